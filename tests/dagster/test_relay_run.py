"""`relay_partition` runs against the real PostgreSQL and broker: a run drains exactly its partition and
records its metadata; with the broker down it retries, then fails; rerun from the failure (what the UI's
"re-execute" does) once the broker is back, it succeeds and both runs are in the partition's history."""

import os
from collections.abc import Callable, Iterator

import dagster as dg
import psycopg
import pytest

from outbox_pipeline import OutboxTable
from outbox_pipeline.assets import relayed_outbox
from outbox_pipeline.definitions import build_resources
from outbox_pipeline.localstack import LocalBroker
from outbox_pipeline.orchestration.jobs import build_relay_partition_job
from outbox_pipeline.orchestration.partitions import OUTBOX_PARTITIONS_NAME, partition_key
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.relay import WorkerPresence
from outbox_pipeline.strategies import StrategyConfig, strategy_class
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import message_ids

from .conftest import FAST_FAILING_KAFKA, Written

FAST_RETRIES = dg.RetryPolicy(max_retries=2, delay=0.2)
JOB_NAME = "relay_partition_fast_retries"


def relay_job_from_env() -> dg.JobDefinition:
    """The relay job with quick retries and the resources of definitions.py (configured from the
    environment), importable by name so that Dagster can re-execute its runs."""
    defs = dg.Definitions(
        assets=[relayed_outbox],
        jobs=[build_relay_partition_job(JOB_NAME, FAST_RETRIES)],
        resources=build_resources(OrchestrationSettings.from_env()),
    )
    return defs.resolve_job_def(JOB_NAME)


@pytest.fixture
def env_for_definitions(
    monkeypatch: pytest.MonkeyPatch, dsn: str, table: OutboxTable, kafka: KafkaProbe
) -> Iterator[None]:
    """What `outbox dev` exports for dagster, for this test's schema; KAFKA_* become producer properties."""
    monkeypatch.setenv("OUTBOX_PG_DSN", dsn)
    monkeypatch.setenv("OUTBOX_SCHEMA", table.schema)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
    for prop, value in FAST_FAILING_KAFKA.items():
        monkeypatch.setenv("KAFKA_" + prop.upper().replace(".", "_"), value)
    monkeypatch.delenv("OUTBOX_RELAY_STRATEGY", raising=False)
    assert os.environ["OUTBOX_SCHEMA"] == table.schema
    yield


def _materialization(result: dg.ExecuteInProcessResult | dg.JobExecutionResult) -> dict[str, object]:
    [event] = result.get_asset_materialization_events()
    return {k: v.value for k, v in event.materialization.metadata.items()}


def test_a_relay_run_drains_exactly_its_partition_and_records_what_it_did(
    instance: dg.DagsterInstance,
    env_for_definitions: None,
    kafka: KafkaProbe,
    write_rows: Callable[..., Written],
) -> None:
    written = write_rows(200)
    key, *others = written.keys
    instance.add_dynamic_partitions(OUTBOX_PARTITIONS_NAME, written.keys)

    result = relay_job_from_env().execute_in_process(partition_key=key, instance=instance)

    assert result.success
    arrived = message_ids(kafka.consume(written.topic, expect=len(written.by_key[key]), idle_s=2.0))
    assert sorted(arrived) == sorted(written.by_key[key])
    metadata = _materialization(result)
    assert metadata["rows_published"] == len(written.by_key[key])
    assert metadata["lag_before"] == len(written.by_key[key]) and metadata["lag_after"] == 0
    assert metadata["strategy"] == "partitioned" and metadata["duplicates_risked"] == 0
    assert metadata["dead_lettered"] == 0 and float(metadata["msg_per_s"]) > 0  # type: ignore[arg-type]
    assert metadata["oldest_pending_age_after_s"] == 0.0


def test_a_run_that_finds_its_partition_leased_by_a_live_worker_leaves_it_and_says_who_holds_it(
    instance: dg.DagsterInstance,
    env_for_definitions: None,
    table: OutboxTable,
    connect: Callable[[], psycopg.Connection],
    write_rows: Callable[..., Written],
) -> None:
    written = write_rows(200)
    instance.add_dynamic_partitions(OUTBOX_PARTITIONS_NAME, written.keys)
    WorkerPresence(connect(), table, "cli-1", "session").register()  # an `outbox relay` worker, alive
    holder = strategy_class("partitioned")(connect(), StrategyConfig(table=table, worker_id="cli-1"))
    claim = holder.claim(10)  # it leases every partition with work
    assert claim is not None
    key = partition_key(*sorted(claim.state)[0])

    result = relay_job_from_env().execute_in_process(partition_key=key, instance=instance)

    assert result.success
    metadata = _materialization(result)
    assert metadata["rows_published"] == 0 and metadata["lag_after"] == len(written.by_key[key])
    assert "leased by cli-1 (alive)" in str(metadata["pending_reasons"])


def test_a_run_retries_while_the_broker_is_down_then_fails_and_its_rerun_succeeds_once_it_is_back(
    instance: dg.DagsterInstance,
    env_for_definitions: None,
    broker: LocalBroker,
    kafka: KafkaProbe,
    write_rows: Callable[..., Written],
) -> None:
    written = write_rows(60, partitions=1)
    [key] = written.keys
    instance.add_dynamic_partitions(OUTBOX_PARTITIONS_NAME, [key])
    job = dg.reconstructable(relay_job_from_env)
    broker.freeze()
    try:
        failed = dg.execute_job(job, instance, tags={"dagster/partition": key})
    finally:
        broker.thaw()

    assert not failed.success
    retries = [e for e in failed.all_events if e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY]
    assert len(retries) == FAST_RETRIES.max_retries

    # The UI's "Re-execute from failure" copies the parent's tags; the Python API needs them given.
    rerun = dg.execute_job(
        job,
        instance,
        tags={"dagster/partition": key},
        reexecution_options=dg.ReexecutionOptions.from_failure(failed.run_id, instance),
    )

    assert rerun.success
    assert _materialization(rerun)["rows_published"] == 60
    arrived = message_ids(kafka.consume(written.topic, expect=60))
    assert set(arrived) == set(written.by_key[key])
    history = instance.get_runs(dg.RunsFilter(tags={"dagster/partition": key}))
    assert [(run.run_id, run.status) for run in history] == [
        (rerun.run_id, dg.DagsterRunStatus.SUCCESS),
        (failed.run_id, dg.DagsterRunStatus.FAILURE),
    ]
