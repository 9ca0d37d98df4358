"""Relay worker processes in slots: tests/kit/worker.py processes (the real Relay, strategy and producer,
instrumented), started through worker_main.py so their INFO log is kept; a slot's process is replaced under a new
worker id, as a Deployment replaces a pod. Their producer and relay settings fail fast enough for a short run.

For ``wal`` the slots are wal relays: the first to take the slot's lock streams, the others wait to take over (a
killed streamer's at once, a frozen one's once it has not answered its walsender for ``lease_s``).

The pool knows what relays the outbox now (``relaying``): a switch of strategy stops every slot and starts them
again with the new one (``stop`` then ``start``), holding ``lock`` so that no kill replaces a slot meanwhile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from tests.kit.probes import wait_until
from tests.kit.workers import ROOT, WorkerProcess

from .cluster import MAX_MESSAGE_BYTES, Outbox, streamed
from .schedule import WAL, Relaying, Setup

MAX_ATTEMPTS = 3
MESSAGE_TIMEOUT_MS = 2000  # under lease_s: a healthy worker's publish ends before its lease does
PRODUCER: dict[str, object] = {
    "message.max.bytes": MAX_MESSAGE_BYTES,
    "allow.auto.create.topics": False,  # the missing topic stays missing
    "message.timeout.ms": MESSAGE_TIMEOUT_MS,
    "request.timeout.ms": 1000,
    "retry.backoff.ms": 100,
    "reconnect.backoff.max.ms": 500,
}
RELAY_SETTINGS: dict[str, object] = {
    "error_backoff_base_s": 0.2,
    "error_backoff_max_s": 1.0,
    "max_poll_interval_s": 1.0,
}


class HarnessWorker(WorkerProcess):
    """A tests/kit/worker.py process started through worker_main.py (its log at INFO)."""

    def start(self) -> WorkerProcess:
        assert self.proc is None or self.proc.poll() is not None, "still running"
        self.runs += 1
        self.spec = {
            **self.spec,
            "events": str(self.directory / f"{self.name}.events"),
            "stats": str(self.directory / f"{self.name}.{self.runs}.stats.json"),
        }
        with open(self.directory / f"{self.name}.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.harness.worker_main", json.dumps(self.spec)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                },
            )
        return self

    def freeze(self) -> None:
        if self.alive():  # stopped meanwhile (a switch of strategy): nothing to freeze
            super().freeze()

    def thaw(self) -> None:
        if self.alive():
            super().thaw()


class WorkerPool:
    """One relay worker process per slot; ``replace`` starts a slot's next process under a new worker id."""

    def __init__(self, outbox: Outbox, setup: Setup, directory: Path) -> None:
        self.outbox, self.setup, self.directory = outbox, setup, directory
        self.relaying = Relaying(setup.strategy, setup.mode)
        self.lock = threading.RLock()
        self.slots: list[WorkerProcess] = []
        self.retired: list[WorkerProcess] = []  # killed by the nemesis (their exit is no finding)
        self._generation = 0

    def _spawn(self, slot: int) -> WorkerProcess:
        self._generation += 1
        name = f"{self.relaying.strategy[:4]}-s{slot}-g{self._generation}"
        spec: dict[str, Any] = {
            "dsn": self.outbox.app_dsn,
            "schema": self.outbox.table.schema,
            "bootstrap": self.outbox.bootstrap,
            "strategy": self.relaying.strategy,
            "worker_id": name,
            "batch_size": self.setup.batch_size,
            "config": {
                "lease_s": self.setup.lease_s,
                "max_attempts": MAX_ATTEMPTS,
                "backoff_base_s": 0.2,
                "backoff_max_s": 1.0,
                "mode": self.relaying.mode,
            },
            "producer": PRODUCER if self.setup.message_timeout_ms is None else self._long_timeout_producer(),
            "settings": RELAY_SETTINGS,
        }
        if self.relaying.strategy == WAL:
            # A streamer silent for lease_s is taken over: the harness's lease_s is what wal calls its takeover time.
            # Its batch is the run's, so that what a fault leaves in flight is a batch of the run's, as for the table
            # strategies.
            spec["settings"] = {
                **RELAY_SETTINGS,
                "wal_takeover_s": self.setup.lease_s,
                "wal_batch_max": self.setup.batch_size,
            }
        return HarnessWorker(spec, self.directory, name).start()

    def _long_timeout_producer(self) -> dict[str, object]:
        """The producers of a seed with a long message.timeout.ms (wal: edges.py's stale-thaw). A record for a topic
        that does not exist still fails within MESSAGE_TIMEOUT_MS (librdkafka waits for it up to
        topic.metadata.propagation.max.ms, 30 s, when the message timeout is longer): the long timeout is for a
        thawed producer's batch, not a missing topic's 30 s per attempt."""
        return {
            **PRODUCER,
            "message.timeout.ms": self.setup.message_timeout_ms,
            "topic.metadata.propagation.max.ms": MESSAGE_TIMEOUT_MS,
        }

    def start(self, relaying: Relaying | None = None) -> None:
        """Start every slot (under new worker ids), with ``relaying`` from now on if given; those it replaces must
        have stopped. wal: slot 0 first, the others once it streams, so that a schedule knows which one streams
        (ci.py: its faults are aimed at the streamer)."""
        with self.lock:
            self.relaying = relaying or self.relaying
            self.retired += [w for w in self.slots if not w.alive()]
            self.slots = []
            for slot in range(self.setup.workers):
                self.slots.append(self._spawn(slot))
                if slot == 0 and self.relaying.strategy == WAL:
                    wait_until("slot 0 to stream the slot", lambda: streamed(self.outbox), 60, 0.1)
            started = list(self.slots)
        for worker in started:
            worker.wait_for("its start", lambda ev: any(e.step == "start" for e in ev), 60)

    def replace(self, slot: int) -> WorkerProcess:
        """SIGKILL the slot's process and start a new one under a new id; returns it once it has started."""
        with self.lock:
            old = self.slots[slot]
            old.kill()
            self.retired.append(old)
            new = self.slots[slot] = self._spawn(slot)
        new.wait_for("its start", lambda ev: any(e.step == "start" for e in ev), 60)
        return new

    def all(self) -> list[WorkerProcess]:
        with self.lock:
            return [*self.retired, *self.slots]

    def kill_all(self) -> None:
        for worker in self.all():
            if worker.alive():
                worker.thaw()
                worker.kill()

    def stop(self, wait_s: float = 60.0) -> dict[str, int]:
        """SIGTERM every live worker (thawed first), SIGKILL one that has not exited within ``wait_s`` (frozen
        again meanwhile: a hung pod is killed); returns the exit codes of those that were live (-9: killed)."""
        with self.lock:
            live = [w for w in self.slots if w.alive()]
            for worker in live:
                worker.thaw()
                try:
                    worker.request_stop()
                except AssertionError:  # it exited meanwhile: its code below
                    pass
            codes = {}
            for worker in live:
                try:
                    codes[worker.name] = worker.wait(wait_s)
                except AssertionError:
                    worker.thaw()
                    worker.kill()
                    codes[worker.name] = -9
            return codes
