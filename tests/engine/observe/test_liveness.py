"""Who is alive (liveness.py, presence.py): a worker's session lock speaks for this outbox only, in this database
only, and one worker id is one live process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.localstack import LocalPostgres
from outbox_pipeline.observe import live_workers, reap
from outbox_pipeline.relay import WorkerIdInUseError, WorkerPresence
from outbox_pipeline.store import init_db, set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import lease_partition, wait_until
from tests.kit.relay import drain, make_relay, message_ids
from tests.kit.workers import WorkerProcess

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def other_database(pg_server: LocalPostgres, db: psycopg.Connection, table: OutboxTable) -> Iterator[str]:
    """Another database on the same server with an outbox of the same schema name (staging beside prod)."""
    name = f"other_{uuid.uuid4().hex[:8]}"
    db.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    with psycopg.connect(pg_server.dsn_for(name), autocommit=True) as conn:
        init_db(conn, table)
    yield pg_server.dsn_for(name)
    db.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def _lock_waits(db: psycopg.Connection) -> int:
    row = db.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted").fetchone()
    return int(row[0]) if row else 0


def _crash(db: psycopg.Connection, conn: psycopg.Connection) -> None:
    """The worker's process dies: its session ends (waiting until its backend is gone)."""
    db.execute("SELECT pg_terminate_backend(%s, 10000)", [conn.info.backend_pid])


def test_a_worker_id_alive_in_another_database_keeps_no_dead_worker_of_this_one_alive(
    db: psycopg.Connection,
    table: OutboxTable,
    other_database: str,
    connect: Callable[[], psycopg.Connection],
) -> None:
    with psycopg.connect(other_database, autocommit=True) as staging:
        WorkerPresence(staging, table, "twin-0", "session").register()  # alive, in the other database
        prod = connect()
        assert WorkerPresence(prod, table, "twin-0", "session").register() == "session"
        lease_partition(db, table, "twin-0")
        _crash(db, prod)

        assert [w.worker_id for w in live_workers(db, table, 60.0)] == []  # the sensor's coverage count
        assert reap(db, table).partitions == 1


def test_the_same_worker_id_in_another_outbox_schema_of_the_database_is_another_worker(
    db: psycopg.Connection,
    outbox_tables: Callable[[str], OutboxTable],
    connect: Callable[[], psycopg.Connection],
) -> None:
    a, b = outbox_tables(db.info.dsn), outbox_tables(db.info.dsn)
    WorkerPresence(connect(), b, "twin-0", "session").register()
    prod = connect()

    assert WorkerPresence(prod, a, "twin-0", "session").register() == "session"
    lease_partition(db, a, "twin-0")
    _crash(db, prod)
    assert reap(db, a).partitions == 1
    assert [w.worker_id for w in live_workers(db, b, 60.0)] == ["twin-0"]


def test_a_relay_whose_worker_id_is_held_by_a_live_session_refuses_to_start_and_names_it(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, connect: Callable[[], psycopg.Connection]
) -> None:
    holder = connect()
    WorkerPresence(holder, table, "same-id", "session").register()
    second = make_relay(
        db.info.dsn,
        table,
        kafka.bootstrap_servers,
        "partitioned",
        worker_id="same-id",
        settings={"worker_id_wait_s": 0.5},
    )

    with pytest.raises(WorkerIdInUseError, match=rf"in use by a live session \(pid {holder.info.backend_pid},"):
        second.run()
    second.close()


def test_a_relay_waits_for_the_session_that_held_its_worker_id_to_end_then_relays(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    connect: Callable[[], psycopg.Connection],
) -> None:
    """A replaced pod under a stable id whose old session lingers: the new one waits for it, then takes over."""
    topic = new_topic()
    written = enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i % 3}") for i in range(30)], table=table)
    lingering = connect()
    WorkerPresence(lingering, table, "pod-0", "session").register()
    replacement = make_relay(db.info.dsn, table, kafka.bootstrap_servers, "partitioned", worker_id="pod-0")
    thread = threading.Thread(target=replacement.run)
    thread.start()
    try:
        wait_until("the replacement to wait for its id's lock", lambda: _lock_waits(db) == 1, 30)
        assert kafka.consume(topic, idle_s=1.0) == []  # nothing published while the old session lives
        _crash(db, lingering)
        thread.join(60)
    finally:
        replacement.stop.set()
        thread.join()
    assert sorted(message_ids(kafka.consume(topic, expect=30))) == sorted(str(w.message_id) for w in written)


def test_two_cli_relays_given_one_worker_id_publish_nothing_twice_the_second_refuses_and_says_why(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    common = ["--dsn", db.info.dsn, "--schema", table.schema, "--strategy", "partitioned", "--worker-id", "same-id"]
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "OUTBOX_WORKER_ID_WAIT_S": "1"}
    first = subprocess.Popen(
        [sys.executable, "-m", "outbox_pipeline.cli", "relay", *common],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until("the first relay to register", lambda: len(live_workers(db, table, 60.0)) == 1, 60)
        for n in range(300):
            enqueue_many(db, [Message(topic, {"n": n, "i": i}, key=f"k{i}") for i in range(10)], table=table)
        second = subprocess.run(
            [sys.executable, "-m", "outbox_pipeline.cli", "relay", "--until-empty", *common],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        records = kafka.consume(topic, expect=3000)
    finally:
        first.terminate()
        first.wait(60)
    assert second.returncode != 0
    said = second.stdout + second.stderr
    assert "worker id 'same-id-0'" in said and "in use by a live session (pid " in said
    arrived = message_ids(records)
    assert len(arrived) == 3000 == len(set(arrived))


@pytest.mark.parametrize("strategy", ["lease", "partitioned", "serialized"])
def test_a_worker_that_exits_on_an_exception_frees_what_it_leased_at_once(
    strategy: str,
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    workers: Callable[..., WorkerProcess],
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    """Issue 40, case 13: its registration went with it, so the reaper could not free its leases, and every other
    worker waited ``lease_s`` (here ten minutes) for them."""
    topic = new_topic(partitions=2)
    set_topic_partitions(db, table, topic, 2)
    written = [
        str(e.message_id)
        for e in enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i % 5}") for i in range(400)], table=table)
    ]
    failing = workers(
        "failing", dsn=dsn, table=table, bootstrap=kafka.bootstrap_servers, strategy=strategy,
        config={"lease_s": 600}, fail_after_publish=1,
    ).start()  # fmt: skip
    assert failing.wait(60) != 0  # it exited on the exception

    held = db.execute(
        sql.SQL(
            "SELECT (SELECT count(*) FROM {offsets} WHERE locked_by = 'failing'), "
            "(SELECT count(*) FROM {leases} WHERE locked_by = 'failing')"
        ).format(offsets=table.offsets, leases=table.leases)
    ).fetchone()
    assert held == (0, 0)
    drain(dsn, table, kafka.bootstrap_servers, strategy, worker_id="next", lease_s=600, max_seconds=30)
    # Everything, once at least: what the failing worker published before it failed comes again (not acked).
    assert set(message_ids(kafka.consume(topic, idle_s=2.0))) == set(written)
