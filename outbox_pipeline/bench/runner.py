"""One bulk run: load N messages, drain them with a strategy, measure and verify; speed is printed, never asserted. See
docs/performance.md#how-a-bulk-run-is-measured."""

from __future__ import annotations

import multiprocessing
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event, Semaphore
from pathlib import Path
from typing import Literal

import psycopg
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from psycopg import sql

from ..config import OutboxTable
from ..localstack.demo import load
from ..model import WAL, PublishOutcome
from ..relay.publisher import KafkaPublisher
from ..relay.relay_settings import RelaySettings
from ..relay.workers import WorkerSpec, build_relay
from ..store.schema import init_db, set_topic_partitions
from ..strategies.base import StrategyConfig
from ..verify import verify
from .baselines.ceilings import ConfirmingPublisher, count_back, produce_all, read_share
from .baselines.handwritten import run_hand_written
from .baselines.naive import NAIVE_BATCH, prepare_naive_schema, run_naive
from .baselines.talk_table import add_talk_offsets, create_talk_table, index_talk_table
from .procstat import own_cpu_s, own_peak_rss_mb, process_cpu_s, tree_cpu_s, wait_for_client_backends_to_end
from .statements import reset_statements, top_statements
from .wal_outbox import WAL_BATCH, drop_outbox, table_for


@dataclass(frozen=True)
class Servers:
    dsn: str
    bootstrap: str
    postgres_pid: int | None = None
    broker_pid: int | None = None


# What a run drains with, and on which table:
# - ours: the relay (``strategy``) on our table;
# - talk: the seed's naive variant for ``strategy`` on the seed's own table (talk_table.py), the headline baseline;
# - naive: the same variant on our table (partitioned by day, more indexes), a second line;
# - produce-only / read-only: the two ceilings (ceilings.py);
# - hand-written: seed variants 3 or 4 tuned by hand on the seed's table (handwritten.py).
RunKind = Literal["ours", "talk", "naive", "produce-only", "read-only", "hand-written"]
TALK_TABLE_KINDS = ("talk", "hand-written")
NAIVE_KINDS = ("talk", "naive")


@dataclass(frozen=True)
class RunSpec:
    strategy: str
    workers: int = 2
    batch_size: int = 5000
    kind: RunKind = "ours"
    messages: int = 1_000_000
    payload_bytes: int = 256
    binary: bool = False  # our table's payloads as bytes (payload_bytes) of the same size, not JSON
    # Every transaction's rows carry a traceparent, and (relay_spans) the relay records a span per batch (an SDK,
    # spans dropped).
    trace_headers: bool = False
    relay_spans: bool = True
    topics: int = 2
    partitions: int = 1
    keys: int = 1000
    # Services commit small transactions; seed variant 3 depends on it (see demo.load).
    rows_per_transaction: int = 100
    mode: str = "delete"
    verify: bool = False
    statements: bool = False  # print pg_stat_statements' top statements of the drain
    server_jit: str | None = None  # the server's own jit during the run (server_jit.py); None: as configured

    @property
    def naive(self) -> bool:
        return self.kind in NAIVE_KINDS

    @property
    def label(self) -> str:
        batch = NAIVE_BATCH if self.naive else WAL_BATCH if self.strategy == WAL else self.batch_size
        return f"{self.strategy} {self.kind} w={self.workers} b={batch}"


@dataclass(frozen=True)
class RunResult:
    spec: RunSpec
    published: int
    drain_s: float
    load_s: float
    relay_cpu_s: float
    postgres_cpu_s: float | None
    broker_cpu_s: float | None
    peak_rss_mb: float
    verified: bool | None = None
    note: str = ""

    @property
    def msg_per_s(self) -> float:
        return self.published / self.drain_s if self.drain_s > 0 else 0.0


@dataclass(frozen=True)
class _WorkerReport:
    published: int
    ended: float  # time.time() when its last batch was confirmed (0: it confirmed none)
    cpu_s: float
    max_rss_mb: float
    error: str | None = None


@dataclass
class _LastConfirmed:
    """A relay's outcome observer: when its last batch was confirmed and acked. A worker run ``until_empty``
    whose own partitions are done does not return at once: it waits, backing off up to seconds, while a
    peer still has rows pending. That wait is not drain time, and it fell on ours only (the naive and
    hand-written lines return at their last send)."""

    at: float = 0.0

    def __call__(self, _outcome: PublishOutcome) -> None:
        self.at = time.time()


def _worker(
    spec: RunSpec,
    dsn: str,
    schema: str,
    bootstrap: str,
    index: int,
    ready: Semaphore,
    go: Event,
    out: Queue[_WorkerReport],
) -> None:
    """One benchmark worker process: set up, say it is ready, wait for the start signal, drain, report."""
    table = table_for(schema, spec.strategy)

    started_cpu = [0.0]  # the worker's CPU when the drain starts: set-up and imports are not the drain's

    def start_line() -> None:
        ready.release()
        go.wait()
        started_cpu[0] = own_cpu_s()

    try:
        published, ended = _drain_line(spec, dsn, table, bootstrap, index, start_line)
        cpu_s = own_cpu_s() - started_cpu[0]
        out.put(_WorkerReport(published, time.time() if ended is None else ended, cpu_s, own_peak_rss_mb()))
    except Exception as exc:  # reported, the run is marked failed
        ready.release()
        out.put(_WorkerReport(0, time.time(), 0.0, 0.0, f"{type(exc).__name__}: {exc}"))


def _drain_line(
    spec: RunSpec, dsn: str, table: OutboxTable, bootstrap: str, index: int, start_line: Callable[[], None]
) -> tuple[int, float | None]:
    """The line under test, ``start_line`` called once it is set up: (published, when its last batch was confirmed;
    None for the naive, hand-written and produce-only lines, which end when they return)."""
    if spec.naive:
        start_line()
        return run_naive(spec.strategy, dsn, table, bootstrap, f"naive-{index}").published, None
    if spec.kind == "hand-written":
        start_line()
        return run_hand_written(spec.strategy, dsn, table, bootstrap, spec.batch_size), None
    if spec.kind == "produce-only":
        records = read_share(dsn, table, index, spec.workers)
        publisher = KafkaPublisher({"bootstrap.servers": bootstrap})
        publisher.warm_up()
        start_line()
        # All of the share at once: the broker's and librdkafka's limit, not one batch in flight.
        return produce_all(publisher, records, max(1, len(records))), None
    confirmed = _LastConfirmed()
    if spec.trace_headers and spec.relay_spans and spec.kind == "ours":
        _record_spans()
    relay = build_relay(
        WorkerSpec(
            dsn,
            spec.strategy,
            {"bootstrap.servers": bootstrap},
            RelaySettings(batch_size=spec.batch_size, until_empty=True, listen=False),
            StrategyConfig(table=table, mode=spec.mode),  # type: ignore[arg-type]
            worker_id=f"bench-{index}",
        ),
        publisher=ConfirmingPublisher() if spec.kind == "read-only" else None,
        observer=confirmed,
    )
    relay.prepare()  # connected and the producer started before the clock starts
    start_line()
    published = relay.run().published
    return published, confirmed.at  # 0 when it confirmed nothing: it does not end the drain


def _record_spans() -> None:
    """An OpenTelemetry SDK in this worker that records every span and exports none: what tracing costs the relay."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Dropped(SpanExporter):
        def export(self, spans: object) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    trace.set_tracer_provider(provider)


def prepare(
    servers: Servers, spec: RunSpec, progress: Callable[[str], None] = print
) -> tuple[OutboxTable, list[str], float]:
    """A fresh schema and topics, loaded with ``spec.messages`` rows: (table, topics, load seconds)."""
    run_id = uuid.uuid4().hex[:8]
    table = table_for(f"bench_{run_id}", spec.strategy)
    topics = [f"bench-{run_id}-topic-{i + 1}" for i in range(spec.topics)]
    talk = spec.kind in TALK_TABLE_KINDS
    if talk and spec.partitions > 1 and spec.strategy in ("partitioned", "serialized"):
        raise SystemExit("outbox bench: the talk's table has one partition per topic (--partitions 1)")
    admin = AdminClient({"bootstrap.servers": servers.bootstrap})
    for future in admin.create_topics([NewTopic(t, spec.partitions, 1) for t in topics]).values():
        future.result()
    try:
        load_s = _load(servers, spec, table, topics, talk=talk)
    except BaseException:
        drop_table(servers, table)  # a wal outbox's slot too
        raise
    progress(f"  loaded {spec.messages:,} rows in {load_s:.1f} s ({spec.messages / load_s:,.0f} rows/s)")
    return table, topics, load_s


def _load(servers: Servers, spec: RunSpec, table: OutboxTable, topics: list[str], *, talk: bool) -> float:
    with psycopg.connect(servers.dsn, autocommit=True) as conn:
        if talk:
            create_talk_table(conn, table, spec.strategy)
        else:
            init_db(conn, table, strategies=[spec.strategy])  # as `init-db --strategy` makes it
            for topic in topics:
                set_topic_partitions(conn, table, topic, spec.partitions)
            # The wake-up trigger costs each committing transaction 0.7-2 ms (README, Performance): a third
            # to half of a 100-rows-per-transaction load. Nobody listens on this fresh schema yet, so the
            # load goes without it; the drain runs with it back on, as a service's table has it (a wal outbox
            # has it off: nobody listens to it).
            conn.execute(sql.SQL("ALTER TABLE {} DISABLE TRIGGER outbox_messages_notify").format(table.messages))
    load_s = load(
        servers.dsn,
        table,
        spec.messages,
        payload_bytes=spec.payload_bytes,
        binary=spec.binary and not talk,
        trace_headers=spec.trace_headers and not talk,
        topics=topics,
        keys=spec.keys,
        rows_per_transaction=spec.rows_per_transaction,
        route_in_db=talk,  # the seed's table has no routing: every row in partition 0 (one per topic)
    )
    with psycopg.connect(servers.dsn, autocommit=True) as conn:
        if talk:
            index_talk_table(conn, table, spec.strategy)
            if spec.strategy in ("partitioned", "serialized"):
                add_talk_offsets(conn, table, topics, spec.partitions)
        elif spec.strategy != WAL:
            conn.execute(sql.SQL("ALTER TABLE {} ENABLE TRIGGER outbox_messages_notify").format(table.messages))
            if spec.kind == "naive":
                prepare_naive_schema(conn, table, spec.strategy)
            # The seed's offsets table starts with a row per partition; ours discovers them, the naive
            # variants need them up front.
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (topic, partition) SELECT t, p FROM unnest(%s::text[]) t, generate_series(0, %s) p"
                ).format(table.offsets),
                (topics, spec.partitions - 1),
            )
    return load_s


def _write_ledger(servers: Servers, table: OutboxTable) -> Path:
    """The loaded message_ids, one per line: the ledger verify needs once delete mode removed the rows."""
    path = Path(tempfile.mkstemp(prefix=f"{table.schema}-", suffix=".ledger")[1])
    with psycopg.connect(servers.dsn) as conn, conn.cursor() as cur, path.open("wb") as out:
        with cur.copy(sql.SQL("COPY (SELECT message_id FROM {}) TO STDOUT").format(table.messages)) as copy:
            for chunk in copy:
                out.write(chunk)
    return path


def run_once(servers: Servers, spec: RunSpec, progress: Callable[[str], None] = print) -> RunResult:
    prepared = prepare(servers, spec, progress)
    try:
        result = _drain(servers, spec, prepared, progress)
    finally:
        drop_table(servers, prepared[0])  # a wal outbox's slot too
    progress("  " + format_result(result))
    return result


@dataclass(frozen=True)
class _Drained:
    """The workers' reports, when they were told to go, and what PostgreSQL and the broker spent meanwhile."""

    reports: list[_WorkerReport]
    started: float
    postgres_cpu_s: float | None
    broker_cpu_s: float | None


def _drain(
    servers: Servers, spec: RunSpec, prepared: tuple[OutboxTable, list[str], float], progress: Callable[[str], None]
) -> RunResult:
    table, topics, load_s = prepared
    # A wal outbox keeps no message_ids to write a ledger from: its messages are counted back from Kafka.
    ledger = _write_ledger(servers, table) if spec.verify and spec.kind == "ours" and spec.strategy != WAL else None
    drained = _run_workers(servers, spec, table)
    if spec.statements:
        progress(top_statements(servers.dsn))
    reports = drained.reports
    errors = [r.error for r in reports if r.error]
    published = sum(r.published for r in reports)
    return RunResult(
        spec=spec,
        published=published,
        drain_s=max(r.ended for r in reports) - drained.started,
        load_s=load_s,
        relay_cpu_s=sum(r.cpu_s for r in reports),
        postgres_cpu_s=drained.postgres_cpu_s,
        broker_cpu_s=drained.broker_cpu_s,
        peak_rss_mb=max(r.max_rss_mb for r in reports),
        verified=_verified(servers, spec, table, topics, ledger, published, progress),
        note="; ".join(e for e in errors if e) or ("" if published >= spec.messages else "INCOMPLETE"),
    )


def _run_workers(servers: Servers, spec: RunSpec, table: OutboxTable) -> _Drained:
    """``spec.workers`` processes, started together once all are set up; CPU read around the drain only."""
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Semaphore(0)
    go = ctx.Event()
    out: Queue[_WorkerReport] = ctx.Queue()
    processes = [
        ctx.Process(target=_worker, args=(spec, servers.dsn, table.schema, servers.bootstrap, i, ready, go, out))
        for i in range(spec.workers)
    ]
    for process in processes:
        process.start()
    # Interpreter start, imports and (ours) connections are not timed; the naive variants connect after the
    # signal, as the seed's code does.
    for _ in processes:
        ready.acquire()
    if spec.statements:
        reset_statements(servers.dsn)
    pg_before = tree_cpu_s(servers.postgres_pid) if servers.postgres_pid else None
    broker_before = process_cpu_s(servers.broker_pid) if servers.broker_pid else None
    started = time.time()
    go.set()
    reports = [out.get() for _ in processes]
    for process in processes:
        process.join()
    if servers.postgres_pid:
        wait_for_client_backends_to_end(servers.postgres_pid)
    pg_cpu = tree_cpu_s(servers.postgres_pid) - pg_before if servers.postgres_pid and pg_before is not None else None
    broker_cpu = (
        process_cpu_s(servers.broker_pid) - broker_before if servers.broker_pid and broker_before is not None else None
    )
    return _Drained(reports, started, pg_cpu, broker_cpu)


def _verified(
    servers: Servers,
    spec: RunSpec,
    table: OutboxTable,
    topics: list[str],
    ledger: Path | None,
    published: int,
    progress: Callable[[str], None],
) -> bool | None:
    """Whether every message arrived (None: not asked): by the ledger, by the count claimed, or counted back."""
    if ledger is not None:
        verified = _verify(servers, table, topics, ledger)
        ledger.unlink()
        return verified
    if spec.verify and spec.kind == "read-only":
        return published >= spec.messages  # nothing goes to Kafka: every row claimed and acked
    if not spec.verify:
        return None
    distinct, records = count_back(servers.bootstrap, topics, spec.messages)
    if distinct != spec.messages:
        progress(f"  counted back {distinct:,} of {spec.messages:,} messages ({records:,} records)")
    return distinct == spec.messages


def _verify(servers: Servers, table: OutboxTable, topics: list[str], ledger: Path) -> bool:
    """Every loaded message_id arrived, none that was not loaded (outbox verify)."""
    with psycopg.connect(servers.dsn, autocommit=True) as conn:
        report = verify(conn, table, {"bootstrap.servers": servers.bootstrap}, topics, ledger_file=ledger, idle_s=3.0)
    if not report.ok:
        print(report.render())
    return bool(report.ok)


def drop_table(servers: Servers, table: OutboxTable) -> None:
    drop_outbox(servers.dsn, table)


def format_result(r: RunResult) -> str:
    pg = f"{r.postgres_cpu_s:.1f}" if r.postgres_cpu_s is not None else "n/a"
    broker = f"{r.broker_cpu_s:.1f}" if r.broker_cpu_s is not None else "n/a"
    verified = "" if r.verified is None else (" verified" if r.verified else " VERIFY FAILED")
    return (
        f"{r.spec.label:<32} {r.published:>9,} msgs in {r.drain_s:7.2f} s = {r.msg_per_s:>9,.0f} msg/s | "
        f"cpu s relay {r.relay_cpu_s:.2f} pg {pg} broker {broker} | rss {r.peak_rss_mb:.0f} MB{verified}"
        + (f" | {r.note}" if r.note else "")
    )
