"""The position strategies read batch N+1 while batch N is in Kafka (pipelining). What N+1 holds must still be this
worker's when it is published (issue 40, cases 14 and 15): a lease that ran out meanwhile and went to another worker
is not published over, and a lease that ran out is never taken again by the read that goes past it."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.model import Claim, DeliveryFailure, PublishOutcome
from outbox_pipeline.store import set_topic_partitions
from outbox_pipeline.strategies import PositionStrategy, StrategyConfig, strategy_class
from tests.kit.probes import positions, wait_until

ORDERED = ["partitioned", "serialized"]
TOPIC = "ahead"


def _worker(
    connect: Callable[[], psycopg.Connection], table: OutboxTable, strategy: str, **config: object
) -> PositionStrategy:
    instance = strategy_class(strategy)(connect(), StrategyConfig(table=table, **config))  # type: ignore[arg-type]
    assert isinstance(instance, PositionStrategy)
    return instance


def _write(db: psycopg.Connection, table: OutboxTable, strategy: str, partition: int, count: int) -> None:
    messages = [Message(TOPIC, {"n": n}, key=f"k{partition}", partition=partition) for n in range(count)]
    enqueue_many(db, messages, serialized=strategy == "serialized", table=table)


def _lease_ran_out(db: psycopg.Connection, table: OutboxTable, partition: int) -> bool:
    row = db.execute(
        sql.SQL("SELECT available_after <= now() FROM {} WHERE topic = %s AND partition = %s").format(table.offsets),
        (TOPIC, partition),
    ).fetchone()
    return bool(row and row[0])


def _partitions(claim: Claim | None) -> set[int]:
    return {r.partition for r in claim.records} if claim is not None else set()


@pytest.mark.parametrize("strategy", ORDERED)
def test_a_partition_leased_by_a_read_ahead_claim_is_not_published_once_another_worker_took_its_expired_lease(
    strategy: str, db: psycopg.Connection, table: OutboxTable, connect: Callable[[], psycopg.Connection]
) -> None:
    """A slow broker: batch N is in Kafka longer than the lease, and the claim read meanwhile (N+1) leased a partition
    N did not have. Its lease ran out before N+1 went to Kafka and another worker took it: N+1 publishes the rest,
    and nothing of that partition (its new owner publishes it)."""
    set_topic_partitions(db, table, TOPIC, 2)
    _write(db, table, strategy, 0, 20)
    slow = _worker(connect, table, strategy, worker_id="slow", lease_s=0.5)
    first = slow.claim(10)  # N
    assert _partitions(first) == {0}
    _write(db, table, strategy, 1, 10)
    slow.discover_partitions()
    ahead = slow.claim(10)  # N+1, read while N is in Kafka
    assert _partitions(ahead) == {0, 1}
    wait_until("partition 1's lease to run out", lambda: _lease_ran_out(db, table, 1), 10)
    other = _worker(connect, table, strategy, worker_id="other", partitions=frozenset({(TOPIC, 1)}))
    taken = other.claim(10)
    assert _partitions(taken) == {1}

    assert first is not None and ahead is not None and taken is not None
    slow.ack(first, PublishOutcome(first.records, []))  # N: Kafka took it, partition 0 is still the slow worker's
    ready = slow.before_publish(ahead)

    assert _partitions(ready) == {0}, "the read-ahead batch publishes a partition another worker holds now"
    assert ready is not None and not {r.id for r in ready.records} & {r.id for r in taken.records}


def _read_ahead_after_the_lease_ran_out(
    db: psycopg.Connection, table: OutboxTable, connect: Callable[[], psycopg.Connection], strategy: str
) -> tuple[PositionStrategy, Claim, Claim]:
    """Batch N of partition 0, then its lease runs out while N is in Kafka (nobody takes it), then N+1 is read."""
    set_topic_partitions(db, table, TOPIC, 1)
    _write(db, table, strategy, 0, 30)
    worker = _worker(connect, table, strategy, worker_id="slow", lease_s=0.5)
    first = worker.claim(10)
    assert first is not None and len(first.records) == 10
    wait_until("the lease to run out", lambda: _lease_ran_out(db, table, 0), 10)
    ahead = worker.claim(10)
    assert ahead is not None
    return worker, first, ahead


@pytest.mark.parametrize("strategy", ORDERED)
def test_a_read_ahead_after_the_lease_ran_out_reads_no_row_of_the_batch_in_flight_again(
    strategy: str, db: psycopg.Connection, table: OutboxTable, connect: Callable[[], psycopg.Connection]
) -> None:
    _, first, ahead = _read_ahead_after_the_lease_ran_out(db, table, connect, strategy)

    again = {r.id for r in ahead.records} & {r.id for r in first.records}
    assert not again, f"the read-ahead batch holds {len(again)} rows of the batch in flight"
    assert min(r.id for r in ahead.records) > max(r.id for r in first.records)


@pytest.mark.parametrize("strategy", ORDERED)
def test_a_position_never_moves_back_when_a_batch_read_ahead_after_the_lease_ran_out_fails(
    strategy: str, db: psycopg.Connection, table: OutboxTable, connect: Callable[[], psycopg.Connection]
) -> None:
    worker, first, ahead = _read_ahead_after_the_lease_ran_out(db, table, connect, strategy)
    worker.ack(first, PublishOutcome(first.records, []))
    after_first = positions(db, table)[(TOPIC, 0)].id
    ready = worker.before_publish(ahead)
    assert ready is not None
    failed = ready.records[2]  # Kafka confirms the rows before it
    worker.ack(
        ready,
        PublishOutcome(
            [r for r in ready.records if r is not failed], [DeliveryFailure(failed, "broker unreachable", "transport")]
        ),
    )

    assert positions(db, table)[(TOPIC, 0)].id >= after_first, "the position moved back over relayed rows"
