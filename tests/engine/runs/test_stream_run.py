"""A long-lived relay worker (what a Dagster relay run drives) reports each partition's progress at intervals."""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from collections.abc import Callable

import psycopg
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.relay import KafkaPublisher, RelaySettings
from outbox_pipeline.runs import StreamReport, StreamRun
from outbox_pipeline.store import set_topic_partitions
from outbox_pipeline.strategies import StrategyConfig
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import message_ids


def _stream(dsn: str, table: OutboxTable, kafka: KafkaProbe, worker: str, window_s: float) -> StreamRun:
    return StreamRun(
        dsn,
        "partitioned",
        StrategyConfig(table=table, worker_id=worker),
        KafkaPublisher({"bootstrap.servers": kafka.bootstrap_servers, "message.timeout.ms": 10_000}),
        RelaySettings(batch_size=100, max_seconds=window_s),
        report_every_s=0.5,
    )


def _partitions(db: psycopg.Connection, table: OutboxTable) -> Counter[tuple[str, int]]:
    query = sql.SQL("SELECT topic, partition FROM {}").format(table.messages)
    return Counter((topic, partition) for topic, partition in db.execute(query))


def test_a_stream_run_relays_rows_written_while_it_runs_and_reports_every_partition_each_interval(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=4)
    set_topic_partitions(db, table, topic, 4)
    enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i}") for i in range(200)], table=table)
    written = _partitions(db, table)
    run = _stream(db.info.dsn, table, kafka, "stream-a", window_s=3.0)

    reports: list[StreamReport] = []
    for report in run.reports():
        if not reports:  # rows committed while the run waits for work: woken by NOTIFY
            enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i}") for i in range(200, 300)], table=table)
        reports.append(report)

    arrived = message_ids(kafka.consume(topic, idle_s=2.0))
    assert len(set(arrived)) == 300
    assert reports[-1].final and not any(r.final for r in reports[:-1])
    assert len(reports) >= 5  # a 3 s window reported every 0.5 s
    published = Counter[tuple[str, int]]()
    for report in reports:
        published.update({(p.topic, p.partition): p.published for p in report.partitions})
    assert sum(published.values()) == 300 == sum(r.published for r in reports)
    assert set(published) == set(written)
    # The only live worker is dealt every partition: each appears in every interval's report.
    assert all({(p.topic, p.partition) for p in r.partitions} == set(written) for r in reports[1:])
    assert all(p.home and p.lag is not None and p.lag.pending == 0 for p in reports[-1].partitions)


def test_two_stream_runs_report_disjoint_shares_of_the_partitions(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=4)
    set_topic_partitions(db, table, topic, 4)
    enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i}") for i in range(100)], table=table)
    runs = [_stream(db.info.dsn, table, kafka, f"stream-{n}", window_s=600.0) for n in range(2)]
    reports: dict[int, list[StreamReport]] = {0: [], 1: []}

    def relay(n: int) -> None:
        for report in runs[n].reports():
            reports[n].append(report)
            if len(reports[n]) == 4:  # both stop after their fourth report (2 s), so both run through the third
                runs[n].stop()

    threads = [threading.Thread(target=relay, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    # Both registered (from their first second on): each reports the 2 partitions dealt to it, never the other's.
    shares = [{(p.topic, p.partition) for p in reports[n][2].partitions if p.home} for n in range(2)]
    assert len(shares[0]) == len(shares[1]) == 2
    assert not shares[0] & shares[1]
    assert len(set(message_ids(kafka.consume(topic, idle_s=2.0)))) == 100


def test_stopping_a_stream_run_ends_it_with_a_final_report_and_deregisters_the_worker(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=2)
    set_topic_partitions(db, table, topic, 2)
    run = _stream(db.info.dsn, table, kafka, "stream-stop", window_s=600.0)

    reports = []
    for report in run.reports():
        reports.append(report)
        run.stop()

    assert reports[-1].final
    workers = db.execute(sql.SQL("SELECT worker_id FROM {}").format(table.workers)).fetchall()
    assert workers == []


def test_an_exception_in_the_caller_between_reports_still_stops_the_worker_on_close(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe
) -> None:
    run = _stream(db.info.dsn, table, kafka, "stream-interrupted", window_s=600.0)

    class Interrupted(Exception):
        pass

    try:
        for _ in run.reports():
            raise Interrupted  # an orchestrator's interrupt while the caller records a report
    except Interrupted:
        pass
    finally:
        run.close()

    assert run.relay.stop.is_set()
    assert db.execute(sql.SQL("SELECT worker_id FROM {}").format(table.workers)).fetchall() == []


def test_an_interrupt_by_signal_while_it_waits_still_ends_with_the_worker_deregistered_on_close(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe
) -> None:
    """What Ctrl-C or Dagster's interrupt does: a signal handler raises in the thread waiting for the next
    report. (A Thread.join interrupted that way marks the thread stopped while it still runs: closing must
    not trust it, or the process exits with the worker still registered.)"""

    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    run = _stream(db.info.dsn, table, kafka, "stream-signalled", window_s=600.0)
    raised = 0
    try:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR1)).start()  # while it waits for a report
        try:
            for _ in run.reports():
                pass
        except Interrupted:
            raised += 1
        run.close()  # at once: the relay thread needs a moment to see the stop and deregister
    finally:
        signal.signal(signal.SIGUSR1, previous)

    assert raised == 1
    assert db.execute(sql.SQL("SELECT worker_id FROM {}").format(table.workers)).fetchall() == []


def test_a_stream_run_whose_report_session_the_database_ended_goes_on_and_reports_lag_again(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """Issue 40, case 10: the report's one connection never reconnected, so a database restart (or an
    idle_session_timeout under the report interval) failed the Dagster run at its next report."""
    topic = new_topic(partitions=2)
    set_topic_partitions(db, table, topic, 2)
    enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i}") for i in range(50)], table=table)
    run = _stream(db.info.dsn, table, kafka, "stream-cut", window_s=3.0)

    reports: list[StreamReport] = []
    for report in run.reports():
        if len(reports) == 1:  # what a restart does to the report's session
            ended = db.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = 'outbox stream report'"
            ).fetchone()
            assert ended == (1,)
            enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i}") for i in range(50, 80)], table=table)
        reports.append(report)

    assert reports[-1].final
    assert len(set(message_ids(kafka.consume(topic, expect=80)))) == 80
    assert sum(r.published for r in reports) == 80  # no interval's counts lost with the session
    assert any(p.lag is None for r in reports[2:3] for p in r.partitions)  # the interval after the cut: no lag
    assert all(p.lag is not None and p.lag.pending == 0 for p in reports[-1].partitions)
