"""Switching a live outbox from one relay strategy to another without losing or reordering a row, by translating what
the old strategy recorded as relayed. See docs/operations.md#the-outboxs-strategy-and-switching-it."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..config import OutboxTable
from ..errors import OutboxError
from ..model import WAL
from ..observe.liveness import live_workers
from ..store import strategy_record
from ..store.indexes import require_indexes
from ..store.partition_counts import BEHIND_POSITION
from ..store.relayable import keeps_positions
from ..strategies.base import AckMode
from ..strategies.positions import partition_pairs


@dataclass(frozen=True)
class Switched:
    strategy: str
    partitions: int  # positions set (position strategies)
    rows: int  # rows deleted or marked sent (row strategies)


# The first row of each partition not relayed, in the new strategy's order, and the partition's last row.
_POSITIONS = """
    WITH RECURSIVE {pairs},
    found AS (
        SELECT p.topic, p.partition, first.xid AS first_xid, first.id AS first_id, last.xid AS last_xid,
               last.id AS last_id
        FROM pairs p
        LEFT JOIN {offsets} o ON o.topic = p.topic AND o.partition = p.partition
        LEFT JOIN LATERAL (
            SELECT m.transaction_id AS xid, m.id FROM {messages} m
            WHERE m.topic = p.topic AND m.partition = p.partition AND m.sent_at IS NULL AND NOT {behind}
            ORDER BY {order} LIMIT 1
        ) first ON true
        LEFT JOIN LATERAL (
            SELECT m.transaction_id AS xid, m.id FROM {messages} m
            WHERE m.topic = p.topic AND m.partition = p.partition
            ORDER BY {order_desc} LIMIT 1
        ) last ON true
    ),
    positions AS (
        SELECT topic, partition,
               CASE WHEN first_id IS NULL THEN last_xid ELSE first_xid END AS xid,
               CASE WHEN first_id IS NULL THEN last_id ELSE first_id - 1 END AS id
        FROM found
    ),
    horizon AS (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin)
    INSERT INTO {offsets} AS o (topic, partition, last_processed_transaction_id, last_processed_id, read_by)
    SELECT p.topic, p.partition,
           CASE WHEN %(strategy)s = 'partitioned' AND (p.xid, p.id) > (h.xmin, 0) THEN h.xmin ELSE p.xid END,
           CASE WHEN %(strategy)s = 'partitioned' AND (p.xid, p.id) > (h.xmin, 0) THEN 0 ELSE p.id END,
           %(strategy)s
    FROM positions p, horizon h
    ON CONFLICT (topic, partition) DO UPDATE SET
        last_processed_transaction_id = excluded.last_processed_transaction_id,
        last_processed_id = excluded.last_processed_id, read_by = excluded.read_by, locked_by = NULL,
        available_after = now(), attempts = 0, last_error = NULL, updated_at = now()
"""

_ORDERS = {
    "partitioned": ("m.transaction_id, m.id", "m.transaction_id DESC, m.id DESC"),
    "serialized": ("m.id", "m.id DESC"),
}

_MARK_RELAYED = {
    "delete": """
        DELETE FROM {messages} m USING {offsets} o
        WHERE o.topic = m.topic AND o.partition = m.partition AND {behind}
    """,
    "mark-sent": """
        UPDATE {messages} m SET sent_at = now() FROM {offsets} o
        WHERE o.topic = m.topic AND o.partition = m.partition AND m.sent_at IS NULL AND {behind}
    """,
}


def switch_strategy(
    conn: psycopg.Connection,
    table: OutboxTable,
    strategy: str,
    *,
    mode: AckMode = "delete",
    lock_timeout: str = "10s",
) -> Switched:
    """Make the outbox's record of what was relayed the one ``strategy`` reads (module docstring)."""
    current = strategy_record.recorded(conn, table)
    if WAL in (strategy, current and current.strategy):
        was = current.strategy if current else "no strategy yet"
        how = "a wal outbox" if was == WAL else f"relayed by {was}"
        raise OutboxError(
            f"switch-strategy refused, nothing was changed: the outbox {table.schema!r} is {how}; "
            + strategy_record.wal_switch_refusal(table, was, strategy)
        )
    require_indexes(conn, table, strategy)
    if workers := live_workers(conn, table, lease_s=60.0):
        alive = ", ".join(w.worker_id for w in workers[:5])
        raise OutboxError(f"stop the relays before switching strategy: live relay workers: {alive}")
    _refuse_held(conn, table)
    behind = sql.SQL(BEHIND_POSITION)
    names = {"messages": table.messages, "offsets": table.offsets, "behind": behind}
    try:
        with conn.transaction():
            strategy_record.record_switch(conn, table, strategy)
            if not keeps_positions(strategy):
                cur = conn.execute(sql.SQL(_MARK_RELAYED[mode]).format(**names))
                return Switched(strategy, 0, cur.rowcount)
            return _positions(conn, table, strategy, names, lock_timeout)
    except psycopg.errors.LockNotAvailable:
        raise OutboxError(
            f"writer transactions on the outbox did not end within {lock_timeout} (one left open?): the switch "
            "waits for them so that it sees every committed row; try again"
        ) from None


def _refuse_held(conn: psycopg.Connection, table: OutboxTable) -> None:
    """Refused while keys are held or held rows wait: only the strategy that held them reads them back."""
    row = conn.execute(
        sql.SQL(
            "SELECT (SELECT count(*) FROM {holds} WHERE released_at IS NULL), (SELECT count(*) FROM {held})"
        ).format(holds=table.holds, held=table.held)
    ).fetchone()
    held_keys, held_rows = row if row else (0, 0)
    if held_keys:
        raise OutboxError(
            f"{held_keys} keys are held behind dead letters: retry or discard them (`outbox dead-letters`) "
            "before switching strategy"
        )
    if held_rows:
        # Released, but not yet moved back: only the strategy that held them reads outbox_held (the row
        # strategies never do), so a switch now would strand them for good.
        raise OutboxError(
            f"{held_rows} rows held behind retried or discarded dead letters are not relayed yet: run the current "
            "strategy's relay until `outbox lag` shows no held rows, then switch"
        )


def _positions(
    conn: psycopg.Connection, table: OutboxTable, strategy: str, names: dict[str, sql.Composable], lock_timeout: str
) -> Switched:
    """Every partition's position for ``strategy``, from what was relayed, with writers locked out so that every
    committed row is seen (position strategies)."""
    conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(lock_timeout)))
    conn.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(table.messages))
    order, order_desc = _ORDERS[strategy]
    cur = conn.execute(
        sql.SQL(_POSITIONS).format(
            pairs=partition_pairs(table), order=sql.SQL(order), order_desc=sql.SQL(order_desc), **names
        ),
        {"strategy": strategy},
    )
    set_ = cur.rowcount
    conn.execute(sql.SQL("UPDATE {} SET read_by = %s").format(table.offsets), (strategy,))
    return Switched(strategy, set_, 0)
