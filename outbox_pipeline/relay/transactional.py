"""Kafka transactions, one transactional producer per virtual partition, so read_committed consumers see a partition's
share of a batch whole or not at all. See docs/strategies.md#kafka-transactions."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from ..model import DeliveryFailure, FailureKind, OutboxRecord, PublishOutcome
from ..store.record_headers import Headers
from ..store.topic_names import is_valid_topic
from .kafka_errors import failure_kind
from .topic_limits import TopicLimits

log = logging.getLogger(__name__)

# Transactional producers kept at most (one per virtual partition this worker published recently).
MAX_TRANSACTIONAL_PRODUCERS = 16
NOT_OWNED = "not sent: another worker took the partition before its transaction began"


class TransactionalProducers:
    """The transactional producers of one relay worker, by transactional id."""

    def __init__(
        self,
        config: Mapping[str, object],
        *,
        timeout_s: float,
        limits: TopicLimits,
        headers_of: Callable[[OutboxRecord], Headers],
        max_producers: int = MAX_TRANSACTIONAL_PRODUCERS,
    ) -> None:
        self._config = config
        self._timeout_s = timeout_s
        self._limits = limits
        self._headers_of = headers_of
        self._max = max_producers
        # Least recently used first.
        self._producers: OrderedDict[str, Producer] = OrderedDict()

    def publish(
        self, records: Sequence[OutboxRecord], transactional_id: str, still_owned: Callable[[], bool] | None = None
    ) -> PublishOutcome:
        """All or nothing. A record Kafka can never take (too large, invalid topic) would abort every transaction
        it is in, so after such an abort the rest of the batch is sent again, once, in a new transaction."""
        started = time.monotonic()
        permanent: list[DeliveryFailure] = []
        batch = list(records)
        for _ in range(2):
            try:
                fresh = transactional_id not in self._producers
                producer = self._producer(transactional_id)
                if fresh and still_owned is not None and not still_owned():
                    drop(self._producers.pop(transactional_id))
                    failed = [DeliveryFailure(r, NOT_OWNED, "transport") for r in batch]
                    return PublishOutcome([], permanent + failed, time.monotonic() - started)
                producer.begin_transaction()
                reports = self._produce_all(producer, batch)
                if not reports.failed_count:
                    producer.commit_transaction(self._timeout_s)
                    return PublishOutcome(batch, permanent, time.monotonic() - started)
                producer.abort_transaction(self._timeout_s)
            except (KafkaException, SystemError) as exc:
                # Fenced by a newer producer with this id, or a fatal/abortable error: nothing confirmed. A fatal
                # error met in flush() comes as a SystemError instead, caused by its KafkaException or with no
                # exception at all (confluent-kafka 2.16 serves the next delivery report with the fatal error's
                # exception set, which a later report may clear): the producer is as dead either way.
                # (No local keeps the exception: its traceback holds this frame, and the frame the dropped producer.)
                drop(self._producers.pop(transactional_id, None))
                cause = exc if isinstance(exc, KafkaException) else exc.__cause__
                failed = _failed(batch, cause if isinstance(cause, KafkaException) else exc)
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
        transient = [DeliveryFailure(r, "transaction aborted", "transport") for r in batch]
        return PublishOutcome([], permanent + transient, time.monotonic() - started)

    def __len__(self) -> int:
        return len(self._producers)

    def retain(self, ids: frozenset[str]) -> None:
        """Drop the producers whose ids are not in ``ids`` (partitions another worker holds now: it fenced, or will
        fence, ours)."""
        for stale in [tid for tid in self._producers if tid not in ids]:
            log.debug("dropping transactional producer %s: its partition is leased by another worker", stale)
            drop(self._producers.pop(stale))

    def close(self, timeout_s: float) -> None:
        for producer in self._producers.values():
            producer.flush(timeout_s)
        self._producers.clear()

    def _producer(self, transactional_id: str) -> Producer:
        producer = self._producers.get(transactional_id)
        if producer is not None:
            self._producers.move_to_end(transactional_id)
            return producer
        while len(self._producers) >= self._max:
            drop(self._producers.popitem(last=False)[1])
        producer = Producer({**self._config, "transactional.id": transactional_id, "delivery.report.only.error": False})
        producer.init_transactions(self._timeout_s)
        self._producers[transactional_id] = producer
        return producer

    def _produce_all(self, producer: Producer, records: Sequence[OutboxRecord]) -> _Reports:
        """Produce with a report per message: each must be accounted for."""
        reports = _Reports(len(records))
        for index, record in enumerate(records):
            if not is_valid_topic(record.topic):
                reports.fail(index, f"invalid Kafka topic name {record.topic[:260]!r}", "permanent")
                continue
            self._limits.check(record.topic)
            self._produce_one(producer, record, index, reports)
        deadline = time.monotonic() + self._timeout_s
        while reports.pending and time.monotonic() < deadline:
            producer.flush(min(1.0, max(0.0, deadline - time.monotonic())))
        if reports.pending:
            log.warning("%d messages without a delivery report after %.0f s", reports.pending, self._timeout_s)
        return reports

    def _produce_one(self, producer: Producer, record: OutboxRecord, index: int, reports: _Reports) -> None:
        headers = self._headers_of(record)
        while True:
            try:
                producer.produce(
                    record.topic, record.payload, record.key, headers=headers, on_delivery=reports.callback(index)
                )
                return
            except BufferError:
                producer.poll(0.05)  # local queue full: serve reports, which frees space
            except KafkaException as exc:
                error = exc.args[0]
                reports.fail(index, error.str(), failure_kind(error))
                return


def drop(producer: Producer | None) -> None:
    """Forget a producer's queued messages (it is fenced or fatally failed; what it holds is retried elsewhere)."""
    if producer is not None:
        producer.purge(in_queue=True, in_flight=False, blocking=False)


class _Reports:
    """Delivery reports of one batch, by position in the batch."""

    def __init__(self, size: int) -> None:
        self.ok = [False] * size
        self.errors: dict[int, tuple[str, FailureKind]] = {}
        self.pending = size
        self.first_error: str | None = None

    def callback(self, index: int) -> Callable[[KafkaError | None, Message], None]:
        def on_delivery(error: KafkaError | None, _msg: Message) -> None:
            if error is None:
                self.ok[index] = True
                self.pending -= 1
            else:
                self.fail(index, error.str(), failure_kind(error))

        return on_delivery

    def fail(self, index: int, error: str, kind: FailureKind) -> None:
        self.errors[index] = (error, kind)
        self.first_error = self.first_error or error
        self.pending -= 1

    @property
    def failed_count(self) -> int:
        return len(self.errors) + self.pending


def _failed(records: Sequence[OutboxRecord], exc: BaseException | None) -> list[DeliveryFailure]:
    """Every record of a transaction the producer could not finish, failed with its error."""
    kerr = exc.args[0] if exc is not None and exc.args and isinstance(exc.args[0], KafkaError) else None
    kind = failure_kind(kerr) if kerr else "transport"
    return [DeliveryFailure(r, kerr.str() if kerr else str(exc), kind) for r in records]


def _all_failed(records: Sequence[OutboxRecord], error: str, reports: _Reports) -> list[DeliveryFailure]:
    """After an aborted transaction nothing was delivered; keep the permanent errors we know of."""
    failures = []
    for index, record in enumerate(records):
        own_error, kind = reports.errors.get(index, (f"transaction aborted: {error}", "transport"))
        failures.append(DeliveryFailure(record, own_error, kind))
    return failures
