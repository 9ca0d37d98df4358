"""A latency bench's writer process: commits on a fixed schedule and stamps each message right after its COMMIT. See
docs/performance.md#how-the-latency-bench-measures."""

from __future__ import annotations

import contextlib
import heapq
import json
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass

import psycopg

from ...config import OutboxTable, pg_dsn_from_env
from ...store.enqueue import Message, enqueue_many


@dataclass(frozen=True)
class Stream:
    """One key class's transactions: ``rate`` msg/s in transactions of ``rows``, to one topic.

    ``keys`` names are ``key`` (one key) or ``key0 .. key{keys-1}`` in turn; ``partition`` None lets the outbox
    hash the key, a number routes every message of the stream there (so the hot-key scenario's routing is certain).
    ``phase`` (a fraction of one interval) staggers streams of the same rate so they do not commit together.
    """

    key_class: str
    topic: str
    key: str
    rate: float
    rows: int
    keys: int = 1
    partition: int | None = None
    phase: float = 0.0

    @property
    def interval_s(self) -> float:
        return self.rows / self.rate

    def key_of(self, n: int) -> str:
        return self.key if self.keys == 1 else f"{self.key}{n % self.keys}"


@dataclass(frozen=True)
class WriterPlan:
    """A writer process's share: transactions ``index``, ``index + of``, ... of each stream's schedule."""

    schema: str
    streams: tuple[Stream, ...]
    seconds: float
    warmup_s: float
    out: str
    index: int = 0
    of: int = 1
    # Strategy `serialized` requires its writers to take the outbox's write lock (serialized.py): without it,
    # concurrent writer processes commit ids out of order and the relay passes rows it has not read.
    serialized: bool = False
    traced: bool = False  # each transaction in a span (an OpenTelemetry SDK here): its rows carry a traceparent
    write_to: str = "table"  # "wal": enqueue_many emits (a wal outbox: OutboxTable.write_to)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> WriterPlan:
        raw = json.loads(text)
        raw["streams"] = tuple(Stream(**s) for s in raw["streams"])
        return WriterPlan(**raw)


@dataclass(frozen=True)
class WriterHeader:
    """How the writer kept its schedule; ``cpu_s`` over ``cpu_window_s`` is its CPU after the warm-up."""

    transactions: int
    scheduled: int
    messages: int
    late_p99_ms: float
    late_max_ms: float
    cpu_s: float
    cpu_window_s: float


def run(plan: WriterPlan, dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        print("ready", flush=True)
        command = sys.stdin.readline().split()
        if command[:1] != ["go"]:
            raise SystemExit(f"traffic: expected 'go <epoch>', got {command!r}")
        header, committed = _schedule(conn, plan, float(command[1]))
        with open(plan.out, "w") as out:
            out.write(json.dumps(asdict(header)) + "\n")
            out.writelines(f"{mid}\t{stamp!r}\t{key_class}\n" for mid, stamp, key_class in committed)
        # The session stays until the bench says so: a backend ending while the bench reads PostgreSQL's CPU could
        # be reaped between the postmaster's reading and its own, and counted nowhere.
        print("done", flush=True)
        sys.stdin.readline()


def _transaction_spans() -> Callable[[], AbstractContextManager[object]]:
    """A span per transaction from an SDK that samples everything and exports nothing: valid trace contexts for enqueue
    to store, at an SDK's cost in the writer."""
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("outbox_pipeline.bench.latency.traffic")
    return lambda: tracer.start_as_current_span("transaction")


def _schedule(
    conn: psycopg.Connection, plan: WriterPlan, t0: float
) -> tuple[WriterHeader, list[tuple[str, float, str]]]:
    table = OutboxTable(schema=plan.schema, write_to=plan.write_to)
    end = t0 + plan.seconds
    due: list[tuple[float, int, int]] = []  # (due time, stream, transaction number)
    scheduled = 0
    for s, stream in enumerate(plan.streams):
        first = t0 + (stream.phase + plan.index) * stream.interval_s
        scheduled += max(0, int((end - first) / (stream.interval_s * plan.of) + 0.999999))
        heapq.heappush(due, (first, s, plan.index))
    committed: list[tuple[str, float, str]] = []
    late: list[float] = []
    span = _transaction_spans() if plan.traced else contextlib.nullcontext
    cpu_from: tuple[float, float] | None = None
    while due:
        at, s, n = heapq.heappop(due)
        if at >= end or time.time() >= end:
            continue  # past the schedule's end: what is left is reported as not done
        stream = plan.streams[s]
        heapq.heappush(due, (t0 + (stream.phase + n + plan.of) * stream.interval_s, s, n + plan.of))
        pause = at - time.time()
        if pause > 0:
            time.sleep(pause)  # pacing the load generator
        if cpu_from is None and at >= t0 + plan.warmup_s:
            cpu_from = (time.process_time(), time.time())
        late.append(max(0.0, time.time() - at))
        batch = [
            Message(stream.topic, {"n": n, "i": i}, key=stream.key_of(n * stream.rows + i), partition=stream.partition)
            for i in range(stream.rows)
        ]
        with span():
            written = enqueue_many(conn, batch, serialized=plan.serialized, table=table)
        conn.commit()
        stamp = time.time()
        committed.extend((str(w.message_id), stamp, stream.key_class) for w in written)
    cpu_to = (time.process_time(), time.time())
    late.sort()
    header = WriterHeader(
        transactions=len(late),
        scheduled=scheduled,
        messages=len(committed),
        late_p99_ms=1000 * late[round(0.99 * (len(late) - 1))] if late else 0.0,
        late_max_ms=1000 * late[-1] if late else 0.0,
        cpu_s=cpu_to[0] - cpu_from[0] if cpu_from else 0.0,
        cpu_window_s=cpu_to[1] - cpu_from[1] if cpu_from else 0.0,
    )
    return header, committed


def read_output(path: str) -> tuple[WriterHeader, list[tuple[str, float, str]]]:
    """A writer's file: its header and (message_id, commit time, key class) per message."""
    with open(path) as lines:
        header = WriterHeader(**json.loads(next(lines)))
        rows = [(mid, float(stamp), key_class) for mid, stamp, key_class in (line.split("\t") for line in lines)]
    return header, [(mid, stamp, key_class.rstrip("\n")) for mid, stamp, key_class in rows]


if __name__ == "__main__":
    run(WriterPlan.from_json(sys.argv[1]), pg_dsn_from_env())
