"""The ``bulk_drain`` asset on a local Spark session against the real PostgreSQL and broker."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import dagster as dg
import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, enqueue_many
from outbox_pipeline.assets.spark import bulk_drain
from outbox_pipeline.config import OutboxTable
from outbox_pipeline.drain import OWNER_PREFIX
from outbox_pipeline.localstack import LocalBroker
from outbox_pipeline.localstack.demo import load
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.resources.kafka import KafkaResource
from outbox_pipeline.store import enqueue, set_topic_partitions
from tests.kit.kafka import KafkaProbe, Record
from tests.kit.probes import positions, row_positions, wait_until
from tests.kit.relay import committed_message_ids, drain, make_relay, message_ids, order_by_key
from tests.kit.writer import Writer, enqueued_behind_the_serialized_position

pytestmark = pytest.mark.spark


def _materialize(resources: dict[str, object], **config: object) -> dg.ExecuteInProcessResult:
    return dg.materialize(
        [bulk_drain], resources=resources, run_config={"ops": {"bulk_drain": {"config": config}}}, raise_on_error=False
    )


def _drain_metadata(result: dg.ExecuteInProcessResult) -> dict[str, Any]:
    [materialization] = result.asset_materializations_for_node("bulk_drain")
    return {key: value.value for key, value in materialization.metadata.items()}


def test_bulk_drain_delivers_a_backlog_in_key_order_while_writers_keep_writing_and_the_relay_continues_exactly(
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    spark_resources: dict[str, object],
) -> None:
    topics = (new_topic("orders"), new_topic("payments"))
    for topic in topics:
        set_topic_partitions(db, table, topic, 3)  # 6 virtual partitions: 6 Spark tasks
    load(dsn, table, 6000, topics=topics, keys=40)
    # One writer per topic, so each key has one writer and its commit order is its id order.
    stop = threading.Event()
    writers = [
        Writer(dsn, table, topic, serialized=False, name=topic, keys=7, per_tx=1, pause_s=0.002, stop=stop)
        for topic in topics
    ]
    for writer in writers:
        writer.start()
    try:
        result = _materialize(spark_resources, page_rows=500)
    finally:
        stop.set()
        for writer in writers:
            writer.join()
            writer.check()
    assert result.success
    metadata = _drain_metadata(result)

    # Positions advanced exactly to what was delivered: per partition, every row up to the position
    # arrived and nothing past it did.
    drained: list[Record] = [r for topic in topics for r in kafka.consume(topic, idle_s=2.0)]
    rows = row_positions(db, table)
    arrived_by_partition: dict[tuple[str, int], set[int]] = defaultdict(set)
    for record in drained:
        topic, part, _ = rows[int(record.headers["outbox_id"])]
        arrived_by_partition[(topic, part)].add(int(record.headers["outbox_id"]))
    stored = positions(db, table)
    for pair, position in stored.items():
        up_to_position = {
            oid
            for oid, (t, p, xid) in rows.items()
            if (t, p) == pair and (xid, oid) <= (int(position.xid), position.id)
        }
        assert arrived_by_partition.get(pair, set()) == up_to_position, pair
        assert position.locked_by is None
    assert metadata["rows"] == len(drained) >= 6000
    assert metadata["partitions"] == 6
    assert sum(metadata["per_partition"].values()) == len(drained)
    assert metadata["bytes"] > 0 and metadata["msg_per_s"] > 0

    # The online relay continues from the drain's positions: nothing lost, nothing twice, keys in order.
    drain(dsn, table, kafka.bootstrap_servers, "partitioned")
    everything = [r for topic in topics for r in kafka.consume(topic, idle_s=2.0)]
    ids = message_ids(everything)
    assert len(ids) == len(set(ids))
    assert set(ids) == committed_message_ids(db, table)
    for topic in topics:
        for key, order in order_by_key([r for r in everything if r.topic == topic]).items():
            assert order == sorted(order), (topic, key)


def test_a_drain_that_cannot_deliver_a_partition_commits_what_kafka_confirmed_fails_naming_it_and_the_relay_takes_over(
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    broker: LocalBroker,
    new_topic: Callable[..., str],
    spark_resources: dict[str, object],
) -> None:
    """A failed drain used to move no position: every rerun (the sensor asked for one each tick) republished the ranges
    that did finish. Now those are committed, the run fails naming what stopped it, and the relay does the rest."""
    good = new_topic("good")
    refused = f"refused-{good}"  # not created, and producers may not auto-create it
    for i in range(300):
        enqueue(db, good, {"i": i}, key=f"k{i % 6}", table=table)
    for i in range(20):
        enqueue(db, refused, {"i": i}, key="k", table=table)
    failing = {
        **spark_resources,
        "kafka": KafkaResource(
            bootstrap_servers=kafka.bootstrap_servers,
            properties={
                "allow.auto.create.topics": "false",
                "message.timeout.ms": "2000",
                "request.timeout.ms": "1000",
            },
        ),
    }

    failed = _materialize(failing)

    assert not failed.success
    failure = failed.failure_data_for_node("bulk_drain")
    assert failure is not None and failure.error is not None
    assert f"topic {refused!r} does not exist" in failure.error.message
    assert "What Kafka confirmed before that is committed (300 rows)" in failure.error.message
    moved = {topic: p for (topic, _), p in positions(db, table).items() if p.id}
    assert set(moved) == {good} and all(p.locked_by is None for p in positions(db, table).values())

    broker.create_topics([refused])
    drain(dsn, table, kafka.bootstrap_servers, "partitioned")

    arrived = message_ids(kafka.consume(good, idle_s=2.0))  # all of it: the drain has returned
    assert len(arrived) == 300 == len(set(arrived))  # the relay did not publish the drained rows again
    assert len(set(message_ids(kafka.consume(refused, expect=20)))) == 20


def test_a_drain_with_no_strategy_configured_uses_the_relays_and_skips_no_row(
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    spark_resources: dict[str, object],
    connect: Callable[[], psycopg.Connection],
) -> None:
    """A serialized outbox with a "write first, enqueue last" writer: its row has a higher id and a lower xid than a
    row already relayed. The drain the sensor launched read in partitioned's (xid, id) order: it left that row behind
    a position it committed past its id, and the serialized relay never published it."""
    topic = new_topic()
    set_topic_partitions(db, table, topic, 1)
    late = enqueued_behind_the_serialized_position(db, connect(), table, topic, kafka.bootstrap_servers)
    for n in range(3, 50):
        enqueue(db, topic, {"n": n}, key="k", serialized=True, table=table)

    result = _materialize({**spark_resources, "orchestration": OrchestrationSettings(strategy="serialized")})
    drain(dsn, table, kafka.bootstrap_servers, "serialized")

    assert str(late.message_id) in message_ids(kafka.consume(topic, idle_s=2.0))
    assert result.success and _drain_metadata(result)["strategy"] == "serialized"


def test_a_drain_refuses_an_outbox_a_row_strategy_relays_and_says_why(
    db: psycopg.Connection, table: OutboxTable, spark_resources: dict[str, object]
) -> None:
    enqueue(db, "orders", {"n": 1}, table=table)

    result = _materialize({**spark_resources, "orchestration": OrchestrationSettings(strategy="lease")})

    assert not result.success
    failure = result.failure_data_for_node("bulk_drain")
    assert failure is not None and failure.error is not None
    assert "not 'lease': row strategies keep delivery state on every row" in failure.error.message


def test_a_drained_partition_keeps_its_lease_until_the_commit_while_another_task_still_runs(
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    spark_resources: dict[str, object],
    connect: Callable[[], psycopg.Connection],
) -> None:
    """Issue 40, case 12: a task that finished renewed its lease no more, so after ``lease_s`` the relay took the
    partition while the driver still waited for a slower task, published the drained range a second time, and the
    commit of that partition failed (lease lost)."""
    fast, slow = new_topic("fast"), new_topic("slow")
    for topic in (fast, slow):
        set_topic_partitions(db, table, topic, 1)
    enqueue_many(db, [Message(fast, {"n": n}, key="k") for n in range(5)], table=table)
    enqueue_many(db, [Message(slow, {"n": n}, key="k") for n in range(2000)], table=table)
    lease_s = 3.0
    drained = threading.Event()
    problems: list[BaseException] = []

    def hold_the_slow_task_past_the_lease() -> None:
        """The slow partition's task waits on its next lease check (a row lock on its offsets row) until the fast
        partition's lease has run out and a relay has had its chance at it."""
        holder = connect()
        try:
            wait_until("the drain's plan", lambda: _leased_to_a_drain(db, table, slow), 120)
            with holder.transaction():
                holder.execute(sql.SQL("SELECT 1 FROM {} WHERE topic = %s FOR UPDATE").format(table.offsets), (slow,))
                assert len(kafka.consume(fast, expect=5)) == 5  # the fast task is done
                finished = _now(db)
                wait_until("the fast partition's lease to run out", lambda: _now(db) > finished + lease_s + 1, 30)
                assert not drained.is_set(), "the slow partition's task finished before it could be held"
                make_relay(dsn, table, kafka.bootstrap_servers, "partitioned", until_empty=False, max_seconds=3).run()
        except BaseException as exc:
            problems.append(exc)
        finally:
            holder.close()

    helper = threading.Thread(target=hold_the_slow_task_past_the_lease)
    helper.start()
    try:
        result = _materialize(spark_resources, lease_s=lease_s, page_rows=1)
    finally:
        drained.set()
        helper.join()
    assert problems == []

    assert result.success
    assert len(message_ids(kafka.consume(fast, idle_s=2.0))) == 5  # once each: the relay did not take it back
    assert len(set(message_ids(kafka.consume(slow, expect=2000)))) == 2000
    assert all(p.locked_by is None and p.id > 0 for p in positions(db, table).values())


def _leased_to_a_drain(db: psycopg.Connection, table: OutboxTable, topic: str) -> bool:
    row = db.execute(sql.SQL("SELECT locked_by FROM {} WHERE topic = %s").format(table.offsets), (topic,)).fetchone()
    return bool(row and row[0] and row[0].startswith(OWNER_PREFIX))


def _now(db: psycopg.Connection) -> float:
    row = db.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
    assert row is not None
    return float(row[0])
