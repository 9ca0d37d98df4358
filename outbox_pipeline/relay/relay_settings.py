"""How a relay worker is set up (RelaySettings, one for the CLI, Dagster runs and the bench), how it backs off after a
failure (Backoff) and how often it claims under steady traffic (Pacer). See docs/operations.md#command-line."""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import settings
from ..observe.liveness import LivenessMode, liveness_from_env

# A claim of this many rows or more is followed by the whole linger, a smaller one by its share (Pacer).
LINGER_FULL_ROWS = 20


@dataclass(frozen=True)
class RelaySettings:
    batch_size: int = 1000
    poll_interval_s: float = 0.2
    max_poll_interval_s: float = 5.0
    error_backoff_base_s: float = 0.5
    error_backoff_max_s: float = 30.0
    listen: bool = True
    # Stop once nothing is pending: waits (bounded by max_seconds) for rows leased by others or backing off,
    # and fills RelayStats.remaining when it stops with rows still pending.
    until_empty: bool = False
    # Stop at the first claim that finds nothing (a Dagster partition run's "caught up").
    until_idle: bool = False
    max_seconds: float | None = None
    # Read the next batch while Kafka confirms the previous one (see Relay.run).
    pipeline: bool = True
    # Heartbeat and reap of dead workers (liveness.py) at most this often; also the longest idle wait.
    upkeep_interval_s: float = 1.0
    # "session": this worker's leases end when its session does; "expiry": only when they expire; "auto": session
    # on a connection verified to be direct (presence.py).
    liveness: LivenessMode = "auto"
    # At start, how long to wait for another live session holding this worker's id before refusing to start.
    worker_id_wait_s: float = 60.0
    # After a claim that took everything there was, the next one no sooner than this (Pacer).
    min_cycle_s: float = settings.RELAY_LINGER_MS.default / 1000
    # wal: a waiting relay takes over from a streaming one silent this long (relay/wal/leader.py).
    wal_takeover_s: float = settings.WAL_TAKEOVER_S.default
    # wal: min_cycle_s of the wal relay's Pacer.
    wal_linger_s: float = settings.WAL_LINGER_MS.default / 1000
    # wal: messages handed to Kafka at once (a backlog's batch; steady traffic sends what came), whatever batch_size.
    wal_batch_max: int = 20_000
    # wal: how often a waiting relay tries the slot's lock (relay/wal/leader.py).
    wal_leader_poll_s: float = 1.0

    def error_backoff_s(self, failures: int) -> float:
        """The wait after the ``failures``-th failure in a row: doubling up to the maximum, jittered by half."""
        ceiling = min(self.error_backoff_max_s, self.error_backoff_base_s * 2 ** (failures - 1))
        return random.uniform(ceiling / 2, ceiling)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **fields: Any) -> RelaySettings:
        """The settings the environment sets (liveness, worker id wait, lingers, wal takeover), and ``fields``: what
        the CLI, the Dagster runs and the bench all build a relay with."""
        return cls(
            **{
                "liveness": liveness_from_env(env),
                "worker_id_wait_s": settings.WORKER_ID_WAIT_S.read(env),
                "min_cycle_s": settings.RELAY_LINGER_MS.read(env) / 1000,
                "wal_takeover_s": settings.WAL_TAKEOVER_S.read(env),
                "wal_linger_s": settings.WAL_LINGER_MS.read(env) / 1000,
                **fields,
            }
        )


@dataclass
class Backoff:
    """The failures in a row (a database or a broker that is down) and the wait after each, for both relays."""

    settings: RelaySettings
    failures: int = 0

    def next_s(self) -> float:
        """One more failure: how long to wait before trying again (RelaySettings.error_backoff_s)."""
        self.failures += 1
        return self.settings.error_backoff_s(self.failures)

    def reset(self) -> None:
        self.failures = 0


@dataclass
class Pacer:
    """How long to let commits gather before the next claim. A claim that took everything there was (a partial
    batch) is followed by the next one no sooner than ``min_cycle_s`` after it, scaled by its rows up to
    LINGER_FULL_ROWS: under steady traffic each claim, ack, flush and produce request then carries dozens of commits
    (their fixed cost per cycle is what the relay's CPU was), while a trickle of commits pauses next to nothing (one
    row: a twentieth of the linger) and a backlog is never paced."""

    min_cycle_s: float
    # The rows from which a claim is followed by the whole linger (the wal relay's is 1: its linger is short already).
    full_rows: int = LINGER_FULL_ROWS
    _at: float = float("-inf")  # the last claim: when it began,
    _rows: int = 0  # how many rows it took,
    _took_all: bool = False  # and whether that was everything there was

    def claimed(self, started: float, rows: int, *, took_all: bool) -> None:
        self._at, self._rows, self._took_all = started, rows, took_all

    def pause_s(self) -> float:
        if not self._took_all:
            return 0.0
        share = min(1.0, self._rows / self.full_rows)
        return self._at + self.min_cycle_s * share - time.monotonic()
