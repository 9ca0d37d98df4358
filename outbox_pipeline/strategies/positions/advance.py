"""How far a batch's outcome advances each partition of a position claim, and what it dead-letters or holds: bookkeeping
without SQL, written by one ack statement. See docs/strategies.md#one-claim-for-many-partitions."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace

from ...model import Claim, DeliveryFailure, OutboxRecord, PublishOutcome
from .offsets import PartitionLease

Key = tuple[str, int]
OrderKey = Callable[[OutboxRecord], tuple[int, int]]


@dataclass
class Advance:
    """One partition's share of a batch's outcome."""

    advanced: OutboxRecord | None = None
    acked: int = 0
    attempts: int = 0
    stopped_at: DeliveryFailure | None = None
    dead: list[DeliveryFailure] | None = None
    to_hold: list[OutboxRecord] | None = None
    retried: int = 0


def advance_all(
    claim: Claim, outcome: PublishOutcome, order_key: OrderKey, max_attempts: int, quarantine: bool
) -> dict[Key, Advance]:
    """How far each partition of the claim advances; ``quarantine``: a dead letter holds its key's later rows."""
    state: dict[Key, PartitionLease] = claim.state
    if not claim.withheld and not outcome.failed and len(outcome.delivered) == len(claim.records):
        # The common case: Kafka took the whole batch. Each partition's rows are in the position's order, so each
        # position moves to its last row without sorting or walking them (13 % of the relay's CPU once).
        if len(state) == 1:  # a bulk drain's batches: one partition
            (only,) = state
            return {only: Advance(claim.records[-1] if claim.records else None, len(claim.records))}
        last: dict[Key, OutboxRecord] = {}
        counts: dict[Key, int] = {}
        for record in claim.records:
            key = (record.topic, record.partition)
            last[key], counts[key] = record, counts.get(key, 0) + 1
        return {key: Advance(last.get(key), counts.get(key, 0)) for key in state}
    delivered = {r.id for r in outcome.delivered}
    failures = {f.record.id: f for f in outcome.failed}
    withheld = {r.id for r in claim.withheld}
    rows: dict[Key, list[OutboxRecord]] = {key: [] for key in state}
    for record in (*claim.records, *claim.withheld):
        rows[(record.topic, record.partition)].append(record)
    return {
        key: _advance(lease, sorted(rows[key], key=order_key), withheld, delivered, failures, max_attempts, quarantine)
        for key, lease in state.items()
    }


def _advance(
    lease: PartitionLease,
    records: Sequence[OutboxRecord],
    withheld: Collection[int],
    delivered: Collection[int],
    failures: dict[int, DeliveryFailure],
    max_attempts: int,
    quarantine: bool,
) -> Advance:
    """One partition, in order: how far its position moves, what is dead-lettered or held, where it stops."""
    done = Advance(attempts=lease.attempts, dead=[], to_hold=[])
    assert done.dead is not None and done.to_hold is not None
    held_now: set[tuple[str, bytes | None]] = set()  # keys dead-lettered in this batch
    for record in records:
        if record.id in withheld or (record.topic, record.key) in held_now:
            # Held (even if Kafka took it: it goes out again after the dead letter it waits for).
            done.to_hold.append(record)
            done.advanced, done.attempts = record, 0
            continue
        if record.id in delivered:
            done.advanced, done.acked, done.attempts = record, done.acked + 1, 0
            continue
        failure = failures[record.id]
        if failure.permanent or (failure.counts and done.attempts + 1 >= max_attempts):
            # Attempts of an ordered partition are counted on its offsets row (rows never change).
            done.dead.append(replace(failure, record=record._replace(attempts=done.attempts)))
            done.advanced, done.attempts = record, 0
            if quarantine and record.key is not None:
                held_now.add((record.topic, record.key))
            continue
        done.stopped_at = failure
        # A transport failure leaves the head's attempts as they were (see FailureKind).
        done.attempts += failure.counts
        break
    if done.stopped_at is None:
        done.attempts = 0
    newly_held = len([r for r in done.to_hold if r.id not in withheld])
    done.retried = len([r for r in records if r.id not in withheld]) - done.acked - len(done.dead) - newly_held
    return done


def count_by_partition(records: Iterable[OutboxRecord]) -> dict[Key, int]:
    counts: dict[Key, int] = {}
    for record in records:
        key = (record.topic, record.partition)
        counts[key] = counts.get(key, 0) + 1
    return counts
