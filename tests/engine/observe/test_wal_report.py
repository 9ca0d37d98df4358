"""What a wal outbox reports and refuses (issue 50): rows its message table would keep where no relay reads them,
a slot near or past ``max_slot_wal_keep_size``, held messages, a relay role without REPLICATION; and its slot made for
failover on PostgreSQL 17+."""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.types.json import Jsonb

from outbox_pipeline import Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.cli import main
from outbox_pipeline.localstack import LocalPostgres
from outbox_pipeline.observe import LagThresholds, evaluate_wal_lag
from outbox_pipeline.observe.wal_lag import WalLag, wal_lag
from outbox_pipeline.relay.wal.stream import ReplicationStream, ReplicationStreamError
from outbox_pipeline.store import init_db
from outbox_pipeline.store.wal.objects import names_of
from outbox_pipeline.store.wal.slot import SlotState
from tests.engine.observe.conftest import lose_the_slot
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import wait_until
from tests.kit.relay import make_wal_relay

REFUSAL = "outbox_wal_rows_go_to_the_stream"
SMALL = {"message.max.bytes": 2000}  # a 5,000-byte message is one Kafka will never take


def _insert(conn: psycopg.Connection, table: OutboxTable, topic: str, n: int) -> None:
    """A plain INSERT, as a Java or psql writer's."""
    conn.execute(
        sql.SQL("INSERT INTO {} (topic, key, payload) VALUES (%s, 'k', %s)").format(table.messages),
        (topic, Jsonb({"n": n})),
    )


def _insert_as_replica(conn: psycopg.Connection, table: OutboxTable, topic: str, n: int) -> None:
    """A whole row (its partition too), as logical replication's apply or a restore with triggers disabled writes it:
    no trigger fires."""
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")
        conn.execute(
            sql.SQL("INSERT INTO {} (topic, key, payload, partition) VALUES (%s, 'k', %s, 0)").format(table.messages),
            (topic, Jsonb({"n": n})),
        )


def _stored(conn: psycopg.Connection, table: OutboxTable) -> int:
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table.messages)).fetchone()
    assert row is not None
    return int(row[0])


def test_a_row_written_with_triggers_off_for_replication_is_refused_not_stored(
    db: psycopg.Connection, wal_outbox: OutboxTable
) -> None:
    with pytest.raises(psycopg.errors.CheckViolation, match=REFUSAL):
        _insert_as_replica(db, wal_outbox, "orders", 1)

    assert _stored(db, wal_outbox) == 0


def test_a_plain_insert_still_goes_through_the_trigger_into_the_stream(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("wal")
    _insert(db, wal_outbox, topic, 1)

    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    assert [r.value for r in kafka.consume(topic)] == [b'{"n": 1}'] and _stored(db, wal_outbox) == 0


def test_rows_an_older_wal_outbox_stored_are_reported_by_init_db_and_status_and_the_advice_relays_them(
    db: psycopg.Connection,
    wal_outbox: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = new_topic("wal")
    # An outbox made before its table refused rows, written by a replica-role session: rows no relay reads.
    db.execute(
        sql.SQL("ALTER TABLE {} DROP CONSTRAINT IF EXISTS {}").format(wal_outbox.messages, sql.Identifier(REFUSAL))
    )
    for n in (1, 2):
        _insert_as_replica(db, wal_outbox, topic, n)

    assert main(["init-db", "--strategy", "wal", "--dsn", db.info.dsn, "--schema", wal_outbox.schema]) == 0
    assert "2 rows stored in" in capsys.readouterr().out
    with pytest.raises(psycopg.errors.CheckViolation, match=REFUSAL):
        _insert_as_replica(db, wal_outbox, topic, 3)  # init-db made the table refuse them from now on
    assert main(["status", "--dsn", db.info.dsn, "--schema", wal_outbox.schema]) == 0
    out = capsys.readouterr().out
    assert "2 rows stored in" in out and "lag objective: ERROR" in out

    advice = re.search(r"in one transaction: (BEGIN;.*COMMIT;)", out)
    assert advice is not None
    db.execute(advice.group(1))
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    assert [r.value for r in kafka.consume(topic)] == [b'{"n": 1}', b'{"n": 2}'] and _stored(db, wal_outbox) == 0
    assert main(["status", "--dsn", db.info.dsn, "--schema", wal_outbox.schema]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "lag objective: OK"


def test_the_slot_is_made_to_follow_a_failover_on_postgresql_17_and_later(
    db: psycopg.Connection, wal_outbox: OutboxTable
) -> None:
    if db.info.server_version < 170000:
        pytest.skip("failover slots came with PostgreSQL 17")
    row = db.execute(
        "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (names_of(wal_outbox).slot,)
    ).fetchone()

    assert row == (True,)


def _near_the_limit(safe_wal_size: int, limit: int) -> WalLag:
    slot = SlotState("outbox_x", True, None, "extended", limit - safe_wal_size, 0, safe_wal_size, limit)
    return WalLag(slot, 0.0, "caught up", None)


def test_a_slot_past_the_warn_fraction_of_max_slot_wal_keep_size_warns_before_it_is_lost() -> None:
    limit = 1 << 30
    thresholds = LagThresholds(warn_keep_fraction=0.5)

    below = evaluate_wal_lag(_near_the_limit(limit // 2 + 1, limit), thresholds)
    above = evaluate_wal_lag(_near_the_limit(int(limit * 0.14), limit), thresholds)  # 86 % kept: the review's figure

    assert below.severity == "ok"
    assert above.severity == "warn" and "86 % of max_slot_wal_keep_size" in above.reasons[0]


def test_the_limit_is_read_with_the_slot_and_a_lost_slot_refuses_every_writer_form(
    small_slot_server: LocalPostgres,
) -> None:
    table = OutboxTable(schema="lost_slot", write_to="wal")
    with psycopg.connect(small_slot_server.dsn, autocommit=True) as conn:
        init_db(conn, table, strategies=["wal"])
        assert wal_lag(conn, table, measure_age=False).slot.keep_limit_bytes == 1 << 20
        lose_the_slot(conn, table)
        refused = []
        writers = (
            lambda: enqueue(conn, "orders", {"n": 1}, key="k", table=table),
            lambda: enqueue_many(conn, [Message("orders", {"n": 1}, key="k")] * 2, table=table),
            lambda: conn.execute("SELECT * FROM lost_slot.enqueue('orders', '{}')"),
            lambda: _insert(conn, table, "orders", 1),
        )
        for write in writers:
            with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState) as caught:
                write()
            refused.append(str(caught.value))

    assert all("is lost (wal_status = 'lost')" in why and "pg_drop_replication_slot" in why for why in refused)


def test_held_messages_are_counted_per_key_with_their_age_in_status_and_the_objective(
    db: psycopg.Connection,
    wal_outbox: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = new_topic("wal")
    with db.transaction():
        for payload in ({"pad": "x" * 5000}, {"n": 2}, {"n": 3}):
            enqueue(db, topic, payload, key="b", table=wal_outbox)
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, producer=SMALL).run()
    monkeypatch.setenv("OUTBOX_LAG_WARN_PENDING", "1")

    lag = wal_lag(db, wal_outbox)
    assert main(["status", "--dsn", db.info.dsn, "--schema", wal_outbox.schema]) == 0
    out = capsys.readouterr().out

    assert [(k.topic, k.key, k.rows) for k in lag.held] == [(topic, "b", 2)]
    assert lag.held[0].oldest_age_s is not None and lag.held[0].oldest_age_s > 0
    assert f"key 'b' of {topic}" in out and "2 rows" in out
    assert "lag objective: WARN: 2 held messages > warn 1" in out


def test_a_relay_whose_role_lacks_replication_says_so_and_stops_and_status_is_not_ok(
    db: psycopg.Connection, dsn: str, wal_outbox: OutboxTable, kafka: KafkaProbe, capsys: pytest.CaptureFixture[str]
) -> None:
    role = f"norepl_{uuid.uuid4().hex[:8]}"
    db.execute(sql.SQL("CREATE ROLE {} LOGIN NOREPLICATION NOSUPERUSER").format(sql.Identifier(role)))
    db.execute(
        sql.SQL("GRANT USAGE ON SCHEMA {s} TO {r}; GRANT ALL ON ALL TABLES IN SCHEMA {s} TO {r}").format(
            s=wal_outbox.schema_ident, r=sql.Identifier(role)
        )
    )
    as_role = make_conninfo(dsn, user=role)
    stop = threading.Event()
    relay = make_wal_relay(as_role, wal_outbox, kafka.bootstrap_servers, stop=stop, until_idle=False, max_seconds=5)

    with pytest.raises(ReplicationStreamError, match=f"role {role!r} has no REPLICATION attribute") as caught:
        relay.run()
    assert main(["status", "--dsn", as_role, "--schema", wal_outbox.schema]) == 0
    out = capsys.readouterr().out

    assert f"ALTER ROLE {role} REPLICATION" in str(caught.value)
    assert "lag objective: WARN" in out and f"role {role!r} has no REPLICATION attribute" in out


def test_the_spill_files_of_a_large_transaction_being_decoded_count_as_what_the_slot_keeps_on_disk(
    db: psycopg.Connection, connect: Callable[[], psycopg.Connection], wal_outbox: OutboxTable
) -> None:
    """A transaction larger than logical_decoding_work_mem is spilled to pg_replslot/<slot>/ while it is decoded:
    disk the slot takes beside the WAL it retains (issue 50: not counted in retained bytes)."""
    names = names_of(wal_outbox)
    stream_dsn = make_conninfo(db.info.dsn, options="-c logical_decoding_work_mem=64kB")
    writer = connect()
    with ReplicationStream.open(stream_dsn, names.slot, names.publication) as stream, writer.transaction():
        enqueue_many(writer, [Message("t", {"pad": "x" * 1000}, key=f"k{n}") for n in range(500)], table=wal_outbox)
        writer.execute("SELECT pg_switch_wal()")  # flushed: the walsender decodes what the open transaction wrote
        wait_until("the walsender spills", lambda: (wal_lag(db, wal_outbox).slot.spill_bytes or 0) > 0, 30.0)
        stream.read(0.0)
        lag = wal_lag(db, wal_outbox)

    assert lag.slot.spill_bytes is not None and lag.slot.spill_bytes > 64 * 1024
    assert "in spill files" in lag.describe()
    thresholds = LagThresholds(warn_retained_bytes=(lag.slot.retained_bytes or 0) + 1)
    assert "spill" in " ".join(evaluate_wal_lag(lag, thresholds).reasons)
