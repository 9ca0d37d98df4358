"""Engine room (benchmarks): commit -> Kafka latency under steady load (`outbox bench --latency RATE`).

Throughput numbers hide what a consumer waits for. A writer commits ``rate`` messages a second in
small transactions and notes each commit's time; the relay under test (`outbox relay` in its own
processes, NOTIFY wake-ups, as deployed; or `dagster dev` driving it, bench/orchestrated.py) publishes
them; a consumer notes when each arrives. Arrival is measured at a consumer fetching with a 5 ms wait,
so the figure is an upper bound of commit -> broker. CPU is read from /proc over the write window: the
whole machine, and per process group.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Set
from dataclasses import dataclass, field
from typing import Protocol

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from psycopg import sql

from .. import settings
from ..config import OutboxTable
from ..enqueue import Message, enqueue_many
from ..liveness import live_workers
from ..schema import init_db, set_topic_partitions
from .procstat import busy_cores, machine_busy, process_cpu_s, tree_cpu_s
from .runner import Servers

WARMUP_S = 2.0  # connections, first produce, metadata: not steady state


class RelayUnderTest(Protocol):
    """What publishes the benchmark's rows: started before the writes, stopped after them."""

    name: str

    def start(self, servers: Servers, table: OutboxTable) -> None:
        """Returns once the relay is ready to publish (warm-up is not measured)."""

    def stop(self) -> None: ...

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds so far of this relay's processes, per group (cumulative, for deltas)."""

    def runs(self) -> tuple[int, int] | None:
        """(runs launched, runs queued now) for an orchestrated relay; None otherwise."""


class CliRelay:
    """`outbox relay` as deployed: its own processes, LISTEN/NOTIFY, default batch size."""

    name = "cli"

    def __init__(self, strategy: str, workers: int, max_seconds: float) -> None:
        self.strategy, self.workers, self.max_seconds = strategy, workers, max_seconds
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, servers: Servers, table: OutboxTable) -> None:
        self._process = _start_relay(servers, table, self.strategy, self.workers, self.max_seconds)
        wait_until_registered(servers.dsn, table, 60.0, self._process)

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=30)

    def cpu_s(self) -> dict[str, float]:
        return {"relay (outbox relay)": tree_cpu_s(self._process.pid) if self._process else 0.0}

    def runs(self) -> tuple[int, int] | None:
        return None


@dataclass(frozen=True)
class LatencyReport:
    rate: float
    seconds: float
    strategy: str
    workers: int
    committed: int
    arrived: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    relay: str = "cli"
    machine_cores: float = 0.0  # the whole machine, /proc/stat, over the write window
    cores: dict[str, float] = field(default_factory=dict)  # per process group, same window
    runs_launched: int | None = None
    runs_queued: int | None = None

    def render(self) -> str:
        groups = ", ".join(f"{name} {c:.3f}" for name, c in self.cores.items())
        runs = "" if self.runs_launched is None else f"; runs launched {self.runs_launched}, queued {self.runs_queued}"
        return (
            f"{self.relay}: commit -> consumer at {self.rate:,.0f} msg/s for {self.seconds:.0f} s, strategy "
            f"{self.strategy}, NOTIFY wake-ups: p50 {self.p50_ms:.1f} ms, p95 {self.p95_ms:.1f} ms, "
            f"p99 {self.p99_ms:.1f} ms, max {self.max_ms:.1f} ms ({self.arrived:,}/{self.committed:,} arrived; "
            f"first {WARMUP_S:.0f} s excluded); machine {self.machine_cores:.3f} cores ({groups}){runs}"
        )


def measure(
    servers: Servers,
    *,
    strategy: str = "partitioned",
    workers: int = 1,
    rate: float = 1000.0,
    seconds: float = 20.0,
    per_transaction: int = 10,
    progress: Callable[[str], None] = print,
    relay: RelayUnderTest | None = None,
) -> LatencyReport:
    table = OutboxTable(schema=f"bench_latency_{uuid.uuid4().hex[:8]}")
    topics = [f"{table.schema.replace('_', '-')}-{i}" for i in (1, 2)]
    admin = AdminClient({"bootstrap.servers": servers.bootstrap})
    for future in admin.create_topics([NewTopic(t, 1, 1) for t in topics]).values():
        future.result()
    with psycopg.connect(servers.dsn, autocommit=True) as conn:
        init_db(conn, table)
        for topic in topics:
            set_topic_partitions(conn, table, topic, 1)
    committed: dict[str, float] = {}
    arrived = _Arrivals()
    stop_consuming = threading.Event()
    consumer = threading.Thread(target=_consume, args=(servers.bootstrap, topics, arrived, stop_consuming))
    consumer.start()
    relay = relay or CliRelay(strategy, workers, seconds + 30)
    try:
        relay.start(servers, table)
        progress(f"  {relay.name}: writing {rate:,.0f} msg/s for {seconds:.0f} s ({per_transaction} per transaction)")
        machine_before, before = machine_busy(), _cpu_s(servers, relay)
        window = time.monotonic()
        _write(servers.dsn, table, topics, rate, seconds, per_transaction, committed)
        arrived.wait_for(committed.keys(), timeout_s=20)
        window = time.monotonic() - window
        machine_cores = busy_cores(machine_before, machine_busy())
        after = _cpu_s(servers, relay)
        runs = relay.runs()
    finally:
        relay.stop()
        stop_consuming.set()
        consumer.join()
        with psycopg.connect(servers.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(table.schema_ident))
    start = min(committed.values()) + WARMUP_S
    times = arrived.snapshot()
    latencies = sorted((times[m] - at) * 1000 for m, at in committed.items() if at >= start and m in times)
    steady = [m for m, at in committed.items() if at >= start]
    if not latencies:
        raise RuntimeError("no message arrived: is the relay running? (see its output above)")
    return LatencyReport(
        rate=rate,
        seconds=seconds,
        strategy=strategy,
        workers=workers,
        committed=len(steady),
        arrived=len(latencies),
        p50_ms=statistics.median(latencies),
        p95_ms=latencies[round(0.95 * (len(latencies) - 1))],
        p99_ms=latencies[round(0.99 * (len(latencies) - 1))],
        max_ms=latencies[-1],
        relay=relay.name,
        machine_cores=machine_cores,
        cores={name: (after[name] - before.get(name, 0.0)) / window for name in after},
        runs_launched=runs[0] if runs else None,
        runs_queued=runs[1] if runs else None,
    )


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


def _cpu_s(servers: Servers, relay: RelayUnderTest) -> dict[str, float]:
    groups = {"bench writer+consumer": process_cpu_s(os.getpid())}
    if servers.postgres_pid:
        groups["postgresql"] = tree_cpu_s(servers.postgres_pid)
    if servers.broker_pid:
        groups["broker"] = process_cpu_s(servers.broker_pid)
    return {**groups, **relay.cpu_s()}


def _start_relay(
    servers: Servers, table: OutboxTable, strategy: str, workers: int, max_seconds: float
) -> subprocess.Popen[bytes]:
    """`outbox relay` as deployed: its own processes, LISTEN/NOTIFY, default batch size."""
    env = {**os.environ, settings.PG_DSN.name: servers.dsn, "KAFKA_BOOTSTRAP_SERVERS": servers.bootstrap}
    command = [sys.executable, "-m", "outbox_pipeline.cli", "relay", "--schema", table.schema]
    command += ["--strategy", strategy, "--workers", str(workers), "--max-seconds", str(max_seconds)]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)


def _write(
    dsn: str,
    table: OutboxTable,
    topics: list[str],
    rate: float,
    seconds: float,
    per_transaction: int,
    committed: dict[str, float],
) -> None:
    """Steady writes on a fixed schedule; a late transaction does not shift the ones after it."""
    interval = per_transaction / rate
    with psycopg.connect(dsn) as conn:
        started = time.monotonic()
        n = 0
        while (due := started + n * interval) < started + seconds:
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)  # pacing the load generator
            batch = [
                Message(topics[(n * per_transaction + i) % len(topics)], {"n": n}, key=f"k{i}")
                for i in range(per_transaction)
            ]
            written = enqueue_many(conn, batch, table=table)
            conn.commit()
            at = time.time()
            for w in written:
                committed[str(w.message_id)] = at
            n += 1


class _Arrivals:
    """First arrival time per message_id, written by the consumer thread, awaited by the writer's."""

    def __init__(self) -> None:
        self._times: dict[str, float] = {}
        self._changed = threading.Condition()

    def add(self, message_id: str, at: float) -> None:
        with self._changed:
            self._times.setdefault(message_id, at)
            self._changed.notify_all()

    def wait_for(self, message_ids: Set[str], timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._times.keys() >= message_ids, timeout=timeout_s)

    def snapshot(self) -> dict[str, float]:
        with self._changed:
            return dict(self._times)


def _consume(bootstrap: str, topics: list[str], arrived: _Arrivals, stop: threading.Event) -> None:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-latency-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 5,
            "fetch.min.bytes": 1,
        }
    )
    try:
        consumer.assign([TopicPartition(t, 0, OFFSET_BEGINNING) for t in topics])
        while not stop.is_set():
            for msg in consumer.consume(num_messages=1000, timeout=0.05):
                at = time.time()
                error = msg.error()
                if error is not None:
                    if error.code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(f"consumer: {error}")
                    continue
                message_id = dict(msg.headers() or []).get("message_id")
                if isinstance(message_id, bytes):
                    arrived.add(message_id.decode(), at)
    finally:
        consumer.close()
