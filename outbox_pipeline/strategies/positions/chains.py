"""The partitions a position worker has batches in flight for (its chains), which of them it reads ahead, and the turns
that keep a backlog's other partitions from waiting. See docs/strategies.md#reading-ahead-in-turns."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import psycopg

from ...model import OutboxRecord
from ..base import FRESH_LEASE_SHARE, StrategyConfig
from . import offsets
from .offsets import PartitionLease
from .sharing import Home

Key = tuple[str, int]

# At most this many partitions in one claim (their rows split the batch), besides the one a full claim still leases.
MAX_PARTITIONS_PER_CLAIM = 32
# With Kafka transactions: a transaction per partition, published one after the other, each with a producer of its
# own (transactional.MAX_TRANSACTIONAL_PRODUCERS are kept).
TRANSACTION_PARTITIONS = 4
# Batches in a row a partition is read ahead before it yields its place to partitions that wait.
TURN_BATCHES = 4


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
    # Batches read since it was leased (its turn: TURN_BATCHES).
    batches: int = 0
    # time.monotonic() no later than when its lease was last set to run ``lease_s`` (leased, or kept by an ack).
    renewed_at: float = 0.0

    def extend(self, last: OutboxRecord) -> None:
        self.read_xid, self.read_id = last.transaction_id, last.id
        self.in_flight += 1
        self.batches += 1

    @property
    def ahead(self) -> PartitionLease:
        """Where the next batch is read from (and its compare-and-set base): past the batches in flight."""
        return PartitionLease(self.lease.topic, self.lease.partition, self.read_xid, self.read_id, 0)


class Chains(dict[Key, Chain]):
    """One worker's chains by partition, and what it saw of the partitions that wait."""

    def __init__(self, conn: psycopg.Connection, config: StrategyConfig) -> None:
        super().__init__()
        self.conn = conn
        self.config = config
        # Whether partitions waited at the last claim that could tell (one that leased as many as it could).
        self.others_wait = False

    @property
    def cap(self) -> int:
        """How many partitions a claim reads at most (one more when the chains fill it)."""
        return TRANSACTION_PARTITIONS if self.config.kafka_transactions else MAX_PARTITIONS_PER_CLAIM

    def ahead(self, home: Home, room: int) -> list[PartitionLease]:
        """The positions to read past in the next claim, at most ``room``: chains at home (elsewhere the lease ends
        with the batch in flight and the partition goes back to its home worker), unbroken, not draining, and, while
        partitions wait, not those that had their turn; the fewest batches first."""
        chains = [c for key, c in self.items() if not c.broken and not c.draining and home.holds(*key)]
        if self.others_wait:
            chains = [c for c in chains if c.batches < TURN_BATCHES]
        chains.sort(key=lambda c: c.batches)
        return [c.ahead for c in chains[: max(0, room)]]

    def saw(self, leased: int, could_lease: int) -> None:
        """A claim leased ``leased`` partitions of the ``could_lease`` it asked for: as many means more may wait."""
        self.others_wait = leased >= could_lease > 0

    def lost(self, keys: Iterable[Key]) -> list[Key]:
        """Of these partitions of a batch about to be published, those it may not publish: no chain or a broken one
        (the batch before it did not ack in full), or a lease that ran out and is no longer this worker's. Leases
        older than a tenth of ``lease_s`` are renewed (one statement), so each covers the publish."""
        lost = [key for key in keys if (c := self.get(key)) is None or c.broken]
        now = time.monotonic()
        aged = [
            key
            for key in keys
            if key not in lost and now - self[key].renewed_at > self.config.lease_s * (1 - FRESH_LEASE_SHARE)
        ]
        if aged:
            renewed = offsets.renew_many(self.conn, self.config, aged)
            for key in aged:
                if key in renewed:
                    self[key].renewed_at = now
                else:
                    lost.append(key)
        return lost

    def give_back(self, keys: Iterable[Key]) -> None:
        """These partitions' batch was not published: nothing may be read past it; a partition with no other batch
        in flight is released now (the earlier batch in flight acks, then releases it)."""
        free: list[Key] = []
        for key in keys:
            chain = self.get(key)
            if chain is not None:
                chain.in_flight -= 1
                chain.broken = True
                if chain.in_flight > 0:
                    continue
                del self[key]
            free.append(key)
        self.release(free)

    def release(self, keys: Sequence[Key]) -> None:
        offsets.release_many(self.conn, self.config, keys)
