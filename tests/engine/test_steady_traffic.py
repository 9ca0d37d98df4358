"""Steady traffic (issue 29): a worker serves its partitions in turns, so a busy partition cannot starve a quiet one,
and a batch finishes when Kafka confirms it, every delivery accounted for."""

from __future__ import annotations

import threading
from collections.abc import Callable

import psycopg
import pytest

from outbox_pipeline import Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.schema import set_topic_partitions
from outbox_pipeline.strategies.base import PublishOutcome
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import wait_until
from tests.kit.relay import make_relay

ORDERED_POSITIONS = ["partitioned", "serialized"]
# About one batch: the one in Kafka, the one read ahead, the one being read; for partitioned, also the busy writer's
# transaction in flight when the quiet row committed (older transaction ids first).
BUSY_BATCHES_ALLOWED = 5


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

    def feed() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                messages = [Message(topic, {"busy": i}, key="busy", partition=0) for i in range(50)]
                enqueue_many(conn, messages, serialized=strategy == "serialized", table=table)

    serialized = strategy == "serialized"
    enqueue(db, topic, {"quiet": 0}, key="quiet", partition=1, serialized=serialized, table=table)  # a known one
    feeder = threading.Thread(target=feed)
    feeder.start()
    relay_thread.start()
    try:
        wait_until("both partitions to be served", lambda: any(1 in b for b in batches) and len(batches) >= 5, 30)
        with lock:
            before = len(batches)
        enqueue(db, topic, {"quiet": 1}, key="quiet", partition=1, serialized=serialized, table=table)
        wait_until(
            "the quiet row, or 200 more batches of the busy partition",
            lambda: any(1 in b for b in batches[before:]) or len(batches) - before > 200,
            60,
        )
    finally:
        stop.set()
        feeder.join()
        relay_thread.join()
    with lock:
        after = batches[before:]
    quiet_at = next((i for i, b in enumerate(after) if 1 in b), None)
    assert quiet_at is not None and quiet_at <= BUSY_BATCHES_ALLOWED, (
        f"the quiet row went out after {quiet_at if quiet_at is not None else len(after)} batches of the busy one"
    )
