"""A replication slot named like a wal outbox's beside an outbox a table strategy relays, reported because it retains
WAL until the disk fills. See docs/operations.md#the-wal-strategy-the-slot."""

from __future__ import annotations

import psycopg

from ..config import OutboxTable
from ..store.wal.objects import drop_by_hand
from ..store.wal.slot import slot_state


def orphan_slot(conn: psycopg.Connection, table: OutboxTable, strategy: str) -> str | None:
    """One line for a table outbox (relayed by ``strategy``) with a slot of its wal name in this database; None
    without one."""
    state = slot_state(conn, table)
    if not state.exists:
        return None
    streamed = f"streamed by pid {state.active_pid}" if state.active_pid is not None else "streamed by nobody"
    return (
        f"warning: a replication slot {state.slot!r} of this outbox's wal name exists, {streamed}, but the outbox is "
        f"relayed by {strategy}: no relay of it reads the slot, and it retains {state.retained_bytes or 0:,} bytes "
        f"of WAL, growing until the disk fills. Unless a program of yours uses it, drop it (and its publication): "
        f"`{drop_by_hand(table)}`"
    )
