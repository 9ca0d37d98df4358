"""What the position strategies (partitioned, serialized) share: lease partitions, read past each stored position,
advance each position by compare-and-set only over confirmed rows. See
docs/strategies.md#the-position-strategies-claims-acks-and-failures."""

from __future__ import annotations

import operator
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from itertools import islice
from typing import Any, ClassVar

import psycopg
from psycopg import IsolationLevel

from ...model import AckResult, Claim, OutboxRecord, PublishOutcome
from ..base import Strategy, StrategyConfig, stamped_cursor
from ..quarantine import NO_HOLDS, Quarantine
from . import offsets
from .advance import advance_all, count_by_partition
from .chains import MAX_PARTITIONS_PER_CLAIM, Chain, Chains
from .discovery import Discovery
from .ids import TransactionalIds
from .offsets import Move, PartitionLease
from .reads import FoldedAck, PartitionRead, Reads, claim_sql, read_partitions
from .sharing import Dealer, Home

Key = tuple[str, int]


class PositionStrategy(Strategy):
    """Lease what waits, read past each position, advance each position only over confirmed rows."""

    ordered: ClassVar[bool] = True
    folds_ack: ClassVar[bool] = True
    # One plan per statement, made once (PostgreSQL planned each claim anew: 2-3 ms of its CPU over ten partitions).
    session_settings: ClassVar[Mapping[str, str]] = {
        **Strategy.session_settings,
        "plan_cache_mode": "force_generic_plan",
    }

    def __init__(self, conn: psycopg.Connection, config: StrategyConfig) -> None:
        super().__init__(conn, config)
        conn.isolation_level = IsolationLevel.READ_COMMITTED
        self._chains = Chains(conn, config)
        self._tx_ids = TransactionalIds(conn, config)
        self._dealer = Dealer(conn, config.table, config.worker_id, config.lease_s)
        # A new partition is nobody's home until the next deal.
        self._discovery = Discovery(conn, config.table, found=self._dealer.invalidate)
        # Another worker's partition (one that waited STEAL_AFTER_S) is taken only by a worker whose last claim found
        # no work at home: a claim leases every partition it may, and the first worker of a backlog would otherwise
        # take every partition, leaving the others idle.
        self._may_steal = False
        self._quarantine = Quarantine(conn, config, self.read_order)
        # Composed once: composing costs on every claim, and the same text keeps the statement prepared.
        self._claim_sql = claim_sql(config, work=self.work_condition, order=self.read_order)
        self._ack_and_claim_sql = claim_sql(config, work=self.work_condition, order=self.read_order, acking=self.name)
        self._cursor = stamped_cursor(conn, raw=True)  # kept: making one copies the connection's adapters
        self._horizon = 0  # the last claim statement's snapshot xmin (Reads.horizon)
        self._reclaim_own_leases()

    # SQL condition on message row ``m`` and offsets row ``o``: m is past o's position and visible to
    # this strategy. Used both to find partitions with work and to read them.
    work_condition: ClassVar[str]
    # ORDER BY for reading one partition, in publishing order, and the same order in Python.
    read_order: ClassVar[str]

    @staticmethod
    def order_key(record: OutboxRecord) -> tuple[int, int]:
        raise NotImplementedError

    @staticmethod
    def order_keys(records: Sequence[OutboxRecord]) -> list[Any]:
        """Each row's place in publishing order, comparable like ``order_key``'s, without a Python call per row."""
        raise NotImplementedError

    # -- claim -------------------------------------------------------------------------------

    def claim(self, limit: int, avoid: Collection[int] = ()) -> Claim | None:
        self._discovery.when_due()
        claim = self._claim(limit)
        if claim is None and self._discovery.recent():
            claim = self._claim(limit)
        return claim

    def ack_and_claim(self, limit: int, previous: Claim, outcome: PublishOutcome) -> tuple[AckResult, Claim | None]:
        """One statement: the previous batch's ack and the next claim, when that ack is only position moves (Kafka
        took the whole batch, nothing withheld or released) and nothing else is in flight (the relay's paced cycle)."""
        acks = self._folded_acks(previous, outcome)
        if acks is None:
            return super().ack_and_claim(limit, previous, outcome)
        for key in previous.state:
            del self._chains[key]  # its ack ends them; a kept lease starts a new chain at the new position
        self._discovery.when_due()
        reads = self._read(limit, acks)
        lost = 0
        if len(reads.owned) < len(acks):
            lost = sum(n for key, n in count_by_partition(previous.records).items() if key not in reads.owned)
        result = AckResult(acked=len(previous.records) - lost, lost_ownership=lost)
        claim = self._claim_from(reads, limit)
        if claim is None and self._discovery.recent():
            claim = self._claim(limit)
        return result, claim

    def _folded_acks(self, previous: Claim, outcome: PublishOutcome) -> list[FoldedAck] | None:
        """The previous batch's position moves, when its ack may go in the next claim's statement; None otherwise."""
        state: dict[Key, PartitionLease] = previous.state
        if (
            previous.release
            or previous.withheld
            or outcome.failed
            or len(outcome.delivered) != len(previous.records)
            or self.config.kafka_transactions
            or previous.holds_version != self._quarantine.version
            or len(self._chains) != len(state)
            # Its kept leases must leave room for a partition that waits (one claim leases that many at most).
            or len(state) >= MAX_PARTITIONS_PER_CLAIM
        ):
            return None
        home = self._dealer.home
        moves: list[FoldedAck] = []
        for key, lease in state.items():
            chain = self._chains.get(key)
            if chain is None or chain.in_flight != 1 or chain.broken or chain.draining:
                return None
            # Nothing was read past this batch: where the chain's reading stopped is the batch's last row there.
            moves.append(FoldedAck(lease, chain.read_xid, chain.read_id, home.holds(*key)))
        return moves

    def _claim(self, limit: int, *, again: bool = True) -> Claim | None:
        return self._claim_from(self._read(limit), limit, again=again)

    def _read(self, limit: int, acks: Sequence[FoldedAck] = ()) -> Reads:
        home = self._dealer.current()
        # Read ahead at home only, and in turns (positions/chains.py): reading ahead keeps a lease as long as the
        # partition has work, so the first worker of a backlog kept every partition and the others idled.
        cap = self._chains.cap - len(acks)
        ahead = self._chains.ahead(home, cap)
        # At least one: a claim that could lease nothing would never learn that partitions wait.
        max_new = max(1, cap - len(ahead))
        reads = read_partitions(
            self._cursor,
            self.config,
            self._ack_and_claim_sql if acks else self._claim_sql,
            ahead=ahead,
            max_new=max_new,
            limit=limit,
            dealt={**home.params(), "steal": self._may_steal},
            acks=acks,
            in_flight=self._chains.keys(),
        )
        self._horizon = reads.horizon
        self._may_steal = not any(r.records and home.holds(*r.key) for r in reads.partitions)
        self._chains.saw(sum(r.leased_now and not r.kept for r in reads.partitions), max_new)
        return reads

    def _claim_from(self, reads: Reads, limit: int, *, again: bool = True) -> Claim | None:
        """The claim of what a read leased and read (its partitions' chains extended)."""
        if released := next((r for r in reads.partitions if r.lease.released), None):
            # A released hold's held rows go before anything else of its partition, and alone.
            self._chains.release([r.key for r in reads.partitions if r.leased_now and r is not released])
            release = self._claim_release(released.lease, limit, reads.at)
            return release if release is not None or not again else self._claim(limit, again=False)
        publish: list[OutboxRecord] = []
        withheld: list[OutboxRecord] = []
        state: dict[Key, PartitionLease] = {}
        idle: list[Key] = []
        for read in reads.partitions:
            split = self._split(read, reads.at)
            if split is None:
                if read.leased_now:
                    idle.append(read.key)
                continue
            records, held = split
            publish += records
            withheld += held
            state[read.key] = read.lease
        self._chains.release(idle)
        if not state:
            return None
        return Claim(
            publish,
            state=state,
            transactional_ids=self._tx_ids.of_partitions(state),
            withheld=withheld,
            holds_version=self._quarantine.version,
            # Claim again at once: more partitions may wait than one claim leases, or one gave its whole share.
            others_waiting=sum(r.leased_now and not r.kept for r in reads.partitions) >= reads.max_new > 0
            or any(len(r.records) >= reads.share for r in reads.partitions),
        )

    def _split(self, read: PartitionRead, at: float) -> tuple[list[OutboxRecord], list[OutboxRecord]] | None:
        """A partition's rows of this claim as (to publish, to withhold), its chain extended; None: nothing of it.
        ``at``: when the claim's statement (which set the leases it took) began."""
        if not read.records:
            return None
        chain = self._chains.get(read.key)
        if read.leased_now or chain is None:
            chain = self._chains[read.key] = Chain(read.lease, read.lease.xid, read.lease.last_id, renewed_at=at)
            chain.has_holds = read.lease.has_holds
        view = NO_HOLDS
        if chain.has_holds:
            view = self._quarantine.view(*read.key)
            chain.has_holds, chain.draining = bool(view.keys), view.released
            if chain.draining:  # its released held rows go first: nothing more of it is read meanwhile
                return None
        records = self._in_order(read.records)
        chain.extend(records[-1])
        return view.split(records)

    def _in_order(self, records: list[OutboxRecord]) -> list[OutboxRecord]:
        """The rows in publishing order (the statement returns them so; checked, since order is the promise)."""
        keys = self.order_keys(records)
        if all(map(operator.lt, keys, islice(keys, 1, None))):  # no Python call per row: this runs on every row
            return records
        return sorted(records, key=self.order_key)

    def _claim_release(self, lease: PartitionLease, limit: int, at: float) -> Claim | None:
        """The held rows of the partition's released holds, before anything else of it; nothing is read
        ahead meanwhile. With none left, the holds end here (this worker owns the partition, nothing of it
        is in flight) and the partition is read as usual."""
        records = self._quarantine.read_released(limit, lease.topic, lease.partition)
        if not records:
            self._quarantine.finish_releases(lease.topic, lease.partition)
            self._chains.release([(lease.topic, lease.partition)])
            return None
        chain = Chain(lease, lease.xid, lease.last_id, in_flight=1, has_holds=True, draining=True, renewed_at=at)
        self._chains[(lease.topic, lease.partition)] = chain
        return Claim(
            records,
            state=lease,
            transactional_ids=self._tx_ids.of_partitions([(lease.topic, lease.partition)]),
            holds_version=self._quarantine.version,
            release=True,
        )

    @property
    def home(self) -> Home:
        """The partitions this worker serves first (see sharing.py), as last dealt."""
        return self._dealer.home

    def discover_partitions(self) -> int:
        """Create offsets rows for (topic, partition) pairs that have rows but no position yet (discovery.py)."""
        return self._discovery.everything()

    def before_publish(self, claim: Claim) -> Claim | None:
        """A batch read ahead is published only where the batch before it acked in full while owned, and where
        its lease is still this worker's (renewed if old: positions/chains.py): past a failure or a lost lease the
        position cannot move, so publishing it would only add duplicates (the README's bound is one batch); those
        partitions are given back, the rest goes. Nor if a hold began or ended since it was read: it may hold a row
        that is held now."""
        if claim.release:
            lease: PartitionLease = claim.state
            if claim.holds_version != self._quarantine.version or self._chains.lost([(lease.topic, lease.partition)]):
                self.give_back(claim, "a hold began or ended, or its lease was lost")
                return None
            return claim
        if claim.holds_version != self._quarantine.version:
            self.give_back(claim, "a hold began or ended since it was read")
            return None
        state: dict[Key, PartitionLease] = claim.state
        stale = self._chains.lost(state)
        if not stale:
            return claim
        self._chains.give_back(stale)
        kept = {key: lease for key, lease in state.items() if key not in stale}
        if not kept:
            return None
        return replace(
            claim,
            records=[r for r in claim.records if (r.topic, r.partition) in kept],
            withheld=[r for r in claim.withheld if (r.topic, r.partition) in kept],
            state=kept,
        )

    def transactional_ids(self) -> frozenset[str] | None:
        return self._tx_ids.usable()

    def still_owns(self, partition: tuple[str, int]) -> bool:
        return not self._chains.lost([partition])

    def _reclaim_own_leases(self) -> None:
        offsets.reclaim_own(self.conn, self.config)

    # -- ack ---------------------------------------------------------------------------------

    def ack(self, claim: Claim, outcome: PublishOutcome) -> AckResult:
        if claim.release:
            return self._ack_release(claim, outcome)
        state: dict[Key, PartitionLease] = claim.state
        advances = advance_all(claim, outcome, self.order_key, self.config.max_attempts, self._quarantine.enabled)
        moves: list[Move] = []
        for key, lease in state.items():
            done = advances[key]
            chain = self._chains.get(key)
            if chain is not None:
                chain.in_flight -= 1
                if done.stopped_at is not None:
                    chain.broken = True  # the position stops here: batches read past it will not ack
            keep = chain is not None and chain.in_flight > 0 and not chain.broken
            error = done.stopped_at.error if done.stopped_at else None
            moves.append(Move(lease, done.advanced, done.attempts, error, keep))
        dead = [f for key in state for f in advances[key].dead or ()]
        to_hold = [r for key in state for r in advances[key].to_hold or ()]
        acked_at = time.monotonic()  # a kept lease runs lease_s from the ack on
        if not dead and not to_hold:
            # The common case: the compare-and-sets alone, one statement in its own transaction.
            owned = offsets.advance_many(self.conn, self.config, self.name, moves)
        else:
            with self.conn.transaction():
                owned = offsets.advance_many(self.conn, self.config, self.name, moves)
                # Only where this worker still owned the partition (elsewhere its new owner decides).
                dead = [f for f in dead if (f.record.topic, f.record.partition) in owned]
                offsets.dead_letter(self.conn, self.config, dead)
                held = self._quarantine.hold(dead)
                for failure in dead:
                    chain = self._chains.get((failure.record.topic, failure.record.partition))
                    if chain is not None and (failure.record.topic, failure.record.key) in held:
                        chain.has_holds = True
                self._quarantine.move_to_held([r for r in to_hold if (r.topic, r.partition) in owned], delete=False)
        acked = retried = dead_lettered = lost = 0
        delivered_in = count_by_partition(outcome.delivered) if len(owned) < len(state) else {}
        for key in state:
            chain = self._chains.get(key)
            if chain is not None:
                chain.broken = chain.broken or key not in owned
                if chain.in_flight == 0:
                    del self._chains[key]
                elif not chain.broken:
                    chain.renewed_at = acked_at
            done = advances[key]
            if key in owned:
                acked, retried = acked + done.acked, retried + done.retried
                dead_lettered += len(done.dead or ())
            else:
                lost += delivered_in.get(key, 0)
        return AckResult(acked=acked, lost_ownership=lost, retried=retried, dead_lettered=dead_lettered)

    def _ack_release(self, claim: Claim, outcome: PublishOutcome) -> AckResult:
        """A release batch: done held rows leave the hold, then the partition is released (its lease ends,
        so the next claim looks at what is left, released or not)."""
        lease: PartitionLease = claim.state
        key = (lease.topic, lease.partition)
        chain = self._chains.get(key)
        if chain is not None:
            chain.in_flight -= 1
            if chain.in_flight == 0:
                del self._chains[key]
        with self.conn.transaction():
            acked, retried, dead = self._quarantine.ack_released(claim.records, outcome, lease.topic, lease.partition)
            owned = offsets.release_many(self.conn, self.config, [key]) == 1
            if not owned:
                raise psycopg.Rollback()
        if not owned:
            return AckResult(lost_ownership=len(outcome.delivered))
        return AckResult(acked=acked, retried=retried, dead_lettered=dead)

    def give_back(self, claim: Claim, error: str) -> None:
        if claim.release:
            lease: PartitionLease = claim.state
            self._chains.give_back([(lease.topic, lease.partition)])
        else:
            self._chains.give_back(list(claim.state))
