"""The operator's dead letters: list them (with what each holds back), retry or discard them, each action one statement
or transaction that says how much it changed, for the CLI and the Dagster jobs. See
docs/strategies.md#poison-messages-keep-their-keys-order-quarantine."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..config import OutboxTable
from ..errors import OutboxError
from ..store.routing import SERIALIZED_LOCK_CLASS
from ..store.wal.format import NOT_RETRIABLE_TOPICS


@dataclass(frozen=True)
class DeadLetter:
    id: int
    message_id: str
    topic: str
    key: str | None
    partition: int
    attempts: int
    last_error: str
    dead_lettered_at: dt.datetime
    dead_lettered_by: str | None
    retried_at: dt.datetime | None
    discarded_at: dt.datetime | None = None
    discard_reason: str | None = None
    # Its key is held behind it (quarantine): how many later rows of the key wait for it.
    holding: bool = False
    held_rows: int = 0
    # Its payload: "json" or "bytes" (published unchanged), and its size as published.
    payload: str = "json"
    payload_size: int = 0

    def describe_hold(self) -> str:
        if not self.holding:
            return ""
        return f"key {self.key!r} of {self.topic}:{self.partition} held behind it, {self.held_rows} rows"


def list_dead_letters(
    conn: psycopg.Connection, table: OutboxTable, limit: int = 100, *, include_retried: bool = False
) -> list[DeadLetter]:
    """The oldest dead letters first, each with the rows its key holds back; retried and discarded ones only
    with ``include_retried``."""
    rows = conn.execute(
        sql.SQL(
            """
            SELECT d.id, d.message_id::text, d.topic, d.key, d.partition, d.attempts, d.last_error,
                   d.dead_lettered_at, d.dead_lettered_by, d.retried_at, d.discarded_at, d.discard_reason,
                   h.topic IS NOT NULL,
                   (SELECT count(*) FROM {held} x WHERE x.topic = h.topic AND x.key = h.key),
                   CASE WHEN d.payload_bytes IS NULL THEN 'json' ELSE 'bytes' END,
                   coalesce(octet_length(d.payload_bytes), octet_length(d.payload::text))
            FROM {dead_letters} d
            LEFT JOIN {holds} h ON h.topic = d.topic AND h.key = d.key AND h.dead_letter_id = d.id
                                AND h.released_at IS NULL
            WHERE %(all)s OR (d.retried_at IS NULL AND d.discarded_at IS NULL)
            ORDER BY d.dead_lettered_at, d.id
            LIMIT %(limit)s
            """
        ).format(dead_letters=table.dead_letters, holds=table.holds, held=table.held),
        {"all": include_retried, "limit": limit},
    ).fetchall()
    return [DeadLetter(*row) for row in rows]


def retry_dead_letters(
    conn: psycopg.Connection,
    table: OutboxTable,
    *,
    ids: Sequence[int] | None = None,
    topic: str | None = None,
    by: str | None = None,
) -> int:
    """Put dead letters (not retried yet) back into the outbox, in one statement; returns how many. Without ``ids``
    or ``topic`` every pending dead letter is retried. Each goes back under a new id past every position, or to the
    head of the rows its key holds (docs/operations.md#replays-rewinds-and-retried-dead-letters)."""
    filters: dict[str, object] = {
        "ids": list(ids) if ids is not None else None,
        "topic": topic,
        "by": by,
        "malformed": list(NOT_RETRIABLE_TOPICS),
    }
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (SERIALIZED_LOCK_CLASS, table.schema))
        return _retry_held(conn, table, filters) + _retry_into_outbox(conn, table, filters)


def _retry_held(conn: psycopg.Connection, table: OutboxTable, filters: dict[str, object]) -> int:
    """The dead letters a key is held behind: each to the head of its held rows, and its hold released."""
    return conn.execute(
        sql.SQL(
            """
            WITH picked AS (
                UPDATE {dead_letters} d SET retried_at = now()
                FROM {holds} h
                WHERE h.topic = d.topic AND h.key = d.key AND h.dead_letter_id = d.id AND h.released_at IS NULL
                  AND d.retried_at IS NULL AND d.discarded_at IS NULL
                  AND (%(ids)s::bigint[] IS NULL OR d.id = ANY(%(ids)s::bigint[]))
                  AND (%(topic)s::text IS NULL OR d.topic = %(topic)s)
                  AND d.topic <> ALL(%(malformed)s::text[])
                RETURNING d.*
            ), released AS (
                UPDATE {holds} h SET released_at = now(), release = 'retry', released_by = %(by)s,
                                     available_after = now()
                FROM picked p WHERE h.topic = p.topic AND h.key = p.key
            )
            INSERT INTO {held} (id, message_id, topic, key, type, payload, payload_bytes, headers, partition,
                                priority, transaction_id, created_at)
            SELECT id, message_id, topic, key, type, payload, payload_bytes, headers, partition, priority,
                   transaction_id, created_at
            FROM picked
            ON CONFLICT (id) DO NOTHING
            """
        ).format(dead_letters=table.dead_letters, holds=table.holds, held=table.held),
        filters,
    ).rowcount


def _retry_into_outbox(conn: psycopg.Connection, table: OutboxTable, filters: dict[str, object]) -> int:
    """The other dead letters (the held ones are retried by now): each inserted again with a new id, a keyed one
    routed again by the insert trigger."""
    seq = table.ident("outbox_messages_id_seq")
    return conn.execute(
        sql.SQL(
            """
            WITH picked AS (
                UPDATE {dead_letters} d SET retried_at = now()
                WHERE d.retried_at IS NULL AND d.discarded_at IS NULL
                  AND (%(ids)s::bigint[] IS NULL OR d.id = ANY(%(ids)s::bigint[]))
                  AND (%(topic)s::text IS NULL OR d.topic = %(topic)s)
                  AND d.topic <> ALL(%(malformed)s::text[])
                RETURNING d.id, d.message_id, d.topic, d.key, d.type, d.payload, d.payload_bytes, d.headers,
                          d.partition, d.priority
            )
            INSERT INTO {messages} (
                id, message_id, topic, key, type, payload, payload_bytes, headers, partition, priority)
            SELECT nextval({seq}::regclass), p.message_id, p.topic, p.key, p.type, p.payload, p.payload_bytes,
                   p.headers,
                   CASE WHEN p.key IS NULL THEN p.partition END, p.priority
            FROM picked p
            ORDER BY p.id
            """
        ).format(dead_letters=table.dead_letters, messages=table.messages, seq=sql.Literal(seq.as_string(conn))),
        filters,
    ).rowcount


def malformed_among(
    conn: psycopg.Connection, table: OutboxTable, *, ids: Sequence[int] | None = None, topic: str | None = None
) -> list[int]:
    """The pending dead letters a retry with these filters leaves alone: malformed, they hold no message to put back
    (only ``discard`` removes them)."""
    rows = conn.execute(
        sql.SQL(
            """
            SELECT d.id FROM {dead_letters} d
            WHERE d.retried_at IS NULL AND d.discarded_at IS NULL AND d.topic = ANY(%(malformed)s::text[])
              AND (%(ids)s::bigint[] IS NULL OR d.id = ANY(%(ids)s::bigint[]))
              AND (%(topic)s::text IS NULL OR d.topic = %(topic)s)
            ORDER BY d.id
            """
        ).format(dead_letters=table.dead_letters),
        {"ids": list(ids) if ids is not None else None, "topic": topic, "malformed": list(NOT_RETRIABLE_TOPICS)},
    ).fetchall()
    return [int(i) for (i,) in rows]


def discard_dead_letters(
    conn: psycopg.Connection, table: OutboxTable, ids: Sequence[int], *, reason: str, by: str | None = None
) -> int:
    """Give up on dead letters for good (recorded: when, by whom, why); returns how many.

    The rows held behind a discarded dead letter are released: the partition's relay publishes them in order,
    without it, then the key flows again. Retried or already discarded dead letters are left as they are.
    """
    if not ids:
        raise OutboxError("discard needs the ids of the dead letters to give up on")
    if not reason.strip():
        raise OutboxError("discard needs a reason: it is recorded with the dead letter")
    row = conn.execute(
        sql.SQL(
            """
            WITH picked AS (
                UPDATE {dead_letters} d SET discarded_at = now(), discarded_by = %(by)s, discard_reason = %(reason)s
                WHERE d.id = ANY(%(ids)s::bigint[]) AND d.retried_at IS NULL AND d.discarded_at IS NULL
                RETURNING d.id, d.topic, d.key
            ), released AS (
                UPDATE {holds} h SET released_at = now(), release = 'discard', released_by = %(by)s,
                                     available_after = now()
                FROM picked p
                WHERE h.topic = p.topic AND h.key = p.key AND h.dead_letter_id = p.id AND h.released_at IS NULL
                RETURNING 1
            )
            SELECT (SELECT count(*) FROM picked), (SELECT count(*) FROM released)
            """
        ).format(dead_letters=table.dead_letters, holds=table.holds),
        {"ids": list(ids), "reason": reason, "by": by},
    ).fetchone()
    return int(row[0]) if row else 0
