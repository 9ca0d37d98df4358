"""Engine room: the one statement a position claim is (partitioned, serialized): lease the partitions that wait, and
read them together with the partitions this worker has batches in flight for.

A batch spans partitions. Under steady traffic a transaction's rows land in many partitions (keys spread), and a
claim per partition cost a lease, a read and an ack for each of them: at 2,000 msg/s in 10-row transactions over 8
partitions, 926 statements per 1,000 messages. One claim now leases every free partition with work (up to
``max_new``: home partitions first, the one that waited longest first, as the single lease did), reads each of those
and each partition read ahead, its fair share of the batch (``limit`` split evenly), and one ack moves every position
(offsets.advance_many). A partition that never runs dry cannot keep the others waiting: every claim serves all of
them. ``partitioned``'s snapshot rule and every other read condition are the strategy's own (``work``). ``Chain``:
how far a worker has read a partition it has batches in flight for (where the next read starts).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from operator import attrgetter
from typing import Any

import psycopg
from psycopg import sql

from .base import RECORD_COLUMNS, OutboxRecord, StrategyConfig
from .offsets import PartitionLease, candidates, released_hold
from .sharing import IS_HOME

# At most this many partitions in one claim (their rows split the batch).
MAX_PARTITIONS_PER_CLAIM = 32
_PAYLOAD = OutboxRecord._fields.index("payload")
_PARTITION = attrgetter("topic", "partition")

_CLAIM = """
    WITH leased AS (
        UPDATE {offsets} target
        SET available_after = now() + make_interval(secs => %(lease)s), locked_by = %(worker)s, updated_at = now()
        FROM ({candidates} ORDER BY {home} DESC, o.available_after LIMIT %(max_new)s FOR UPDATE OF o SKIP LOCKED) free
        WHERE target.topic = free.topic AND target.partition = free.partition
        RETURNING target.topic, target.partition, target.last_processed_transaction_id,
                  target.last_processed_id, target.attempts,
                  EXISTS (SELECT 1 FROM {holds} h
                          WHERE h.topic = target.topic AND h.partition = target.partition) AS has_holds,
                  EXISTS ({released_target}) AS released
    ),
    reading AS (
        SELECT topic, partition, last_processed_transaction_id, last_processed_id, attempts, has_holds, released,
               true AS leased_now
        FROM leased
        UNION ALL
        SELECT a.topic, a.partition, a.xid, a.id, 0, false, false, false
        FROM jsonb_to_recordset(%(ahead)s::jsonb) AS a(topic text, partition int, xid xid8, id bigint)
    )
    -- Record rows are RECORD_COLUMNS alone, made records in one pass. What the claim knows of each partition comes
    -- last, one JSON document in the payload column of a row with no id: a partition's eight columns on every record
    -- row doubled the read's CPU in a bulk drain, and a row per partition cost a Python loop to tell the rows apart.
    SELECT r.*
    FROM reading o
    JOIN LATERAL (
        SELECT {columns} FROM {messages} m
        WHERE m.topic = o.topic AND m.partition = o.partition AND {work}
        ORDER BY {order}
        LIMIT (SELECT ceil(%(limit)s::numeric / greatest(count(*), 1))::bigint FROM reading)
    ) r ON NOT o.released
    UNION ALL
    SELECT NULL, NULL, NULL, convert_to(coalesce((
        SELECT json_agg(json_build_object(
            'topic', topic, 'partition', partition, 'xid', last_processed_transaction_id::text,
            'id', last_processed_id, 'attempts', attempts, 'has_holds', has_holds, 'released', released,
            'leased_now', leased_now))
        FROM reading), '[]')::text, 'UTF8'), NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
"""


def claim_sql(config: StrategyConfig, *, work: str, order: str) -> bytes:
    """The claim statement for the strategy's condition and read order; compose once per strategy instance (as
    bytes: psycopg would render a composed statement again at every execution)."""
    table = config.table
    return (
        sql.SQL(_CLAIM)
        .format(
            offsets=table.offsets,
            candidates=candidates(config, work=work, order=order),
            home=IS_HOME,
            holds=table.holds,
            released_target=released_hold(table, "target"),
            columns=sql.SQL(RECORD_COLUMNS),
            messages=table.messages,
            work=sql.SQL(work),
            order=sql.SQL(order),
        )
        .as_bytes(None)
    )


@dataclass
class PartitionRead:
    """One partition of a claim: where it was read from (the compare-and-set base of its ack) and what was read."""

    lease: PartitionLease
    leased_now: bool
    records: list[OutboxRecord] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, int]:
        return self.lease.topic, self.lease.partition


@dataclass(frozen=True)
class Reads:
    partitions: list[PartitionRead]
    share: int  # the rows each partition could give: a partition that gave that many may have more


def share_of(limit: int, partitions: int) -> int:
    """Each partition's fair share of a batch of ``limit`` rows."""
    return max(1, math.ceil(limit / max(1, partitions)))


def read_partitions(
    cursor: psycopg.Cursor[Any],
    config: StrategyConfig,
    query: bytes,
    *,
    ahead: Sequence[PartitionLease],
    max_new: int,
    limit: int,
    dealt: Mapping[str, object],
) -> Reads:
    """Lease up to ``max_new`` waiting partitions and read them with the ``ahead`` ones (positions to read past);
    ``cursor`` from base.stamped_cursor. The positions go as one JSON document: dumping four arrays of them cost
    more CPU than the rest of the claim."""
    positions = json.dumps([{"topic": a.topic, "partition": a.partition, "xid": a.xid, "id": a.last_id} for a in ahead])
    params = {"lease": config.lease_s, "worker": config.worker_id, "max_new": max_new, "ahead": positions}
    rows = cursor.execute(query, {**params, "limit": limit, **dealt}).fetchall()
    # The partitions' row is the last (UNION ALL appends); looked for if not, since nothing promises it.
    at = len(rows) - 1 if rows and rows[-1][0] is None else next(i for i, row in enumerate(rows) if row[0] is None)
    by_partition = {
        (p["topic"], p["partition"]): PartitionRead(
            PartitionLease(p["topic"], p["partition"], p["xid"], p["id"], p["attempts"], p["has_holds"], p["released"]),
            p["leased_now"],
        )
        for p in json.loads(rows.pop(at)[_PAYLOAD])
    }
    # A partition's rows come together (one LATERAL read each); grouping by runs stays right if they did not.
    for key, run in groupby(map(OutboxRecord._make, rows), _PARTITION):
        by_partition[key].records.extend(run)
    return Reads(list(by_partition.values()), share_of(limit, len(by_partition)))


@dataclass
class Chain:
    """A leased partition with batches in flight, and how far this worker has read it."""

    lease: PartitionLease
    read_xid: str
    read_id: int
    in_flight: int = 0
    broken: bool = False
    # The partition has holds (quarantine.py): reads are split into rows to publish and rows to withhold.
    has_holds: bool = False
    # A hold was released: no more reading ahead; once the batches in flight ack, the partition is leased
    # again and its held rows go first.
    draining: bool = False

    def extend(self, last: OutboxRecord) -> None:
        self.read_xid, self.read_id = last.transaction_id, last.id
        self.in_flight += 1

    @property
    def ahead(self) -> PartitionLease:
        """Where the next batch is read from (and its compare-and-set base): past the batches in flight."""
        return PartitionLease(self.lease.topic, self.lease.partition, self.read_xid, self.read_id, 0)
