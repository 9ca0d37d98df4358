"""Engine room: relay worker processes, as `outbox relay --workers N` runs them.

Each worker is a spawned process with its own connections, producer and strategy (nothing inherited),
started from a picklable ``WorkerSpec``; it sends its cumulative metrics back as a ``WorkerResult``. The
supervisor forwards SIGINT/SIGTERM to every worker (each then finishes its batch and deregisters) and
collects the results while they run.
"""

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

from ..config import default_worker_id
from ..errors import OutboxError
from ..strategies import WAL, strategy_class
from ..strategies.base import PublishOutcome, Strategy, StrategyConfig
from .loop import Relay
from .publisher import KafkaPublisher
from .relay_settings import RelaySettings
from .stats import RelayInstruments
from .wal.leader import LeaderSettings
from .wal.relay import WalRelay, WalRelaySettings

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


def build_relay(
    spec: WorkerSpec,
    stop: threading.Event | None = None,
    *,
    publisher: KafkaPublisher | None = None,
    strategy_cls: type[Strategy] | None = None,
    instruments: RelayInstruments | None = None,
    observer: Callable[[PublishOutcome], None] | None = None,
) -> Relay:
    """The one way a relay worker is assembled: the CLI's processes, the bench and the test workers call it.

    ``publisher`` and ``strategy_cls`` replace the defaults built from the spec (a Dagster resource's publisher,
    the bench's read-only ceiling, the fault suite's instrumented workers); ``observer`` sees every outcome.
    """
    return Relay(
        spec.dsn,
        strategy_cls or strategy_class(spec.strategy),
        replace(spec.config, worker_id=spec.worker_id or default_worker_id()),
        publisher or KafkaPublisher(spec.kafka_config),
        spec.settings,
        stop,
        instruments=instruments,
        observer=observer,
    )


def build_wal_relay(
    spec: WorkerSpec,
    stop: threading.Event | None = None,
    *,
    publisher: KafkaPublisher | None = None,
    observer: Callable[[PublishOutcome], None] | None = None,
    instruments: RelayInstruments | None = None,
) -> WalRelay:
    """The wal strategy's relay (relay/wal/), from the same spec: one process streams the slot, others wait."""
    return WalRelay(
        spec.dsn,
        spec.config.table,
        publisher or KafkaPublisher(spec.kafka_config),
        WalRelaySettings(
            until_idle=spec.settings.until_empty or spec.settings.until_idle,
            max_seconds=spec.settings.max_seconds,
            linger_s=spec.settings.wal_linger_s,
            leader=LeaderSettings(takeover_after_s=spec.settings.wal_takeover_s),
        ),
        stop,
        worker_id=spec.worker_id or default_worker_id(),
        on_poison=spec.config.on_poison,
        observer=observer,
        instruments=instruments,
    )


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
    relay_spec = replace(spec, worker_id=spec.worker_id or default_worker_id())
    worker_id = relay_spec.worker_id or ""
    table = spec.config.table
    served = None
    if spec.metrics_port is not None:
        from ..observe.metrics import serve_worker_metrics

        # Worker n serves on port + n; the first also samples the outbox's lag.
        served = serve_worker_metrics(
            spec.metrics_port + spec.index, spec.dsn, table, spec.strategy, sample_lag=spec.index == 0
        )
    relay: Relay | WalRelay = (
        build_wal_relay(relay_spec, stop, instruments=served.metrics if served else None)
        if spec.strategy == WAL
        else build_relay(relay_spec, stop, instruments=served.metrics if served else None)
    )
    done = threading.Event()

    def report() -> None:
        while not done.wait(METRICS_INTERVAL_S):
            log.info("worker %s: %s", worker_id, relay.stats.summary())

    reporter = threading.Thread(target=report, name="relay-metrics", daemon=True)
    reporter.start()
    error: str | None = None
    try:
        relay.run()
    except OutboxError as exc:  # a condition an operator fixes (an id in use): its message, not a traceback
        error = str(exc)
        log.error("worker %s stopped: %s", worker_id, exc)
    except Exception as exc:  # reported to the parent, which exits non-zero
        error = f"{type(exc).__name__}: {exc}"
        log.exception("worker %s crashed", worker_id)
    finally:
        done.set()
        reporter.join()
        if served is not None:
            served.stop()
    stats = relay.stats
    log.info("worker %s finished: %s", worker_id, stats.summary())
    results.put(
        WorkerResult(
            spec.index,
            worker_id,
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
    )
    if error is not None:
        sys.exit(1)


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
