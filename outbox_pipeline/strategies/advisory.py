"""Strategy `advisory`: one active worker per outbox, elected by a session advisory lock, publishing in id order; the
others stand by. See docs/strategies.md#advisory-one-active-worker."""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import ClassVar

import psycopg
from psycopg import IsolationLevel, pq

from ..errors import ConfigurationError
from ..model import AckResult, Claim, OutboxRecord, PublishOutcome
from .base import Strategy, StrategyConfig, fetch_records
from .quarantine import NO_HOLDS, Quarantine
from .rows import finish, select_pending_sql, split_failures

log = logging.getLogger(__name__)

# First key of pg_try_advisory_lock(class, hashtext(schema)); distinct from the migration and the
# serialized-writer classes, which are transaction-scoped locks in the same key space.
ADVISORY_LOCK_CLASS = 0x4F41  # "OA"

# Does this server connection already hold our lock? (Two-int4 keys show as objsubid 2.)
_HELD_HERE = """
    SELECT EXISTS (
        SELECT 1 FROM pg_locks
        WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted
          AND classid = %(class)s::oid AND objid = hashtext(%(schema)s)::oid AND objsubid = 2)
"""
_TRY_LOCK = "SELECT pg_try_advisory_lock(%(class)s, hashtext(%(schema)s))"
_UNLOCK = "SELECT pg_advisory_unlock(%(class)s, hashtext(%(schema)s))"


class AdvisoryStrategy(Strategy):
    name: ClassVar[str] = "advisory"
    ordered: ClassVar[bool] = True

    def __init__(self, conn: psycopg.Connection, config: StrategyConfig) -> None:
        super().__init__(conn, config)
        # Only the holder reads, so isolation buys nothing here; say which one rather than inherit it.
        conn.isolation_level = IsolationLevel.READ_COMMITTED
        self._key = {"class": ADVISORY_LOCK_CLASS, "schema": self.table.schema}
        self._held = False
        self._select = select_pending_sql(config, order="id", lock=False)
        self._quarantine = Quarantine(conn, config, "m.id")
        self._has_holds = False
        self._release_in_flight = False

    @property
    def holds_lock(self) -> bool:
        """Whether this worker is the active one (it took the lock and has not released it)."""
        return self._held

    @property
    def standing_by(self) -> bool:
        return not self._held

    def claim(self, limit: int, avoid: Collection[int] = ()) -> Claim | None:
        if not self._held and not self._acquire():
            return None
        view = NO_HOLDS
        if self._has_holds:
            view = self._quarantine.view()
            self._has_holds = bool(view.keys)
            if view.released and not self._release_in_flight:
                released = self._quarantine.read_released(limit)
                if released:
                    self._release_in_flight = True
                    return Claim(released, holds_version=self._quarantine.version, release=True)
                with self.conn.transaction():
                    self._quarantine.finish_releases()
        # Rows of a batch still in flight are unsent but not ours to take again (pipelining).
        records = fetch_records(self.conn, self._select, {"limit": limit, "exclude": list(avoid)}, prepare=True)
        if not records:
            return None
        publish, withheld = view.split(records)
        return Claim(publish, withheld=withheld, holds_version=self._quarantine.version)

    def _acquire(self) -> bool:
        # One transaction, so that even a transaction pooler runs the check and the lock on one server
        # connection; the lock itself is session-scoped and survives the COMMIT.
        with self.conn.transaction():
            row = self.conn.execute(_HELD_HERE, self._key).fetchone()
            if row and row[0]:
                raise ConfigurationError(
                    "strategy 'advisory': this server connection already holds the relay's advisory lock that "
                    "this worker never took; the connection is shared (transaction pooling?). Use a direct "
                    "connection or session pooling."
                )
            row = self.conn.execute(_TRY_LOCK, self._key).fetchone()
        self._held = bool(row and row[0])
        if self._held:
            self._has_holds = self._quarantine.any_holds()
            log.info("advisory: worker %s is now the active relay for %s", self.config.worker_id, self.table.schema)
        return self._held

    def before_publish(self, claim: Claim) -> Claim | None:
        """Not a batch read before a hold began or ended: it may publish a row that is held now."""
        if claim.holds_version != self._quarantine.version:
            self.give_back(claim, "a hold began or ended since it was read")
            return None
        return claim

    def ack(self, claim: Claim, outcome: PublishOutcome) -> AckResult:
        # No owner fence needed: while this session holds the lock nobody else touches unsent rows.
        if claim.release:
            self._release_in_flight = False
            with self.conn.transaction():
                acked, retried, dead = self._quarantine.ack_released(claim.records, outcome)
            return AckResult(acked=acked, retried=retried, dead_lettered=dead)
        to_hold = self._successors_of_dead(claim.records, outcome)
        held = {r.id for r in to_hold}
        if held:
            outcome = PublishOutcome(
                [r for r in outcome.delivered if r.id not in held],
                [f for f in outcome.failed if f.record.id not in held],
                outcome.elapsed_s,
            )
        with self.conn.transaction():
            result = finish(self.conn, self.config, outcome)
            if self._quarantine.hold(split_failures(outcome.failed, self.config.max_attempts)[1]):
                self._has_holds = True
            self._quarantine.move_to_held([*claim.withheld, *to_hold], delete=True)
        return result

    def _successors_of_dead(self, records: list[OutboxRecord], outcome: PublishOutcome) -> list[OutboxRecord]:
        """Rows of the batch after a row of their key that is dead-lettered now: held with it, even if Kafka
        took them (they go out again after the dead letter)."""
        if not self._quarantine.enabled:
            return []
        dead = split_failures(outcome.failed, self.config.max_attempts)[1]
        first_dead: dict[tuple[str, bytes | None], int] = {}
        for failure in sorted(dead, key=lambda f: f.record.id):
            if failure.record.key is not None:
                first_dead.setdefault((failure.record.topic, failure.record.key), failure.record.id)
        return [r for r in records if r.id > first_dead.get((r.topic, r.key), r.id)]

    def give_back(self, claim: Claim, error: str) -> None:
        """Nothing to undo: claiming changed no row, so the next claim starts from the same row."""
        if claim.release:
            self._release_in_flight = False

    def close(self) -> None:
        """Release the lock so a standby takes over now rather than when this session ends."""
        if not self._held:
            return
        self._held = False
        conn = self.conn
        if conn.closed or conn.broken or conn.info.transaction_status != pq.TransactionStatus.IDLE:
            return  # ending the session (or rolling back into it) is the caller's job; that releases it
        row = conn.execute(_UNLOCK, self._key).fetchone()
        if not (row and row[0]):
            log.warning("advisory: the lock was not held by this server connection (transaction pooling?)")
