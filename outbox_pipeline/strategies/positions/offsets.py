"""The offsets table of the position strategies: one row per (topic, virtual partition) with its position and lease, and
the single statements that discover, lease, advance and release them. See
docs/strategies.md#the-position-strategies-claims-acks-and-failures."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ...config import OutboxTable
from ...model import DeliveryFailure, OutboxRecord
from ..base import DEAD_LETTER_MOVED, StrategyConfig, scope_condition
from .sharing import IS_HOME

# Distinct (topic, partition) pairs of the message table as a loose index scan: one probe of the
# (topic, partition, ...) index per pair instead of a DISTINCT over every row. A CTE named "pairs" for
# a WITH RECURSIVE clause (lag reports use it too).
_PAIRS_CTE = """
    pairs AS (
        (SELECT topic, partition FROM {messages} ORDER BY topic, partition LIMIT 1)
        UNION ALL
        SELECT next.topic, next.partition
        FROM pairs, LATERAL (
            SELECT m.topic, m.partition FROM {messages} m
            WHERE (m.topic, m.partition) > (pairs.topic, pairs.partition)
            ORDER BY m.topic, m.partition LIMIT 1
        ) next
    )
"""


def partition_pairs(table: OutboxTable) -> sql.Composed:
    return sql.SQL(_PAIRS_CTE).format(messages=table.messages)


@dataclass(frozen=True, slots=True)
class PartitionLease:
    topic: str
    partition: int
    xid: str  # last_processed_transaction_id, as xid8 text
    last_id: int
    attempts: int
    has_holds: bool = False
    released: bool = False  # some hold is released and its held rows are ready to publish


@dataclass(frozen=True, slots=True)
class Discovered:
    """What a discovery did: offsets rows created, the highest message id it saw, and its snapshot's bounds: every
    transaction below ``xmin`` had ended; the ids up to ``seen_id`` were drawn by transactions below ``xmax``, so a
    look whose xmin has passed ``xmax`` sees every one of them that will ever commit."""

    created: int
    seen_id: int
    xmin: int
    xmax: int
    complete: bool = True  # False: more new rows than a recent look reads; look at every pair instead


# The snapshot's bounds, as numbers (xid8 as text: psycopg loads xid8 as text only).
_BOUNDS = """
    pg_snapshot_xmin(pg_current_snapshot())::text, pg_snapshot_xmax(pg_current_snapshot())::text
"""


def discover(conn: psycopg.Connection, table: OutboxTable) -> Discovered:
    """Create offsets rows for (topic, partition) pairs that have rows but no position yet.

    A loose index scan (one index probe per distinct pair), not a DISTINCT over the whole table; with it, the
    highest id now and the snapshot's bounds, from which ``discover_recent`` looks next.
    """
    row = conn.execute(
        sql.SQL(
            """
            WITH RECURSIVE {pairs},
            created AS (
                INSERT INTO {offsets} (topic, partition)
                SELECT topic, partition FROM pairs
                ON CONFLICT (topic, partition) DO NOTHING
                RETURNING 1
            )
            SELECT (SELECT count(*) FROM created), coalesce((SELECT max(id) FROM {messages}), 0), {bounds}
            """
        ).format(pairs=partition_pairs(table), offsets=table.offsets, messages=table.messages, bounds=sql.SQL(_BOUNDS))
    ).fetchone()
    assert row is not None
    return Discovered(int(row[0]), int(row[1]), int(row[2]), int(row[3]))


# How many rows written since the last look ``discover_recent`` reads; past it, a full discovery is cheaper.
RECENT_ROWS = 10_000


def discover_recent(conn: psycopg.Connection, table: OutboxTable, floor: int) -> Discovered:
    """Create offsets rows for the pairs of rows with ids above ``floor`` that have none: what a lease that found
    nothing asks (a new partition's first rows), reading only what was written since the earlier looks
    (discovery.py keeps the floor below the ids that may still commit)."""
    row = conn.execute(
        sql.SQL(
            """
            WITH recent AS (
                SELECT m.id, m.topic, m.partition FROM {messages} m
                WHERE m.id > %(floor)s ORDER BY m.id LIMIT %(cap)s
            ),
            created AS (
                INSERT INTO {offsets} (topic, partition)
                SELECT DISTINCT r.topic, r.partition FROM recent r
                WHERE NOT EXISTS (SELECT 1 FROM {offsets} o WHERE o.topic = r.topic AND o.partition = r.partition)
                ON CONFLICT (topic, partition) DO NOTHING
                RETURNING 1
            )
            SELECT (SELECT count(*) FROM created), (SELECT max(id) FROM recent), (SELECT count(*) FROM recent), {bounds}
            """
        ).format(messages=table.messages, offsets=table.offsets, bounds=sql.SQL(_BOUNDS)),
        {"floor": floor, "cap": RECENT_ROWS},
    ).fetchone()
    assert row is not None
    created, seen, rows = int(row[0]), row[1], int(row[2])
    seen_id = floor if seen is None else int(seen)
    return Discovered(created, seen_id, int(row[3]), int(row[4]), complete=rows < RECENT_ROWS)


# The seed's "longest unchecked partition first", restricted to partitions that have work (one
# index probe per partition), so an empty partition costs no lease round trips and "nothing
# claimed" really means "nothing to publish". The probe is a LIMIT 1 subquery ordered like the read: with 10M
# relayed rows behind the positions the planner answered EXISTS (which drops ORDER BY and LIMIT inside it) with a
# bitmap scan of every pending entry of the partition (25,000 in `outbox bench --retained`); in index order, with
# LIMIT 1, it stops at the first. Home partitions first, then others whose oldest pending row waited STEAL_AFTER_S
# (sharing.py), and any whose lease expired unreleased (``locked_by`` kept: its holder stopped renewing, it is hung or
# cut off), even by a worker busy at home. Free: not leased by anyone (this worker's own leases included).
_CANDIDATES = """
    SELECT o.topic, o.partition, o.available_after FROM {offsets} o
    LEFT JOIN LATERAL (
        SELECT m.created_at FROM {messages} m
        WHERE m.topic = o.topic AND m.partition = o.partition AND {work}
        ORDER BY {order} LIMIT 1
    ) oldest ON true
    WHERE o.available_after <= now() {scope} {exclude}
      AND (oldest.created_at IS NOT NULL OR EXISTS ({released}))
      AND ({home} OR o.locked_by IS NOT NULL
           OR (%(steal)s AND coalesce(oldest.created_at, '-infinity')
                             <= now() - make_interval(secs => %(steal_after)s)))
"""

_NO_CONDITION = sql.SQL("")


def candidates(
    config: StrategyConfig, *, work: str, order: str, exclude: sql.Composable = _NO_CONDITION
) -> sql.Composed:
    """The partitions this worker could lease now: free, in scope, with work (see _CANDIDATES); parameters from
    ``Home.params()``. ``exclude``: a further condition on ``o`` (a claim that also acks leaves that batch's
    partitions alone: one statement must not update a row twice)."""
    table = config.table
    return sql.SQL(_CANDIDATES).format(
        offsets=table.offsets,
        messages=table.messages,
        work=sql.SQL(work),
        order=sql.SQL(order),
        scope=scope_condition(config, "o"),
        exclude=exclude,
        home=IS_HOME,
        released=released_hold(table, "o"),
    )


@dataclass(frozen=True, slots=True)
class Move:
    """One partition's outcome of a batch: from where (``lease``: owner and old position, the compare-and-set) to
    where (``to``: the last row passed; None: the position stays), and how the partition goes on."""

    lease: PartitionLease
    to: OutboxRecord | None
    attempts: int
    error: str | None  # the failure the position stopped at: the partition backs off
    keep_lease: bool  # a later batch of the partition is in flight and moves the position on from here


_ADVANCE_MANY = """
    UPDATE {offsets} o
    SET last_processed_transaction_id = coalesce(v.to_xid, o.last_processed_transaction_id),
        last_processed_id = coalesce(v.to_id, o.last_processed_id),
        attempts = v.attempts,
        last_error = v.error,
        read_by = %(strategy)s,
        locked_by = CASE WHEN v.keep THEN o.locked_by END,
        available_after = CASE
            WHEN v.keep THEN now() + make_interval(secs => %(lease)s)
            WHEN v.error IS NULL THEN now()
            ELSE clock_timestamp() + make_interval(
                secs => least(%(max)s, %(base)s * power(2, v.attempts - 1)) * (0.5 + random() / 2))
        END,
        updated_at = now()
    FROM jsonb_to_recordset(%(moves)s::jsonb) AS v(
        topic text, partition int, from_xid xid8, from_id bigint, to_xid xid8, to_id bigint, attempts int, error text,
        keep bool)
    WHERE o.topic = v.topic AND o.partition = v.partition AND o.locked_by = %(worker)s
      AND o.last_processed_transaction_id = v.from_xid AND o.last_processed_id = v.from_id
    RETURNING o.topic, o.partition
"""


@functools.cache
def _advance_many_sql(table: OutboxTable) -> bytes:
    """Rendered once per outbox: psycopg renders a composed statement again at every execution."""
    return sql.SQL(_ADVANCE_MANY).format(offsets=table.offsets).as_bytes(None)


def advance_many(
    conn: psycopg.Connection, config: StrategyConfig, strategy: str, moves: Sequence[Move]
) -> set[tuple[str, int]]:
    """Compare-and-set every position of a batch in one statement; the partitions this worker still owned (the
    others moved nothing). A kept lease is renewed, otherwise released now, or after a backoff past an error. The
    moves go as one JSON document (dumping nine arrays of them cost more CPU than the statement)."""
    document = json.dumps(
        [
            {
                "topic": m.lease.topic,
                "partition": m.lease.partition,
                "from_xid": m.lease.xid,
                "from_id": m.lease.last_id,
                "to_xid": m.to.transaction_id if m.to else None,
                "to_id": m.to.id if m.to else None,
                "attempts": m.attempts,
                "error": m.error,
                "keep": m.keep_lease,
            }
            for m in moves
        ]
    )
    params = {"moves": document, "strategy": strategy, "worker": config.worker_id}
    timing = {"lease": config.lease_s, "max": config.backoff_max_s, "base": config.backoff_base_s}
    rows = conn.execute(_advance_many_sql(config.table), {**params, **timing}).fetchall()
    return {(topic, int(partition)) for topic, partition in rows}


def release_many(conn: psycopg.Connection, config: StrategyConfig, pairs: Sequence[tuple[str, int]]) -> int:
    """End this worker's leases of ``pairs`` now; how many it still held."""
    if not pairs:
        return 0
    cur = conn.execute(
        sql.SQL(
            """
            UPDATE {offsets} o SET available_after = now(), locked_by = NULL, updated_at = now()
            FROM unnest(%(topics)s::text[], %(partitions)s::int[]) AS p(topic, partition)
            WHERE o.topic = p.topic AND o.partition = p.partition AND o.locked_by = %(worker)s
            """
        ).format(offsets=config.table.offsets),
        {"topics": [t for t, _ in pairs], "partitions": [p for _, p in pairs], "worker": config.worker_id},
    )
    return cur.rowcount


def renew_many(
    conn: psycopg.Connection, config: StrategyConfig, pairs: Sequence[tuple[str, int]]
) -> set[tuple[str, int]]:
    """Renew this worker's leases of ``pairs`` for ``lease_s`` from now, expired or not; the pairs it still held
    (an expired lease is still this worker's until another worker takes it)."""
    rows = conn.execute(
        sql.SQL(
            """
            UPDATE {offsets} o SET available_after = now() + make_interval(secs => %(lease)s), updated_at = now()
            FROM unnest(%(topics)s::text[], %(partitions)s::int[]) AS p(topic, partition)
            WHERE o.topic = p.topic AND o.partition = p.partition AND o.locked_by = %(worker)s
            RETURNING o.topic, o.partition
            """
        ).format(offsets=config.table.offsets),
        {
            "topics": [t for t, _ in pairs],
            "partitions": [p for _, p in pairs],
            "worker": config.worker_id,
            "lease": config.lease_s,
        },
    ).fetchall()
    return {(topic, int(partition)) for topic, partition in rows}


def reclaim_own(conn: psycopg.Connection, config: StrategyConfig) -> None:
    """A restarted worker with the same id takes its partitions back at once."""
    conn.execute(
        sql.SQL("UPDATE {offsets} SET available_after = now(), locked_by = NULL WHERE locked_by = %(worker)s").format(
            offsets=config.table.offsets
        ),
        {"worker": config.worker_id},
    )


def unleased_by_others(conn: psycopg.Connection, config: StrategyConfig) -> list[tuple[str, int]]:
    """Partitions no other worker holds a live lease on."""
    rows = conn.execute(
        sql.SQL(
            """
            SELECT o.topic, o.partition FROM {offsets} o
            WHERE o.locked_by IS NULL OR o.locked_by = %(worker)s OR o.available_after <= now()
            """
        ).format(offsets=config.table.offsets),
        {"worker": config.worker_id},
    ).fetchall()
    return [(topic, int(partition)) for topic, partition in rows]


def dead_letter(conn: psycopg.Connection, config: StrategyConfig, failures: list[DeliveryFailure]) -> None:
    """Copy undeliverable rows to the dead letters; message rows themselves are never touched. A failure's
    ``record.attempts`` are the partition's attempts at it before this one (counted on the offsets row)."""
    if not failures:
        return
    conn.execute(
        sql.SQL(
            """
            WITH moved AS (
                SELECT m.id, m.message_id, m.topic, m.key, m.type, m.payload, m.payload_bytes, m.headers, m.partition,
                       m.priority,
                       m.transaction_id, m.created_at, f.attempts, f.error
                FROM {messages} m
                JOIN unnest(%(ids)s::bigint[], %(errors)s::text[], %(attempts)s::int[]) AS f(id, error, attempts)
                  ON m.id = f.id
            )
            {dead_letter}
            """
        ).format(
            messages=config.table.messages,
            dead_letter=sql.SQL(DEAD_LETTER_MOVED).format(dead_letters=config.table.dead_letters),
        ),
        {
            "ids": [f.record.id for f in failures],
            "errors": [f.error for f in failures],
            "attempts": [f.record.attempts for f in failures],
            "worker": config.worker_id,
        },
    )


def released_hold(table: OutboxTable, alias: str) -> sql.Composed:
    """A released hold of the offsets row ``alias``'s partition whose held rows may go out now."""
    return sql.SQL(
        """
        SELECT 1 FROM {holds} h
        WHERE h.topic = {a}.topic AND h.partition = {a}.partition AND h.released_at IS NOT NULL
          AND h.available_after <= now()
        """
    ).format(holds=table.holds, a=sql.Identifier(alias))
