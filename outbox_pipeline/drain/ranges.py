"""A bulk drain's task side: fetch one frozen range of one virtual partition and publish it all, wherever the executor
runs. See docs/spark.md#the-drains-steps-and-who-runs-each."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

import psycopg
from psycopg import sql

from ..model import OutboxRecord
from ..relay.publisher import KafkaPublisher
from ..strategies.base import RECORD_COLUMNS, fetch_records
from .values import (
    DEFAULT_FETCH_ROWS,
    DeliveryError,
    DrainError,
    DrainPlan,
    DrainRange,
    LeaseLostError,
    RangeDelivery,
    position_class,
    position_key,
)

# The end of a frozen range, per strategy, on message row ``m``: together with the strategy's own
# ``work_condition`` (past the start) it bounds a task's rows. Rows up to a ``partitioned`` end were
# all committed when the end was read (their xid is below that snapshot's xmin), so the range never
# grows; ``serialized`` relies on commit-ordered ids exactly as its relay does.
_UP_TO_END = {
    "partitioned": "(m.transaction_id, m.id) <= (%(end_xid)s::xid8, %(end_id)s::bigint)",
    "serialized": "m.id <= %(end_id)s::bigint",
}


# How often a task checks (and renews) that its drain still owns the partition: a drain whose driver died is
# reaped by any relay worker within a second, which then publishes the partition itself; the task must stop
# within about this long of that, not a third of the lease (20 minutes by default) later.
OWNERSHIP_CHECK_S = 1.0


def fetch_range(
    conn: psycopg.Connection,
    plan: DrainPlan,
    rng: DrainRange,
    *,
    page_rows: int = DEFAULT_FETCH_ROWS,
) -> Iterator[list[OutboxRecord]]:
    """The range's rows in publishing order, a page at a time; raises LeaseLostError if the lease goes.

    ``conn`` in autocommit: each page is its own statement, so nothing holds a snapshot for the drain.
    Before the first page and then at most every OWNERSHIP_CHECK_S, the lease is checked and renewed.
    """
    cls = position_class(plan.strategy)
    table = plan.table
    conn.execute("SET enable_sort = off")
    query = sql.SQL(
        """
        SELECT {columns}
        FROM {messages} m,
             (SELECT %(topic)s::text AS topic, %(partition)s::int AS partition,
                     %(xid)s::xid8 AS last_processed_transaction_id, %(id)s::bigint AS last_processed_id) o
        WHERE m.topic = o.topic AND m.partition = o.partition AND {work} AND {up_to_end}
        ORDER BY {order}
        LIMIT %(limit)s
        """
    ).format(
        columns=sql.SQL(RECORD_COLUMNS),
        messages=table.messages,
        work=sql.SQL(cls.work_condition),
        up_to_end=sql.SQL(_UP_TO_END[plan.strategy]),
        order=sql.SQL(cls.read_order),
    )
    params: dict[str, object] = {
        "topic": rng.topic,
        "partition": rng.partition,
        "xid": rng.start_xid,
        "id": rng.start_id,
        "end_xid": rng.end_xid,
        "end_id": rng.end_id,
        "limit": page_rows,
    }
    renewed = float("-inf")
    while True:
        if time.monotonic() - renewed >= min(plan.lease_s / 3, OWNERSHIP_CHECK_S):
            renew_lease(conn, plan, rng)
            renewed = time.monotonic()
        page = fetch_records(conn, query, params, prepare=True)
        if not page:
            return
        yield page
        if len(page) < page_rows:
            return
        params["xid"], params["id"] = page[-1].transaction_id, page[-1].id


def renew_lease(conn: psycopg.Connection, plan: DrainPlan, rng: DrainRange) -> None:
    """A task's check that its drain still owns ``rng`` at its planned start, renewing the lease; LeaseLostError if
    not."""
    if renew_leases(conn, plan, [rng]) != 1:
        raise LeaseLostError(f"{rng.label} is no longer leased to {plan.owner} at its planned start")


_RENEW = """
    UPDATE {offsets} o SET available_after = now() + make_interval(secs => %(lease)s), updated_at = now()
    FROM (
        SELECT x.topic, x.partition
        FROM {offsets} x
        JOIN unnest(%(topics)s::text[], %(partitions)s::int[], %(xids)s::xid8[], %(ids)s::bigint[])
             AS r(topic, partition, xid, id) ON x.topic = r.topic AND x.partition = r.partition
        WHERE x.locked_by = %(owner)s AND x.last_processed_transaction_id = r.xid AND x.last_processed_id = r.id
        FOR UPDATE OF x {skip}
    ) mine
    WHERE o.topic = mine.topic AND o.partition = mine.partition
"""


def renew_leases(
    conn: psycopg.Connection, plan: DrainPlan, ranges: Sequence[DrainRange], *, skip_locked: bool = False
) -> int:
    """Renew the drain's lease of each range still owned at its planned start; how many were. ``skip_locked``: leave
    a row another session is updating this moment (a task renewing it) instead of waiting for it."""
    cur = conn.execute(
        sql.SQL(_RENEW).format(offsets=plan.table.offsets, skip=sql.SQL("SKIP LOCKED" if skip_locked else "")),
        {
            "lease": plan.lease_s,
            "owner": plan.owner,
            "topics": [r.topic for r in ranges],
            "partitions": [r.partition for r in ranges],
            "xids": [r.start_xid for r in ranges],
            "ids": [r.start_id for r in ranges],
        },
    )
    return cur.rowcount


def publish_range(
    publisher: KafkaPublisher, strategy: str, pages: Iterable[Sequence[OutboxRecord]]
) -> RangeDelivery | None:
    """Publish pages of one partition's range and wait for every delivery; None for no rows.

    Raises DeliveryError on the first page Kafka did not fully confirm, carrying what the pages before it
    delivered (the driver commits that much), and DrainError if the rows are not one partition's, in order: the
    task's input is checked, not trusted, since order is the promise.
    """
    started = time.monotonic()
    rows = size = 0
    first: OutboxRecord | None = None
    last_key: tuple[int, ...] | None = None
    last: OutboxRecord | None = None
    for page in pages:
        if not page:
            continue
        if first is None:
            first = page[0]
        for record in page:
            key = position_key(strategy, record.transaction_id, record.id)
            if (record.topic, record.partition) != (first.topic, first.partition):
                raise DrainError(
                    f"a task got rows of {first.topic}/{first.partition} and {record.topic}/{record.partition}"
                )
            if last_key is not None and key <= last_key:
                raise DrainError(f"rows of {first.topic}/{first.partition} arrived out of order at id {record.id}")
            last_key = key
        outcome = publisher.publish(page)
        if outcome.failed:
            failure = outcome.failed[0]
            raise DeliveryError(
                f"{len(outcome.failed)} of {len(page)} messages of {first.topic}/{first.partition} were not "
                f"confirmed (first: outbox id {failure.record.id}: {failure.error})",
                delivered=_delivery(first, last, rows, size, started),
            )
        rows += len(page)
        size += sum(len(r.payload) + len(r.key or b"") for r in page)
        last = page[-1]
    return _delivery(first, last, rows, size, started)


def _delivery(
    first: OutboxRecord | None, last: OutboxRecord | None, rows: int, size: int, started: float
) -> RangeDelivery | None:
    if first is None or last is None:
        return None
    return RangeDelivery(
        first.topic, first.partition, rows, size, last.transaction_id, last.id, time.monotonic() - started
    )
