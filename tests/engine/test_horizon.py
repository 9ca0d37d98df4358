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
from outbox_pipeline.horizon import find_horizon
from outbox_pipeline.localstack import LocalPostgres


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
        assert "forgotten_begin" in (holder.query or "")
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
