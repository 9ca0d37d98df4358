"""Engine room: the offsets table of the position strategies (partitioned, serialized).

One row per (topic, virtual partition): its stored position, and the lease that makes one worker its reader.
Each function is one statement: discover partitions that have rows but no offsets row, lease the partition to
read next, advance a position by compare-and-set, release a lease, and copy undeliverable rows to the dead
letters. The reading and acking logic around them is positions.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..config import OutboxTable
from .base import DEAD_LETTER_MOVED, DeliveryFailure, OutboxRecord, StrategyConfig, scope_condition
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


# Message row ``m`` is behind offsets row ``o``'s position, in the order of the strategy that last advanced it
# (``read_by``): ``partitioned`` by (transaction id, id), ``serialized`` by id. With none recorded, behind in both
# orders: a "write first, enqueue last" writer commits a lower xid after a higher id, so a row behind in one order
# may be ahead in the other. Whoever asks whether a row was relayed (maintenance, the partition-count guard) asks
# this, never the strategy it was told: a wrong name must not pass an unrelayed row.
BEHIND_POSITION = """
    coalesce(CASE o.read_by
        WHEN 'serialized' THEN m.id <= o.last_processed_id
        WHEN 'partitioned' THEN (m.transaction_id, m.id) <= (o.last_processed_transaction_id, o.last_processed_id)
        ELSE m.id <= o.last_processed_id
             AND (m.transaction_id, m.id) <= (o.last_processed_transaction_id, o.last_processed_id)
    END, false)
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
    others: bool = False  # another partition this worker could lease has work too


@dataclass(frozen=True, slots=True)
class Discovered:
    """What a discovery did: offsets rows created, and the highest message id it had covered."""

    created: int
    seen_id: int
    complete: bool = True  # False: more new rows than a recent look reads; look at every pair instead


def discover(conn: psycopg.Connection, table: OutboxTable) -> Discovered:
    """Create offsets rows for (topic, partition) pairs that have rows but no position yet.

    A loose index scan (one index probe per distinct pair), not a DISTINCT over the whole table; with it, the
    highest id now, from which ``discover_recent`` looks next.
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
            SELECT (SELECT count(*) FROM created), coalesce((SELECT max(id) FROM {messages}), 0)
            """
        ).format(pairs=partition_pairs(table), offsets=table.offsets, messages=table.messages)
    ).fetchone()
    assert row is not None
    return Discovered(int(row[0]), int(row[1]))


# How many rows written since the last look ``discover_recent`` reads; past it, a full discovery is cheaper.
RECENT_ROWS = 10_000


def discover_recent(conn: psycopg.Connection, table: OutboxTable, after_id: int) -> Discovered:
    """Create offsets rows for the pairs of rows with ids above ``after_id`` that have none: what a lease that
    found nothing asks (a new partition's first rows), reading only what was written since the last look. A row of
    a new partition committed late with a lower id is found by the next full ``discover`` (DISCOVERY_INTERVAL_S)."""
    row = conn.execute(
        sql.SQL(
            """
            WITH recent AS (
                SELECT m.id, m.topic, m.partition FROM {messages} m
                WHERE m.id > %(after)s ORDER BY m.id LIMIT %(cap)s
            ),
            created AS (
                INSERT INTO {offsets} (topic, partition)
                SELECT DISTINCT r.topic, r.partition FROM recent r
                WHERE NOT EXISTS (SELECT 1 FROM {offsets} o WHERE o.topic = r.topic AND o.partition = r.partition)
                ON CONFLICT (topic, partition) DO NOTHING
                RETURNING 1
            )
            SELECT (SELECT count(*) FROM created), (SELECT max(id) FROM recent), (SELECT count(*) FROM recent)
            """
        ).format(messages=table.messages, offsets=table.offsets),
        {"after": after_id, "cap": RECENT_ROWS},
    ).fetchone()
    assert row is not None
    created, seen, rows = int(row[0]), row[1], int(row[2])
    return Discovered(created, after_id if seen is None else int(seen), complete=rows < RECENT_ROWS)


# The talk's "longest unchecked partition first", restricted to partitions that have work (one
# index probe per partition), so an empty partition costs no lease round trips and "nothing
# claimed" really means "nothing to publish". The probe is a LIMIT 1 subquery ordered like the read: with 10M
# relayed rows behind the positions the planner answered EXISTS (which drops ORDER BY and LIMIT inside it) with a
# bitmap scan of every pending entry of the partition (25,000 in `outbox bench --retained`); in index order, with
# LIMIT 1, it stops at the first. Home partitions first, then others whose oldest pending row waited STEAL_AFTER_S
# (sharing.py). Free: not leased by anyone (this worker's own leases included).
_CANDIDATES = """
    SELECT o.topic, o.partition, o.available_after FROM {offsets} o
    LEFT JOIN LATERAL (
        SELECT m.created_at FROM {messages} m
        WHERE m.topic = o.topic AND m.partition = o.partition AND {work}
        ORDER BY {order} LIMIT 1
    ) oldest ON true
    WHERE o.available_after <= now() {scope}
      AND (oldest.created_at IS NOT NULL OR EXISTS ({released}))
      AND ({home} OR coalesce(oldest.created_at, '-infinity')
                     <= now() - make_interval(secs => %(steal_after)s))
"""

# SKIP LOCKED keeps two workers off one partition.
_LEASE = """
        UPDATE {offsets} target
        SET available_after = now() + make_interval(secs => %(lease)s), locked_by = %(worker)s,
            updated_at = now()
        FROM ({candidates} ORDER BY {home} DESC, o.available_after LIMIT 1 FOR UPDATE OF o SKIP LOCKED) free
        WHERE target.topic = free.topic AND target.partition = free.partition
        RETURNING target.topic, target.partition, target.last_processed_transaction_id::text,
                  target.last_processed_id, target.attempts,
                  EXISTS (SELECT 1 FROM {holds} h
                          WHERE h.topic = target.topic AND h.partition = target.partition),
                  EXISTS ({released_target}),
                  EXISTS (SELECT 1 FROM ({candidates}) c
                          WHERE (c.topic, c.partition) <> (target.topic, target.partition))
        """


def candidates(config: StrategyConfig, *, work: str, order: str) -> sql.Composed:
    """The partitions this worker could lease now: free, in scope, with work (see _CANDIDATES); parameters from
    ``Home.params()``. Also how a batch read ahead yields to a partition that waits (positions.py)."""
    table = config.table
    return sql.SQL(_CANDIDATES).format(
        offsets=table.offsets,
        messages=table.messages,
        work=sql.SQL(work),
        order=sql.SQL(order),
        scope=scope_condition(config, "o"),
        home=IS_HOME,
        released=_released_hold(table, "o"),
    )


def lease_sql(config: StrategyConfig, *, work: str, order: str) -> sql.Composed:
    """The lease statement for the strategy's condition and read order (``work``/``order``); compose once."""
    table = config.table
    return sql.SQL(_LEASE).format(
        offsets=table.offsets,
        candidates=candidates(config, work=work, order=order),
        home=IS_HOME,
        holds=table.holds,
        released_target=_released_hold(table, "target"),
    )


def lease_next(
    conn: psycopg.Connection, config: StrategyConfig, query: sql.Composed, dealt: Mapping[str, object]
) -> PartitionLease | None:
    """Lease the next partition with work (``query`` from lease_sql)."""
    row = conn.execute(query, {"lease": config.lease_s, "worker": config.worker_id, **dealt}).fetchone()
    return PartitionLease(*row) if row else None


def advance(
    conn: psycopg.Connection,
    config: StrategyConfig,
    strategy: str,
    lease: PartitionLease,
    to: OutboxRecord | None,
    failure: DeliveryFailure | None,
    attempts: int,
    keep_lease: bool = False,
) -> bool:
    """Compare-and-set the position; False when this worker no longer owns the partition.

    ``keep_lease`` renews the lease instead of releasing it: a later batch of the same partition is
    in flight and will advance the position from where this one ends.
    """
    cur = conn.execute(
        sql.SQL(
            """
            UPDATE {offsets}
            SET last_processed_transaction_id = coalesce(%(to_xid)s::xid8, last_processed_transaction_id),
                last_processed_id = coalesce(%(to_id)s, last_processed_id),
                attempts = %(attempts)s,
                last_error = %(error)s,
                read_by = %(strategy)s,
                locked_by = CASE WHEN %(keep)s THEN locked_by END,
                available_after = CASE
                    WHEN %(keep)s THEN now() + make_interval(secs => %(lease)s)
                    WHEN %(error)s::text IS NULL THEN now()
                    ELSE clock_timestamp() + make_interval(
                        secs => least(%(max)s, %(base)s * power(2, %(attempts)s - 1)) * (0.5 + random() / 2))
                END,
                updated_at = now()
            WHERE topic = %(topic)s AND partition = %(partition)s AND locked_by = %(worker)s
              AND last_processed_transaction_id = %(from_xid)s::xid8 AND last_processed_id = %(from_id)s
            """
        ).format(offsets=config.table.offsets),
        {
            "to_xid": to.transaction_id if to else None,
            "to_id": to.id if to else None,
            "attempts": attempts,
            "error": failure.error if failure else None,
            "max": config.backoff_max_s,
            "base": config.backoff_base_s,
            "topic": lease.topic,
            "partition": lease.partition,
            "worker": config.worker_id,
            "from_xid": lease.xid,
            "from_id": lease.last_id,
            "keep": keep_lease,
            "lease": config.lease_s,
            "strategy": strategy,
        },
    )
    return cur.rowcount == 1


def release(conn: psycopg.Connection, config: StrategyConfig, lease: PartitionLease) -> bool:
    """End this worker's lease now; False when it no longer held it."""
    cur = conn.execute(
        sql.SQL(
            """
            UPDATE {offsets}
            SET available_after = now(), locked_by = NULL, updated_at = now()
            WHERE topic = %(topic)s AND partition = %(partition)s AND locked_by = %(worker)s
            """
        ).format(offsets=config.table.offsets),
        {"topic": lease.topic, "partition": lease.partition, "worker": config.worker_id},
    )
    return cur.rowcount == 1


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
                SELECT m.id, m.message_id, m.topic, m.key, m.type, m.payload, m.headers, m.partition, m.priority,
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


def _released_hold(table: OutboxTable, alias: str) -> sql.Composed:
    """A released hold of the offsets row ``alias``'s partition whose held rows may go out now."""
    return sql.SQL(
        """
        SELECT 1 FROM {holds} h
        WHERE h.topic = {a}.topic AND h.partition = {a}.partition AND h.released_at IS NOT NULL
          AND h.available_after <= now()
        """
    ).format(holds=table.holds, a=sql.Identifier(alias))
