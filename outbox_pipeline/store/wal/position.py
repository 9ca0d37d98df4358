"""The position a wal outbox's relay recorded in the database (`outbox_wal_position`), the one record that tells a crash
from a restored snapshot. See docs/wal.md#recorded-positions."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from ...config import OutboxTable
from ...errors import SchemaError

TABLE = "outbox_wal_position"

_CREATE = """
    CREATE TABLE IF NOT EXISTS {position} (
        one        boolean     PRIMARY KEY DEFAULT true CHECK (one),
        system     text        NOT NULL,
        timeline   integer     NOT NULL,
        lsn        pg_lsn      NOT NULL,
        bound      pg_lsn      NOT NULL,
        gap_from   pg_lsn,
        gap_to     pg_lsn,
        recorded_at timestamptz NOT NULL DEFAULT now()
    )
"""

# The row and the slot's confirmed position, read together (the relay holds the slot: nothing moves it meanwhile).
_READ = """
    SELECT p.system, p.timeline, p.lsn - '0/0'::pg_lsn, p.bound - '0/0'::pg_lsn, p.gap_from - '0/0'::pg_lsn,
           p.gap_to - '0/0'::pg_lsn,
           (SELECT s.confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots s
            WHERE s.slot_name = %s AND s.database = current_database())
    FROM (SELECT 1) x LEFT JOIN {position} p ON true
"""

# The bound: the WAL's insert position now (everything the relay has read is before it), this record's own WAL
# (RECORD_WAL_BYTES) and the caller's margin. Returns the bound and the end of the allowance for this record's WAL.
_RECORD = """
    INSERT INTO {position} (system, timeline, lsn, bound)
    VALUES (%(system)s, %(timeline)s, '0/0'::pg_lsn + %(lsn)s::numeric,
            pg_current_wal_insert_lsn() + (%(own)s::bigint + %(margin)s::bigint)::numeric)
    ON CONFLICT (one) DO UPDATE SET system = EXCLUDED.system, timeline = EXCLUDED.timeline, lsn = EXCLUDED.lsn,
                                    bound = EXCLUDED.bound, recorded_at = now()
    RETURNING bound - '0/0'::pg_lsn, bound - '0/0'::pg_lsn - %(margin)s::bigint
"""

#: An allowance for a record's own WAL (its row's update and its commit; a full-page image of the row's page, the
#: first change after a checkpoint, is more: the relay records once more then, past it).
RECORD_WAL_BYTES = 256

# The earliest position of the gaps found since the last clearing, and the latest.
_GAP = """
    UPDATE {position} SET gap_from = least(gap_from, '0/0'::pg_lsn + %s::numeric),
                          gap_to = greatest(gap_to, '0/0'::pg_lsn + %s::numeric)
"""


@dataclass(frozen=True)
class Recorded:
    """The row (``system`` None: none recorded yet) and the slot's confirmed position (None: no slot)."""

    system: str | None
    timeline: int
    lsn: int
    bound: int  # the slot is never confirmed past it (relay/wal/position.py)
    gap: tuple[int, int] | None
    slot_confirmed: int | None


def create_table(conn: psycopg.Connection, table: OutboxTable) -> None:
    """The one-row table (init-db, on a new wal outbox and on an existing one)."""
    conn.execute(sql.SQL(_CREATE).format(position=table.ident(TABLE)))


def read(conn: psycopg.Connection, table: OutboxTable, slot: str) -> Recorded:
    """What the relays recorded, and the confirmed position of the outbox's ``slot`` (objects.names_of). Refused on an
    outbox made before the table was."""
    try:
        row = conn.execute(sql.SQL(_READ).format(position=table.ident(TABLE)), (slot,)).fetchone()
    except psycopg.errors.UndefinedTable:
        raise SchemaError(
            f"the wal outbox {table.schema!r} has no {TABLE} table (made by a release before it): run "
            "`outbox init-db --strategy wal` to add it (it changes nothing else of a wal outbox)"
        ) from None
    assert row is not None  # one row, always (the LEFT JOIN)
    system, timeline, lsn, bound, gap_from, gap_to, confirmed = row
    gap = (int(gap_from), int(gap_to)) if gap_from is not None and gap_to is not None else None
    slot_confirmed = int(confirmed) if confirmed is not None else None
    return Recorded(system, int(timeline or 0), int(lsn or 0), int(bound or 0), gap, slot_confirmed)


def record(
    conn: psycopg.Connection, table: OutboxTable, server: tuple[str, int], lsn: int, margin: int
) -> tuple[int, int]:
    """Record ``lsn``, the position Kafka has everything before, and a bound ``margin`` bytes past the WAL written
    now, flushed before this returns: the slot is confirmed up to the bound next, and the row must survive any crash
    the slot's position survives. Returns the bound and where this record's own WAL ends at the latest."""
    with conn.transaction():
        conn.execute("SET LOCAL synchronous_commit = on")
        row = conn.execute(
            sql.SQL(_RECORD).format(position=table.ident(TABLE)),
            {
                "system": server[0],
                "timeline": server[1],
                "lsn": lsn,
                "own": RECORD_WAL_BYTES,
                "margin": margin,
            },
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def record_gap(conn: psycopg.Connection, table: OutboxTable, start: int, end: int) -> None:
    """Messages committed between ``start`` and ``end`` may never have been streamed (module docstring)."""
    conn.execute(sql.SQL(_GAP).format(position=table.ident(TABLE)), (start, end))


def clear_gap_statement(conn: psycopg.Connection, table: OutboxTable) -> str:
    """The statement an operator runs once the gap's messages are republished (or known to be none)."""
    return sql.SQL("UPDATE {} SET gap_from = NULL, gap_to = NULL").format(table.ident(TABLE)).as_string(conn)


def gap_report(conn: psycopg.Connection, table: OutboxTable) -> str | None:
    """The gap a relay found and nobody cleared yet, for an operator (status, the relay's log); None: none, or an
    outbox without the table."""
    found = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table.ident(TABLE).as_string(conn),)).fetchone()
    if not found or not found[0]:
        return None
    row = conn.execute(
        sql.SQL("SELECT gap_from - '0/0'::pg_lsn, gap_to - '0/0'::pg_lsn FROM {}").format(table.ident(TABLE))
    ).fetchone()
    if row is None or row[0] is None or row[1] is None:
        return None
    return describe_gap(conn, table, int(row[0]), int(row[1]))


def describe_gap(conn: psycopg.Connection, table: OutboxTable, start: int, end: int) -> str:
    return (
        f"messages committed between {_lsn(start)} and {_lsn(end)} may never have been streamed nor published: the "
        "replication slot was dropped and created again (or advanced by hand) behind the relay, and a slot starts at "
        "the WAL's end of its making. Republish what committed then from its source, then clear this report: "
        f"{clear_gap_statement(conn, table)}"
    )


def _lsn(lsn: int) -> str:
    """PostgreSQL's text form of a position, as pg_lsn prints it."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"
