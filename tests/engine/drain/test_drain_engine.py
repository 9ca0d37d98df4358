"""The bulk drain's protocol on the driver, without Spark: leases keep the online relay off drained
partitions, and a commit moves only positions the drain still owns."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from outbox_pipeline.config import OutboxTable
from outbox_pipeline.drain import (
    OWNERSHIP_CHECK_S,
    DrainError,
    LeaseLostError,
    RangeDelivery,
    RangeReport,
    commit_drain,
    drain_owner,
    fetch_range,
    plan_drain,
    publish_range,
    release_drain,
)
from outbox_pipeline.localstack.demo import load
from outbox_pipeline.observe import live_workers, reap
from outbox_pipeline.operate import release_lease, retry_dead_letters
from outbox_pipeline.relay import KafkaPublisher, present
from outbox_pipeline.store import StrategyMismatch, enqueue, set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import positions
from tests.kit.quarantine import POISON, arrived_by_key, poisoned, write_keys
from tests.kit.relay import drain, message_ids
from tests.kit.writer import enqueued_behind_the_serialized_position

ROOT = Path(__file__).resolve().parents[3]


def test_the_online_relay_does_not_publish_partitions_a_bulk_drain_has_leased(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    leased_topic, free_topic = new_topic("drained"), new_topic("free")
    for topic in (leased_topic, free_topic):
        set_topic_partitions(db, table, topic, 2)
    load(db.info.dsn, table, 200, topics=(leased_topic, free_topic), keys=10)
    owner = drain_owner("run-1")
    plan = plan_drain(db, table, strategy="partitioned", owner=owner, topics=[leased_topic])
    assert {(r.topic, r.partition) for r in plan.ranges} == {(leased_topic, 0), (leased_topic, 1)}

    stats = drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned", max_seconds=3)
    assert kafka.consume(leased_topic, idle_s=1.0) == []
    assert any(f"leased by {owner}" in line for line in stats.remaining), stats.remaining
    assert len(kafka.consume(free_topic, expect=100)) == 100

    release_drain(db, table, owner)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")
    assert len(kafka.consume(leased_topic, expect=100)) == 100


# A drain's driver in a process of its own: registered, its plan made, then it waits to be killed.
_DRIVER = """
import sys, time
from outbox_pipeline.config import OutboxTable
from outbox_pipeline.drain.engine import plan_drain
from outbox_pipeline.relay.presence import present
import psycopg
dsn, schema, owner = sys.argv[1:4]
table = OutboxTable(schema=schema)
with present(dsn, table, owner, kind="drain", liveness="session"), psycopg.connect(dsn, autocommit=True) as conn:
    print(len(plan_drain(conn, table, strategy="partitioned", owner=owner).ranges), flush=True)
    time.sleep(3600)
"""


def test_the_partitions_of_a_drain_whose_driver_was_killed_are_relayed_at_once_not_after_the_lease(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("orphaned")
    set_topic_partitions(db, table, topic, 2)
    load(db.info.dsn, table, 100, topics=(topic,), keys=10)
    owner = drain_owner("run-killed")
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, db.info.dsn, table.schema, owner], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert driver.stdout is not None and driver.stdout.readline().strip() == "2"  # leased for an hour
    finally:
        driver.kill()
        driver.wait()

    stats = drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned", max_seconds=30)

    assert len(set(message_ids(kafka.consume(topic, expect=100)))) == 100
    assert stats.remaining == []
    assert all(p.locked_by != owner for p in positions(db, table).values())


def test_a_drain_driver_stays_alive_through_idle_session_timeouts(
    db: psycopg.Connection, table: OutboxTable, new_topic: Callable[..., str]
) -> None:
    """The driver's session must not end while it waits for Spark: an idle timeout (here the server's; a proxy's in
    production, minutes rather than the half second here, against heartbeats every 0.1 s instead of a second) once
    ended it, and any relay's next upkeep freed the drain's partitions while its tasks published them."""
    topic = new_topic()
    set_topic_partitions(db, table, topic, 1)
    load(db.info.dsn, table, 20, topics=(topic,), keys=2)
    owner = drain_owner("run-idle")
    impatient = make_conninfo(db.info.dsn, options="-c idle_session_timeout=500")
    with present(impatient, table, owner, kind="drain", liveness="session", heartbeat_s=0.1):
        plan_drain(db, table, strategy="partitioned", owner=owner)
        time.sleep(1.5)  # three idle timeouts of the driver's session pass while Spark works

        assert reap(db, table).partitions == 0
        assert [w.worker_id for w in live_workers(db, table, 60.0)] == [owner]
        assert positions(db, table)[(topic, 0)].locked_by == owner


def test_a_drain_task_stops_within_a_page_once_its_drain_lost_the_partition(
    db: psycopg.Connection, table: OutboxTable, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    set_topic_partitions(db, table, topic, 1)
    load(db.info.dsn, table, 100, topics=(topic,), keys=5)
    plan = plan_drain(db, table, strategy="partitioned", owner=drain_owner("run-reaped"))  # an hour's lease
    pages = fetch_range(db, plan, plan.ranges[0], page_rows=10)
    assert len(next(pages)) == 10

    release_lease(db, table, topic, 0)  # a relay's upkeep reaped the drain (its driver's session ended)
    time.sleep(OWNERSHIP_CHECK_S)  # the task's next look at its ownership is due

    with pytest.raises(LeaseLostError):
        next(pages)


def test_a_drain_refuses_positions_another_strategy_advanced_so_no_row_is_skipped(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    connect: Callable[[], psycopg.Connection],
) -> None:
    """A serialized outbox with a "write first, enqueue last" writer: its row has a higher id and a lower xid than a
    row already relayed. A drain in (xid, id) order read past it and moved the serialized position beyond its id."""
    topic = new_topic()
    set_topic_partitions(db, table, topic, 1)
    late = enqueued_behind_the_serialized_position(db, connect(), table, topic, kafka.bootstrap_servers)
    enqueue(db, topic, {"n": 3}, key="k", serialized=True, table=table)

    with pytest.raises(StrategyMismatch, match="is relayed by serialized"):
        plan_drain(db, table, strategy="partitioned", owner=drain_owner("run-wrong-order"))
    drain(db.info.dsn, table, kafka.bootstrap_servers, "serialized")

    assert str(late.message_id) in message_ids(kafka.consume(topic, expect=3))


def test_a_drain_leaves_a_partition_with_a_held_key_to_the_relay_so_the_key_keeps_its_order(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """A4 is dead-lettered and A's later rows are held; more of A is written. A drain that read past the hold put
    A10.. in Kafka before A4, which the operator's retry then sent after them."""
    topic = new_topic()
    written = poisoned("partitioned", db, table, kafka, topic)
    later = write_keys(db, table, topic, "AB", 5, start=10)

    plan = plan_drain(db, table, strategy="partitioned", owner=drain_owner("run-held"))
    for rng in plan.ranges:
        publish_range(
            KafkaPublisher({"bootstrap.servers": kafka.bootstrap_servers}), "partitioned", fetch_range(db, plan, rng)
        )
    commit_drain(db, plan, ())
    retry_dead_letters(db, table, ids=[written["A"][POISON]])
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")

    assert plan.ranges == ()
    arrived = arrived_by_key(kafka, topic)
    assert arrived["A"] == written["A"] + later["A"]
    assert arrived["B"] == written["B"] + later["B"]


def test_a_drain_plan_freezes_each_partitions_end_at_its_last_committed_row(
    db: psycopg.Connection, table: OutboxTable, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    set_topic_partitions(db, table, topic, 1)
    load(db.info.dsn, table, 50, topics=(topic,), keys=5)
    last = db.execute(f'SELECT max(id) FROM "{table.schema}".outbox_messages').fetchone()
    plan = plan_drain(db, table, strategy="partitioned", owner=drain_owner("run-2"))
    [rng] = plan.ranges
    assert (rng.start_xid, rng.start_id) == ("0", 0)
    assert last is not None and rng.end_id == last[0]
    assert positions(db, table)[(topic, 0)].locked_by == drain_owner("run-2")


def test_a_commit_moves_no_position_whose_lease_was_lost(
    db: psycopg.Connection, table: OutboxTable, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    set_topic_partitions(db, table, topic, 2)
    load(db.info.dsn, table, 40, topics=(topic,), keys=8)
    plan = plan_drain(db, table, strategy="partitioned", owner=drain_owner("run-3"))
    kept, lost = plan.ranges
    release_lease(db, table, lost.topic, lost.partition)  # an operator freed it mid-drain

    outcome = commit_drain(
        db,
        plan,
        [
            RangeReport(r.label, RangeDelivery(r.topic, r.partition, 1, 1, r.end_xid, r.end_id, 0.1))
            for r in plan.ranges
        ],
    )

    assert [d.label for d in outcome.committed] == [kept.label]
    assert "lease lost" in outcome.not_committed[lost.label]
    after = positions(db, table)
    assert (after[(kept.topic, kept.partition)].xid, after[(kept.topic, kept.partition)].id) == (
        kept.end_xid,
        kept.end_id,
    )
    assert (after[(lost.topic, lost.partition)].xid, after[(lost.topic, lost.partition)].id) == ("0", 0)
    assert all(p.locked_by is None for p in after.values())


@pytest.mark.parametrize("strategy", ["locking", "advisory", "lease"])
def test_bulk_drain_refuses_row_strategies(strategy: str, db: psycopg.Connection, table: OutboxTable) -> None:
    with pytest.raises(DrainError, match="position strategies"):
        plan_drain(db, table, strategy=strategy, owner=drain_owner("run-4"))


def test_bulk_drain_refuses_a_wal_outbox_and_says_its_backlog_is_the_slots(
    db: psycopg.Connection, wal_outbox: OutboxTable
) -> None:
    with pytest.raises(DrainError, match="keeps no rows, its backlog is in the replication slot"):
        plan_drain(db, wal_outbox, strategy="wal", owner=drain_owner("run-5"))
