"""What the fault scenarios share beyond the test kit: reading everything back from Kafka until idle, the
lost/phantom/duplicate tally and the FAULT figures line."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from tests.kit.kafka import Record

STRATEGIES = ("locking", "advisory", "lease", "partitioned", "serialized")
POSITION_STRATEGIES = frozenset({"partitioned", "serialized"})
# Fails fast enough for tests: a frozen or unreachable broker reports every message failed within 1 s.
FAST_FAILING_PRODUCER: dict[str, object] = {
    "message.timeout.ms": 1000,
    "request.timeout.ms": 500,
    "retry.backoff.ms": 100,
    "reconnect.backoff.max.ms": 500,
}

# The relay pipelines: up to two batches are claimed and not yet acked (one confirmed by Kafka and being acked,
# the next already handed to the producer), so one fault (a kill, a lost connection, an expired lease) can make
# two batches go out again.
IN_FLIGHT_BATCHES = 2

FIGURES: list[str] = []


@dataclass(frozen=True)
class TimedRecord(Record):
    """A record with its Kafka timestamp (CreateTime: when the relay produced it), in ms since the epoch."""

    timestamp_ms: int = 0


def report(
    scenario: str, strategy: str, *, messages: int, lost: int, phantom: int, dupes: int, seconds: float, **extra: object
) -> str:
    """Print (and keep, for the session summary) one `FAULT ...` figures line."""
    line = (
        f"FAULT {scenario} {strategy}: messages={messages} lost={lost} phantom={phantom} dupes={dupes} "
        f"time={seconds:.1f}s"
    )
    if extra:
        line += " " + " ".join(f"{k}={v}" for k, v in extra.items())
    print(line, flush=True)
    FIGURES.append(line)
    return line


# -- what arrived versus what was committed -------------------------------------------------------


@dataclass(frozen=True)
class Tally:
    messages: int
    lost: set[str]
    phantom: set[str]
    dupes: int
    arrived: int

    @property
    def figures(self) -> dict[str, int]:
        return {"messages": self.messages, "lost": len(self.lost), "phantom": len(self.phantom), "dupes": self.dupes}


def tally(committed: Iterable[str], records: Sequence[Record]) -> Tally:
    """lost: committed, never arrived. phantom: arrived, never committed. dupes: arrivals beyond the first."""
    expected = set(committed)
    ids = [r.headers["message_id"].decode() for r in records]
    seen = set(ids)
    return Tally(len(expected), expected - seen, seen - expected, len(ids) - len(seen), len(ids))


def consume(
    bootstrap: str,
    topics: Iterable[str],
    expected: Iterable[str] = (),
    *,
    quiet_s: float = 1.0,
    idle_s: float = 6.0,
    deadline_s: float = 90.0,
    isolation: str = "read_uncommitted",
) -> list[TimedRecord]:
    """Every record of ``topics`` from the beginning, until idle (never trusting high watermarks).

    Once every ``expected`` message_id is in, ``quiet_s`` without a new record ends it (late duplicates and
    phantoms are already in the log by then); before that, ``idle_s`` without one gives up. ``read_uncommitted`` sees
    everything that reached the log, phantoms and aborted Kafka transactions included; ``read_committed`` what an
    application consuming transactions sees.
    """
    wanted = set(expected)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"faults-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "isolation.level": isolation,
        }
    )
    try:
        assignment = []
        for topic in topics:
            metadata = consumer.list_topics(topic, timeout=10)
            assignment += [
                TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(metadata.topics[topic].partitions)
            ]
        consumer.assign(assignment)
        records: list[TimedRecord] = []
        start = last = time.monotonic()
        while (now := time.monotonic()) - start < deadline_s:
            quiet = now - last
            if quiet >= idle_s or (not wanted and quiet >= quiet_s):
                break
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            error = msg.error()
            if error is not None:
                if error.code() in (KafkaError._PARTITION_EOF, KafkaError.UNKNOWN_TOPIC_OR_PART):
                    continue
                raise RuntimeError(f"consume error: {error}")
            last = time.monotonic()
            got_topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
            assert got_topic is not None and partition is not None and offset is not None  # a consumed message
            # Consumed header values are bytes (the stubs also allow the producer side's str).
            headers = dict(cast(list[tuple[str, bytes]], msg.headers() or []))
            _, timestamp_ms = msg.timestamp()
            records.append(TimedRecord(got_topic, partition, offset, msg.key(), msg.value(), headers, timestamp_ms))
            wanted.discard(headers["message_id"].decode())
        return records
    finally:
        consumer.close()
