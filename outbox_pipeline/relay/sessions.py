"""A table relay's PostgreSQL sessions (control, and one or two per strategy), opened on first use and dropped together
on a database failure, so a reconnect starts from what PostgreSQL holds. See docs/operations.md#crashed-workers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg

from .. import server
from ..config import OutboxTable
from ..observe.lag import explain_pending, pending_in_scope
from ..store.relayable import require_relayable
from ..store.schema import require_current
from ..strategies.base import Strategy, StrategyConfig
from ..strategies.positions import UNSCOPED_KIND
from .presence import WorkerPresence
from .relay_settings import RelaySettings
from .wakeups import WakeUps

StrategyFactory = Callable[[psycopg.Connection, StrategyConfig], Strategy]


class WorkerSessions:
    """The control session and the strategy instances of one relay worker."""

    def __init__(
        self,
        dsn: str,
        strategy_factory: StrategyFactory,
        strategy_config: StrategyConfig,
        settings: RelaySettings,
        stop: threading.Event,
    ) -> None:
        self.dsn = dsn
        self.strategy_factory = strategy_factory
        self.config = strategy_config
        self.settings = settings
        self.wake_ups = WakeUps(strategy_config.table, stop)
        self.stop = stop
        self.registered = threading.Event()  # set once the worker is in the registry
        self.control: psycopg.Connection | None = None
        self._connections: list[psycopg.Connection] = []
        self._strategies: list[Strategy] = []
        self._presence: WorkerPresence | None = None
        self._upkeep_at = float("-inf")

    def strategies(self) -> list[Strategy]:
        """The strategy instances, connected on first use."""
        if not self._strategies:
            wanted = 1
            if self.settings.pipeline and getattr(self.strategy_factory, "pipelining", "shared") == "own-connection":
                wanted = 2  # one open transaction per batch in flight
            self.connect_control()
            for _ in range(wanted):
                conn = server.connect(self.dsn, autocommit=True, application_name=self._application_name)
                self._connections.append(conn)
                strategy = self.strategy_factory(conn, self.config)
                if not self._strategies:
                    require_relayable(conn, self.config.table, strategy.name)
                self._strategies.append(strategy)
        return self._strategies

    def connect_control(self) -> WorkerPresence:
        """The control connection: this worker's liveness lock and registration, and its LISTEN."""
        if self._presence is None:
            conn = server.connect(self.dsn, autocommit=True, application_name=self._application_name)
            self.control = conn
            require_current(conn, self.config.table)
            scoped = self.config.partitions is not None
            presence = WorkerPresence(
                conn,
                self.config.table,
                self.config.worker_id,
                self.settings.liveness,
                kind="relay-scoped" if scoped else UNSCOPED_KIND,
                heartbeat_s=self.settings.upkeep_interval_s,
            )
            presence.register(wait_s=self.settings.worker_id_wait_s, stop=self.stop)
            self.registered.set()
            if self.settings.listen:
                self.wake_ups.listen(conn)
            self._presence = presence
        return self._presence

    @property
    def _application_name(self) -> str:
        return f"outbox {self.config.worker_id}"[:63]

    def upkeep(self) -> bool | None:
        """Heartbeat and reap at most every upkeep_interval_s: None when not due, else whether dead workers' work
        was freed."""
        if time.monotonic() - self._upkeep_at < self.settings.upkeep_interval_s:
            return None
        self._upkeep_at = time.monotonic()
        reaped = self.connect_control().upkeep()
        return bool(reaped.partitions or reaped.rows)

    @property
    def listening(self) -> bool:
        """Whether commits are announced to this worker (else only its poll finds them)."""
        return self.wake_ups.listening

    def announced(self) -> bool:
        """Whether commits were announced since the last look (the NOTIFYs are dropped: the next claim sees them)."""
        return self.wake_ups.coalesce(self.control) > 0

    def wait_for_work(self, timeout_s: float) -> bool:
        """Wake at the first NOTIFY (a commit that inserted rows) or after the timeout (wakeups.py); True: a NOTIFY."""
        if not self.settings.listen:
            self.stop.wait(timeout_s)
            return False
        try:
            if self.control is None:
                self.connect_control()
                return False  # rows committed before LISTEN sent no wake-up: look once more before waiting
            return self.wake_ups.wait(self.control, timeout_s)
        except psycopg.OperationalError:
            self.disconnect()
            self.stop.wait(timeout_s)
            return False

    def stand_by(self, timeout_s: float) -> None:
        """Wait to ask for the active worker's role again (Strategy.standing_by), not listening meanwhile."""
        try:
            self.wake_ups.stand_by(self.control, timeout_s)
        except psycopg.OperationalError:
            self.disconnect()
            self.stop.wait(timeout_s)

    def pending(self) -> bool:
        """Whether rows in this worker's scope are still to publish (``until_empty``)."""
        return pending_in_scope(*self._scope())

    def explain_pending(self) -> list[str]:
        """Why rows are still pending when ``max_seconds`` ended an ``until_empty`` run: asked of the database, which
        may be the reason it could not finish."""
        try:
            return explain_pending(*self._scope())
        except psycopg.OperationalError as exc:
            return [f"unknown: the database did not answer ({str(exc).strip().splitlines()[0]})"]

    def _scope(self) -> tuple[psycopg.Connection, OutboxTable, str, frozenset[tuple[str, int]] | None]:
        strategy = self.strategies()[0]
        return strategy.conn, self.config.table, strategy.name, self.config.partitions

    def disconnect(self, *, deregister: bool = False) -> None:
        if deregister and self._presence is not None:
            self._presence.deregister()
        for held in (*self._strategies, *self._connections, self.control):
            try:
                if held is not None:
                    held.close()
            except Exception:  # the connection is already broken; closing is best effort
                pass
        self._strategies, self._connections, self.control, self._presence = [], [], None, None
        self.wake_ups.forget()
