"""Test kit: what tests read back from the database to check the relay (positions, unsent rows, dead letters,
what a strategy still has to publish), and polling until a condition holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from psycopg import sql

from outbox_pipeline.config import OutboxTable
from outbox_pipeline.observe import partition_lag


@dataclass(frozen=True)
class Position:
    xid: str
    id: int
    locked_by: str | None

    @property
    def at(self) -> tuple[int, int]:
        """(transaction id, id): what a position is, without who holds it."""
        return int(self.xid), self.id


def positions(db: psycopg.Connection, table: OutboxTable) -> dict[tuple[str, int], Position]:
    """(topic, partition) -> its offsets row."""
    rows = db.execute(
        sql.SQL(
            "SELECT topic, partition, last_processed_transaction_id::text, last_processed_id, locked_by FROM {}"
        ).format(table.offsets)
    ).fetchall()
    return {(topic, part): Position(xid, last_id, owner) for topic, part, xid, last_id, owner in rows}


def unsent_ids(conn: psycopg.Connection, table: OutboxTable) -> set[str]:
    rows = conn.execute(
        sql.SQL("SELECT message_id::text FROM {} WHERE sent_at IS NULL").format(table.messages)
    ).fetchall()
    return {r[0] for r in rows}


def dead_letters(conn: psycopg.Connection, table: OutboxTable) -> dict[str, tuple[int, str]]:
    """message_id -> (attempts, last_error)."""
    rows = conn.execute(
        sql.SQL("SELECT message_id::text, attempts, last_error FROM {}").format(table.dead_letters)
    ).fetchall()
    return {r[0]: (r[1], r[2]) for r in rows}


def wait_until(what: str, condition: Callable[[], bool], deadline_s: float, interval_s: float = 0.05) -> float:
    """Poll ``condition`` until true; fail naming ``what`` after ``deadline_s``. Returns the time it took."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > deadline_s:
            raise AssertionError(f"timed out after {deadline_s:.0f}s waiting for {what}")
        time.sleep(interval_s)
    return time.monotonic() - start


def pending(dsn: str, table: OutboxTable, strategy: str) -> int:
    """Rows the strategy still has to publish (PostgreSQL's view, as `outbox lag` shows it)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return sum(p.pending for p in partition_lag(conn, table, strategy))


def row_positions(db: psycopg.Connection, table: OutboxTable) -> dict[int, tuple[str, int, int]]:
    """outbox id -> (topic, partition, xid) of every row."""
    rows = db.execute(
        sql.SQL("SELECT id, topic, partition, transaction_id::text FROM {}").format(table.messages)
    ).fetchall()
    return {int(oid): (topic, part, int(xid)) for oid, topic, part, xid in rows}


def lease_partition(
    db: psycopg.Connection, table: OutboxTable, worker: str, topic: str = "t", partition: int = 0
) -> None:
    """An offsets row leased to ``worker`` for an hour, as a worker holding the partition leaves it."""
    db.execute(
        sql.SQL(
            "INSERT INTO {} (topic, partition, locked_by, available_after) "
            "VALUES (%s, %s, %s, now() + interval '1 hour')"
        ).format(table.offsets),
        (topic, partition, worker),
    )
