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
are published without it.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import ClassVar

import psycopg
from psycopg import IsolationLevel, sql

from ..config import OutboxTable
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
    scope_condition,
)
from .quarantine import NO_HOLDS, HoldView, Quarantine
from .sharing import IS_HOME, Dealer, Home

# New (topic, partition) pairs get an offsets row at most this often while busy.
DISCOVERY_INTERVAL_S = 5.0


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


@dataclass(frozen=True, slots=True)
class PartitionLease:
    topic: str
    partition: int
    xid: str  # last_processed_transaction_id, as xid8 text
    last_id: int
    attempts: int
    has_holds: bool = False
    released: bool = False  # some hold is released and its held rows are ready to publish


class PositionStrategy(Strategy):
    """Lease a partition, read past its position, advance the position only over confirmed rows."""

    ordered: ClassVar[bool] = True

    def __init__(self, conn: psycopg.Connection, config: StrategyConfig) -> None:
        super().__init__(conn, config)
        conn.isolation_level = IsolationLevel.READ_COMMITTED
        self._discovered_at = float("-inf")
        self._chains: dict[tuple[str, int], _Chain] = {}
        self._checked_tx_at = float("-inf")
        self._tx_ids: frozenset[str] | None = None
        self._dealer = Dealer(conn, config.table, config.worker_id, config.lease_s)
        self._quarantine = Quarantine(conn, config, self.read_order)
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
        # Pipelining: keep reading a partition whose previous batch is still in flight, past that batch.
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
            records = self._read(ahead, limit)
            if records:
                chain.extend(records[-1])
                return self._claim_of(ahead, records, view)
        if time.monotonic() - self._discovered_at > DISCOVERY_INTERVAL_S:
            self.discover_partitions()
        lease = self._lease_partition()
        if lease is None and self.discover_partitions():
            lease = self._lease_partition()  # a topic or partition that is new since the last look
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
        return self._claim_of(lease, records, view)

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

    def _read(self, lease: PartitionLease, limit: int) -> list[OutboxRecord]:
        query = sql.SQL(
            """
            SELECT {columns}
            FROM {messages} m,
                 (SELECT %(topic)s::text AS topic, %(partition)s::int AS partition,
                         %(xid)s::xid8 AS last_processed_transaction_id, %(id)s::bigint AS last_processed_id) o
            WHERE m.topic = o.topic AND m.partition = o.partition AND {work}
            ORDER BY {order}
            LIMIT %(limit)s
            """
        ).format(
            columns=sql.SQL(RECORD_COLUMNS),
            messages=self.table.messages,
            work=sql.SQL(self.work_condition),
            order=sql.SQL(self.read_order),
        )
        params = {"topic": lease.topic, "partition": lease.partition, "xid": lease.xid, "id": lease.last_id}
        return fetch_records(self.conn, query, {**params, "limit": limit})

    @property
    def home(self) -> Home:
        """The partitions this worker serves first (see sharing.py), as last dealt."""
        return self._dealer.home

    def discover_partitions(self) -> int:
        """Create offsets rows for (topic, partition) pairs that have rows but no position yet.

        A loose index scan (one index probe per distinct pair), not a DISTINCT over the whole table.
        """
        cur = self.conn.execute(
            sql.SQL(
                """
                WITH RECURSIVE {pairs}
                INSERT INTO {offsets} (topic, partition)
                SELECT topic, partition FROM pairs
                ON CONFLICT (topic, partition) DO NOTHING
                """
            ).format(pairs=partition_pairs(self.table), offsets=self.table.offsets)
        )
        self._discovered_at = time.monotonic()
        if cur.rowcount:
            self._dealer.invalidate()  # a new partition is nobody's home until the next deal
        return cur.rowcount

    def _lease_partition(self) -> PartitionLease | None:
        # The talk's "longest unchecked partition first", restricted to partitions that have work (one
        # index probe per partition), so an empty partition costs no lease round trips and "nothing
        # claimed" really means "nothing to publish". SKIP LOCKED keeps two workers off one partition.
        # The probe is a LIMIT 1 subquery ordered like the read: with 10M relayed rows behind the
        # positions the planner answered EXISTS (which drops ORDER BY and LIMIT inside it) with a
        # bitmap scan of every pending entry of the partition (25,000 in `outbox bench --retained`);
        # in index order, with LIMIT 1, it stops at the first.
        # Home partitions first, then others whose oldest pending row waited STEAL_AFTER_S (sharing.py).
        row = self.conn.execute(
            sql.SQL(
                """
                UPDATE {offsets} target
                SET available_after = now() + make_interval(secs => %(lease)s), locked_by = %(worker)s,
                    updated_at = now()
                FROM (
                    SELECT o.topic, o.partition FROM {offsets} o
                    LEFT JOIN LATERAL (
                        SELECT m.created_at FROM {messages} m
                        WHERE m.topic = o.topic AND m.partition = o.partition AND {work}
                        ORDER BY {order} LIMIT 1
                    ) oldest ON true
                    WHERE o.available_after <= now() {scope}
                      AND (oldest.created_at IS NOT NULL OR EXISTS ({released}))
                      AND ({home} OR coalesce(oldest.created_at, '-infinity')
                                     <= now() - make_interval(secs => %(steal_after)s))
                    ORDER BY {home} DESC, o.available_after
                    LIMIT 1
                    FOR UPDATE OF o SKIP LOCKED
                ) free
                WHERE target.topic = free.topic AND target.partition = free.partition
                RETURNING target.topic, target.partition, target.last_processed_transaction_id::text,
                          target.last_processed_id, target.attempts,
                          EXISTS (SELECT 1 FROM {holds} h
                                  WHERE h.topic = target.topic AND h.partition = target.partition),
                          EXISTS ({released_target})
                """
            ).format(
                offsets=self.table.offsets,
                messages=self.table.messages,
                work=sql.SQL(self.work_condition),
                order=sql.SQL(self.read_order),
                scope=scope_condition(self.config, "o"),
                home=IS_HOME,
                holds=self.table.holds,
                released=_released_hold(self.table, "o"),
                released_target=_released_hold(self.table, "target"),
            ),
            {"lease": self.config.lease_s, "worker": self.config.worker_id, **self._dealer.current().params()},
        ).fetchone()
        return PartitionLease(*row) if row else None

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
        rows = self.conn.execute(
            sql.SQL(
                """
                SELECT o.topic, o.partition FROM {offsets} o
                WHERE o.locked_by IS NULL OR o.locked_by = %(worker)s OR o.available_after <= now()
                """
            ).format(offsets=self.table.offsets),
            {"worker": self.config.worker_id},
        ).fetchall()
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
        """A restarted worker with the same id takes its partitions back at once."""
        self.conn.execute(
            sql.SQL(
                "UPDATE {offsets} SET available_after = now(), locked_by = NULL WHERE locked_by = %(worker)s"
            ).format(offsets=self.table.offsets),
            {"worker": self.config.worker_id},
        )

    # -- ack ---------------------------------------------------------------------------------

    def ack(self, claim: Claim, outcome: PublishOutcome) -> AckResult:
        if claim.release:
            return self._ack_release(claim, outcome)
        lease: PartitionLease = claim.state
        delivered = {r.id for r in outcome.delivered}
        failures = {f.record.id: f for f in outcome.failed}
        withheld = {r.id for r in claim.withheld}
        advanced: OutboxRecord | None = None
        acked = 0
        dead: list[DeliveryFailure] = []
        to_hold: list[OutboxRecord] = []
        held_now: set[tuple[str, bytes | None]] = set()  # keys dead-lettered in this batch
        stopped_at: DeliveryFailure | None = None
        head_attempts = lease.attempts
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
        with self.conn.transaction():
            self._dead_letter(dead)
            if self._quarantine.hold(dead) and chain is not None:
                chain.has_holds = True
            self._quarantine.move_to_held(to_hold, delete=False)
            # A transport failure leaves the head's attempts as they were (see FailureKind).
            attempts = head_attempts + stopped_at.counts if stopped_at else 0
            owned = self._advance(lease, advanced, stopped_at, attempts, keep_lease)
            if not owned:
                raise psycopg.Rollback()  # undo the dead letters too (the transaction block swallows it)
        if chain is not None:
            chain.broken = chain.broken or not owned
            if chain.in_flight == 0:
                del self._chains[(lease.topic, lease.partition)]
        if not owned:
            return AckResult(lost_ownership=len(delivered))
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

    def _advance(
        self,
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
        cur = self.conn.execute(
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
            ).format(offsets=self.table.offsets),
            {
                "to_xid": to.transaction_id if to else None,
                "to_id": to.id if to else None,
                "attempts": attempts,
                "error": failure.error if failure else None,
                "max": self.config.backoff_max_s,
                "base": self.config.backoff_base_s,
                "topic": lease.topic,
                "partition": lease.partition,
                "worker": self.config.worker_id,
                "from_xid": lease.xid,
                "from_id": lease.last_id,
                "keep": keep_lease,
                "lease": self.config.lease_s,
                "strategy": self.name,
            },
        )
        return cur.rowcount == 1

    def _dead_letter(self, failures: list[DeliveryFailure]) -> None:
        """Copy undeliverable rows to the dead letters; message rows themselves are never touched."""
        if not failures:
            return
        self.conn.execute(
            sql.SQL(
                """
                INSERT INTO {dead_letters} (
                    id, message_id, topic, key, type, payload, headers, partition, priority, transaction_id,
                    created_at, attempts, last_error, dead_lettered_by)
                SELECT m.id, m.message_id, m.topic, m.key, m.type, m.payload, m.headers, m.partition, m.priority,
                       m.transaction_id, m.created_at, f.attempts, f.error, %(worker)s
                FROM {messages} m
                JOIN unnest(%(ids)s::bigint[], %(errors)s::text[], %(attempts)s::int[]) AS f(id, error, attempts)
                  ON m.id = f.id
                ON CONFLICT (id) DO UPDATE SET
                    attempts = excluded.attempts, last_error = excluded.last_error,
                    dead_lettered_at = now(), dead_lettered_by = excluded.dead_lettered_by, retried_at = NULL
                """
            ).format(dead_letters=self.table.dead_letters, messages=self.table.messages),
            {
                "ids": [f.record.id for f in failures],
                "errors": [f.error for f in failures],
                "attempts": [f.record.attempts + 1 for f in failures],
                "worker": self.config.worker_id,
            },
        )

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
        cur = self.conn.execute(
            sql.SQL(
                """
                UPDATE {offsets}
                SET available_after = now(), locked_by = NULL, updated_at = now()
                WHERE topic = %(topic)s AND partition = %(partition)s AND locked_by = %(worker)s
                """
            ).format(offsets=self.table.offsets),
            {"topic": lease.topic, "partition": lease.partition, "worker": self.config.worker_id},
        )
        return cur.rowcount == 1


def _released_hold(table: OutboxTable, alias: str) -> sql.Composed:
    """A released hold of the offsets row ``alias``'s partition whose held rows may go out now."""
    return sql.SQL(
        """
        SELECT 1 FROM {holds} h
        WHERE h.topic = {a}.topic AND h.partition = {a}.partition AND h.released_at IS NOT NULL
          AND h.available_after <= now()
        """
    ).format(holds=table.holds, a=sql.Identifier(alias))
