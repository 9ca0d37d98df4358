"""The Dagster sensors on a wal outbox (issue 42): the lag sensor keeps one relay_stream run streaming the slot and
reports it, and the lag objective's sensor judges the WAL the slot retains and a missing slot."""

from __future__ import annotations

import threading
from typing import Any

import dagster as dg
import psycopg
import pytest

from outbox_pipeline import OutboxTable
from outbox_pipeline.observe import LagThresholds
from outbox_pipeline.orchestration.alert_sensors import build_lag_slo_sensor
from outbox_pipeline.orchestration.lag_sensor import build_outbox_lag_sensor
from outbox_pipeline.orchestration.relay_stream import relay_stream_job
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.resources import AlertResource, KafkaResource, PostgresResource
from outbox_pipeline.store.wal.objects import names_of
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import make_wal_relay

from .lag_ticks import requested, skip_message, tick


@pytest.fixture
def wal_resources(dsn: str, wal_outbox: OutboxTable, kafka: KafkaProbe) -> dict[str, dg.ConfigurableResource[Any]]:
    return {
        "postgres": PostgresResource(dsn=dsn, schema_name=wal_outbox.schema),
        "kafka": KafkaResource(bootstrap_servers=kafka.bootstrap_servers),
        "alerts": AlertResource(),
        "orchestration": OrchestrationSettings(),
    }


def _lag_check(
    settings: OrchestrationSettings, instance: dg.DagsterInstance, resources: dict[str, dg.ConfigurableResource[Any]]
) -> dg.AssetCheckEvaluation:
    with dg.build_sensor_context(instance=instance, resources=resources) as context:
        result = build_lag_slo_sensor(settings)(context)
    assert isinstance(result, dg.SensorResult)
    [evaluation] = [e for e in result.asset_events if isinstance(e, dg.AssetCheckEvaluation)]
    return evaluation


def test_the_lag_sensor_requests_one_relay_stream_run_for_a_wal_outbox_nobody_streams(
    instance: dg.DagsterInstance, wal_resources: dict[str, dg.ConfigurableResource[Any]]
) -> None:
    [request] = requested(tick(build_outbox_lag_sensor(relay_stream_job), instance, wal_resources))

    assert request.tags["outbox/reason"] == "uncovered"
    assert request.run_config["ops"]["relay_outbox_stream"]["config"]["strategy"] == "wal"


def test_the_lag_sensor_requests_no_run_while_another_relay_streams_the_slot_and_reports_it(
    dsn: str,
    instance: dg.DagsterInstance,
    wal_resources: dict[str, dg.ConfigurableResource[Any]],
    wal_outbox: OutboxTable,
    kafka: KafkaProbe,
) -> None:
    stop = threading.Event()
    relay = make_wal_relay(dsn, wal_outbox, kafka.bootstrap_servers, stop=stop, until_idle=False)
    streaming = threading.Thread(target=relay.run)
    streaming.start()
    try:
        assert relay.registered.wait(10.0)
        result = tick(build_outbox_lag_sensor(relay_stream_job), instance, wal_resources)
    finally:
        stop.set()
        streaming.join(10.0)

    assert requested(result) == []
    message = skip_message(result)
    assert message.startswith(f"wal slot {names_of(wal_outbox).slot}: ") and "of WAL retained" in message


def test_the_lag_check_of_a_wal_outbox_warns_when_its_slot_retains_more_wal_than_the_threshold(
    instance: dg.DagsterInstance, wal_resources: dict[str, dg.ConfigurableResource[Any]]
) -> None:
    settings = OrchestrationSettings.with_thresholds(LagThresholds(warn_retained_bytes=1))

    evaluation = _lag_check(settings, instance, wal_resources)

    assert (evaluation.passed, evaluation.severity) == (False, dg.AssetCheckSeverity.WARN)
    retained = evaluation.metadata["retained_wal_bytes"].value
    assert isinstance(retained, int) and retained > 1
    assert "bytes of WAL > warn 1" in (evaluation.description or "")


def test_the_lag_check_of_a_wal_outbox_without_its_slot_errs_with_the_procedure(
    instance: dg.DagsterInstance,
    wal_resources: dict[str, dg.ConfigurableResource[Any]],
    db: psycopg.Connection,
    wal_outbox: OutboxTable,
) -> None:
    db.execute("SELECT pg_drop_replication_slot(%s)", (names_of(wal_outbox).slot,))

    evaluation = _lag_check(OrchestrationSettings(), instance, wal_resources)

    assert (evaluation.passed, evaluation.severity) == (False, dg.AssetCheckSeverity.ERROR)
    assert "Run `outbox init-db --strategy wal`" in (evaluation.description or "")
