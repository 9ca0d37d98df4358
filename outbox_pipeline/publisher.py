"""Engine room: publishing one batch to Kafka and reporting exactly what was confirmed.

Confluent's discipline: produce the whole batch asynchronously, serve delivery callbacks, and wait
for a report for every message (``message.timeout.ms`` bounds the wait; librdkafka reports every
message as delivered or failed by then). Only a successful delivery report counts as delivered.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence

from confluent_kafka import KafkaError, KafkaException, Producer

from .config import redact_kafka_config
from .enqueue import decode_headers
from .strategies.base import DeliveryFailure, OutboxRecord, PublishOutcome

log = logging.getLogger(__name__)

# Producer settings the at-least-once, per-key-order promise depends on; user config cannot weaken them.
REQUIRED_PRODUCER_CONFIG: Mapping[str, object] = {
    "enable.idempotence": True,
    "acks": "all",
}
DEFAULT_PRODUCER_CONFIG: Mapping[str, object] = {
    # The Java client's default partitioner: same key -> same Kafka partition as every other client.
    "partitioner": "murmur2_random",
    "linger.ms": 5,
    "batch.num.messages": 10_000,
    "queue.buffering.max.messages": 500_000,
    "message.timeout.ms": 30_000,
    "compression.type": "lz4",
}
# Errors no retry can fix: the record itself is unacceptable (too large, invalid topic name).
PERMANENT_ERRORS = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError.INVALID_MSG,
        KafkaError.INVALID_RECORD,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError._INVALID_ARG,
    }
)


def is_permanent(error: KafkaError) -> bool:
    return error.code() in PERMANENT_ERRORS


class KafkaPublisher:
    """One idempotent producer (plus transactional ones on demand) used by one relay worker."""

    def __init__(self, config: Mapping[str, object]) -> None:
        merged: dict[str, object] = {**DEFAULT_PRODUCER_CONFIG, **config, **REQUIRED_PRODUCER_CONFIG}
        self._config = merged
        self._timeout_s = float(merged["message.timeout.ms"]) / 1000.0 + 10.0  # type: ignore[arg-type]
        self._producer: Producer | None = None
        self._transactional: dict[str, Producer] = {}
        log.debug("producer config: %s", redact_kafka_config(merged))

    @property
    def producer(self) -> Producer:
        if self._producer is None:
            self._producer = Producer(self._config)
        return self._producer

    def publish(self, records: Sequence[OutboxRecord], *, transactional_id: str | None = None) -> PublishOutcome:
        if transactional_id is not None:
            return self._publish_transaction(records, transactional_id)
        started = time.monotonic()
        outcome = self._produce_all(self.producer, records)
        if outcome.fatal:
            # An idempotent producer that hit a fatal error cannot be used again.
            self._drop(self._producer)
            self._producer = None
        failures = self._explain_missing_topics(outcome.failures(records))
        return PublishOutcome(outcome.delivered(records), failures, time.monotonic() - started)

    def _explain_missing_topics(self, failures: list[DeliveryFailure]) -> list[DeliveryFailure]:
        """A message to a topic that does not exist (auto-creation off) just times out: say why.

        Only on the failure path, one metadata request per failed batch.
        """
        if not failures or self._producer is None:
            return failures
        try:
            existing = set(self._producer.list_topics(timeout=2.0).topics)
        except KafkaException:
            return failures  # the broker is unreachable: the timeout is the right explanation
        return [
            DeliveryFailure(
                f.record,
                f"topic {f.record.topic!r} does not exist on the broker and is not auto-created ({f.error})",
                f.permanent,
            )
            if f.record.topic not in existing
            else f
            for f in failures
        ]

    def _publish_transaction(self, records: Sequence[OutboxRecord], transactional_id: str) -> PublishOutcome:
        """All or nothing: read_committed consumers see the whole batch or none of it.

        A record Kafka can never take (too large, invalid topic) would abort every transaction it is
        in, so after such an abort the rest of the batch is sent again, once, in a new transaction.
        """
        started = time.monotonic()
        permanent: list[DeliveryFailure] = []
        batch = list(records)
        for _ in range(2):
            try:
                producer = self._transactional_producer(transactional_id)
                producer.begin_transaction()
                reports = self._produce_all(producer, batch)
                if not reports.failed_count:
                    producer.commit_transaction(self._timeout_s)
                    return PublishOutcome(batch, permanent, time.monotonic() - started)
                producer.abort_transaction(self._timeout_s)
            except KafkaException as exc:
                # Fenced by a newer producer with this id, or a fatal/abortable error: nothing confirmed.
                kerr = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
                self._drop(self._transactional.pop(transactional_id, None))
                failed = [DeliveryFailure(r, kerr.str() if kerr else str(exc), False) for r in batch]
                return PublishOutcome([], permanent + failed, time.monotonic() - started)
            failures = _all_failed(batch, reports.first_error or "a message in the transaction failed", reports)
            newly_permanent = [f for f in failures if f.permanent]
            if not newly_permanent:
                return PublishOutcome([], permanent + failures, time.monotonic() - started)
            permanent += newly_permanent
            rejected = {f.record.id for f in newly_permanent}
            batch = [r for r in batch if r.id not in rejected]
            if not batch:
                break
        transient = [DeliveryFailure(r, "transaction aborted", False) for r in batch]
        return PublishOutcome([], permanent + transient, time.monotonic() - started)

    def _transactional_producer(self, transactional_id: str) -> Producer:
        producer = self._transactional.get(transactional_id)
        if producer is None:
            producer = Producer({**self._config, "transactional.id": transactional_id})
            producer.init_transactions(self._timeout_s)
            self._transactional[transactional_id] = producer
        return producer

    def _produce_all(self, producer: Producer, records: Sequence[OutboxRecord]) -> _Reports:
        reports = _Reports(len(records))
        for index, record in enumerate(records):
            self._produce_one(producer, record, index, reports)
        deadline = time.monotonic() + self._timeout_s
        while reports.pending and time.monotonic() < deadline:
            producer.flush(min(1.0, max(0.0, deadline - time.monotonic())))
        if reports.pending:
            log.warning("%d messages without a delivery report after %.0f s", reports.pending, self._timeout_s)
        return reports

    def _produce_one(self, producer: Producer, record: OutboxRecord, index: int, reports: _Reports) -> None:
        headers: list[tuple[str, str | bytes | None]] = [
            ("message_id", record.message_id.encode()),
            ("outbox_id", str(record.id).encode()),
            ("created_at", record.created_at.encode()),
        ]
        if record.type is not None:
            headers.append(("type", record.type.encode()))
        if record.headers != "{}":
            headers.extend(decode_headers(json.loads(record.headers)))
        while True:
            try:
                producer.produce(
                    record.topic,
                    record.payload.encode(),
                    record.key.encode() if record.key is not None else None,
                    headers=headers,
                    on_delivery=reports.callback(index),
                )
                return
            except BufferError:
                producer.poll(0.05)  # local queue full: serve callbacks, which frees space
            except KafkaException as exc:
                error = exc.args[0]
                reports.fail(index, error.str(), is_permanent(error))
                return

    def close(self, timeout_s: float = 10.0) -> None:
        for producer in [self._producer, *self._transactional.values()]:
            if producer is not None:
                producer.flush(timeout_s)
        self._producer = None
        self._transactional.clear()

    @staticmethod
    def _drop(producer: Producer | None) -> None:
        if producer is not None:
            producer.purge(in_queue=True, in_flight=False, blocking=False)


class _Reports:
    """Delivery reports of one batch, by position in the batch."""

    def __init__(self, size: int) -> None:
        self.ok = [False] * size
        self.errors: dict[int, tuple[str, bool]] = {}
        self.pending = size
        self.fatal = False
        self.first_error: str | None = None

    def callback(self, index: int):  # type: ignore[no-untyped-def]
        def on_delivery(error: KafkaError | None, _msg: object) -> None:
            if error is None:
                self.ok[index] = True
                self.pending -= 1
            else:
                self.fatal = self.fatal or error.fatal()
                self.fail(index, error.str(), is_permanent(error))

        return on_delivery

    def fail(self, index: int, error: str, permanent: bool) -> None:
        self.errors[index] = (error, permanent)
        self.first_error = self.first_error or error
        self.pending -= 1

    @property
    def failed_count(self) -> int:
        return len(self.errors) + self.pending

    def delivered(self, records: Sequence[OutboxRecord]) -> list[OutboxRecord]:
        return [r for r, ok in zip(records, self.ok, strict=True) if ok]

    def failures(self, records: Sequence[OutboxRecord]) -> list[DeliveryFailure]:
        failures = []
        for index, record in enumerate(records):
            if self.ok[index]:
                continue
            error, permanent = self.errors.get(index, ("no delivery report before the timeout", False))
            failures.append(DeliveryFailure(record, error, permanent))
        return failures


def _all_failed(records: Sequence[OutboxRecord], error: str, reports: _Reports) -> list[DeliveryFailure]:
    """After an aborted transaction nothing was delivered; keep the permanent errors we know of."""
    failures = []
    for index, record in enumerate(records):
        own_error, permanent = reports.errors.get(index, (f"transaction aborted: {error}", False))
        failures.append(DeliveryFailure(record, own_error, permanent))
    return failures
