"""The relay a latency bench measures, started as deployed in processes of its own, logged in as its own role so its
statements can be counted. See docs/performance.md#how-the-latency-bench-measures."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psycopg

from ... import settings
from ...config import OutboxTable
from ...localstack.ports import free_port
from ...model import WAL
from ...observe.liveness import live_workers
from ..procstat import tree_cpu_s
from ..runner import Servers
from ..wal_outbox import wait_streaming


@dataclass(frozen=True)
class RelayCounters:
    """The relay's own totals so far (its /metrics): records Kafka confirmed, batches published."""

    published: float
    batches: float


class RelayUnderTest(Protocol):
    """What publishes the benchmark's rows: started before the traffic, stopped after it."""

    name: str

    def start(self, servers: Servers, table: OutboxTable) -> None:
        """Returns once the relay is registered (its start-up is not measured)."""

    def stop(self) -> None: ...

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds so far of this relay's processes, per group (cumulative, for deltas)."""

    def counters(self) -> RelayCounters | None:
        """Published records and batches so far; None when the relay serves no metrics here."""

    def runs(self) -> tuple[int, int] | None:
        """(runs launched, runs queued now) for an orchestrated relay; None otherwise."""


class CliRelay:
    """`outbox relay --strategy S --workers W --metrics-port P`, in its own process group; ``checkout``: that of
    another checkout of the project (an A/B of two versions of the relay, named ``cli@<directory>``)."""

    def __init__(
        self, strategy: str, workers: int, max_seconds: float, log: Path | None = None, checkout: Path | None = None
    ) -> None:
        self.strategy, self.workers, self.max_seconds, self.log = strategy, workers, max_seconds, log
        self.checkout = checkout
        self.name = "cli" if checkout is None else f"cli@{checkout.resolve().name}"
        self.port = None if strategy == WAL else free_port()
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, servers: Servers, table: OutboxTable) -> None:
        env = {**os.environ, settings.PG_DSN.name: servers.dsn, "KAFKA_BOOTSTRAP_SERVERS": servers.bootstrap}
        if self.checkout is not None:  # `python -m` imports the package from there (it comes first on the path)
            env["PYTHONPATH"] = str(self.checkout.resolve())
        command = [sys.executable, "-m", "outbox_pipeline.cli", "relay", "--schema", table.schema]
        command += ["--strategy", self.strategy, "--workers", str(self.workers)]
        command += ["--max-seconds", f"{self.max_seconds:.0f}"]
        command += ["--metrics-port", str(self.port)] if self.port is not None else []
        # Its log goes to a file: its periodic summaries would interleave with the bench's lines.
        with open(self.log or os.devnull, "ab") as log:
            self._process = subprocess.Popen(
                command, env=env, cwd=self.checkout, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            if self.strategy == WAL:
                wait_streaming(servers.dsn, table, 60.0, self._process.poll)
            else:
                wait_until_registered(servers.dsn, table, 60.0, self._process)
        except RuntimeError as exc:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log else ""
            raise RuntimeError(f"{exc}; its log ends:\n{tail}") from None

    def stop(self) -> None:
        """SIGTERM to the supervisor, which forwards it: each worker finishes its batch and deregisters."""
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()

    def cpu_s(self) -> dict[str, float]:
        return {"relay": tree_cpu_s(self._process.pid) if self._process else 0.0}

    def counters(self) -> RelayCounters | None:
        if self.port is None:
            return None
        published = batches = 0.0
        for n in range(self.workers):
            text = scrape(self.port + n)
            published += _sample(text, "outbox_relay_published_total")
            batches += _sample(text, "outbox_relay_publish_seconds_count")
        return RelayCounters(published, batches)

    def runs(self) -> tuple[int, int] | None:
        return None


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def _sample(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def wait_until_registered(dsn: str, table: OutboxTable, timeout_s: float, alive: subprocess.Popen[bytes]) -> None:
    """Until a relay worker of ``table`` is registered and alive (polling PostgreSQL: another process's
    state, no event to wait on)."""
    deadline = time.monotonic() + timeout_s
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not live_workers(conn, table, lease_s=60):
            if alive.poll() is not None:
                raise RuntimeError(f"the relay exited with {alive.returncode} before registering")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no relay worker registered within {timeout_s:.0f} s")
            time.sleep(0.5)
