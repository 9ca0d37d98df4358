"""A worker's presence: its session lock and registration, and their upkeep, so that one worker id is one live process
and a crashed worker is seen within seconds. See docs/operations.md#crashed-workers."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import sql

from .. import server
from ..config import OutboxTable
from ..connection_path import connection_path
from ..errors import OutboxError
from ..observe.liveness import WORKER_LOCK_CLASS, Liveness, LivenessMode, Reaped, lock_held, lock_key, reap

log = logging.getLogger(__name__)

# The control session asks the server to probe its client: a vanished host ends the session (and frees its lock)
# after about idle + interval x count seconds instead of the kernel's two hours.
SERVER_KEEPALIVES = {"tcp_keepalives_idle": 10, "tcp_keepalives_interval": 5, "tcp_keepalives_count": 3}


# The session holding a worker id's lock, for the message that names it.
_HOLDER = """
    SELECT a.pid, a.application_name, host(a.client_addr), a.backend_start
    FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
      AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
      AND l.classid = %(class)s::oid AND l.objid = hashtext(%(schema)s || '/' || %(worker)s)::oid
    LIMIT 1
"""


class WorkerIdInUseError(OutboxError):
    """Another live session holds this worker id: two processes under one id would publish the same partitions."""


class WorkerPresence:
    """A worker's registration and session lock, on a connection of its own (the control connection)."""

    def __init__(
        self,
        conn: psycopg.Connection,
        table: OutboxTable,
        worker_id: str,
        liveness: LivenessMode,
        kind: str = "relay",
        *,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.conn = conn
        self.kind = kind  # "relay" serves every partition (strategies/positions/sharing.py deals partitions among them)
        self.table = table
        self.worker_id = worker_id
        self.mode: LivenessMode = liveness
        # Effective once registered; "session" until then only for the type (register decides).
        self.liveness: Liveness = "expiry" if liveness == "expiry" else "session"
        self.heartbeat_s = heartbeat_s
        self._key = {"class": WORKER_LOCK_CLASS, "worker": worker_id, "schema": table.schema}
        self._lock_key = lock_key(sql.Literal(table.schema), sql.Literal(worker_id))

    def register(self, *, wait_s: float = 0.0, stop: threading.Event | None = None) -> Liveness:
        """Take the session lock (unless expiry), then register; returns the liveness in force. The lock comes first:
        a registered session-bound worker without it is dead. Waits up to ``wait_s`` for a live session that holds
        this worker id, then raises WorkerIdInUseError naming it."""
        self.liveness = self._decide()
        if self.liveness == "session":
            for name, value in SERVER_KEEPALIVES.items():
                self.conn.execute(sql.SQL("SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))
            self._take_lock(wait_s, stop)
            if not (self.holds_lock() and self.holds_lock()):  # two more transactions, two more chances
                log.warning(
                    "worker %s: the connection does not keep its session lock between transactions (a "
                    "transaction-pooling PgBouncer?): its leases will end by expiry only",
                    self.worker_id,
                )
                self.liveness = "expiry"
        else:
            self._wait_for_stale_twin(wait_s, stop)
        self._record()
        return self.liveness

    def _record(self) -> None:
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

    def _decide(self) -> Liveness:
        if self.mode != "auto":
            return self.mode
        path = connection_path(self.conn)
        if path.direct:
            return "session"
        log.warning(
            "worker %s: %s: a pooler or proxy may move its session, so its leases will end by expiry only "
            "(set OUTBOX_LIVENESS=session if this path keeps one server session per connection)",
            self.worker_id,
            path.reason,
        )
        return "expiry"

    def _take_lock(self, wait_s: float, stop: threading.Event | None) -> None:
        """The lock, waiting (in the database, in slices that stay responsive to ``stop``) while a live session has
        it."""
        deadline = time.monotonic() + wait_s
        take = sql.SQL("SELECT pg_try_advisory_lock({})").format(self._lock_key)
        wait = sql.SQL("SELECT pg_advisory_lock({})").format(self._lock_key)
        row = self.conn.execute(take).fetchone()
        if row and row[0]:
            return
        holder = self.holder()
        log.warning(
            "worker %s: its id is held by a live session (%s): waiting up to %.0f s for it to end",
            self.worker_id,
            holder,
            wait_s,
        )
        while (left := deadline - time.monotonic()) > 0 and not (stop is not None and stop.is_set()):
            try:
                with self.conn.transaction():
                    self.conn.execute(
                        sql.SQL("SET LOCAL lock_timeout = {}").format(
                            sql.Literal(f"{int(min(left, 1.0) * 1000) + 1}ms")
                        )
                    )
                    self.conn.execute(wait)
                return
            except psycopg.errors.LockNotAvailable:
                continue
        raise WorkerIdInUseError(
            f"worker id {self.worker_id!r} of outbox {self.table.schema!r} is in use by a live session "
            f"({self.holder() or holder}): two processes under one id would publish the same partitions. Stop the "
            "other one, or give this worker its own id (--worker-id)"
        )

    def holder(self) -> str:
        """Who holds this worker id's lock now, in words ('' when nobody does)."""
        row = self.conn.execute(_HOLDER, self._key).fetchone()
        if row is None:
            return ""
        pid, application, client, since = row
        since_text = f"{since:%Y-%m-%d %H:%M:%S %Z}"
        return f"pid {pid}, application_name {application!r}, client {client or 'local socket'}, since {since_text}"

    def _wait_for_stale_twin(self, wait_s: float, stop: threading.Event | None) -> None:
        """Expiry liveness has no lock to wait on: a registration of this id whose heartbeat is fresh belongs to a
        live twin (a dead one stops heartbeating): wait for it to go stale, then refuse."""
        stale_after = 3 * self.heartbeat_s
        query = sql.SQL(
            "SELECT extract(epoch FROM now() - heartbeat_at)::float8, application_name FROM {} "
            "WHERE worker_id = %(worker)s"
        ).format(self.table.workers)
        deadline = time.monotonic() + wait_s
        while True:
            row = self.conn.execute(query, self._key).fetchone()
            if row is None or row[0] >= stale_after:
                return
            if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                raise WorkerIdInUseError(
                    f"worker id {self.worker_id!r} of outbox {self.table.schema!r} heartbeats elsewhere "
                    f"({row[1]!r}, {row[0]:.1f} s ago): two processes under one id would publish the same "
                    "partitions. Stop the other one, or give this worker its own id (--worker-id)"
                )
            (stop or threading.Event()).wait(min(self.heartbeat_s, max(0.0, deadline - time.monotonic())))

    def holds_lock(self) -> bool:
        row = self.conn.execute(
            sql.SQL("SELECT {}").format(lock_held(sql.Literal(self.worker_id), mine=True)), self._key
        ).fetchone()
        return bool(row and row[0])

    def upkeep(self) -> Reaped:
        """Heartbeat, a check that the lock is still ours, and a reap of dead workers."""
        if self.liveness == "session" and not self.holds_lock():
            self._lock_again()
        self.conn.execute(
            sql.SQL("UPDATE {} SET heartbeat_at = now() WHERE worker_id = %(worker)s").format(self.table.workers),
            self._key,
        )
        return reap(self.conn, self.table)

    def _lock_again(self) -> None:
        """The lock is no longer this session's (a pooler moved the connection after all): take it again, or, where
        another session has it, leave liveness to expiry. Never raises: this worker is running, and two processes
        under one id were refused at start."""
        row = self.conn.execute(sql.SQL("SELECT pg_try_advisory_lock({})").format(self._lock_key)).fetchone()
        if not (row and row[0]):
            log.warning(
                "worker %s lost its liveness lock to another session (%s): its leases will end by expiry only",
                self.worker_id,
                self.holder() or "gone since",
            )
            self.liveness = "expiry"
        else:
            log.warning("worker %s lost its liveness lock: took it again", self.worker_id)
        self._record()

    def deregister(self) -> None:
        """A stop, clean or on an exception: gone from the registry, what it leased freed and the lock released, so
        nobody waits for expiry. (Its registration gone, the reaper could no longer free its leases: a worker that
        exited on an exception held its partitions for ``lease_s``.) Nothing of it is acked after this: what it had
        in flight is published again by whoever takes the partition (at least once)."""
        if self.conn.closed or self.conn.broken:
            return
        try:
            self.conn.execute(
                sql.SQL(
                    """
                    WITH gone AS (DELETE FROM {workers} WHERE worker_id = %(worker)s),
                    partitions AS (
                        UPDATE {offsets} SET locked_by = NULL, available_after = now(), updated_at = now()
                        WHERE locked_by = %(worker)s
                    )
                    DELETE FROM {leases} WHERE locked_by = %(worker)s
                    """
                ).format(workers=self.table.workers, offsets=self.table.offsets, leases=self.table.leases),
                self._key,
            )
            if self.liveness == "session":
                self.conn.execute(sql.SQL("SELECT pg_advisory_unlock({})").format(self._lock_key))
        except psycopg.Error as exc:  # the session ends right after; that releases the lock too
            log.debug("deregistering %s: %s", self.worker_id, exc)


@contextmanager
def present(
    dsn: str,
    table: OutboxTable,
    worker_id: str,
    *,
    kind: str,
    liveness: LivenessMode,
    heartbeat_s: float = 1.0,
) -> Iterator[WorkerPresence]:
    """Registered, and alive by its session, for the block: what a bulk drain's driver holds while its tasks run.

    A thread keeps the registration alive every ``heartbeat_s`` (a heartbeat, so no idle-session timeout or idle
    proxy ends it, and a check of its lock): should the session end anyway, it registers again on a new one. If the
    process dies, any relay worker's upkeep frees what it leased within a second.
    """
    holder = _KeptAlive(dsn, table, worker_id, kind, liveness, heartbeat_s)
    try:
        yield holder.presence
    finally:
        holder.close()


class _KeptAlive:
    """A WorkerPresence on a connection of its own, kept registered by a heartbeat thread until closed."""

    def __init__(
        self, dsn: str, table: OutboxTable, worker_id: str, kind: str, liveness: LivenessMode, heartbeat_s: float
    ) -> None:
        self._args = (dsn, table, worker_id, kind, liveness, heartbeat_s)
        self.presence = self._register()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"presence-{worker_id}", daemon=True)
        self._thread.start()

    def _register(self) -> WorkerPresence:
        dsn, table, worker_id, kind, liveness, heartbeat_s = self._args
        conn = server.connect(dsn, autocommit=True, application_name=f"outbox {worker_id}"[:63])
        presence = WorkerPresence(conn, table, worker_id, liveness, kind=kind, heartbeat_s=heartbeat_s)
        presence.register()
        return presence

    def _beat(self) -> None:
        while not self._stop.wait(self.presence.heartbeat_s):
            try:
                self.presence.upkeep()
            except psycopg.OperationalError as exc:
                log.warning("worker %s: its session ended (%s): registering again", self.presence.worker_id, exc)
                self.presence.conn.close()
                try:
                    self.presence = self._register()
                except psycopg.Error as again:
                    log.warning("worker %s: registering again failed: %s", self.presence.worker_id, again)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.presence.deregister()
        self.presence.conn.close()
