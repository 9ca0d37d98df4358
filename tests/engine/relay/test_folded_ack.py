"""Under steady traffic a position worker acks a batch in the statement of its next claim (issue 29: one statement
per batch): the position moves exactly as a separate ack would move it, a partition with more work keeps its lease
and is read on from its new position, one with none is released, and a worker that lost a partition meanwhile moves
nothing and reads nothing of it."""

from __future__ import annotations

import threading
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.model import Claim, PublishOutcome
from outbox_pipeline.store import set_topic_partitions
from outbox_pipeline.strategies import PositionStrategy, StrategyConfig, strategy_class
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import wait_until
from tests.kit.relay import make_relay, order_by_key

ORDERED_POSITIONS = ["partitioned", "serialized"]


def _offsets(db: psycopg.Connection, table: OutboxTable) -> tuple[int, str | None]:
    row = db.execute(sql.SQL("SELECT last_processed_id, locked_by FROM {}").format(table.offsets)).fetchone()
    assert row is not None
    return row[0], row[1]


def _all_delivered(claim: Claim) -> PublishOutcome:
    return PublishOutcome(claim.records, [])


def _one_key(db: psycopg.Connection, table: OutboxTable, rows: int) -> list[int]:
    """``rows`` rows of one key in a topic of one partition; their ids, in commit order."""
    set_topic_partitions(db, table, "orders", 1)
    messages = [Message("orders", {"n": i}, key="k") for i in range(rows)]
    return [w.id for w in enqueue_many(db, messages, serialized=True, table=table)]


@pytest.mark.parametrize("strategy", ORDERED_POSITIONS)
def test_an_ack_in_the_next_claim_moves_the_position_and_the_claim_reads_on_from_there(
    strategy: str, dsn: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    ids = _one_key(db, table, 25)
    with psycopg.connect(dsn, autocommit=True) as conn:
        worker = strategy_class(strategy)(conn, StrategyConfig(table=table, worker_id="w"))
        first = worker.claim(10)
        assert first is not None and [r.id for r in first.records] == ids[:10]

        result, second = worker.ack_and_claim(10, first, _all_delivered(first))
        assert (result.acked, result.lost_ownership) == (10, 0)
        assert _offsets(db, table) == (ids[9], "w")  # moved, and the lease kept: more rows wait
        assert second is not None and [r.id for r in second.records] == ids[10:20]

        result, third = worker.ack_and_claim(10, second, _all_delivered(second))
        assert result.acked == 10
        assert third is not None and [r.id for r in third.records] == ids[20:]

        result, fourth = worker.ack_and_claim(10, third, _all_delivered(third))
        assert result.acked == 5 and fourth is None
    assert _offsets(db, table) == (ids[-1], None)  # nothing more: released


@pytest.mark.parametrize("strategy", ORDERED_POSITIONS)
def test_a_worker_that_lost_its_partition_before_its_next_claim_acks_nothing_and_reads_nothing_of_it(
    strategy: str, dsn: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    _one_key(db, table, 20)
    cls = strategy_class(strategy)
    with psycopg.connect(dsn, autocommit=True) as c1, psycopg.connect(dsn, autocommit=True) as c2:
        slow = cls(c1, StrategyConfig(table=table, worker_id="slow", lease_s=0.2))
        fast = cls(c2, StrategyConfig(table=table, worker_id="fast", lease_s=30))
        slow_claim = slow.claim(10)
        assert slow_claim is not None
        wait_until("the slow worker's lease expired", lambda: fast.claim(10) is not None, 30)

        result, after = slow.ack_and_claim(10, slow_claim, _all_delivered(slow_claim))

        assert (result.acked, result.lost_ownership) == (0, 10)
        assert after is None  # the partition is the fast worker's: nothing of it read past the lost batch
    assert _offsets(db, table) == (0, "fast")  # the new owner publishes the lost batch's rows again


class _CountingFolds:
    """Counts the acks a strategy made inside its next claim."""

    def __init__(self, strategy: str) -> None:
        self.folded = 0
        self.lock = threading.Lock()
        base: type[PositionStrategy] = strategy_class(strategy)  # type: ignore[assignment]
        counter = self

        class Counting(base):  # type: ignore[valid-type,misc]
            def _folded_acks(self, previous: Claim, outcome: PublishOutcome) -> object:
                acks = super()._folded_acks(previous, outcome)
                if acks is not None:
                    with counter.lock:
                        counter.folded += 1
                return acks

        self.factory: type[PositionStrategy] = Counting


@pytest.mark.parametrize("strategy", ORDERED_POSITIONS)
def test_a_paced_relay_acks_in_its_next_claims_and_kafka_gets_every_row_once_in_commit_order(
    strategy: str,
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    topic = new_topic(partitions=2)
    set_topic_partitions(db, table, topic, 2)
    folds = _CountingFolds(strategy)
    stop = threading.Event()
    relay = make_relay(  # paced: each claim waits 0.1 s after the one before, which took everything there was
        dsn,
        table,
        kafka.bootstrap_servers,
        strategy,
        stop=stop,
        until_empty=False,
        max_seconds=120,
        listen=True,
        linger_s=0.1,
        strategy_cls=folds.factory,
    )
    relay_thread = threading.Thread(target=relay.run)
    relay_thread.start()
    written: list[int] = []
    try:
        with psycopg.connect(dsn, autocommit=True) as writer:
            for n in range(60):  # a commit every 20 ms or so: each paced claim takes several
                rows = [Message(topic, {"n": n, "i": i}, key=f"k{i % 3}") for i in range(5)]
                written += [w.id for w in enqueue_many(writer, rows, serialized=strategy == "serialized", table=table)]
                writer.execute("SELECT pg_sleep(0.02)")
        arrived = kafka.consume(topic, expect=len(written), deadline_s=60)
    finally:
        stop.set()
        relay_thread.join(60)
    by_key = order_by_key(arrived)
    assert len(arrived) == len(written)  # no duplicate: nothing failed
    assert sorted(id_ for ids in by_key.values() for id_ in ids) == sorted(written)  # every row
    assert all(ids == sorted(ids) for ids in by_key.values())  # each key in commit order
    assert folds.folded > 0
    assert relay.stats.acked == len(written)
    pending = db.execute(
        sql.SQL("SELECT count(*) FROM {} m JOIN {} o USING (topic, partition) WHERE m.id > o.last_processed_id").format(
            table.messages, table.offsets
        )
    ).fetchone()
    assert pending == (0,)  # every position at its partition's last row
