"""What the outbox costs a service's own transaction (`outbox bench --writers`), each writer form against a plain INSERT
of the same rows. See docs/performance.md#writer-cost-what-the-outbox-costs-a-services-transaction."""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from ..config import OutboxTable
from ..localstack.demo import load
from ..model import WAL
from ..partitioning import partition_for
from ..store.enqueue import Message, enqueue_many
from ..store.schema import init_db, set_topic_partitions
from .procstat import parent_pid, process_cpu_s, tree_cpu_s, wait_for_client_backends_to_end
from .runner import Servers
from .wal_outbox import drop_outbox, emitted_messages, insert_lsn, table_for, why_not_wal

TOPIC = "writers"
PARTITIONS = 12
KEYS = 1000
PAYLOAD = {"n": 1}  # each message's payload, an object every writer serializes (the SQL writers with json.dumps)
# Rows each cell writes: enough transactions to time, few enough that a run of 1-row cells takes seconds.
ROWS_PER_CELL = {1: 3_000, 10: 10_000, 100: 30_000}
DEFAULT_ROWS_PER_CELL = 10_000

# Writes rows ``first .. first + count - 1`` in the caller's open transaction; serialized or not.
Writer = Callable[[psycopg.Connection, OutboxTable, int, int, bool], None]
DEFAULT_INDEX_SETS = ("partitioned", "serialized", WAL)


def _keys(first: int, count: int) -> list[str]:
    return [f"key-{i % KEYS}" for i in range(first, first + count)]


def _payloads(count: int) -> list[str]:
    return [json.dumps(PAYLOAD) for _ in range(count)]


def _plain_table(conn: psycopg.Connection, table: OutboxTable, first: int, count: int, serialized: bool) -> None:
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (topic, key, payload) SELECT * FROM unnest(%s::text[], %s::text[], %s::jsonb[])"
        ).format(table.ident("plain")),
        ([TOPIC] * count, _keys(first, count), _payloads(count)),
    )


def _python_enqueue(conn: psycopg.Connection, table: OutboxTable, first: int, count: int, serialized: bool) -> None:
    messages = [Message(TOPIC, PAYLOAD, key=key) for key in _keys(first, count)]
    enqueue_many(conn, messages, serialized=serialized, table=table)


def _insert_with_partition(
    conn: psycopg.Connection, table: OutboxTable, first: int, count: int, serialized: bool
) -> None:
    keys = _keys(first, count)
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (topic, key, payload, partition) "
            "SELECT * FROM unnest(%s::text[], %s::text[], %s::jsonb[], %s::int[])"
        ).format(table.messages),
        ([TOPIC] * count, keys, _payloads(count), [partition_for(k, PARTITIONS) for k in keys]),
    )


def _insert_routed_by_trigger(
    conn: psycopg.Connection, table: OutboxTable, first: int, count: int, serialized: bool
) -> None:
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (topic, key, payload) SELECT * FROM unnest(%s::text[], %s::text[], %s::jsonb[])"
        ).format(table.messages),
        ([TOPIC] * count, _keys(first, count), _payloads(count)),
    )


def _sql_enqueue(conn: psycopg.Connection, table: OutboxTable, first: int, count: int, serialized: bool) -> None:
    query = sql.SQL("SELECT id, message_id FROM {}(%s, %s, key => %s, serialized => %s)").format(table.ident("enqueue"))
    for key in _keys(first, count):
        conn.execute(query, (TOPIC, json.dumps(PAYLOAD), key, serialized))


BASELINE = "plain table, one INSERT (baseline)"
WRITERS: dict[str, Writer] = {
    BASELINE: _plain_table,
    "Python enqueue_many()": _python_enqueue,
    "INSERT naming its partitions": _insert_with_partition,
    "INSERT without partition (trigger)": _insert_routed_by_trigger,
    "SQL enqueue(), a call per row": _sql_enqueue,
}
# A wal outbox's writers: the Python one, and the plain INSERT of a writer in another language (its trigger emits).
WAL_WRITERS = ("Python enqueue_many()", "INSERT without partition (trigger)")
BULK = {"outbox load, partition from Python": False, "outbox load --route-in-db (trigger)": True}


@dataclass
class Cell:
    """One writer at one transaction size, per run: rows/s, and PostgreSQL's CPU per row (None: not measurable): all
    of its processes', and the writer session's backend alone."""

    rates: list[float] = field(default_factory=list)
    pg_us_per_row: list[float | None] = field(default_factory=list)
    backend_us_per_row: list[float | None] = field(default_factory=list)
    wal_bytes_per_row: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class WriterResults:
    sizes: tuple[int, ...]
    index_sets: tuple[str, ...]
    cells: dict[tuple[str, int, str], Cell]  # (writer, rows per transaction, index set; "" for the baseline)
    bulk: dict[str, list[float]]  # rows/s per run
    bulk_rows: int

    def render(self) -> str:
        runs = len(self.cells[(BASELINE, self.sizes[0], "")].rates)
        lines = [
            f"| writer | indexes of | rows per transaction | rows/s (median of {runs}) | x baseline "
            "| PostgreSQL CPU us/row | x baseline | its backend us/row | x baseline | WAL bytes/row | x baseline |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for size in self.sizes:
            base = self.cells[(BASELINE, size, "")]
            for name, index_set in _cells(self.index_sets):
                cell = self.cells[(name, size, index_set)]
                rate = statistics.median(cell.rates)
                # Ratios per run (the machine's speed swings between runs), then their median.
                rate_x = statistics.median(r / b for r, b in zip(cell.rates, base.rates, strict=True))
                cpu, cpu_x = _cpu(cell.pg_us_per_row, base.pg_us_per_row)
                backend, backend_x = _cpu(cell.backend_us_per_row, base.backend_us_per_row)
                wal, wal_x = _cpu(cell.wal_bytes_per_row, base.wal_bytes_per_row)
                lines.append(
                    f"| {name} | {index_set or '-'} | {size} | {rate:,.0f} | {rate_x:.2f} | {_fmt(cpu, '.1f')} "
                    f"| {_fmt(cpu_x, '.2f')} | {_fmt(backend, '.1f')} | {_fmt(backend_x, '.2f')} "
                    f"| {_fmt(wal, ',.0f')} | {_fmt(wal_x, '.2f')} |"
                )
        bulk_base = statistics.median(self.bulk[next(iter(BULK))])
        lines += ["", f"| bulk load, {self.bulk_rows:,} rows, commits every 100 | rows/s | x first |", "|---|---|---|"]
        for name, rates in self.bulk.items():
            lines.append(f"| {name} | {statistics.median(rates):,.0f} | {statistics.median(rates) / bulk_base:.2f} |")
        return "\n".join(lines)


def _cpu(cell: Sequence[float | None], base: Sequence[float | None]) -> tuple[float | None, float | None]:
    """The cell's median CPU per row, and the median of its per-run ratios to the baseline's."""
    ratios = [c / b if c is not None and b else None for c, b in zip(cell, base, strict=True)]
    return _median_or_none(cell), _median_or_none(ratios)


def _median_or_none(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _cells(index_sets: Sequence[str]) -> list[tuple[str, str]]:
    """(writer, index set) in the order they run: the baseline once, then every outbox writer per index set (a wal
    outbox's own writers for ``wal``)."""
    return [(BASELINE, "")] + [
        (name, i) for i in index_sets for name in (WAL_WRITERS if i == WAL else WRITERS) if name != BASELINE
    ]


def default_index_sets(dsn: str) -> tuple[str, ...]:
    """DEFAULT_INDEX_SETS, without ``wal`` where the server cannot hold a wal outbox (said on stdout)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        why = why_not_wal(conn)
    if why:
        print(f"writers: no wal lines on this server: {why}")
        return tuple(i for i in DEFAULT_INDEX_SETS if i != WAL)
    return DEFAULT_INDEX_SETS


def measure(
    found: Servers,
    *,
    sizes: Sequence[int],
    transactions: int | None,
    rows: int,
    runs: int,
    index_sets: Sequence[str] = DEFAULT_INDEX_SETS,
) -> WriterResults:
    """``transactions`` per writer and size (None: ROWS_PER_CELL); ``rows`` per bulk load (with the first table
    strategy's indexes)."""
    cells = {(name, size, i): Cell() for size in sizes for name, i in _cells(index_sets)}
    bulk_set = next((i for i in index_sets if i != WAL), DEFAULT_INDEX_SETS[0])
    bulk: dict[str, list[float]] = {name: [] for name in BULK}
    for run in range(runs):
        for size in sizes:
            for name, index_set in _cells(index_sets):
                cell_rows = size * transactions if transactions else ROWS_PER_CELL.get(size, DEFAULT_ROWS_PER_CELL)
                rate, cpu, backend, wal = _write(found, WRITERS[name], size, cell_rows, index_set)
                cell = cells[(name, size, index_set)]
                cell.rates.append(rate)
                cell.pg_us_per_row.append(cpu)
                cell.backend_us_per_row.append(backend)
                cell.wal_bytes_per_row.append(wal)
                print(
                    f"run {run + 1}: {name} ({index_set or 'no outbox'}) x {size}: {rate:,.0f} rows/s, "
                    f"PostgreSQL {_fmt(cpu, '.1f')} us/row, WAL {wal:,.0f} bytes/row"
                )
        for name, route_in_db in BULK.items():
            table = _fresh_outbox(found.dsn, bulk_set)
            try:
                elapsed = load(
                    found.dsn, table, rows, topics=[TOPIC], rows_per_transaction=100, route_in_db=route_in_db
                )
            finally:
                _drop(found.dsn, table)
            bulk[name].append(rows / elapsed)
            print(f"run {run + 1}: {name}: {bulk[name][-1]:,.0f} rows/s", flush=True)
    return WriterResults(tuple(sizes), tuple(index_sets), cells, bulk, rows)


def _write(
    found: Servers, writer: Writer, size: int, rows: int, index_set: str
) -> tuple[float, float | None, float | None, float]:
    """(rows/s, PostgreSQL CPU us per row, the session's backend's us per row, WAL bytes per row) of ``rows`` rows in
    transactions of ``size``. All of the server's processes is what the issue measured; they include background work
    (autovacuum analyzing the fresh tables, the WAL writer) that lands in some cells and not others. The backend alone
    is what the service's own transactions cost, and steadier."""
    table = _fresh_outbox(found.dsn, index_set or DEFAULT_INDEX_SETS[0])
    try:
        with psycopg.connect(found.dsn, autocommit=True) as conn:
            conn.execute("SET synchronous_commit = off")
            # The server's processes: the embedded stack's, else the postmaster of this session's backend when it
            # runs on this machine (None: elsewhere, no CPU figure).
            server = found.postgres_pid or parent_pid(conn.info.backend_pid)
            transactions = max(1, rows // size)
            backend = conn.info.backend_pid if server else None
            backend_before = process_cpu_s(backend) if backend else 0.0
            cpu_before = tree_cpu_s(server) if server else 0.0
            wal_before = insert_lsn(conn)
            started = time.perf_counter()
            for t in range(transactions):
                with conn.transaction():
                    writer(conn, table, t * size, size, index_set == "serialized")
            elapsed = time.perf_counter() - started
            wal_bytes = insert_lsn(conn) - wal_before
            # This session's backend is live: its CPU so far is in the server's tree now.
            cpu = tree_cpu_s(server) - cpu_before if server else None
            backend_cpu = process_cpu_s(backend) - backend_before if backend else None
            _check(conn, table, writer, transactions * size)
        if server:
            wait_for_client_backends_to_end(server)
        written = transactions * size
        return (
            written / elapsed,
            None if cpu is None else cpu * 1e6 / written,
            None if backend_cpu is None else backend_cpu * 1e6 / written,
            wal_bytes / written,
        )
    finally:
        _drop(found.dsn, table)


def _check(conn: psycopg.Connection, table: OutboxTable, writer: Writer, expected: int) -> None:
    """Every writer stored every row; the outbox's writers each in the partition Kafka's partitioner picks; a wal
    outbox's writers stored none and emitted every message."""
    if table.write_to == "wal" and writer is not _plain_table:
        stored = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table.messages)).fetchone()
        emitted = emitted_messages(conn, table)
        if (stored, emitted) != ((0,), expected):
            raise RuntimeError(
                f"writers bench: {stored} rows stored and {emitted} messages emitted into the wal outbox, expected "
                f"(0,) and {expected}"
            )
        return
    if writer is _plain_table:
        query = sql.SQL("SELECT count(*), 0 FROM {}").format(table.ident("plain"))
    else:
        query = sql.SQL("SELECT count(*), count(*) FILTER (WHERE partition <> {}(topic, key)) FROM {}").format(
            table.ident("partition_for"), table.messages
        )
    row = conn.execute(query).fetchone()
    if row != (expected, 0):
        raise RuntimeError(f"writers bench: {row} (rows stored, rows misrouted), expected ({expected}, 0)")


def _fresh_outbox(dsn: str, strategy: str) -> OutboxTable:
    """An outbox as `outbox init-db --strategy S` makes it, and beside it the baseline's table: a primary key and
    nothing else. A wal outbox is written the wal way; whatever fails here drops what was made (its slot too)."""
    table = table_for(f"bench_writers_{uuid.uuid4().hex[:8]}", strategy)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            init_db(conn, table, strategies=[strategy])
            set_topic_partitions(conn, table, TOPIC, PARTITIONS)
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {} (id bigserial PRIMARY KEY, topic text NOT NULL, key text, payload jsonb NOT NULL)"
                ).format(table.ident("plain"))
            )
    except BaseException:
        _drop(dsn, table)
        raise
    return table


def _drop(dsn: str, table: OutboxTable) -> None:
    drop_outbox(dsn, table)
