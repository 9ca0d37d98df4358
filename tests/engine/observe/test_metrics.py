"""Prometheus metrics and the liveness probe of a relay worker: scraped over HTTP from a running `outbox relay`
process and checked against what it relayed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import psycopg
import pytest

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.localstack import free_port
from outbox_pipeline.observe import LagSampler, MetricsServer, RelayMetrics
from outbox_pipeline.relay import RelaySettings, WorkerSpec, build_relay
from outbox_pipeline.strategies import StrategyConfig
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import wait_until

COUNT = 500


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _value(text: str, name: str, **labels: str) -> float | None:
    """The sample ``name{labels}`` of a scrape (labels in any order; a subset is enough)."""
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:]+)(?:\{(.*)\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return None


@pytest.fixture
def relay_process(
    dsn: str, table: OutboxTable, kafka: KafkaProbe
) -> Iterator[Callable[[int], subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(port: int) -> subprocess.Popen[bytes]:
        env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "OUTBOX_PG_DSN": dsn}
        proc = subprocess.Popen(
            [sys.executable, "-m", "outbox_pipeline.cli", "relay", "--strategy", "partitioned", "--schema",
             table.schema, "--metrics-port", str(port)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_scrape_of_a_running_relay_counts_what_it_relayed_and_shows_the_lag_gone(
    db: psycopg.Connection,
    table: OutboxTable,
    new_topic: Callable[..., str],
    relay_process: Callable[[int], subprocess.Popen[bytes]],
) -> None:
    topic = new_topic()
    port = free_port()
    relay_process(port)
    enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i % 7}") for i in range(COUNT)], table=table)
    url = f"http://127.0.0.1:{port}"

    deadline = time.monotonic() + 60
    scrape = ""
    while time.monotonic() < deadline:
        try:
            scrape = _get(f"{url}/metrics")[1]
        except OSError:
            time.sleep(0.2)  # the worker is still starting
            continue
        if _value(scrape, "outbox_relay_acked_total", strategy="partitioned") == COUNT:
            break
        time.sleep(0.2)

    assert _value(scrape, "outbox_relay_published_total", strategy="partitioned") == COUNT
    assert _value(scrape, "outbox_relay_acked_total", strategy="partitioned") == COUNT
    assert _value(scrape, "outbox_relay_dead_lettered_total", strategy="partitioned") == 0
    batches = _value(scrape, "outbox_relay_batch_size_count", strategy="partitioned")
    assert batches and _value(scrape, "outbox_relay_batch_size_sum", strategy="partitioned") == COUNT
    assert _value(scrape, "outbox_relay_publish_seconds_count", strategy="partitioned") == batches
    assert _value(scrape, "outbox_relay_ack_seconds_count", strategy="partitioned") == batches
    assert _value(scrape, "outbox_relay_up") == 1.0
    assert _get(f"{url}/healthz") == (200, "ok\n")


def test_the_lag_gauges_show_each_partitions_pending_rows_from_one_query_per_interval(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    enqueue_many(db, [Message("orders", {"n": i}, key="k", partition=i % 2) for i in range(5)], table=table)
    sampler = LagSampler(db.info.dsn, table, "partitioned", interval_s=3600)
    sampler.sample()
    metrics = RelayMetrics("partitioned")
    metrics.registry.register(sampler)
    server = MetricsServer(metrics.registry, metrics.healthy, 0, "127.0.0.1").start()
    try:
        first = _get(f"http://127.0.0.1:{server.port}/metrics")[1]
        enqueue_many(db, [Message("orders", {"n": 9}, key="k", partition=0)], table=table)
        second = _get(f"http://127.0.0.1:{server.port}/metrics")[1]
    finally:
        server.stop()

    assert _value(first, "outbox_pending_rows", topic="orders", partition="0") == 3
    assert _value(first, "outbox_pending_rows", topic="orders", partition="1") == 2
    assert _value(first, "outbox_horizon_age_seconds") == 0
    assert _value(second, "outbox_pending_rows", topic="orders", partition="0") == 3  # a scrape reads no table


def test_healthz_answers_503_with_the_reason_once_the_loop_stops_turning() -> None:
    metrics = RelayMetrics("partitioned", stall_after_s=0.2)
    server = MetricsServer(metrics.registry, metrics.healthy, 0, "127.0.0.1").start()
    try:
        metrics.loop()
        metrics.database_ok()
        healthy = _get(f"http://127.0.0.1:{server.port}/healthz")
        time.sleep(0.5)  # the loop "hangs": nothing calls loop() any more
        stalled = _get(f"http://127.0.0.1:{server.port}/healthz")
        up = _value(_get(f"http://127.0.0.1:{server.port}/metrics")[1], "outbox_relay_up")
    finally:
        server.stop()

    assert healthy == (200, "ok\n")
    assert stalled[0] == 503 and "the relay loop has not turned for" in stalled[1]
    assert up == 0.0


def test_healthz_answers_503_with_the_reason_when_the_relay_cannot_reach_kafka(
    dsn: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    """A worker cut off from Kafka turns its loop and reaches its database, and relays nothing: its probe must fail
    (so that it is restarted) once deliveries have failed for longer than the bound, not stay 200."""
    enqueue_many(db, [Message("orders", {"n": n}, key=f"k{n}") for n in range(5)], table=table)
    metrics = RelayMetrics("partitioned", stall_after_s=4.0)
    stop = threading.Event()
    nowhere = {"message.timeout.ms": 300, "socket.connection.setup.timeout.ms": 1000}
    spec = WorkerSpec(
        dsn,
        "partitioned",
        {"bootstrap.servers": f"127.0.0.1:{free_port()}", **nowhere},  # nothing listens there
        RelaySettings(batch_size=10, listen=False, poll_interval_s=0.05, error_backoff_max_s=0.2),
        StrategyConfig(table=table),
    )
    relay = build_relay(spec, stop, instruments=metrics)
    worker = threading.Thread(target=relay.run)
    worker.start()
    try:
        wait_until("the probe to fail", lambda: not metrics.healthy()[0], 20)
        ok, why = metrics.healthy()
    finally:
        stop.set()
        worker.join(60)

    assert not ok and "Kafka" in why, why
    assert relay.stats.published == 0 and relay.stats.batches > 0


def test_a_wal_relay_streaming_or_waiting_to_stream_stays_healthy_and_counts_what_it_publishes(
    dsn: str, wal_outbox: OutboxTable, kafka: KafkaProbe, db: psycopg.Connection
) -> None:
    streaming, waiting = RelayMetrics("wal", stall_after_s=1.0), RelayMetrics("wal", stall_after_s=1.0)
    stop = threading.Event()
    spec = WorkerSpec(
        dsn, "wal", {"bootstrap.servers": kafka.bootstrap_servers}, RelaySettings(), StrategyConfig(table=wal_outbox)
    )
    relays = [build_relay(spec, stop, instruments=m) for m in (streaming, waiting)]
    threads = [threading.Thread(target=r.run) for r in relays]
    for t in threads:
        t.start()
    try:
        enqueue_many(db, [Message("orders", {"n": n}, key=f"k{n}") for n in range(5)], table=wal_outbox)
        wait_until("the messages are published", lambda: sum(r.stats.published for r in relays) == 5, 20)
        time.sleep(3.5)  # past stall_after_s: a loop that stopped turning (a waiting relay's too) would show now
        health = streaming.healthy(), waiting.healthy()
    finally:
        stop.set()
        for t in threads:
            t.join(30)

    assert health == ((True, "ok"), (True, "ok"))
    assert streaming.published._value.get() + waiting.published._value.get() == 5
