"""Engine room: strategy `lease`, the talk's variant 2 (two short transactions, leased rows).

Transaction 1, the claim, is one statement: ``UPDATE ... SET available_after = now() + lease,
locked_by = worker FROM (SELECT ... FOR UPDATE SKIP LOCKED) ... RETURNING``. It commits at once, so
row locks last milliseconds instead of a whole publish; the lease in ``available_after`` is what keeps
other workers away meanwhile. Kafka is written outside any transaction. Transaction 2, the ack,
deletes (or marks sent) what Kafka confirmed and retries or dead-letters the rest, touching only rows
still leased to this worker. Many workers run side by side; there is no order guarantee, and every
row is written twice (lease, then delete), which the talk measures as extra autovacuum work.

Leases, and what they cost when they run out:
- A worker that dies or hangs keeps its rows until ``lease_s`` passes; then any worker re-claims them
  and publishes them again (at-least-once). ``lease_s`` must exceed the worst publish time (the
  producer's ``message.timeout.ms`` plus the flush), or slow batches are published twice.
- The ack is fenced by ``locked_by = worker``: a worker whose lease expired and whose rows another
  worker re-claimed acks none of them. Those are counted as ``lost_ownership`` (Merpay's
  "published but commit failed"); their new owner publishes and acks them.
- A restarted worker with the same ``worker_id`` (a StatefulSet pod name, the talk's upgrade) frees
  its own leases when it starts, so it does not wait for them to expire; other workers do.

Fairness: like ``rows.claim_fair`` (highest priority first, plus an ``oldest_share`` of each batch
taken oldest-first so old low-priority rows are never starved), but inside the one claim statement:
two CTEs, each ``FOR UPDATE SKIP LOCKED``. SKIP LOCKED does not skip rows the same statement already
locked, hence the explicit exclusion of the oldest share from the priority share.

Shuffle and sample (Merpay), when ``sample_factor > 1``: read ``sample_factor x n`` fair candidate
ids without locking, shuffle them, and lease a random ``n`` of them that are still available.
Workers then spread over the head of the queue instead of all walking the same first rows; a sampled
row that another worker leased or published first is a collision (Merpay's already-published count),
reported in ``Claim.collisions``.

READ COMMITTED, explicitly: when SKIP LOCKED does lock a row that another worker leased and committed
meanwhile, READ COMMITTED re-checks ``available_after <= now()`` against that newest version and
drops the row, so no two live leases cover one row. (Under REPEATABLE READ the same race is a
serialization error instead.)
"""

from __future__ import annotations

import random
from collections.abc import Collection
from typing import ClassVar

import psycopg
from psycopg import IsolationLevel, sql

from .base import (
    RECORD_COLUMNS,
    AckResult,
    Claim,
    OutboxRecord,
    PublishOutcome,
    Strategy,
    StrategyConfig,
    fetch_records,
    scope_condition,
)
from .rows import finish

# A sampled claim that collided on every row resamples (fresh candidates) this many times in all
# before reporting "nothing available": the rows it lost went to other workers, more may be left.
_SAMPLE_ROUNDS = 3

# The fair pick as two CTEs: the oldest share by id, then the rest by priority. They may pick the
# same rows (always, when priorities are equal), so "urgent" reads a full batch and the pick below
# drops what "oldest" has with ``NOT IN (SELECT ...)``, a hashed lookup (``id <> ALL(ARRAY(...))``
# compared every array element with every row walked). Rows urgent locked but did not pick are
# released when the statement ends.
_FAIR_IDS = """
    oldest AS (
        SELECT o.id FROM {messages} o
        WHERE o.sent_at IS NULL AND o.available_after <= now() {scope_o}
        ORDER BY o.id
        LIMIT %(oldest)s
        {lock}
    ),
    urgent AS (
        SELECT u.id FROM {messages} u
        WHERE u.sent_at IS NULL AND u.available_after <= now() {scope_u}
        ORDER BY u.priority DESC, u.id
        LIMIT %(limit)s
        {lock}
    )
"""

_PICKED = """
    SELECT id FROM oldest
    UNION ALL
    (SELECT id FROM urgent WHERE id NOT IN (SELECT id FROM oldest) LIMIT %(limit)s - (SELECT count(*) FROM oldest))
"""

# The picked ids go in as an array rather than the talk's ``FROM (...) c WHERE m.id = c.id``: joined
# to the CTEs, PostgreSQL 18 hashed a sequential scan of the whole table (112 ms for 1,000 of 300,000
# rows); ``id = ANY(array)`` probes each partition's primary key instead (15 ms).
_LEASE = """
    UPDATE {messages} m
    SET available_after = now() + make_interval(secs => %(lease)s), locked_by = %(worker)s
    WHERE m.id = ANY (ARRAY({picked}))
    RETURNING {columns}
"""


class LeaseStrategy(Strategy):
    name: ClassVar[str] = "lease"
    ordered: ClassVar[bool] = False

    def __init__(self, conn: psycopg.Connection, config: StrategyConfig) -> None:
        super().__init__(conn, config)
        # SKIP LOCKED's re-check of the lease is READ COMMITTED behaviour (see the module docstring).
        conn.isolation_level = IsolationLevel.READ_COMMITTED
        messages = config.table.messages
        scope = {"scope_o": scope_condition(config, "o"), "scope_u": scope_condition(config, "u")}
        locked = sql.SQL(_FAIR_IDS).format(messages=messages, lock=sql.SQL("FOR UPDATE SKIP LOCKED"), **scope)
        unlocked = sql.SQL(_FAIR_IDS).format(messages=messages, lock=sql.SQL(""), **scope)
        self._claim_fair = sql.SQL("WITH {fair} {lease}").format(
            fair=locked,
            lease=sql.SQL(_LEASE).format(
                messages=messages,
                picked=sql.SQL(_PICKED),
                columns=sql.SQL(RECORD_COLUMNS),
            ),
        )
        self._candidates = sql.SQL("WITH {fair} " + _PICKED).format(fair=unlocked)
        self._claim_sample = sql.SQL(_LEASE).format(
            messages=messages,
            picked=sql.SQL(
                """
                SELECT s.id FROM {messages} s
                WHERE s.id = ANY(%(ids)s::bigint[]) AND s.sent_at IS NULL AND s.available_after <= now()
                FOR UPDATE SKIP LOCKED
                """
            ).format(messages=messages),
            columns=sql.SQL(RECORD_COLUMNS),
        )
        self._reclaim_own_leases()

    def _reclaim_own_leases(self) -> None:
        """A restart under the same worker_id: this worker's leases belong to a dead process, free them now."""
        self.conn.execute(
            sql.SQL(
                """
                UPDATE {messages} m SET available_after = now(), locked_by = NULL
                WHERE m.locked_by = %(worker)s AND m.sent_at IS NULL AND m.available_after > now()
                """
            ).format(messages=self.table.messages),
            {"worker": self.config.worker_id},
        )

    def _lease(self, query: sql.Composed, params: dict[str, object]) -> list[OutboxRecord]:
        params = {**params, "lease": self.config.lease_s, "worker": self.config.worker_id}
        records = fetch_records(self.conn, query, params)
        records.sort(key=lambda r: r.id)  # RETURNING has no order; publish oldest first within the batch
        return records

    def _fair_params(self, limit: int) -> dict[str, object]:
        return {"oldest": int(limit * self.config.oldest_share), "limit": limit}

    def claim(self, limit: int, avoid: Collection[int] = ()) -> Claim | None:
        if self.config.sample_factor > 1:
            return self._claim_sampled(limit)
        records = self._lease(self._claim_fair, self._fair_params(limit))
        return Claim(records) if records else None

    def _claim_sampled(self, limit: int) -> Claim | None:
        collisions = 0
        for _ in range(_SAMPLE_ROUNDS):
            rows = self.conn.execute(self._candidates, self._fair_params(limit * self.config.sample_factor))
            candidates = [row[0] for row in rows.fetchall()]
            if not candidates:
                return None
            random.shuffle(candidates)
            sample = candidates[:limit]
            records = self._lease(self._claim_sample, {"ids": sample})
            collisions += len(sample) - len(records)
            if records:
                return Claim(records, collisions=collisions)
        # Others took every sampled row: report the collisions with an empty claim.
        return Claim([], collisions=collisions) if collisions else None

    def ack(self, claim: Claim, outcome: PublishOutcome) -> AckResult:
        # The second short transaction; the owner fence makes an expired, re-claimed lease ack nothing.
        with self.conn.transaction():
            return finish(self.conn, self.config, outcome, owner=self.config.worker_id)

    def give_back(self, claim: Claim, error: str) -> None:
        """End the lease early on the rows still ours, so any worker can publish them right away."""
        self.conn.execute(
            sql.SQL(
                """
                UPDATE {messages} m SET available_after = now(), locked_by = NULL
                WHERE m.id = ANY(%(ids)s::bigint[]) AND m.locked_by = %(worker)s AND m.sent_at IS NULL
                """
            ).format(messages=self.table.messages),
            {"ids": [r.id for r in claim.records], "worker": self.config.worker_id},
        )
