"""Engine room: how a position worker (positions.py) learns of partitions that have rows but no offsets row yet.

A partition is nobody's to lease until it has an offsets row: every pair is looked at every DISCOVERY_INTERVAL_S, the
rows written since the last look every RECENT_DISCOVERY_S while claims find work (a new topic's first rows must not
wait for a busy partition to run dry), and whenever a claim finds nothing (every wake-up whose rows were already
published ends so: a full look each time cost more than the rest of the cycle).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg

from ..config import OutboxTable
from . import offsets

DISCOVERY_INTERVAL_S = 5.0
RECENT_DISCOVERY_S = 0.5


class Discovery:
    """One worker's looks for new partitions; ``found``: called when a look created offsets rows."""

    def __init__(self, conn: psycopg.Connection, table: OutboxTable, found: Callable[[], None]) -> None:
        self.conn = conn
        self.table = table
        self._found = found
        self._all_at = self._recent_at = float("-inf")
        self._seen_id = 0  # the highest message id a look covered

    def when_due(self) -> None:
        """Before a claim: a full look, or one at the rows written since the last, when its time has come."""
        now = time.monotonic()
        if now - self._all_at > DISCOVERY_INTERVAL_S:
            self.everything()
        elif now - self._recent_at > RECENT_DISCOVERY_S:
            self.recent()

    def everything(self) -> int:
        """Create offsets rows for every (topic, partition) pair that has rows but no position yet."""
        self._all_at = self._recent_at = time.monotonic()
        return self._counted(offsets.discover(self.conn, self.table))

    def recent(self) -> int:
        """The same for rows written since the last look only; every pair when too many were."""
        self._recent_at = time.monotonic()
        found = offsets.discover_recent(self.conn, self.table, self._seen_id)
        return self._counted(found) if found.complete else self.everything()

    def _counted(self, found: offsets.Discovered) -> int:
        self._seen_id = max(self._seen_id, found.seen_id)
        if found.created:
            self._found()
        return found.created
