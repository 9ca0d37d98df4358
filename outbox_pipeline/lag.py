"""Engine room: how far behind the relay is, per topic and virtual partition, in one query."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import psycopg
from psycopg import sql

from .config import OutboxTable


@dataclass(frozen=True)
class PartitionLag:
    topic: str
    partition: int
    pending: int
    oldest_pending_age_s: float | None
    max_id: int


def pending_by_partition(conn: psycopg.Connection, table: OutboxTable) -> list[PartitionLag]:
    """Unsent rows per partition for the row-claiming strategies (sent rows are deleted or marked)."""
    rows = conn.execute(
        sql.SQL(
            """
            SELECT topic, partition, count(*), extract(epoch FROM now() - min(created_at)), max(id)
            FROM {messages}
            WHERE sent_at IS NULL
            GROUP BY topic, partition
            ORDER BY topic, partition
            """
        ).format(messages=table.messages)
    ).fetchall()
    return [PartitionLag(t, p, int(n), float(age) if age is not None else None, int(m)) for t, p, n, age, m in rows]


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)
