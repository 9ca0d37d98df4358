"""Partition routing: our murmur2 picks the same partition as librdkafka's Java-compatible partitioner."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from outbox_pipeline.partitioning import murmur2, partition_for

from .kafka_helpers import KafkaProbe


def test_murmur2_matches_kafkas_reference_values() -> None:
    # From Apache Kafka's UtilsTest.testMurmur2 (signed 32-bit results there).
    cases = {
        b"21": -973932308,
        b"foobar": -790332482,
        b"a-little-bit-long-string": -985981536,
        b"a-little-bit-longer-string": -1486304829,
        b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
        b"abc": 479470107,
    }
    for data, signed in cases.items():
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
