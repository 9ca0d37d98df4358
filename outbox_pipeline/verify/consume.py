"""Consuming every partition of the topics into the verify workspace, in chunks. See
docs/operations.md#checking-delivery-outbox-verify."""

from __future__ import annotations

import datetime as dt
import logging
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from ..config import redact_kafka_error
from ..errors import ConfigurationError, OutboxError
from .ledger import Ledger

log = logging.getLogger(__name__)

# Rows per COPY: the only records Python holds at once.
CHUNK_ROWS = 10_000

# A consumer that reads everything once and commits nothing. The prefetch queue is librdkafka's memory,
# not Python's: bounded so that verify stays well inside the benchmark's memory budget.
DEFAULT_CONSUMER_CONFIG: Mapping[str, object] = {
    "queued.max.messages.kbytes": 16_384,
    "queued.min.messages": 20_000,
    "max.partition.fetch.bytes": 4 << 20,
    "fetch.max.bytes": 16 << 20,
}
REQUIRED_CONSUMER_CONFIG: Mapping[str, object] = {
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "enable.partition.eof": False,
    "isolation.level": "read_committed",
    "auto.offset.reset": "earliest",
}
# Producer-only properties users may have in KAFKA_* for the relay: a consumer warns about each one.
_PRODUCER_ONLY = re.compile(
    r"^(acks|enable\.idempotence|linger\.ms|batch\.|queue\.buffering\.|message\.timeout\.ms|compression\.|"
    r"partitioner|transactional\.id|transaction\.timeout\.ms|retries|delivery\.timeout\.ms|"
    r"request\.required\.acks|sticky\.partitioning)"
)
_UUID = re.compile(rb"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_MAX_BIGINT = 2**63 - 1

# -- consuming --------------------------------------------------------------------------------------


def make_consumer(bootstrap_config: Mapping[str, object]) -> Consumer:
    config: dict[str, object] = {
        **DEFAULT_CONSUMER_CONFIG,
        **{k: v for k, v in bootstrap_config.items() if not _PRODUCER_ONLY.match(k)},
        **REQUIRED_CONSUMER_CONFIG,
        "group.id": f"outbox-verify-{uuid.uuid4().hex}",  # never commits: the group only names the client
    }
    try:
        return Consumer(config)
    except KafkaException as exc:
        raise ConfigurationError(f"invalid Kafka configuration: {redact_kafka_error(exc, config)}") from None


@dataclass
class Consumed:
    records: int = 0
    partitions: int = 0
    complete: bool = True


def consume_topics(
    consumer: Consumer,
    topics: Sequence[str],
    starts: Mapping[tuple[str, int], int],
    idle_s: float,
    max_s: float | None,
    work: Ledger,
) -> Consumed:
    """Read every partition of ``topics`` into the workspace until each is idle past its start watermark."""
    try:
        assignment = _assignment(consumer, topics, starts)
        remaining = _start_watermarks(consumer, assignment, starts)
        consumer.assign(assignment)
        log.info("verify: consuming %d partitions of %s", len(assignment), ", ".join(topics))
        return _consume(consumer, work, remaining, idle_s, max_s, Consumed(partitions=len(assignment)))
    finally:
        consumer.close()


def _assignment(
    consumer: Consumer, topics: Sequence[str], starts: Mapping[tuple[str, int], int]
) -> list[TopicPartition]:
    """Every partition of ``topics``, from the beginning; a topic that cannot be read, or a start offset for a
    partition it lacks, is refused."""
    try:
        metadata = consumer.list_topics(timeout=15)
    except KafkaException as exc:
        raise OutboxError(f"cannot read Kafka metadata: {redact_kafka_error(exc, {})}") from None
    assignment: list[TopicPartition] = []
    for topic in topics:
        info = metadata.topics.get(topic)
        if info is None or info.error is not None or not info.partitions:
            reason = info.error.str() if info is not None and info.error is not None else "no such topic"
            raise OutboxError(f"topic {topic!r} cannot be read: {reason}")
        assignment += [TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(info.partitions)]
    known = {(tp.topic, tp.partition) for tp in assignment}
    for topic, partition in starts:
        if (topic, partition) not in known:
            raise OutboxError(f"--from {topic}:{partition}: the topic has no partition {partition}")
    return assignment


def _start_watermarks(
    consumer: Consumer, assignment: list[TopicPartition], starts: Mapping[tuple[str, int], int]
) -> dict[tuple[str, int], int]:
    """What "caught up" means at the start: each partition with records past its start, and its high watermark
    then (records keep arriving after it until the topics are idle). A given start offset is set on ``assignment``."""
    remaining: dict[tuple[str, int], int] = {}
    for tp in assignment:
        try:
            low, high = consumer.get_watermark_offsets(tp, timeout=15, cached=False)
        except KafkaException as exc:
            raise OutboxError(f"cannot read {tp.topic}/{tp.partition}: {redact_kafka_error(exc, {})}") from None
        start = starts.get((tp.topic, tp.partition))
        if start is not None:
            tp.offset = start
        if high > max(low, start or 0):
            remaining[(tp.topic, tp.partition)] = high
    return remaining


def _consume(
    consumer: Consumer,
    work: Ledger,
    remaining: dict[tuple[str, int], int],
    idle_s: float,
    max_s: float | None,
    result: Consumed,
) -> Consumed:
    """Records into the workspace a chunk at a time, until every partition passed its start watermark and none had
    a record for ``idle_s`` (or ``max_s`` passed: then the result is not complete)."""
    chunk: list[tuple[object, ...]] = []
    began = last_record = time.monotonic()
    while True:
        messages = consumer.consume(num_messages=CHUNK_ROWS, timeout=0.5)
        now = time.monotonic()
        _take(messages, chunk, remaining)
        if messages:
            last_record = now
        if len(chunk) >= CHUNK_ROWS:
            work.write_consumed(chunk)
            result.records += len(chunk)
            chunk.clear()
        if remaining and not messages:
            _drop_reached(consumer, remaining)
        if not remaining and now - last_record >= idle_s:
            break
        if max_s is not None and now - began >= max_s:
            result.complete = False
            log.warning("verify: stopped after %.0f s before every partition was idle", max_s)
            break
    work.write_consumed(chunk)
    result.records += len(chunk)
    log.debug("verify: consumed %d records in %.1f s", result.records, time.monotonic() - began)
    return result


def _take(messages: list[Message], chunk: list[tuple[object, ...]], remaining: dict[tuple[str, int], int]) -> None:
    """One batch's records onto ``chunk``, each partition dropped from ``remaining`` once its start watermark is
    reached; an error that no retry cures (fatal, a topic gone or forbidden) ends the verification."""
    for msg in messages:
        error = msg.error()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                continue
            if error.fatal() or error.code() in (
                KafkaError.UNKNOWN_TOPIC_OR_PART,
                KafkaError.TOPIC_AUTHORIZATION_FAILED,
            ):
                raise OutboxError(f"consuming {msg.topic()}/{msg.partition()} failed: {error.str()}")
            log.warning("verify: consumer error (retrying): %s", error.str())
            continue
        row = _row(msg)
        chunk.append(row)
        topic_partition = cast("tuple[str, int]", row[1:3])
        target = remaining.get(topic_partition)
        if target is not None and cast(int, row[3]) + 1 >= target:
            del remaining[topic_partition]


def _drop_reached(consumer: Consumer, remaining: dict[tuple[str, int], int]) -> None:
    """Partitions whose position passed their start watermark without a record there (a transaction
    marker, or an aborted record read_committed skips)."""
    positions = consumer.position([TopicPartition(t, p) for t, p in remaining])
    for tp in positions:
        if tp.offset >= 0 and tp.offset >= remaining[(tp.topic, tp.partition)]:
            del remaining[(tp.topic, tp.partition)]


def _row(msg: Message) -> tuple[object, ...]:
    """(message_id, topic, partition, offset, key, outbox_id, created_at, broker_ms) of one record."""
    message_id = outbox_id = created_at = None
    headers = cast("list[tuple[str, bytes | None]]", msg.headers() or [])
    for name, value in headers:
        if value is None:
            continue
        if name == "message_id":
            message_id = _uuid(value)
        elif name == "outbox_id":
            outbox_id = _bigint(value)
        elif name == "created_at":
            created_at = _timestamp(value)
    ts_type, ts = msg.timestamp()
    raw_key = msg.key()
    key = None
    if raw_key is not None:
        key = raw_key.decode("utf-8", "backslashreplace") if isinstance(raw_key, bytes) else str(raw_key)
        key = key.replace("\x00", "\\x00")  # PostgreSQL text cannot hold NUL
    broker_ms = ts if ts_type != TIMESTAMP_NOT_AVAILABLE and ts >= 0 else None
    return (message_id, msg.topic(), msg.partition(), msg.offset(), key, outbox_id, created_at, broker_ms)


def _uuid(value: bytes | str) -> str | None:
    raw = value.encode() if isinstance(value, str) else value
    if _UUID.fullmatch(raw):
        return raw.decode()
    try:
        return str(uuid.UUID(raw.decode()))
    except (ValueError, UnicodeDecodeError):
        return None


def _bigint(value: bytes | str) -> int | None:
    try:
        number = int(value)
    except ValueError:
        return None
    return number if 0 <= number <= _MAX_BIGINT else None


def _timestamp(value: bytes | str) -> dt.datetime | None:
    try:
        parsed = dt.datetime.fromisoformat(value.decode() if isinstance(value, bytes) else value)
    except (ValueError, UnicodeDecodeError):
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=dt.UTC)
