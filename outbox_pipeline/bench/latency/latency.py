"""Commit-to-Kafka latency under steady traffic (`outbox bench --latency RATE,...`), because throughput hides what a
consumer waits for. See docs/performance.md#how-the-latency-bench-measures."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import platform
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from ... import settings
from ...config import OutboxTable
from ...model import WAL
from ...store.schema import init_db
from ..runner import Servers
from ..server_jit import JIT_SUFFIX, set_server_jit
from ..wal_outbox import drop_outbox, table_for
from .gauges import relay_dsn, with_local_pids
from .orchestrated import DagsterRelay
from .relays import CliRelay, RelayUnderTest
from .scenarios import IdleResult, Scenario, ScenarioResult
from .steady import Session, run_idle, run_scenario

# Tansu: 5 ms measured a probe delay p99 of 6 ms against 13 at 20, for about 0.05 cores more of the broker.
TANSU_FETCH_WAIT_MS = 5


@dataclass(frozen=True)
class LatencyOptions:
    strategies: tuple[str, ...] = ("partitioned",)
    rates: tuple[float, ...] = ()  # the curve's rates (msg/s); none: no curve
    rows: tuple[int, ...] = (10,)  # the curve's rows per transaction
    hot_rates: tuple[float, ...] = ()  # the hot key's rates; none: no hot-key scenario
    quiet_keys: int = 7
    seconds: float = 20.0
    runs: int = 1
    workers: int = 1
    observe: bool = True
    idle_seconds: float = 10.0
    # The observer's fetch.wait.max.ms (bench/observer.py): the client's own default on Apache Kafka, which answers a
    # waiting fetch as soon as data comes (probe p99 1-4 ms at 500 as at 5, 2 fetches/s idle against 141-166);
    # TANSU_FETCH_WAIT_MS on Tansu, which notices new data only part way through a wait.
    fetch_wait_ms: int = 500
    dagster: bool = False
    # Other checkouts of the project whose `outbox relay` runs too, interleaved in every round (an A/B).
    relay_checkouts: tuple[str, ...] = ()
    # Every writer transaction in a span of its own (an SDK in the writers): the rows carry a traceparent.
    traced: bool = False
    # Each relay once per value of the server's own jit (ALTER SYSTEM), interleaved: a server with JIT against itself.
    server_jit: tuple[str, ...] = ()
    # Each curve point again with a transaction held open this long from the warm-up's end (0: not).
    hold_open_s: float = 0.0

    def scenarios(self) -> list[Scenario]:
        curve = [Scenario("curve", rate, rows) for rows in self.rows for rate in self.rates]
        if self.hold_open_s:  # each right after the same point without it: they share the machine's minute
            held = [dataclasses.replace(s, kind="held-open", hold_open_s=self.hold_open_s) for s in curve]
            curve = [s for pair in zip(curve, held, strict=True) for s in pair]
        return curve + [Scenario("hot-key", rate, quiet_keys=self.quiet_keys) for rate in self.hot_rates]


@dataclass
class LatencyBench:
    """Every run's numbers, in the order they were measured."""

    options: LatencyOptions
    command: str
    started: str
    machine: dict[str, object]
    statements_note: str = ""
    scenarios: list[ScenarioResult] = field(default_factory=list)
    idle: list[IdleResult] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return all(r.complete for r in self.scenarios)

    def write_json(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))
        return path


def machine() -> dict[str, object]:
    memory = next(
        (
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        ),
        0,
    )
    return {
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": round(memory / 2**20, 1),
        "python": platform.python_version(),
    }


def default_json_path() -> Path:
    return Path(settings.HOME.read()) / "bench" / f"latency-{time.strftime('%Y%m%d-%H%M%S')}.json"


def _relays(options: LatencyOptions, strategy: str, budget_s: float, scratch: Path) -> list[RelayUnderTest]:
    def cli(checkout: Path | None = None) -> CliRelay:
        log = scratch / f"relay-{strategy}-{uuid.uuid4().hex[:6]}.log"
        return CliRelay(strategy, options.workers, budget_s, log, checkout)

    others: list[RelayUnderTest] = [cli(Path(c)) for c in options.relay_checkouts]
    # Dagster's run for wal is not the bench's to drive yet: its CLI relay only.
    return [DagsterRelay(strategy), cli(), *others] if options.dagster and strategy != WAL else [cli(), *others]


def run(
    servers: Servers, options: LatencyOptions, command: str, progress: Callable[[str], None] = print
) -> LatencyBench:
    """Rounds x strategies (x Dagster, CLI): a fresh schema and relay each, its idle windows, then every scenario."""
    servers = with_local_pids(servers)
    dsn, why = relay_dsn(servers)
    bench = LatencyBench(options, command, time.strftime("%Y-%m-%d %H:%M:%S %Z"), machine(), why)
    m = bench.machine
    progress(f"$ {command}\n{bench.started}; {m['machine']}, {m['cores']} cores, {m['memory_gib']} GiB")
    budget_s = 2 * options.idle_seconds + len(options.scenarios()) * (options.seconds + 60) + 300
    with tempfile.TemporaryDirectory(prefix="bench-latency-") as scratch:
        for round_, jit in _rounds(options, budget_s, Path(scratch)):
            if jit is not None:
                set_server_jit(servers.dsn, jit)
            _run_round(bench, servers, dsn, round_, Path(scratch), progress)
    if options.server_jit:
        set_server_jit(servers.dsn, None)  # back to the server's own configuration
    return bench


@dataclass(frozen=True)
class _Round:
    """One relay's turn in one round: which round, which strategy, which relay, and its label (the server's jit)."""

    number: int
    strategy: str
    relay: RelayUnderTest
    label: str


def _rounds(options: LatencyOptions, budget_s: float, scratch: Path) -> Iterator[tuple[_Round, str | None]]:
    """Every relay's turn, interleaved: rounds x strategies x relays x the server's jit values (None: left as is)."""
    for n in range(options.runs):
        for strategy in options.strategies:
            relays = _relays(options, strategy, budget_s, scratch)
            for relay, jit in itertools.product(relays, options.server_jit or (None,)):
                yield _Round(n + 1, strategy, relay, f"{JIT_SUFFIX}{jit}" if jit is not None else ""), jit


def _run_round(
    bench: LatencyBench, servers: Servers, dsn: str, round_: _Round, scratch: Path, progress: Callable[[str], None]
) -> None:
    """A fresh outbox and relay for this turn, its idle windows and then every scenario; the outbox dropped after."""
    options, relay = bench.options, round_.relay
    progress(f"\n== round {round_.number}/{options.runs}: {round_.strategy}, {relay.name}{round_.label} relay")
    table = _fresh_outbox(servers.dsn, round_.strategy)
    session = Session(
        servers, relay, table, round_.strategy, round_.number, scratch, options.seconds, options.observe,
        options.fetch_wait_ms, bench.statements_note, options.traced, round_.label,
    )  # fmt: skip
    try:
        relay.start(dataclasses.replace(servers, dsn=dsn), table)
        if options.idle_seconds > 0:
            bench.idle.append(run_idle(session, options.idle_seconds))
            progress(_idle_line(bench.idle[-1]))
        for scenario in options.scenarios():
            bench.scenarios.append(run_scenario(session, scenario))
            progress(run_lines(bench.scenarios[-1]))
    finally:
        relay.stop()
        drop_outbox(servers.dsn, table)  # a wal outbox's slot too


def _fresh_outbox(dsn: str, strategy: str) -> OutboxTable:
    """A new outbox for one turn, as `init-db --strategy` makes it (dropped again, slot and all, if that fails)."""
    table = table_for(f"bench_latency_{uuid.uuid4().hex[:8]}", strategy)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            init_db(conn, table, strategies=[strategy])
    except BaseException:
        drop_outbox(dsn, table)  # a wal outbox's slot too
        raise
    return table


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _groups(cores: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.3f}" for name, value in cores.items())


def _idle_line(r: IdleResult) -> str:
    statements = f"{r.statements_per_s:.2f}/s" if r.statements_per_s is not None else f"n/a ({r.statements.why})"
    return (
        f"  idle {r.seconds:.0f} s: {_groups(r.cores)}; relay statements {statements}\n"
        f"  idle {r.seconds:.0f} s, observer polling ({r.observer_fetches_per_s or 0:.0f} fetches/s): "
        f"{_groups(r.cores_observed)}"
    )


def run_lines(r: ScenarioResult) -> str:
    """One run, as it ends: latency per key class, CPU per group, batches, statements, the observer's own delay."""
    lines = [f"  {r.scenario} for {r.seconds:.0f} s ({r.writers} writer processes):"]
    for c in r.classes:
        arrived = "-" if c.arrived is None else f"{c.arrived:,}"
        lines.append(
            f"    {c.key_class}: {c.achieved_rate:,.0f} of {c.target_rate:,.0f} msg/s committed; p50 {_ms(c.p50_ms)}, "
            f"p95 {_ms(c.p95_ms)}, p99 {_ms(c.p99_ms)}, max {_ms(c.max_ms)} ms ({arrived}/{c.committed:,} arrived)"
        )
    statements = (
        f"{r.statements_per_1000:.1f} per 1,000 messages" if r.statements_per_1000 is not None else r.statements.why
    )
    per_message = _ms(r.relay_us_per_message)
    lines += [
        f"    cores: {_groups(r.cores)}; machine {r.machine_cores:.3f}, of which other processes {r.other_cores:.3f}",
        f"    relay {r.relay_cores:.3f} cores = {per_message} us/message over {r.window_messages:,} messages; "
        f"batches/s {_ms(r.batches_per_s)}; statements {statements}",
        f"    writers: {r.writers_transactions:,} of {r.writers_scheduled:,} scheduled transactions, started late by "
        f"p99 {r.writers_late_p99_ms:.1f} ms (max {r.writers_late_max_ms:.1f}); observer "
        f"{_ms(r.observer_fetches_per_s)} fetches/s, probe ack -> poll p50 {_ms(r.probe_ms.get('p50'))}, "
        f"p99 {_ms(r.probe_ms.get('p99'))} ms; missing {r.missing:,}, duplicates {r.duplicates:,}",
    ]
    if r.runs_launched is not None:
        lines.append(f"    runs launched {r.runs_launched}, queued {r.runs_queued}")
    lines += [f"      {calls:>7,} x {query}" for calls, query in r.statements.top]
    return "\n".join(lines)
