"""Engine room: what the ordered, read-only strategies (partitioned, serialized) share.

They never touch message rows. A worker leases one virtual partition's ``outbox_offsets`` row (the
talk's one-statement ``UPDATE ... FROM (SELECT ... FOR UPDATE SKIP LOCKED)``), reads the rows past
its stored position in order, publishes them, and advances the position with a compare-and-set on
(owner, old position) in the same transaction as any dead letters. A worker that lost its lease (it
was frozen past expiry and another worker took over) therefore advances nothing and dead-letters
nothing: its batch counts as published-but-ack-failed and the new owner publishes it again.

Failures keep the order: the position stops before the first row Kafka did not confirm, and the
partition backs off (``attempts``, ``last_error``, ``available_after`` on the offsets row). Rows after
it that Kafka did confirm are published again on the retry (at-least-once: duplicates bounded by one
batch). A row that can never be delivered (too large, invalid topic) or that ran out of attempts is
copied to the dead-letter table and the position passes it; with ``on_poison="quarantine"`` (the default)
its key's later rows are held until an operator retries or discards it (quarantine.py), with "skip" they
are published without it. The statements on the offsets table are in offsets.py.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import ClassVar

import psycopg
from psycopg import IsolationLevel, sql

from . import offsets
from .base import (
    RECORD_COLUMNS,
    AckResult,
    Claim,
    DeliveryFailure,
    OutboxRecord,
    PublishOutcome,
    Strategy,
    StrategyConfig,
    fetch_records,
)
from .offsets import PartitionLease
from .quarantine import NO_HOLDS, HoldView, Quarantine
from .sharing import Dealer, Home

# Every (topic, partition) pair gets looked at this often (a lease that finds nothing looks at new rows only).
DISCOVERY_INTERVAL_S = 5.0


@dataclass
class _Chain:
    """A leased partition with batches in flight, and how far this worker has read it."""

    lease: PartitionLease
    read_xid: str
    read_id: int
    in_flight: int = 1
    broken: bool = False
    # The partition has holds (quarantine.py): reads are split into rows to publish and rows to withhold.
    has_holds: bool = False
    # A hold was released: no more reading ahead; once the batches in flight ack, the partition is leased
    # again and its held rows go first.
    draining: bool = False

    def extend(self, last: OutboxRecord) -> None:
        self.read_xid, self.read_id = last.transaction_id, last.id
        self.in_flight += 1


class PositionStrategy(Strategy):
    """Lease a partition, read past its position, advance the position only over confirmed rows."""

    ordered: ClassVar[bool] = True

    def __init__(self, conn: psycopg.Connection, config: StrategyConfig) -> None:
        super().__init__(conn, config)
        conn.isolation_level = IsolationLevel.READ_COMMITTED
        self._discovered_at = float("-inf")
        self._seen_id = 0  # the highest message id a discovery covered
        self._chains: dict[tuple[str, int], _Chain] = {}
        self._checked_tx_at = float("-inf")
        self._tx_ids: frozenset[str] | None = None
        self._dealer = Dealer(conn, config.table, config.worker_id, config.lease_s)
        self._quarantine = Quarantine(conn, config, self.read_order)
        # Composed once: composing costs on every claim, and the same text keeps the statements prepared.
        self._read_sql = self._read_query(yielding=False)
        self._read_yielding_sql = self._read_query(yielding=True)
        self._lease_sql = offsets.lease_sql(config, work=self.work_condition, order=self.read_order)
        self._reclaim_own_leases()

    # SQL condition on message row ``m`` and offsets row ``o``: m is past o's position and visible to
    # this strategy. Used both to find partitions with work and to read them.
    work_condition: ClassVar[str]
    # ORDER BY for reading one partition, in publishing order, and the same order in Python.
    read_order: ClassVar[str]

    @staticmethod
    def order_key(record: OutboxRecord) -> tuple[int, int]:
        raise NotImplementedError

    # -- claim -------------------------------------------------------------------------------

    def claim(self, limit: int, avoid: Collection[int] = ()) -> Claim | None:
        """Fair service: a batch is read ahead on a partition still in flight (pipelining) only while no other
        partition this worker could lease has work; otherwise that partition goes first. So a partition that never
        runs dry delays a quiet one by about one batch, not until it runs dry."""
        ahead = self._read_ahead(limit, yield_to_others=True)
        if ahead is not None:
            return ahead
        claim = self._claim_new(limit)
        if claim is None and self._chains:  # the partition that waited was taken by another worker meanwhile
            return self._read_ahead(limit, yield_to_others=False)
        return claim

    def _read_ahead(self, limit: int, *, yield_to_others: bool) -> Claim | None:
        """The next batch of a partition whose previous batch is still in flight, past that batch."""
        for chain in self._chains.values():
            if chain.broken or chain.draining:
                continue
            view = NO_HOLDS
            if chain.has_holds:
                view = self._quarantine.view(chain.lease.topic, chain.lease.partition)
                chain.has_holds, chain.draining = bool(view.keys), view.released
                if chain.draining:
                    continue
            ahead = replace(chain.lease, xid=chain.read_xid, last_id=chain.read_id, attempts=0)
            records = self._read(ahead, limit, yield_to_others=yield_to_others)
            if records:
                chain.extend(records[-1])
                return self._claim_of(ahead, records, view)
        return None

    def _claim_new(self, limit: int) -> Claim | None:
        """Lease the partition that waited longest (home first) and read it."""
        lease = self._lease_partition()
        # A partition new since the last look has no offsets row yet: read the rows written since then (an empty
        # lease is also how every wake-up that finds its rows already published ends: a full look each time cost more
        # than the rest of the cycle).
        if lease is None and self._discover_recent():
            lease = self._lease_partition()
        if lease is None:
            return None
        if lease.released and (release := self._claim_release(lease, limit)) is not None:
            return release
        view = self._quarantine.view(lease.topic, lease.partition) if lease.has_holds else NO_HOLDS
        records = self._read(lease, limit)
        if not records:  # the position moved under us (the lease rules it out) or only a release was due
            self._release(lease)
            return None
        chain = _Chain(lease, records[-1].transaction_id, records[-1].id, has_holds=bool(view.keys))
        self._chains[(lease.topic, lease.partition)] = chain
        claim = self._claim_of(lease, records, view)
        claim.others_waiting = lease.others
        return claim

    def _claim_of(self, lease: PartitionLease, records: list[OutboxRecord], view: HoldView) -> Claim:
        publish, withheld = view.split(records)
        return Claim(
            publish,
            state=lease,
            transactional_id=self._transactional_id(lease),
            withheld=withheld,
            holds_version=self._quarantine.version,
        )

    def _claim_release(self, lease: PartitionLease, limit: int) -> Claim | None:
        """The held rows of the partition's released holds, before anything else of it; nothing is read
        ahead meanwhile. With none left, the holds end here (this worker owns the partition, nothing of it
        is in flight) and the partition is read as usual."""
        records = self._quarantine.read_released(limit, lease.topic, lease.partition)
        if not records:
            self._quarantine.finish_releases(lease.topic, lease.partition)
            return None
        chain = _Chain(lease, lease.xid, lease.last_id, has_holds=True, draining=True)
        self._chains[(lease.topic, lease.partition)] = chain
        return Claim(
            records,
            state=lease,
            transactional_id=self._transactional_id(lease),
            holds_version=self._quarantine.version,
            release=True,
        )

    def _read(self, lease: PartitionLease, limit: int, *, yield_to_others: bool = False) -> list[OutboxRecord]:
        """The partition's next rows past ``lease``'s position. ``yield_to_others``: none at all if another partition
        this worker could lease has work (a one-time filter, not a second statement)."""
        query = self._read_yielding_sql if yield_to_others else self._read_sql
        params = {"topic": lease.topic, "partition": lease.partition, "xid": lease.xid, "id": lease.last_id}
        dealt = self._dealer.current().params() if yield_to_others else {}
        return fetch_records(self.conn, query, {**params, **dealt, "limit": limit})

    def _read_query(self, *, yielding: bool) -> sql.Composed:
        others = sql.SQL("AND NOT EXISTS ({})").format(
            offsets.candidates(self.config, work=self.work_condition, order=self.read_order)
        )
        return sql.SQL(
            """
            SELECT {columns}
            FROM {messages} m,
                 (SELECT %(topic)s::text AS topic, %(partition)s::int AS partition,
                         %(xid)s::xid8 AS last_processed_transaction_id, %(id)s::bigint AS last_processed_id) o
            WHERE m.topic = o.topic AND m.partition = o.partition AND {work} {others}
            ORDER BY {order}
            LIMIT %(limit)s
            """
        ).format(
            columns=sql.SQL(RECORD_COLUMNS),
            messages=self.table.messages,
            work=sql.SQL(self.work_condition),
            others=others if yielding else sql.SQL(""),
            order=sql.SQL(self.read_order),
        )

    @property
    def home(self) -> Home:
        """The partitions this worker serves first (see sharing.py), as last dealt."""
        return self._dealer.home

    def discover_partitions(self) -> int:
        """Create offsets rows for (topic, partition) pairs that have rows but no position yet."""
        return self._discovered(offsets.discover(self.conn, self.table))

    def _discover_recent(self) -> int:
        """The same for rows written since the last look only; every pair when too many were."""
        found = offsets.discover_recent(self.conn, self.table, self._seen_id)
        return self._discovered(found) if found.complete else self.discover_partitions()

    def _discovered(self, found: offsets.Discovered) -> int:
        self._seen_id = max(self._seen_id, found.seen_id)
        if found.created:
            self._dealer.invalidate()  # a new partition is nobody's home until the next deal
        return found.created

    def _lease_partition(self) -> PartitionLease | None:
        return offsets.lease_next(self.conn, self.config, self._lease_sql, self._dealer.current().params())

    def before_publish(self, claim: Claim) -> Claim | None:
        """A batch read ahead is published only if the batch before it acked in full while owned: past a
        failure or a lost lease the position cannot move, so publishing it would only add duplicates
        (the README's bound is one batch). Nor if a hold began or ended since it was read: it may hold a
        row that is held now."""
        lease: PartitionLease = claim.state
        chain = self._chains.get((lease.topic, lease.partition))
        if chain is None or chain.broken or claim.holds_version != self._quarantine.version:
            self.give_back(claim, "the batch before it did not ack in full, or a hold began or ended")
            return None
        return claim

    def transactional_ids(self) -> frozenset[str] | None:
        """Ids of the partitions no other worker holds a live lease on; a producer for any other id was
        (or is about to be) fenced by that worker and only costs threads and connections. At most once
        per DISCOVERY_INTERVAL_S."""
        if not self.config.kafka_transactions:
            return None
        if time.monotonic() - self._checked_tx_at < DISCOVERY_INTERVAL_S:
            return self._tx_ids
        rows = offsets.unleased_by_others(self.conn, self.config)
        self._tx_ids = frozenset(self._transactional_name(topic, partition) for topic, partition in rows)
        self._checked_tx_at = time.monotonic()
        return self._tx_ids

    def _transactional_name(self, topic: str, partition: int) -> str:
        return f"outbox.{self.table.schema}.{topic}.{partition}"

    def _transactional_id(self, lease: PartitionLease) -> str | None:
        if not self.config.kafka_transactions:
            return None
        # One id per virtual partition: a second worker on the same partition fences the first.
        return self._transactional_name(lease.topic, lease.partition)

    def _reclaim_own_leases(self) -> None:
        offsets.reclaim_own(self.conn, self.config)

    # -- ack ---------------------------------------------------------------------------------

    def ack(self, claim: Claim, outcome: PublishOutcome) -> AckResult:
        if claim.release:
            return self._ack_release(claim, outcome)
        lease: PartitionLease = claim.state
        advanced: OutboxRecord | None = None
        acked = 0
        dead: list[DeliveryFailure] = []
        to_hold: list[OutboxRecord] = []
        held_now: set[tuple[str, bytes | None]] = set()  # keys dead-lettered in this batch
        stopped_at: DeliveryFailure | None = None
        head_attempts = lease.attempts
        withheld = {r.id for r in claim.withheld}
        if claim.records and not withheld and not outcome.failed and len(outcome.delivered) == len(claim.records):
            # The common case: Kafka took the whole batch. The read's order is the position's order, so the
            # position moves to the batch's last row without sorting or walking it (13 % of the relay's CPU).
            advanced, acked, head_attempts = claim.records[-1], len(claim.records), 0
        else:
            delivered = {r.id for r in outcome.delivered}
            failures = {f.record.id: f for f in outcome.failed}
            for record in sorted([*claim.records, *claim.withheld], key=self.order_key):
                if record.id in withheld or (record.topic, record.key) in held_now:
                    # Held (even if Kafka took it: it goes out again after the dead letter it waits for).
                    to_hold.append(record)
                    advanced, head_attempts = record, 0
                    continue
                if record.id in delivered:
                    advanced, acked, head_attempts = record, acked + 1, 0
                    continue
                failure = failures[record.id]
                if failure.permanent or (failure.counts and head_attempts + 1 >= self.config.max_attempts):
                    # Attempts of an ordered partition are counted on its offsets row (rows never change).
                    dead.append(replace(failure, record=record._replace(attempts=head_attempts)))
                    advanced, head_attempts = record, 0
                    if self._quarantine.enabled and record.key is not None:
                        held_now.add((record.topic, record.key))
                    continue
                stopped_at = failure
                break
        chain = self._chains.get((lease.topic, lease.partition))
        if chain is not None:
            chain.in_flight -= 1
            if stopped_at is not None:
                chain.broken = True  # the position stops here: batches read past it will not ack
        keep_lease = chain is not None and chain.in_flight > 0 and not chain.broken
        # A transport failure leaves the head's attempts as they were (see FailureKind).
        attempts = head_attempts + stopped_at.counts if stopped_at else 0
        if not dead and not to_hold:
            # The common case: the compare-and-set alone, one statement in its own transaction (not three).
            owned = offsets.advance(
                self.conn, self.config, self.name, lease, advanced, stopped_at, attempts, keep_lease
            )
        else:
            with self.conn.transaction():
                self._dead_letter(dead)
                if self._quarantine.hold(dead) and chain is not None:
                    chain.has_holds = True
                self._quarantine.move_to_held(to_hold, delete=False)
                owned = offsets.advance(
                    self.conn, self.config, self.name, lease, advanced, stopped_at, attempts, keep_lease
                )
                if not owned:
                    raise psycopg.Rollback()  # undo the dead letters too (the transaction block swallows it)
        if chain is not None:
            chain.broken = chain.broken or not owned
            if chain.in_flight == 0:
                del self._chains[(lease.topic, lease.partition)]
        if not owned:
            return AckResult(lost_ownership=len(outcome.delivered))
        retried = len(claim.records) - acked - len(dead) - len([r for r in to_hold if r.id not in withheld])
        return AckResult(acked=acked, retried=retried, dead_lettered=len(dead))

    def _ack_release(self, claim: Claim, outcome: PublishOutcome) -> AckResult:
        """A release batch: done held rows leave the hold, then the partition is released (its lease ends,
        so the next claim looks at what is left, released or not)."""
        lease: PartitionLease = claim.state
        chain = self._chains.get((lease.topic, lease.partition))
        if chain is not None:
            chain.in_flight -= 1
            if chain.in_flight == 0:
                del self._chains[(lease.topic, lease.partition)]
        with self.conn.transaction():
            acked, retried, dead = self._quarantine.ack_released(claim.records, outcome, lease.topic, lease.partition)
            owned = self._release(lease)
            if not owned:
                raise psycopg.Rollback()
        if not owned:
            return AckResult(lost_ownership=len(outcome.delivered))
        return AckResult(acked=acked, retried=retried, dead_lettered=dead)

    def _dead_letter(self, failures: list[DeliveryFailure]) -> None:
        offsets.dead_letter(self.conn, self.config, failures)

    def give_back(self, claim: Claim, error: str) -> None:
        lease: PartitionLease = claim.state
        chain = self._chains.get((lease.topic, lease.partition))
        if chain is not None:
            chain.in_flight -= 1
            chain.broken = True  # this batch was not published: nothing may be read past it
            if chain.in_flight > 0:
                return  # the earlier batch in flight acks, then releases the partition
            del self._chains[(lease.topic, lease.partition)]
        self._release(lease)

    def _release(self, lease: PartitionLease) -> bool:
        return offsets.release(self.conn, self.config, lease)
