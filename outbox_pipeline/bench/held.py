"""Claim time with a key held behind a dead letter (`outbox bench --held 0,10000`): quarantine must cost the partition's
other keys nothing. See docs/performance.md#claims-with-held-keys-and-retained-rows."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

import psycopg
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from psycopg import sql

from ..config import OutboxTable
from ..observe.lag import held_keys
from ..relay.relay_settings import RelaySettings
from ..relay.workers import WorkerSpec, build_relay
from ..store.enqueue import Message, enqueue_many
from ..store.schema import init_db, set_topic_partitions
from ..strategies.base import StrategyConfig
from .retained import LatencyStep, time_claims
from .runner import Servers

HELD_KEY = "held-key"
OTHER_KEYS = 100
MAX_MESSAGE_BYTES = 10_000


def measure(
    servers: Servers,
    strategy: str,
    steps: Sequence[int] = (0, 10_000),
    *,
    pending: int = 20_000,
    batch_size: int = 1000,
    samples: int = 40,
    progress: Callable[[str], None] = print,
) -> list[LatencyStep]:
    """Claim latency (p50, p99) with ``steps`` rows held behind a dead letter; ``retained`` reports the held rows."""
    results: list[LatencyStep] = []
    admin = AdminClient({"bootstrap.servers": servers.bootstrap})  # kept alive until its futures resolve
    for held in steps:
        table = OutboxTable(schema=f"bench_held_{uuid.uuid4().hex[:8]}")
        topic = f"bench-held-{table.schema[-8:]}"
        for future in admin.create_topics([NewTopic(topic, 1, 1)]).values():
            future.result()
        with psycopg.connect(servers.dsn, autocommit=True) as conn:
            init_db(conn, table)
            set_topic_partitions(conn, table, topic, 1)
            try:
                _hold(servers, conn, table, topic, strategy, held)
                found = sum(k.rows for k in held_keys(conn, table))
                if found != held:
                    raise RuntimeError(f"{strategy}: {found} rows held, expected {held}")
                _write(conn, table, topic, pending, held=False)
                conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(table.messages))
                progress(f"  {strategy}: {held:,} held rows, {pending:,} pending of other keys; timing claims")
                results.append(time_claims(servers.dsn, table, strategy, held, batch_size, samples, pending))
            finally:
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(table.schema_ident))
    return results


def _hold(servers: Servers, conn: psycopg.Connection, table: OutboxTable, topic: str, strategy: str, held: int) -> None:
    """With ``held`` > 0: a poison row, then ``held`` rows of its key among as many of other keys, relayed."""
    if held:
        poison = Message(topic, {"blob": "x" * 2 * MAX_MESSAGE_BYTES}, key=HELD_KEY)
        enqueue_many(conn, [poison], serialized=True, table=table)
    _write(conn, table, topic, held, held=True)
    _write(conn, table, topic, max(held, 1000), held=False)
    spec = WorkerSpec(
        servers.dsn,
        strategy,
        {"bootstrap.servers": servers.bootstrap, "message.max.bytes": MAX_MESSAGE_BYTES},
        RelaySettings(batch_size=5000, until_empty=True, max_seconds=300, listen=False),
        StrategyConfig(table=table),
        worker_id="bench-held",
    )
    build_relay(spec).run()


def _write(conn: psycopg.Connection, table: OutboxTable, topic: str, count: int, *, held: bool) -> None:
    for first in range(0, count, 1000):
        with conn.transaction():
            messages = [
                Message(topic, {"n": i}, key=HELD_KEY if held else f"key-{i % OTHER_KEYS}")
                for i in range(first, min(first + 1000, count))
            ]
            enqueue_many(conn, messages, serialized=True, table=table)


def render(strategy: str, steps: Sequence[LatencyStep], batch_size: int) -> str:
    base = steps[0].p50_ms if steps else 0.0
    lines = [
        f"claim latency with a key held behind a dead letter, strategy {strategy}, batch {batch_size} "
        f"(p50 / p99 over {steps[0].samples} claims)",
        f"{'held rows':>10} {'p50 ms':>8} {'p99 ms':>8} {'p50 vs 0':>9} {'bounded':>8}  plan (scans)",
    ]
    for s in steps:
        plan = " | ".join(dict.fromkeys(s.plans)) or "(no plan captured)"
        change = f"{(s.p50_ms / base - 1) * 100:+.0f} %" if base else "n/a"
        lines.append(
            f"{s.retained:>10,} {s.p50_ms:>8.1f} {s.p99_ms:>8.1f} {change:>9} "
            f"{'yes' if s.bounded(batch_size) else 'NO':>8}  {plan}"
        )
    return "\n".join(lines)
