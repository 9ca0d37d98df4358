"""A wal outbox's lag is its slot's (issue 42): the WAL the slot keeps, what the relay has not confirmed, the age of the
oldest unpublished commit, the lag objective's verdict on them, the metrics, and a missing or lost slot reported as
what it is, with the procedure."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable

import psycopg
from prometheus_client.core import Metric

from outbox_pipeline import Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.localstack import LocalPostgres
from outbox_pipeline.observe import LagSampler, LagThresholds, evaluate_wal_lag
from outbox_pipeline.observe.wal_lag import CAUGHT_UP, DECODED, wal_lag
from outbox_pipeline.store import init_db
from outbox_pipeline.store.wal.objects import names_of
from tests.engine.observe.conftest import lose_the_slot
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import wait_until
from tests.kit.relay import make_wal_relay


def flushed(db: psycopg.Connection) -> None:
    """Wait until the WAL written so far is flushed: the test server commits asynchronously, and the slot decodes only
    flushed WAL."""
    row = db.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
    assert row is not None
    wait_until(
        "the WAL flushed",
        lambda: bool(db.execute("SELECT pg_current_wal_flush_lsn() >= %s", (row[0],)).fetchone()[0]),  # type: ignore[index]
        10.0,
    )


def seconds_since(db: psycopg.Connection, at: dt.datetime) -> float:
    row = db.execute("SELECT extract(epoch FROM clock_timestamp() - %s)::float8", (at,)).fetchone()
    assert row is not None
    return float(row[0])


def retained(db: psycopg.Connection, table: OutboxTable) -> int:
    found = wal_lag(db, table, measure_age=False).slot.retained_bytes
    assert found is not None
    return found


def test_a_fresh_wal_outbox_has_its_slot_reserved_unstreamed_and_nothing_unpublished(
    db: psycopg.Connection, wal_outbox: OutboxTable
) -> None:
    lag = wal_lag(db, wal_outbox)

    assert (lag.slot.exists, lag.slot.wal_status, lag.streamed_by, lag.problem) == (True, "reserved", None, None)
    assert lag.oldest_unpublished_age_s == 0.0 and lag.age_measured_by in (DECODED, CAUGHT_UP)
    assert "no relay streams it" in lag.describe()


def test_retained_wal_grows_while_no_relay_runs_and_falls_back_once_a_relay_confirms(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("wal")
    before = retained(db, wal_outbox)
    with db.transaction():
        enqueue_many(db, [Message(topic, {"pad": "x" * 2000}, key=f"k{i % 8}") for i in range(1000)], table=wal_outbox)
    flushed(db)
    grown = retained(db, wal_outbox)
    db.execute("CHECKPOINT")  # logs the running transactions: a point the slot restarts from once confirmed past it

    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    assert grown >= before + 2_000_000
    wait_until("the slot releases what the relay confirmed", lambda: retained(db, wal_outbox) < 1_000_000, 10.0)


def test_the_oldest_unpublished_commit_is_decoded_from_a_copy_of_the_slot_while_no_relay_streams(
    db: psycopg.Connection, wal_outbox: OutboxTable
) -> None:
    with db.transaction():
        started = db.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        enqueue(db, "orders", {"n": 1}, key="k", table=wal_outbox)
    flushed(db)

    lag = wal_lag(db, wal_outbox)

    assert lag.age_measured_by == DECODED and lag.oldest_unpublished_age_s is not None
    assert 0.0 < lag.oldest_unpublished_age_s <= seconds_since(db, started)  # its commit came after its start
    slots = db.execute("SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE 'outbox_peek_%'").fetchall()
    assert slots == []  # the copy is gone


def test_messages_under_another_prefix_are_no_unpublished_commit_of_this_outbox(
    db: psycopg.Connection, wal_outbox: OutboxTable
) -> None:
    other = OutboxTable(schema=f"{wal_outbox.schema}_other", write_to="wal")
    db.execute("SELECT pg_logical_emit_message(true, 'another-application', 'not an outbox message')")
    db.execute("SELECT pg_logical_emit_message(true, %s, 'a message of another outbox')", (names_of(other).prefix,))
    flushed(db)

    lag = wal_lag(db, wal_outbox)

    assert (lag.oldest_unpublished_age_s, lag.age_measured_by) == (0.0, DECODED)
    assert lag.slot.unconfirmed_bytes is not None and lag.slot.unconfirmed_bytes > 0


def test_the_age_of_a_commit_a_streaming_relay_cannot_publish_is_decoded_and_grows(
    db: psycopg.Connection, wal_outbox: OutboxTable
) -> None:
    stop = threading.Event()
    stuck = make_wal_relay(
        db.info.dsn,
        wal_outbox,
        "127.0.0.1:1",  # nothing listens: Kafka confirms nothing
        stop=stop,
        until_idle=False,
        producer={"message.timeout.ms": 500},
    )
    thread = threading.Thread(target=stuck.run)
    thread.start()
    try:
        wait_until("the relay streams", lambda: wal_lag(db, wal_outbox, measure_age=False).streamed_by is not None, 10)
        enqueue(db, "orders", {"n": 1}, key="k", table=wal_outbox)

        flushed(db)
        first = wal_lag(db, wal_outbox)
        age = first.oldest_unpublished_age_s
        assert age is not None and age > 0.0
        wait_until("the age grows", lambda: (wal_lag(db, wal_outbox).oldest_unpublished_age_s or 0.0) > age, 10.0)
        streamed_by = wal_lag(db, wal_outbox).streamed_by
    finally:
        stop.set()
        thread.join(30)
    assert first.age_measured_by == DECODED and first.streamed_by is not None and streamed_by == first.streamed_by
    assert stuck.stats.published == 0


def test_a_dropped_slot_is_reported_missing_with_the_procedure_and_is_an_error(
    db: psycopg.Connection, wal_outbox: OutboxTable
) -> None:
    db.execute("SELECT pg_drop_replication_slot(%s)", (names_of(wal_outbox).slot,))

    lag = wal_lag(db, wal_outbox)
    verdict = evaluate_wal_lag(lag, LagThresholds())

    assert not lag.slot.exists and lag.oldest_unpublished_age_s is None
    assert lag.problem is not None and "without its replication slot" in lag.problem
    assert "outbox init-db --strategy wal" in lag.problem and lag.problem in lag.describe()
    assert verdict.severity == "error" and lag.problem in verdict.summary()


def test_retention_past_the_warn_threshold_warns_and_past_the_error_threshold_errors(
    db: psycopg.Connection, wal_outbox: OutboxTable
) -> None:
    lag = wal_lag(db, wal_outbox, measure_age=False)
    kept = lag.slot.retained_bytes
    assert kept is not None and kept > 0

    below = evaluate_wal_lag(lag, LagThresholds(warn_retained_bytes=kept, error_retained_bytes=kept))
    warned = evaluate_wal_lag(lag, LagThresholds(warn_retained_bytes=kept - 1, error_retained_bytes=kept))
    errored = evaluate_wal_lag(lag, LagThresholds(warn_retained_bytes=kept - 1, error_retained_bytes=kept - 1))

    assert [v.severity for v in (below, warned, errored)] == ["ok", "warn", "error"]
    assert warned.reasons == (f"slot {lag.slot.slot} retains {kept} bytes of WAL > warn {kept - 1}",)


def _gauges(sampler: LagSampler) -> dict[str, float]:
    families: list[Metric] = list(sampler.collect())
    return {sample.name: sample.value for family in families for sample in family.samples}


def test_the_metrics_show_the_bytes_the_slot_retains_and_has_not_confirmed(
    db: psycopg.Connection, wal_outbox: OutboxTable
) -> None:
    enqueue_many(db, [Message("orders", {"pad": "x" * 1000}, key="k") for _ in range(100)], table=wal_outbox)
    flushed(db)
    sampler = LagSampler(db.info.dsn, wal_outbox, "wal", interval_s=3600)

    sampler.sample()
    gauges = _gauges(sampler)

    assert gauges["outbox_wal_retained_bytes"] >= 100_000
    assert gauges["outbox_wal_unconfirmed_bytes"] >= 100_000
    assert gauges["outbox_wal_slot_usable"] == 1.0
    assert "outbox_pending_rows" not in gauges


def test_a_slot_past_max_slot_wal_keep_size_is_reported_lost_with_the_procedure_and_is_an_error(
    small_slot_server: LocalPostgres,
) -> None:
    table = OutboxTable(schema="lost_slot", write_to="wal")
    with psycopg.connect(small_slot_server.dsn, autocommit=True) as conn:
        init_db(conn, table, strategies=["wal"])
        enqueue(conn, "orders", {"n": 1}, key="k", table=table)
        lose_the_slot(conn, table)
        lag = wal_lag(conn, table)

    assert lag.problem is not None and "is lost (wal_status = 'lost')" in lag.problem
    assert "pg_drop_replication_slot" in lag.problem and "outbox init-db --strategy wal" in lag.problem
    assert evaluate_wal_lag(lag, LagThresholds()).severity == "error"
