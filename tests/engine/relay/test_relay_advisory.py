"""Strategy `advisory` (seed variant 1.1): one active worker under a session advisory lock, id order."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import replace

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.errors import ConfigurationError
from outbox_pipeline.relay import KafkaPublisher, Relay
from outbox_pipeline.strategies import ADVISORY_LOCK_CLASS, AdvisoryStrategy, StrategyConfig
from tests.kit.kafka import KafkaProbe, Record
from tests.kit.probes import wait_until
from tests.kit.relay import drain, make_relay, message_ids, order_by_key, row_count, run_workers


def _outbox_ids(records: list[Record]) -> list[int]:
    return [int(r.headers["outbox_id"]) for r in records]


def test_advisory_delivers_every_committed_row_once_in_id_order_and_deletes_it(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    written = enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i % 7}") for i in range(500)], table=table)
    stats = drain(db.info.dsn, table, kafka.bootstrap_servers, "advisory", batch_size=64)
    records = kafka.consume(topic, expect=500)
    assert _outbox_ids(records) == sorted(w.id for w in written)
    assert sorted(message_ids(records)) == sorted(str(w.message_id) for w in written)
    assert stats.published == 500
    assert row_count(db, table) == 0


def test_advisory_mark_sent_mode_keeps_rows_with_sent_at(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    enqueue_many(db, [Message(topic, {"n": i}) for i in range(50)], table=table)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "advisory", mode="mark-sent", batch_size=16)
    assert len(kafka.consume(topic, expect=50)) == 50
    assert row_count(db, table, "sent_at IS NOT NULL AND locked_by IS NULL") == 50


def test_two_advisory_workers_one_publishes_everything_in_per_key_id_order(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=2)
    written = enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i % 10}") for i in range(2000)], table=table)
    stats = run_workers(db.info.dsn, table, kafka.bootstrap_servers, "advisory", 2, batch_size=50)
    records = kafka.consume(topic, expect=2000)
    arrived = message_ids(records)
    assert len(arrived) == 2000 and len(set(arrived)) == 2000
    # The standby never publishes: whichever worker took the lock first drained everything.
    assert sorted(s.published for s in stats) == [0, 2000]
    expected = {f"k{k}".encode(): [w.id for i, w in enumerate(written) if i % 10 == k] for k in range(10)}
    assert order_by_key(records) == expected
    assert row_count(db, table) == 0


def test_standby_claims_nothing_while_the_holder_lives_and_takes_over_after_close(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    connect: Callable[[], psycopg.Connection],
    publisher: KafkaPublisher,
) -> None:
    topic = new_topic()
    written = enqueue_many(db, [Message(topic, {"n": i}) for i in range(20)], table=table)
    config = StrategyConfig(table=table)
    holder = AdvisoryStrategy(connect(), replace(config, worker_id="holder"))
    standby = AdvisoryStrategy(connect(), replace(config, worker_id="standby"))

    first = holder.claim(10)
    assert first is not None and [r.id for r in first.records] == [w.id for w in written[:10]]
    assert standby.claim(10) is None
    assert holder.ack(first, publisher.publish(first.records)).acked == 10
    assert standby.claim(10) is None  # the holder keeps the lock across batches

    holder.close()
    second = standby.claim(10)
    assert second is not None and [r.id for r in second.records] == [w.id for w in written[10:]]
    assert standby.ack(second, publisher.publish(second.records)).acked == 10
    standby.close()

    assert _outbox_ids(kafka.consume(topic, expect=20)) == [w.id for w in written]
    assert row_count(db, table) == 0


def _has_waited(relay: Relay) -> Callable[[], bool]:
    """Whether ``relay`` has waited for rows yet (a condition bound to this relay, not to a loop variable)."""
    return lambda: relay.stats.idle_waits > 0


def test_a_standby_relay_is_not_woken_by_each_commit_the_holder_publishes(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """Fifteen standbys woken by every commit starved the active worker of CPU (a row waited 10 s in the
    scale-out fault scenario on the CI runner). A standby asks again at its poll interval, whatever is committed."""
    topic = new_topic()
    stop = threading.Event()
    # Poll and upkeep far beyond the test: the standby can only look again if a commit wakes it.
    far = {"poll_interval_s": 3600, "max_poll_interval_s": 3600, "upkeep_interval_s": 3600}
    relays = {
        name: make_relay(
            db.info.dsn,
            table,
            kafka.bootstrap_servers,
            "advisory",
            stop=stop,
            until_empty=False,
            max_seconds=120,
            listen=True,
            worker_id=name,
            settings=far if name == "standby" else None,
        )
        for name in ("holder", "standby")
    }
    threads = {name: threading.Thread(target=relay.run) for name, relay in relays.items()}
    try:
        for name, relay in relays.items():  # the holder's first claim takes the lock, then it waits for rows
            threads[name].start()
            wait_until(f"the {name} to wait", _has_waited(relay), 30)
        written = [enqueue(db, topic, {"n": i}, key=f"k{i % 5}", table=table) for i in range(50)]  # 50 commits
        records = kafka.consume(topic, expect=50)
    finally:
        stop.set()
        for thread in threads.values():
            thread.join()
    assert _outbox_ids(records) == [w.id for w in written]
    assert relays["holder"].stats.published == 50
    assert relays["standby"].stats.published == 0
    assert relays["standby"].stats.idle_waits == 1  # looked once, found the lock taken, and slept through 50 commits


def test_lock_is_released_when_the_holders_session_dies(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    connect: Callable[[], psycopg.Connection],
    publisher: KafkaPublisher,
) -> None:
    topic = new_topic()
    written = enqueue_many(db, [Message(topic, {"n": i}) for i in range(10)], table=table)
    config = StrategyConfig(table=table)
    crashed_conn = connect()
    crashed = AdvisoryStrategy(crashed_conn, replace(config, worker_id="crashed"))
    survivor = AdvisoryStrategy(connect(), replace(config, worker_id="survivor"))
    assert crashed.claim(10) is not None
    assert survivor.claim(10) is None

    # The holder dies before publishing; the timeout makes the call wait until its backend is gone.
    db.execute("SELECT pg_terminate_backend(%s, 10000)", [crashed_conn.info.backend_pid])
    claim = survivor.claim(10)
    assert claim is not None and [r.id for r in claim.records] == [w.id for w in written]
    survivor.ack(claim, publisher.publish(claim.records))

    assert _outbox_ids(kafka.consume(topic, expect=10)) == [w.id for w in written]
    assert row_count(db, table) == 0


def test_transient_failure_acks_the_delivered_rows_and_later_rows_overtake_the_failed_one(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    connect: Callable[[], psycopg.Connection],
) -> None:
    topic = new_topic()
    missing = f"missing-{uuid.uuid4().hex[:10]}"  # never created, and the producer may not auto-create it
    messages = [Message(topic if i != 4 else missing, {"n": i}, key="k") for i in range(10)]
    written = enqueue_many(db, messages, table=table)
    strategy = AdvisoryStrategy(connect(), StrategyConfig(table=table, backoff_base_s=60.0))
    publisher = KafkaPublisher(
        {"bootstrap.servers": kafka.bootstrap_servers, "message.timeout.ms": 1500, "allow.auto.create.topics": False}
    )
    try:
        claim = strategy.claim(10)
        assert claim is not None
        outcome = publisher.publish(claim.records)
        result = strategy.ack(claim, outcome)
        assert (result.acked, result.retried, result.dead_lettered) == (9, 1, 0)

        # The failed row waits out its backoff; rows written after it go first.
        later = enqueue_many(db, [Message(topic, {"n": i}, key="k") for i in range(10, 13)], table=table)
        next_claim = strategy.claim(10)
        assert next_claim is not None and [r.id for r in next_claim.records] == [w.id for w in later]
        strategy.ack(next_claim, publisher.publish(next_claim.records))
    finally:
        publisher.close()
        strategy.close()

    delivered = [w.id for w in written if w is not written[4]] + [w.id for w in later]
    assert _outbox_ids(kafka.consume(topic, expect=12)) == delivered
    row = db.execute(
        sql.SQL("SELECT id, attempts, last_error IS NOT NULL, available_after > now() FROM {}").format(table.messages)
    ).fetchall()
    assert row == [(written[4].id, 1, True, True)]


def test_with_on_poison_skip_a_permanently_failing_row_is_dead_lettered_and_skipped(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    messages = [Message(topic, {"n": i, "pad": "x" * (5000 if i == 3 else 0)}, key="k") for i in range(8)]
    written = enqueue_many(db, messages, table=table)
    stats = drain(
        db.info.dsn,
        table,
        kafka.bootstrap_servers,
        "advisory",
        producer={"message.max.bytes": 2000},
        batch_size=4,
        on_poison="skip",
    )
    assert stats.dead_lettered == 1
    assert _outbox_ids(kafka.consume(topic, expect=7)) == [w.id for w in written if w is not written[3]]
    assert row_count(db, table) == 0
    dead = db.execute(sql.SQL("SELECT id FROM {}").format(table.dead_letters)).fetchall()
    assert dead == [(written[3].id,)]


def test_acquiring_refuses_a_server_connection_that_already_holds_the_lock(
    db: psycopg.Connection, table: OutboxTable, connect: Callable[[], psycopg.Connection]
) -> None:
    # What a transaction pooler does: hand this worker a server connection on which another client
    # took the lock. Advisory locks are re-entrant, so trying again there would "succeed".
    shared = connect()
    shared.execute("SELECT pg_try_advisory_lock(%s, hashtext(%s))", [ADVISORY_LOCK_CLASS, table.schema])
    enqueue_many(db, [Message("unused-topic", {"n": 1})], table=table)
    strategy = AdvisoryStrategy(shared, StrategyConfig(table=table))
    with pytest.raises(ConfigurationError, match="transaction pooling"):
        strategy.claim(10)
    assert not strategy.holds_lock
    assert row_count(db, table, "sent_at IS NULL") == 1


def test_a_row_committed_just_as_a_claim_begins_is_not_overtaken_by_a_later_row_of_its_key(
    table: OutboxTable, new_topic: Callable[..., str], connect: Callable[[], psycopg.Connection]
) -> None:
    """Rows are available from their writer's ``now()`` (its transaction's start). A claim that compared that with
    its own ``now()`` left out a row whose writer began after the claim's transaction began and committed before its
    snapshot, while a later row of the key, written by a transaction that began earlier and waited for the key,
    went out first. Seen under load in the 4-writer order test; the claim's transaction here widens the window
    that is microseconds wide in autocommit."""
    topic = new_topic()
    early, late, claimer = connect(), connect(), connect()
    strategy = AdvisoryStrategy(claimer, StrategyConfig(table=table, worker_id="w"))
    early.execute("BEGIN")
    early.execute("SELECT 1")  # began first: its row is available from the earliest time
    claimer.execute("BEGIN")
    claimer.execute("SELECT 1")  # the claim's transaction has begun
    first = enqueue(late, topic, {"n": 1}, key="k", table=table)  # began and committed after the claimer began
    second = enqueue(early, topic, {"n": 2}, key="k", table=table)
    early.execute("COMMIT")

    claim = strategy.claim(10)
    claimer.execute("COMMIT")

    assert claim is not None and [r.id for r in claim.records] == [first.id, second.id]
