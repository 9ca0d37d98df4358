"""Switching a live outbox to another relay strategy (docs/operations.md): nothing lost, nothing reordered, and no
relay reads another strategy's positions as its own."""

from __future__ import annotations

import threading
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.cli import main
from outbox_pipeline.errors import OutboxError
from outbox_pipeline.operate import discard_dead_letters, switch_strategy
from outbox_pipeline.relay import present
from outbox_pipeline.store import set_topic_partitions
from outbox_pipeline.strategies.positions import UNSCOPED_KIND
from tests.kit.kafka import KafkaProbe
from tests.kit.quarantine import POISON, arrived_by_key, poisoned
from tests.kit.relay import drain, make_relay, order_by_key, row_count


def _crossed_rows(db: psycopg.Connection, dsn: str, table: OutboxTable, topic: str) -> tuple[int, int]:
    """Two rows of one partition whose orders disagree: ``late`` has the lower id and the higher transaction id
    (its transaction began second and enqueued first). Returns (early's id, late's id)."""
    with psycopg.connect(dsn) as early, psycopg.connect(dsn) as late:
        early.execute("SELECT pg_current_xact_id()")
        late.execute("SELECT pg_current_xact_id()")
        late_id = enqueue(late, topic, {"row": "late"}, key="b", partition=0, table=table).id
        early_id = enqueue(early, topic, {"row": "early"}, key="a", partition=0, table=table).id
        early.commit()
        late.commit()
    return early_id, late_id


def _relay_one_row_as_partitioned(dsn: str, table: OutboxTable, bootstrap: str) -> None:
    relay = make_relay(dsn, table, bootstrap, "partitioned", batch_size=1)
    try:
        assert relay.run_once() is not None
    finally:
        relay.close()  # deregisters: a stopped relay, as the switch requires


def test_a_serialized_relay_refuses_positions_a_partitioned_relay_left_and_names_the_switch(
    dsn: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """By id, the partitioned position passed the row it has not published yet: read as serialized, it was lost."""
    topic = new_topic()
    set_topic_partitions(db, table, topic, 1)
    _crossed_rows(db, dsn, table, topic)
    _relay_one_row_as_partitioned(dsn, table, kafka.bootstrap_servers)

    with pytest.raises(OutboxError, match="outbox switch-strategy --to serialized"):
        drain(dsn, table, kafka.bootstrap_servers, "serialized")


def test_switching_partitioned_to_serialized_publishes_the_row_the_old_position_had_passed_by_id(
    dsn: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    set_topic_partitions(db, table, topic, 1)
    early, late = _crossed_rows(db, dsn, table, topic)
    _relay_one_row_as_partitioned(dsn, table, kafka.bootstrap_servers)

    switched = switch_strategy(db, table, "serialized")
    drain(dsn, table, kafka.bootstrap_servers, "serialized")

    assert switched.partitions == 1
    assert order_by_key(kafka.consume(topic, expect=3)) == {b"a": [early], b"b": [late]}


def test_switching_from_lease_mark_sent_to_partitioned_publishes_only_the_rows_not_yet_relayed(
    dsn: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=4)
    set_topic_partitions(db, table, topic, 4)
    enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i % 5}") for i in range(100)], table=table)
    drain(dsn, table, kafka.bootstrap_servers, "lease", mode="mark-sent")
    later = enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i % 5}") for i in range(50)], table=table)

    switch_strategy(db, table, "partitioned")
    drain(dsn, table, kafka.bootstrap_servers, "partitioned")

    arrived = order_by_key(kafka.consume(topic, expect=150, idle_s=3.0))
    assert sum(len(ids) for ids in arrived.values()) == 150  # none of the first 100 again
    assert {oid for ids in arrived.values() for oid in ids} >= {w.id for w in later}


def test_switching_from_partitioned_to_lease_deletes_what_was_relayed_so_nothing_is_published_twice(
    dsn: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=4)
    set_topic_partitions(db, table, topic, 4)
    enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i % 5}") for i in range(100)], table=table)
    drain(dsn, table, kafka.bootstrap_servers, "partitioned")
    enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i % 5}") for i in range(50)], table=table)

    switched = switch_strategy(db, table, "lease")
    left = row_count(db, table)
    drain(dsn, table, kafka.bootstrap_servers, "lease")

    assert (switched.rows, left) == (100, 50)
    arrived = kafka.consume(topic, expect=150, idle_s=3.0)
    assert len(arrived) == 150 and row_count(db, table) == 0


def test_the_switch_refuses_while_a_relay_worker_is_alive(dsn: str, db: psycopg.Connection, table: OutboxTable) -> None:
    with present(dsn, table, "relay-7", kind=UNSCOPED_KIND, liveness="session"):
        with pytest.raises(OutboxError, match="stop the relays before switching strategy: live relay workers: relay-7"):
            switch_strategy(db, table, "serialized")


def test_the_switch_to_a_position_strategy_waits_for_open_writer_transactions_and_says_so_when_one_stays_open(
    dsn: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    with psycopg.connect(dsn) as writer:
        enqueue(writer, "orders", {"n": 1}, key="a", table=table)  # and left open, as over lunch
        with pytest.raises(OutboxError, match="did not end within 1s"):
            switch_strategy(db, table, "partitioned", lock_timeout="1s")
        writer.rollback()


def test_switching_partitioned_to_serialized_per_the_procedure_while_writers_write_loses_and_reorders_nothing(
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """docs/operations.md, "Switching strategy": writers enqueue serialized throughout (a serialized outbox needs
    it); the index is built while they write and the partitioned relay runs; relays stop; switch; serialized
    relays start."""
    topic = new_topic(partitions=4)
    set_topic_partitions(db, table, topic, 4)
    stop_writers, stop_relay = threading.Event(), threading.Event()
    written: list[int] = []

    def write() -> None:
        with psycopg.connect(dsn) as conn:
            n = 0
            while not stop_writers.is_set():
                results = enqueue_many(
                    conn,
                    [Message(topic, {"n": n + i}, key=f"k{(n + i) % 6}") for i in range(5)],
                    serialized=True,
                    table=table,
                )
                conn.commit()
                written.extend(r.id for r in results)
                n += 5

    writer = threading.Thread(target=write)
    writer.start()
    relaying = _relaying(dsn, table, kafka.bootstrap_servers, "partitioned", stop_relay)
    try:
        assert main(["indexes", "--dsn", dsn, "--schema", table.schema, "--strategy", "serialized"]) == 0
        stop_relay.set()
        relaying.join(timeout=60)
        assert main(["switch-strategy", "--dsn", dsn, "--schema", table.schema, "--to", "serialized"]) == 0
        stop_relay.clear()
        relaying = _relaying(dsn, table, kafka.bootstrap_servers, "serialized", stop_relay)
    finally:
        stop_writers.set()
        writer.join(timeout=60)
    stop_relay.set()
    relaying.join(timeout=60)
    drain(dsn, table, kafka.bootstrap_servers, "serialized")

    assert "start its relays now" in capsys.readouterr().out
    by_key = order_by_key(kafka.consume(topic, expect=len(written), idle_s=3.0))
    assert sorted(oid for ids in by_key.values() for oid in ids) == sorted(written)
    assert all(ids == sorted(ids) for ids in by_key.values())  # serialized writers: id order is commit order


def _relaying(dsn: str, table: OutboxTable, bootstrap: str, strategy: str, stop: threading.Event) -> threading.Thread:
    """A relay woken by NOTIFY, running in a thread until ``stop``."""
    relay = make_relay(dsn, table, bootstrap, strategy, stop=stop, until_empty=False, max_seconds=None, listen=True)
    thread = threading.Thread(target=relay.run)
    thread.start()
    return thread


def test_the_switch_waits_until_rows_held_behind_a_discarded_dead_letter_are_relayed_and_then_loses_none(
    dsn: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """Issue 40, case 1: following the switch's own refusal (discard the dead letter, switch again), the switch to a
    row strategy passed while the key's held rows were still in outbox_held, which row strategies never read: they
    never reached Kafka."""
    topic = new_topic()
    written = poisoned("partitioned", db, table, kafka, topic)  # A4 dead-lettered, A5..A9 held behind it
    dead = db.execute(sql.SQL("SELECT id FROM {}").format(table.dead_letters)).fetchone()
    assert dead is not None
    discard_dead_letters(db, table, [dead[0]], reason="a bad row", by="test")

    with pytest.raises(OutboxError, match="5 rows held behind retried or discarded dead letters are not relayed yet"):
        switch_strategy(db, table, "locking")

    drain(dsn, table, kafka.bootstrap_servers, "partitioned")  # the current strategy relays them, in order
    switch_strategy(db, table, "locking")
    drain(dsn, table, kafka.bootstrap_servers, "locking")
    arrived = arrived_by_key(kafka, topic)
    assert arrived["A"] == [i for n, i in enumerate(written["A"]) if n != POISON]
    assert arrived["B"] == written["B"]
