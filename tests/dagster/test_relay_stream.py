"""`relay_stream`: one long-lived run relays every partition, records each partition's history at intervals,
and survives kill -9 (its partitions relayed again, nothing lost) and a rerun from failure (it resumes)."""

import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from outbox_pipeline import OutboxTable
from outbox_pipeline.localstack import LocalBroker
from outbox_pipeline.observe import live_workers, partition_lag
from outbox_pipeline.orchestration.lag_sensor import build_outbox_lag_sensor
from outbox_pipeline.orchestration.relay_stream import (
    RELAYED_OUTBOX,
    relay_stream_job,
    stopping_on_terminate,
    stream_worker_id,
)
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.resources import KafkaResource
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import message_ids, order_by_key
from tests.kit.writer import Writer

from .conftest import Written

ROOT = Path(__file__).resolve().parents[2]


def _materializations(instance: dg.DagsterInstance, key: str) -> list[dg.EventLogRecord]:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=RELAYED_OUTBOX, asset_partitions=[key]), limit=1000
    )
    return list(records.records)


def _metadata(record: dg.EventLogRecord) -> Mapping[str, dg.MetadataValue]:
    """The metadata of a fetched materialization (fetch_materializations returns materializations only)."""
    materialization = record.asset_materialization
    assert materialization is not None
    return materialization.metadata


def _count(metadata: Mapping[str, dg.MetadataValue], name: str) -> int:
    """A count the run recorded with ``dg.MetadataValue.int``."""
    value = metadata[name].value
    assert isinstance(value, int), (name, value)
    return value


def _failed_deliveries(instance: dg.DagsterInstance, keys: list[str]) -> int:
    return sum(_count(_metadata(r), "failed_deliveries") for key in keys for r in _materializations(instance, key))


def test_one_run_relays_every_partition_and_records_a_materialization_per_partition_per_interval(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
) -> None:
    written = write_rows(200, partitions=4)
    config = {"ops": {"relay_outbox_stream": {"config": {"window_s": 4.0, "report_interval_s": 1.0}}}}
    kafka = dagster_resources["kafka"]
    assert isinstance(kafka, KafkaResource)

    result = relay_stream_job.execute_in_process(run_config=config, instance=instance, resources=dagster_resources)

    assert result.success
    arrived = message_ids(KafkaProbe(kafka.bootstrap_servers).consume(written.topic, idle_s=2.0))
    assert sorted(arrived) == sorted(m for ids in written.by_key.values() for m in ids)
    for key, ids in written.by_key.items():
        history = _materializations(instance, key)
        assert len(history) >= 3, f"{key}: {len(history)} materializations in a 4 s window reported every 1 s"
        published = sum(_count(_metadata(r), "rows_published") for r in history)
        assert published == len(ids)
        assert all(r.run_id == result.run_id for r in history)


def _pending(db: psycopg.Connection, table: OutboxTable) -> int:
    return sum(lag.pending for lag in partition_lag(db, table, "partitioned"))


def test_with_the_broker_down_a_run_backs_off_records_the_failures_per_partition_and_delivers_once_it_is_back(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
    broker: LocalBroker,
) -> None:
    written = write_rows(40, partitions=2)
    config = {"ops": {"relay_outbox_stream": {"config": {"window_s": 15.0, "report_interval_s": 1.0}}}}
    # The outage lasts until a report has recorded a failed delivery (the resource's delivery timeout is 2 s), not a
    # fixed 5 s: on a loaded machine the run took longer than that to start, and the broker was back before the
    # relay had tried it (seen once in a parallel run).
    outage_seen = threading.Event()

    def thaw_once_the_outage_is_reported() -> None:
        deadline = time.monotonic() + 12.0
        while time.monotonic() < deadline and not outage_seen.is_set():
            if _failed_deliveries(instance, written.keys) > 0:
                outage_seen.set()
            else:
                outage_seen.wait(0.1)
        broker.thaw()

    thaw = threading.Thread(target=thaw_once_the_outage_is_reported)
    broker.freeze()
    thaw.start()
    try:
        result = relay_stream_job.execute_in_process(run_config=config, instance=instance, resources=dagster_resources)
    finally:
        outage_seen.set()
        thaw.join()
        broker.thaw()

    assert result.success  # an outage is not the run's failure: it backs off and goes on (no alert per run)
    resource = dagster_resources["kafka"]
    assert isinstance(resource, KafkaResource)
    kafka = KafkaProbe(resource.bootstrap_servers)
    arrived = message_ids(kafka.consume(written.topic, idle_s=2.0))
    assert set(arrived) == {m for ids in written.by_key.values() for m in ids}
    # The partition whose batch the outage caught shows it in its own history: failed deliveries and the error.
    history = {key: [_metadata(r) for r in _materializations(instance, key)] for key in written.keys}
    hit = [key for key, entries in history.items() if sum(_count(m, "failed_deliveries") for m in entries) > 0]
    assert hit, "the outage is in no partition's history"
    assert all(any(m["last_error"].value != "-" for m in history[key]) for key in hit)


@pytest.fixture
def dagster_home(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    yield home


def _start_run(dagster_home: Path, dsn: str, table: OutboxTable, bootstrap: str, *args: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "DAGSTER_HOME": str(dagster_home),
        "OUTBOX_PG_DSN": dsn,
        "OUTBOX_SCHEMA": table.schema,
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
    }
    return subprocess.Popen([sys.executable, "-m", "tests.dagster.stream_run_process", *args], cwd=ROOT, env=env)


def test_a_killed_run_is_replaced_and_its_rerun_from_failure_resumes_with_nothing_lost(
    dagster_home: Path,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    topic = new_topic("stream", partitions=4)
    set_topic_partitions(db, table, topic, 4)
    stop = threading.Event()
    # A steady writer, 20 keys, through the kill and the rerun.
    writer = Writer(db.info.dsn, table, topic, serialized=False, keys=20, per_tx=1, pause_s=0.02, stop=stop)
    written = writer.committed
    writer.start()
    first = _start_run(dagster_home, db.info.dsn, table, kafka.bootstrap_servers, "600", "1")
    try:
        with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
            for _ in range(600):  # until the run has recorded a partition's progress (60 s at most)
                if instance.fetch_materializations(RELAYED_OUTBOX, limit=1).records:
                    break
                stop.wait(0.1)
            [killed] = instance.get_runs(dg.RunsFilter(job_name="relay_stream"))
            assert stream_worker_id(killed) in [w.worker_id for w in live_workers(db, table, 60)]
            first.send_signal(signal.SIGKILL)
            first.wait()
            killed_now = instance.get_run_by_id(killed.run_id)
            assert killed_now is not None
            instance.report_run_failed(killed_now)  # what the code server does

            # Its worker is gone at once: the sensor asks for a run, though the killed one was registered.
            sensor = build_outbox_lag_sensor(relay_stream_job, settings=OrchestrationSettings())
            with dg.build_sensor_context(instance=instance, resources=dagster_resources) as context:
                result = sensor(context)
            assert isinstance(result, dg.SensorResult)
            assert [r.tags["outbox/reason"] for r in result.run_requests or []] == ["uncovered"]

            rerun = _start_run(dagster_home, db.info.dsn, table, kafka.bootstrap_servers, "600", "1", killed.run_id)
            for _ in range(600):
                if stream_worker_id(killed) in [w.worker_id for w in live_workers(db, table, 60)]:
                    break  # the rerun took back the killed run's worker id (its root run id)
                stop.wait(0.1)
            stop.set()
            writer.join()
            writer.check()
            records = kafka.consume(topic, idle_s=1.0)
            for _ in range(60):  # until everything written arrived (duplicates aside), 2 minutes at most
                if set(message_ids(records)) >= set(written):
                    break
                records = kafka.consume(topic, idle_s=1.0)
            rerun.send_signal(signal.SIGTERM)
            rerun.wait(60)
            [child] = [
                r for r in instance.get_runs(dg.RunsFilter(job_name="relay_stream")) if r.run_id != killed.run_id
            ]
            assert child.root_run_id == killed.run_id
    finally:
        stop.set()
        first.kill()

    assert len(written) > 100
    missing = set(written) - set(message_ids(records))
    assert not missing, f"{len(missing)} of {len(written)} never arrived; pending {_pending(db, table)}"
    for key, numbers in order_by_key(records).items():
        firsts = list(dict.fromkeys(numbers))
        assert firsts == sorted(firsts), f"key {key!r} out of order"


class _Pushgateway(BaseHTTPRequestHandler):
    """Records what a Prometheus pushgateway would receive (method, path, body)."""

    received: list[tuple[str, str, str]] = []

    def _record(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
        self.received.append((self.command, self.path, body))
        self.send_response(200)
        self.end_headers()

    do_PUT = do_POST = do_DELETE = _record

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def test_a_run_pushes_its_relay_metrics_to_the_pushgateway_and_deletes_them_when_it_ends(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
) -> None:
    received: list[tuple[str, str, str]] = []
    handler = type("Gateway", (_Pushgateway,), {"received": received})
    gateway = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    orchestration = OrchestrationSettings(metrics_pushgateway=f"127.0.0.1:{gateway.server_port}")
    written = write_rows(60, partitions=2)
    config = {"ops": {"relay_outbox_stream": {"config": {"window_s": 3.0, "report_interval_s": 1.0}}}}
    try:
        result = relay_stream_job.execute_in_process(
            run_config=config, instance=instance, resources={**dagster_resources, "orchestration": orchestration}
        )
    finally:
        gateway.shutdown()

    assert result.success
    path = f"/metrics/job/outbox_relay/worker/{stream_worker_id(result.dagster_run)}"
    pushes = [body for method, p, body in received if method == "PUT" and p == path]
    assert len(pushes) >= 2 and received[-1][:2] == ("DELETE", path)
    last, total = pushes[-1], float(sum(len(ids) for ids in written.by_key.values()))
    assert f'outbox_relay_published_total{{strategy="partitioned"}} {total}' in last, last


def test_a_terminate_whose_interrupt_python_swallows_still_stops_the_run() -> None:
    """Seen in CI: SIGTERM reached Dagster's handler inside a weakref callback, where Python ignores the exception it
    raises ("Exception ignored in ..."), and the run relayed on. Here the signal arrives inside such a callback."""
    stopped = threading.Event()
    interrupts: list[BaseException] = []

    def dagsters(signum: int, frame: object) -> None:  # what Dagster's handler does: raise into the run
        interrupts.append(dg.DagsterExecutionInterruptedError())
        raise interrupts[-1]

    class Collected:
        pass

    original = signal.signal(signal.SIGTERM, dagsters)
    try:
        with stopping_on_terminate(stopped.set):
            collected = Collected()
            watched = weakref.ref(collected, lambda _: signal.raise_signal(signal.SIGTERM))
            del collected  # the callback runs, the handler raises inside it, Python prints and drops the exception
            assert watched() is None
        assert interrupts, "the handler that was there (Dagster's) was not called"
        assert stopped.is_set(), "the interrupt was swallowed and nothing stopped the run"
        assert signal.getsignal(signal.SIGTERM) is dagsters  # put back as it was
    finally:
        signal.signal(signal.SIGTERM, original)
