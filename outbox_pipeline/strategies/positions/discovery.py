"""How a position worker learns of partitions that have rows but no offsets row yet, quickly for new topics and without
missing a transaction that committed late. See docs/strategies.md#finding-new-partitions."""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg

from ...config import OutboxTable
from . import offsets

DISCOVERY_INTERVAL_S = 5.0
RECENT_DISCOVERY_S = 0.5
# How far below the highest id seen the floor may stay for a transaction still open (half a recent look's rows).
LOOK_BACK = offsets.RECENT_ROWS // 2
# Looks remembered above the floor at most (dropping the oldest only keeps the floor lower: more rows read, never
# fewer), so a transaction open for hours under a trickle of rows does not grow the list.
MAX_LOOKS = 32


class Discovery:
    """One worker's looks for new partitions; ``found``: called when a look created offsets rows."""

    def __init__(self, conn: psycopg.Connection, table: OutboxTable, found: Callable[[], None]) -> None:
        self.conn = conn
        self.table = table
        self._found = found
        self._all_at = self._recent_at = float("-inf")
        self._floor = 0  # every row at or below this id that will ever commit was seen by a look
        # (highest id seen, snapshot xmax) of the looks above the floor, oldest first
        self._looks: list[tuple[int, int]] = []

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
        found = offsets.discover_recent(self.conn, self.table, self._floor)
        return self._counted(found) if found.complete else self.everything()

    def _counted(self, found: offsets.Discovered) -> int:
        looks = self._looks
        if not looks or looks[-1][0] < found.seen_id:  # an earlier look that saw as far becomes due no later
            looks = [*looks, (found.seen_id, found.xmax)]
        # Looks whose every id this one saw (its xmin passed their xmax): nothing at or below them is still to come.
        floor = max([self._floor, *(seen for seen, xmax in looks if xmax <= found.xmin)])
        self._floor = max(floor, found.seen_id - LOOK_BACK)
        self._looks = [(seen, xmax) for seen, xmax in looks if seen > self._floor and xmax > found.xmin][-MAX_LOOKS:]
        if found.created:
            self._found()
        return found.created
