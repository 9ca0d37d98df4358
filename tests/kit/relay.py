"""Running relay workers against the real servers, and comparing what arrived with what was written."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import psycopg
from psycopg import sql

from outbox_pipeline.config import OutboxTable
from outbox_pipeline.model import WAL
from outbox_pipeline.relay import OutcomeObserver, Relay, RelaySettings, RelayStats, WalRelay, WorkerSpec, build_relay
from outbox_pipeline.strategies import OnPoison, Strategy, StrategyConfig

from .kafka import Record


def make_relay(
    dsn: str,
    table: OutboxTable,
    bootstrap: str,
    strategy: str,
    *,
    batch_size: int = 100,
    producer: Mapping[str, object] | None = None,
    stop: threading.Event | None = None,
    until_empty: bool = True,
    max_seconds: float | None = 60.0,
    listen: bool = False,
    linger_s: float = RelaySettings.min_cycle_s,
    settings: Mapping[str, Any] | None = None,
    strategy_cls: type[Strategy] | None = None,
    observer: OutcomeObserver | None = None,
    **config: object,
) -> Relay:
    """A table relay worker as the CLI builds one; ``settings`` overrides RelaySettings fields, ``config`` the
    StrategyConfig's, ``strategy_cls`` the strategy's class (an instrumented subclass)."""
    worker_id = config.pop("worker_id", None)
    spec = WorkerSpec(
        dsn,
        strategy,
        {"bootstrap.servers": bootstrap, "message.timeout.ms": 10_000, **(producer or {})},
        RelaySettings(
            **{
                "batch_size": batch_size,
                "until_empty": until_empty,
                "max_seconds": max_seconds,
                "listen": listen,
                "poll_interval_s": 0.05,
                "min_cycle_s": linger_s,
                **(settings or {}),
            }
        ),
        replace(StrategyConfig(table=table), **config),  # type: ignore[arg-type]
        worker_id=worker_id,  # type: ignore[arg-type]
    )
    relay = build_relay(spec, stop, strategy_cls=strategy_cls, observer=observer)
    assert isinstance(relay, Relay), f"{strategy} is not a table strategy"
    return relay


def drain(dsn: str, table: OutboxTable, bootstrap: str, strategy: str, **kwargs: Any) -> RelayStats:
    return make_relay(dsn, table, bootstrap, strategy, **kwargs).run()


def run_workers(
    dsn: str, table: OutboxTable, bootstrap: str, strategy: str, workers: int, **kwargs: Any
) -> list[RelayStats]:
    """Several relay workers in threads, each with its own connection and producer."""
    results: list[RelayStats] = []
    lock = threading.Lock()

    def work(index: int) -> None:
        stats = drain(dsn, table, bootstrap, strategy, worker_id=f"w{index}", **kwargs)
        with lock:
            results.append(stats)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def message_ids(records: Iterable[Record]) -> list[str]:
    return [r.headers["message_id"].decode() for r in records]


def committed_message_ids(conn: psycopg.Connection, table: OutboxTable) -> set[str]:
    """Everything enqueued and committed: still in the table, or already published and deleted."""
    rows = conn.execute(sql.SQL("SELECT message_id::text FROM {}").format(table.messages)).fetchall()
    return {r[0] for r in rows}


def order_by_key(records: Sequence[Record]) -> dict[bytes | None, list[int]]:
    """Outbox ids per key in the order Kafka delivered them (first occurrence of each)."""
    seen: set[int] = set()
    per_key: dict[bytes | None, list[int]] = defaultdict(list)
    for record in records:
        oid = int(record.headers["outbox_id"])
        if oid not in seen:
            seen.add(oid)
            per_key[record.key].append(oid)
    return dict(per_key)


def row_count(db: psycopg.Connection, table: OutboxTable, where: str = "true") -> int:
    """Rows of the outbox table matching a (test-written, constant) condition."""
    row = db.execute(sql.SQL("SELECT count(*) FROM {} WHERE " + where).format(table.messages)).fetchone()
    return int(row[0]) if row else 0


def make_wal_relay(
    dsn: str,
    table: OutboxTable,
    bootstrap: str,
    *,
    stop: threading.Event | None = None,
    until_idle: bool = True,
    max_seconds: float | None = 60.0,
    producer: Mapping[str, object] | None = None,
    worker_id: str | None = None,
    on_poison: OnPoison = "quarantine",
    settings: Mapping[str, Any] | None = None,
) -> WalRelay:
    """The wal strategy's relay, assembled as the CLI's worker processes assemble it."""
    spec = WorkerSpec(
        dsn,
        WAL,
        {"bootstrap.servers": bootstrap, "message.timeout.ms": 10_000, **(producer or {})},
        RelaySettings(until_empty=until_idle, max_seconds=max_seconds, **(settings or {})),
        StrategyConfig(table=table, on_poison=on_poison),
        worker_id=worker_id,
    )
    relay = build_relay(spec, stop)
    assert isinstance(relay, WalRelay)
    return relay
