"""Engine room: who is alive. A crashed worker's leases are freed in about a second, not a lease length.

Each relay worker holds a *session* advisory lock, ``(WORKER_LOCK_CLASS, hashtext(worker_id))``, on its
control connection for as long as it runs, and registers in ``outbox_workers``. PostgreSQL releases the
lock the moment that session ends (the process was killed, its host vanished and TCP keepalive gave up,
the server restarted), so "registered, and nobody holds its lock" means dead. Every worker's upkeep
(``upkeep_interval_s``, 1 s) reaps the dead: deletes their registration, frees their partitions
(``outbox_offsets``) and row leases (``outbox_leases``) at once. Expiry (``lease_s``) stays the fallback
for a holder that is connected but hung: its session, and so its lock, lives on.

What keeps a reaped-but-alive worker (its control connection broke, its other connections did not) from
doing harm is what kept a worker whose lease expired from it: acks are fenced by the owner (``locked_by``)
and, for positions, a compare-and-set on the old position. It publishes duplicates, never skips.

Behind a transaction-pooling PgBouncer a session lock stays on whichever server connection took it, which
goes back to the pool: the worker cannot hold it, and a dead worker's lock may outlive it. A worker checks,
in a separate transaction, that its own backend holds the lock; where it does not (or where
``OUTBOX_LIVENESS=expiry``) it registers as ``expiry`` and its leases are only ever freed by expiry. A hash
collision between two worker ids can only make a dead worker look alive: expiry again, never a loss.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import psycopg
from psycopg import sql

from . import settings
from .config import OutboxTable

log = logging.getLogger(__name__)

# First key of the workers' session locks: distinct from the advisory strategy's ("OA") and the
# transaction-scoped migration and serialized-writer classes.
WORKER_LOCK_CLASS = 0x4F57  # "OW"
Liveness = Literal["session", "expiry"]

_HOLDS_LOCK = """
    SELECT EXISTS (
        SELECT 1 FROM pg_locks
        WHERE locktype = 'advisory' AND granted AND classid = %(class)s::oid
          AND objid = hashtext(%(worker)s)::oid AND objsubid = 2 {mine})
"""

# Dead: registered as session-bound and nobody holds its lock. Freed in one statement.
_REAP = """
    WITH dead AS (
        DELETE FROM {workers} w
        WHERE w.liveness = 'session' AND NOT EXISTS (
            SELECT 1 FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %(class)s::oid
              AND l.objid = hashtext(w.worker_id)::oid AND l.objsubid = 2)
        RETURNING w.worker_id
    ),
    partitions AS (
        UPDATE {offsets} o SET locked_by = NULL, available_after = now(), updated_at = now()
        FROM dead WHERE o.locked_by = dead.worker_id
        RETURNING o.topic
    ),
    rows AS (
        DELETE FROM {leases} l USING dead WHERE l.locked_by = dead.worker_id RETURNING l.id
    )
    SELECT coalesce((SELECT array_agg(worker_id ORDER BY worker_id) FROM dead), '{{}}'),
           (SELECT count(*) FROM partitions), (SELECT count(*) FROM rows)
"""


@dataclass(frozen=True)
class Reaped:
    workers: tuple[str, ...] = ()
    partitions: int = 0
    rows: int = 0


def liveness_from_env(env: Mapping[str, str] | None = None) -> Liveness:
    """OUTBOX_LIVENESS: ``session`` (default: crashed workers are detected at once) or ``expiry`` (leases
    only end by expiry; what a transaction-pooling PgBouncer forces anyway)."""
    return settings.LIVENESS.read(env)  # type: ignore[return-value]


class WorkerPresence:
    """A worker's registration and session lock, on a connection of its own (the control connection)."""

    def __init__(
        self, conn: psycopg.Connection, table: OutboxTable, worker_id: str, liveness: Liveness, kind: str = "relay"
    ) -> None:
        self.conn = conn
        self.kind = kind  # "relay" serves every partition (strategies/sharing.py deals partitions among them)
        self.table = table
        self.worker_id = worker_id
        self.liveness: Liveness = liveness
        self._key = {"class": WORKER_LOCK_CLASS, "worker": worker_id}

    def register(self) -> Liveness:
        """Take the session lock (unless expiry), check it is really ours, then register; returns the
        liveness in force. The lock comes first: a registered session-bound worker without it is dead."""
        if self.liveness == "session":
            taken = self.conn.execute(
                "SELECT pg_try_advisory_lock(%(class)s, hashtext(%(worker)s))", self._key
            ).fetchone()
            if not (taken and taken[0]):
                log.warning(
                    "worker %s: its liveness lock is held by another session (the same worker id running "
                    "twice, or a transaction pooler): its leases will end by expiry only",
                    self.worker_id,
                )
                self.liveness = "expiry"
            elif not (self.holds_lock() and self.holds_lock()):  # two more transactions, two more chances
                log.warning(
                    "worker %s: the connection does not keep its session lock between transactions (a "
                    "transaction-pooling PgBouncer?): its leases will end by expiry only",
                    self.worker_id,
                )
                self.liveness = "expiry"
        self.conn.execute(
            sql.SQL(
                """
                INSERT INTO {workers} (worker_id, kind, liveness, backend_pid, application_name)
                VALUES (%(worker)s, %(kind)s, %(liveness)s, pg_backend_pid(), current_setting('application_name'))
                ON CONFLICT (worker_id) DO UPDATE SET kind = excluded.kind, liveness = excluded.liveness,
                    backend_pid = excluded.backend_pid, application_name = excluded.application_name,
                    registered_at = now(), heartbeat_at = now()
                """
            ).format(workers=self.table.workers),
            {**self._key, "kind": self.kind, "liveness": self.liveness},
        )
        return self.liveness

    def holds_lock(self) -> bool:
        query = sql.SQL(_HOLDS_LOCK).format(mine=sql.SQL("AND pid = pg_backend_pid()"))
        row = self.conn.execute(query, self._key).fetchone()
        return bool(row and row[0])

    def upkeep(self) -> Reaped:
        """Heartbeat, a check that the lock is still ours, and a reap of dead workers."""
        if self.liveness == "session" and not self.holds_lock():
            log.warning("worker %s lost its liveness lock: registering again", self.worker_id)
            self.register()
        self.conn.execute(
            sql.SQL("UPDATE {} SET heartbeat_at = now() WHERE worker_id = %(worker)s").format(self.table.workers),
            self._key,
        )
        return reap(self.conn, self.table)

    def deregister(self) -> None:
        """A clean stop: gone from the registry and the lock released, so nobody waits for expiry."""
        if self.conn.closed or self.conn.broken:
            return
        try:
            self.conn.execute(
                sql.SQL("DELETE FROM {} WHERE worker_id = %(worker)s").format(self.table.workers), self._key
            )
            if self.liveness == "session":
                self.conn.execute("SELECT pg_advisory_unlock(%(class)s, hashtext(%(worker)s))", self._key)
        except psycopg.Error as exc:  # the session ends right after; that releases the lock too
            log.debug("deregistering %s: %s", self.worker_id, exc)


@contextmanager
def present(dsn: str, table: OutboxTable, worker_id: str, *, kind: str, liveness: Liveness) -> Iterator[WorkerPresence]:
    """Registered, and alive by its session, for the block: what a bulk drain's driver holds while its tasks
    run, so that if the driver dies its leases are freed by the next upkeep of any relay worker."""
    with psycopg.connect(dsn, autocommit=True, application_name=f"outbox {worker_id}"[:63]) as conn:
        presence = WorkerPresence(conn, table, worker_id, liveness, kind=kind)
        presence.register()
        try:
            yield presence
        finally:
            presence.deregister()


def reap(conn: psycopg.Connection, table: OutboxTable) -> Reaped:
    """Free everything held by registered session-bound workers whose session is gone."""
    query = sql.SQL(_REAP).format(workers=table.workers, offsets=table.offsets, leases=table.leases)
    row = conn.execute(query, {"class": WORKER_LOCK_CLASS}).fetchone()
    reaped = Reaped(tuple(row[0]), int(row[1]), int(row[2])) if row else Reaped()
    if reaped.workers:
        log.info(
            "dead workers %s: freed %d partitions and %d row leases",
            ", ".join(reaped.workers),
            reaped.partitions,
            reaped.rows,
        )
    return reaped


def holders_alive(conn: psycopg.Connection, table: OutboxTable, holders: Collection[str]) -> dict[str, bool | None]:
    """For each holder: True (its session holds its lock), False (registered session-bound, lock gone:
    about to be reaped), None (unknown: expiry liveness or not registered)."""
    if not holders:
        return {}
    rows = conn.execute(
        sql.SQL(
            """
            SELECT h.name, w.liveness, EXISTS (
                SELECT 1 FROM pg_locks l
                WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %(class)s::oid
                  AND l.objid = hashtext(h.name)::oid AND l.objsubid = 2)
            FROM unnest(%(names)s::text[]) AS h(name) LEFT JOIN {workers} w ON w.worker_id = h.name
            """
        ).format(workers=table.workers),
        {"class": WORKER_LOCK_CLASS, "names": sorted(holders)},
    ).fetchall()
    return {name: (held if liveness == "session" else None) for name, liveness, held in rows}


@dataclass(frozen=True)
class LiveWorker:
    worker_id: str
    kind: str  # "relay": serves every partition (dealt among them); "relay-scoped", "drain": their own scope
    liveness: Liveness


def live_workers(conn: psycopg.Connection, table: OutboxTable, lease_s: float) -> list[LiveWorker]:
    """Registered workers that are alive now: their session holds their lock (session liveness) or their
    heartbeat is younger than ``lease_s`` (expiry). A dead worker not yet reaped is not listed."""
    rows = conn.execute(
        sql.SQL(
            """
            SELECT w.worker_id, w.kind, w.liveness FROM {workers} w
            WHERE CASE w.liveness
                WHEN 'session' THEN EXISTS (
                    SELECT 1 FROM pg_locks l
                    WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %(class)s::oid
                      AND l.objid = hashtext(w.worker_id)::oid AND l.objsubid = 2)
                ELSE w.heartbeat_at > now() - make_interval(secs => %(lease)s) END
            ORDER BY w.worker_id
            """
        ).format(workers=table.workers),
        {"class": WORKER_LOCK_CLASS, "lease": lease_s},
    ).fetchall()
    return [LiveWorker(worker_id, kind, liveness) for worker_id, kind, liveness in rows]
