"""How an idle relay learns that there is work: LISTEN for the insert trigger's NOTIFY on its control connection, with
the poll interval as the bound. See docs/strategies.md#wake-ups."""

from __future__ import annotations

import select
import threading
import time

import psycopg
from psycopg import sql

from ..config import OutboxTable
from ..store.migrations import notify_channel


class WakeUps:
    """The LISTEN state of one relay's control connection (not thread-safe: the relay loop's own).

    Notifications are counted, never kept: a handler counts those psycopg reads while the connection runs a statement
    (the relay's upkeep), and a look reads the socket through libpq and counts the rest. ``conn.notifies()`` made a
    generator, a poller and a timeout exception for every look, and an object for every NOTIFY: at 2,000 msg/s in
    10-row transactions, twice a cycle, a tenth of the relay's CPU.
    """

    def __init__(self, table: OutboxTable, stop: threading.Event) -> None:
        self._channel = sql.Identifier(notify_channel(table))
        self._stop = stop
        self.listening = False
        self._heard = 0  # counted by the handler since the last look
        self._handled: psycopg.Connection | None = None

    def listen(self, conn: psycopg.Connection, on: bool = True) -> None:
        if on and self._handled is not conn:
            conn.add_notify_handler(self._count)
            self._handled = conn
        conn.execute(sql.SQL("LISTEN {}" if on else "UNLISTEN {}").format(self._channel))
        self.listening = on

    def forget(self) -> None:
        """The connection is gone, and its LISTEN with it."""
        self.listening, self._handled, self._heard = False, None, 0

    def _count(self, _: psycopg.Notify) -> None:
        self._heard += 1

    def coalesce(self, conn: psycopg.Connection | None) -> int:
        """Drop the NOTIFYs already received (the claim that follows sees what they announce); how many."""
        if not self.listening or conn is None:
            return 0
        pgconn = conn.pgconn
        with conn.lock:
            pgconn.consume_input()  # what the socket has, without waiting; raises if the connection is gone
            heard = self._heard
            while pgconn.notifies() is not None:
                heard += 1
        self._heard = 0
        return heard

    def wait(self, conn: psycopg.Connection, timeout_s: float) -> bool:
        """Until the first NOTIFY (True), ``timeout_s`` or a stop request. A connection that was not listening starts
        to and returns at once: rows committed before LISTEN announced nothing to it, so the caller looks once more."""
        if not self.listening:
            self.listen(conn)
            return False
        deadline = time.monotonic() + timeout_s
        readable = select.poll()  # not select(): a descriptor past 1,024 is fine
        readable.register(conn.fileno(), select.POLLIN)
        while not self._stop.is_set() and (remaining := deadline - time.monotonic()) > 0:
            if self.coalesce(conn):
                return True
            readable.poll(min(remaining, 0.5) * 1000)  # short slices, so a stop request is seen promptly
        return False

    def stand_by(self, conn: psycopg.Connection | None, timeout_s: float) -> None:
        """Wait without listening (a standby asks for the active role again at its poll interval)."""
        if self.listening and conn is not None:
            self.listen(conn, False)
        self._stop.wait(timeout_s)
