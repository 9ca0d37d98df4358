"""Your PostgreSQL (server.py): the versions the outbox runs on, and no statement of the engine's is JIT-compiled,
whatever the server's ``jit``.

The compile test needs a build with LLVM: `make test` runs this module on Debian's PostgreSQL 15 too
(OUTBOX_TEST_PG_BIN=/usr/lib/postgresql/15/bin). The embedded wheel's 18 is built without it; there that test is
skipped with the reason, and the others run.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from outbox_pipeline import Message, OutboxTable, enqueue_many, server
from outbox_pipeline.cli import main
from outbox_pipeline.drain import RangeReport, commit_drain, drain_owner, fetch_range, plan_drain, publish_range
from outbox_pipeline.localstack import LocalBroker, LocalPostgres
from outbox_pipeline.operate import check_relayed, create_ahead, day_partitions, move_default_rows
from outbox_pipeline.relay import KafkaPublisher
from outbox_pipeline.store import set_topic_partitions
from outbox_pipeline.strategies import StrategyConfig, strategy_class
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain, message_ids
from tests.kit.servers import server_under_test

STRATEGIES = ["locking", "advisory", "lease", "partitioned", "serialized"]


@pytest.fixture(scope="module")
def compiling_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    """A server that JIT-compiles every statement a session lets it (jit_above_cost = 0) and counts what it compiled."""
    pg = server_under_test(
        tmp_path_factory.mktemp("jit_pg") / "data",
        {
            "fsync": "off",
            "synchronous_commit": "off",
            "jit_above_cost": "0",
            "shared_preload_libraries": "pg_stat_statements",
        },  # fmt: skip
    )
    pg.start()
    try:
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            row = conn.execute("SELECT pg_jit_available()").fetchone()
            if not (row and row[0]):
                pytest.skip(
                    f"PostgreSQL {conn.info.server_version} here has no JIT (the embedded wheel's is built without "
                    "LLVM): run with OUTBOX_TEST_PG_BIN=/usr/lib/postgresql/15/bin, as make test does"
                )
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        yield pg
    finally:
        pg.stop("fast", force=True)


def _compiled(dsn: str) -> list[tuple[str, int]]:
    """Statements the server JIT-compiled since the last reset (this reading session compiles nothing)."""
    with psycopg.connect(dsn, autocommit=True, options="-c jit=off") as conn:
        rows = conn.execute(
            "SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 120), jit_functions FROM pg_stat_statements "
            "WHERE jit_functions > 0 ORDER BY jit_functions DESC"
        ).fetchall()
    return [(str(query), int(functions)) for query, functions in rows]


def _reset_statements(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True, options="-c jit=off") as conn:
        conn.execute("SELECT pg_stat_statements_reset()")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_relay_on_a_server_that_would_jit_every_statement_compiles_none_and_delivers_everything(
    strategy: str,
    compiling_pg: LocalPostgres,
    outbox_tables: Callable[[str], OutboxTable],
    broker: LocalBroker,
    new_topic: Callable[..., str],
    kafka: KafkaProbe,
) -> None:
    table = outbox_tables(compiling_pg.dsn)
    topic = new_topic("jit", partitions=2)
    with psycopg.connect(compiling_pg.dsn, options="-c jit=off") as conn, conn.transaction():
        enqueue_many(conn, [Message(topic, {"n": i}, key=f"k{i % 7}") for i in range(400)], table=table)
    _reset_statements(compiling_pg.dsn)

    drain(compiling_pg.dsn, table, broker.bootstrap_servers, strategy, batch_size=50)

    assert len(kafka.consume(topic, expect=400)) == 400
    assert _compiled(compiling_pg.dsn) == []


def test_status_and_lag_on_a_server_that_would_jit_every_statement_compile_none(
    compiling_pg: LocalPostgres,
    outbox_tables: Callable[[str], OutboxTable],
    capsys: pytest.CaptureFixture[str],
) -> None:
    table = outbox_tables(compiling_pg.dsn)
    with psycopg.connect(compiling_pg.dsn, options="-c jit=off") as conn, conn.transaction():
        enqueue_many(conn, [Message("orders", {"n": i}, key=f"k{i}") for i in range(50)], table=table)
    _reset_statements(compiling_pg.dsn)

    for command in ("status", "lag"):
        assert main([command, "--dsn", compiling_pg.dsn, "--schema", table.schema, "--strategy", "partitioned"]) == 0
    assert "50" in capsys.readouterr().out
    assert _compiled(compiling_pg.dsn) == []


def _jit(conn: psycopg.Connection) -> str:
    row = conn.execute("SHOW jit").fetchone()
    assert row is not None
    return str(row[0])


def test_every_engine_session_runs_with_jit_off_whatever_the_server_default(dsn: str) -> None:
    with server.connect(dsn, autocommit=True) as conn:
        assert _jit(conn) == "off"
    with server.connect(dsn) as conn:  # not autocommit: a rollback must not undo it
        conn.execute("SELECT 1")
        conn.rollback()
        assert _jit(conn) == "off"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_strategy_session_runs_with_jit_off_even_on_a_connection_the_caller_opened(
    strategy: str, dsn: str, table: OutboxTable
) -> None:
    with psycopg.connect(dsn, autocommit=True, options="-c jit=on") as conn:
        strategy_class(strategy)(conn, StrategyConfig(table=table, worker_id=f"jit-{strategy}"))
        assert _jit(conn) == "off"


def test_the_server_under_test_is_supported(db: psycopg.Connection) -> None:
    server.require_supported(db)
    assert db.info.server_version >= server.MIN_SERVER_VERSION


@pytest.mark.parametrize(
    ("version", "named"), [(120022, "PostgreSQL 12 is not supported"), (90624, "PostgreSQL 9.6 is not supported")]
)
def test_a_server_older_than_13_is_refused_with_what_it_lacks_and_what_to_do(version: int, named: str) -> None:
    refusal = server.version_refusal(version)
    assert refusal is not None
    assert named in refusal
    assert "13 or newer" in refusal and "xid8" in refusal and "upgrade the server" in refusal


@pytest.mark.parametrize("version", [130000, 150020, 180001])
def test_servers_from_13_on_are_accepted(version: int) -> None:
    assert server.version_refusal(version) is None


def test_an_engine_session_outlives_an_idle_session_timeout_the_dba_set(dsn: str, db: psycopg.Connection) -> None:
    """A relay's sessions idle between wake-ups by design; a role or server default must not end them."""
    if db.info.server_version < 140000:
        pytest.skip("idle_session_timeout is new in PostgreSQL 14")
    with server.connect(dsn, autocommit=True, options="-c idle_session_timeout=200") as conn:
        pid = conn.info.backend_pid
        waited = db.execute(
            "SELECT count(*) FROM generate_series(1, 10) WHERE pg_sleep(0.05) IS NOT NULL"
        ).fetchone()  # 0.5 s, past the 0.2 s timeout, while ``conn`` idles
        assert waited == (10,)
        assert conn.execute("SELECT pg_backend_pid()").fetchone() == (pid,)


def test_a_relay_without_superuser_sets_its_session_settings_and_delivers_everything(
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    """A managed service gives no superuser: every setting an engine session sets is one any role may set."""
    role = f"relay_{uuid.uuid4().hex[:8]}"
    db.execute(sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER").format(sql.Identifier(role)))
    try:
        for grant in (
            "GRANT USAGE ON SCHEMA {schema} TO {role}",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role}",
            "GRANT USAGE ON ALL SEQUENCES IN SCHEMA {schema} TO {role}",
        ):
            db.execute(sql.SQL(grant).format(schema=table.schema_ident, role=sql.Identifier(role)))
        topic = new_topic("role")
        enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i % 3}") for i in range(30)], table=table)
        as_role = make_conninfo(dsn, user=role)
        with server.connect(as_role, autocommit=True) as conn:
            assert (
                _jit(conn),
                conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone(),
            ) == (
                "off",
                (False,),
            )

        drain(as_role, table, kafka.bootstrap_servers, "partitioned")

        assert len(set(message_ids(kafka.consume(topic, expect=30)))) == 30
    finally:
        db.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_a_bulk_drain_and_partition_maintenance_on_a_server_that_would_jit_every_statement_compile_none(
    compiling_pg: LocalPostgres,
    outbox_tables: Callable[[str], OutboxTable],
    new_topic: Callable[..., str],
    kafka: KafkaProbe,
) -> None:
    """What the Spark drain's tasks and the maintenance asset run, through the sessions they open (server.connect)."""
    table = outbox_tables(compiling_pg.dsn)
    topic = new_topic("drain", partitions=2)
    with psycopg.connect(compiling_pg.dsn, options="-c jit=off") as conn, conn.transaction():
        set_topic_partitions(conn, table, topic, 2)
        enqueue_many(conn, [Message(topic, {"n": i}, key=f"k{i % 7}") for i in range(300)], table=table)
    _reset_statements(compiling_pg.dsn)

    with server.connect(compiling_pg.dsn, autocommit=True) as conn:
        plan = plan_drain(conn, table, strategy="partitioned", owner=drain_owner("jit"))
        publisher = KafkaPublisher({"bootstrap.servers": kafka.bootstrap_servers})
        reports = [
            RangeReport(r.label, publish_range(publisher, "partitioned", fetch_range(conn, plan, r)))
            for r in plan.ranges
        ]
        publisher.close()
        commit_drain(conn, plan, reports)
        today = dt.datetime.now(dt.UTC).date()
        create_ahead(conn, table, today=today, days_ahead=3)
        move_default_rows(conn, table)
        for day in day_partitions(conn, table):
            check_relayed(conn, table, day.name, "partitioned")

    assert len(set(message_ids(kafka.consume(topic, expect=300)))) == 300
    assert _compiled(compiling_pg.dsn) == []
