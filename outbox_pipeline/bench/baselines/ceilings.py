"""The two ceilings every relay result is read against (produce-only, read-only), and the count-back of what Kafka got.
See docs/performance.md#the-machine-and-how-to-read-the-figures."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence

import psycopg
from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from psycopg import sql

from ...config import OutboxTable
from ...model import OutboxRecord, PublishOutcome
from ...relay.publisher import KafkaPublisher, PendingBatch
from ...strategies.base import RECORD_COLUMNS, fetch_records
from ...verify.consume import make_consumer


def read_share(dsn: str, table: OutboxTable, index: int, workers: int) -> list[OutboxRecord]:
    """Worker ``index``'s share of the loaded rows, in id order, as the relay would have read them."""
    query = sql.SQL("SELECT {columns} FROM {messages} m WHERE m.id %% %s = %s ORDER BY m.id").format(
        columns=sql.SQL(RECORD_COLUMNS), messages=table.messages
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        return fetch_records(conn, query, (workers, index))  # type: ignore[arg-type]


def produce_all(publisher: KafkaPublisher, records: Sequence[OutboxRecord], batch_size: int) -> int:
    """Every record through the relay's produce loop, one batch after another; returns those confirmed."""
    confirmed = 0
    for first in range(0, len(records), batch_size):
        outcome = publisher.finish(publisher.start(records[first : first + batch_size]))
        confirmed += len(outcome.delivered)
    return confirmed


class ConfirmingPublisher(KafkaPublisher):
    """The read-only ceiling's Kafka: every batch confirmed the moment it is handed over (no producer is made)."""

    def __init__(self) -> None:
        super().__init__({})

    def warm_up(self) -> None:
        """Nothing to start: a producer here would be one more client in the measurement."""

    def start(self, records: Sequence[OutboxRecord], until: float = math.inf) -> PendingBatch:
        return PendingBatch(records, time.monotonic())

    def finish(self, pending: PendingBatch) -> PublishOutcome:
        return PublishOutcome(pending.records, [], 0.0)

    def settled(self) -> bool:
        """Every batch is settled the moment it is handed over (a relay that pipelines asks before it waits)."""
        return True

    def publish(
        self,
        records: Sequence[OutboxRecord],
        *,
        transactional_id: str | None = None,
        still_owned: Callable[[], bool] | None = None,
    ) -> PublishOutcome:
        return self.finish(self.start(records))


_SEQ = re.compile(rb'"seq":\s*(\d+)')


def count_back(bootstrap: str, topics: list[str], expected: int, max_s: float = 300.0) -> tuple[int, int]:
    """(distinct messages, records) that arrived in ``topics``, told apart by the payload's ``seq``.

    For tables without a message_id (the seed's): every loaded ``seq`` 0..expected-1 must be there. Called
    after the drain, when nothing is produced any more: it reads each partition up to its high watermark
    (an idle gap while the machine is busy must not end the count early), for at most ``max_s``.
    """
    consumer = make_consumer({"bootstrap.servers": bootstrap})
    try:
        metadata = consumer.list_topics(timeout=15)
        assignment = [
            TopicPartition(t, p, OFFSET_BEGINNING) for t in topics for p in sorted(metadata.topics[t].partitions)
        ]
        ends = {
            (tp.topic, tp.partition): consumer.get_watermark_offsets(tp, timeout=15, cached=False)[1]
            for tp in assignment
        }
        remaining = {key for key, end in ends.items() if end > 0}
        consumer.assign(assignment)
        seen: set[int] = set()
        records = 0
        deadline = time.monotonic() + max_s
        while remaining and time.monotonic() < deadline:
            for message in consumer.consume(10_000, timeout=0.5):
                if message.error() is not None:
                    continue
                records += 1
                found = _SEQ.search(message.value() or b"")
                if found:
                    seen.add(int(found.group(1)))
                key = (message.topic() or "", message.partition() or 0)
                if (message.offset() or 0) + 1 >= ends.get(key, 0):
                    remaining.discard(key)
        distinct = sum(1 for seq in seen if seq < expected)
        return distinct, records
    finally:
        consumer.close()
