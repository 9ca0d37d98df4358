"""`outbox_lag_sensor` against real lag in PostgreSQL: which partitions it registers, which runs it asks for."""

from collections.abc import Callable

import dagster as dg
import psycopg

from assets import relayed_outbox
from assets.spark import bulk_drain_job
from outbox_pipeline import OutboxTable
from outbox_pipeline.orchestration.jobs import relay_partition_job
from outbox_pipeline.orchestration.lag_sensor import build_outbox_lag_sensor
from outbox_pipeline.orchestration.partitions import OUTBOX_PARTITIONS_NAME
from outbox_pipeline.orchestration.settings import OrchestrationSettings

from ..kafka_helpers import KafkaProbe
from ..relay_helpers import drain
from .conftest import Written

# Every partition with a pending row lags (no batching of trickles in these tests).
EAGER = OrchestrationSettings(trigger_pending=1, trigger_age_s=0.0)


def _tick(
    sensor: dg.SensorDefinition,
    instance: dg.DagsterInstance,
    resources: dict[str, dg.ConfigurableResource],
    cursor: str | None = None,
) -> dg.SensorResult | dg.SkipReason:
    with dg.build_sensor_context(instance=instance, resources=resources, cursor=cursor) as context:
        result = sensor(context)
    assert isinstance(result, dg.SensorResult | dg.SkipReason), result
    return result


def _added(result: dg.SensorResult | dg.SkipReason) -> list[str]:
    if isinstance(result, dg.SkipReason):
        return []
    return sorted(key for request in result.dynamic_partitions_requests or [] for key in request.partition_keys or [])


def _requested(result: dg.SensorResult | dg.SkipReason) -> dict[str, dg.RunRequest]:
    if isinstance(result, dg.SkipReason):
        return {}
    return {request.partition_key or "": request for request in result.run_requests or []}


def test_the_sensor_registers_new_partitions_and_requests_one_relay_run_per_lagging_partition(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource],
    write_rows: Callable[..., Written],
) -> None:
    written = write_rows(200)
    sensor = build_outbox_lag_sensor(relay_partition_job, settings=EAGER)

    result = _tick(sensor, instance, dagster_resources)

    assert _added(result) == written.keys
    requested = _requested(result)
    assert sorted(requested) == written.keys
    assert {request.job_name for request in requested.values()} == {"relay_partition"}
    assert all(request.tags["outbox/pending"] == str(len(written.by_key[k])) for k, request in requested.items())


def test_a_partition_with_a_run_in_flight_gets_no_new_run(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource],
    write_rows: Callable[..., Written],
) -> None:
    written = write_rows(200)
    busy, *others = written.keys
    instance.add_dynamic_partitions(OUTBOX_PARTITIONS_NAME, written.keys)
    defs = dg.Definitions(assets=[relayed_outbox], jobs=[relay_partition_job], resources=dagster_resources)
    job = defs.resolve_job_def("relay_partition")
    instance.create_run_for_job(job, tags={"dagster/partition": busy}, status=dg.DagsterRunStatus.STARTED)
    sensor = build_outbox_lag_sensor(relay_partition_job, settings=EAGER)

    result = _tick(sensor, instance, dagster_resources)

    assert sorted(_requested(result)) == others
    assert _added(result) == []  # all known already


def test_repeated_ticks_over_the_same_lag_ask_for_the_same_run_keys(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource],
    write_rows: Callable[..., Written],
) -> None:
    write_rows(100)
    sensor = build_outbox_lag_sensor(relay_partition_job, settings=EAGER)

    first = {k: r.run_key for k, r in _requested(_tick(sensor, instance, dagster_resources)).items()}
    second = {k: r.run_key for k, r in _requested(_tick(sensor, instance, dagster_resources)).items()}

    # The daemon launches at most one run per run key: a tick never duplicates work already requested.
    assert first == second and len(set(first.values())) == len(first)


def test_an_idle_outbox_is_a_skip_with_a_reason(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource],
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    write_rows: Callable[..., Written],
) -> None:
    written = write_rows(40)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")
    instance.add_dynamic_partitions(OUTBOX_PARTITIONS_NAME, written.keys)
    sensor = build_outbox_lag_sensor(relay_partition_job, settings=EAGER)

    result = _tick(sensor, instance, dagster_resources)

    assert isinstance(result, dg.SkipReason)
    assert "0 pending rows" in (result.skip_message or "")


def test_a_backlog_above_the_bulk_threshold_asks_for_the_bulk_drain_job_instead(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource],
    write_rows: Callable[..., Written],
) -> None:
    write_rows(120)
    settings = OrchestrationSettings(trigger_pending=1, trigger_age_s=0.0, bulk_drain_threshold=100)
    sensor = build_outbox_lag_sensor(relay_partition_job, settings=settings, bulk_drain_job=bulk_drain_job)

    result = _tick(sensor, instance, dagster_resources)

    assert isinstance(result, dg.SensorResult)
    assert [request.job_name for request in result.run_requests or []] == ["bulk_drain_job"]
