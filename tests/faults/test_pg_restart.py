"""Scenario 3: PostgreSQL restarts in the middle of a drain, with ``pg_ctl stop -m fast`` (sessions terminated)
and ``-m immediate`` (a crash: no shutdown checkpoint, recovery on start). The relay worker processes are not
touched: each must notice, reconnect by itself and finish, losing nothing. The server is this module's own, so
no other test's connections break. One worker per strategy runs through the same restart."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Literal

import psycopg
import pytest

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.localstack import LocalPostgres
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import pending, wait_until
from tests.kit.workers import WorkerProcess
from tests.kit.writer import write

from .helpers import IN_FLIGHT_BATCHES, STRATEGIES, consume, report, tally

pytestmark = pytest.mark.faults

BACKLOG = 2000
AFTER = 100
BATCH = 20
RELAY_SETTINGS = {"error_backoff_base_s": 0.2, "error_backoff_max_s": 1.0, "max_poll_interval_s": 1.0}


@dataclass
class Lane:
    strategy: str
    table: OutboxTable
    topic: str
    worker: WorkerProcess
    committed: list[str]
    drained_at: float | None = None


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_postgres_restart_mid_drain_the_relay_reconnects_by_itself_and_loses_nothing(
    mode: Literal["fast", "immediate"],
    module_pg: LocalPostgres,
    outbox_tables: Callable[[str], OutboxTable],
    workers: Callable[..., WorkerProcess],
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    dsn = module_pg.dsn
    lanes: list[Lane] = []
    for strategy in STRATEGIES:
        table = outbox_tables(dsn)
        topic = new_topic(strategy, partitions=2)
        with psycopg.connect(dsn, autocommit=True) as db:
            set_topic_partitions(db, table, topic, 4)
        committed = write(dsn, table, topic, 10, serialized=strategy == "serialized")  # warms the producer up
        worker = workers(
            strategy,
            dsn=dsn,
            table=table,
            bootstrap=kafka.bootstrap_servers,
            strategy=strategy,
            batch_size=BATCH,
            settings=RELAY_SETTINGS,
        )
        lanes.append(Lane(strategy, table, topic, worker.start(), committed))
    for lane in lanes:
        wait_until(
            f"{lane.strategy} warm-up", partial(lambda lane: pending(dsn, lane.table, lane.strategy) == 0, lane), 30
        )
    # Every backlog commits at the same moment, so all workers are mid-drain together.
    with ExitStack() as stack:
        backlogs = []
        for lane in lanes:
            conn = stack.enter_context(psycopg.connect(dsn))
            messages = [Message(lane.topic, {"n": i}, key=f"k{i % 8}") for i in range(BACKLOG)]
            written = enqueue_many(conn, messages, serialized=lane.strategy == "serialized", table=lane.table)
            backlogs.append((conn, lane, [str(w.message_id) for w in written]))
        committed_at = time.monotonic()
        for conn, lane, ids in backlogs:
            conn.commit()
            lane.committed += ids
    for lane in lanes:
        lane.worker.wait_for(
            "an ack of the backlog", lambda ev: any(e.step == "acked" and e.t > committed_at for e in ev)
        )
    old_pid = module_pg.pid
    t0 = time.monotonic()
    module_pg.restart(mode=mode)
    t1 = time.monotonic()
    assert module_pg.pid not in (None, old_pid)
    for lane in lanes:
        assert lane.worker.alive(), f"{lane.strategy} worker died with the database:\n{lane.worker.log()}"
        # New rows after the restart: the relay must see them too (its LISTEN connection was broken).
        lane.committed += write(dsn, lane.table, lane.topic, AFTER, serialized=lane.strategy == "serialized")

    def all_drained() -> bool:
        for lane in lanes:
            if lane.drained_at is None and pending(dsn, lane.table, lane.strategy) == 0:
                lane.drained_at = time.monotonic()
        return all(lane.drained_at is not None for lane in lanes)

    wait_until("every worker to drain after the restart", all_drained, 60, interval_s=0.1)
    for lane in lanes:
        assert lane.worker.terminate() == 0, lane.worker.log()

    records = consume(
        kafka.bootstrap_servers, [lane.topic for lane in lanes], [m for ln in lanes for m in ln.committed]
    )
    failures = []
    for lane in lanes:
        result = tally(lane.committed, [r for r in records if r.topic == lane.topic])
        stats = lane.worker.stats()
        before = sum(e.numbers[0] for e in lane.worker.events() if e.step == "acked" and committed_at < e.t < t0)
        assert lane.drained_at is not None
        report(
            f"pg-restart-{mode}",
            lane.strategy,
            **result.figures,
            seconds=lane.drained_at - t0,
            restart=f"{t1 - t0:.1f}s",
            resumed=f"{lane.drained_at - t1:.1f}s",
            db_errors=stats["errors"],
            acked_before=before,
        )
        checks = {
            "lost": result.lost and len(result.lost),
            "phantom": result.phantom and len(result.phantom),
            # at most the batches in hand when the server went away are published again
            f"duplicates over {IN_FLIGHT_BATCHES} batches": result.dupes > IN_FLIGHT_BATCHES * BATCH and result.dupes,
            "never saw the restart (no database error)": stats["errors"] == 0,
            "had acked its whole backlog before the restart (not mid-drain)": before >= BACKLOG,
            "dead-lettered": stats["dead_lettered"],
        }
        failures += [f"{lane.strategy}: {what}: {detail}" for what, detail in checks.items() if detail]
    assert not failures, "\n".join(failures)
