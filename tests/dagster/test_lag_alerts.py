"""Lag alerts: the `outbox_lag_slo` check fails at its thresholds (from a sensor tick and from a run), the
alert reaches a loopback webhook once per incident and once on recovery, and a relay run that failed
for good is announced while one the instance will retry is not."""

import json
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import dagster as dg
import psycopg
import pytest

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.assets import outbox_backlog, outbox_lag_slo, relayed_outbox
from outbox_pipeline.localstack import free_port
from outbox_pipeline.observe import LagThresholds
from outbox_pipeline.operate import retry_dead_letters
from outbox_pipeline.orchestration.alert_sensors import (
    build_dead_letter_sensor,
    build_lag_slo_sensor,
    build_relay_failure_sensor,
)
from outbox_pipeline.orchestration.jobs import build_relay_partition_job, relay_partition_job
from outbox_pipeline.orchestration.partitions import OUTBOX_PARTITIONS_NAME
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.resources import Alert, AlertResource, KafkaResource
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain

from .conftest import Written

# WARN above 5 pending rows, ERROR above 10; ages far out of reach.
THRESHOLDS = LagThresholds(warn_age_s=3600, error_age_s=7200, warn_pending=5, error_pending=10)


class Receiver:
    """A loopback HTTP server that keeps every JSON body POSTed to it."""

    def __init__(self) -> None:
        received: list[dict[str, object]] = []
        self.received = received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(204)
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    hook = Receiver()
    hook.thread.start()
    monkeypatch.setenv("OUTBOX_ALERT_WEBHOOK_URL", hook.url)
    yield hook
    hook.server.shutdown()
    hook.server.server_close()


def _tick(
    sensor: dg.SensorDefinition,
    instance: dg.DagsterInstance,
    resources: dict[str, dg.ConfigurableResource[Any]],
    cursor: str | None,
) -> dg.SensorResult:
    with dg.build_sensor_context(instance=instance, resources=resources, cursor=cursor) as context:
        result = sensor(context)
    assert isinstance(result, dg.SensorResult)
    return result


def _evaluation(result: dg.SensorResult) -> dg.AssetCheckEvaluation:
    [evaluation] = [e for e in result.asset_events if isinstance(e, dg.AssetCheckEvaluation)]
    return evaluation


def test_the_lag_check_passes_below_warns_above_the_warn_and_errors_above_the_error_threshold(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
) -> None:
    sensor = build_lag_slo_sensor(OrchestrationSettings.with_thresholds(THRESHOLDS))
    verdicts = []
    topic = write_rows(5, partitions=1).topic
    for more in (0, 1, 5):  # 5, 6, 11 pending rows
        if more:
            write_rows(more, partitions=1, topic=topic)
        evaluation = _evaluation(_tick(sensor, instance, dagster_resources, None))
        verdicts.append((evaluation.passed, evaluation.severity, evaluation.metadata["pending_rows"].value))

    assert verdicts == [
        (True, dg.AssetCheckSeverity.WARN, 5),
        (False, dg.AssetCheckSeverity.WARN, 6),
        (False, dg.AssetCheckSeverity.ERROR, 11),
    ]


def test_the_lag_check_run_from_the_ui_judges_by_the_thresholds_of_the_orchestration_resource(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
) -> None:
    orchestration = OrchestrationSettings(lag_warn_pending=5, lag_error_pending=10)
    write_rows(11, partitions=1)

    result = dg.materialize(
        [outbox_backlog, outbox_lag_slo],
        resources={**dagster_resources, "orchestration": orchestration},
        instance=instance,
    )

    [evaluation] = result.get_asset_check_evaluations()
    assert (evaluation.passed, evaluation.severity) == (False, dg.AssetCheckSeverity.ERROR)


def test_the_lag_check_counts_rows_held_behind_a_dead_letter_and_names_the_key(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    topic = new_topic("dg", partitions=1)
    rows = [Message(topic, {"blob": "x" * 20_000}, key="order-7")]
    rows += [Message(topic, {"n": i}, key="order-7") for i in range(3)]
    poison, *_ = enqueue_many(db, rows, table=table)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned", producer={"message.max.bytes": 10_000})

    resources = {**dagster_resources, "orchestration": OrchestrationSettings(lag_warn_pending=2)}
    result = dg.materialize([outbox_backlog, outbox_lag_slo], resources=resources, instance=instance)

    [evaluation] = result.get_asset_check_evaluations()
    assert (evaluation.passed, evaluation.metadata["held_rows"].value) == (False, 3)
    held = str(evaluation.metadata["held_keys"].value)
    assert re.search(rf"key 'order-7' of {topic}:\d+ held behind dead letter {poison.id}, 3 rows", held), held
    assert "3 held: key 'order-7'" in (evaluation.description or "")
    status = str(evaluation.metadata["partition_status"].value)
    assert f"poison: key 'order-7' held behind dead letter {poison.id} (3 rows)" in status, status


def test_a_lag_incident_alerts_the_webhook_once_and_its_recovery_once(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    receiver: Receiver,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    write_rows: Callable[..., Written],
) -> None:
    sensor = build_lag_slo_sensor(OrchestrationSettings.with_thresholds(THRESHOLDS))
    written = write_rows(40)
    cursor = None
    for _ in range(2):  # lagging, twice
        cursor = _tick(sensor, instance, dagster_resources, cursor).cursor
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")
    for _ in range(2):  # recovered, twice
        cursor = _tick(sensor, instance, dagster_resources, cursor).cursor

    assert [(a["alert"], a["status"], a["severity"]) for a in receiver.received] == [
        ("outbox_lag_slo", "firing", "ERROR"),
        ("outbox_lag_slo", "resolved", "OK"),
    ]
    partitions = receiver.received[0]["partitions"]
    assert isinstance(partitions, list)
    assert {p["partition"] for p in partitions} == set(written.keys)


def test_a_transaction_left_open_holds_the_horizon_and_the_alert_fires_once_naming_it(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    receiver: Receiver,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    open_transaction: psycopg.Connection,
    write_rows: Callable[..., Written],
) -> None:
    """A BEGIN left open over lunch (after a write) keeps `partitioned` from reading rows committed since. The alert
    (and the webhook) names the session; its SQL text stays in the database: it may hold a password."""
    sensor = build_lag_slo_sensor(OrchestrationSettings.with_thresholds(THRESHOLDS))
    write_rows(12)
    cursor = None
    for _ in range(2):  # held back, twice
        cursor = _tick(sensor, instance, dagster_resources, cursor).cursor
    open_transaction.execute("ROLLBACK")
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")
    cursor = _tick(sensor, instance, dagster_resources, cursor).cursor

    assert [(a["alert"], a["status"]) for a in receiver.received] == [
        ("outbox_lag_slo", "firing"),
        ("outbox_lag_slo", "resolved"),
    ]
    text = str(receiver.received[0]["text"])
    assert "12 committed rows" in text and f"pid {open_transaction.info.backend_pid} " in text
    assert "idle in transaction" in text and "over_lunch" not in text  # who and where, never the SQL it ran


def test_an_unreachable_webhook_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_ALERT_WEBHOOK_URL", f"http://127.0.0.1:{free_port()}/nobody")
    alert = Alert(alert="outbox_lag_slo", status="firing", severity="ERROR", text="test")

    assert AlertResource(timeout_s=2).send(alert) is False


def _failed_relay_run(
    instance: dg.DagsterInstance, resources: dict[str, dg.ConfigurableResource[Any]]
) -> dg.DagsterRun:
    """A relay run that fails for good: its Kafka configuration is invalid, which no retry can fix."""
    broken = {
        **resources,
        "kafka": KafkaResource(bootstrap_servers="127.0.0.1:1", properties={"compression.type": "bogus"}),
    }
    defs = dg.Definitions(
        assets=[relayed_outbox], jobs=[build_relay_partition_job(retry_policy=dg.RetryPolicy(0))], resources=broken
    )
    instance.add_dynamic_partitions(OUTBOX_PARTITIONS_NAME, ["orders:3"])
    result = defs.resolve_job_def("relay_partition").execute_in_process(
        partition_key="orders:3", instance=instance, raise_on_error=False
    )
    assert not result.success
    return result.dagster_run


def _run_failure_tick(instance: dg.DagsterInstance, run: dg.DagsterRun) -> None:
    [failure] = instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE).records
    sensor = build_relay_failure_sensor(relay_partition_job)
    context = dg.build_run_status_sensor_context(
        sensor_name=sensor.name,
        dagster_event=failure.event_log_entry.get_dagster_event(),
        dagster_instance=instance,
        dagster_run=instance.get_run_by_id(run.run_id) or run,
        resources={"alerts": AlertResource()},
    )
    sensor(context.for_run_failure())


def test_a_relay_run_that_failed_for_good_alerts_naming_its_partition(
    instance: dg.DagsterInstance, dagster_resources: dict[str, dg.ConfigurableResource[Any]], receiver: Receiver
) -> None:
    run = _failed_relay_run(instance, dagster_resources)

    _run_failure_tick(instance, run)

    [alert] = receiver.received
    assert (alert["alert"], alert["status"], alert["partitions"]) == (
        "relay_run_failed",
        "firing",
        [{"partition": "orders:3"}],
    )
    assert "invalid Kafka configuration" in str(alert["text"])


def test_a_failed_relay_run_the_instance_will_retry_does_not_alert(
    instance: dg.DagsterInstance, dagster_resources: dict[str, dg.ConfigurableResource[Any]], receiver: Receiver
) -> None:
    run = _failed_relay_run(instance, dagster_resources)
    instance.add_run_tags(run.run_id, {"dagster/will_retry": "true"})

    _run_failure_tick(instance, run)

    assert receiver.received == []


def test_dead_letters_alert_the_webhook_once_per_incident_and_once_when_all_are_retried(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    receiver: Receiver,
    new_topic: Callable[..., str],
) -> None:
    """An oversize message is dead-lettered by a real relay: the check fails, the webhook hears about it
    once (not again for the next one of the same incident), and once more when every dead letter is retried."""
    topic = new_topic("dg", partitions=1)
    sensor = build_dead_letter_sensor(OrchestrationSettings())

    def poison() -> None:
        # A key of its own each time: a second poison row of a held key would be held, not dead-lettered.
        enqueue_many(db, [Message(topic, {"blob": "x" * 20_000}, key=uuid.uuid4().hex)], table=table)
        drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned", producer={"message.max.bytes": 10_000})

    cursor = _tick(sensor, instance, dagster_resources, None).cursor
    poison()
    first = _tick(sensor, instance, dagster_resources, cursor)
    poison()
    second = _tick(sensor, instance, dagster_resources, first.cursor)
    assert (_evaluation(first).passed, _evaluation(second).metadata["dead_letters"].value) == (False, 2)
    retry_dead_letters(db, table)
    recovered = _tick(sensor, instance, dagster_resources, second.cursor)
    assert _evaluation(recovered).passed

    assert [(a["alert"], a["status"]) for a in receiver.received] == [
        ("outbox_dead_letters", "firing"),
        ("outbox_dead_letters", "resolved"),
    ]
    assert "1 outbox messages dead-lettered" in str(receiver.received[0]["text"])


@pytest.mark.parametrize(
    "url", ["hooks.example.com/services/T0/B0/tok3n-Secr3t", "ftp://hooks.example.com/tok3n-Secr3t"]
)
def test_a_webhook_url_without_an_http_scheme_is_reported_by_its_variable_not_raised_nor_shown(
    url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 40, case 17: urllib raised on the tick that had to alert, with the URL (its token) in the tick error."""
    monkeypatch.setenv("OUTBOX_ALERT_WEBHOOK_URL", url)
    alert = Alert(alert="outbox_lag_slo", status="firing", severity="ERROR", text="test")

    with caplog.at_level("INFO"):
        assert AlertResource(timeout_s=2).send(alert) is False

    assert "OUTBOX_ALERT_WEBHOOK_URL is not an http:// or https:// URL" in caplog.text
    assert "tok3n-Secr3t" not in caplog.text
