"""Test kit: relay worker processes (``tests/kit/worker.py``) that tests start, kill, freeze and restart,
and the ``workers`` fixture that kills whatever is still running after a test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from outbox_pipeline import OutboxTable

from .probes import wait_until

ROOT = Path(__file__).resolve().parents[2]
WORKER_SCRIPT = Path(__file__).with_name("worker.py")


@dataclass(frozen=True)
class Event:
    t: float
    step: str
    numbers: tuple[int, ...]


@dataclass
class WorkerProcess:
    """One ``tests/kit/worker.py`` process; ``spec`` is its JSON configuration."""

    spec: dict[str, Any]
    directory: Path
    name: str
    proc: subprocess.Popen[bytes] | None = None
    runs: int = 0

    def start(self) -> WorkerProcess:
        """(Re)start the process with the same spec (same worker id), appending to the same event log."""
        assert self.proc is None or self.proc.poll() is not None, "still running"
        self.runs += 1
        self.spec = {
            **self.spec,
            "events": str(self.directory / f"{self.name}.events"),
            "stats": str(self.directory / f"{self.name}.{self.runs}.stats.json"),
        }
        log = open(self.directory / f"{self.name}.log", "ab")  # the child inherits it; ours is closed below
        try:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER_SCRIPT), json.dumps(self.spec)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                # the engine this test run imports, whichever checkout that is
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                },
            )
        finally:
            log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def events(self) -> list[Event]:
        path = self.directory / f"{self.name}.events"
        if not path.exists():
            return []
        events = []
        for line in path.read_text().splitlines():
            parts = line.split()
            try:
                events.append(Event(float(parts[0]), parts[1], tuple(int(p) for p in parts[2:])))
            except (IndexError, ValueError):
                continue  # a line cut short by SIGKILL
        return events

    def wait_for(self, what: str, condition: Callable[[list[Event]], bool], deadline_s: float = 30.0) -> float:
        def check() -> bool:
            if condition(self.events()):
                return True
            if not self.alive():
                raise AssertionError(f"worker {self.name} exited ({self.returncode}) before {what}\n{self.log()}")
            return False

        return wait_until(f"{self.name}: {what}", check, deadline_s, interval_s=0.02)

    def kill(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.wait(10)

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM: the relay finishes its batch and the worker writes its stats (once its handler is in place,
        which is before it logs `start`)."""
        self.request_stop()
        return self.wait(timeout_s)

    def request_stop(self) -> None:
        """SIGTERM without waiting for the exit, so that many workers stop at once (then ``wait``)."""
        if self.alive():
            self.wait_for("its start", lambda ev: sum(1 for e in ev if e.step == "start") >= self.runs)
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, signal.SIGTERM)

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker {self.name} did not exit within {timeout_s:.0f}s\n{self.log()}") from None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stats(self) -> dict[str, Any]:
        """The last run's RelayStats (written when it ended normally)."""
        stats: dict[str, Any] = json.loads(Path(self.spec["stats"]).read_text())
        return stats

    def total_stats(self) -> Counter[str]:
        """The counters summed over every run that ended normally."""
        total: Counter[str] = Counter()
        for run in range(1, self.runs + 1):
            path = self.directory / f"{self.name}.{run}.stats.json"
            if path.exists():
                total.update({k: v for k, v in json.loads(path.read_text()).items() if isinstance(v, int)})
        return total

    def log(self, chars: int = 3000) -> str:
        path = self.directory / f"{self.name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def steps_between(events: Sequence[Event], start: float, end: float) -> Counter[str]:
    """How many times each step happened in [start, end]; `batch` counts claims that returned records."""
    counts: Counter[str] = Counter()
    for e in events:
        if start <= e.t <= end:
            counts[e.step] += 1
            if e.step == "claim" and e.numbers and e.numbers[0] > 0:
                counts["batch"] += 1
    return counts


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """``spawn(name, dsn=..., table=..., bootstrap=..., strategy=..., ...)``: a relay worker process (not yet
    started). Whatever is still running at the end is killed, by pid."""
    spawned: list[WorkerProcess] = []

    def spawn(
        name: str,
        *,
        dsn: str,
        table: OutboxTable,
        bootstrap: str,
        strategy: str,
        worker_id: str | None = None,
        batch_size: int = 50,
        config: dict[str, object] | None = None,
        producer: dict[str, object] | None = None,
        settings: dict[str, object] | None = None,
        stop_after_publish: int | None = None,
        fail_after_publish: int | None = None,
        kill_in_transaction: int | None = None,
        pause_in_transaction: int | None = None,
        pause_before_transaction: int | None = None,
    ) -> WorkerProcess:
        spec = {
            "dsn": dsn,
            "schema": table.schema,
            "bootstrap": bootstrap,
            "strategy": strategy,
            "worker_id": worker_id or name,
            "batch_size": batch_size,
            "config": config or {},
            "producer": producer or {},
            "settings": settings or {},
            "stop_after_publish": stop_after_publish,
            "fail_after_publish": fail_after_publish,
            "kill_in_transaction": kill_in_transaction,
            "pause_in_transaction": pause_in_transaction,
            "pause_before_transaction": pause_before_transaction,
        }
        worker = WorkerProcess(spec, tmp_path, name)
        spawned.append(worker)
        return worker

    yield spawn
    for worker in spawned:
        if worker.alive():
            worker.thaw()
            worker.kill()
