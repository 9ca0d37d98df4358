"""What the nemesis and the operator share during a run: the timeline of what was done when, the operator's
``outbox`` command line (the application's DSN in its environment, as an operator sets it), and the Context that
holds the run's servers, outbox and worker slots."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from tests.kit.workers import ROOT

from .cluster import Outbox, Servers, admin
from .relays import PRODUCER, WorkerPool
from .schedule import WAL, Relaying, Setup
from .writers import Written


@dataclass(frozen=True)
class Span:
    """One thing the nemesis or an operator did: when (wall clock), to which slot, and what came of it."""

    action: str
    slot: int | None
    start: float
    end: float
    note: str = ""

    def __str__(self) -> str:
        slot = "" if self.slot is None else f" slot={self.slot}"
        return f"{self.action}{slot} {self.end - self.start:.2f}s {self.note}".rstrip()


@dataclass
class Timeline:
    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, span: Span) -> None:
        with self.lock:
            self.spans.append(span)

    def of(self, *actions: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.action in actions]


@dataclass(frozen=True)
class Switch:
    """A switch of strategy that was done (switching.py), for the checker: copies stamped before ``at`` are the old
    strategy's, after it the new one's; ``republished``: rows relayed past the new positions, which the new
    strategy publishes again (docs/operations.md); ``killed``: workers SIGKILLed instead of stopping."""

    at: float  # wall clock, just after `outbox switch-strategy` succeeded (every relay stopped)
    old: Relaying
    new: Relaying
    republished: int
    killed: int
    refused: tuple[str, ...] = ()  # what the switch refused first, and why (one line each)
    exits: tuple[tuple[str, int], ...] = ()  # (worker, exit code) of the workers stopped for it

    def __str__(self) -> str:
        return f"{self.old}>{self.new}:{self.republished}"


@dataclass(frozen=True)
class CliResult:
    argv: tuple[str, ...]
    code: int | None  # None: it did not end within its timeout
    output: str

    def __str__(self) -> str:
        return f"outbox {' '.join(self.argv)} -> exit {self.code}"


def cli_env(outbox: Outbox) -> dict[str, str]:
    """The operator's environment: the application's DSN (password and all) and the workers' producer limits."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "KAFKA_", "PG"))}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        OUTBOX_PG_DSN=outbox.app_dsn,
        OUTBOX_SCHEMA=outbox.table.schema,
        KAFKA_BOOTSTRAP_SERVERS=outbox.bootstrap,
        **{f"KAFKA_{k.upper().replace('.', '_')}": str(v).lower() for k, v in PRODUCER.items()},
    )
    return env


def outbox_cli(outbox: Outbox, argv: Sequence[str], timeout_s: float = 60.0) -> CliResult:
    """Run ``outbox ARGV`` as an operator would, output (stdout and stderr) kept."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "outbox_pipeline.cli", *argv],
            env=cli_env(outbox),
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as exc:
        output = b"".join(part for part in (exc.stdout, exc.stderr) if isinstance(part, bytes))
        return CliResult(tuple(argv), None, output.decode(errors="replace"))
    return CliResult(tuple(argv), done.returncode, (done.stdout + done.stderr).decode(errors="replace"))


@dataclass
class Context:
    """What the nemesis and the operator act on, and what they leave for the checker."""

    servers: Servers
    outbox: Outbox
    setup: Setup
    pool: WorkerPool
    stop: threading.Event  # set when the nemesis ends: an action that lasts ends at once
    timeline: Timeline = field(default_factory=Timeline)
    commands: list[CliResult] = field(default_factory=list)
    # Rows an operator's replay or rewind publishes again on purpose: (what, rows), counted apart from duplicates.
    replayed: list[tuple[str, int]] = field(default_factory=list)
    switches: list[Switch] = field(default_factory=list)
    # wal: the messages held behind each dead letter the operator retried or discarded (counted just before).
    released: list[int] = field(default_factory=list)
    # Each row's place in the orders (transaction id, id), read before a switch deletes rows an ordered strategy
    # relayed (to a row strategy in delete mode): the checker still checks their order.
    order: dict[str, tuple[int, int]] = field(default_factory=dict)
    # What the nemesis itself wrote (a long transaction's messages), for the ledger beside the writers'.
    written: list[Written] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def relaying(self) -> Relaying:
        """What relays the outbox now (a switch changes it): every action, worker and drain uses it."""
        return self.pool.relaying

    def cli(self, *argv: str, timeout_s: float = 60.0) -> CliResult:
        behind = self._held_behind(argv) if self.relaying.strategy == WAL else 0
        result = outbox_cli(self.outbox, argv, timeout_s)
        with self.lock:
            self.commands.append(result)
            if behind and result.code == 0:
                self.released.append(behind)
        return result

    def _held_behind(self, argv: Sequence[str]) -> int:
        """wal: the messages held behind the dead letters a retry or discard names, counted before it runs (the
        streamer publishes them at the release: the checker's allowance if a fault comes before their hold ends)."""
        if tuple(argv[:2]) not in (("dead-letters", "retry"), ("dead-letters", "discard")):
            return 0
        ids = [int(a.removeprefix("--id=")) for a in argv if a.startswith("--id=")]
        ids += [int(argv[i + 1]) for i, a in enumerate(argv[:-1]) if a == "--id"]
        t = self.outbox.table
        query = sql.SQL(
            "SELECT count(*) FROM {held} x JOIN {holds} h ON h.topic = x.topic AND h.key = x.key "
            "WHERE h.dead_letter_id = ANY(%s)"
        ).format(held=t.held, holds=t.holds)
        try:
            with admin(self.outbox) as conn:
                row = conn.execute(query, (ids,)).fetchone()
        except psycopg.OperationalError:  # the server restarting: the command will say so too
            return 0
        return int(row[0]) if row else 0

    def replay(self, what: str, rows: int) -> None:
        with self.lock:
            self.replayed.append((what, rows))

    def record(self, written: list[Written]) -> None:
        """Rows the nemesis writes: the ledger reads them once the run is over (their outcomes filled by then)."""
        with self.lock:
            self.written.extend(written)
