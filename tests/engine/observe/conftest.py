"""The observe room's tests: a server of a test's own where the session's shared one cannot serve (its slots)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from outbox_pipeline import OutboxTable
from outbox_pipeline.localstack import LocalPostgres
from outbox_pipeline.observe.wal_lag import wal_lag
from tests.kit.probes import wait_until
from tests.kit.servers import server_under_test


@pytest.fixture
def small_slot_server(tmp_path: Path) -> Iterator[LocalPostgres]:
    """A server of this test's own (the session's keeps every test's slot): max_slot_wal_keep_size 1 MB."""
    server = server_under_test(tmp_path / "data", {"fsync": "off", "max_slot_wal_keep_size": "1MB"})
    server.start()
    try:
        yield server
    finally:
        server.stop("immediate", force=True)


def lose_the_slot(conn: psycopg.Connection, table: OutboxTable) -> None:
    """On a small_slot_server: WAL past the slot's segment, then a checkpoint, until PostgreSQL invalidates the slot
    (kept further back than max_slot_wal_keep_size)."""

    def lost() -> bool:
        conn.execute("SELECT pg_logical_emit_message(false, 'filler', repeat('x', 1000000))")
        conn.execute("SELECT pg_switch_wal()")
        conn.execute("CHECKPOINT")
        return wal_lag(conn, table, measure_age=False).slot.wal_status == "lost"

    wait_until("the slot is lost", lost, 30.0, interval_s=0.0)
