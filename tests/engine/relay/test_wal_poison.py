"""The wal relay's failure paths (issue 50): a record Kafka refuses for now holds only its key until an operator retries
it, a message it cannot read is a dead letter and never a silent drop, a dead letter is never published behind the
operator's back, and what the relay published and confirmed is not reported as a duplicate risked."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

import psycopg
from psycopg import sql

from outbox_pipeline import OutboxTable, enqueue
from outbox_pipeline.localstack import LocalBroker
from outbox_pipeline.model import PublishOutcome
from outbox_pipeline.operate import discard_dead_letters, retry_dead_letters
from outbox_pipeline.store.wal.format import UNSTORABLE_TOPIC, encode
from outbox_pipeline.store.wal.objects import names_of
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import make_wal_relay

# A producer that gives up on a message to a topic that does not exist within a second, and never creates one.
NO_AUTO_CREATE = {"message.timeout.ms": 1000, "allow.auto.create.topics": False}


def _dead_letters(db: psycopg.Connection, table: OutboxTable) -> list[tuple[str, str]]:
    return [
        (str(topic), str(error))
        for topic, error in db.execute(
            sql.SQL("SELECT topic, last_error FROM {} ORDER BY id").format(table.dead_letters)
        ).fetchall()
    ]


def test_a_message_to_a_topic_created_late_holds_only_its_key_and_a_retry_once_it_exists_publishes_it_in_order(
    db: psycopg.Connection,
    wal_outbox: OutboxTable,
    kafka: KafkaProbe,
    broker: LocalBroker,
    new_topic: Callable[..., str],
) -> None:
    """Not retried by the relay as the table strategies retry it (max_attempts): one stream, and each attempt would
    stop every key for a message timeout; its key is held, the others flow, and the operator's retry publishes it and
    what its key held, in order (issue 50, case 12)."""
    late, other = f"late-{uuid.uuid4().hex[:10]}", new_topic("wal")
    with db.transaction():
        enqueue(db, late, {"n": 1}, key="k", table=wal_outbox)
        enqueue(db, other, {"n": 2}, key="k2", table=wal_outbox)
    first = make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, producer=NO_AUTO_CREATE).run()
    assert [r.value for r in kafka.consume(other, expect=1)] == [b'{"n": 2}']
    [(dead_topic, error)] = _dead_letters(db, wal_outbox)
    assert dead_topic == late and f"topic {late!r} does not exist" in error and first.dead_lettered == 1
    with db.transaction():
        enqueue(db, late, {"n": 3}, key="k", table=wal_outbox)  # held behind the dead letter

    broker.create_topics([late], partitions=1)
    retry_dead_letters(db, wal_outbox)
    stop = threading.Event()
    second = make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, stop=stop, until_idle=False)
    worker = threading.Thread(target=second.run)
    worker.start()
    try:
        arrived = kafka.consume(late, expect=2, deadline_s=60)
    finally:
        stop.set()
        worker.join()

    assert [r.value for r in arrived] == [b'{"n": 1}', b'{"n": 3}']


def test_a_non_transactional_message_under_the_prefix_is_dead_lettered_as_malformed_not_dropped(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("wal")
    prefix = names_of(wal_outbox).prefix
    db.execute("SELECT pg_logical_emit_message(false, %s, '\\x01'::bytea)", (prefix,))
    with db.transaction():
        enqueue(db, topic, {"n": 1}, key="k", table=wal_outbox)

    stats = make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    assert [r.value for r in kafka.consume(topic, expect=1)] == [b'{"n": 1}']
    [(dead_topic, error)] = _dead_letters(db, wal_outbox)
    assert dead_topic == "(malformed)" and "not transactional" in error
    assert stats.dead_lettered == 1


def test_a_dead_letter_whose_confirm_was_lost_is_not_held_again_so_discarding_it_publishes_nothing_of_it(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """The relay dead-letters a message and holds its key; its stream is ended before it confirms past the message,
    so the stream sends the message again. It is the hold's dead letter, not one of the messages held behind it."""
    topic = new_topic("wal")
    with db.transaction():
        enqueue(db, topic, {"pad": "x" * 5000}, key="k", table=wal_outbox)  # over the first relay's limit
        enqueue(db, topic, {"n": 2}, key="k", table=wal_outbox)
    first = make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, producer={"message.max.bytes": 2000})
    ended = threading.Event()

    def end_the_stream(outcome: PublishOutcome) -> None:  # after Kafka refused the message, before the confirm
        if outcome.failed and not ended.is_set():
            ended.set()
            db.execute(
                "SELECT pg_terminate_backend(active_pid, 5000) FROM pg_replication_slots WHERE slot_name = %s",
                (names_of(wal_outbox).slot,),
            )

    first.observer = end_the_stream
    first.run()
    assert ended.is_set() and first.stats.dead_lettered == 1  # its confirm went to a stream the server had ended

    [dead_letter] = db.execute(sql.SQL("SELECT id FROM {}").format(wal_outbox.dead_letters)).fetchall()
    discard_dead_letters(db, wal_outbox, [dead_letter[0]], reason="too large for good")
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()  # no size limit: would publish it

    assert [r.value for r in kafka.consume(topic)] == [b'{"n": 2}']


def test_what_a_wal_relay_published_and_confirmed_is_not_counted_as_a_duplicate_risked(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("wal")
    with db.transaction():
        for n in range(20):
            enqueue(db, topic, {"n": n}, key=f"k{n % 3}", table=wal_outbox)

    stats = make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    assert stats.published == 20
    assert stats.published - stats.acked == 0


def test_a_message_whose_headers_are_not_json_is_dead_lettered_and_the_rest_flows(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """A writer that checks nothing (bytes made by hand, a writer of another version) can emit a message of our layout
    whose headers are not JSON: a dead letter (kept whole: a dead letter's headers column is jsonb), not a relay that
    dies on it at every start (found by the harness's forged-emit fault, seed 116)."""
    topic = new_topic("wal")
    content = encode(
        str(uuid.uuid4()).encode(), topic.encode(), b"k", None, b"{not json", b'{"n": 0}', binary=False, partition=None
    )
    with db.transaction():
        db.execute("SELECT pg_logical_emit_message(true, %s, %s::bytea)", (names_of(wal_outbox).prefix, content))
        enqueue(db, topic, {"n": 1}, key="other", table=wal_outbox)

    stats = make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    assert [r.value for r in kafka.consume(topic, expect=1)] == [b'{"n": 1}']
    [(dead_topic, error)] = _dead_letters(db, wal_outbox)
    assert dead_topic == UNSTORABLE_TOPIC and "headers" in error  # kept as the bytes it was emitted as
    assert stats.dead_lettered == 1
