"""The one statement a position claim is: lease the partitions that wait and read them together with those read ahead,
so one claim and one ack serve a batch that spans partitions. See docs/strategies.md#one-claim-for-many-partitions."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from operator import attrgetter
from typing import Any, NamedTuple

import psycopg
from psycopg import sql

from ...model import OutboxRecord
from ..base import RECORD_COLUMNS, StrategyConfig
from .offsets import PartitionLease, candidates, released_hold
from .sharing import IS_HOME

_PAYLOAD = OutboxRecord._fields.index("payload")
_PARTITION = attrgetter("topic", "partition")

_CLAIM = """
    WITH {acked}
    leased AS (
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
               true AS leased_now, false AS kept
        FROM leased
        UNION ALL
        SELECT a.topic, a.partition, a.xid, a.id, 0, false, false, false, false
        FROM jsonb_to_recordset(%(ahead)s::jsonb) AS a(topic text, partition int, xid xid8, id bigint)
        {acked_reading}
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
    SELECT NULL, NULL, NULL, convert_to(json_build_object(
        'reading', (SELECT coalesce(json_agg(json_build_object(
            'topic', topic, 'partition', partition, 'xid', last_processed_transaction_id::text,
            'id', last_processed_id, 'attempts', attempts, 'has_holds', has_holds, 'released', released,
            'leased_now', leased_now, 'kept', kept)), '[]') FROM reading),
        'owned', {owned}, 'horizon', pg_snapshot_xmin(pg_current_snapshot())::text)::text, 'UTF8'),
        NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
"""

# The claim that also acks the batch before it (Relay: under steady traffic the batch's ack waits for the next
# claim, which comes within the linger, and never after the next batch is published): the ack's compare-and-set,
# in the same statement, one statement per batch instead of two. The previous batch was delivered in full and
# nothing else is in flight, so each of its partitions moves to its last row; one that is at home and has more
# work keeps its lease (read on from its new position, as if leased now), the others are released. Its partitions
# are not leased again by the same statement (a statement must not update a row twice): the leases kept cover
# them. ``o`` in the probe is the position the partition moves to (``work`` reads ``o``'s position).
_ACKED = """
    acked AS (
        UPDATE {offsets} target
        SET last_processed_transaction_id = v.to_xid, last_processed_id = v.to_id, attempts = 0,
            last_error = NULL, read_by = {strategy},
            locked_by = CASE WHEN v.home AND more.id IS NOT NULL THEN target.locked_by END,
            available_after = CASE WHEN v.home AND more.id IS NOT NULL
                                   THEN now() + make_interval(secs => %(lease)s) ELSE now() END,
            updated_at = now()
        FROM jsonb_to_recordset(%(acks)s::jsonb) AS v(
            topic text, partition int, from_xid xid8, from_id bigint, to_xid xid8, to_id bigint, home bool)
        LEFT JOIN LATERAL (
            SELECT m.id
            FROM (SELECT v.to_xid AS last_processed_transaction_id, v.to_id AS last_processed_id) o, {messages} m
            WHERE m.topic = v.topic AND m.partition = v.partition AND {work}
            ORDER BY {order} LIMIT 1
        ) more ON true
        WHERE target.topic = v.topic AND target.partition = v.partition AND target.locked_by = %(worker)s
          AND target.last_processed_transaction_id = v.from_xid AND target.last_processed_id = v.from_id
        RETURNING target.topic, target.partition, target.last_processed_transaction_id, target.last_processed_id,
                  target.locked_by IS NOT NULL AS kept,
                  EXISTS (SELECT 1 FROM {holds} h
                          WHERE h.topic = target.topic AND h.partition = target.partition) AS has_holds,
                  EXISTS ({released_target}) AS released
    ),
"""
_ACKED_READING = """
        UNION ALL
        SELECT topic, partition, last_processed_transaction_id, last_processed_id, 0, has_holds, released, true, true
        FROM acked WHERE kept
"""
_NOT_ACKED = """
    AND (o.topic, o.partition) NOT IN (
        SELECT s.topic, s.partition FROM jsonb_to_recordset(%(acks)s::jsonb) AS s(topic text, partition int))
"""
# Never lease a partition this worker has a batch in flight for: should that lease have run out, leasing it again
# would read it from its stored position, behind the batch in flight, beside the read past that batch (its rows
# twice in one claim, and an ack from the wrong base moved the position back). Its ack renews or ends the lease.
_NOT_IN_FLIGHT = """
    AND (o.topic, o.partition) NOT IN (
        SELECT f.topic, f.partition FROM jsonb_to_recordset(%(in_flight)s::jsonb) AS f(topic text, partition int))
"""


class Positional(NamedTuple):
    """A statement with ``$n`` placeholders, and the parameter name each stands for."""

    text: bytes
    names: tuple[str, ...]

    def params(self, values: Mapping[str, object]) -> list[object]:
        return [values[name] for name in self.names]


def positional(query: bytes) -> Positional:
    """``%(name)s`` placeholders made ``$n`` ones, for a RawCursor. psycopg parses a statement's placeholders at every
    execution when its text is longer than 4,096 bytes (it caches shorter ones): the claim is, and that parse was a
    third of the relay's CPU per claim under steady traffic."""
    names: list[str] = []

    def number(match: re.Match[bytes]) -> bytes:
        if match.group(0) == b"%%":
            return b"%"
        name = match.group(1).decode()
        if name not in names:
            names.append(name)
        return b"$%d" % (names.index(name) + 1)

    return Positional(re.sub(rb"%%|%\((\w+)\)s", number, query), tuple(names))


def claim_sql(config: StrategyConfig, *, work: str, order: str, acking: str | None = None) -> Positional:
    """The claim statement for the strategy's condition and read order; ``acking``: the strategy's name, for the
    variant that also acks the previous batch (_ACKED). Compose once per strategy instance (as bytes: psycopg would
    render a composed statement again at every execution)."""
    table = config.table
    parts = {
        "offsets": table.offsets,
        "holds": table.holds,
        "released_target": released_hold(table, "target"),
        "messages": table.messages,
        "work": sql.SQL(work),
        "order": sql.SQL(order),
    }
    exclude = sql.SQL(_NOT_IN_FLIGHT + (_NOT_ACKED if acking else ""))
    return positional(
        sql.SQL(_CLAIM)
        .format(
            acked=sql.SQL(_ACKED).format(strategy=sql.Literal(acking), **parts) if acking else sql.SQL(""),
            acked_reading=sql.SQL(_ACKED_READING if acking else ""),
            owned=sql.SQL(
                "(SELECT coalesce(json_agg(json_build_array(s.topic, s.partition)), '[]') FROM acked s)"
                if acking
                else "NULL::json"
            ),
            candidates=candidates(config, work=work, order=order, exclude=exclude),
            home=IS_HOME,
            columns=sql.SQL(RECORD_COLUMNS),
            **parts,
        )
        .as_bytes(None)
    )


class FoldedAck(NamedTuple):
    """One partition of the batch a claim acks (``acks``): from its lease's position to its last row, and
    whether it is at home (only then may it keep its lease)."""

    lease: PartitionLease
    to_xid: str
    to_id: int
    home: bool


@dataclass
class PartitionRead:
    """One partition of a claim: where it was read from (the compare-and-set base of its ack) and what was read."""

    lease: PartitionLease
    leased_now: bool
    records: list[OutboxRecord] = field(default_factory=list)
    kept: bool = False  # its lease was kept by the ack this claim made (leased_now too: read from its new position)

    @property
    def key(self) -> tuple[str, int]:
        return self.lease.topic, self.lease.partition


@dataclass(frozen=True)
class Reads:
    partitions: list[PartitionRead]
    share: int  # the rows each partition could give: a partition that gave that many may have more
    max_new: int  # how many partitions it could lease: leasing that many, it may have left others waiting
    # A claim that acked the previous batch (``acks``): the partitions whose position it moved (still this worker's).
    owned: frozenset[tuple[str, int]] = frozenset()
    at: float = 0.0  # time.monotonic() before the statement: its leases run from no earlier than this
    horizon: int = 0  # its snapshot's xmin: every transaction below it had ended (partitioned.py reads no further)


def share_of(limit: int, partitions: int) -> int:
    """Each partition's fair share of a batch of ``limit`` rows."""
    return max(1, math.ceil(limit / max(1, partitions)))


def read_partitions(
    cursor: psycopg.Cursor[Any],
    config: StrategyConfig,
    query: Positional,
    *,
    ahead: Sequence[PartitionLease],
    max_new: int,
    limit: int,
    dealt: Mapping[str, object],
    acks: Sequence[FoldedAck] = (),
    in_flight: Collection[tuple[str, int]] = (),
) -> Reads:
    """Lease up to ``max_new`` waiting partitions and read them with the ``ahead`` ones (positions to read past);
    ``cursor``: base.stamped_cursor(raw=True). ``in_flight``: every partition with a batch in flight (those read
    ahead among them), never leased again here. With ``acks`` (``query`` composed with ``acking``), first move
    each of those positions (the previous batch's ack). The positions go as one JSON document: dumping four arrays
    of them cost more CPU than the rest of the claim."""
    positions = json.dumps([{"topic": a.topic, "partition": a.partition, "xid": a.xid, "id": a.last_id} for a in ahead])
    busy = json.dumps([{"topic": topic, "partition": partition} for topic, partition in in_flight])
    params = {
        "lease": config.lease_s,
        "worker": config.worker_id,
        "max_new": max_new,
        "ahead": positions,
        "in_flight": busy,
    }
    if acks:
        params["acks"] = json.dumps(
            [
                {
                    "topic": s.lease.topic,
                    "partition": s.lease.partition,
                    "from_xid": s.lease.xid,
                    "from_id": s.lease.last_id,
                    "to_xid": s.to_xid,
                    "to_id": s.to_id,
                    "home": s.home,
                }
                for s in acks
            ]
        )
    at = time.monotonic()
    rows = cursor.execute(query.text, query.params({**params, "limit": limit, **dealt})).fetchall()
    # The partitions' row is the last (UNION ALL appends); looked for if not, since nothing promises it.
    at = len(rows) - 1 if rows and rows[-1][0] is None else next(i for i, row in enumerate(rows) if row[0] is None)
    document = json.loads(rows.pop(at)[_PAYLOAD])
    by_partition = {
        (p["topic"], p["partition"]): PartitionRead(
            PartitionLease(p["topic"], p["partition"], p["xid"], p["id"], p["attempts"], p["has_holds"], p["released"]),
            p["leased_now"],
            kept=p["kept"],
        )
        for p in document["reading"]
    }
    # A partition's rows come together (one LATERAL read each); grouping by runs stays right if they did not.
    for key, run in groupby(map(OutboxRecord._make, rows), _PARTITION):
        by_partition[key].records.extend(run)
    owned = frozenset((topic, partition) for topic, partition in document["owned"] or ())
    horizon = int(document["horizon"])
    return Reads(list(by_partition.values()), share_of(limit, len(by_partition)), max_new, owned, at, horizon)
