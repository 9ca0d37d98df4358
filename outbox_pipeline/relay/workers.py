"""Relay worker processes as `outbox relay --workers N` runs them: spawned with nothing inherited, stopped by forwarded
signals, their metrics collected. See docs/operations.md#command-line."""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import TYPE_CHECKING, Protocol

from ..config import default_worker_id
from ..errors import OutboxError
from ..model import WAL, PublishOutcome
from ..strategies import strategy_class
from ..strategies.base import Strategy, StrategyConfig
from .loop import Relay
from .publisher import KafkaPublisher
from .relay_settings import RelaySettings
from .sessions import WorkerSessions
from .stats import RelayInstruments, RelayStats
from .wal.relay import WalRelay

if TYPE_CHECKING:
    from ..observe.metrics import WorkerMetrics

log = logging.getLogger(__name__)

# How often each relay worker logs its cumulative metrics.
METRICS_INTERVAL_S = 5.0
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})  # how a pod, systemd or Ctrl-C asks the relay to stop


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one relay worker needs; picklable, so a spawned process can be given it."""

    dsn: str
    strategy: str
    kafka_config: Mapping[str, object]
    settings: RelaySettings = field(default_factory=RelaySettings)
    # table, mode, transactions, poison policy, leases...; its worker_id is replaced by ``worker_id``
    config: StrategyConfig = field(default_factory=StrategyConfig)
    worker_id: str | None = None  # None: "<hostname>-<pid>" of the process that builds the relay
    index: int = 0
    metrics_port: int | None = None
    log_level: int = logging.INFO


class RelayWorker(Protocol):
    """What every relay is to its callers (the CLI's processes, Dagster runs, the bench, the tests): the table relay
    (loop.py) and the wal relay (wal/relay.py) alike."""

    stop: threading.Event  # set it to end the run after the batch in Kafka is confirmed
    stats: RelayStats
    registered: threading.Event  # set while the worker is registered (table) or streams the slot (wal)

    def prepare(self) -> None: ...  # connect and start the producer now, before a measurement's clock starts
    def run(self) -> RelayStats: ...


def build_relay(
    spec: WorkerSpec,
    stop: threading.Event | None = None,
    *,
    publisher: KafkaPublisher | None = None,
    strategy_cls: type[Strategy] | None = None,
    instruments: RelayInstruments | None = None,
    observer: Callable[[PublishOutcome], None] | None = None,
) -> RelayWorker:
    """The one way a relay worker is assembled: the CLI's processes, the bench, Dagster runs and the test workers.

    ``publisher`` and ``strategy_cls`` replace the defaults built from the spec (a Dagster resource's publisher,
    the bench's read-only ceiling, the fault suite's instrumented workers); ``observer`` sees every outcome.
    """
    stop = stop or threading.Event()
    publisher = publisher or KafkaPublisher(spec.kafka_config)
    config = replace(spec.config, worker_id=spec.worker_id or default_worker_id())
    if spec.strategy == WAL:  # one process streams the slot, others wait (relay/wal/)
        return WalRelay(
            spec.dsn,
            config.table,
            publisher,
            spec.settings,
            stop,
            worker_id=config.worker_id,
            on_poison=config.on_poison,
            observer=observer,
            instruments=instruments,
        )
    factory = strategy_cls or strategy_class(spec.strategy)
    sessions = WorkerSessions(spec.dsn, factory, config, spec.settings, stop)
    return Relay(sessions, publisher, spec.settings, stop, observer=observer, instruments=instruments)


@dataclass(frozen=True)
class WorkerResult:
    """A worker's cumulative metrics (RelayStats), sent back to the parent when it ends."""

    index: int
    worker_id: str
    published: int
    claimed: int
    collisions: int
    lost_ownership: int
    dead_lettered: int
    retried: int
    errors: int
    elapsed_s: float
    summary: str
    error: str | None = None
    # --until-empty stopped with rows pending: why (lag.explain_pending)
    remaining: tuple[str, ...] = ()

    @classmethod
    def of(cls, spec: WorkerSpec, stats: RelayStats, error: str | None) -> WorkerResult:
        return cls(
            spec.index,
            spec.worker_id or "",
            stats.published,
            stats.claimed,
            stats.collisions,
            stats.lost_ownership,
            stats.dead_lettered,
            stats.retried,
            stats.errors,
            stats.elapsed_s,
            stats.summary(),
            error,
            tuple(stats.remaining),
        )


def relay_worker(spec: WorkerSpec, results: Queue[WorkerResult]) -> None:
    """Entry point of one spawned relay process: its own connection, producer and strategy.

    SIGINT/SIGTERM (the parent forwards its own) set the worker's stop event: the relay finishes its
    batch and returns. No multiprocessing lock or event is shared with the parent on purpose: a
    process that ends while waiting on one leaves it unusable for everyone else.
    """
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda *_: stop.set())
    # The parent started us with them blocked: one sent while we booted waited for the handler above.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    spec = replace(spec, worker_id=spec.worker_id or default_worker_id())
    served = _serve_metrics(spec)
    relay = build_relay(spec, stop, instruments=served.metrics if served else None)
    try:
        error = _run_reporting(relay, spec.worker_id or "")
    finally:
        if served is not None:
            served.stop()
    log.info("worker %s finished: %s", spec.worker_id, relay.stats.summary())
    results.put(WorkerResult.of(spec, relay.stats, error))
    if error is not None:
        sys.exit(1)


def _serve_metrics(spec: WorkerSpec) -> WorkerMetrics | None:
    """/metrics and /healthz when asked for: worker n serves on port + n; the first also samples the outbox's lag."""
    if spec.metrics_port is None:
        return None
    from ..observe.metrics import serve_worker_metrics

    table = spec.config.table
    return serve_worker_metrics(
        spec.metrics_port + spec.index, spec.dsn, table, spec.strategy, sample_lag=spec.index == 0
    )


def _run_reporting(relay: RelayWorker, worker_id: str) -> str | None:
    """Run the relay, logging its counts every METRICS_INTERVAL_S; what ended it, when it was not a stop."""
    done = threading.Event()

    def report() -> None:
        while not done.wait(METRICS_INTERVAL_S):
            log.info("worker %s: %s", worker_id, relay.stats.summary())

    reporter = threading.Thread(target=report, name="relay-metrics", daemon=True)
    reporter.start()
    try:
        relay.run()
    except OutboxError as exc:  # a condition an operator fixes (an id in use): its message, not a traceback
        log.error("worker %s stopped: %s", worker_id, exc)
        return str(exc)
    except Exception as exc:  # reported to the parent, which exits non-zero
        log.exception("worker %s crashed", worker_id)
        return f"{type(exc).__name__}: {exc}"
    finally:
        done.set()
        reporter.join()
    return None


@contextmanager
def forward_stop_signals(processes: Sequence[BaseProcess], stopping: threading.Event) -> Iterator[None]:
    """SIGINT/SIGTERM to the parent set `stopping` and become SIGTERM to every started worker."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return

    def forward(signum: int, _frame: object) -> None:
        stopping.set()
        started = [p for p in processes if p.pid is not None and p.exitcode is None]
        log.info("relay: %s received, stopping %d workers", signal.Signals(signum).name, len(started))
        for process in started:
            os.kill(process.pid, signal.SIGTERM)  # type: ignore[arg-type]  # started: pid is set

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Start a worker with SIGINT/SIGTERM blocked: the child inherits the mask, so a stop sent while it boots
    waits for its handler instead of killing it half-started (exit -15, counted as a crash), and the parent's
    own signal waits until the child has a pid to forward it to."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def collect(processes: Sequence[BaseProcess], results: Queue[WorkerResult]) -> dict[int, WorkerResult]:
    """Results as workers finish; read while they run, so no worker blocks on a full pipe at exit."""
    collected: dict[int, WorkerResult] = {}
    while len(collected) < len(processes):
        try:
            result = results.get(timeout=0.5)
        except queue.Empty:
            if not any(p.is_alive() for p in processes):
                break
            continue
        collected[result.index] = result
    return collected


def run_worker_processes(specs: Sequence[WorkerSpec]) -> tuple[list[BaseProcess], dict[int, WorkerResult]]:
    """Start one spawned process per spec, forward stop signals to them, and collect their results."""
    # "spawn": each worker starts clean (no inherited connections, producer threads or locks).
    ctx = multiprocessing.get_context("spawn")
    processes: list[BaseProcess] = []
    stopping = threading.Event()
    with forward_stop_signals(processes, stopping):
        # The queue's lock starts multiprocessing's resource tracker now: starting it later, inside the first
        # start(), would unblock SIGINT/SIGTERM again (resource_tracker.ensure_running does).
        results: Queue[WorkerResult] = ctx.Queue()
        try:
            for spec in specs:
                if stopping.is_set():  # stopped while starting: the rest never start
                    break
                worker = ctx.Process(target=relay_worker, args=(spec, results), name=f"relay-{spec.index}")
                with stop_signals_blocked():
                    worker.start()
                    processes.append(worker)
            collected = collect(processes, results)
        finally:
            for process in processes:
                process.join(timeout=30)
                if process.is_alive():
                    process.terminate()
                    process.join()
    return processes, collected
