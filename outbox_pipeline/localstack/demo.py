"""Demo traffic for the local stack (a small service's transactions, rollbacks and long transactions) and bulk loads for
benchmarks. See docs/dagster.md#the-local-stack-outbox-dev."""

from __future__ import annotations

import logging
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..config import OutboxTable
from ..partitioning import partition_for
from ..store.enqueue import Message, enqueue_many
from ..store.migrations import DEFAULT_TOPIC_ROW

log = logging.getLogger(__name__)

DEMO_TOPICS = ("orders", "payments", "shipments")


@dataclass(frozen=True)
class TrafficSpec:
    rate: float = 20.0  # messages per second
    topics: Sequence[str] = DEMO_TOPICS
    keys: int = 50
    rollback_every: int = 25  # every Nth transaction rolls back
    long_tx_every_s: float = 30.0  # a long transaction starts this often (0 = never)
    long_tx_hold_s: float = 8.0


@dataclass
class TrafficStats:
    committed: int = 0
    rolled_back: int = 0
    long_transactions: int = 0


def run_traffic(dsn: str, table: OutboxTable, spec: TrafficSpec, stop: threading.Event) -> TrafficStats:
    """Write demo traffic until ``stop`` is set; returns what was committed and rolled back."""
    stats = TrafficStats()
    rng = random.Random()
    interval = 1.0 / spec.rate if spec.rate > 0 else 1.0
    next_long = time.monotonic() + spec.long_tx_every_s if spec.long_tx_every_s > 0 else float("inf")
    holders: list[threading.Thread] = []
    seq = 0
    with psycopg.connect(dsn) as conn:
        next_at = time.monotonic()
        while not stop.is_set():
            seq += 1
            batch = [_demo_message(rng, spec, seq, i) for i in range(rng.randint(1, 3))]
            rollback = spec.rollback_every > 0 and seq % spec.rollback_every == 0
            with conn.transaction(force_rollback=rollback):
                enqueue_many(conn, batch, table=table)
            if rollback:
                stats.rolled_back += len(batch)
            else:
                stats.committed += len(batch)
            if time.monotonic() >= next_long:
                next_long = time.monotonic() + spec.long_tx_every_s
                holder = threading.Thread(
                    target=_long_transaction, args=(dsn, table, spec, rng.randrange(1 << 30), stop), daemon=True
                )
                holder.start()
                holders.append(holder)
                stats.long_transactions += 1
            next_at += interval * len(batch)
            # Pace by the clock, not by fixed sleeps: a slow transaction is caught up, not compounded.
            stop.wait(max(0.0, next_at - time.monotonic()))
    for holder in holders:
        holder.join()
    return stats


def _demo_message(rng: random.Random, spec: TrafficSpec, seq: int, i: int) -> Message:
    topic = rng.choice(list(spec.topics))
    key = f"customer-{rng.randrange(spec.keys)}"
    return Message(
        topic=topic,
        key=key,
        type=f"{topic}.updated",
        payload={"seq": seq, "n": i, "customer": key, "amount": round(rng.uniform(1, 500), 2)},
        headers={"source": "demo-traffic"},
    )


def _long_transaction(dsn: str, table: OutboxTable, spec: TrafficSpec, seed: int, stop: threading.Event) -> None:
    rng = random.Random(seed)
    with psycopg.connect(dsn) as conn, conn.transaction():
        enqueue_many(conn, [_demo_message(rng, spec, -1, i) for i in range(3)], table=table)
        log.info("long transaction holding its rows for %.0f s", spec.long_tx_hold_s)
        stop.wait(spec.long_tx_hold_s)


def load(
    dsn: str,
    table: OutboxTable,
    count: int,
    *,
    payload_bytes: int = 256,
    binary: bool = False,
    trace_headers: bool = False,
    topics: Sequence[str] = ("topic-1", "topic-2"),
    keys: int = 1000,
    chunk: int = 20_000,
    rows_per_transaction: int | None = None,
    route_in_db: bool = False,
    progress: Callable[[int, float], None] | None = None,
) -> float:
    """COPY ``count`` messages of about ``payload_bytes`` each; returns the elapsed seconds.

    Rows are spread round-robin over ``topics`` (the seed's layout: two topics), keys ``key-0..keys-1``,
        each in its topic's virtual partition as enqueue would route it. ``rows_per_transaction`` commits
        every that many rows, like services writing small transactions: one million rows under one
        transaction id is a shape no real outbox has, and it turns seed variant 3's condition (a range on
        ``transaction_id`` alone) into a scan of every row already read. ``route_in_db``: COPY without the
        partition column, as a writer in another language would, so the insert trigger routes every row. ``binary``: the
        same payloads as bytes (``payload_bytes``), to compare the two kinds at one size; ``trace_headers``: each
    transaction's rows carry one W3C ``traceparent`` header, as a traced service's enqueue stores it.
    """
    started = time.monotonic()
    per_tx = rows_per_transaction or count
    # Autocommit: each `conn.transaction()` below is a real transaction, not a savepoint.
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Many small commits: waiting for each one's WAL flush would time the disk, not the load.
        conn.execute("SET synchronous_commit = off")
        # Without the partition column the table routes (our trigger) or has none to route (the seed's table).
        counts = {} if route_in_db else _partition_counts(conn, table, topics)
        routes = [
            (topic, f"key-{k}", partition_for(f"key-{k}", counts[topic]) if counts else 0)
            for topic in topics
            for k in range(keys)
        ]
        # Precomputed line prefixes: the hot loop only formats the sequence number and padding.
        lines = _Lines(
            prefixes=[f"{t}\t{k}\tdemo.loaded\t".encode() for t, k, _ in routes],
            suffixes=[(b"\t{}\n" if route_in_db else f"\t{{}}\t{p}\n".encode()) for _, _, p in routes],
            topics=len(topics),
            keys=keys,
            payload_bytes=payload_bytes,
            binary=binary,
            trace_headers=trace_headers,
        )
        payload_column = "payload_bytes" if binary else "payload"
        columns = sql.SQL(f"topic, key, type, {payload_column}, headers" + ("" if route_in_db else ", partition"))
        copy_sql = sql.SQL("COPY {} ({}) FROM STDIN").format(table.messages, columns)
        for first in range(0, count, per_tx):
            _copy_transaction(conn, copy_sql, lines, range(first, min(first + per_tx, count)), chunk, progress, started)
    elapsed = time.monotonic() - started
    if progress:
        progress(count, elapsed)
    return elapsed


@dataclass(frozen=True)
class _Lines:
    """How a loaded row's COPY line is made: per route (topic x key, topic first) its fixed prefix and suffix (the
    suffix's ``{}`` is where the headers go), and the payload's size and kind."""

    prefixes: list[bytes]
    suffixes: list[bytes]
    topics: int
    keys: int
    payload_bytes: int
    binary: bool
    trace_headers: bool


def _copy_transaction(
    conn: psycopg.Connection,
    copy_sql: sql.Composed,
    lines: _Lines,
    rows: range,
    chunk: int,
    progress: Callable[[int, float], None] | None,
    started: float,
) -> None:
    """One transaction's rows, written to COPY every ``chunk`` lines; its rows share one traceparent (if any)."""
    prefixes, suffixes, topics, keys = lines.prefixes, lines.suffixes, lines.topics, lines.keys
    payload_bytes, binary, trace_headers = lines.payload_bytes, lines.binary, lines.trace_headers
    skeleton = len('{"seq":,"pad":""}')
    with conn.transaction(), conn.cursor() as cur, cur.copy(copy_sql) as copy:
        buf = bytearray()
        ids = os.urandom(24).hex().encode()
        trace = b'{"traceparent": "00-%s-%s-01"}' % (ids[:32], ids[32:])
        for i in rows:
            route = (i % topics) * keys + (i // topics) % keys
            seq = str(i)
            pad = "x" * max(0, payload_bytes - skeleton - len(seq))
            buf += prefixes[route]
            payload = f'{{"seq":{seq},"pad":"{pad}"}}'.encode()
            buf += b"\\\\x" + payload.hex().encode() if binary else payload  # COPY text: bytea as \\x<hex>
            buf += suffixes[route].replace(b"{}", trace, 1) if trace_headers else suffixes[route]
            if (i + 1) % chunk == 0:
                copy.write(bytes(buf))
                buf.clear()
                if progress:
                    progress(i + 1, time.monotonic() - started)
        if buf:
            copy.write(bytes(buf))


def _partition_counts(conn: psycopg.Connection, table: OutboxTable, topics: Sequence[str]) -> dict[str, int]:
    rows = conn.execute(
        sql.SQL("SELECT topic, partitions FROM {} WHERE topic = ANY(%s)").format(table.topics),
        (list(topics) + [DEFAULT_TOPIC_ROW],),
    ).fetchall()
    known: dict[str, int] = {str(topic): int(count) for topic, count in rows}
    return {topic: known.get(topic, known[DEFAULT_TOPIC_ROW]) for topic in topics}


def print_progress(done: int, elapsed: float) -> None:
    rate = done / elapsed if elapsed > 0 else 0.0
    sys.stderr.write(f"\rloaded {done:,} messages  {rate:,.0f} msg/s   ")
    sys.stderr.flush()
