"""Reading back what arrived in Kafka: assign() partitions explicitly (group joins are slow on the
local broker) and read until every expected record is in or the broker stays idle."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import cast

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from outbox_pipeline.localstack import Broker


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]


class KafkaProbe:
    def __init__(self, bootstrap_servers: str) -> None:
        self.bootstrap_servers = bootstrap_servers

    def producer(self, **overrides: object) -> Producer:
        config: dict[str, object] = {
            "bootstrap.servers": self.bootstrap_servers,
            "enable.idempotence": True,
            "acks": "all",
        }
        config.update(overrides)
        return Producer(config)

    def consume(
        self,
        topic: str,
        *,
        expect: int | None = None,
        idle_s: float = 2.0,
        deadline_s: float = 60.0,
        isolation: str = "read_committed",
    ) -> list[Record]:
        """Records of every partition of ``topic``: until ``expect`` arrived, else until idle.

        With ``expect``, ``idle_s`` does not end the wait: asking for more than will ever arrive waits the whole
        ``deadline_s``. To read everything after the relay has returned (duplicates included), leave ``expect`` out.
        """
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap_servers,
                "group.id": f"probe-{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "isolation.level": isolation,
            }
        )
        try:
            metadata = consumer.list_topics(topic, timeout=10)
            partitions = sorted(metadata.topics[topic].partitions)
            consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
            records: list[Record] = []
            start = last = time.monotonic()
            while time.monotonic() - start < deadline_s:
                if expect is not None and len(records) >= expect:
                    break
                if expect is None and time.monotonic() - last > idle_s:
                    break
                msg = consumer.poll(0.2)
                if msg is None:
                    continue
                error = msg.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise RuntimeError(f"consume error: {error}")
                last = time.monotonic()
                got_topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
                assert got_topic is not None and partition is not None and offset is not None  # a consumed message
                # Consumed header values are bytes (the stubs also allow the producer side's str).
                headers = cast(list[tuple[str, bytes]], msg.headers() or [])
                records.append(Record(got_topic, partition, offset, msg.key(), msg.value(), dict(headers)))
            return records
        finally:
            consumer.close()


def shows_only_committed(broker: Broker) -> bool:
    """Whether ``broker`` hides aborted transactions from read_committed consumers: Apache Kafka does, Tansu 0.6 not."""
    return broker.name != "Tansu"
