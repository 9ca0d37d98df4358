"""The latency bench's scenarios (curve, hot-key, held-open) as traffic, and the values one measured run yields. See
docs/performance.md#how-the-latency-bench-measures."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ...partitioning import partition_for
from .gauges import SESSIONS, Statements
from .traffic import Stream, WriterPlan

WARMUP_S = 2.0  # connections, the producer's first metadata, plans: not steady state
WRITER_TX_PER_S = 200  # transactions a second one writer process is given, so it keeps its schedule
WRITER_MSG_PER_S = 3_000  # and messages a second (one process fell behind at 10,000 msg/s in 100-row transactions)
CURVE_PARTITIONS = 8
CURVE_KEYS = 1000
QUIET_RATE = 10.0
HOT_ROWS = 10


def key_for(partition: int, partitions: int, prefix: str) -> str:
    """A key Kafka's partitioner sends to ``partition``, so the outbox partition and the Kafka one agree."""
    return next(k for i in range(10_000) if partition_for(k := f"{prefix}-{i}", partitions) == partition)


@dataclass(frozen=True)
class Scenario:
    kind: str  # "curve", "hot-key" or "held-open"
    rate: float  # curve, held-open: all of it; hot-key: the hot key's
    rows: int = HOT_ROWS
    quiet_keys: int = 7
    hold_open_s: float = 0.0  # held-open: how long the transaction stays open

    @property
    def name(self) -> str:
        if self.kind == "curve":
            return f"{self.rate:,.0f} msg/s x {self.rows}"
        if self.kind == "held-open":
            return f"{self.rate:,.0f} msg/s x {self.rows}, a transaction open {self.hold_open_s:,.0f} s"
        return f"hot key {self.rate:,.0f} msg/s"

    @property
    def partitions(self) -> int:
        return self.quiet_keys + 1 if self.kind == "hot-key" else CURVE_PARTITIONS

    def streams(self, topic: str) -> list[Stream]:
        if self.kind != "hot-key":
            return [Stream("all", topic, "k", self.rate, self.rows, keys=CURVE_KEYS)]
        n = self.partitions
        streams = [
            Stream("quiet", topic, key_for(p, n, "quiet"), QUIET_RATE, 1, partition=p, phase=p / self.quiet_keys)
            for p in range(self.quiet_keys)
        ]
        if self.rate > 0:
            streams.append(Stream("hot", topic, key_for(n - 1, n, "hot"), self.rate, HOT_ROWS, partition=n - 1))
        return streams


def writer_plans(
    streams: Sequence[Stream],
    schema: str,
    seconds: float,
    scratch: Path,
    *,
    serialized: bool = False,
    traced: bool = False,
    write_to: str = "table",
) -> list[WriterPlan]:
    """Per key class, as many writer processes as its transactions and messages a second need (each takes every
    n-th transaction); ``serialized``: they write as strategy `serialized` requires; ``traced``: each transaction in a
    span, so its rows carry a traceparent; ``write_to``: "wal" for a wal outbox."""
    plans = []
    for key_class in dict.fromkeys(s.key_class for s in streams):
        mine = tuple(s for s in streams if s.key_class == key_class)
        n = max(
            1,
            math.ceil(sum(s.rate / s.rows for s in mine) / WRITER_TX_PER_S),
            math.ceil(sum(s.rate for s in mine) / WRITER_MSG_PER_S),
        )
        plans += [
            WriterPlan(
                schema,
                mine,
                seconds,
                WARMUP_S,
                str(scratch / f"writer-{key_class}-{i}.tsv"),
                i,
                n,
                serialized,
                traced,
                write_to,
            )
            for i in range(n)
        ]
    return plans


@dataclass(frozen=True)
class ClassLatency:
    """One key class: commit -> observer ``poll()`` percentiles (ms) after the warm-up, and the counts.

    ``committed``/``arrived`` count the messages after the warm-up; ``missing`` counts every committed message
    (warm-up too) that never arrived. Without an observer, percentiles, ``arrived`` and ``missing`` are None (the
    scenario's ``missing`` then comes from the relay's published counter).
    """

    key_class: str
    target_rate: float
    achieved_rate: float
    committed: int
    arrived: int | None
    missing: int | None
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None


def class_latency(
    key_class: str,
    target_rate: float,
    seconds: float,
    steady_from: float,
    committed: Sequence[tuple[str, float, str]],
    arrivals: dict[str, float] | None,
) -> ClassLatency:
    mine = [(mid, at) for mid, at, c in committed if c == key_class]
    steady = [(mid, at) for mid, at in mine if at >= steady_from]
    achieved = len(mine) / seconds
    if arrivals is None:
        return ClassLatency(key_class, target_rate, achieved, len(steady), None, None)
    latencies = sorted(1000 * (arrivals[mid] - at) for mid, at in steady if mid in arrivals)
    lost = sum(1 for mid, _ in mine if mid not in arrivals)
    if not latencies:
        return ClassLatency(key_class, target_rate, achieved, len(steady), 0, lost)
    return ClassLatency(
        key_class,
        target_rate,
        achieved,
        len(steady),
        len(latencies),
        lost,
        p50_ms=percentile(latencies, 0.5),
        p95_ms=percentile(latencies, 0.95),
        p99_ms=percentile(latencies, 0.99),
        max_ms=latencies[-1],
    )


def percentile(ordered: Sequence[float], q: float) -> float:
    return ordered[round(q * (len(ordered) - 1))]


@dataclass(frozen=True)
class ScenarioResult:
    """One scenario on one relay in one round; cores and statements over the window after the warm-up."""

    round: int
    strategy: str
    relay: str
    scenario: str
    kind: str
    rate: float
    rows: int
    seconds: float
    classes: list[ClassLatency]
    missing: int  # of everything committed (warm-up too), by the observer or else the relay's counter
    cores: dict[str, float]  # per process group, average over the window
    machine_cores: float
    relay_cores: float  # the relay's processes (not its PostgreSQL sessions, a group of their own)
    window_messages: int  # published by the relay in the window (its counter), else committed in it
    relay_us_per_message: float | None
    batches_per_s: float | None  # the relay's published batches (its /metrics), not produce requests
    statements: Statements
    statements_per_1000: float | None
    writers_late_p99_ms: float  # how late transactions started against the schedule
    writers_late_max_ms: float
    writers: int  # processes
    writers_transactions: int  # done, of
    writers_scheduled: int  # the schedule's (fewer done: the writers fell behind; see the achieved rates)
    observer_fetches_per_s: float | None = None
    probe_ms: dict[str, float] = field(default_factory=dict)  # ack -> observer poll: p50, p99, max
    duplicates: int = 0
    runs_launched: int | None = None
    runs_queued: int | None = None
    hold_open_s: float = 0.0  # held-open: how long a transaction stayed open from the warm-up's end

    @property
    def complete(self) -> bool:
        return self.missing == 0

    @property
    def other_cores(self) -> float:
        """The machine's CPU outside every group measured: other work on a shared machine skews this run."""
        return self.machine_cores - sum(v for k, v in self.cores.items() if k != SESSIONS)


@dataclass(frozen=True)
class IdleResult:
    """The relay with no traffic for ``seconds``: per group cores without the observer, then with it polling."""

    round: int
    strategy: str
    relay: str
    seconds: float
    relay_cores: float
    cores: dict[str, float]
    machine_cores: float
    statements_per_s: float | None
    statements: Statements
    cores_observed: dict[str, float]
    observer_fetches_per_s: float | None
