"""Engine room (relay, wal): one streamer per slot, and a waiting relay that takes over within seconds.

PostgreSQL lets one walsender stream a slot at a time, and a second START_REPLICATION fails at once; relays must not
take turns by failing. The streamer holds a session advisory lock on an ordinary connection; the others wait for it.

- A relay that dies (kill -9, a crashed pod) closes its sockets: its lock goes with its session at once, and its
  walsender ends when it reads the closed socket. The next relay takes the lock, and terminates that walsender
  if it is still there (it holds the lock, so the walsender's relay is gone).
- A relay that is frozen (SIGSTOP, a paused VM) keeps its sessions open and stops answering. The streamer says it
  is alive every few seconds, Kafka down or not (wal/relay.py): a status update to its walsender and a statement on
  its ordinary session (``heartbeat``). The waiting relay sees the later of the two (``pg_stat_replication.reply_time``,
  ``pg_stat_activity.state_change`` of the lock's holder) grow older than ``takeover_after_s`` and terminates both of
  the frozen relay's sessions. Both signals: PostgreSQL shows a walsender's reply time only to superusers and
  ``pg_read_all_stats``, a session's activity to its own role too; a relay that can see neither (another role,
  without either right) never takes over a frozen streamer, and says so once.

Terminating another session needs the same role or ``pg_signal_backend`` (docs/operations.md, Your PostgreSQL).
"""

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


@dataclass(frozen=True)
class LeaderSettings:
    poll_s: float = 1.0  # how often a waiting relay tries the lock
    takeover_after_s: float = 30.0  # a streamer whose walsender heard nothing from it this long is frozen
    slot_free_timeout_s: float = 10.0  # how long to wait for a gone streamer's walsender to end


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
                return True
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
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
            if waited >= deadline or self._stop.wait(0.1):
                return  # START_REPLICATION will say the slot is active, and the relay tries again
            waited += 0.1

    def _end_frozen_leader(self, conn: psycopg.Connection) -> float:
        """End the streamer's sessions if it has been silent for the takeover time (0.0: ended, the lock is free);
        else the seconds until it would be (the next look then, not a poll later: each poll added to the takeover is
        a second more that nothing is published)."""
        row = conn.execute(
            """
            SELECT s.active_pid, l.pid, extract(epoch FROM now() - greatest(r.reply_time, a.state_change))
            FROM pg_replication_slots s
            LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
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
        if walsender is not None and holder is not None and silent_s is None and not self._blind_logged:
            self._blind_logged = True
            log.warning(
                "cannot tell whether the relay streaming the slot %s is alive: its session belongs to another role "
                "and this one has neither that role nor pg_read_all_stats; a frozen streamer is not taken over",
                self._slot,
            )
        if walsender is None or silent_s is None:
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
        return 0.0
