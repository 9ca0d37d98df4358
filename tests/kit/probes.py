"""What every kind of test reads back from the database to check the relay: each partition's stored position."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from outbox_pipeline.config import OutboxTable


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
