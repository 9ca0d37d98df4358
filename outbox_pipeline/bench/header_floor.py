"""What one more Kafka header costs the producer library itself (`outbox bench --trace-headers`): the floor under any
relay's cost for the trace header. See docs/performance.md#trace-headers."""

from __future__ import annotations

import os
import statistics
import uuid
from dataclasses import dataclass

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from ..relay.publisher import DEFAULT_PRODUCER_CONFIG, REQUIRED_PRODUCER_CONFIG
from ..store.record_headers import Headers
from .procstat import own_cpu_s

PARTITIONS = 12
BATCH = 5_000  # messages handed to the producer before each flush, as the relay's bulk batches
# A traceparent as OpenTelemetry writes it: version, trace id, span id, flags.
TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@dataclass(frozen=True)
class HeaderFloor:
    """Medians of interleaved rounds: the hand-written producer's CPU per message without and with the header."""

    plain_us: list[float]
    traced_us: list[float]

    @property
    def added_us(self) -> float:
        return statistics.median(self.traced_us) - statistics.median(self.plain_us)

    def render(self, messages: int) -> str:
        plain, traced = statistics.median(self.plain_us), statistics.median(self.traced_us)
        return (
            f"hand-written producer (confluent-kafka, our producer settings, {messages:,} messages, medians of "
            f"{len(self.plain_us)} interleaved rounds): {plain:.2f} us/msg with our three headers, {traced:.2f} "
            f"with a traceparent too: +{self.added_us:.2f} us (+{traced / plain - 1:.0%}), the client library's own "
            "cost of the header"
        )


def measure(bootstrap: str, *, messages: int, payload_bytes: int, runs: int) -> HeaderFloor:
    topic = f"bench-header-floor-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, PARTITIONS, 1)]).values():
        future.result()
    try:
        plain: list[float] = []
        traced: list[float] = []
        for _ in range(runs):
            plain.append(_produce(bootstrap, topic, messages, payload_bytes, trace=False))
            traced.append(_produce(bootstrap, topic, messages, payload_bytes, trace=True))
        return HeaderFloor(plain, traced)
    finally:
        for future in admin.delete_topics([topic]).values():
            future.result()


def _produce(bootstrap: str, topic: str, messages: int, payload_bytes: int, *, trace: bool) -> float:
    """CPU us per message (this process, the client's threads included) to send and confirm ``messages``."""
    producer = Producer({"bootstrap.servers": bootstrap, **DEFAULT_PRODUCER_CONFIG, **REQUIRED_PRODUCER_CONFIG})
    producer.list_topics(topic, timeout=10)  # connected, with the topic's metadata, before the clock starts
    payload = os.urandom(payload_bytes // 2).hex().encode()
    created_at = b"2026-11-27T07:00:00.123456Z"
    rows = [(f"key-{i % 1000}".encode(), str(uuid.uuid4()).encode(), str(i).encode()) for i in range(messages)]
    failed: list[object] = []

    def on_delivery(error: object, message: object) -> None:
        if error is not None:
            failed.append(error)

    started = own_cpu_s()
    for first in range(0, messages, BATCH):
        for key, message_id, outbox_id in rows[first : first + BATCH]:
            headers: Headers = [("message_id", message_id), ("outbox_id", outbox_id), ("created_at", created_at)]
            if trace:
                headers.append(("traceparent", TRACEPARENT))
            producer.produce(topic, payload, key, headers=headers, on_delivery=on_delivery)
        while len(producer):
            producer.flush(1.0)
    cpu_s = own_cpu_s() - started
    if failed:
        raise RuntimeError(f"header floor: {len(failed)} messages not delivered, the first: {failed[0]}")
    return cpu_s / messages * 1e6
