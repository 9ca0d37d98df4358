"""Steady traffic (issue 29): a worker serves its partitions in turns, so a busy partition cannot starve a quiet one,
and a batch finishes when Kafka confirms it, every delivery accounted for."""

from __future__ import annotations

import threading
from collections.abc import Callable

import psycopg
import pytest

from outbox_pipeline import Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.model import PublishOutcome
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import wait_until
from tests.kit.relay import make_relay

ORDERED_POSITIONS = ["partitioned", "serialized"]
# About one batch: the one in Kafka, the one read ahead, the one being read.
BUSY_BATCHES_ALLOWED = 3


@pytest.mark.parametrize("strategy", ORDERED_POSITIONS)
def test_a_row_of_a_quiet_partition_is_published_within_a_batch_or_two_of_a_busy_one(
    strategy: str,
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    """One worker, two partitions; partition 0 is fed faster than the worker can publish it. A row written to
    partition 1 must not wait for partition 0 to run dry (it never does here): counted in batches, not seconds."""
    topic = new_topic(partitions=2)
    set_topic_partitions(db, table, topic, 2)
    batches: list[set[int]] = []  # the virtual partitions of every batch, in the order the relay acked them
    lock = threading.Lock()

    def observe(outcome: PublishOutcome) -> None:
        with lock:
            batches.append({r.partition for r in outcome.delivered})

    stop = threading.Event()
    relay = make_relay(
        dsn, table, kafka.bootstrap_servers, strategy, batch_size=10, stop=stop, until_empty=False, max_seconds=120
    )
    relay.observer = observe
    relay_thread = threading.Thread(target=relay.run)

    fed = threading.Semaphore(0)  # released after each busy transaction commits

    def feed() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                messages = [Message(topic, {"busy": i}, key="busy", partition=0) for i in range(50)]
                enqueue_many(conn, messages, serialized=strategy == "serialized", table=table)
                fed.release()

    serialized = strategy == "serialized"
    enqueue(db, topic, {"quiet": 0}, key="quiet", partition=1, serialized=serialized, table=table)  # a known one
    feeder = threading.Thread(target=feed)
    feeder.start()
    relay_thread.start()
    try:
        wait_until("both partitions to be served", lambda: any(1 in b for b in batches) and len(batches) >= 5, 30)
        with lock:
            committed = len(batches)  # no batch acked before the quiet row was written can hold it
        enqueue(db, topic, {"quiet": 1}, key="quiet", partition=1, serialized=serialized, table=table)
        # partitioned reads a transaction's rows once every older one has ended: the busy transaction in flight when
        # the quiet row committed ends first. Count from there, from when the quiet row can be read.
        while fed.acquire(blocking=False):
            pass
        assert fed.acquire(timeout=30)
        with lock:
            readable = len(batches)
        wait_until(
            "the quiet row, or 200 more batches of the busy partition",
            lambda: any(1 in b for b in batches[committed:]) or len(batches) - readable > 200,
            60,
        )
    finally:
        stop.set()
        feeder.join()
        relay_thread.join()
    with lock:
        served = next((i for i, b in enumerate(batches) if i >= committed and 1 in b), None)
    waited = (served if served is not None else len(batches)) - readable
    assert served is not None and waited <= BUSY_BATCHES_ALLOWED, (
        f"the quiet row went out after {waited} batches of the busy one"
    )


@pytest.mark.parametrize("kafka_transactions", [False, True], ids=["plain", "kafka-transactions"])
@pytest.mark.parametrize("strategy", ORDERED_POSITIONS)
def test_every_partition_of_a_backlog_moves_before_half_of_it_is_relayed(
    strategy: str,
    kafka_transactions: bool,
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    """One worker, a backlog over more partitions than one claim leases (32; with Kafka transactions, a transaction
    per partition, 4), each many batches deep. Partitions read ahead keep their lease while they have work: the others
    must still get turns while they are busy, not wait for them to run dry (one at a time with Kafka transactions)."""
    partitions, rows = (12, 100) if kafka_transactions else (40, 50)
    topic = new_topic(partitions=4)
    set_topic_partitions(db, table, topic, partitions)
    backlog = [Message(topic, {"n": n}, key=f"k{n}", partition=n % partitions) for n in range(partitions * rows)]
    enqueue_many(db, backlog, serialized=strategy == "serialized", table=table)
    delivered = 0
    before_first: dict[int, int] = {}  # partition -> rows delivered before its first row was

    def observe(outcome: PublishOutcome) -> None:
        nonlocal delivered
        for partition in {r.partition for r in outcome.delivered}:
            before_first.setdefault(partition, delivered)
        delivered += len(outcome.delivered)

    relay = make_relay(
        dsn, table, kafka.bootstrap_servers, strategy, batch_size=20, kafka_transactions=kafka_transactions
    )
    relay.observer = observe
    stats = relay.run()

    assert stats.published >= len(backlog) and sorted(before_first) == list(range(partitions))
    late = {p: n for p, n in before_first.items() if n >= len(backlog) / 2}
    assert not late, f"partitions whose first row went out after half the backlog ({len(backlog)} rows): {late}"
