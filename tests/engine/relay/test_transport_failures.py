"""A broker outage is not the records' fault: however many publishes it fails, nothing is dead-lettered.

Only failures that are the record's own (too large, invalid topic, an explicit per-record error) count
toward ``max_attempts``; see ``FailureKind``. Here ``max_attempts=2`` and the broker stays frozen for
at least four failed publishes of the same rows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.localstack import LocalBroker
from outbox_pipeline.model import STRATEGY_NAMES
from outbox_pipeline.store import set_topic_partitions
from outbox_pipeline.strategies import strategy_class
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import make_relay, message_ids, order_by_key

# Fails a batch within 1 s of a frozen broker and reconnects within 0.5 s of its return (the default
# reconnect backoff grows to 10 s, which only makes the test wait).
FAST_FAILING_PRODUCER = {
    "message.timeout.ms": 1000,
    "request.timeout.ms": 500,
    "retry.backoff.ms": 100,
    "reconnect.backoff.ms": 100,
    "reconnect.backoff.max.ms": 500,
}


def _failed_publishes(db: psycopg.Connection, table: OutboxTable, strategy: str) -> str | None:
    """The last error recorded for the rows (row strategies) or partitions (ordered ones)."""
    target = table.offsets if strategy in {"partitioned", "serialized"} else table.messages
    row = db.execute(sql.SQL("SELECT max(last_error) FROM {}").format(target)).fetchone()
    return row[0] if row else None


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_a_broker_outage_longer_than_max_attempts_dead_letters_nothing_and_loses_nothing(
    strategy: str,
    db: psycopg.Connection,
    table: OutboxTable,
    broker: LocalBroker,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    topic = new_topic()
    set_topic_partitions(db, table, topic, 1)
    messages = [Message(topic, {"n": i}, key=f"k{i % 3}") for i in range(30)]
    written = [str(w.message_id) for w in enqueue_many(db, messages, serialized=strategy == "serialized", table=table)]
    stop = threading.Event()
    relay = make_relay(
        db.info.dsn,
        table,
        kafka.bootstrap_servers,
        strategy,
        batch_size=10,
        producer=FAST_FAILING_PRODUCER,
        stop=stop,
        until_empty=False,
        max_seconds=180,
        max_attempts=2,
        backoff_base_s=0.05,
        backoff_max_s=0.2,
        # The relay's own pause after a batch Kafka took none of stays short, so the outage sees many publishes.
        settings={"error_backoff_max_s": 0.3},
    )
    broker.freeze()
    worker = threading.Thread(target=relay.run)
    try:
        worker.start()
        deadline = time.monotonic() + 90
        while relay.stats.batches < 3:  # the same head rows each time: 3 publishes > max_attempts=2
            assert time.monotonic() < deadline, f"only {relay.stats.batches} publishes failed during the outage"
            time.sleep(0.2)
        assert relay.stats.dead_lettered == 0
        assert _failed_publishes(db, table, strategy), "the failures were not recorded for the lag report"
    finally:
        broker.thaw()
    records = kafka.consume(topic, expect=len(written), deadline_s=90)
    stop.set()
    worker.join()
    dead = db.execute(sql.SQL("SELECT count(*) FROM {}").format(table.dead_letters)).fetchone()
    assert dead == (0,), "a broker outage turned into dead letters"
    assert set(message_ids(records)) == set(written), "messages were lost"
    if strategy_class(strategy).ordered:
        for key, ids in order_by_key(records).items():
            assert ids == sorted(ids), f"key {key!r} out of order: {ids}"
