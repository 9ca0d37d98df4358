"""Which partition a wal message counts under in a run's per-partition history: its writer's, else its key's by the SQL
writers' routing, else 0. See docs/dagster.md#long-lived-relay-runs."""

from __future__ import annotations

import time

import psycopg
from psycopg import sql

from .. import server
from ..config import OutboxTable
from ..model import OutboxRecord
from ..partitioning import partition_for
from ..store.migrations import DEFAULT_TOPIC_ROW, DEFAULT_VIRTUAL_PARTITIONS

# Partition counts are read again this often (an operator may change one).
COUNTS_TTL_S = 60.0
# Keys whose partition is remembered; past it the cache starts over.
MAX_CACHED_KEYS = 100_000


class WalPartitions:
    def __init__(self, dsn: str, table: OutboxTable) -> None:
        self._dsn = dsn
        self._table = table
        self._counts: dict[str, int] = {}
        self._read_at = float("-inf")
        self._cache: dict[tuple[str, bytes], int] = {}

    def of(self, record: OutboxRecord) -> tuple[str, int]:
        if record.partition >= 0:
            return record.topic, record.partition
        if record.key is None:
            return record.topic, 0
        if time.monotonic() - self._read_at > COUNTS_TTL_S:
            self._read_counts()
        found = self._cache.get((record.topic, record.key))
        if found is None:
            if len(self._cache) >= MAX_CACHED_KEYS:
                self._cache.clear()
            count = self._counts.get(record.topic) or self._counts.get(DEFAULT_TOPIC_ROW) or DEFAULT_VIRTUAL_PARTITIONS
            found = self._cache[(record.topic, record.key)] = partition_for(record.key, count)
        return record.topic, found

    def _read_counts(self) -> None:
        self._read_at = time.monotonic()
        try:
            with server.connect(self._dsn, autocommit=True) as conn:
                rows = conn.execute(sql.SQL("SELECT topic, partitions FROM {}").format(self._table.topics)).fetchall()
        except psycopg.OperationalError:
            return  # the last counts stand until the database answers
        counts = {topic: int(n) for topic, n in rows}
        if counts != self._counts:
            self._cache.clear()
        self._counts = counts
