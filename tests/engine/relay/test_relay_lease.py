"""Strategy `lease` (seed variant 2): two short transactions, rows leased in outbox_leases (owner, expiry)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import psycopg
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.relay import KafkaPublisher
from outbox_pipeline.strategies import LeaseStrategy, StrategyConfig
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain, message_ids, row_count, run_workers


def _wait_for_leases_to_expire(db: psycopg.Connection, table: OutboxTable, deadline_s: float = 15.0) -> None:
    """Wait on the database clock (the one leases use) until no lease in the table is still running."""
    deadline = time.monotonic() + deadline_s
    query = sql.SQL("SELECT extract(epoch FROM max(expires_at) - clock_timestamp())::float8 FROM {}").format(
        table.leases
    )
    while True:
        row = db.execute(query).fetchone()
        remaining = row[0] if row else None
        if remaining is None or remaining < 0:
            return
        assert time.monotonic() < deadline, f"leases still running {remaining:.1f} s after the deadline"
        db.execute("SELECT pg_sleep(%s)", [min(remaining + 0.01, 1.0)])


def _live_leases(db: psycopg.Connection, table: OutboxTable) -> dict[int, str]:
    """Row id -> owner, for every lease still running."""
    query = sql.SQL("SELECT id, locked_by FROM {} WHERE expires_at > now()").format(table.leases)
    return dict(db.execute(query).fetchall())


def test_two_lease_workers_deliver_every_committed_row_once(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=2)
    written = enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i}") for i in range(2000)], table=table)
    stats = run_workers(db.info.dsn, table, kafka.bootstrap_servers, "lease", 2, batch_size=50)
    arrived = message_ids(kafka.consume(topic, expect=2000))
    assert sorted(arrived) == sorted(str(w.message_id) for w in written)
    assert sum(s.published for s in stats) == 2000
    assert sum(s.lost_ownership for s in stats) == 0
    assert row_count(db, table) == 0


def test_lease_mark_sent_mode_keeps_rows_with_sent_at_and_no_lease(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    enqueue_many(db, [Message(topic, {"n": i}) for i in range(50)], table=table)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "lease", mode="mark-sent", batch_size=16)
    assert len(kafka.consume(topic, expect=50)) == 50
    assert row_count(db, table, "sent_at IS NOT NULL AND locked_by IS NULL") == 50
    assert _live_leases(db, table) == {}


def test_claimed_rows_are_leased_to_the_worker_until_the_lease_runs_out(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    connect: Callable[[], psycopg.Connection],
    publisher: KafkaPublisher,
) -> None:
    topic = new_topic()
    written = enqueue_many(db, [Message(topic, {"n": i}) for i in range(15)], table=table)
    strategy = LeaseStrategy(connect(), StrategyConfig(table=table, worker_id="w1", lease_s=30.0))
    claim = strategy.claim(10)
    assert claim is not None and [r.id for r in claim.records] == [w.id for w in written[:10]]

    leased = db.execute(
        sql.SQL("SELECT id FROM {} WHERE locked_by = 'w1' AND expires_at > now() + interval '20 s' ORDER BY id").format(
            table.leases
        )
    ).fetchall()
    assert [r[0] for r in leased] == [w.id for w in written[:10]]
    assert row_count(db, table) == 15  # rows are not touched by a claim

    assert strategy.ack(claim, publisher.publish(claim.records)).acked == 10
    assert len(kafka.consume(topic, expect=10)) == 10
    assert row_count(db, table) == 5
    assert _live_leases(db, table) == {}  # the ack ends the leases


def test_restarted_worker_reclaims_its_own_leases_at_once_while_others_wait(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    connect: Callable[[], psycopg.Connection],
    publisher: KafkaPublisher,
) -> None:
    topic = new_topic()
    written = enqueue_many(db, [Message(topic, {"n": i}) for i in range(10)], table=table)
    config = StrategyConfig(table=table, lease_s=30.0)
    before_crash = LeaseStrategy(connect(), replace(config, worker_id="pod-0"))
    assert before_crash.claim(10) is not None  # ... and the process dies without acking
    other = LeaseStrategy(connect(), replace(config, worker_id="pod-1"))
    assert other.claim(10) is None

    restarted = LeaseStrategy(connect(), replace(config, worker_id="pod-0"))
    claim = restarted.claim(10)
    assert claim is not None and [r.id for r in claim.records] == [w.id for w in written]
    assert restarted.ack(claim, publisher.publish(claim.records)).acked == 10

    assert sorted(message_ids(kafka.consume(topic, expect=10))) == sorted(str(w.message_id) for w in written)
    assert row_count(db, table) == 0


def test_expired_lease_hands_a_dead_workers_rows_to_another_worker(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    connect: Callable[[], psycopg.Connection],
) -> None:
    topic = new_topic()
    written = enqueue_many(db, [Message(topic, {"n": i}) for i in range(30)], table=table)
    dead_conn = connect()
    dead = LeaseStrategy(dead_conn, StrategyConfig(table=table, worker_id="dead", lease_s=1.0))
    assert dead.claim(30) is not None
    dead_conn.close()  # gone without acking or giving anything back

    _wait_for_leases_to_expire(db, table)
    stats = drain(db.info.dsn, table, kafka.bootstrap_servers, "lease", worker_id="heir")
    assert stats.published == 30
    assert sorted(message_ids(kafka.consume(topic, expect=30))) == sorted(str(w.message_id) for w in written)
    assert row_count(db, table) == 0


def test_worker_whose_expired_lease_was_reclaimed_acks_nothing(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    connect: Callable[[], psycopg.Connection],
    publisher: KafkaPublisher,
) -> None:
    topic = new_topic()
    written = enqueue_many(db, [Message(topic, {"n": i}) for i in range(20)], table=table)
    slow = LeaseStrategy(connect(), StrategyConfig(table=table, worker_id="slow", lease_s=1.0))
    slow_claim = slow.claim(20)
    assert slow_claim is not None
    slow_outcome = publisher.publish(slow_claim.records)  # published; the ack comes too late

    _wait_for_leases_to_expire(db, table)
    fast = LeaseStrategy(connect(), StrategyConfig(table=table, worker_id="fast", lease_s=30.0))
    fast_claim = fast.claim(20)
    assert fast_claim is not None and len(fast_claim.records) == 20

    late = slow.ack(slow_claim, slow_outcome)
    assert (late.acked, late.lost_ownership) == (0, 20)
    assert set(_live_leases(db, table).values()) == {"fast"} and len(_live_leases(db, table)) == 20

    assert fast.ack(fast_claim, publisher.publish(fast_claim.records)).acked == 20
    assert row_count(db, table) == 0
    # At-least-once: both workers published every row.
    arrived = Counter(message_ids(kafka.consume(topic, expect=40)))
    assert arrived == Counter({str(w.message_id): 2 for w in written})


def test_give_back_ends_the_lease_so_another_worker_can_claim_at_once(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    connect: Callable[[], psycopg.Connection],
    publisher: KafkaPublisher,
) -> None:
    topic = new_topic()
    written = enqueue_many(db, [Message(topic, {"n": i}) for i in range(10)], table=table)
    config = StrategyConfig(table=table, lease_s=30.0)
    first = LeaseStrategy(connect(), replace(config, worker_id="first"))
    second = LeaseStrategy(connect(), replace(config, worker_id="second"))
    claim = first.claim(10)
    assert claim is not None
    first.give_back(claim, "producer failed")
    assert _live_leases(db, table) == {}

    taken = second.claim(10)
    assert taken is not None and [r.id for r in taken.records] == [w.id for w in written]
    assert second.ack(taken, publisher.publish(taken.records)).acked == 10
    assert len(kafka.consume(topic, expect=10)) == 10
    assert row_count(db, table) == 0


def test_lease_claim_takes_highest_priority_plus_an_oldest_share(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    enqueue_many(db, [Message(topic, {"p": 0, "n": i}) for i in range(10)], table=table)
    enqueue_many(db, [Message(topic, {"p": 9, "n": i}, priority=9) for i in range(100)], table=table)
    stats = drain(db.info.dsn, table, kafka.bootstrap_servers, "lease", batch_size=20, oldest_share=0.25)
    records = kafka.consume(topic, expect=110)
    first_batch = [json.loads(r.value or b"null")["p"] for r in records[:20]]
    assert stats.published == 110
    assert first_batch.count(0) == 5 and first_batch.count(9) == 15
    assert row_count(db, table) == 0


def test_shuffle_and_sample_with_three_workers_delivers_everything_and_counts_collisions(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=3)
    written = enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i}") for i in range(3000)], table=table)
    stats = run_workers(db.info.dsn, table, kafka.bootstrap_servers, "lease", 3, batch_size=50, sample_factor=4)
    arrived = message_ids(kafka.consume(topic, expect=3000))
    collisions = sum(s.collisions for s in stats)
    print(f"shuffle-and-sample, 3 workers: collisions={collisions} per worker={[s.collisions for s in stats]}")
    # Collisions cost a worker a row, never a delivery: every claimed row was published once. (Asserted before what
    # arrived, so that a shortfall in Kafka tells a row never published from a record the broker confirmed and lost.)
    assert sum(s.claimed for s in stats) == sum(s.published for s in stats) == 3000
    assert row_count(db, table) == 0
    assert sorted(arrived) == sorted(str(w.message_id) for w in written)


def _waiting_for_a_lock(db: psycopg.Connection, pid: int) -> bool:
    return db.execute("SELECT count(*) > 0 FROM pg_locks WHERE pid = %s AND NOT granted", [pid]).fetchone() == (True,)


def _until(what: str, condition: Callable[[], bool], deadline_s: float = 15.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_an_ack_and_a_claim_meeting_on_the_same_expired_leases_never_deadlock(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    connect: Callable[[], psycopg.Connection],
    publisher: KafkaPublisher,
) -> None:
    """Forced interleaving: the ack stops right after deleting its lease rows (a test trigger waits for an
    advisory lock the test holds); meanwhile a claim of the same, expired, leases runs; then the ack goes on.
    Both must finish (no DeadlockDetected), and the ack, which got there first, keeps its rows."""
    topic = new_topic()
    enqueue_many(db, [Message(topic, {"n": i}) for i in range(5)], table=table)
    slow = LeaseStrategy(connect(), StrategyConfig(table=table, worker_id="slow", lease_s=30.0))
    fast = LeaseStrategy(connect(), StrategyConfig(table=table, worker_id="fast", lease_s=30.0))
    claim = slow.claim(5)
    assert claim is not None and len(claim.records) == 5
    outcome = publisher.publish(claim.records)
    db.execute(sql.SQL("UPDATE {} SET expires_at = now() - interval '1 second'").format(table.leases))
    pause = sql.Identifier(table.schema, "pause_after_lease_delete")
    db.execute(
        sql.SQL(
            "CREATE FUNCTION {}() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_advisory_xact_lock_shared(4242); RETURN NULL; END $$"
        ).format(pause)
    )
    db.execute(
        sql.SQL("CREATE TRIGGER pause AFTER DELETE ON {} FOR EACH STATEMENT EXECUTE FUNCTION {}()").format(
            table.leases, pause
        )
    )
    gate = connect()
    gate.execute("SELECT pg_advisory_lock(4242)")
    results: dict[str, object] = {}

    def run(name: str, call: Callable[[], object]) -> threading.Thread:
        def target() -> None:
            try:
                results[name] = call()
            except Exception as exc:  # reported by the assertion below
                results[name] = exc

        thread = threading.Thread(target=target)
        thread.start()
        return thread

    acking = run("ack", lambda: slow.ack(claim, outcome))
    _until("the ack to stop after its lease delete", lambda: _waiting_for_a_lock(db, slow.conn.info.backend_pid))
    claiming = run("claim", lambda: fast.claim(5))
    _until(
        "the claim to finish or wait",
        lambda: not claiming.is_alive() or _waiting_for_a_lock(db, fast.conn.info.backend_pid),
    )
    gate.execute("SELECT pg_advisory_unlock(4242)")
    acking.join(30)
    claiming.join(30)
    assert not isinstance(results["ack"], Exception), f"the ack failed: {results['ack']!r}"
    assert not isinstance(results["claim"], Exception), f"the claim failed: {results['claim']!r}"
    assert results["ack"].acked == 5  # type: ignore[attr-defined]
    assert results["claim"] is None
    assert row_count(db, table) == 0


def test_a_batch_read_ahead_has_its_leases_renewed_when_it_goes_to_kafka(
    db: psycopg.Connection,
    table: OutboxTable,
    new_topic: Callable[..., str],
    connect: Callable[[], psycopg.Connection],
) -> None:
    """The relay reads batch N+1 while N is in Kafka; by the time N+1 is published its leases have aged
    one publish. ``before_publish`` renews them, so another worker cannot take them mid-publish."""
    topic = new_topic()
    enqueue_many(db, [Message(topic, {"n": i}) for i in range(10)], table=table)
    first = LeaseStrategy(connect(), StrategyConfig(table=table, worker_id="first", lease_s=30.0))
    other = LeaseStrategy(connect(), StrategyConfig(table=table, worker_id="other", lease_s=30.0))
    ahead = first.claim(10)
    assert ahead is not None
    db.execute(sql.SQL("UPDATE {} SET expires_at = now() + interval '10 milliseconds'").format(table.leases))
    ready = first.before_publish(ahead)
    assert ready is not None and len(ready.records) == 10
    db.execute("SELECT pg_sleep(0.05)")  # past the old expiry, on the database clock
    assert other.claim(10) is None, "another worker took rows whose batch was being published"


def test_a_batch_read_ahead_whose_leases_another_worker_took_publishes_only_what_is_still_ours(
    db: psycopg.Connection,
    table: OutboxTable,
    new_topic: Callable[..., str],
    connect: Callable[[], psycopg.Connection],
) -> None:
    topic = new_topic()
    enqueue_many(db, [Message(topic, {"n": i}) for i in range(10)], table=table)
    first = LeaseStrategy(connect(), StrategyConfig(table=table, worker_id="first", lease_s=30.0))
    other = LeaseStrategy(connect(), StrategyConfig(table=table, worker_id="other", lease_s=30.0))
    ahead = first.claim(10)
    assert ahead is not None
    taken = [r.id for r in ahead.records[:4]]
    db.execute(sql.SQL("UPDATE {} SET expires_at = now() WHERE id = ANY(%s)").format(table.leases), [taken])
    stolen = other.claim(4)
    assert stolen is not None and sorted(r.id for r in stolen.records) == taken
    ready = first.before_publish(ahead)
    assert ready is not None and sorted(r.id for r in ready.records) == sorted(r.id for r in ahead.records[4:])
