"""Which partitions a position worker serves first (its home), dealt round-robin over the live workers so work spreads
evenly. See docs/strategies.md#home-partitions-and-the-deal."""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ...config import OutboxTable

# How often a worker looks at the registry and the offsets rows to deal the partitions again.
DEAL_INTERVAL_S = 1.0
# How long a pending row waits for its partition's home worker before any worker may take it.
STEAL_AFTER_S = 0.5
# The registry's kind for a relay worker that serves every partition (a scoped worker registers otherwise).
UNSCOPED_KIND = "relay"

_DEAL = """
    WITH live AS (
        SELECT worker_id, row_number() OVER (ORDER BY worker_id) - 1 AS i, count(*) OVER () AS n
        FROM {workers}
        WHERE kind = %(kind)s AND heartbeat_at > now() - make_interval(secs => %(lease)s)
    ),
    dealt AS (
        SELECT topic, partition, row_number() OVER (ORDER BY topic, partition) - 1 AS j FROM {offsets}
    )
    SELECT d.topic, d.partition
    FROM live me LEFT JOIN dealt d ON d.j %% me.n = me.i
    WHERE me.worker_id = %(worker)s
"""


@dataclass(frozen=True)
class Home:
    """The partitions dealt to one worker; ``None``: no preference (everything is home). A registered
    worker may be dealt nothing (more workers than partitions): it only takes what waited."""

    topics: list[str] | None = None
    partitions: list[int] | None = None

    @property
    def everywhere(self) -> bool:
        return self.topics is None

    @functools.cached_property
    def _pairs(self) -> frozenset[tuple[str, int]]:
        return frozenset(zip(self.topics or [], self.partitions or [], strict=True))

    def holds(self, topic: str, partition: int) -> bool:
        return self.everywhere or (topic, partition) in self._pairs

    @functools.cached_property
    def _document(self) -> str:
        return json.dumps([{"topic": t, "partition": p} for t, p in self._pairs])

    def params(self) -> dict[str, object]:
        """The parameters of IS_HOME and the candidates (offsets.py). The pairs go as one JSON document, made once per
        deal: two arrays were dumped again at every claim."""
        return {"everywhere": self.everywhere, "home": self._document, "steal_after": STEAL_AFTER_S, "steal": True}


# ``o`` is an offsets row: whether it is home to this worker (parameters from Home.params()).
IS_HOME = sql.SQL(
    "(%(everywhere)s OR (o.topic, o.partition) IN "
    "(SELECT h.topic, h.partition FROM jsonb_to_recordset(%(home)s::jsonb) AS h(topic text, partition int)))"
)


class Dealer:
    """Keeps one worker's Home current (at most one registry query per DEAL_INTERVAL_S)."""

    def __init__(self, conn: psycopg.Connection, table: OutboxTable, worker_id: str, lease_s: float) -> None:
        self.conn = conn
        self.table = table
        self.worker_id = worker_id
        self.lease_s = lease_s
        self.home = Home()
        self._dealt_at = float("-inf")

    def invalidate(self) -> None:
        """Deal again at the next look: new partitions were discovered (a home dealt before them is stale)."""
        self._dealt_at = float("-inf")

    def current(self) -> Home:
        if time.monotonic() - self._dealt_at >= DEAL_INTERVAL_S:
            self.home = self._deal()
            self._dealt_at = time.monotonic()
        return self.home

    def _deal(self) -> Home:
        return deal(self.conn, self.table, self.worker_id, self.lease_s)


def deal(conn: psycopg.Connection, table: OutboxTable, worker_id: str, lease_s: float) -> Home:
    """The partitions dealt to ``worker_id`` now; an unregistered worker has no preference (Home())."""
    query = sql.SQL(_DEAL).format(workers=table.workers, offsets=table.offsets)
    rows = conn.execute(query, {"kind": UNSCOPED_KIND, "lease": lease_s, "worker": worker_id}).fetchall()
    if not rows:
        return Home()
    dealt = [(topic, partition) for topic, partition in rows if topic is not None]
    return Home([topic for topic, _ in dealt], [partition for _, partition in dealt])
