"""Engine room: a relay worker's PostgreSQL sessions (relay/loop.py runs the loop over them).

The control session holds the worker's liveness lock and registration and LISTENs for commits; each strategy instance
has a session of its own (two when a strategy pipelines with one open transaction per batch in flight). All are opened
on first use and dropped together when the database fails, so a reconnect starts from what PostgreSQL holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg

from .. import server
from ..store.relayable import require_relayable
from ..store.schema import require_current
from ..strategies.base import Strategy, StrategyConfig
from ..strategies.sharing import UNSCOPED_KIND
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
        wake_ups: WakeUps,
        stop: threading.Event,
        registered: threading.Event,
    ) -> None:
        self.dsn = dsn
        self.strategy_factory = strategy_factory
        self.strategy_config = strategy_config
        self.settings = settings
        self.wake_ups = wake_ups
        self.stop = stop
        self.registered = registered  # set once the worker is in the registry
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
                strategy = self.strategy_factory(conn, self.strategy_config)
                if not self._strategies:
                    require_relayable(conn, self.strategy_config.table, strategy.name)
                self._strategies.append(strategy)
        return self._strategies

    def connect_control(self) -> WorkerPresence:
        """The control connection: this worker's liveness lock and registration, and its LISTEN."""
        if self._presence is None:
            conn = server.connect(self.dsn, autocommit=True, application_name=self._application_name)
            self.control = conn
            require_current(conn, self.strategy_config.table)
            scoped = self.strategy_config.partitions is not None
            presence = WorkerPresence(
                conn,
                self.strategy_config.table,
                self.strategy_config.worker_id,
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
        return f"outbox {self.strategy_config.worker_id}"[:63]

    def upkeep(self) -> bool | None:
        """Heartbeat and reap at most every upkeep_interval_s: None when not due, else whether dead workers' work
        was freed."""
        if time.monotonic() - self._upkeep_at < self.settings.upkeep_interval_s:
            return None
        self._upkeep_at = time.monotonic()
        reaped = self.connect_control().upkeep()
        return bool(reaped.partitions or reaped.rows)

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
