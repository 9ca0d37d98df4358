"""Bulk drains of a backlog, one frozen range per virtual partition, committed at the end: the driver's steps (plan,
keep leases, commit, release), which know nothing of Spark. See docs/spark.md#the-drains-steps-and-who-runs-each."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import psycopg
from psycopg import sql

from .. import server
from ..config import OutboxTable
from ..observe.lag import PartitionLag, partition_lag
from ..store import strategy_record
from ..store.relayable import other_orders
from ..strategies.positions import discover
from .ranges import renew_leases
from .values import (
    DEFAULT_LEASE_S,
    OWNER_PREFIX,
    DrainError,
    DrainOutcome,
    DrainPlan,
    DrainRange,
    RangeDelivery,
    RangeReport,
    position_class,
    position_key,
)

# -- plan (driver) ---------------------------------------------------------------------------------


def plan_drain(
    conn: psycopg.Connection,
    table: OutboxTable,
    *,
    strategy: str | None,
    owner: str,
    lease_s: float = DEFAULT_LEASE_S,
    topics: Sequence[str] | None = None,
    max_partitions: int | None = None,
) -> DrainPlan:
    """Lease the partitions to drain and freeze their ranges; an empty plan when nothing is available.

    Partitions an online relay holds (or that back off after a failure) are skipped, not waited for.
    ``conn`` must be in autocommit mode; the lease and the ends are one transaction.
    """
    if strategy is not None:
        position_class(strategy)  # a row strategy is refused before the outbox could record it
    strategy = strategy_record.claim(conn, table, strategy)  # None: the outbox's own; another is refused
    cls = position_class(strategy)
    if not owner.startswith(OWNER_PREFIX):
        raise DrainError(f"a drain owner starts with {OWNER_PREFIX!r}, got {owner!r}")
    discover(conn, table)
    _refuse_other_orders(conn, table, strategy, topics)
    work = sql.SQL(cls.work_condition)
    with conn.transaction():
        conn.execute("SET LOCAL enable_sort = off")  # index order, never a sort of the backlog
        leased = _lease(conn, table, work, owner, lease_s, topics, max_partitions)
        if not leased:
            return DrainPlan(owner, strategy, table.schema, lease_s)
        end_of = _ends(conn, table, work, cls.read_order, leased)
        ranges = tuple(
            DrainRange(topic, part, xid, last_id, *end_of[(topic, part)])
            for topic, part, xid, last_id in sorted(leased)
            if (topic, part) in end_of
        )
        idle = [(topic, part) for topic, part, _, _ in leased if (topic, part) not in end_of]
        if idle:  # only if an operator moved the position between the two statements
            _release(conn, table, owner, idle)
    return DrainPlan(owner, strategy, table.schema, lease_s, ranges)


# A leased partition: topic, partition, and its position (transaction id as text, id).
_Leased = tuple[str, int, str, int]


def _lease(
    conn: psycopg.Connection,
    table: OutboxTable,
    work: sql.Composable,
    owner: str,
    lease_s: float,
    topics: Sequence[str] | None,
    max_partitions: int | None,
) -> list[_Leased]:
    """Lease every free partition with work and no held key (skipping those locked now), with its position."""
    return conn.execute(
        sql.SQL(
            """
            UPDATE {offsets} target
            SET available_after = now() + make_interval(secs => %(lease)s), locked_by = %(owner)s,
                updated_at = now()
            FROM (
                SELECT o.topic, o.partition FROM {offsets} o
                WHERE o.available_after <= now()
                  AND (%(topics)s::text[] IS NULL OR o.topic = ANY(%(topics)s::text[]))
                  AND EXISTS (SELECT 1 FROM {messages} m
                              WHERE m.topic = o.topic AND m.partition = o.partition AND {work})
                  AND NOT EXISTS (SELECT 1 FROM {holds} h WHERE h.topic = o.topic AND h.partition = o.partition)
                ORDER BY o.topic, o.partition
                LIMIT %(max)s
                FOR UPDATE OF o SKIP LOCKED
            ) free
            WHERE target.topic = free.topic AND target.partition = free.partition
            RETURNING target.topic, target.partition, target.last_processed_transaction_id::text,
                      target.last_processed_id
            """
        ).format(offsets=table.offsets, messages=table.messages, work=work, holds=table.holds),
        {"lease": lease_s, "owner": owner, "topics": list(topics) if topics else None, "max": max_partitions},
    ).fetchall()


def _ends(
    conn: psycopg.Connection, table: OutboxTable, work: sql.Composable, read_order: str, leased: list[_Leased]
) -> dict[tuple[str, int], tuple[str, int]]:
    """Every leased partition's end, (xid, id) of the last row the relay could read now: one statement, so one
    snapshot. A partition missing from it has no work left (an operator moved its position meanwhile)."""
    descending = ", ".join(f"{column.strip()} DESC" for column in read_order.split(","))
    ends = conn.execute(
        sql.SQL(
            """
            SELECT o.topic, o.partition, e.xid, e.id
            FROM unnest(%(topics)s::text[], %(partitions)s::int[], %(xids)s::xid8[], %(ids)s::bigint[])
                 AS o(topic, partition, last_processed_transaction_id, last_processed_id)
            CROSS JOIN LATERAL (
                SELECT m.transaction_id::text AS xid, m.id FROM {messages} m
                WHERE m.topic = o.topic AND m.partition = o.partition AND {work}
                ORDER BY {descending}
                LIMIT 1
            ) e
            """
        ).format(messages=table.messages, work=work, descending=sql.SQL(descending)),
        {
            "topics": [r[0] for r in leased],
            "partitions": [r[1] for r in leased],
            "xids": [r[2] for r in leased],
            "ids": [r[3] for r in leased],
        },
    ).fetchall()
    return {(topic, part): (xid, last_id) for topic, part, xid, last_id in ends}


def drainable(lag: PartitionLag) -> bool:
    """Whether a plan made now would take this partition, from its lag row (what plan_drain's lease leaves out:
    leased by anyone, backing off, a key held). A partition whose holds were all released but not yet cleared reads
    as drainable here and is still left to the relay by the plan."""
    return lag.pending > 0 and not lag.leased_by and not lag.in_backoff and lag.held == 0


def _refuse_other_orders(
    conn: psycopg.Connection, table: OutboxTable, strategy: str, topics: Sequence[str] | None
) -> None:
    """A position another strategy advanced is in that strategy's order: draining past it in this one skips rows
    (serialized's "write first, enqueue last" writers commit lower xids after higher ids)."""
    if rows := other_orders(conn, table, strategy, topics):
        named = ", ".join(f"{topic}/{partition} ({read_by})" for topic, partition, read_by in rows)
        raise DrainError(
            f"cannot drain as {strategy}: positions were advanced by another strategy ({named}) and are in its "
            "order; drain with the strategy the relay uses"
        )


log = logging.getLogger(__name__)

# -- leases kept while the tasks run (driver) -------------------------------------------------------


@contextmanager
def leases_kept(dsn: str, plan: DrainPlan) -> Iterator[None]:
    """Renew every lease of ``plan`` every third of ``lease_s`` until the block ends (then commit or release).

    A task renews its own partition's lease only while it reads; one that finished early would lose its partition
    ``lease_s`` later, while a slower task still runs, and a relay would publish the delivered range again. A thread
    on a connection of its own, so no task and no commit waits on it; it dies with the driver, and then the drain's
    leases end as the driver's registration does.
    """
    if not plan.ranges:
        yield
        return
    stop = threading.Event()
    thread = threading.Thread(target=_keep_leases, args=(dsn, plan, stop), name=f"leases-{plan.owner}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _keep_leases(dsn: str, plan: DrainPlan, stop: threading.Event) -> None:
    conn: psycopg.Connection | None = None
    try:
        while not stop.wait(plan.lease_s / 3):
            try:
                if conn is None:
                    conn = server.connect(dsn, autocommit=True, application_name=f"outbox {plan.owner}"[:63])
                renew_leases(conn, plan, plan.ranges, skip_locked=True)
            except psycopg.Error as exc:  # a session that ended: a new one at the next round, well within the lease
                log.warning("drain %s: renewing its leases failed (%s): trying again", plan.owner, exc)
                if conn is not None:
                    conn.close()
                conn = None
    finally:
        if conn is not None:
            conn.close()


# -- commit or release (driver) --------------------------------------------------------------------


def commit_drain(conn: psycopg.Connection, plan: DrainPlan, reports: Iterable[RangeReport]) -> DrainOutcome:
    """Advance each range's position to what its task confirmed (all of it, or the part before a failure); release
    every lease of the drain.

    One transaction. Each position moves by compare-and-set from (owner, planned start): a partition
    whose lease was lost (expired, released by an operator) is not moved, and its rows are published
    again by whoever owns it now. A delivery outside its planned range is refused, never applied.
    """
    table = plan.table
    reports = list(reports)
    by_label = {r.label: r.delivery for r in reports if r.delivery is not None}
    failed = {r.label: r.error for r in reports if r.error is not None}
    committed: list[RangeDelivery] = []
    refused: dict[str, str] = {}
    with conn.transaction():
        for rng in plan.ranges:
            delivery = by_label.get(rng.label)
            if delivery is None:
                refused[rng.label] = failed.get(rng.label, "no delivery reported")
                continue
            key = position_key(plan.strategy, delivery.last_xid, delivery.last_id)
            start = position_key(plan.strategy, rng.start_xid, rng.start_id)
            end = position_key(plan.strategy, rng.end_xid, rng.end_id)
            if not start < key <= end:
                refused[rng.label] = (
                    f"delivered up to xid={delivery.last_xid} id={delivery.last_id}, outside the planned range"
                )
                continue
            cur = conn.execute(
                sql.SQL(
                    """
                    UPDATE {offsets}
                    SET last_processed_transaction_id = %(to_xid)s::xid8, last_processed_id = %(to_id)s,
                        attempts = 0, last_error = NULL, locked_by = NULL, available_after = now(),
                        read_by = %(strategy)s, updated_at = now()
                    WHERE topic = %(topic)s AND partition = %(partition)s AND locked_by = %(owner)s
                      AND last_processed_transaction_id = %(from_xid)s::xid8 AND last_processed_id = %(from_id)s
                    """
                ).format(offsets=table.offsets),
                {
                    "to_xid": delivery.last_xid,
                    "to_id": delivery.last_id,
                    "topic": rng.topic,
                    "partition": rng.partition,
                    "owner": plan.owner,
                    "from_xid": rng.start_xid,
                    "from_id": rng.start_id,
                    "strategy": plan.strategy,
                },
            )
            if cur.rowcount == 1:
                committed.append(delivery)
            else:
                refused[rng.label] = f"lease lost: {rng.label} is no longer owned by {plan.owner} at its start"
        release_drain(conn, table, plan.owner)
    return DrainOutcome(tuple(committed), refused, failed)


def release_drain(conn: psycopg.Connection, table: OutboxTable, owner: str) -> int:
    """Release every lease ``owner`` holds without moving a position; returns how many."""
    cur = conn.execute(
        sql.SQL(
            "UPDATE {offsets} SET locked_by = NULL, available_after = now(), updated_at = now() "
            "WHERE locked_by = %(owner)s"
        ).format(offsets=table.offsets),
        {"owner": owner},
    )
    return cur.rowcount


def _release(conn: psycopg.Connection, table: OutboxTable, owner: str, pairs: Sequence[tuple[str, int]]) -> None:
    conn.execute(
        sql.SQL(
            """
            UPDATE {offsets} o SET locked_by = NULL, available_after = now(), updated_at = now()
            FROM unnest(%(topics)s::text[], %(partitions)s::int[]) AS p(topic, partition)
            WHERE o.topic = p.topic AND o.partition = p.partition AND o.locked_by = %(owner)s
            """
        ).format(offsets=table.offsets),
        {"topics": [p[0] for p in pairs], "partitions": [p[1] for p in pairs], "owner": owner},
    )


def drain_leases(conn: psycopg.Connection, table: OutboxTable) -> dict[str, int]:
    """Owners of bulk-drain leases still held (live or expired), with how many partitions each holds."""
    rows = conn.execute(
        sql.SQL("SELECT locked_by, count(*) FROM {offsets} WHERE locked_by LIKE %(prefix)s GROUP BY locked_by").format(
            offsets=table.offsets
        ),
        {"prefix": OWNER_PREFIX.replace("_", r"\_") + "%"},
    ).fetchall()
    return {str(owner): int(n) for owner, n in rows}


# -- when to drain ---------------------------------------------------------------------------------


def backlog_at_least(conn: psycopg.Connection, table: OutboxTable, strategy: str, threshold: int) -> bool:
    """Whether at least ``threshold`` rows wait, as ``strategy`` counts them (the lag query, capped:
    a huge backlog costs at most ``threshold`` rows per partition to count)."""
    lags = partition_lag(conn, table, strategy, cap=max(1, threshold))
    return sum(lag.pending for lag in lags) >= threshold
