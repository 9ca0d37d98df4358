"""Test kit (a pytest plugin): freshly migrated outbox schemas, each dropped after its test."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline.config import OutboxTable
from outbox_pipeline.store import init_db
from outbox_pipeline.store.wal.objects import drop_slot


@pytest.fixture
def outbox_tables() -> Iterator[Callable[[str], OutboxTable]]:
    """``make(dsn)``: a freshly migrated outbox schema on that server (the fault suite has servers of its own)."""
    made: list[tuple[str, OutboxTable]] = []

    def make(dsn: str) -> OutboxTable:
        table = OutboxTable(schema=f"t_{uuid.uuid4().hex[:12]}")
        with psycopg.connect(dsn, autocommit=True) as conn:
            init_db(conn, table)
        made.append((dsn, table))
        return table

    yield make
    for dsn, table in made:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(table.schema_ident))


@pytest.fixture
def table(dsn: str, outbox_tables: Callable[[str], OutboxTable]) -> OutboxTable:
    """An outbox on the session's server."""
    return outbox_tables(dsn)


@pytest.fixture
def wal_outbox(dsn: str) -> Iterator[OutboxTable]:
    """An outbox made by ``init-db --strategy wal`` on the session's server (its slot dropped after the test), and
    written the wal way (OUTBOX_WRITE_TO=wal)."""
    table = OutboxTable(schema=f"w_{uuid.uuid4().hex[:12]}", write_to="wal")
    with psycopg.connect(dsn, autocommit=True) as conn:
        init_db(conn, table, strategies=["wal"])
    yield table
    with psycopg.connect(dsn, autocommit=True) as conn:
        drop_slot(conn, table)
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(table.schema_ident))
