"""The Kafka transactional ids of a position worker: one per virtual partition, so a second worker on the same partition
fences the first. See docs/strategies.md#kafka-transactions."""

from __future__ import annotations

import time
from collections.abc import Iterable

import psycopg

from ..base import StrategyConfig
from . import offsets
from .discovery import DISCOVERY_INTERVAL_S


class TransactionalIds:
    """The ids of one worker's partitions, and which of them it may still use (looked up at most once per
    DISCOVERY_INTERVAL_S)."""

    def __init__(self, conn: psycopg.Connection, config: StrategyConfig) -> None:
        self.conn = conn
        self.config = config
        self._checked_at = float("-inf")
        self._usable: frozenset[str] | None = None

    def of_partitions(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], str] | None:
        """Each partition's id (a batch publishes each partition's rows in a transaction of its own); None without
        Kafka transactions."""
        if not self.config.kafka_transactions:
            return None
        return {(topic, partition): self._id(topic, partition) for topic, partition in partitions}

    def _id(self, topic: str, partition: int) -> str:
        return f"outbox.{self.config.table.schema}.{topic}.{partition}"

    def usable(self) -> frozenset[str] | None:
        """Ids of the partitions no other worker holds a live lease on; a producer for any other id was (or is
        about to be) fenced by that worker and only costs threads and connections. None without Kafka transactions."""
        if not self.config.kafka_transactions:
            return None
        if time.monotonic() - self._checked_at < DISCOVERY_INTERVAL_S:
            return self._usable
        rows = offsets.unleased_by_others(self.conn, self.config)
        self._usable = frozenset(self._id(t, p) for t, p in rows)
        self._checked_at = time.monotonic()
        return self._usable
