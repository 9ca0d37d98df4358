"""Strategy `locking` (seed variant 1): every committed row delivered, rows deleted or marked sent."""

from __future__ import annotations

import json
from collections.abc import Callable

import psycopg

from outbox_pipeline import Message, OutboxTable, enqueue_many
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain, message_ids, row_count, run_workers


def test_locking_delivers_every_committed_row_once_and_deletes_it(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    written = enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i % 7}") for i in range(500)], table=table)
    stats = drain(db.info.dsn, table, kafka.bootstrap_servers, "locking", batch_size=64)
    arrived = message_ids(kafka.consume(topic, expect=500))
    assert sorted(arrived) == sorted(str(w.message_id) for w in written)
    assert stats.published == 500
    assert row_count(db, table) == 0


def test_locking_mark_sent_mode_keeps_rows_with_sent_at(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    enqueue_many(db, [Message(topic, {"n": i}) for i in range(50)], table=table)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "locking", mode="mark-sent")
    assert len(kafka.consume(topic, expect=50)) == 50
    assert row_count(db, table, "sent_at IS NOT NULL") == 50


def test_two_locking_workers_split_the_rows_without_publishing_any_twice(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=2)
    enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i}") for i in range(2000)], table=table)
    stats = run_workers(db.info.dsn, table, kafka.bootstrap_servers, "locking", 2, batch_size=50)
    arrived = message_ids(kafka.consume(topic, expect=2000))
    assert len(arrived) == 2000 and len(set(arrived)) == 2000
    assert sum(s.published for s in stats) == 2000


def test_higher_priority_rows_are_claimed_first(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    enqueue_many(db, [Message(topic, {"p": 0, "n": i}) for i in range(100)], table=table)
    enqueue_many(db, [Message(topic, {"p": 5, "n": i}, priority=5) for i in range(10)], table=table)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "locking", batch_size=20, oldest_share=0.0)
    records = kafka.consume(topic, expect=110)
    first_batch = [json.loads(r.value or b"null")["p"] for r in records[:20]]
    assert first_batch.count(5) == 10


def test_old_low_priority_rows_are_not_starved(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    enqueue_many(db, [Message(topic, {"p": 0, "n": i}) for i in range(10)], table=table)
    enqueue_many(db, [Message(topic, {"p": 9, "n": i}, priority=9) for i in range(100)], table=table)
    relay_stats = drain(
        db.info.dsn, table, kafka.bootstrap_servers, "locking", batch_size=20, oldest_share=0.25, max_seconds=60
    )
    records = kafka.consume(topic, expect=110)
    first_batch = [json.loads(r.value or b"null")["p"] for r in records[:20]]
    assert relay_stats.published == 110
    assert first_batch.count(0) == 5
