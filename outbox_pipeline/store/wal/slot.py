"""The state of a wal outbox's replication slot, and what an operator does when it is gone: the slot is the wal outbox's
operational risk. See docs/operations.md#the-wal-strategy-the-slot."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from ...config import OutboxTable
from ...errors import OutboxError
from .objects import names_of


@dataclass(frozen=True)
class SlotState:
    slot: str
    exists: bool
    active_pid: int | None = None
    wal_status: str | None = None  # reserved, extended, unreserved, lost
    retained_bytes: int | None = None  # WAL kept for the slot: from its restart point to the server's current one
    unconfirmed_bytes: int | None = None  # from its confirmed position to the server's current one
    safe_wal_size: int | None = None  # bytes left before max_slot_wal_keep_size invalidates it (None: no limit)
    keep_limit_bytes: int | None = None  # max_slot_wal_keep_size in bytes (None: -1, no limit)
    # Files a transaction too large for logical_decoding_work_mem is spilled to while it is decoded (pg_replslot/):
    # disk beside the WAL retained. None: not readable here (before 15, or a role without pg_monitor).
    spill_bytes: int | None = None

    @property
    def disk_bytes(self) -> int | None:
        """What the slot keeps on the server's disk: the WAL it retains and its spill files."""
        if self.retained_bytes is None:
            return None
        return self.retained_bytes + (self.spill_bytes or 0)

    @property
    def kept_fraction(self) -> float | None:
        """How much of max_slot_wal_keep_size the slot has used up (1.0: the next checkpoint loses it); None: no
        limit. From ``safe_wal_size``, PostgreSQL's own figure of what is left, which counts whole segments."""
        if self.keep_limit_bytes is None or self.safe_wal_size is None or self.keep_limit_bytes <= 0:
            return None
        return min(1.0, max(0.0, 1.0 - self.safe_wal_size / self.keep_limit_bytes))


class SlotUnusable(OutboxError):
    """The slot is missing or lost: the relay cannot stream, and says what to do."""


def slot_state(conn: psycopg.Connection, table: OutboxTable) -> SlotState:
    name = names_of(table).slot
    row = conn.execute(
        """
        SELECT active_pid, wal_status,
               pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint,
               pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint,
               safe_wal_size,
               (SELECT nullif(greatest(setting::bigint, -1), -1) * 1024 * 1024
                FROM pg_settings WHERE name = 'max_slot_wal_keep_size' AND unit = 'MB')
        FROM pg_replication_slots WHERE slot_name = %s AND database = current_database()
        """,
        (name,),
    ).fetchone()
    if row is None:
        return SlotState(name, exists=False)
    active_pid, wal_status, retained, unconfirmed, safe, limit = row
    return SlotState(name, True, active_pid, wal_status, retained, unconfirmed, safe, limit, _spill_bytes(conn, name))


# pg_ls_replslotdir (PostgreSQL 15 on) lists the slot's folder; superusers and pg_monitor may call it.
_MAY_LIST = """
    SELECT has_function_privilege(p.oid, 'EXECUTE') FROM pg_proc p
    WHERE p.proname = 'pg_ls_replslotdir' AND p.pronamespace = 'pg_catalog'::regnamespace
"""


def _spill_bytes(conn: psycopg.Connection, slot: str) -> int | None:
    """The bytes of the slot's spill files, or None when this server or role cannot list them."""
    may = conn.execute(_MAY_LIST).fetchone()
    if may is None or not may[0]:
        return None
    row = conn.execute(
        "SELECT coalesce(sum(size), 0)::bigint FROM pg_ls_replslotdir(%s) WHERE name LIKE '%%.spill'", (slot,)
    ).fetchone()
    return int(row[0]) if row else None


def unusable_reason(table: OutboxTable, state: SlotState) -> str | None:
    """What is wrong with a missing or lost slot and what an operator does about it; None while it streams. One copy
    of these words: the relay refuses with them, and status, lag and the alerts report them."""
    if not state.exists:
        return (
            f"the outbox {table.schema!r} is a wal outbox without its replication slot {state.slot!r}: a slot "
            "dropped (or a server restored from a backup, which keeps no slots) has lost the messages it had not "
            "confirmed. Run `outbox init-db --strategy wal` to create it again; it streams what commits from then "
            "on (docs/operations.md, The wal strategy: the slot)"
        )
    if state.wal_status == "lost":
        return (
            f"the replication slot {state.slot!r} is lost (wal_status = 'lost'): it fell behind by more than "
            "max_slot_wal_keep_size and PostgreSQL removed the WAL it needed, with the messages it had not "
            "confirmed. Drop it (SELECT pg_drop_replication_slot(...)) and run `outbox init-db --strategy wal`; "
            "then republish what was lost from its source (docs/operations.md, The wal strategy: the slot)"
        )
    return None


def require_streamable(conn: psycopg.Connection, table: OutboxTable) -> SlotState:
    state = slot_state(conn, table)
    if (reason := unusable_reason(table, state)) is not None:
        raise SlotUnusable(reason)
    return state
