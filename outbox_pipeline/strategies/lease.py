"""Strategy `lease`: two short transactions per batch, the claim leasing rows in the narrow `outbox_leases` table, so no
row lock lasts a publish and many workers share the queue fairly. See
docs/strategies.md#lease-leased-rows-two-short-transactions."""

from __future__ import annotations

import random
import time
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import ClassVar

import psycopg
from psycopg import IsolationLevel, sql

from ..model import AckResult, Claim, OutboxRecord, PublishOutcome
from ..timestamps import created_at_bounds
from .base import (
    FRESH_LEASE_SHARE,
    RECORD_COLUMNS,
    Strategy,
    StrategyConfig,
    fetch_records,
    scope_condition,
    stamped_cursor,
)
from .rows import finish, oldest_share, one_priority_sql

# A claim that lost every row it picked to concurrent claims picks again this many times in all
# before reporting "nothing available": the rows it lost went to other workers, more may be left.
_ROUNDS = 3

# Unsent, available, not under a live lease: the rows a claim may pick. This worker's own batch in
# flight is under a live lease too, so the relay's ``avoid`` list adds nothing here and is not used:
# as an array constant it cost 23 ms of planning per claim (measured, 5,000 ids), more than the
# 5,000 lease-index probes it would save, and it kept the claim from being a prepared statement.
_CANDIDATE = """
    {a}.sent_at IS NULL AND {a}.available_after <= clock_timestamp() {scope}
    AND NOT EXISTS (SELECT 1 FROM {leases} l WHERE l.id = {a}.id AND l.expires_at > now())
"""

# The fair pick as CTEs: the oldest share by id, then the rest by priority. They may pick the same
# rows (always, when priorities are equal), so "urgent" reads a full batch and "picked" drops what
# "oldest" has with ``NOT IN (SELECT ...)``, a hashed lookup. Rows urgent locked but did not pick
# are released when the statement ends.
_FAIR = """
    oldest AS (
        SELECT o.id, o.created_at FROM {messages} o
        WHERE {candidate_o}
        ORDER BY o.id
        LIMIT %(oldest)s
        {lock}
    ),
    urgent AS (
        SELECT u.id, u.created_at FROM {messages} u
        WHERE {candidate_u}
        ORDER BY u.priority DESC, u.id
        LIMIT %(limit)s
        {lock}
    ),
    picked AS (
        SELECT id, created_at FROM oldest
        UNION ALL
        (SELECT id, created_at FROM urgent WHERE id NOT IN (SELECT id FROM oldest)
         LIMIT %(limit)s - (SELECT count(*) FROM oldest))
    )
"""

# Take the leases; RETURNING names the rows won. In id order, so concurrent claims never deadlock.
_TAKE = """
    INSERT INTO {leases} AS l (id, created_at, locked_by, expires_at)
    SELECT id, created_at, %(worker)s, now() + make_interval(secs => %(lease)s) FROM {source} ORDER BY id
    ON CONFLICT (id) DO UPDATE SET locked_by = excluded.locked_by, expires_at = excluded.expires_at
    WHERE l.expires_at <= now()
    RETURNING l.id, l.created_at
"""

# The leased rows, read after the lease committed. The created_at range lets PostgreSQL prune to the
# daily partitions holding them (``id = ANY(...)`` alone probes every partition's key for every id).
_READ = """
    SELECT {columns} FROM {messages} m
    WHERE m.id = ANY(%(ids)b::bigint[]) AND m.created_at BETWEEN %(from)s AND %(to)s AND m.sent_at IS NULL
"""


@dataclass(frozen=True, slots=True)
class _Leased:
    """The ids a claim holds leases on (a row may have gone since; its lease is still ours to end)."""

    ids: list[int]


class LeaseStrategy(Strategy):
    name: ClassVar[str] = "lease"
    ordered: ClassVar[bool] = False

    def __init__(self, conn: psycopg.Connection, config: StrategyConfig) -> None:
        super().__init__(conn, config)
        # SKIP LOCKED and ON CONFLICT's re-check of the latest lease are READ COMMITTED behaviour.
        conn.isolation_level = IsolationLevel.READ_COMMITTED
        t = config.table

        def fair(lock: str) -> sql.Composed:
            def candidate(alias: str) -> sql.Composed:
                return sql.SQL(_CANDIDATE).format(
                    a=sql.Identifier(alias), scope=scope_condition(config, alias), leases=t.leases
                )

            return sql.SQL(_FAIR).format(
                messages=t.messages, candidate_o=candidate("o"), candidate_u=candidate("u"), lock=sql.SQL(lock)
            )

        take_picked = sql.SQL(_TAKE).format(leases=t.leases, source=sql.SQL("picked"))
        self._claim = sql.SQL("WITH {fair} {take}").format(fair=fair("FOR UPDATE SKIP LOCKED"), take=take_picked)
        # created_at as text for the sample to send back as it came (infinity included).
        self._candidates = sql.SQL("WITH {fair} SELECT id, created_at::text FROM picked").format(fair=fair(""))
        self._take_sample = sql.SQL(_TAKE).format(
            leases=t.leases,
            source=sql.SQL("unnest(%(ids)s::bigint[], %(created)s::text[]::timestamptz[]) AS s(id, created_at)"),
        )
        self._read = sql.SQL(_READ).format(columns=sql.SQL(RECORD_COLUMNS), messages=t.messages)
        self._release = sql.SQL(
            "DELETE FROM {leases} l WHERE l.id = ANY(%(ids)b::bigint[]) AND l.locked_by = %(worker)s RETURNING l.id"
        ).format(leases=t.leases)
        # The ack's first statement: lock the batch's message rows, in id order, before any lease row. A
        # claim locks a message row (SKIP LOCKED) and then its lease row; an ack that took a lease row
        # first and then waited for a message row a concurrent claim held was a deadlock (reproduced).
        self._lock_rows = sql.SQL(
            "SELECT m.id FROM {messages} m WHERE m.id = ANY(%(ids)b::bigint[]) "
            "AND m.created_at BETWEEN %(from)s::timestamptz AND %(to)s::timestamptz ORDER BY m.id FOR UPDATE OF m"
        ).format(messages=t.messages)
        # Leases of a batch read ahead that still have most of their length: ours, and as good as renewed.
        self._fresh = sql.SQL(
            "SELECT l.id FROM {leases} l WHERE l.id = ANY(%(ids)b::bigint[]) AND l.locked_by = %(worker)s "
            "AND l.expires_at > now() + make_interval(secs => %(lease)s * {share})"
        ).format(leases=t.leases, share=sql.Literal(FRESH_LEASE_SHARE))
        self._renew = sql.SQL(
            "UPDATE {leases} l SET expires_at = now() + make_interval(secs => %(lease)s) "
            "WHERE l.id = ANY(%(ids)b::bigint[]) AND l.locked_by = %(worker)s RETURNING l.id"
        ).format(leases=t.leases)
        self._one_priority = one_priority_sql(config)
        self._swept_at = float("-inf")
        self._reclaim_own_leases()

    def _reclaim_own_leases(self) -> None:
        """A restart under the same worker_id: this worker's leases belong to a dead process, free them now.
        Expired leases of anyone go too: they hold nothing, and rows deleted elsewhere leave them behind."""
        self.conn.execute(
            sql.SQL("DELETE FROM {leases} WHERE locked_by = %(worker)s OR expires_at <= now()").format(
                leases=self.table.leases
            ),
            {"worker": self.config.worker_id},
        )
        self._swept_at = time.monotonic()

    def _params(self, limit: int) -> dict[str, object]:
        return {
            "oldest": oldest_share(self.conn, self.config, self._one_priority, limit),
            "limit": limit,
            "lease": self.config.lease_s,
            "worker": self.config.worker_id,
        }

    def _read_leased(self, won: list[tuple[int, int]]) -> list[OutboxRecord]:
        """``won``: (id, created_at) as RETURNING gave them through ``stamped_cursor``."""
        ids = [row[0] for row in won]
        params = {"ids": ids, **created_at_bounds([row[1] for row in won])}
        records = fetch_records(self.conn, self._read, params, prepare=False)
        if len(records) < len(ids):  # acked by a previous owner meanwhile: end those leases now
            gone = sorted(set(ids) - {r.id for r in records})
            self.conn.execute(self._release, {"ids": gone, "worker": self.config.worker_id})
        records.sort(key=lambda r: r.id)  # publish oldest first within the batch
        return records

    def claim(self, limit: int, avoid: Collection[int] = ()) -> Claim | None:
        if self.config.sample_factor > 1:
            return self._claim_sampled(limit)
        params = self._params(limit)
        for _ in range(_ROUNDS):
            won = stamped_cursor(self.conn).execute(self._claim, params, prepare=True).fetchall()
            if won:
                records = self._read_leased(won)
                if records:
                    return Claim(records, state=_Leased([row[0] for row in won]))
            elif not self._contended(limit):
                break
        self._sweep()
        return None

    def _contended(self, limit: int) -> bool:
        """Nothing won: were there candidates (lost to a concurrent claim), or is there no work?"""
        return bool(self.conn.execute(self._candidates, {**self._params(1)}).fetchone())

    def _claim_sampled(self, limit: int) -> Claim | None:
        collisions = 0
        for _ in range(_ROUNDS):
            rows = self.conn.execute(self._candidates, self._params(limit * self.config.sample_factor)).fetchall()
            if not rows:
                break
            random.shuffle(rows)
            sample = rows[:limit]
            params = {
                "ids": [r[0] for r in sample],
                "created": [r[1] for r in sample],
                "lease": self.config.lease_s,
                "worker": self.config.worker_id,
            }
            won = stamped_cursor(self.conn).execute(self._take_sample, params).fetchall()
            records = self._read_leased(won) if won else []
            collisions += len(sample) - len(records)
            if records:
                return Claim(records, collisions=collisions, state=_Leased([row[0] for row in won]))
        self._sweep()
        # Others took every sampled row: report the collisions with an empty claim.
        return Claim([], collisions=collisions, state=_Leased([])) if collisions else None

    def _sweep(self) -> None:
        """When idle, at most once a lease period: drop expired leases (they hold nothing)."""
        if time.monotonic() - self._swept_at < self.config.lease_s:
            return
        self.conn.execute(sql.SQL("DELETE FROM {} WHERE expires_at <= now()").format(self.table.leases))
        self._swept_at = time.monotonic()

    def before_publish(self, claim: Claim) -> Claim | None:
        """A batch read ahead waited for the previous publish: renew its leases so they cover this one,
        and publish only the rows still ours (another worker may have taken an expired lease)."""
        leased: _Leased = claim.state
        params = {"ids": leased.ids, "worker": self.config.worker_id, "lease": self.config.lease_s}
        kept = {row[0] for row in self.conn.execute(self._fresh, params)}
        if len(kept) < len(leased.ids):
            aged = [i for i in leased.ids if i not in kept]
            kept.update(row[0] for row in self.conn.execute(self._renew, {**params, "ids": aged}))
        if len(kept) == len(leased.ids):
            return claim
        records = [r for r in claim.records if r.id in kept]
        if not records:
            self.give_back(Claim([], state=_Leased(sorted(kept))), "leases lost before publishing")
            return None
        return Claim(records, claim.collisions, _Leased(sorted(kept)), claim.transactional_ids)

    def ack(self, claim: Claim, outcome: PublishOutcome) -> AckResult:
        # The second short transaction. Message rows first, then our lease rows (see _lock_rows): a
        # worker re-claiming an expired lease either was skipped past the locked rows or committed
        # first, and then the lease delete below finds the lease no longer ours.
        leased: _Leased = claim.state
        with self.conn.transaction():
            if claim.records:
                bounds = created_at_bounds([r.created_at for r in claim.records])
                self.conn.execute(self._lock_rows, {"ids": [r.id for r in claim.records], **bounds})
            owned = {
                row[0] for row in self.conn.execute(self._release, {"ids": leased.ids, "worker": self.config.worker_id})
            }
            kept = PublishOutcome(
                delivered=[r for r in outcome.delivered if r.id in owned],
                failed=[f for f in outcome.failed if f.record.id in owned],
            )
            result = finish(self.conn, self.config, kept)
        lost = len(outcome.delivered) + len(outcome.failed) - len(kept.delivered) - len(kept.failed)
        return replace(result, lost_ownership=result.lost_ownership + lost)

    def give_back(self, claim: Claim, error: str) -> None:
        """End the leases still ours, so any worker can publish those rows right away."""
        leased: _Leased = claim.state
        self.conn.execute(self._release, {"ids": leased.ids, "worker": self.config.worker_id})
