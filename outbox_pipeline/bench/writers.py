"""Engine room (benchmarks): what routing in the database costs writers (`outbox bench --writers`).

Single-row transactions, one session, interleaved per run: the baseline is a plain INSERT that names its
partition (what a user writes by hand; the routing trigger does not fire), against the Python ``enqueue``
(routes in Python, no trigger), a plain INSERT without a partition (the trigger routes it) and the SQL
``<schema>.enqueue(...)``. Then bulk: ``outbox load`` (COPY) with the partition computed in Python against
COPY without the partition column (the trigger on every row). Medians of ``runs``.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..config import OutboxTable
from ..demo import load
from ..enqueue import enqueue
from ..partitioning import partition_for
from ..schema import init_db, set_topic_partitions
from .runner import Servers

TOPIC = "writers"
PARTITIONS = 12
KEYS = 1000

Writer = Callable[[psycopg.Connection, OutboxTable, int], None]


def _insert_with_partition(conn: psycopg.Connection, table: OutboxTable, i: int) -> None:
    key = f"key-{i % KEYS}"
    conn.execute(
        sql.SQL("INSERT INTO {} (topic, key, payload, partition) VALUES (%s, %s, %s, %s)").format(table.messages),
        (TOPIC, key, '{"n": 1}', partition_for(key, PARTITIONS)),
    )


def _insert_routed_by_trigger(conn: psycopg.Connection, table: OutboxTable, i: int) -> None:
    conn.execute(
        sql.SQL("INSERT INTO {} (topic, key, payload) VALUES (%s, %s, %s)").format(table.messages),
        (TOPIC, f"key-{i % KEYS}", '{"n": 1}'),
    )


def _sql_enqueue(conn: psycopg.Connection, table: OutboxTable, i: int) -> None:
    conn.execute(
        sql.SQL("SELECT id, message_id FROM {}(%s, %s, key => %s)").format(table.ident("enqueue")),
        (TOPIC, '{"n": 1}', f"key-{i % KEYS}"),
    )


def _python_enqueue(conn: psycopg.Connection, table: OutboxTable, i: int) -> None:
    enqueue(conn, TOPIC, {"n": 1}, key=f"key-{i % KEYS}", table=table)


SINGLE_ROW: dict[str, Writer] = {
    "INSERT naming its partition (baseline)": _insert_with_partition,
    "Python enqueue()": _python_enqueue,
    "INSERT without partition (trigger)": _insert_routed_by_trigger,
    "SQL enqueue()": _sql_enqueue,
}
BULK = {"outbox load, partition from Python": False, "outbox load --route-in-db (trigger)": True}


@dataclass(frozen=True)
class WriterResults:
    transactions: int
    rows: int
    rates: dict[str, list[float]]  # msg/s per run, by writer

    def render(self) -> str:
        base = statistics.median(self.rates[next(iter(SINGLE_ROW))])
        bulk_base = statistics.median(self.rates[next(iter(BULK))])
        lines = [
            f"| writer | msg/s (median of {len(self.rates[next(iter(SINGLE_ROW))])}) | vs. baseline |",
            "|---|---|---|",
        ]
        for name, rates in self.rates.items():
            reference = base if name in SINGLE_ROW else bulk_base
            median = statistics.median(rates)
            lines.append(f"| {name} | {median:,.0f} | {median / reference:.2f} |")
        return (
            f"{self.transactions:,} single-row transactions per writer; {self.rows:,} rows per bulk load "
            f"(commits every 100 rows)\n" + "\n".join(lines)
        )


def measure(found: Servers, *, transactions: int, rows: int, runs: int) -> WriterResults:
    rates: dict[str, list[float]] = {name: [] for name in [*SINGLE_ROW, *BULK]}
    for run in range(runs):
        for name, writer in SINGLE_ROW.items():
            rates[name].append(_single_rows(found.dsn, writer, transactions))
            print(f"run {run + 1}: {name}: {rates[name][-1]:,.0f} msg/s", flush=True)
        for name, route_in_db in BULK.items():
            table = _fresh_outbox(found.dsn)
            try:
                elapsed = load(
                    found.dsn, table, rows, topics=[TOPIC], rows_per_transaction=100, route_in_db=route_in_db
                )
            finally:
                _drop(found.dsn, table)
            rates[name].append(rows / elapsed)
            print(f"run {run + 1}: {name}: {rates[name][-1]:,.0f} msg/s", flush=True)
    return WriterResults(transactions, rows, rates)


def _single_rows(dsn: str, writer: Writer, transactions: int) -> float:
    table = _fresh_outbox(dsn)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            # Durable commits would time the disk's flush, the same for every writer.
            conn.execute("SET synchronous_commit = off")
            started = time.perf_counter()
            for i in range(transactions):
                with conn.transaction():
                    writer(conn, table, i)
            rate = transactions / (time.perf_counter() - started)
            _check_routing(conn, table, transactions)
            return rate
    finally:
        _drop(dsn, table)


def _check_routing(conn: psycopg.Connection, table: OutboxTable, expected: int) -> None:
    """Every writer must have stored every row, each in the partition Kafka's partitioner picks for its key."""
    row = conn.execute(
        sql.SQL("SELECT count(*), count(*) FILTER (WHERE partition <> {}(topic, key)) FROM {}").format(
            table.ident("partition_for"), table.messages
        )
    ).fetchone()
    if row != (expected, 0):
        raise RuntimeError(f"writers bench: {row} (rows stored, rows misrouted), expected ({expected}, 0)")


def _fresh_outbox(dsn: str) -> OutboxTable:
    table = OutboxTable(schema=f"bench_writers_{uuid.uuid4().hex[:8]}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        init_db(conn, table)
        set_topic_partitions(conn, table, TOPIC, PARTITIONS)
    return table


def _drop(dsn: str, table: OutboxTable) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(table.schema_ident))
