"""Engine room: which partitions a position worker serves first (its *home*), so work spreads evenly.

Leases stay per batch (a free partition is taken, read, published, acked and released), which keeps failover, bulk
drains and rewinds simple; reading ahead keeps a lease past its batch at home only. What spreads the partitions is a
preference: the live unscoped relay workers, sorted by id, deal the offsets rows, sorted, round-robin, so partition
*i* is home to worker *i mod n*. Homes differ in size by at most one, every worker computes the same deal from the
same registry (``outbox_workers``), and a partition held elsewhere goes back with its batch in flight: the deal is
looked at again every ``DEAL_INTERVAL_S``. A worker takes another's partition only once its oldest pending row has
waited ``STEAL_AFTER_S`` (its home worker is busy, hung, or dead and not yet reaped), so no partition waits long for
its owner, and a backlog (every row old) is served by whoever is free, as before.

A worker whose heartbeat is older than ``lease_s`` is out of the deal, even while its session (and so its liveness
lock) lives: a frozen (SIGSTOP) or hung worker stops heartbeating, and its home is dealt to the live workers, who
serve it as their own however busy they are (a worker busy at home never steals). Its leases expire meanwhile, and an
expired lease is anyone's (offsets.candidates). It is dealt its home again at its next heartbeat.

A worker that is not in the registry (a scoped run, or a strategy used without a relay loop) has no home:
every partition is equally its own.
"""

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
