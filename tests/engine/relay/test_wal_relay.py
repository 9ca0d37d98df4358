"""The wal strategy's relay (issue 42): the slot's messages reach Kafka in commit order, confirmed to the slot only once
Kafka has them; a restart resumes after what was confirmed; a message Kafka never takes is dead-lettered."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from outbox_pipeline import Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.operate import discard_dead_letters, retry_dead_letters
from outbox_pipeline.relay import KafkaPublisher, RelaySettings, WalRelay
from outbox_pipeline.relay.wal.leader import LeaderSettings, SlotLeader
from outbox_pipeline.relay.wal.pgoutput import pg_clock_us, standby_status
from outbox_pipeline.relay.wal.stream import ReplicationStream
from outbox_pipeline.store import init_db
from outbox_pipeline.store.wal.format import decode
from outbox_pipeline.store.wal.grants import emit_function
from outbox_pipeline.store.wal.objects import drop_slot, names_of
from outbox_pipeline.store.wal.slot import SlotUnusable, slot_state
from tests.kit.kafka import KafkaProbe, Record
from tests.kit.probes import wait_until
from tests.kit.relay import make_wal_relay


def by_key(records: list[Record]) -> dict[bytes | None, list[bytes | None]]:
    streams: dict[bytes | None, list[bytes | None]] = defaultdict(list)
    for r in records:
        streams[r.key].append(r.value)
    return streams


def test_every_writer_form_arrives_in_kafka_in_the_order_it_committed(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("wal", partitions=3)
    with db.transaction():
        enqueue(db, topic, {"n": 1}, key="k", table=wal_outbox)
        db.execute(sql.SQL("SELECT {}(%s, '{{\"n\": 2}}', 'k')").format(wal_outbox.ident("enqueue")), (topic,))
        db.execute(
            sql.SQL("INSERT INTO {} (topic, key, payload) VALUES (%s, 'k', '{{\"n\": 3}}')").format(
                wal_outbox.messages
            ),
            (topic,),
        )
    with db.transaction():
        enqueue_many(db, [Message(topic, {"n": n}, key="k") for n in (4, 5)], table=wal_outbox)

    stats = make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    assert [r.value for r in kafka.consume(topic)] == [b'{"n": %d}' % n for n in range(1, 6)]
    assert stats.published == 5


def test_a_transaction_that_commits_later_is_published_later_whatever_it_wrote_first(
    db: psycopg.Connection,
    connect: Callable[[], psycopg.Connection],
    wal_outbox: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    topic = new_topic("wal")
    early = connect()
    with early.transaction():
        enqueue(early, topic, {"n": "written first, committed last"}, key="k", table=wal_outbox)
        with db.transaction():
            enqueue(db, topic, {"n": "written last, committed first"}, key="k", table=wal_outbox)

    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    assert [r.value for r in kafka.consume(topic)] == [
        b'{"n": "written last, committed first"}',
        b'{"n": "written first, committed last"}',
    ]


def test_a_rolled_back_transaction_publishes_nothing(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("wal")
    with db.transaction(force_rollback=True):
        enqueue(db, topic, {"n": 0}, key="k", table=wal_outbox)
    with db.transaction():
        enqueue(db, topic, {"n": 1}, key="k", table=wal_outbox)

    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    assert [r.value for r in kafka.consume(topic)] == [b'{"n": 1}']


def test_a_restarted_relay_resumes_after_what_it_confirmed(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("wal")
    with db.transaction():
        enqueue_many(db, [Message(topic, {"n": n}, key=f"k{n % 4}") for n in range(100)], table=wal_outbox)
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()
    with db.transaction():
        enqueue_many(db, [Message(topic, {"n": n}, key=f"k{n % 4}") for n in range(100, 150)], table=wal_outbox)

    second = make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    assert second.published == 50
    assert [r.value for r in kafka.consume(topic)] == [b'{"n": %d}' % n for n in range(150)]


def test_the_slot_is_confirmed_only_up_to_what_kafka_confirmed(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("wal")
    with db.transaction():
        enqueue(db, topic, {"n": 1}, key="k", table=wal_outbox)
    unreachable = make_wal_relay(
        db.info.dsn,
        wal_outbox,
        "127.0.0.1:1",  # nothing listens: Kafka confirms nothing
        max_seconds=3.0,
        producer={"message.timeout.ms": 500},
    )
    unreachable.run()
    assert unreachable.stats.published == 0

    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    assert [r.value for r in kafka.consume(topic)] == [b'{"n": 1}']


def test_a_message_kafka_refuses_is_dead_lettered_and_the_rest_of_the_stream_goes_on(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("wal")
    with db.transaction():
        enqueue(db, topic, {"n": 1}, key="a", table=wal_outbox)
        enqueue(db, topic, {"pad": "x" * 5000}, key="b", table=wal_outbox)
        enqueue(db, topic, {"n": 3}, key="a", table=wal_outbox)

    stats = make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, producer={"message.max.bytes": 2000}).run()

    assert [r.value for r in kafka.consume(topic)] == [b'{"n": 1}', b'{"n": 3}']
    assert stats.dead_lettered == 1
    row = db.execute(sql.SQL("SELECT key, last_error FROM {}").format(wal_outbox.dead_letters)).fetchone()
    assert row is not None and row[0] == "b" and "too large" in row[1].lower()


def test_a_waiting_relay_takes_over_when_the_streaming_one_stops(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("wal")
    first_stop, second_stop = threading.Event(), threading.Event()
    first = make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, stop=first_stop, until_idle=False)
    second = make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, stop=second_stop, until_idle=False)
    threads = [threading.Thread(target=relay.run) for relay in (first, second)]
    threads[0].start()
    wait_until("the first relay streams", lambda: slot_state(db, wal_outbox).active_pid is not None, 10.0)
    threads[1].start()
    with db.transaction():
        enqueue(db, topic, {"n": 1}, key="k", table=wal_outbox)
    wait_until("the first message is published", lambda: first.stats.published == 1, 10.0)

    first_stop.set()
    threads[0].join(10.0)
    with db.transaction():
        enqueue(db, topic, {"n": 2}, key="k", table=wal_outbox)
    wait_until("the waiting relay publishes", lambda: second.stats.published == 1, 15.0)
    second_stop.set()
    threads[1].join(10.0)

    assert [r.value for r in kafka.consume(topic)] == [b'{"n": 1}', b'{"n": 2}']


def _takes_over(
    db: psycopg.Connection,
    dsn: str,
    table: OutboxTable,
    settings: LeaderSettings,
    stream: ReplicationStream,
    frozen: SlotLeader,
) -> None:
    """A waiting relay takes the lock from the frozen streamer (``stream`` and ``frozen``: its walsender and its lock)
    within 20 s, and its walsender is ended; then every session is closed."""
    waiting = SlotLeader(dsn, table, threading.Event(), settings)
    try:
        assert waiting.acquire(deadline=time.monotonic() + 20.0), "the waiting relay did not take the lock"
        assert slot_state(db, table).active_pid is None  # the frozen stream's walsender was ended
    finally:
        waiting.release()
        stream.close()
        frozen.release()


def test_a_waiting_relay_takes_over_a_frozen_streamer_when_it_is_due_not_at_its_next_poll(
    db: psycopg.Connection, dsn: str, wal_outbox: OutboxTable
) -> None:
    """The waiting relay looks again when the streamer's silence reaches the takeover time, and takes the lock as soon
    as it has ended the frozen relay's sessions. A poll interval added to each stretched the harness's silence past
    its bound (seed 777, wal: 8.7 s for a 5 s takeover plus 3 s). Here the poll interval is an hour."""
    names = names_of(wal_outbox)
    frozen = SlotLeader(dsn, wal_outbox, threading.Event(), LeaderSettings())
    assert frozen.acquire()
    # Streams and never answers: a frozen pod's walsender, and a lock held by a session that says nothing more.
    stream = ReplicationStream.open(dsn, names.slot, names.publication, status_interval_s=3600.0)
    _takes_over(db, dsn, wal_outbox, LeaderSettings(poll_s=3600.0, takeover_after_s=1.0), stream, frozen)


@pytest.mark.timing
def test_a_frozen_streamer_whose_walsender_the_server_timed_out_is_taken_over(
    db: psycopg.Connection, dsn: str, wal_outbox: OutboxTable
) -> None:
    """``wal_sender_timeout`` shorter than the takeover time ends a frozen relay's walsender first; its lock's session
    stays, silent, and is what tells the waiting relay it is frozen (issue 50, case 7: never taken over)."""
    names = names_of(wal_outbox)
    frozen = SlotLeader(dsn, wal_outbox, threading.Event(), LeaderSettings())
    assert frozen.acquire()
    short = make_conninfo(dsn, options="-c wal_sender_timeout=1000")  # a user setting (PostgreSQL 12+)
    stream = ReplicationStream.open(short, names.slot, names.publication, status_interval_s=3600.0)
    wait_until("the server ends the silent walsender", lambda: slot_state(db, wal_outbox).active_pid is None, 15.0)
    waiting = SlotLeader(dsn, wal_outbox, threading.Event(), LeaderSettings(poll_s=0.2, takeover_after_s=2.0))
    try:
        assert waiting.acquire(deadline=time.monotonic() + 20.0), "the waiting relay did not take the lock"
    finally:
        waiting.release()
        stream.close()
        frozen.release()


@pytest.mark.timing
def test_a_frozen_streamer_whose_clock_runs_ahead_is_taken_over(
    db: psycopg.Connection, dsn: str, wal_outbox: OutboxTable
) -> None:
    """A status update carries the client's clock (``pg_stat_replication.reply_time``): a frozen relay whose clock ran
    an hour ahead looked alive for that hour. The takeover judges by the server's clock only (issue 50, case 12)."""
    names = names_of(wal_outbox)
    frozen = SlotLeader(dsn, wal_outbox, threading.Event(), LeaderSettings())
    assert frozen.acquire()
    stream = ReplicationStream.open(dsn, names.slot, names.publication, status_interval_s=3600.0)
    ahead = standby_status(stream.confirmed, stream.confirmed, stream.confirmed, pg_clock_us(time.time() + 3600))
    stream._pgconn.put_copy_data(ahead)
    stream._pgconn.flush()
    wait_until(
        "the server has the status update",
        lambda: _replied_from_the_future(db, slot_state(db, wal_outbox).active_pid),
        10.0,
    )
    _takes_over(db, dsn, wal_outbox, LeaderSettings(poll_s=0.2, takeover_after_s=2.0), stream, frozen)


def _replied_from_the_future(db: psycopg.Connection, walsender: int | None) -> bool:
    row = db.execute("SELECT reply_time > now() FROM pg_stat_replication WHERE pid = %s", (walsender,)).fetchone()
    return bool(row and row[0])


def _write(db: psycopg.Connection, table: OutboxTable, topic: str, *messages: tuple[str, object]) -> None:
    with db.transaction():
        for key, payload in messages:
            enqueue(db, topic, payload, key=key, table=table)


def held_payloads(db: psycopg.Connection, table: OutboxTable) -> list[bytes]:
    """The payloads in ``outbox_held``, in id order: each held message is kept whole, as emitted (holds.py)."""
    held = db.execute(sql.SQL("SELECT payload_bytes FROM {} ORDER BY id").format(table.held)).fetchall()
    return [decode(kept).payload for (kept,) in held]


SMALL = {"message.max.bytes": 2000}  # a 5,000-byte message is one Kafka will never take
POISON = {"pad": "x" * 5000}


def test_a_poison_message_holds_only_its_key_until_an_operator_retries_it(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("wal")
    _write(db, wal_outbox, topic, ("a", {"n": 1}), ("b", POISON), ("b", {"n": 2}))
    _write(db, wal_outbox, topic, ("a", {"n": 3}), ("b", {"n": 4}))
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, producer=SMALL).run()

    assert by_key(kafka.consume(topic)) == {b"a": [b'{"n": 1}', b'{"n": 3}']}
    assert held_payloads(db, wal_outbox) == [b'{"n": 2}', b'{"n": 4}']

    [(dead_letter,)] = db.execute(sql.SQL("SELECT id FROM {}").format(wal_outbox.dead_letters)).fetchall()
    assert retry_dead_letters(db, wal_outbox, ids=[dead_letter]) == 1
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()  # Kafka takes it now

    assert [len(v or b"") > 5000 or v for v in by_key(kafka.consume(topic))[b"b"]] == [True, b'{"n": 2}', b'{"n": 4}']
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(wal_outbox.holds)).fetchone() == (0,)


def test_discarding_the_dead_letter_publishes_what_its_key_held_without_it(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("wal")
    _write(db, wal_outbox, topic, ("b", POISON), ("b", {"n": 2}))
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, producer=SMALL).run()
    [(dead_letter,)] = db.execute(sql.SQL("SELECT id FROM {}").format(wal_outbox.dead_letters)).fetchall()

    discard_dead_letters(db, wal_outbox, [dead_letter], reason="a test")
    _write(db, wal_outbox, topic, ("b", {"n": 3}))
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, producer=SMALL).run()

    assert by_key(kafka.consume(topic)) == {b"b": [b'{"n": 2}', b'{"n": 3}']}


def test_a_held_message_is_published_byte_for_byte_as_its_writer_wrote_it(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """Issue 50, case 12: before, a held JSON payload was stored as jsonb and published re-rendered (b'{"a": 1.0, "b":
    1}'), unlike the same writer's unheld message."""
    topic = new_topic("wal")
    payload = {"b": 1, "a": 1.0}
    _write(db, wal_outbox, topic, ("held", POISON), ("held", payload), ("free", payload))
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, producer=SMALL).run()
    [(dead_letter,)] = db.execute(sql.SQL("SELECT id FROM {}").format(wal_outbox.dead_letters)).fetchall()

    discard_dead_letters(db, wal_outbox, [dead_letter], reason="a test")
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    streams = by_key(kafka.consume(topic))
    assert streams[b"held"] == streams[b"free"] == [b'{"b": 1, "a": 1.0}']


def test_a_held_message_refused_at_its_release_and_retried_goes_out_as_its_writer_wrote_it(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """A held message kept whole becomes the key's dead letter whole when Kafka refuses it at the release; retried, it
    is published from those bytes again."""
    topic = new_topic("wal")
    larger = {"b": 1, "a": 1.0, "pad": "y" * 9000}
    _write(db, wal_outbox, topic, ("k", POISON), ("k", larger), ("k", {"n": 3}))
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, producer=SMALL).run()
    [(first,)] = db.execute(sql.SQL("SELECT id FROM {}").format(wal_outbox.dead_letters)).fetchall()
    retry_dead_letters(db, wal_outbox, ids=[first])
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, producer={"message.max.bytes": 8000}).run()
    [(second,)] = db.execute(
        sql.SQL("SELECT id FROM {} WHERE id <> %s").format(wal_outbox.dead_letters), (first,)
    ).fetchall()

    retry_dead_letters(db, wal_outbox, ids=[second])
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    values = by_key(kafka.consume(topic))[b"k"]
    assert values[1:] == [json.dumps(larger).encode(), b'{"n": 3}']


def test_with_skip_a_poison_message_leaves_a_hole_and_its_key_flows_on(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("wal")
    _write(db, wal_outbox, topic, ("b", {"n": 1}), ("b", POISON), ("b", {"n": 3}))

    relay = make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, producer=SMALL, on_poison="skip")
    relay.run()

    assert by_key(kafka.consume(topic)) == {b"b": [b'{"n": 1}', b'{"n": 3}']}
    assert relay.stats.dead_lettered == 1


def test_a_transaction_left_open_on_the_database_holds_back_nothing_committed_after_it(
    db: psycopg.Connection,
    connect: Callable[[], psycopg.Connection],
    wal_outbox: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    topic = new_topic("wal")
    lunch = connect()
    lunch.execute("BEGIN")
    lunch.execute("SELECT pg_current_xact_id()")  # a psql BEGIN that wrote, left open over lunch
    lunch.execute("CREATE TEMP TABLE over_lunch (n int)")
    _write(db, wal_outbox, topic, ("k", {"n": 1}), ("k", {"n": 2}))

    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    assert [r.value for r in kafka.consume(topic)] == [b'{"n": 1}', b'{"n": 2}']
    lunch.execute("ROLLBACK")


def test_a_relay_refuses_a_wal_outbox_whose_slot_is_gone_and_says_how_to_recover(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe
) -> None:
    db.execute("SELECT pg_drop_replication_slot(%s)", (names_of(wal_outbox).slot,))

    with pytest.raises(SlotUnusable, match=r"without its replication slot .* `outbox init-db --strategy wal`"):
        make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()


def _outbox_of_a_relay_role(db: psycopg.Connection, dsn: str) -> tuple[str, str, OutboxTable]:
    """A wal outbox made by a role of the relays' own (REPLICATION, no superuser, no monitoring rights): the role,
    its conninfo and the outbox. init-db's role emits (docs/wal.md): the right a superuser's init-db revoked from
    PUBLIC here."""
    role = f"relay_{uuid.uuid4().hex[:8]}"
    db.execute(sql.SQL("CREATE ROLE {} LOGIN REPLICATION NOSUPERUSER").format(sql.Identifier(role)))
    db.execute(
        sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(sql.Identifier(db.info.dbname), sql.Identifier(role))
    )
    db.execute(sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(sql.SQL(emit_function(db)), sql.Identifier(role)))
    as_role = make_conninfo(dsn, user=role)
    table = OutboxTable(schema=f"w_{uuid.uuid4().hex[:12]}", write_to="wal")
    with psycopg.connect(as_role, autocommit=True) as conn:
        init_db(conn, table, strategies=["wal"])
    return role, as_role, table


def test_a_streaming_relay_of_a_role_without_monitoring_rights_is_not_taken_for_frozen(
    db: psycopg.Connection, dsn: str, kafka: KafkaProbe
) -> None:
    """pg_stat_replication shows a walsender's reply time only to superusers and pg_read_all_stats; a relay's role
    has REPLICATION (docs/wal.md), and a waiting relay of that role must still tell a live streamer from a frozen one.
    Found by the harness (seed 1, wal, 20 s): every streamer was ended by the waiting relay, busy or idle."""
    role, as_role, table = _outbox_of_a_relay_role(db, dsn)
    takeover = RelaySettings(wal_leader_poll_s=0.1, wal_takeover_s=1.0)
    stops = [threading.Event(), threading.Event()]
    relays = [
        WalRelay(
            as_role,
            table,
            KafkaPublisher({"bootstrap.servers": kafka.bootstrap_servers}),
            takeover,
            stop,
        )
        for stop in stops
    ]
    threads = [threading.Thread(target=relay.run) for relay in relays]
    try:
        threads[0].start()
        wait_until("the first relay streams", relays[0].registered.is_set, 10.0)
        streaming = slot_state(db, table).active_pid
        threads[1].start()
        wait_until(
            "the first relay has streamed for four takeover times",
            lambda: _seconds_since_start(db, streaming) > 4 * takeover.wal_takeover_s,
            15.0,
        )

        assert slot_state(db, table).active_pid == streaming
        assert not relays[1].registered.is_set()
    finally:
        for stop in stops:
            stop.set()
        for thread in threads:
            thread.join(15.0)
        drop_slot(db, table)
        db.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(table.schema_ident))
        db.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def _seconds_since_start(db: psycopg.Connection, pid: int | None) -> float:
    row = db.execute("SELECT extract(epoch FROM now() - backend_start) FROM pg_stat_activity WHERE pid = %s", (pid,))
    found = row.fetchone()
    return float(found[0]) if found else 0.0


def test_a_retried_dead_letter_kafka_still_refuses_is_dead_lettered_again_and_its_key_stays_held(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """Found by the harness (seed 1, wal, 20 s): the streamer published the released key's held messages again and
    again, the retried dead letter at their head refused each time, and the key's later messages never went out."""
    topic = new_topic("wal")
    _write(db, wal_outbox, topic, ("b", POISON), ("b", {"n": 2}))
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, producer=SMALL).run()
    [(dead_letter,)] = db.execute(sql.SQL("SELECT id FROM {}").format(wal_outbox.dead_letters)).fetchall()
    retry_dead_letters(db, wal_outbox, ids=[dead_letter])
    _write(db, wal_outbox, topic, ("b", {"n": 3}))

    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, producer=SMALL).run()  # Kafka still refuses it

    letter = sql.SQL("SELECT retried_at IS NULL, last_error FROM {} WHERE id = %s").format(wal_outbox.dead_letters)
    row = db.execute(letter, (dead_letter,)).fetchone()
    assert row is not None and row[0] and "too large" in row[1].lower()
    hold = sql.SQL("SELECT dead_letter_id, released_at IS NULL FROM {} WHERE key = 'b'").format(wal_outbox.holds)
    assert db.execute(hold).fetchone() == (dead_letter, True)
    assert held_payloads(db, wal_outbox) == [b'{"n": 2}', b'{"n": 3}']

    discard_dead_letters(db, wal_outbox, [dead_letter], reason="too large for good")
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    assert by_key(kafka.consume(topic)) == {b"b": [b'{"n": 2}', b'{"n": 3}']}


def test_a_relay_with_max_seconds_stops_in_time_while_another_streams_the_slot(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe
) -> None:
    """`outbox relay --until-empty --max-seconds 6` beside the streaming relay (the harness's drain) waited for the
    slot without end; it stops at its --max-seconds and says why, as a table strategy's drain does."""
    stop = threading.Event()
    streaming = make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, stop=stop, until_idle=False)
    thread = threading.Thread(target=streaming.run)
    thread.start()
    try:
        wait_until("the first relay streams", streaming.registered.is_set, 10.0)
        drain = make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, max_seconds=1.0)
        done = threading.Event()

        def drain_then_done() -> None:
            drain.run()
            done.set()

        threading.Thread(target=drain_then_done, daemon=True).start()

        wait_until("the drain gives up at its --max-seconds", done.is_set, 15.0)
        assert drain.stats.published == 0
        assert any("another relay streams" in line for line in drain.stats.remaining)
    finally:
        stop.set()
        thread.join(15.0)


def test_a_held_keys_messages_are_published_in_commit_order_when_released(
    db: psycopg.Connection,
    connect: Callable[[], psycopg.Connection],
    wal_outbox: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    """Held messages were released in the order they were written (their own LSNs), not the order their
    transactions committed: a transaction that wrote first and committed last went first."""
    topic = new_topic("wal")
    _write(db, wal_outbox, topic, ("b", POISON))
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, producer=SMALL).run()  # b is held now
    early = connect()
    with early.transaction():
        enqueue(early, topic, {"n": "written first, committed last"}, key="b", table=wal_outbox)
        _write(db, wal_outbox, topic, ("b", {"n": "written last, committed first"}))
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers, producer=SMALL).run()  # both held
    [(dead_letter,)] = db.execute(sql.SQL("SELECT id FROM {}").format(wal_outbox.dead_letters)).fetchall()

    discard_dead_letters(db, wal_outbox, [dead_letter], reason="a test")
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    assert [r.value for r in kafka.consume(topic)] == [
        b'{"n": "written last, committed first"}',
        b'{"n": "written first, committed last"}',
    ]


def test_a_streaming_relay_waiting_for_a_broker_that_is_down_is_not_taken_for_frozen(
    db: psycopg.Connection, wal_outbox: OutboxTable, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("wal")
    stops = threading.Event(), threading.Event()
    # Kafka's answer takes longer than the takeover time: 9 s against 4 (the first publish to a topic also waits up
    # to 2 s reading its limits, topic_limits.py).
    settings = RelaySettings(wal_leader_poll_s=0.2, wal_takeover_s=4.0, error_backoff_max_s=1.0)
    down = {"bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": 9000}
    relays = [WalRelay(db.info.dsn, wal_outbox, KafkaPublisher(down), settings, stop) for stop in stops]
    threads = [threading.Thread(target=relay.run) for relay in relays]
    threads[0].start()
    wait_until("the first relay streams", lambda: relays[0].registered.is_set(), 10.0)
    threads[1].start()
    _write(db, wal_outbox, topic, ("k", {"n": 1}))
    try:
        deadline = time.monotonic() + 9.0  # the batch waits on Kafka for longer than the takeover time
        while time.monotonic() < deadline and not relays[1].registered.is_set():
            stops[0].wait(0.1)
        taken_over = relays[1].registered.is_set()
    finally:
        for stop in stops:
            stop.set()
        for thread in threads:
            thread.join(30)

    assert not taken_over


@pytest.mark.timing
def test_a_streaming_relay_publishing_a_released_key_to_a_broker_that_is_down_is_not_taken_for_frozen(
    db: psycopg.Connection, wal_outbox: OutboxTable, new_topic: Callable[..., str]
) -> None:
    """What a key held when an operator released it goes to Kafka while the streamer goes on saying it is alive
    (issue 50, case 12: with Kafka down, a waiting relay ended the live streamer, and the two took turns)."""
    topic = new_topic("wal")
    stops = threading.Event(), threading.Event()
    settings = RelaySettings(wal_leader_poll_s=0.2, wal_takeover_s=4.0, error_backoff_max_s=1.0)
    down = {"bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": 9000, **SMALL}
    relays = [WalRelay(db.info.dsn, wal_outbox, KafkaPublisher(down), settings, stop) for stop in stops]
    threads = [threading.Thread(target=relay.run) for relay in relays]
    threads[0].start()
    try:
        wait_until("the first relay streams", relays[0].registered.is_set, 10.0)
        _write(db, wal_outbox, topic, ("b", POISON), ("b", {"n": 2}))  # refused by the producer itself: no broker
        wait_until("the key is held", lambda: _count(db, wal_outbox.schema, "outbox_held") == 1, 15.0)
        threads[1].start()
        [(dead_letter,)] = db.execute(sql.SQL("SELECT id FROM {}").format(wal_outbox.dead_letters)).fetchall()
        discard_dead_letters(db, wal_outbox, [dead_letter], reason="a test")
        deadline = time.monotonic() + 9.0  # the released message waits on Kafka for longer than the takeover time
        while time.monotonic() < deadline and not relays[1].registered.is_set():
            stops[0].wait(0.1)
        taken_over = relays[1].registered.is_set()
    finally:
        for stop in stops:
            stop.set()
        for thread in threads:
            if thread.is_alive():
                thread.join(30)

    assert not taken_over


def _count(db: psycopg.Connection, schema: str, table: str) -> int:
    row = db.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, table))).fetchone()
    return int(row[0]) if row else 0


def test_a_relay_that_finds_the_slot_streamed_by_a_process_it_cannot_end_waits_and_streams_once_it_is_gone(
    db: psycopg.Connection, dsn: str, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """Another process streams the slot and this relay's role may not end it (a superuser's pg_recvlogical): the
    relay waits and tries again, as for any other streamer of the slot (issue 50, case 12: the worker ended)."""
    topic = new_topic("wal")
    role, as_role, table = _outbox_of_a_relay_role(db, dsn)
    names = names_of(table)
    holder = ReplicationStream.open(dsn, names.slot, names.publication)  # the superuser's
    stop = threading.Event()
    settings = RelaySettings(error_backoff_base_s=0.2, error_backoff_max_s=0.5)
    relay = WalRelay(as_role, table, KafkaPublisher({"bootstrap.servers": kafka.bootstrap_servers}), settings, stop)
    failure: list[BaseException] = []
    thread = threading.Thread(target=lambda: _run_catching(relay, failure))
    try:
        thread.start()
        wait_until("the relay has tried twice", lambda: relay.stats.errors >= 2 or not thread.is_alive(), 15.0)
        holder.close()
        _write(db, table, topic, ("k", {"n": 1}))
        wait_until("the relay publishes", lambda: relay.stats.published == 1 or not thread.is_alive(), 20.0)
        assert failure == []
        assert relay.stats.published == 1
    finally:
        stop.set()
        thread.join(15.0)
        holder.close()
        drop_slot(db, table)
        db.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(table.schema_ident))
        db.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def _run_catching(relay: WalRelay, failure: list[BaseException]) -> None:
    try:
        relay.run()
    except BaseException as exc:  # the test asserts there was none
        failure.append(exc)


def test_a_streamer_hands_kafka_nothing_once_it_may_have_been_taken_over(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """A relay frozen between its last sign of life and handing a batch over may have been replaced when it thaws:
    from half the takeover time after its last heartbeat on, it hands Kafka nothing (what it handed over is purged)
    and tries again after a heartbeat (issue 50, case 6). Here the takeover time is shorter than any hand-over."""
    topic = new_topic("wal")
    _write(db, wal_outbox, topic, *[("k", {"n": n}) for n in range(1000)])
    settings = RelaySettings(wal_takeover_s=1e-6, max_seconds=3.0, error_backoff_base_s=0.1, error_backoff_max_s=0.2)
    publisher = KafkaPublisher({"bootstrap.servers": kafka.bootstrap_servers})
    try:
        stats = WalRelay(db.info.dsn, wal_outbox, publisher, settings).run()
    finally:
        publisher.close()

    assert kafka.consume(topic) == []
    assert stats.published == 0
