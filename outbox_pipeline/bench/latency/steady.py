"""One measured run of a latency scenario, or of the idle relay, on a running relay: its order and its window. See
docs/performance.md#how-the-latency-bench-measures."""

from __future__ import annotations

import statistics
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import psycopg
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from ... import settings
from ...config import OutboxTable
from ...model import WAL
from ...observe.lag import partition_lag
from ...store.schema import set_topic_partitions
from ..children import Child, sleep_until
from ..runner import Servers
from ..wal_outbox import wait_confirmed
from . import observer as observing
from . import traffic
from .gauges import CpuReading, Statements, read_cpu, relay_sessions, relay_statements, reset_statements
from .open_transaction import transaction_held_open
from .relays import RelayCounters, RelayUnderTest
from .scenarios import WARMUP_S, IdleResult, Scenario, ScenarioResult, class_latency, percentile, writer_plans

START_S = 0.5  # writers are told to start this far ahead, so they start together
READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Session:
    """A relay serving one schema for a series of runs; ``statements_why`` non-empty: not countable here."""

    servers: Servers
    relay: RelayUnderTest
    table: OutboxTable
    strategy: str
    round: int
    scratch: Path
    seconds: float
    observe: bool
    fetch_wait_ms: int
    statements_why: str = ""
    traced: bool = False  # the writers' transactions in spans: their rows carry a traceparent
    label: str = ""  # after the relay's name in the results (the server's jit of the run: `` @ jit on``)


def _topic(session: Session, partitions: int, label: str) -> str:
    topic = f"{session.table.schema.replace('_', '-')}-{label}-{uuid.uuid4().hex[:6]}"
    admin = AdminClient({"bootstrap.servers": session.servers.bootstrap})
    for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        future.result()
    with psycopg.connect(session.servers.dsn, autocommit=True) as conn:
        set_topic_partitions(conn, session.table, topic, partitions)
    return topic


def _observer(session: Session, topic: str, partitions: int, probe: bool) -> tuple[Child, observing.ObserverPlan]:
    probe_topic = None
    if probe:
        probe_topic = f"{topic}-probe"
        admin = AdminClient({"bootstrap.servers": session.servers.bootstrap})
        for future in admin.create_topics([NewTopic(probe_topic, 1, 1)]).values():
            future.result()
    out = str(session.scratch / f"observer-{topic}.tsv")
    plan = observing.ObserverPlan(session.servers.bootstrap, topic, partitions, out, session.fetch_wait_ms, probe_topic)
    child = Child("outbox_pipeline.bench.latency.observer", plan.to_json())
    if child.wait_line("ready", READY_TIMEOUT_S) is None:
        child.kill()
        raise RuntimeError("the bench observer did not get ready")
    return child, plan


def _stop_observer(child: Child, plan: observing.ObserverPlan) -> tuple[observing.ObserverHeader, dict[str, float]]:
    child.say("stop")
    child.finish(60.0)
    return observing.read_output(plan.out)


def _reading(session: Session, sessions: list[int], observer: Child | None) -> CpuReading:
    others = {"observer": observer.pid} if observer else {}
    return read_cpu(session.servers, session.relay.cpu_s(), sessions, **others)


def _wait_published(session: Session, topic: str, before: RelayCounters | None, expected: int, timeout_s: float) -> int:
    """Without an observer: until the relay published ``expected`` more (its counter), or nothing of ``topic`` is
    pending (no counter: Dagster), or (wal, no counter) the slot confirmed everything committed so far, else all
    ``expected`` count as missing (the slot tells no count). Polling another process's state; how many are missing."""
    if before is None and session.strategy == WAL:
        return 0 if wait_confirmed(session.servers.dsn, session.table, timeout_s) else expected
    deadline = time.monotonic() + timeout_s
    while True:
        now = session.relay.counters()
        if before is not None and now is not None:
            missing = max(0, expected - round(now.published - before.published))
        else:
            with psycopg.connect(session.servers.dsn, autocommit=True) as conn:
                lags = partition_lag(conn, session.table, session.strategy)
            missing = sum(lag.pending for lag in lags if lag.topic == topic)
        if missing == 0 or time.monotonic() > deadline:
            return missing
        time.sleep(0.2)


@dataclass(frozen=True)
class _Window:
    """The measured window's two ends: CPU and the relay's counters at each, and what the relay ran in between."""

    cpu_from: CpuReading
    cpu_to: CpuReading
    counted_from: RelayCounters | None
    counted_to: RelayCounters | None
    statements: Statements
    runs: tuple[int, int] | None  # (launched, queued) for an orchestrated relay


@dataclass(frozen=True)
class _Outcome:
    """What one run measured: its window, what the writers committed, and what arrived (None: no observer)."""

    t0: float
    window: _Window
    headers: list[traffic.WriterHeader]
    committed: list[tuple[str, float, str]]
    missing: int
    arrivals: dict[str, float] | None
    observed: observing.ObserverHeader | None


def run_scenario(session: Session, scenario: Scenario) -> ScenarioResult:
    topic = _topic(session, scenario.partitions, scenario.kind)
    streams = scenario.streams(topic)
    plans = writer_plans(
        streams,
        session.table.schema,
        session.seconds,
        session.scratch,
        serialized=session.strategy == "serialized",
        traced=session.traced,
        write_to=session.table.write_to,
    )
    observer = _observer(session, topic, scenario.partitions, probe=True) if session.observe else None
    watcher = observer[0] if observer else None
    writers: list[Child] = []
    try:
        env = {settings.PG_DSN.name: session.servers.dsn}
        writers = [Child("outbox_pipeline.bench.latency.traffic", plan.to_json(), env) for plan in plans]
        outcome = _drive(session, scenario, topic, writers, plans, observer)
    finally:
        for child in writers + ([watcher] if watcher else []):
            child.kill()
    return _result(session, scenario, streams, len(writers), outcome)


def _drive(
    session: Session,
    scenario: Scenario,
    topic: str,
    writers: list[Child],
    plans: list[traffic.WriterPlan],
    observer: tuple[Child, observing.ObserverPlan] | None,
) -> _Outcome:
    """The writers started together at ``t0``, the window measured, then everything committed waited for."""
    for writer in writers:
        if writer.wait_line("ready", READY_TIMEOUT_S) is None:
            raise RuntimeError("a bench writer did not get ready")
    before = session.relay.counters()
    t0 = time.time() + START_S
    for writer in writers:
        writer.say(f"go {t0!r}")
    window = _measure(session, scenario, t0, observer[0] if observer else None)
    for writer in writers:
        if writer.wait_line("done", 60.0) is None:
            raise RuntimeError("a bench writer did not finish its schedule")
    outputs = [traffic.read_output(plan.out) for plan in plans]
    for writer in writers:
        writer.say("exit")
        writer.finish(30.0)
    committed = [row for _, rows in outputs for row in rows]
    drain_s = max(60.0, 2 * session.seconds)
    if observer is None:
        missing = _wait_published(session, topic, before, len(committed), drain_s)
        return _Outcome(t0, window, [h for h, _ in outputs], committed, missing, None, None)
    observer[0].say(f"expect {len(committed)}")
    observer[0].wait_line("arrived", drain_s)
    header, arrivals = _stop_observer(*observer)
    missing = sum(1 for mid, _, _ in committed if mid not in arrivals)
    return _Outcome(t0, window, [h for h, _ in outputs], committed, missing, arrivals, header)


def _measure(session: Session, scenario: Scenario, t0: float, watcher: Child | None) -> _Window:
    """Both ends of ``[t0 + warm-up, t0 + seconds]``, with a transaction held open at its start if the scenario asks."""
    servers, relay = session.servers, session.relay
    with ExitStack() as held:
        sleep_until(t0 + WARMUP_S)
        if scenario.hold_open_s:
            held.enter_context(transaction_held_open(servers.dsn, session.table))
        why = session.statements_why or reset_statements(servers.dsn)
        sessions = relay_sessions(servers.dsn)
        counted_from, cpu_from = relay.counters(), _reading(session, sessions, watcher)
        if scenario.hold_open_s:
            sleep_until(t0 + WARMUP_S + scenario.hold_open_s)
            held.close()  # the transaction ends (rolled back)
        sleep_until(t0 + session.seconds)
        cpu_to, counted_to = _reading(session, sessions, watcher), relay.counters()
    return _Window(cpu_from, cpu_to, counted_from, counted_to, relay_statements(servers.dsn, why), relay.runs())


def _result(
    session: Session, scenario: Scenario, streams: list[traffic.Stream], writers: int, outcome: _Outcome
) -> ScenarioResult:
    """The run's figures: latency per key class, CPU per group, and the relay's work per message in the window."""
    relay, seconds, w, headers = session.relay, session.seconds, outcome.window, outcome.headers
    cores, machine = w.cpu_from.cores(w.cpu_to)
    window = w.cpu_to.at - w.cpu_from.at
    cores["writers"] = sum(h.cpu_s / h.cpu_window_s for h in headers if h.cpu_window_s > 0)
    relay_cores = sum(cores[name] for name in relay.cpu_s())
    if w.counted_from is not None and w.counted_to is not None:
        in_window = round(w.counted_to.published - w.counted_from.published)
        batches_per_s: float | None = (w.counted_to.batches - w.counted_from.batches) / window
    else:
        in_window = sum(1 for _, at, _ in outcome.committed if w.cpu_from.at <= at < w.cpu_to.at)
        batches_per_s = None
    key_classes = {s.key_class: 0.0 for s in streams}
    for s in streams:
        key_classes[s.key_class] += s.rate
    header, statements, runs = outcome.observed, w.statements, w.runs
    # The probes sent in the window (the observer's first fetches of a new topic are not its steady delay).
    probes = sorted(ms for at, ms in (header.probes if header else []) if w.cpu_from.at <= at < w.cpu_to.at)
    return ScenarioResult(
        round=session.round,
        strategy=session.strategy,
        relay=relay.name + session.label,
        scenario=scenario.name,
        kind=scenario.kind,
        rate=scenario.rate,
        rows=scenario.rows,
        seconds=seconds,
        classes=[
            class_latency(name, rate, seconds, outcome.t0 + WARMUP_S, outcome.committed, outcome.arrivals)
            for name, rate in key_classes.items()
        ],
        missing=outcome.missing,
        cores=cores,
        machine_cores=machine,
        relay_cores=relay_cores,
        window_messages=in_window,
        relay_us_per_message=1e6 * relay_cores * window / in_window if in_window else None,
        batches_per_s=batches_per_s,
        statements=statements,
        statements_per_1000=1000 * statements.calls / in_window if statements.calls is not None and in_window else None,
        writers_late_p99_ms=max(h.late_p99_ms for h in headers),
        writers_late_max_ms=max(h.late_max_ms for h in headers),
        writers=writers,
        writers_transactions=sum(h.transactions for h in headers),
        writers_scheduled=sum(h.scheduled for h in headers),
        observer_fetches_per_s=header.fetch_requests / header.lifetime_s if header else None,
        probe_ms={"p50": statistics.median(probes), "p99": percentile(probes, 0.99), "max": probes[-1]}
        if probes
        else {},
        duplicates=header.duplicates if header else 0,
        runs_launched=runs[0] if runs else None,
        runs_queued=runs[1] if runs else None,
        hold_open_s=scenario.hold_open_s,
    )


def run_idle(session: Session, seconds: float) -> IdleResult:
    """``seconds`` with no traffic and no observer (the relay's idle cost), then as long with the observer polling
    an empty topic of 8 partitions (what it costs the broker when there is nothing to fetch)."""
    servers = session.servers
    why = session.statements_why or reset_statements(servers.dsn)
    sessions = relay_sessions(servers.dsn)
    before = _reading(session, sessions, None)
    time.sleep(seconds)  # the measured idle window
    after = _reading(session, sessions, None)
    statements = relay_statements(servers.dsn, why)
    cores, machine = before.cores(after)
    child, plan = _observer(session, _topic(session, 8, "idle"), 8, probe=False)
    try:
        observed_from = _reading(session, sessions, child)
        time.sleep(seconds)  # the measured window with the observer polling
        observed, _ = observed_from.cores(_reading(session, sessions, child))
        header, _ = _stop_observer(child, plan)
    finally:
        child.kill()
    return IdleResult(
        round=session.round,
        strategy=session.strategy,
        relay=session.relay.name + session.label,
        seconds=seconds,
        relay_cores=sum(cores[name] for name in session.relay.cpu_s()),
        cores=cores,
        machine_cores=machine,
        statements_per_s=statements.calls / (after.at - before.at) if statements.calls is not None else None,
        statements=statements,
        cores_observed=observed,
        observer_fetches_per_s=header.fetch_requests / header.lifetime_s,
    )
