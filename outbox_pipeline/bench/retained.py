"""Claim latency as already-relayed rows pile up (`outbox bench --retained`), with the plans PostgreSQL ran for the
strategy's real claims. See docs/performance.md#claims-with-held-keys-and-retained-rows."""

from __future__ import annotations

import re
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import psycopg
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from psycopg import sql

from ..config import OutboxTable
from ..store.schema import init_db, set_topic_partitions
from ..strategies import strategy_class
from ..strategies.base import StrategyConfig
from ..strategies.positions import PositionStrategy
from .runner import Servers

# Retained rows are history: a small payload keeps 10M of them to about 2 GB.
_FILL = """
    INSERT INTO {messages} (topic, key, type, payload, partition, sent_at)
    SELECT (%(topics)s::text[])[1 + g %% cardinality(%(topics)s::text[])], 'key-' || (g %% 1000), 'bench.retained',
           jsonb_build_object('seq', g), 0, CASE WHEN %(sent)s THEN now() END
    FROM generate_series(1, %(count)s) g
"""


@dataclass(frozen=True)
class LatencyStep:
    retained: int
    p50_ms: float
    p99_ms: float
    samples: int
    # Per captured claim statement: its scan nodes with the rows each returned (from auto_explain).
    plans: list[str] = field(default_factory=list)
    pending: int = 0

    def bounded(self, batch_size: int) -> bool:
        """No scan of messages returned more than twice a batch (the fair pick reads two ranges of at most a batch
        each), and a sequential scan read no more than the pending rows and that: a scan that walked the history
        would read millions. (A planner may rightly read a partition of a few pending rows whole: PostgreSQL 15 does
        for 200 of 1,000, 18 does not.) Only scans of the message table count: offsets (a row per partition) and
        leases (a row per row in flight) are small by construction."""
        nodes = [node for plan in self.plans for node in plan.split("; ") if "outbox_messages" in node]
        rows = [int(n) for node in nodes for n in re.findall(r" rows=(\d+)", node)]
        examined = [int(n) for node in nodes if node.startswith("Seq Scan") for n in re.findall(r"read=(\d+)", node)]
        return (
            bool(self.plans)
            and max(rows, default=0) <= 2 * batch_size
            and max(examined, default=0) <= self.pending + 2 * batch_size
        )


def measure(
    servers: Servers,
    strategy: str,
    steps: Sequence[int] = (0, 1_000_000, 10_000_000),
    *,
    pending: int = 50_000,
    batch_size: int = 5000,
    samples: int = 40,
    progress: Callable[[str], None] = print,
) -> list[LatencyStep]:
    """Claim latency (p50, p99) with ``steps`` retained rows in front of ``pending`` unsent ones."""
    if list(steps) != sorted(steps):
        raise ValueError("retained steps must grow: rows are added between them, never removed")
    cls = strategy_class(strategy)
    positions = issubclass(cls, PositionStrategy)
    table = OutboxTable(schema=f"bench_retained_{uuid.uuid4().hex[:8]}")
    topics = [f"bench-retained-{table.schema[-8:]}-{i}" for i in (1, 2)]
    admin = AdminClient({"bootstrap.servers": servers.bootstrap})
    for future in admin.create_topics([NewTopic(t, 1, 1) for t in topics]).values():
        future.result()
    results: list[LatencyStep] = []
    with psycopg.connect(servers.dsn, autocommit=True) as conn:
        init_db(conn, table, strategies=[strategy])  # the strategy's own indexes, as `init-db --strategy` makes it
        for topic in topics:
            set_topic_partitions(conn, table, topic, 1)
        try:
            retained = 0
            for step in steps:
                _refill(conn, table, topics, add_retained=step - retained, pending=pending, positions=positions)
                retained = step
                progress(f"  {strategy}: {retained:,} retained rows, {pending:,} pending; timing claims")
                results.append(time_claims(servers.dsn, table, strategy, retained, batch_size, samples, pending))
        finally:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(table.schema_ident))
    return results


def _refill(
    conn: psycopg.Connection, table: OutboxTable, topics: list[str], *, add_retained: int, pending: int, positions: bool
) -> None:
    """Pending rows out, ``add_retained`` relayed rows in, positions moved past them, pending rows back."""
    fill = sql.SQL(_FILL).format(messages=table.messages)
    pending_rows = (
        sql.SQL(
            "DELETE FROM {m} m "
            "WHERE NOT EXISTS (SELECT 1 FROM {o} o WHERE o.topic = m.topic AND m.id <= o.last_processed_id)"
        )
        if positions
        else sql.SQL("DELETE FROM {m} WHERE sent_at IS NULL")
    )
    conn.execute(pending_rows.format(m=table.messages, o=table.offsets))
    chunk = 1_000_000
    for start in range(0, add_retained, chunk):
        with conn.transaction():  # one transaction id per chunk: positions are (transaction_id, id)
            conn.execute(fill, {"topics": topics, "count": min(chunk, add_retained - start), "sent": not positions})
    if positions:
        # Old offsets: each partition's position is its newest retained row.
        conn.execute(
            sql.SQL(
                """
                INSERT INTO {o} (topic, partition, last_processed_transaction_id, last_processed_id)
                SELECT DISTINCT ON (topic) topic, partition, transaction_id, id FROM {m}
                ORDER BY topic, transaction_id DESC, id DESC
                ON CONFLICT (topic, partition) DO UPDATE
                SET last_processed_transaction_id = excluded.last_processed_transaction_id,
                    last_processed_id = excluded.last_processed_id
                """
            ).format(o=table.offsets, m=table.messages)
        )
    conn.execute(fill, {"topics": topics, "count": pending, "sent": False})
    # What autovacuum would have done by the time a service has this much history: without it, the
    # claims are timed while autovacuum works through millions of fresh rows on the same two cores,
    # and the pending index still holds the entries of the pending rows deleted above (measured,
    # locking p50 20 / 26 / 33 ms at 0 / 1M / 10M retained rows with ANALYZE only).
    conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(table.messages))
    # And the checkpoint that the fill's WAL set off, done now: during one, the first change to each page
    # writes the whole page to WAL, so claims that lock rows (locking) would time the fill's checkpoint.
    try:
        conn.execute("CHECKPOINT")
    except psycopg.errors.InsufficientPrivilege:
        pass  # needs pg_checkpoint or a superuser; the embedded server has both


def time_claims(
    dsn: str, table: OutboxTable, strategy: str, retained: int, batch_size: int, samples: int, pending: int
) -> LatencyStep:
    plans: list[str] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        captured: list[str] = []
        conn.add_notice_handler(lambda diag: captured.append(diag.message_primary or ""))
        cls = strategy_class(strategy)
        mode = "delete" if issubclass(cls, PositionStrategy) else "mark-sent"
        instance = cls(conn, StrategyConfig(table=table, worker_id="bench-latency", mode=mode))  # type: ignore[arg-type]
        if isinstance(instance, PositionStrategy):
            instance.discover_partitions()
        timings: list[float] = []
        for i in range(samples + 1):
            explain = i == samples  # the last claim is explained, not timed (ANALYZE adds overhead)
            if explain:
                _explain_next_statements(conn)
            started = time.perf_counter()
            claim = instance.claim(batch_size)
            elapsed = time.perf_counter() - started
            if claim is None or not claim.records:
                raise RuntimeError(f"{strategy}: a claim found nothing with {retained} retained rows")
            instance.give_back(claim, "latency probe")
            if not explain:
                timings.append(elapsed * 1000)
        conn.execute("SET auto_explain.log_min_duration = -1")
        instance.close()
        plans = [_scan_summary(text) for text in captured if "Query Text" in text or "->" in text]
    timings.sort()
    p99 = timings[min(len(timings) - 1, round(0.99 * (len(timings) - 1)))]
    return LatencyStep(retained, statistics.median(timings), p99, len(timings), [p for p in plans if p], pending)


def _explain_next_statements(conn: psycopg.Connection) -> None:
    """Send the plans of this session's next statements to the client as NOTICEs."""
    conn.execute("LOAD 'auto_explain'")
    for setting, value in (
        ("auto_explain.log_min_duration", "0"),
        ("auto_explain.log_analyze", "on"),
        ("auto_explain.log_timing", "off"),
        ("auto_explain.log_nested_statements", "on"),
        ("auto_explain.log_level", "notice"),
    ):
        conn.execute(sql.SQL("SET {} = {}").format(sql.Identifier(*setting.split(".")), sql.Literal(value)))


_SCAN = re.compile(
    r"(Index Only Scan|Index Scan|Bitmap Heap Scan|Seq Scan|Bitmap Index Scan)(?: Backward)?"
    r"(?: using (\S+))? on (\S+)[^\n]*?rows=(\d+(?:\.\d+)?) loops=(\d+)\)"
    # The node's own detail lines, up to the next node: what its filter removed is what it read and dropped.
    r"((?:\n(?![^\n]*->)[^\n]*)*)"
)
_REMOVED = re.compile(r"Rows Removed by Filter: (\d+)")


def _scan_summary(plan: str) -> str:
    """The scan nodes of a plan that returned rows: "Index Scan using <index> rows=N", and what a sequential scan
    read ("Seq Scan on <table> rows=N read=M")."""
    nodes = []
    for kind, index, relation, rows, loops, detail in _SCAN.findall(plan):
        returned = float(rows) * int(loops)
        if returned == 0:
            continue  # an empty daily partition probed once
        where = f" using {index}" if index else f" on {relation}"
        read = ""
        if kind == "Seq Scan":
            removed = sum(int(n) for n in _REMOVED.findall(detail)) * int(loops)
            read = f" read={returned + removed:.0f}"
        nodes.append(f"{kind}{where} rows={returned:.0f}{read}")
    return "; ".join(nodes)


def render(strategy: str, steps: Sequence[LatencyStep], batch_size: int) -> str:
    base = steps[0].p50_ms if steps else 0.0
    lines = [
        f"claim latency, strategy {strategy}, batch {batch_size} (p50 / p99 over {steps[0].samples} claims)",
        f"{'retained rows':>14} {'p50 ms':>8} {'p99 ms':>8} {'p50 vs 0':>9} {'bounded':>8}  plan (scans)",
    ]
    for s in steps:
        plan = " | ".join(dict.fromkeys(s.plans)) or "(no plan captured: auto_explain needs a superuser)"
        change = f"{(s.p50_ms / base - 1) * 100:+.0f} %" if base else "n/a"
        bounded = "yes" if s.bounded(batch_size) else "NO"
        lines.append(f"{s.retained:>14,} {s.p50_ms:>8.1f} {s.p99_ms:>8.1f} {change:>9} {bounded:>8}  {plan}")
    return "\n".join(lines)
