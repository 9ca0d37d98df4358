"""Schema: versioned, idempotent migrations and daily partitions created ahead."""

from __future__ import annotations

import datetime as dt
import re
import threading
import uuid
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from outbox_pipeline.cli import main
from outbox_pipeline.config import OutboxTable
from outbox_pipeline.errors import SchemaError
from outbox_pipeline.store import (
    LATEST_VERSION,
    MIGRATIONS,
    TOPIC_CHECK_PATTERN,
    current_version,
    init_db,
    partition_name,
    require_current,
    schema,
)


def _write_rows_as_plain_sql(conn: psycopg.Connection, table: OutboxTable, count: int) -> None:
    """Rows as any writer of an older schema wrote them (the Python API writes the newest columns)."""
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (topic, key, payload) SELECT 'orders', 'k' || n, jsonb_build_object('n', n) "
            "FROM generate_series(0, %s - 1) n"
        ).format(table.messages),
        (count,),
    )


def _partitions(conn: psycopg.Connection, table: OutboxTable) -> set[str]:
    rows = conn.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = %s::regclass",
        (table.messages.as_string(conn),),
    ).fetchall()
    return {r[0] for r in rows}


def test_init_db_twice_applies_nothing_the_second_time(db: psycopg.Connection, table: OutboxTable) -> None:
    assert init_db(db, table) == []
    assert current_version(db, table) == LATEST_VERSION


def test_init_db_works_on_a_connection_whose_rows_are_dicts_and_leaves_it_so(dsn: str) -> None:
    table = OutboxTable(schema=f"dicts_{uuid.uuid4().hex[:8]}")
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        applied = init_db(conn, table, strategies=["partitioned"])  # type: ignore[arg-type]  # hinted for tuple rows
        assert conn.execute("SELECT 1 AS one").fetchone() == {"one": 1}
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert current_version(conn, table) == LATEST_VERSION
    assert [m.version for m in applied] == [m.version for m in MIGRATIONS]


def test_migrations_are_recorded_with_their_names(db: psycopg.Connection, table: OutboxTable) -> None:
    rows = db.execute(sql.SQL("SELECT version, name FROM {}").format(table.migrations)).fetchall()
    assert [v for v, _ in rows] == list(range(1, LATEST_VERSION + 1))
    assert all(name for _, name in rows)


def test_concurrent_init_db_on_a_new_schema_succeeds_once(dsn: str) -> None:
    table = OutboxTable(schema=f"c_{uuid.uuid4().hex[:10]}")
    results: list[object] = []

    def migrate() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                results.append(len(init_db(conn, table)))
        except Exception as exc:  # recorded, asserted below
            results.append(exc)

    threads = [threading.Thread(target=migrate) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Each migration is applied once, by whichever caller holds the lock when it is due (callers may take
    # turns between migrations); nobody fails.
    assert all(isinstance(n, int) for n in results), results
    assert sum(results) == LATEST_VERSION  # type: ignore[arg-type]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(table.schema_ident))


def test_daily_partitions_exist_from_yesterday_to_days_ahead(db: psycopg.Connection, table: OutboxTable) -> None:
    today = dt.datetime.now(dt.UTC).date()
    names = _partitions(db, table)
    expected = {partition_name(today + dt.timedelta(days=d)) for d in range(-1, 8)}
    assert expected <= names
    assert "outbox_messages_default" in names


def test_a_row_for_a_day_without_partition_lands_in_the_default_partition(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    far = dt.datetime(2099, 1, 1, tzinfo=dt.UTC)
    db.execute(
        sql.SQL("INSERT INTO {} (topic, payload, created_at) VALUES ('t', '{{}}', %s)").format(table.messages), (far,)
    )
    row = db.execute(sql.SQL("SELECT count(*) FROM {}").format(table.ident("outbox_messages_default"))).fetchone()
    assert row == (1,)


def test_a_hostile_schema_name_is_only_ever_an_identifier(dsn: str) -> None:
    hostile = OutboxTable(schema='x"; DROP TABLE pg_class; --')
    with psycopg.connect(dsn, autocommit=True) as conn:
        init_db(conn, hostile)
        assert current_version(conn, hostile) == LATEST_VERSION
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(hostile.schema_ident))
        assert conn.execute("SELECT count(*) > 0 FROM pg_class").fetchone() == (True,)


def test_the_table_rejects_an_invalid_topic_even_from_raw_sql(db: psycopg.Connection, table: OutboxTable) -> None:
    try:
        db.execute(sql.SQL("INSERT INTO {} (topic, payload) VALUES ('no spaces', '1')").format(table.messages))
    except psycopg.errors.CheckViolation:
        return
    raise AssertionError("an invalid topic name was stored")


@pytest.mark.parametrize(
    ("topic", "stored"),
    [("a" * 249, True), ("a" * 250, False), (".", False), ("..", False), ("a.b_c-D9", True), ("é", False)],
)
def test_the_table_stores_exactly_the_topic_names_kafka_accepts(
    topic: str, stored: bool, db: psycopg.Connection, table: OutboxTable
) -> None:
    insert = sql.SQL("INSERT INTO {} (topic, payload, partition) VALUES (%s, '1', 0)").format(table.messages)
    try:
        with db.transaction():
            db.execute(insert, (topic,))
    except psycopg.errors.CheckViolation as exc:
        assert not stored and "outbox_messages_topic_valid" in str(exc)
        return
    assert stored, f"{topic!r} was stored"


@pytest.mark.parametrize(("topic", "accepted"), [("a" * 249, True), ("a" * 250, False), ("..", False)])
def test_sql_enqueue_accepts_exactly_the_topic_names_kafka_accepts(
    topic: str, accepted: bool, db: psycopg.Connection, table: OutboxTable
) -> None:
    call = sql.SQL("SELECT id FROM {}(%s, '1')").format(table.ident("enqueue"))
    try:
        with db.transaction():
            db.execute(call, (topic,))
    except psycopg.errors.InvalidParameterValue as exc:
        assert not accepted and "invalid Kafka topic name" in str(exc)
        return
    assert accepted, f"{topic!r} was enqueued"


def test_an_outbox_with_rows_migrates_to_the_cheap_topic_check_keeping_every_row(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = OutboxTable(schema=f"migrate_{uuid.uuid4().hex[:8]}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        monkeypatch.setattr(schema, "MIGRATIONS", MIGRATIONS[:9])
        init_db(conn, table)
        _write_rows_as_plain_sql(conn, table, 500)
        monkeypatch.undo()

        applied = init_db(conn, table)

        assert [m.version for m in applied] == list(range(10, LATEST_VERSION + 1))
        rows = conn.execute(sql.SQL("SELECT count(*), min(topic), max(topic) FROM {}").format(table.messages))
        assert rows.fetchone() == (500, "orders", "orders")
        check = conn.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'outbox_messages_topic_valid' "
            "AND conrelid = %s::regclass",
            (table.messages.as_string(conn),),
        ).fetchone()
        assert check is not None and TOPIC_CHECK_PATTERN in check[0] and "249" in check[0]
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(sql.SQL("INSERT INTO {} (topic, payload) VALUES ('no spaces', '1')").format(table.messages))
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(table.schema_ident))


def test_a_relay_and_the_commands_refuse_a_schema_newer_than_this_code_knows(
    db: psycopg.Connection, table: OutboxTable, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 40, case 4: only an older schema was refused; a relay of the release before bytes payloads published a
    bytes row as a null value (a tombstone) and acked it."""
    db.execute(
        sql.SQL("INSERT INTO {} (version, name) VALUES (%s, 'from a newer release')").format(table.migrations),
        (LATEST_VERSION + 1,),
    )
    newer = f"is at version {LATEST_VERSION + 1}, newer than this code knows ({LATEST_VERSION})"
    with pytest.raises(SchemaError, match=re.escape(newer)):
        require_current(db, table)
    where = ["--dsn", db.info.dsn, "--schema", table.schema]
    relay = ["relay", "--strategy", "partitioned", "--until-empty", "--bootstrap-servers", "127.0.0.1:1", *where]
    for command in (relay, ["lag", "--strategy", "partitioned", *where]):
        assert main(command) == 2
        assert newer in capsys.readouterr().err


def test_a_migration_that_cannot_get_its_lock_gives_up_applies_nothing_and_succeeds_when_run_again(
    dsn: str, connect: Callable[[], psycopg.Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40, case 26: migrations' DDL waited for its lock without a bound, and every writer queued behind it."""
    table = OutboxTable(schema=f"locked_{uuid.uuid4().hex[:8]}")
    locking = 12  # adds a CHECK to the live table (later ones may replace functions only, which locks no table)
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            monkeypatch.setattr(schema, "MIGRATIONS", MIGRATIONS[: locking - 1])
            init_db(conn, table)
            monkeypatch.setattr(schema, "MIGRATIONS", MIGRATIONS[:locking])
            monkeypatch.setattr(schema, "MIGRATION_LOCK_TIMEOUT", "200ms")
            reader = connect()
            reader.execute("BEGIN")
            reader.execute(sql.SQL("SELECT count(*) FROM {}").format(table.messages))  # held until its commit

            try:
                with pytest.raises(SchemaError, match=f"migration {locking} .* did not get its lock .* within 200ms"):
                    init_db(conn, table)
                assert current_version(conn, table) == locking - 1
            finally:
                reader.execute("COMMIT")
            assert [m.version for m in init_db(conn, table)] == [locking]
        finally:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(table.schema_ident))
