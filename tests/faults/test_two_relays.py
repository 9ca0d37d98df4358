"""Scenario 6: two relay worker processes on the same outbox, one topic with one virtual and one Kafka partition,
while a writer writes. They must never both publish the same batch: no message_id may arrive twice (a lease
expiring could allow it; with the default lease none does, so the bound is zero), and the ordered strategies
keep their order across the hand-overs between the two workers."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import OutboxTable
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import pending, wait_until
from tests.kit.relay import order_by_key
from tests.kit.workers import Event, WorkerProcess
from tests.kit.writer import Writer, write

from .helpers import STRATEGIES, consume, report, tally

pytestmark = pytest.mark.faults

BACKLOG = 1000
WRITTEN_LIVE = 1000
BATCH = 50


def _acks(events: list[Event]) -> int:
    return sum(1 for e in events if e.step == "acked")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_relays_on_one_partition_never_publish_the_same_batch(
    strategy: str,
    dsn: str,
    outbox_tables: Callable[[str], OutboxTable],
    workers: Callable[..., WorkerProcess],
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    started = time.monotonic()
    serialized = strategy == "serialized"
    table = outbox_tables(dsn)
    topic = new_topic(partitions=1)
    with psycopg.connect(dsn, autocommit=True) as db:
        set_topic_partitions(db, table, topic, 1)
    committed = write(dsn, table, topic, BACKLOG, serialized=serialized)
    # Slow enough that each third of the writes outlasts a hand-over (a stop, the other worker's next deal of the
    # partitions, strategies/positions/sharing.py, and a restart), so both workers publish.
    writer = Writer(dsn, table, topic, serialized=serialized, per_tx=5, total=WRITTEN_LIVE, pause_s=0.03)
    relays = [
        workers(
            f"relay{n}", dsn=dsn, table=table, bootstrap=kafka.bootstrap_servers, strategy=strategy, batch_size=BATCH
        )
        for n in range(2)
    ]
    for relay in relays:
        relay.start()
    wait_until("the backlog to be delivered", lambda: pending(dsn, table, strategy) == 0, 60)
    writer.start()
    # A rolling restart of each worker (SIGTERM, then the same id again) while the writer writes: the other one
    # takes over (it acks a batch while the first is down), so both publish and the hand-overs happen under load.
    for n, relay in enumerate(relays, start=1):
        wait_until(
            f"{n}/3 of the live writes", partial(lambda n: len(writer.committed) >= n * WRITTEN_LIVE // 3, n), 60
        )
        other = relays[n % 2]
        acked = _acks(other.events())
        assert relay.terminate() == 0, relay.log()
        other.wait_for("taking over the partition", partial(lambda acked, events: _acks(events) > acked, acked))
        relay.start()
    writer.join(60)
    writer.check()
    committed += writer.committed
    wait_until("everything to be delivered", lambda: pending(dsn, table, strategy) == 0, 60)
    for relay in relays:
        assert relay.terminate() == 0, relay.log()
    stats = [relay.total_stats() for relay in relays]

    records = consume(kafka.bootstrap_servers, [topic], committed)
    result = tally(committed, records)
    order_ok: bool | None = None
    if strategy in ("partitioned", "serialized"):
        with psycopg.connect(dsn, autocommit=True) as db:
            order = "transaction_id, id" if strategy == "partitioned" else "id"
            rows = db.execute(
                sql.SQL("SELECT id, key FROM {} ORDER BY {}").format(table.messages, sql.SQL(order))
            ).fetchall()
        expected: dict[bytes, list[int]] = {}
        for oid, key in rows:
            expected.setdefault(key.encode(), []).append(oid)
        order_ok = order_by_key(records) == expected
    lease_expired = sum(s["lost_ownership"] for s in stats)
    report(
        "two-relays",
        strategy,
        **result.figures,
        seconds=time.monotonic() - started,
        published=f"{stats[0]['published']}+{stats[1]['published']}",
        batches=f"{stats[0]['batches']}+{stats[1]['batches']}",
        lease_expired=lease_expired,
        collisions=sum(s["collisions"] for s in stats),
        order="ok" if order_ok else ("n/a" if order_ok is None else "WRONG"),
    )
    assert not result.lost and not result.phantom, result.figures
    assert lease_expired == 0, "a lease expired with the default lease length"
    assert result.dupes == 0, f"{result.dupes} messages published by both workers"
    assert sum(s["published"] for s in stats) == len(committed)
    assert all(s["published"] for s in stats), "the rolling restarts should have made both workers publish"
    assert order_ok is not False, "per-key order broken across the two workers"
