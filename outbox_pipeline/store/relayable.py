"""What a relay, a drain or the lag sensor checks before reading the outbox as a strategy: the recorded strategy, its
indexes, and positions in its own order. See docs/operations.md#the-outboxs-strategy-and-switching-it."""

from __future__ import annotations

from collections.abc import Sequence

import psycopg
from psycopg import sql

from ..config import OutboxTable
from ..errors import OutboxError
from ..model import POSITION_STRATEGIES
from . import strategy_record
from .indexes import require_indexes


def keeps_positions(strategy: str) -> bool:
    """Whether ``strategy`` keeps positions (partitioned, serialized) rather than marking rows."""
    return strategy in POSITION_STRATEGIES


def other_orders(
    conn: psycopg.Connection, table: OutboxTable, strategy: str, topics: Sequence[str] | None = None
) -> list[tuple[str, int, str]]:
    """Up to three partitions whose position another strategy advanced: (topic, partition, read_by)."""
    rows = conn.execute(
        sql.SQL(
            """
            SELECT topic, partition, read_by FROM {offsets}
            WHERE read_by IS NOT NULL AND read_by <> %(strategy)s
              AND (%(topics)s::text[] IS NULL OR topic = ANY(%(topics)s::text[]))
            ORDER BY topic, partition LIMIT 3
            """
        ).format(offsets=table.offsets),
        {"strategy": strategy, "topics": list(topics) if topics else None},
    ).fetchall()
    return [(topic, int(partition), read_by) for topic, partition, read_by in rows]


def require_relayable(conn: psycopg.Connection, table: OutboxTable, strategy: str | None) -> str:
    """What a relay checks before it claims, and the strategy it is to run: the outbox's recorded one (``strategy``,
    when named, must be it; with none recorded it is recorded now: strategy_record.py), its indexes, and positions
    in its own order."""
    strategy = strategy_record.claim(conn, table, strategy)
    require_indexes(conn, table, strategy)
    require_own_positions(conn, table, strategy)
    return strategy


def require_own_positions(conn: psycopg.Connection, table: OutboxTable, strategy: str) -> None:
    """A position strategy refuses positions in the other one's order (reading past them skips rows)."""
    if not keeps_positions(strategy) or not (rows := other_orders(conn, table, strategy)):
        return
    named = ", ".join(f"{topic}/{partition} ({read_by})" for topic, partition, read_by in rows)
    raise OutboxError(
        f"the outbox {table.schema!r} was relayed by another strategy ({named}), whose positions {strategy} would "
        f"read past unrelayed rows: stop its relays and run `outbox switch-strategy --to {strategy}` first"
    )
