"""The bulk drain's protocol on the driver, without Spark: leases keep the online relay off drained
partitions, and a commit moves only positions the drain still owns."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest

from outbox_pipeline.config import OutboxTable
from outbox_pipeline.demo import load
from outbox_pipeline.drain import (
    DrainError,
    RangeDelivery,
    commit_drain,
    drain_owner,
    plan_drain,
    release_drain,
)
from outbox_pipeline.liveness import present
from outbox_pipeline.operations import release_lease
from outbox_pipeline.schema import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import positions
from tests.kit.relay import drain, message_ids


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


def test_the_partitions_of_a_drain_whose_driver_died_are_relayed_at_once_not_after_the_lease(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("orphaned")
    set_topic_partitions(db, table, topic, 2)
    load(db.info.dsn, table, 100, topics=(topic,), keys=10)
    owner = drain_owner("run-killed")
    with present(db.info.dsn, table, owner, kind="drain", liveness="session") as driver:
        plan = plan_drain(db, table, strategy="partitioned", owner=owner)  # leased for an hour
        assert len(plan.ranges) == 2
        driver.conn.close()  # the driver process dies: its session ends, nothing is deregistered

    stats = drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned", max_seconds=30)

    assert len(set(message_ids(kafka.consume(topic, expect=100)))) == 100
    assert stats.remaining == []
    assert all(p.locked_by != owner for p in positions(db, table).values())


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
        db, plan, [RangeDelivery(r.topic, r.partition, 1, 1, r.end_xid, r.end_id, 0.1) for r in plan.ranges]
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
