"""What the fault scenarios share: relay worker processes, writers that remember what they committed, reading
everything back from Kafka until idle, the lost/phantom/duplicate tally and the FAULT figures line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.lag import partition_lag

from ..kafka_helpers import Record

ROOT = Path(__file__).resolve().parents[2]
WORKER_SCRIPT = Path(__file__).with_name("worker.py")
STRATEGIES = ("locking", "advisory", "lease", "partitioned", "serialized")
POSITION_STRATEGIES = frozenset({"partitioned", "serialized"})
# Fails fast enough for tests: a frozen or unreachable broker reports every message failed within 1 s.
FAST_FAILING_PRODUCER: dict[str, object] = {
    "message.timeout.ms": 1000,
    "request.timeout.ms": 500,
    "retry.backoff.ms": 100,
    "reconnect.backoff.max.ms": 500,
}

# The relay pipelines: up to two batches are claimed and not yet acked (one confirmed by Kafka and being acked,
# the next already handed to the producer), so one fault (a kill, a lost connection, an expired lease) can make
# two batches go out again.
IN_FLIGHT_BATCHES = 2

FIGURES: list[str] = []


@dataclass(frozen=True)
class TimedRecord(Record):
    """A record with its Kafka timestamp (CreateTime: when the relay produced it), in ms since the epoch."""

    timestamp_ms: int = 0


def report(
    scenario: str, strategy: str, *, messages: int, lost: int, phantom: int, dupes: int, seconds: float, **extra: object
) -> str:
    """Print (and keep, for the session summary) one `FAULT ...` figures line."""
    line = (
        f"FAULT {scenario} {strategy}: messages={messages} lost={lost} phantom={phantom} dupes={dupes} "
        f"time={seconds:.1f}s"
    )
    if extra:
        line += " " + " ".join(f"{k}={v}" for k, v in extra.items())
    print(line, flush=True)
    FIGURES.append(line)
    return line


# -- what arrived versus what was committed -------------------------------------------------------


@dataclass(frozen=True)
class Tally:
    messages: int
    lost: set[str]
    phantom: set[str]
    dupes: int
    arrived: int

    @property
    def figures(self) -> dict[str, int]:
        return {"messages": self.messages, "lost": len(self.lost), "phantom": len(self.phantom), "dupes": self.dupes}


def tally(committed: Iterable[str], records: Sequence[Record]) -> Tally:
    """lost: committed, never arrived. phantom: arrived, never committed. dupes: arrivals beyond the first."""
    expected = set(committed)
    ids = [r.headers["message_id"].decode() for r in records]
    seen = set(ids)
    return Tally(len(expected), expected - seen, seen - expected, len(ids) - len(seen), len(ids))


def consume(
    bootstrap: str,
    topics: Iterable[str],
    expected: Iterable[str] = (),
    *,
    settle_s: float = 1.0,
    idle_s: float = 6.0,
    deadline_s: float = 90.0,
) -> list[TimedRecord]:
    """Every record of ``topics`` from the beginning, until idle (never trusting high watermarks).

    Once every ``expected`` message_id is in, ``settle_s`` without a new record ends it (late duplicates and
    phantoms are already in the log by then); before that, ``idle_s`` without one gives up.
    """
    wanted = set(expected)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"faults-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "isolation.level": "read_uncommitted",  # see everything that reached the log, phantoms included
        }
    )
    try:
        assignment = []
        for topic in topics:
            metadata = consumer.list_topics(topic, timeout=10)
            assignment += [
                TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(metadata.topics[topic].partitions)
            ]
        consumer.assign(assignment)
        records: list[TimedRecord] = []
        start = last = time.monotonic()
        while (now := time.monotonic()) - start < deadline_s:
            quiet = now - last
            if quiet >= idle_s or (not wanted and quiet >= settle_s):
                break
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() in (KafkaError._PARTITION_EOF, KafkaError.UNKNOWN_TOPIC_OR_PART):
                    continue
                raise RuntimeError(f"consume error: {msg.error()}")
            last = time.monotonic()
            headers = {k: v for k, v in (msg.headers() or [])}
            _, timestamp_ms = msg.timestamp()
            records.append(
                TimedRecord(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(), headers, timestamp_ms)
            )
            wanted.discard(headers["message_id"].decode())
        return records
    finally:
        consumer.close()


# -- the database side --------------------------------------------------------------------------


def unsent_ids(conn: psycopg.Connection, table: OutboxTable) -> set[str]:
    rows = conn.execute(
        sql.SQL("SELECT message_id::text FROM {} WHERE sent_at IS NULL").format(table.messages)
    ).fetchall()
    return {r[0] for r in rows}


def dead_letters(conn: psycopg.Connection, table: OutboxTable) -> dict[str, tuple[int, str]]:
    """message_id -> (attempts, last_error)."""
    rows = conn.execute(
        sql.SQL("SELECT message_id::text, attempts, last_error FROM {}").format(table.dead_letters)
    ).fetchall()
    return {r[0]: (r[1], r[2]) for r in rows}


def wait_until(what: str, condition: Callable[[], bool], deadline_s: float, interval_s: float = 0.05) -> float:
    """Poll ``condition`` until true; fail naming ``what`` after ``deadline_s``. Returns the time it took."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > deadline_s:
            raise AssertionError(f"timed out after {deadline_s:.0f}s waiting for {what}")
        time.sleep(interval_s)
    return time.monotonic() - start


# -- writers ------------------------------------------------------------------------------------


class Writer(threading.Thread):
    """Writes ``per_tx`` messages per transaction (keys round-robin) until ``total`` committed messages,
    ``transactions`` transactions or ``stop``, and keeps the message_ids of what it committed and of what it rolled
    back: every ``rollback_every``-th transaction rolls back, every ``savepoint_rollback_every``-th commits with one
    more message in a rolled-back savepoint."""

    def __init__(
        self,
        dsn: str,
        table: OutboxTable,
        topic: str,
        *,
        serialized: bool,
        name: str = "w",
        keys: int = 8,
        per_tx: int = 5,
        total: int | None = None,
        transactions: int | None = None,
        pause_s: float = 0.0,
        rollback_every: int = 0,
        savepoint_rollback_every: int = 0,
        stop: threading.Event | None = None,
    ) -> None:
        super().__init__(name=f"writer-{name}", daemon=True)
        self.dsn, self.table, self.topic, self.serialized = dsn, table, topic, serialized
        self.label, self.keys, self.per_tx, self.total, self.pause_s = name, keys, per_tx, total, pause_s
        self.transactions = transactions
        self.rollback_every = rollback_every
        self.savepoint_rollback_every = savepoint_rollback_every
        self.stop = stop or threading.Event()
        self.committed: list[str] = []
        self.rolled_back: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn) as conn:
                n = 0
                while (
                    not self.stop.is_set()
                    and (self.total is None or len(self.committed) < self.total)
                    and (self.transactions is None or n < self.transactions)
                ):
                    n += 1
                    count = self.per_tx if self.total is None else min(self.per_tx, self.total - len(self.committed))
                    rollback = self.rollback_every > 0 and n % self.rollback_every == 0
                    messages = [
                        Message(self.topic, {"w": self.label, "tx": n, "i": i}, key=f"k{(n + i) % self.keys}")
                        for i in range(count)
                    ]
                    with conn.transaction(force_rollback=rollback):
                        written = enqueue_many(conn, messages, serialized=self.serialized, table=self.table)
                        if self.savepoint_rollback_every and n % self.savepoint_rollback_every == 0:
                            # One more message in a savepoint that is rolled back; the transaction commits.
                            with conn.transaction(force_rollback=True):
                                undone = enqueue_many(
                                    conn,
                                    [Message(self.topic, {"w": self.label, "tx": n, "savepoint": True})],
                                    serialized=self.serialized,
                                    table=self.table,
                                )
                            self.rolled_back.append(str(undone[0].message_id))
                    (self.rolled_back if rollback else self.committed).extend(str(w.message_id) for w in written)
                    if self.pause_s:
                        self.stop.wait(self.pause_s)
        except BaseException as exc:  # reported by check()
            self.error = exc

    def check(self) -> None:
        if self.is_alive():
            raise AssertionError(f"writer {self.label} is still running")
        if self.error is not None:
            raise AssertionError(f"writer {self.label} failed: {self.error!r}") from self.error


def write(dsn: str, table: OutboxTable, topic: str, count: int, *, serialized: bool, keys: int = 8) -> list[str]:
    """``count`` messages in one transaction; their message_ids."""
    with psycopg.connect(dsn) as conn, conn.transaction():
        messages = [Message(topic, {"n": i}, key=f"k{i % keys}") for i in range(count)]
        return [str(w.message_id) for w in enqueue_many(conn, messages, serialized=serialized, table=table)]


# -- relay worker processes ---------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    t: float
    step: str
    numbers: tuple[int, ...]


@dataclass
class WorkerProcess:
    """One ``tests/faults/worker.py`` process; ``spec`` is its JSON configuration."""

    spec: dict[str, Any]
    directory: Path
    name: str
    proc: subprocess.Popen[bytes] | None = None
    runs: int = 0

    def start(self) -> WorkerProcess:
        """(Re)start the process with the same spec (same worker id), appending to the same event log."""
        assert self.proc is None or self.proc.poll() is not None, "still running"
        self.runs += 1
        self.spec = {
            **self.spec,
            "events": str(self.directory / f"{self.name}.events"),
            "stats": str(self.directory / f"{self.name}.{self.runs}.stats.json"),
        }
        log = open(self.directory / f"{self.name}.log", "ab")  # the child inherits it; ours is closed below
        try:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER_SCRIPT), json.dumps(self.spec)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                # the engine this test run imports, whichever checkout that is
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                },
            )
        finally:
            log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def events(self) -> list[Event]:
        path = self.directory / f"{self.name}.events"
        if not path.exists():
            return []
        events = []
        for line in path.read_text().splitlines():
            parts = line.split()
            try:
                events.append(Event(float(parts[0]), parts[1], tuple(int(p) for p in parts[2:])))
            except (IndexError, ValueError):
                continue  # a line cut short by SIGKILL
        return events

    def wait_for(self, what: str, condition: Callable[[list[Event]], bool], deadline_s: float = 30.0) -> float:
        def check() -> bool:
            if condition(self.events()):
                return True
            if not self.alive():
                raise AssertionError(f"worker {self.name} exited ({self.returncode}) before {what}\n{self.log()}")
            return False

        return wait_until(f"{self.name}: {what}", check, deadline_s, interval_s=0.02)

    def kill(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.wait(10)

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM: the relay finishes its batch and the worker writes its stats (once its handler is in place,
        which is before it logs `start`)."""
        self.request_stop()
        return self.wait(timeout_s)

    def request_stop(self) -> None:
        """SIGTERM without waiting for the exit, so that many workers stop at once (then ``wait``)."""
        if self.alive():
            self.wait_for("its start", lambda ev: sum(1 for e in ev if e.step == "start") >= self.runs)
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, signal.SIGTERM)

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker {self.name} did not exit within {timeout_s:.0f}s\n{self.log()}") from None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stats(self) -> dict[str, Any]:
        """The last run's RelayStats (written when it ended normally)."""
        return json.loads(Path(self.spec["stats"]).read_text())  # type: ignore[no-any-return]

    def total_stats(self) -> Counter[str]:
        """The counters summed over every run that ended normally."""
        total: Counter[str] = Counter()
        for run in range(1, self.runs + 1):
            path = self.directory / f"{self.name}.{run}.stats.json"
            if path.exists():
                total.update({k: v for k, v in json.loads(path.read_text()).items() if isinstance(v, int)})
        return total

    def log(self, chars: int = 3000) -> str:
        path = self.directory / f"{self.name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def steps_between(events: Sequence[Event], start: float, end: float) -> Counter[str]:
    """How many times each step happened in [start, end]; `batch` counts claims that returned records."""
    counts: Counter[str] = Counter()
    for e in events:
        if start <= e.t <= end:
            counts[e.step] += 1
            if e.step == "claim" and e.numbers and e.numbers[0] > 0:
                counts["batch"] += 1
    return counts


def pending(dsn: str, table: OutboxTable, strategy: str) -> int:
    """Rows the strategy still has to publish (PostgreSQL's view, as `outbox lag` shows it)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return sum(p.pending for p in partition_lag(conn, table, strategy))
