"""One streamer per slot, and a waiting relay that takes over within seconds when the streamer dies or freezes, without
two producers publishing at once. See docs/wal.md#one-streamer-and-taking-over."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from ... import server
from ...config import OutboxTable
from ...store.wal.objects import names_of, slot_holder

log = logging.getLogger(__name__)

# Class of the session advisory lock (class, hashtext(schema)) the streamer of an outbox's slot holds.
WAL_LEADER_LOCK_CLASS = 0x4F57  # "OW"
# Added to message.timeout.ms in a successor's wait (fence_s): a request in flight at the expiry, the clocks' drift.
FENCE_MARGIN_S = 2.0


@dataclass(frozen=True)
class LeaderSettings:
    poll_s: float = 1.0  # how often a waiting relay tries the lock
    takeover_after_s: float = 30.0  # a streamer whose lock session said nothing this long is frozen
    slot_free_timeout_s: float = 10.0  # how long to wait for a gone streamer's walsender to end
    fence_s: float = 0.0  # after ending a frozen streamer: until its producer's queue has expired (WalRelay sets it)


class SlotLeader:
    """The lock that makes one relay the slot's streamer. ``acquire`` waits for it; ``release`` gives it up."""

    def __init__(self, dsn: str, table: OutboxTable, stop: threading.Event, settings: LeaderSettings) -> None:
        self._dsn = dsn
        self._table = table
        self._stop = stop
        self._settings = settings
        self._slot = names_of(table).slot
        self._conn: psycopg.Connection | None = None
        self._blind_logged = False
        self._fence_until = 0.0  # monotonic: a frozen streamer's queued messages have expired by then

    def acquire(self, deadline: float | None = None, waiting: Callable[[], None] | None = None) -> bool:
        """Wait until this relay holds the lock (True), or ``stop`` is set or the monotonic ``deadline`` passes
        (False); ``waiting`` is called at each try (a waiting relay is healthy: its liveness probe must not restart
        it)."""
        logged = False
        while not self._stop.is_set() and (deadline is None or time.monotonic() < deadline):
            if waiting is not None:
                waiting()
            conn = self._connection()
            row = conn.execute(
                "SELECT pg_try_advisory_lock(%s, hashtext(%s))", (WAL_LEADER_LOCK_CLASS, self._table.schema)
            ).fetchone()
            if row and row[0]:
                self._free_slot(conn)
                return self._await_fence(waiting)
            if not logged:
                log.info("another relay streams the slot %s; waiting to take over", self._slot)
                logged = True
            due_s = self._end_frozen_leader(conn)
            if due_s == 0.0:
                continue  # its sessions are gone, and its lock with them: take it now
            wait = min(self._settings.poll_s, due_s)
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
            self._stop.wait(max(wait, 0.0))
        return False

    def _await_fence(self, waiting: Callable[[], None] | None) -> bool:
        """Hold the lock, saying it is alive, until what a frozen predecessor's producer queued has expired (True), or
        until ``stop`` (False, the lock released)."""
        every_s = min(self._settings.poll_s, self._settings.takeover_after_s / 3)
        while (left := self._fence_until - time.monotonic()) > 0:
            if waiting is not None:
                waiting()
            self.heartbeat()
            if self._stop.wait(min(left, every_s)):
                self.release()
                return False
        return True

    def release(self) -> None:
        if self._conn is not None:
            self._conn.close()  # the session's lock goes with it
            self._conn = None

    def heartbeat(self) -> None:
        """The streamer is alive: a statement on its ordinary session, which a waiting relay of the same role sees
        (``pg_stat_activity.state_change``), whatever its monitoring rights."""
        self.connection.execute("SELECT 1")

    @property
    def connection(self) -> psycopg.Connection:
        """The leader's ordinary session (autocommit), for what the streamer writes (dead letters)."""
        return self._connection()

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            # UTF-8 whatever the database's encoding, as the table strategies' sessions (strategies/base.py): the
            # held messages it reads back go to Kafka as the bytes it loads (holds.py).
            self._conn = server.connect(
                self._dsn, autocommit=True, application_name="outbox-relay-wal", client_encoding="UTF8"
            )
        return self._conn

    def _free_slot(self, conn: psycopg.Connection) -> None:
        """End a walsender a gone streamer left on the slot, and wait until the slot is free."""
        deadline = self._settings.slot_free_timeout_s
        waited = 0.0
        while True:
            _, pid = slot_holder(conn, self._slot)
            if pid is None:
                return
            if waited == 0.0:
                log.warning("the slot %s is still streamed by pid %s, a relay that is gone: ending it", self._slot, pid)
                try:
                    conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
                except psycopg.errors.InsufficientPrivilege as exc:  # another role's: START_REPLICATION says so
                    log.warning("this relay's role may not end pid %s (%s)", pid, str(exc).strip().splitlines()[0])
                    return
            if waited >= deadline or self._stop.wait(0.1):
                return  # START_REPLICATION will say the slot is active, and the relay tries again
            waited += 0.1

    def _end_frozen_leader(self, conn: psycopg.Connection) -> float:
        """End the streamer's sessions if it has been silent for the takeover time (0.0: ended, the lock is free);
        else the seconds until it would be (the next look then, not a poll later: each poll added to the takeover is
        a second more that nothing is published)."""
        row = conn.execute(
            """
            SELECT s.active_pid, l.pid, extract(epoch FROM now() - a.state_change)
            FROM pg_replication_slots s
            LEFT JOIN pg_locks l ON l.locktype = 'advisory' AND l.granted AND l.classid = %(class)s
                 AND l.objid = hashtext(%(schema)s)::oid AND l.objsubid = 2
                 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
            LEFT JOIN pg_stat_activity a ON a.pid = l.pid
            WHERE s.slot_name = %(slot)s AND s.database = current_database()
            """,
            {"class": WAL_LEADER_LOCK_CLASS, "schema": self._table.schema, "slot": self._slot},
        ).fetchone()
        if row is None:
            return math.inf
        walsender, holder, silent_s = row
        if holder is not None and silent_s is None and not self._blind_logged:
            self._blind_logged = True
            log.warning(
                "cannot tell whether the relay streaming the slot %s is alive: its session belongs to another role "
                "and this one has neither that role nor pg_read_all_stats; a frozen streamer is not taken over",
                self._slot,
            )
        if holder is None or silent_s is None:
            return math.inf
        if float(silent_s) < self._settings.takeover_after_s:
            return self._settings.takeover_after_s - float(silent_s)
        log.warning(
            "the relay streaming the slot %s has not answered for %.0f s (frozen?): ending its sessions (pids %s, %s)",
            self._slot,
            float(silent_s),
            walsender,
            holder,
        )
        for pid in (walsender, holder):
            if pid is not None:  # waits (up to 5 s) until the process has exited and its lock is released
                conn.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
        if self._settings.fence_s > 0:
            self._fence_until = time.monotonic() + self._settings.fence_s
            log.warning(
                "waiting %.0f s before streaming the slot %s: the frozen relay's Kafka producer sends what it still "
                "holds if it thaws, until its message.timeout.ms has passed (this relay's, plus %.0f s: every relay of "
                "an outbox must use the same KAFKA_MESSAGE_TIMEOUT_MS)",
                self._settings.fence_s,
                self._slot,
                FENCE_MARGIN_S,
            )
        return 0.0
