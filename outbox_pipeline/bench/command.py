"""`outbox bench`, on the embedded stack unless servers are configured: bulk drains, the latency bench, writer cost,
held keys, retained rows, each against baselines of the same invocation. See
docs/performance.md#how-to-run-each-bench."""

from __future__ import annotations

import argparse
import os
import platform
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from .. import settings
from ..config import check_dsn
from ..model import STRATEGY_NAMES, WAL
from . import header_floor, held, retained, writers
from .baselines.comparison import (
    HEADLINE,
    PRODUCE_ONLY,
    READ_ONLY,
    Comparison,
    bench_lines,
    compare,
    same_jit,
    with_server_jit,
)
from .latency import latency_cli
from .runner import RunSpec, Servers
from .wal_outbox import WAL_BATCH

# The seed's table (1M x 256 B, batch 100, two topics of one partition), mm:ss, for the side-by-side.
TALK_TABLE = {
    "locking": ("01:53", "01:00"),
    "lease": ("02:08", "01:17"),
    "partitioned": ("02:36", "01:07"),
    "serialized": ("01:58", "00:57"),
}
# Messages the hand-written producer sends per round for `--trace-headers`' baseline (header_floor.py).
HEADER_FLOOR_MESSAGES = 200_000
# Server settings for benchmarks: durable defaults kept (fsync, synchronous_commit), with room for a
# million rows in memory and no checkpoint storm during the load.
BENCH_PG_SETTINGS = {
    "shared_buffers": "2GB",
    "max_wal_size": "8GB",
    "checkpoint_timeout": "30min",
    "work_mem": "64MB",
    # Where PostgreSQL's time goes, per statement (`--statements`); loaded always, so runs stay comparable.
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "all",
}


@contextmanager
def servers(embedded: bool, broker_kind: str = "kafka") -> Iterator[Servers]:
    """The configured servers, or an embedded PostgreSQL and the broker ``broker_kind`` names (Apache Kafka by
    default: figures are the broker users run; Tansu's are a development broker's, docs/performance.md)."""
    dsn, bootstrap = settings.PG_DSN.read(), os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if dsn and bootstrap and not embedded:
        check_dsn(dsn)
        print(f"servers: configured (OUTBOX_PG_DSN, KAFKA_BOOTSTRAP_SERVERS={bootstrap})", flush=True)
        yield Servers(dsn, bootstrap)
        return
    from ..localstack import BrokerSpec, LocalPostgres, PostgresSpec, free_port, local_broker
    from ..localstack.kafka_broker import SERVER_JVM_OPTIONS, LocalKafka

    home = Path(settings.HOME.read()).resolve()
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-", dir=home) as scratch:
        pg = LocalPostgres(PostgresSpec(Path(scratch) / "pg", port=free_port(), settings=BENCH_PG_SETTINGS))
        spec = BrokerSpec(port=free_port(), log_path=Path(scratch) / "broker.log")
        broker = local_broker(broker_kind, spec, Path(scratch) / "broker", home, SERVER_JVM_OPTIONS)
        pg.start()
        try:
            broker.start()
            jvm = " (Kafka's own JVM options: G1, a 1 GiB heap)" if isinstance(broker, LocalKafka) else ""
            print(f"servers: embedded PostgreSQL, broker {broker.name}{jvm}", flush=True)
            try:
                yield Servers(pg.dsn, broker.bootstrap_servers, pg.pid, broker.pid)
            finally:
                broker.stop()
        finally:
            pg.stop("fast", force=True)


def _mmss(seconds: float) -> str:
    return f"{int(seconds // 60):02d}:{seconds % 60:04.1f}"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    # SIGTERM (kill, a CI timeout) unwinds like Ctrl-C, so the embedded PostgreSQL and broker are
    # stopped instead of outliving the benchmark.
    signal.signal(signal.SIGTERM, _interrupt)
    if args.latency is not None or args.hot_key is not None:
        with servers(args.embedded, args.broker) as found:
            return latency_cli.run(found, args)
    if args.writers:
        with servers(args.embedded, args.broker) as found:
            return _writers(found, args)
    base = _drain_spec(args)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}", flush=True)
    with servers(args.embedded, args.broker) as found:
        if args.held is not None:
            held_steps = held.measure(found, args.strategy, args.held, batch_size=min(args.batch_size, 1000))
            print("\n" + held.render(args.strategy, held_steps, min(args.batch_size, 1000)))
            return 0 if all(s.bounded(min(args.batch_size, 1000)) for s in held_steps) else 1
        if args.retained is not None:
            steps = retained.measure(
                found, args.strategy, args.retained, pending=args.pending, batch_size=args.batch_size
            )
            print("\n" + retained.render(args.strategy, steps, args.batch_size))
            return 0 if all(s.bounded(args.batch_size) for s in steps) else 1
        if args.matrix:
            return _matrix(found, base, args.runs, args.matrix_strategies)
        return _drain(found, base, args)


def _writers(found: Servers, args: argparse.Namespace) -> int:
    """--writers: what each way of writing the outbox costs the writer and PostgreSQL (bench/writers.py)."""
    results = writers.measure(
        found,
        sizes=args.rows_per_transaction or [1, 10, 100],
        transactions=args.transactions,
        rows=args.messages,
        runs=args.runs,
        index_sets=args.strategies or writers.default_index_sets(found.dsn),
    )
    print("\n" + results.render())
    return 0


def _drain_spec(args: argparse.Namespace) -> RunSpec:
    """The drain every line of a backlog bench runs, from the flags (refusing those that do not apply)."""
    rows = args.rows_per_transaction or [100]
    if len(rows) > 1:
        raise SystemExit("outbox bench: several --rows-per-transaction are for --latency and --writers only")
    if args.strategy == WAL and (args.held is not None or args.retained is not None or args.matrix):
        raise SystemExit("outbox bench: --held, --retained and --matrix time a table's claims; a wal outbox has none")
    return RunSpec(
        strategy=args.strategy,
        workers=2 if args.workers is None else args.workers,
        batch_size=args.batch_size,
        messages=args.messages,
        payload_bytes=args.payload_bytes,
        binary=args.payload == "bytes",
        trace_headers=args.trace_headers is not None,
        relay_spans=args.trace_headers == "spans",
        topics=args.topics,
        partitions=args.partitions,
        keys=args.keys,
        rows_per_transaction=rows[0],
        mode=args.mode,
        verify=args.verify,
        statements=args.statements,
    )


def _drain(found: Servers, base: RunSpec, args: argparse.Namespace) -> int:
    """A backlog drained by our relay and its baselines, interleaved; 1 if a line did not deliver everything."""
    lines = bench_lines(base, baseline=args.baseline, naive_strategy=args.baseline_strategy)
    if args.server_jit:
        lines = with_server_jit(lines, args.server_jit)
    comparison = compare(found, lines, args.runs)
    print("\n" + render_comparison(base, comparison, args.runs))
    if base.trace_headers:
        # The same invocation's baseline for what the header costs: the client library's own share.
        messages = min(base.messages, HEADER_FLOOR_MESSAGES)
        floor = header_floor.measure(
            found.bootstrap, messages=messages, payload_bytes=base.payload_bytes, runs=max(3, args.runs)
        )
        print("\n" + floor.render(messages))
    return 0 if comparison.complete else 1


_WHAT = {
    "talk": "the talk's variant on the talk's own table, batch 100",
    "naive": "the talk's variant on our table (partitioned by day, its indexes), batch 100",
    "ours": "our relay",
    "produce-only": "the same records from memory through the same producer (no PostgreSQL)",
    "read-only": "our relay with Kafka replaced by an instant confirmation (no Kafka)",
    "hand-written": "the talk's variant tuned by hand on its table: batch 5,000, pipelined, no headers",
}


def render_comparison(base: RunSpec, c: Comparison, runs: int) -> str:
    """The results table: medians, ratios against the headline baseline, shares of both ceilings."""
    traced = (", traced" + ("" if base.relay_spans else ", no relay spans")) if base.trace_headers else ""
    relay = f"{base.strategy}, {base.workers} worker(s)"
    batch = f"ours batch {base.batch_size}"
    if base.strategy == WAL:  # one relay streams the slot, in batches of its own; partitioned beside it
        relay = f"wal (one relay streams the slot) beside partitioned ({base.workers} worker(s))"
        batch = f"batch wal up to {WAL_BATCH:,}, partitioned {base.batch_size}"
    head = [
        f"{relay}, {base.messages:,} x {base.payload_bytes} B {'bytes' if base.binary else 'JSON'}{traced}, "
        f"{base.topics} topics x {base.partitions} partition(s), {batch}, "
        f"medians of {runs} interleaved round(s); "
        f"{platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}",
        "| line | what | msg/s | x talk v1 | % of produce-only | % of read-only | verified |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = []
    for name, spec in c.specs.items():
        rate = c.median(name)
        produce, read = c.median(same_jit(PRODUCE_ONLY, name)), c.median(same_jit(READ_ONLY, name))
        headline = same_jit(HEADLINE, name)
        vs_headline = f"{c.ratio(name, headline):.2f}" if headline in c.specs else "-"
        verified = {r.verified for r in c.results.get(name, [])}
        rows.append(
            f"| {name} | {_WHAT[spec.kind]} | {rate:,.0f} | {vs_headline} | "
            f"{100 * rate / produce:.0f} % | {100 * rate / read:.0f} % | "
            f"{'yes' if verified == {True} else 'NO' if False in verified else '-'} |"
            if produce and read
            else f"| {name} | {_WHAT[spec.kind]} | {rate:,.0f} | {vs_headline} | - | - | - |"
        )
    return "\n".join(head + rows)


def _matrix(found: Servers, base: RunSpec, runs: int, strategies: list[str]) -> int:
    unknown = sorted(set(strategies) - set(STRATEGY_NAMES))
    if unknown:
        raise SystemExit(f"outbox bench: unknown strategies {unknown}; choose from {', '.join(STRATEGY_NAMES)}")
    by_workers: dict[int, Comparison] = {}
    for workers in (1, 2):
        spec = replace(base, workers=workers)
        lines: dict[str, RunSpec] = {HEADLINE: replace(spec, kind="talk", strategy="locking")}
        for strategy in strategies:
            if strategy != "locking":
                lines[f"talk {strategy}"] = replace(spec, kind="talk", strategy=strategy)
            lines[f"ours {strategy}"] = replace(spec, strategy=strategy)
            lines[f"read-only {strategy}"] = replace(spec, strategy=strategy, kind="read-only")
        lines[PRODUCE_ONLY] = replace(spec, kind="produce-only")
        print(f"\n== {workers} worker(s)", flush=True)
        by_workers[workers] = compare(found, lines, runs)
    print(
        f"\n{base.messages:,} messages x {base.payload_bytes} B, {base.topics} topics x {base.partitions} partition(s),"
        f" medians of {runs} interleaved round(s), naive batch 100, ours batch {base.batch_size}; "
        f"{platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}"
    )
    print(
        "| variant | talk's slide 1w | talk's slide 2w | talk table 1w | talk table 2w | ours 1w | ours 2w "
        "| ours / its naive (1w, 2w) | ours / talk v1 (1w, 2w) | read-only 2w | produce-only 2w |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for strategy in strategies:
        naive = HEADLINE if strategy == "locking" else f"talk {strategy}"
        talk = TALK_TABLE.get(strategy, ("-", "-"))

        def cell(workers: int, line: str) -> str:
            rate = by_workers[workers].median(line)
            return f"{_mmss(base.messages / rate)} ({rate / 1000:.0f}k/s)" if rate else "-"

        def ratios(against: str, ours: str = f"ours {strategy}") -> str:
            return ", ".join(f"{by_workers[w].ratio(ours, against):.1f}x" for w in (1, 2))

        print(
            f"| {strategy} | {talk[0]} | {talk[1]} | {cell(1, naive)} | {cell(2, naive)} | "
            f"{cell(1, f'ours {strategy}')} | {cell(2, f'ours {strategy}')} | {ratios(naive)} | {ratios(HEADLINE)} | "
            f"{by_workers[2].median(f'read-only {strategy}') / 1000:.0f}k/s | "
            f"{by_workers[2].median(PRODUCE_ONLY) / 1000:.0f}k/s |"
        )
    return 0 if all(c.complete for c in by_workers.values()) else 1
