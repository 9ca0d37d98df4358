"""Partition routing: our murmur2 picks the same partition as librdkafka's Java-compatible partitioner."""

from __future__ import annotations

import random
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import OutboxTable
from outbox_pipeline.partitioning import murmur2, partition_for
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe

# From Apache Kafka's UtilsTest.testMurmur2 (signed 32-bit results there).
KAFKA_REFERENCE = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


def test_murmur2_matches_kafkas_reference_values() -> None:
    for data, signed in KAFKA_REFERENCE.items():
        assert murmur2(data) == signed & 0xFFFFFFFF, data


@pytest.mark.parametrize("partitions", [1, 3, 7, 16])
def test_partition_for_equals_librdkafkas_murmur2_random_choice(
    kafka: KafkaProbe, new_topic: Callable[..., str], partitions: int
) -> None:
    topic = new_topic("route", partitions=partitions)
    producer = kafka.producer(partitioner="murmur2_random")
    chosen: dict[str, int] = {}

    def on_delivery(err: object, msg: object) -> None:
        assert err is None, err
        chosen[msg.key().decode()] = msg.partition()  # type: ignore[attr-defined]

    keys = [f"customer-{i}" for i in range(100)] + ["", "é☃", "k" * 300]
    for key in keys:
        producer.produce(topic, b"v", key=key.encode(), on_delivery=on_delivery)
    assert producer.flush(30) == 0
    assert chosen == {key: partition_for(key, partitions) for key in keys}


def test_the_sql_murmur2_matches_kafkas_reference_values(db: psycopg.Connection, table: OutboxTable) -> None:
    query = sql.SQL("SELECT {}(%s)").format(table.ident("murmur2"))
    for data, signed in KAFKA_REFERENCE.items():
        assert db.execute(query, (data,)).fetchone() == (signed & 0xFFFFFFFF,), data


def test_the_sql_partition_for_equals_the_python_router_on_100000_random_keys(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    """Any language that inserts through SQL routes a key exactly as the Python API (and Kafka's Java client)."""
    rng = random.Random(16)
    alphabet = "abcXYZ019-_: é☃€𝄞中文ß"  # 1- to 4-byte UTF-8
    keys = ["", *("".join(rng.choices(alphabet, k=rng.randint(1, 40))) for _ in range(100_000))]
    set_topic_partitions(db, table, "routing-7", 7)
    query = sql.SQL("SELECT k, {}('routing-7', k) FROM unnest(%s::text[]) AS k").format(table.ident("partition_for"))

    routed: dict[str, int] = dict(db.execute(query, (keys,)).fetchall())

    mismatched = [k for k in keys if routed[k] != partition_for(k, 7)]
    assert not mismatched, f"{len(mismatched)} keys routed differently, e.g. {mismatched[:3]}"
    no_key = sql.SQL("SELECT {}('routing-7', NULL)").format(table.ident("partition_for"))
    assert db.execute(no_key).fetchone() == (None,)
