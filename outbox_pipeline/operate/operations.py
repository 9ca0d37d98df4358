"""Operator actions on a running outbox (replay, rewind, stuck leases), each one statement or transaction that says how
much it changed, so it can run beside live relays; replays are at-least-once by construction. See
docs/dagster.md#operator-jobs."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..config import OutboxTable
from ..errors import OutboxError

# -- replay rows kept in mark-sent mode ------------------------------------------------------------


def replay_sent(
    conn: psycopg.Connection,
    table: OutboxTable,
    *,
    topic: str | None = None,
    id_from: int | None = None,
    id_to: int | None = None,
    created_from: dt.datetime | None = None,
    created_to: dt.datetime | None = None,
    key: str | None = None,
    all: bool = False,
) -> int:
    """Mark sent rows pending again (Merpay's ``SentAt = NULL``); returns how many.

    Only rows kept by the row strategies' mark-sent mode can be replayed this way (deleted rows are
    gone; position strategies never mark rows: use ``rewind_partition``). Ranges are inclusive for
    ids and half-open for time (``created_from <= created_at < created_to``). Without any filter it
    refuses unless ``all=True``: replaying a whole outbox is rarely what a typo meant.
    """
    filters = {
        "topic": topic,
        "id_from": id_from,
        "id_to": id_to,
        "created_from": created_from,
        "created_to": created_to,
        "key": key,
    }
    if not all and not any(value is not None for value in filters.values()):
        raise OutboxError("replay needs a filter (topic, key, id range or created_at range), or all=True")
    cur = conn.execute(
        sql.SQL(
            """
            UPDATE {messages} m
            SET sent_at = NULL, attempts = 0, available_after = now(), locked_by = NULL, last_error = NULL
            WHERE m.sent_at IS NOT NULL
              AND (%(topic)s::text IS NULL OR m.topic = %(topic)s)
              AND (%(key)s::text IS NULL OR m.key = %(key)s)
              AND (%(id_from)s::bigint IS NULL OR m.id >= %(id_from)s)
              AND (%(id_to)s::bigint IS NULL OR m.id <= %(id_to)s)
              AND (%(created_from)s::timestamptz IS NULL OR m.created_at >= %(created_from)s)
              AND (%(created_to)s::timestamptz IS NULL OR m.created_at < %(created_to)s)
            """
        ).format(messages=table.messages),
        filters,
    )
    return cur.rowcount


# -- rewind a position strategy's partition --------------------------------------------------------


@dataclass(frozen=True)
class Rewound:
    """A partition's position before and after a rewind (xid8 as text)."""

    topic: str
    partition: int
    from_xid: str
    from_id: int
    to_xid: str
    to_id: int

    @property
    def changed(self) -> int:
        return int((self.from_xid, self.from_id) != (self.to_xid, self.to_id))


def rewind_partition(
    conn: psycopg.Connection,
    table: OutboxTable,
    topic: str,
    partition: int,
    *,
    to_id: int | None = None,
    to_xid: str | None = None,
    since: dt.datetime | None = None,
    force: bool = False,
) -> Rewound:
    """Move a partitioned/serialized position back so the relay publishes again from there: just after ``to_id``
    (exactly ``(to_xid, to_id)`` with ``to_xid``), or before the rows created ``since``. Never forward, and not under a
    live worker's lease unless ``force`` (docs/operations.md#replays-rewinds-and-retried-dead-letters)."""
    if since is not None and (to_id is not None or to_xid is not None):
        raise OutboxError("rewind takes either a position (to_id, to_xid) or since, not both")
    if since is None and to_id is None:
        raise OutboxError("rewind needs to_id (optionally with to_xid) or since")
    if to_id is not None and to_id < 0:
        raise OutboxError(f"to_id must be >= 0, got {to_id}")
    if to_xid is not None and not (to_xid.isascii() and to_xid.isdigit() and int(to_xid) < 2**64):
        raise OutboxError(f"to_xid {to_xid!r} is not a transaction id (an unsigned 64-bit xid8)")
    with conn.transaction():
        from_xid, from_id = _locked_position(conn, table, topic, partition, force=force)
        new_xid, new_id = _target(conn, table, topic, partition, to_id=to_id, to_xid=to_xid, since=since)
        row = conn.execute(
            "SELECT %(new_id)s::bigint <= %(from_id)s::bigint AND "
            "(%(new_xid)s::xid8, %(new_id)s::bigint) <= (%(from_xid)s::xid8, %(from_id)s::bigint)",
            {"new_xid": new_xid, "new_id": new_id, "from_xid": from_xid, "from_id": from_id},
        ).fetchone()
        if not (row and row[0]):
            raise OutboxError(
                f"refusing to move {topic}/{partition} forward from xid={from_xid} id={from_id} "
                f"to xid={new_xid} id={new_id}: that would skip rows"
            )
        _set_position(conn, table, topic, partition, new_xid, new_id, force=force)
    return Rewound(topic, partition, from_xid, from_id, new_xid, new_id)


def _locked_position(
    conn: psycopg.Connection, table: OutboxTable, topic: str, partition: int, *, force: bool
) -> tuple[str, int]:
    """The partition's position (xid as text, id), its offsets row locked till the transaction ends; refused while a
    live worker leases it, unless ``force``."""
    current = conn.execute(
        sql.SQL(
            """
            SELECT last_processed_transaction_id::text, last_processed_id, locked_by,
                   locked_by IS NOT NULL AND available_after > now()
            FROM {offsets} WHERE topic = %(topic)s AND partition = %(partition)s
            FOR UPDATE
            """
        ).format(offsets=table.offsets),
        {"topic": topic, "partition": partition},
    ).fetchone()
    if current is None:
        raise OutboxError(f"{topic}/{partition} has no stored position: nothing was relayed there yet")
    from_xid, from_id, owner, leased = current
    if leased and not force:
        raise OutboxError(f"{topic}/{partition} is leased by live worker {owner!r}: stop it first, or force")
    return from_xid, from_id


def _set_position(
    conn: psycopg.Connection, table: OutboxTable, topic: str, partition: int, xid: str, id_: int, *, force: bool
) -> None:
    """The new position, its failures forgotten; with ``force`` the lease freed too."""
    conn.execute(
        sql.SQL(
            """
            UPDATE {offsets}
            SET last_processed_transaction_id = %(xid)s::xid8, last_processed_id = %(id)s,
                attempts = 0, last_error = NULL, updated_at = now(),
                locked_by = CASE WHEN %(force)s THEN NULL ELSE locked_by END,
                available_after = CASE WHEN %(force)s THEN now() ELSE available_after END
            WHERE topic = %(topic)s AND partition = %(partition)s
            """
        ).format(offsets=table.offsets),
        {"xid": xid, "id": id_, "force": force, "topic": topic, "partition": partition},
    )


def _target(
    conn: psycopg.Connection,
    table: OutboxTable,
    topic: str,
    partition: int,
    *,
    to_id: int | None,
    to_xid: str | None,
    since: dt.datetime | None,
) -> tuple[str, int]:
    """The (xid8 text, id) position a rewind asks for."""
    where = {"topic": topic, "partition": partition}
    if since is not None:
        row = conn.execute(
            sql.SQL(
                """
                SELECT (SELECT m.transaction_id::text FROM {messages} m
                        WHERE m.topic = %(topic)s AND m.partition = %(partition)s AND m.created_at >= %(since)s
                        ORDER BY m.transaction_id LIMIT 1),
                       (SELECT min(m.id) FROM {messages} m
                        WHERE m.topic = %(topic)s AND m.partition = %(partition)s AND m.created_at >= %(since)s)
                """
            ).format(messages=table.messages),
            {**where, "since": since},
        ).fetchone()
        if row is None or row[0] is None:
            raise OutboxError(f"{topic}/{partition} has no rows created at or after {since.isoformat()}")
        return str(row[0]), int(row[1]) - 1
    assert to_id is not None
    if to_xid is not None:
        return str(int(to_xid)), to_id
    if to_id == 0:
        return "0", 0
    found = conn.execute(
        sql.SQL(
            "SELECT m.transaction_id::text FROM {messages} m "
            "WHERE m.topic = %(topic)s AND m.partition = %(partition)s AND m.id = %(id)s"
        ).format(messages=table.messages),
        {**where, "id": to_id},
    ).fetchone()
    if found is None:
        raise OutboxError(f"{topic}/{partition} has no row with id {to_id}: give its transaction id too (to_xid)")
    return str(found[0]), to_id


# -- stuck leases ----------------------------------------------------------------------------------


def release_lease(conn: psycopg.Connection, table: OutboxTable, topic: str, partition: int) -> bool:
    """Free a partition's offsets lease now instead of when it expires; True when one was held.

    For a worker that died or hangs with a long ``lease_s``. If the holder is in fact alive, its next
    ack fails the owner check and advances nothing; the next owner publishes that batch again.
    """
    cur = conn.execute(
        sql.SQL(
            """
            UPDATE {offsets} SET locked_by = NULL, available_after = now(), updated_at = now()
            WHERE topic = %(topic)s AND partition = %(partition)s AND locked_by IS NOT NULL
            """
        ).format(offsets=table.offsets),
        {"topic": topic, "partition": partition},
    )
    return cur.rowcount == 1
