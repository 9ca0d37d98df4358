"""The xmin horizon, named: when `partitioned` cannot read committed rows because an older transaction is still
open (in any database of the server, or prepared and forgotten), the operator is told which one and how to end it."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.cli import main
from outbox_pipeline.localstack import LocalPostgres
from outbox_pipeline.observe import find_horizon


@pytest.fixture
def other_database(pg_server: LocalPostgres, db: psycopg.Connection) -> Iterator[str]:
    name = f"other_{uuid.uuid4().hex[:8]}"
    db.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield name
    db.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def _write(db: psycopg.Connection, table: OutboxTable, n: int) -> None:
    enqueue_many(db, [Message("orders", {"n": i}, key=f"k{i}", partition=0) for i in range(n)], table=table)


def test_nothing_is_held_back_when_no_older_transaction_is_open(db: psycopg.Connection, table: OutboxTable) -> None:
    _write(db, table, 3)

    assert find_horizon(db, table).describe() == []


def test_a_transaction_left_open_in_another_database_is_named_with_the_rows_it_holds_back(
    db: psycopg.Connection, table: OutboxTable, other_database: str, pg_server: LocalPostgres
) -> None:
    with psycopg.connect(pg_server.dsn_for(other_database), application_name="lunch-psql") as lunch:
        lunch.execute("SELECT pg_current_xact_id() AS forgotten_begin")  # a write: the transaction has an xid
        _write(db, table, 3)

        horizon = find_horizon(db, table)

        assert horizon.rows == 3
        [holder] = horizon.holders
        assert (holder.kind, holder.database, holder.application_name, holder.state) == (
            "session",
            other_database,
            "lunch-psql",
            "idle in transaction",
        )
        assert holder.query is None  # SQL text leaves the database only when asked for
        assert "forgotten_begin" in (find_horizon(db, table, show_query=True).holders[0].query or "")
        lines = horizon.describe()
        assert lines[0].startswith("3 committed rows in orders:0 wait for older transactions still open")
        assert f"pid {holder.pid} " in lines[1] and "pg_terminate_backend" in lines[1]


def test_a_forgotten_prepared_transaction_is_named_with_its_gid(
    db: psycopg.Connection, table: OutboxTable, connect: Callable[[], psycopg.Connection]
) -> None:
    gid = f"lunch-{uuid.uuid4().hex[:6]}"
    prepared = connect()
    prepared.execute("BEGIN")
    prepared.execute("SELECT pg_current_xact_id()")
    prepared.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
    try:
        _write(db, table, 2)

        horizon = find_horizon(db, table)

        assert [(h.kind, h.gid) for h in horizon.holders] == [("prepared", gid)]
        assert f"COMMIT PREPARED or ROLLBACK PREPARED '{gid}'" in horizon.describe()[1]
    finally:
        db.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))


def test_outbox_lag_names_the_transaction_holding_the_horizon(
    db: psycopg.Connection,
    table: OutboxTable,
    open_transaction: psycopg.Connection,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _write(db, table, 2)

    assert main(["lag", "--strategy", "partitioned", "--dsn", db.info.dsn, "--schema", table.schema]) == 0

    out = capsys.readouterr().out
    assert "2 committed rows in orders:0 wait for older transactions still open" in out
    assert f"pid {open_transaction.info.backend_pid} " in out


@pytest.fixture
def password_left_open(db: psycopg.Connection, connect: Callable[[], psycopg.Connection]) -> Iterator[tuple[int, str]]:
    """A DBA's session left open after ``ALTER ROLE ... PASSWORD``: (its pid, the password)."""
    role, secret = f"r_{uuid.uuid4().hex[:8]}", f"pw-{uuid.uuid4().hex}"
    db.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
    dba = connect()
    dba.execute("BEGIN")
    dba.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(role), sql.Literal(secret)))
    yield dba.info.backend_pid, secret
    dba.execute("ROLLBACK")
    db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_no_sql_text_leaves_the_database_in_the_status_or_the_lag_report_unless_asked_for(
    db: psycopg.Connection,
    table: OutboxTable,
    password_left_open: tuple[int, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    pid, secret = password_left_open
    _write(db, table, 2)
    where = ["--strategy", "partitioned", "--dsn", db.info.dsn, "--schema", table.schema]

    printed = {}
    for command in (["status"], ["status", "--json"], ["lag"], ["lag", "--json"], ["status", "--show-query"]):
        assert main([*command, *where]) == 0
        printed[" ".join(command)] = capsys.readouterr().out

    asked = printed.pop("status --show-query")
    assert [command for command, out in printed.items() if secret in out] == []
    assert all(f"pid {pid} " in printed[command] for command in ("status", "status --json", "lag"))
    assert secret in asked and "ALTER ROLE" in asked


def test_a_transaction_that_got_its_xid_after_the_snapshot_is_not_blamed(
    db: psycopg.Connection,
    table: OutboxTable,
    open_transaction: psycopg.Connection,
    connect: Callable[[], psycopg.Connection],
) -> None:
    """The holders' 32-bit xids were widened against a snapshot older than pg_stat_activity's view: one assigned
    in between landed in the previous epoch, sorted first and was named as the blocker. Here the report runs in
    a REPEATABLE READ transaction, which keeps its snapshot while a younger transaction gets its xid."""
    _write(db, table, 2)
    reporter = connect()
    reporter.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    reporter.execute("SELECT 1")  # the snapshot is taken
    db.execute("SELECT pg_current_xact_id()")  # an xid used up: the younger one is past the snapshot's xmax
    younger = connect()
    younger.execute("BEGIN")
    younger.execute("SELECT pg_current_xact_id()")

    horizon = find_horizon(reporter, table)
    reporter.execute("COMMIT")
    younger.execute("ROLLBACK")

    assert horizon.rows == 2
    assert [h.pid for h in horizon.holders] == [open_transaction.info.backend_pid]
