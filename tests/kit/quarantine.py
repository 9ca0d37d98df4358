"""Test kit: an outbox with a poison row in the middle of a key's stream (quarantine), and reading keys back."""

from __future__ import annotations

import psycopg

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.store import set_topic_partitions

from .kafka import KafkaProbe
from .relay import drain, order_by_key

SMALL_PRODUCER = {"message.max.bytes": 2000}  # the oversize row cannot go until the relay runs without it
POISON = 4  # A4 is the poison row, in the middle of key A's stream


def write_keys(
    db: psycopg.Connection, table: OutboxTable, topic: str, keys: str, n: int, *, start: int = 0, poison: int = -1
) -> dict[str, list[int]]:
    """Round i writes row i of each key in one transaction; returns the ids per key, in commit order."""
    ids: dict[str, list[int]] = {key: [] for key in keys}
    for i in range(start, start + n):
        with db.transaction():
            messages = [
                Message(topic, {"i": i, "pad": "x" * (5000 if (key == "A" and i == poison) else 0)}, key=key)
                for key in keys
            ]
            for key, row in zip(keys, enqueue_many(db, messages, serialized=True, table=table), strict=True):
                ids[key].append(row.id)
    return ids


def arrived_by_key(kafka: KafkaProbe, topic: str, expect: int | None = None) -> dict[str, list[int]]:
    """Outbox ids per key in the order Kafka has them (first arrival of each); without ``expect``, until idle."""
    records = kafka.consume(topic, expect=expect, idle_s=2.0)
    return {key.decode(): ids for key, ids in order_by_key(records).items() if key is not None}


def poisoned(
    strategy: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, topic: str
) -> dict[str, list[int]]:
    """Keys A and B, ten rows each, A4 poison; one drain that cannot take A4."""
    set_topic_partitions(db, table, topic, 1)  # both keys in one partition: B must flow past A's hold
    written = write_keys(db, table, topic, "AB", 10, poison=POISON)
    stats = drain(db.info.dsn, table, kafka.bootstrap_servers, strategy, producer=SMALL_PRODUCER, batch_size=3)
    assert stats.dead_lettered == 1
    return written
