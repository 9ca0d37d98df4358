"""`outbox_lag_sensor` against real lag and a real worker registry in PostgreSQL: which partitions it
registers, and when it asks for a long-lived `relay_stream` run (one live owner covers every partition)."""

from collections.abc import Callable
from typing import Any

import dagster as dg
import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import OutboxTable
from outbox_pipeline.drain import drain_owner, plan_drain
from outbox_pipeline.orchestration.lag_sensor import build_outbox_lag_sensor
from outbox_pipeline.orchestration.partitions import OUTBOX_PARTITIONS_NAME
from outbox_pipeline.orchestration.relay_stream import REGISTERED_TAG, relay_stream_job, stream_worker_id
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.store import enqueue
from tests.kit.kafka import KafkaProbe
from tests.kit.quarantine import poisoned
from tests.kit.relay import drain

from .conftest import Written
from .lag_ticks import added, live_worker, requested, skip_message, tick

# Every partition with a pending row lags (no batching of trickles in these tests).
EAGER = OrchestrationSettings(trigger_pending=1, trigger_age_s=0.0)


def _stream_run(
    instance: dg.DagsterInstance, status: dg.DagsterRunStatus, *, registered: bool = False, **tags: str
) -> dg.DagsterRun:
    """A relay_stream run; ``registered``: its worker registered once (the run tags itself so)."""
    run = instance.create_run_for_job(relay_stream_job, tags=tags, status=status)
    if registered:
        instance.add_run_tags(run.run_id, {REGISTERED_TAG: run.run_id})
    return run


def test_an_uncovered_outbox_gets_one_relay_stream_run_and_its_partitions_registered(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
) -> None:
    written = write_rows(200)
    sensor = build_outbox_lag_sensor(relay_stream_job, settings=EAGER)

    result = tick(sensor, instance, dagster_resources)

    assert added(result) == written.keys
    [request] = requested(result)
    assert request.job_name == "relay_stream" and request.tags["outbox/reason"] == "uncovered"
    # The same state asks for the same run key: the daemon launches it once.
    assert [r.run_key for r in requested(tick(sensor, instance, dagster_resources))] == [request.run_key]


def test_a_live_external_relay_worker_covers_the_outbox_so_no_run_is_requested(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
    db: psycopg.Connection,
    table: OutboxTable,
) -> None:
    write_rows(40)
    sensor = build_outbox_lag_sensor(relay_stream_job, settings=OrchestrationSettings())

    with live_worker(db, table, "cli-relay-1"):
        covered = tick(sensor, instance, dagster_resources)
    uncovered = tick(sensor, instance, dagster_resources)

    assert requested(covered) == [] and "1 live relay worker" in skip_message(covered)
    assert [r.tags["outbox/reason"] for r in requested(uncovered)] == ["uncovered"]


def test_a_run_still_starting_covers_the_outbox_so_no_second_run_is_queued(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
) -> None:
    write_rows(200)
    _stream_run(instance, dg.DagsterRunStatus.STARTING)  # launched, loading the code location
    sensor = build_outbox_lag_sensor(relay_stream_job, settings=EAGER)

    result = tick(sensor, instance, dagster_resources)

    assert requested(result) == [] and "1 run(s) starting" in skip_message(result)


def test_a_run_whose_registered_worker_died_covers_nothing_and_gets_a_successor(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
) -> None:
    write_rows(40)
    # Started, registered once, and its worker is not alive (kill -9): the code server has not marked it yet.
    _stream_run(instance, dg.DagsterRunStatus.STARTED, registered=True)
    sensor = build_outbox_lag_sensor(relay_stream_job, settings=OrchestrationSettings())

    result = tick(sensor, instance, dagster_resources)

    assert [r.tags["outbox/reason"] for r in requested(result)] == ["uncovered"]


def test_a_killed_run_the_instance_is_about_to_retry_gets_no_second_run_from_the_sensor(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
) -> None:
    write_rows(40)
    _stream_run(instance, dg.DagsterRunStatus.FAILURE, registered=True, **{"dagster/will_retry": "true"})
    sensor = build_outbox_lag_sensor(relay_stream_job, settings=OrchestrationSettings())

    result = tick(sensor, instance, dagster_resources)

    assert requested(result) == [] and "1 run(s) starting" in skip_message(result)


def test_a_run_near_the_end_of_its_window_gets_its_successor_before_it_ends(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
    db: psycopg.Connection,
    table: OutboxTable,
) -> None:
    write_rows(40)
    settings = OrchestrationSettings()
    # A window shorter than the handover: from its start the run is about to end.
    ending = _stream_run(instance, dg.DagsterRunStatus.STARTED, registered=True, **{"outbox/window_s": "30"})
    long = _stream_run(instance, dg.DagsterRunStatus.STARTED, registered=True, **{"outbox/window_s": "600"})
    sensor = build_outbox_lag_sensor(relay_stream_job, settings=settings)

    with live_worker(db, table, stream_worker_id(ending)):
        alone = tick(sensor, instance, dagster_resources)
        with live_worker(db, table, stream_worker_id(long)):
            with_other = tick(sensor, instance, dagster_resources)

    assert [r.tags["outbox/reason"] for r in requested(alone)] == ["successor"]
    assert requested(with_other) == []


def test_lagging_partitions_get_one_more_run_up_to_the_maximum(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
    db: psycopg.Connection,
    table: OutboxTable,
) -> None:
    write_rows(200)
    runs = [_stream_run(instance, dg.DagsterRunStatus.STARTED, registered=True) for _ in range(2)]
    below = build_outbox_lag_sensor(
        relay_stream_job, settings=OrchestrationSettings(trigger_pending=1, relay_runs_max=3)
    )
    at_max = build_outbox_lag_sensor(
        relay_stream_job, settings=OrchestrationSettings(trigger_pending=1, relay_runs_max=2)
    )

    with live_worker(db, table, stream_worker_id(runs[0])), live_worker(db, table, stream_worker_id(runs[1])):
        _up_for(db, table, seconds=60)
        more = tick(below, instance, dagster_resources)
        enough = tick(at_max, instance, dagster_resources)

    assert [r.tags["outbox/reason"] for r in requested(more)] == ["lagging"]
    assert requested(enough) == [] and "lagging:" in skip_message(enough)


def test_partitions_a_bulk_drain_has_leased_get_no_more_relay_runs(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
    db: psycopg.Connection,
    table: OutboxTable,
) -> None:
    """Issue 40, case 19: a drain's partitions lag until it commits, and no relay run can take them; the sensor added
    runs up to the maximum for them."""
    write_rows(200)
    runs = [_stream_run(instance, dg.DagsterRunStatus.STARTED, registered=True) for _ in range(2)]
    sensor = build_outbox_lag_sensor(
        relay_stream_job, settings=OrchestrationSettings(trigger_pending=1, relay_runs_max=3)
    )

    with live_worker(db, table, stream_worker_id(runs[0])), live_worker(db, table, stream_worker_id(runs[1])):
        _up_for(db, table, seconds=60)
        plan_drain(db, table, strategy="partitioned", owner=drain_owner("a-drain-run"))
        result = tick(sensor, instance, dagster_resources)

    assert requested(result) == [] and "lagging" not in skip_message(result)


def test_rows_held_behind_a_dead_letter_get_no_more_relay_runs(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    """Issue 40, case 19: a key held behind a dead letter waits for an operator (the dead-letter alert says so), not
    for more runs; its old held rows made a partition with a few fresh rows look late, and the sensor added runs."""
    topic = new_topic()
    poisoned("partitioned", db, table, kafka, topic)  # key A held behind its dead letter
    db.execute(sql.SQL("UPDATE {} SET created_at = now() - interval '1 hour'").format(table.held))
    enqueue(db, topic, {"fresh": True}, key="B", table=table)  # the relay's to publish, and not late
    run = _stream_run(instance, dg.DagsterRunStatus.STARTED, registered=True)
    sensor = build_outbox_lag_sensor(
        relay_stream_job, settings=OrchestrationSettings(trigger_pending=1000, trigger_age_s=60.0, relay_runs_max=3)
    )

    with live_worker(db, table, stream_worker_id(run)):
        _up_for(db, table, seconds=600)
        result = tick(sensor, instance, dagster_resources)

    assert requested(result) == [] and "lagging" not in skip_message(result)


def test_a_run_that_registered_moments_ago_gets_time_to_work_through_the_lag_before_another_is_added(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
    db: psycopg.Connection,
    table: OutboxTable,
) -> None:
    """Rows older than the age trigger, found by the first run as it comes up (`dagster dev` starting against an
    outbox written before it): the run drains them in moments; a second run would cost seconds of CPU for nothing."""
    write_rows(200)
    run = _stream_run(instance, dg.DagsterRunStatus.STARTED, registered=True)
    sensor = build_outbox_lag_sensor(
        relay_stream_job, settings=OrchestrationSettings(trigger_pending=1, trigger_age_s=10.0, relay_runs_max=3)
    )

    with live_worker(db, table, stream_worker_id(run)):
        just_up = tick(sensor, instance, dagster_resources)
        _up_for(db, table, seconds=10)
        up_a_while = tick(sensor, instance, dagster_resources)

    assert requested(just_up) == [] and "came up" in skip_message(just_up)
    assert [r.tags["outbox/reason"] for r in requested(up_a_while)] == ["lagging"]


def _up_for(db: psycopg.Connection, table: OutboxTable, seconds: float) -> None:
    """Every registered worker registered ``seconds`` ago."""
    db.execute(
        psycopg.sql.SQL("UPDATE {} SET registered_at = now() - make_interval(secs => %s)").format(table.workers),
        [seconds],
    )


def test_an_idle_outbox_is_a_skip_with_a_reason(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    write_rows: Callable[..., Written],
) -> None:
    written = write_rows(40)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")
    instance.add_dynamic_partitions(OUTBOX_PARTITIONS_NAME, written.keys)
    sensor = build_outbox_lag_sensor(relay_stream_job, settings=EAGER)

    with live_worker(db, table, "cli-relay-1"):
        result = tick(sensor, instance, dagster_resources)

    assert isinstance(result, dg.SkipReason)
    assert "0 pending rows" in (result.skip_message or "")


def test_an_outbox_the_relay_would_refuse_gets_no_run_but_a_skip_naming_the_command(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
    db: psycopg.Connection,
    table: OutboxTable,
) -> None:
    """A run would fail at once and the next tick would launch another: a run every few seconds, each seconds of CPU."""
    write_rows(40)
    db.execute(psycopg.sql.SQL("DROP INDEX {}").format(table.ident("outbox_messages_position")))
    sensor = build_outbox_lag_sensor(relay_stream_job, settings=OrchestrationSettings(strategy="partitioned"))

    result = tick(sensor, instance, dagster_resources)

    assert requested(result) == []
    assert "outbox indexes --strategy partitioned" in skip_message(result)


@pytest.mark.parametrize("parent_wrote", ["its own run id", "true (the release before)"])
def test_a_re_executed_run_not_registered_yet_counts_as_starting_though_it_inherited_its_parents_tag(
    parent_wrote: str,
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
) -> None:
    """Issue 40, case 18: a retry or re-execution inherits its parent's tags; with ``registered: true`` among them it
    looked registered (and dead) while it was still starting, and the sensor launched a second run beside it."""
    write_rows(40)
    parent = _stream_run(instance, dg.DagsterRunStatus.FAILURE, registered=True)
    if parent_wrote.startswith("true"):
        instance.add_run_tags(parent.run_id, {REGISTERED_TAG: "true"})
    inherited = {**instance.get_run_by_id(parent.run_id).tags, "dagster/parent_run_id": parent.run_id}  # type: ignore[union-attr]
    _stream_run(instance, dg.DagsterRunStatus.STARTED, **inherited)
    sensor = build_outbox_lag_sensor(relay_stream_job, settings=OrchestrationSettings())

    result = tick(sensor, instance, dagster_resources)

    assert requested(result) == [] and "1 run(s) starting" in skip_message(result)
