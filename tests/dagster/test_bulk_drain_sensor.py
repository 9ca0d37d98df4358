"""`outbox_lag_sensor` and the bulk drain: when the backlog asks for one on Spark (in the relay's order), and when it
does not (a run in flight, after one failed, after one that could take nothing)."""

from collections.abc import Callable
from typing import Any

import dagster as dg
import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import OutboxTable
from outbox_pipeline.assets.spark import bulk_drain, bulk_drain_job
from outbox_pipeline.orchestration.lag_sensor import build_outbox_lag_sensor
from outbox_pipeline.orchestration.relay_stream import relay_stream_job
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.resources.spark import SparkResource
from outbox_pipeline.strategies.positions import discover

from .conftest import Written
from .lag_ticks import live_worker, requested, skip_message, tick


def _drain_settings(strategy: str = "partitioned") -> OrchestrationSettings:
    return OrchestrationSettings(trigger_pending=1, trigger_age_s=0.0, bulk_drain_threshold=100, strategy=strategy)


def _drain_run(
    instance: dg.DagsterInstance, resources: dict[str, dg.ConfigurableResource[Any]], status: dg.DagsterRunStatus
) -> dg.DagsterRun:
    """A bulk drain run in the instance's history (its status set, nothing executed)."""
    defs = dg.Definitions(assets=[bulk_drain], jobs=[bulk_drain_job], resources={**resources, "spark": SparkResource()})
    return instance.create_run_for_job(defs.resolve_job_def(bulk_drain_job.name), status=status)


@pytest.mark.parametrize("strategy", ["partitioned", "serialized"])
def test_a_backlog_above_the_bulk_threshold_asks_for_a_bulk_drain_in_the_relays_order_and_a_relay_run(
    strategy: str,
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
) -> None:
    """The drain must read in the order the relay's positions are in: a partitioned drain over serialized positions
    skipped rows. And the relay keeps covering the outbox: rows after the drain's ranges, and anything it leaves."""
    write_rows(120)
    sensor = build_outbox_lag_sensor(
        relay_stream_job, settings=_drain_settings(strategy), bulk_drain_job=bulk_drain_job
    )

    result = tick(sensor, instance, dagster_resources)

    drain, relay = requested(result)
    assert (drain.job_name, drain.run_config) == (
        "bulk_drain_job",
        {"ops": {"bulk_drain": {"config": {"strategy": strategy}}}},
    )
    assert relay.job_name == "relay_stream" and relay.tags["outbox/reason"] == "uncovered"


@pytest.mark.parametrize("strategy", ["lease"])
def test_no_bulk_drain_is_asked_for_an_outbox_a_row_strategy_relays(
    strategy: str,
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
) -> None:
    write_rows(120)
    sensor = build_outbox_lag_sensor(
        relay_stream_job, settings=_drain_settings(strategy), bulk_drain_job=bulk_drain_job
    )

    result = tick(sensor, instance, dagster_resources)

    assert [r.job_name for r in requested(result)] == ["relay_stream"]


def test_while_a_bulk_drain_runs_the_relay_still_gets_its_runs(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
) -> None:
    write_rows(120)
    _drain_run(instance, dagster_resources, dg.DagsterRunStatus.STARTED)
    sensor = build_outbox_lag_sensor(relay_stream_job, settings=_drain_settings(), bulk_drain_job=bulk_drain_job)

    result = tick(sensor, instance, dagster_resources)

    assert [(r.job_name, r.tags["outbox/reason"]) for r in requested(result)] == [("relay_stream", "uncovered")]


def test_after_a_bulk_drain_failed_the_sensor_asks_for_no_other_within_the_cooldown_and_keeps_the_relay_going(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
) -> None:
    """A drain that stopped at a message Kafka refuses would stop there again on every tick, republishing what it
    did deliver; the relay's attempts and dead letters are what deals with that message."""
    write_rows(120)
    _drain_run(instance, dagster_resources, dg.DagsterRunStatus.FAILURE)
    sensor = build_outbox_lag_sensor(relay_stream_job, settings=_drain_settings(), bulk_drain_job=bulk_drain_job)
    after_cooldown = build_outbox_lag_sensor(
        relay_stream_job,
        settings=_drain_settings().model_copy(update={"bulk_drain_cooldown_s": 0.0}),
        bulk_drain_job=bulk_drain_job,
    )

    within = tick(sensor, instance, dagster_resources)
    later = tick(after_cooldown, instance, dagster_resources)

    assert [r.job_name for r in requested(within)] == ["relay_stream"]
    assert [r.job_name for r in requested(later)] == ["bulk_drain_job", "relay_stream"]


def _no_lag_trigger(**settings: float) -> OrchestrationSettings:
    """Drain settings under which the live worker is enough for the relay: the tick's skip reason says what it
    decided about the drain."""
    return _drain_settings().model_copy(update={"trigger_pending": 10_000, "trigger_age_s": 3600.0, **settings})


def _drain_job(resources: dict[str, dg.ConfigurableResource[Any]]) -> dg.JobDefinition:
    defs = dg.Definitions(assets=[bulk_drain], jobs=[bulk_drain_job], resources={**resources, "spark": SparkResource()})
    return defs.resolve_job_def(bulk_drain_job.name)


def _launch_drains(
    instance: dg.DagsterInstance,
    resources: dict[str, dg.ConfigurableResource[Any]],
    result: dg.SensorResult | dg.SkipReason,
) -> None:
    """Run the bulk drains a tick requested, as the daemon launches them: its run config and tags, in the instance."""
    for request in requested(result):
        if request.job_name == bulk_drain_job.name:
            _drain_job(resources).execute_in_process(
                run_config=request.run_config, tags=request.tags, instance=instance, raise_on_error=False
            )


def _drains(result: dg.SensorResult | dg.SkipReason) -> int:
    return sum(r.job_name == bulk_drain_job.name for r in requested(result))


def _lease_every_partition(db: psycopg.Connection, table: OutboxTable, worker_id: str) -> None:
    """Every partition leased to ``worker_id`` for an hour, as relay workers working through a backlog hold them."""
    discover(db, table)
    db.execute(
        sql.SQL("UPDATE {} SET locked_by = %s, available_after = now() + interval '1 hour'").format(table.offsets),
        [worker_id],
    )


def _free_every_partition(db: psycopg.Connection, table: OutboxTable) -> None:
    db.execute(sql.SQL("UPDATE {} SET locked_by = NULL, available_after = now()").format(table.offsets))


def test_no_bulk_drain_is_requested_while_relay_workers_hold_every_partition_of_the_backlog(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
    db: psycopg.Connection,
    table: OutboxTable,
) -> None:
    """Issue 40, case 11: the drain could lease no partition, succeeded with 0 rows, and the next tick asked for
    another: a Spark run every few seconds that could take nothing."""
    write_rows(120)
    sensor = build_outbox_lag_sensor(relay_stream_job, settings=_no_lag_trigger(), bulk_drain_job=bulk_drain_job)

    ticks = []
    with live_worker(db, table, "cli-relay-1"):
        _lease_every_partition(db, table, "cli-relay-1")
        for _ in range(3):
            ticks.append(result := tick(sensor, instance, dagster_resources))
            _launch_drains(instance, dagster_resources, result)

    assert [_drains(result) for result in ticks] == [0, 0, 0]
    assert "0 of them in partitions a drain could take" in skip_message(ticks[-1])


def test_after_a_bulk_drain_that_could_take_no_partition_the_sensor_asks_for_no_other_within_the_cooldown(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
    db: psycopg.Connection,
    table: OutboxTable,
) -> None:
    """Partitions free at a tick and taken by relay workers before the drain planned (they lease between batches): a
    drain per tick, each taking nothing, unless the sensor backs off after one."""
    write_rows(120)
    sensor = build_outbox_lag_sensor(relay_stream_job, settings=_no_lag_trigger(), bulk_drain_job=bulk_drain_job)
    after_cooldown = build_outbox_lag_sensor(
        relay_stream_job, settings=_no_lag_trigger(bulk_drain_cooldown_s=0.0), bulk_drain_job=bulk_drain_job
    )

    with live_worker(db, table, "cli-relay-1"):
        first = tick(sensor, instance, dagster_resources)
        _lease_every_partition(db, table, "cli-relay-1")
        _launch_drains(instance, dagster_resources, first)
        _free_every_partition(db, table)
        later = [tick(sensor, instance, dagster_resources) for _ in range(2)]
        past_the_cooldown = tick(after_cooldown, instance, dagster_resources)

    assert (_drains(first), [_drains(result) for result in later], _drains(past_the_cooldown)) == (1, [0, 0], 1)
    assert "took no partition" in skip_message(later[-1])


def test_after_a_bulk_drain_was_canceled_the_sensor_requests_none_until_an_operator_launches_one(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
    db: psycopg.Connection,
    table: OutboxTable,
) -> None:
    """Issue 40, case 20: an operator terminated the drain from the UI, and the next tick launched it again."""
    write_rows(120)
    _drain_run(instance, dagster_resources, dg.DagsterRunStatus.CANCELED)
    # No cool-down ends it: only the operator.
    sensor = build_outbox_lag_sensor(
        relay_stream_job, settings=_no_lag_trigger(bulk_drain_cooldown_s=0.0), bulk_drain_job=bulk_drain_job
    )

    with live_worker(db, table, "cli-relay-1"):
        after_the_cancel = [tick(sensor, instance, dagster_resources) for _ in range(2)]
        _drain_run(instance, dagster_resources, dg.DagsterRunStatus.SUCCESS)  # one launched by hand, from the launchpad
        after_the_operators_run = tick(sensor, instance, dagster_resources)

    assert [_drains(result) for result in after_the_cancel] == [0, 0]
    assert "was canceled" in skip_message(after_the_cancel[-1])
    assert _drains(after_the_operators_run) == 1
