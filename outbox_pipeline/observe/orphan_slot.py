"""Engine room: a replication slot of a wal outbox's name beside an outbox that a table strategy relays.

No relay reads such a slot, and it retains every WAL segment from its restart point on, until the disk fills: a
refused ``init-db --strategy wal`` left one behind before it asked first, and a slot can be made by hand. Status and
lag of a table outbox report it, with the SQL that drops it.
"""

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
