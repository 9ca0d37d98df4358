"""Position workers share the partitions out evenly (strategies/positions/sharing.py): each live unscoped worker is
dealt a home, serves it first, and takes another's partition only once its oldest row has waited."""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg
import pytest

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.model import PublishOutcome
from outbox_pipeline.relay import WorkerPresence
from outbox_pipeline.store import set_topic_partitions
from outbox_pipeline.strategies import StrategyConfig, strategy_class
from outbox_pipeline.strategies.positions import STEAL_AFTER_S, PositionStrategy

PARTITIONS = 8


def _registered(connect: Callable[[], psycopg.Connection], table: OutboxTable, worker: str) -> WorkerPresence:
    presence = WorkerPresence(connect(), table, worker, "session")
    presence.register()
    return presence


def _worker(
    connect: Callable[[], psycopg.Connection], table: OutboxTable, strategy: str, worker: str
) -> PositionStrategy:
    instance = strategy_class(strategy)(connect(), StrategyConfig(table=table, worker_id=worker))
    assert isinstance(instance, PositionStrategy)
    return instance


def _fill(db: psycopg.Connection, table: OutboxTable, topic: str, strategy: str) -> None:
    """At least one row in every partition (keys spread by Kafka's hash), and every offsets row created."""
    messages = [Message(topic, {"n": i}, key=f"k{i}") for i in range(200)]
    enqueue_many(db, messages, serialized=strategy == "serialized", table=table)


@pytest.mark.parametrize("strategy", ["partitioned", "serialized"])
def test_live_workers_are_dealt_every_partition_once_and_evenly_and_again_when_one_leaves(
    strategy: str, db: psycopg.Connection, table: OutboxTable, connect: Callable[[], psycopg.Connection]
) -> None:
    topic = "shared"
    set_topic_partitions(db, table, topic, PARTITIONS)
    _fill(db, table, topic, strategy)
    presences = [_registered(connect, table, f"w{n}") for n in range(3)]
    workers = [_worker(connect, table, strategy, f"w{n}") for n in range(3)]
    workers[0].discover_partitions()

    homes = {w.config.worker_id: set(w._dealer._deal().partitions or []) for w in workers}
    assert sorted(p for home in homes.values() for p in home) == list(range(PARTITIONS))
    assert sorted(len(home) for home in homes.values()) == [2, 3, 3]

    presences[2].deregister()
    homes = {w.config.worker_id: set(w._dealer._deal().partitions or []) for w in workers[:2]}
    assert sorted(p for home in homes.values() for p in home) == list(range(PARTITIONS))
    assert sorted(len(home) for home in homes.values()) == [4, 4]
    assert workers[2]._dealer._deal().everywhere  # no longer registered: no preference


@pytest.mark.parametrize("strategy", ["partitioned", "serialized"])
def test_a_worker_serves_its_home_first_and_takes_another_partition_only_after_its_row_waited(
    strategy: str, db: psycopg.Connection, table: OutboxTable, connect: Callable[[], psycopg.Connection]
) -> None:
    topic = "shared"
    set_topic_partitions(db, table, topic, 2)
    for name in ("a", "b"):
        _registered(connect, table, name)
    a, b = _worker(connect, table, strategy, "a"), _worker(connect, table, strategy, "b")
    # One fresh row in each partition; "a" is dealt partition 0, "b" partition 1.
    messages = [Message(topic, {"p": p}, key="k", partition=p) for p in (0, 1)]
    enqueue_many(db, messages, serialized=strategy == "serialized", table=table)
    a.discover_partitions()

    first = a.claim(10)
    assert first is not None and {r.partition for r in first.records} == {0}
    assert a.claim(10) is None, "a took b's fresh row instead of leaving it to b"

    time.sleep(STEAL_AFTER_S)  # the rule under test is about time: let b's row wait past STEAL_AFTER_S
    stolen = a.claim(10)
    assert stolen is not None and {r.partition for r in stolen.records} == {1}
    assert b.claim(10) is None  # a holds it now


@pytest.mark.parametrize("strategy", ["partitioned", "serialized"])
def test_a_worker_that_leased_every_partition_before_another_joined_hands_over_the_newcomers_home_at_a_batch(
    strategy: str, db: psycopg.Connection, table: OutboxTable, connect: Callable[[], psycopg.Connection]
) -> None:
    """Reading ahead keeps a lease as long as a partition has work (a backlog, steady traffic); a worker alone at
    start leased every partition, and kept them all after a second worker joined: the newcomer idled through the
    whole backlog (a bulk drain ran at one worker's speed)."""
    topic = "shared"
    set_topic_partitions(db, table, topic, 2)
    messages = [Message(topic, {"n": n}, key="k", partition=n % 2) for n in range(200)]
    enqueue_many(db, messages, serialized=strategy == "serialized", table=table)
    _registered(connect, table, "a")
    a = _worker(connect, table, strategy, "a")
    first = a.claim(20)
    assert first is not None and {r.partition for r in first.records} == {0, 1}  # alone: both are home

    _registered(connect, table, "b")  # "b" is dealt partition 1
    b = _worker(connect, table, strategy, "b")
    a._dealer.invalidate()
    ahead = a.claim(20)
    assert ahead is not None and {r.partition for r in ahead.records} == {0}, "a read b's partition ahead"
    a.ack(first, PublishOutcome(first.records, []))

    taken = b.claim(20)
    assert taken is not None and {r.partition for r in taken.records} == {1}
    assert min(r.id for r in taken.records) > max(r.id for r in first.records if r.partition == 1)
