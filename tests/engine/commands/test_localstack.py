"""The local dev/test servers: ports, PostgreSQL lifecycle, and the broker (round trip, freeze/thaw).

Self-contained on purpose (fixtures prefixed `ls_`): these are the servers every other test builds on.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, Producer, TopicPartition

from outbox_pipeline.localstack import (
    BrokerSpec,
    LocalBroker,
    LocalPostgres,
    PortInUseError,
    PostgresSpec,
    free_port,
)

DeliveryReports = list[tuple[KafkaError | None, bytes | None]]


@pytest.fixture(scope="module")
def ls_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    pg = LocalPostgres(PostgresSpec(data_dir=tmp_path_factory.mktemp("ls_pg") / "data", port=free_port()))
    pg.start()
    try:
        yield pg
    finally:
        pg.stop("fast", force=True)


@pytest.fixture(scope="module")
def ls_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    log_path = tmp_path_factory.mktemp("ls_broker") / "broker.log"
    broker = LocalBroker(BrokerSpec(port=free_port(), log_path=log_path))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def ls_taken_port() -> Iterator[int]:
    """A port held by a listening socket of ours, like a stray server would hold it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _producer(broker: LocalBroker) -> Producer:
    return Producer({"bootstrap.servers": broker.bootstrap_servers, "enable.idempotence": True, "acks": "all"})


def _record_into(reports: DeliveryReports) -> Callable[[KafkaError | None, Message], None]:
    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        reports.append((err, msg.value()))

    return on_delivery


def test_postgres_on_taken_port_raises_port_in_use(tmp_path: Path, ls_taken_port: int) -> None:
    pg = LocalPostgres(PostgresSpec(data_dir=tmp_path / "data", port=ls_taken_port))
    with pytest.raises(PortInUseError, match=f"127.0.0.1:{ls_taken_port} is already in use"):
        pg.start()
    assert pg.pid is None and not pg.started_by_us


def test_broker_on_taken_port_raises_port_in_use(ls_taken_port: int) -> None:
    broker = LocalBroker(BrokerSpec(port=ls_taken_port))
    with pytest.raises(PortInUseError, match=f"127.0.0.1:{ls_taken_port} is already in use"):
        broker.start()
    assert broker.pid is None


def test_postgres_accepts_tcp_connections_on_loopback_only(ls_pg: LocalPostgres) -> None:
    with psycopg.connect(ls_pg.dsn, autocommit=True) as conn:
        listen = conn.execute("SHOW listen_addresses").fetchone()
        peer = conn.execute("SELECT host(inet_server_addr())").fetchone()
    assert listen == ("127.0.0.1",)
    assert peer == ("127.0.0.1",)  # NULL would mean a Unix socket


def test_postgres_immediate_restart_keeps_committed_data(ls_pg: LocalPostgres) -> None:
    with psycopg.connect(ls_pg.dsn) as conn:
        conn.execute("CREATE TABLE ls_restart (id int PRIMARY KEY, note text)")
        conn.execute("INSERT INTO ls_restart VALUES (1, 'survives')")
        conn.commit()
    old_pid = ls_pg.pid

    ls_pg.restart(mode="immediate")

    assert ls_pg.pid not in (None, old_pid)
    with psycopg.connect(ls_pg.dsn) as conn:
        assert conn.execute("SELECT id, note FROM ls_restart").fetchall() == [(1, "survives")]


def test_second_handle_reuses_running_server_and_its_stop_leaves_it_running(ls_pg: LocalPostgres) -> None:
    pid = ls_pg.pid
    second = LocalPostgres(ls_pg.spec)

    second.start()
    assert not second.started_by_us
    assert second.pid == pid
    second.stop()

    assert ls_pg.pid == pid
    with psycopg.connect(ls_pg.dsn) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_stale_postmaster_pid_does_not_block_start(tmp_path: Path) -> None:
    pg = LocalPostgres(PostgresSpec(data_dir=tmp_path / "data", port=free_port()))
    pg.start()
    pid_file = pg.spec.data_dir / "postmaster.pid"
    contents = pid_file.read_text().splitlines(keepends=True)
    pg.stop()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid is now certainly not a live process
    pid_file.write_text("".join([f"{dead.pid}\n", *contents[1:]]))

    try:
        pg.start()
        assert pg.pid not in (None, dead.pid)
        with psycopg.connect(pg.dsn) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        pg.stop()


def test_broker_round_trips_a_message(ls_broker: LocalBroker) -> None:
    topic = "ls-round-trip"
    ls_broker.create_topics([topic])
    reports: DeliveryReports = []
    producer = _producer(ls_broker)
    producer.produce(topic, b"hello", key=b"k", on_delivery=_record_into(reports))
    assert producer.flush(30) == 0
    assert reports == [(None, b"hello")]

    consumer = Consumer(
        {"bootstrap.servers": ls_broker.bootstrap_servers, "group.id": "ls-round-trip", "enable.auto.commit": False}
    )
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        deadline = time.monotonic() + 30
        received: Message | None = None
        while received is None and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                received = msg
    finally:
        consumer.close()
    assert received is not None, "message not consumed within 30 s"
    assert (received.key(), received.value()) == (b"k", b"hello")


def test_frozen_broker_withholds_delivery_until_thawed(ls_broker: LocalBroker) -> None:
    topic = "ls-freeze"
    ls_broker.create_topics([topic])
    producer = _producer(ls_broker)
    warmup: DeliveryReports = []
    producer.produce(topic, b"warm-up", on_delivery=_record_into(warmup))
    assert producer.flush(30) == 0 and warmup == [(None, b"warm-up")]  # connected, producer id assigned

    reports: DeliveryReports = []
    ls_broker.freeze()
    try:
        producer.produce(topic, b"while-frozen", on_delivery=_record_into(reports))
        assert producer.flush(2) == 1
        assert reports == []
    finally:
        ls_broker.thaw()

    assert producer.flush(30) == 0
    assert reports == [(None, b"while-frozen")]
