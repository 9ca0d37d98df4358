"""Operator jobs launched with config, as from the UI's launchpad: replay a partition, release a stuck lease,
retry dead letters. Each changes the real outbox the way the engine operation it calls promises."""

import uuid
from collections.abc import Callable, Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, cast

import dagster as dg
import psycopg
import pytest
import yaml
from dagster._core.definitions.selector import RepositorySelector
from dagster._core.remote_representation.external_data import PartitionTagsSnap
from dagster._core.test_utils import in_process_test_workspace
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._core.workspace.context import WorkspaceRequestContext
from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.errors import SchemaError
from outbox_pipeline.observe import partition_lag
from outbox_pipeline.operate import list_dead_letters
from outbox_pipeline.orchestration.operator_jobs import OPERATOR_JOBS
from outbox_pipeline.orchestration.partitions import OUTBOX_PARTITIONS_NAME, parse_partition_key
from outbox_pipeline.runs import lag_of
from outbox_pipeline.store import require_indexes
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain

from .conftest import Written

ROOT = Path(__file__).resolve().parents[2]


def _job(name: str, resources: dict[str, dg.ConfigurableResource[Any]]) -> dg.JobDefinition:
    return dg.Definitions(jobs=OPERATOR_JOBS, resources=resources).resolve_job_def(name)


def _pending(db: psycopg.Connection, table: OutboxTable, key: str) -> int:
    lag = lag_of(db, table, "partitioned", *parse_partition_key(key))
    return lag.pending if lag else 0


def test_replaying_a_partition_from_its_start_makes_all_of_it_pending_again(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    write_rows: Callable[..., Written],
) -> None:
    written = write_rows(80)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")
    key, other = written.keys[:2]
    instance.add_dynamic_partitions(OUTBOX_PARTITIONS_NAME, written.keys)

    result = _job("replay_partition", dagster_resources).execute_in_process(
        partition_key=key,
        instance=instance,
        run_config={"ops": {"replay_outbox_partition": {"config": {"after_id": 0}}}},
    )

    assert result.success
    assert (_pending(db, table, key), _pending(db, table, other)) == (len(written.by_key[key]), 0)


def test_releasing_a_stuck_lease_frees_the_partition_at_once(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    write_rows: Callable[..., Written],
) -> None:
    written = write_rows(20, partitions=1)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")
    [key] = written.keys
    db.execute(  # a worker that died holding the partition for another hour
        sql.SQL("UPDATE {} SET locked_by = 'dead-worker', available_after = now() + interval '1 hour'").format(
            table.offsets
        )
    )
    instance.add_dynamic_partitions(OUTBOX_PARTITIONS_NAME, [key])

    result = _job("release_lease", dagster_resources).execute_in_process(partition_key=key, instance=instance)

    assert result.output_for_node("release_partition_lease") is True
    assert [lag.leased_by for lag in partition_lag(db, table, "partitioned")] == [None]


def test_retrying_dead_letters_puts_them_back_in_the_outbox(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    topic = new_topic()
    enqueue_many(db, [Message(topic, {"blob": "x" * 20_000}, key="k")], table=table)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned", producer={"message.max.bytes": 10_000})
    assert len(list_dead_letters(db, table)) == 1
    config = {"ops": {"retry_outbox_dead_letters": {"config": {"all": True}}}}

    result = _job("retry_dead_letters", dagster_resources).execute_in_process(instance=instance, run_config=config)

    assert result.output_for_node("retry_outbox_dead_letters") == 1
    assert list_dead_letters(db, table) == []
    assert sum(lag.pending for lag in partition_lag(db, table, "partitioned")) == 1


def test_discarding_a_dead_letter_from_the_launchpad_records_why_and_releases_the_rows_held_behind_it(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    topic = new_topic()
    poison, *held = enqueue_many(
        db, [Message(topic, {"blob": "x" * 20_000}, key="k"), *(Message(topic, {"n": i}, key="k") for i in range(3))],
        table=table,
    )  # fmt: skip
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned", producer={"message.max.bytes": 10_000})
    [dead] = list_dead_letters(db, table)
    assert (dead.id, dead.held_rows) == (poison.id, 3)
    config = {"ops": {"discard_outbox_dead_letters": {"config": {"ids": [poison.id], "reason": "corrupt order"}}}}

    result = _job("discard_dead_letters", dagster_resources).execute_in_process(instance=instance, run_config=config)

    assert result.output_for_node("discard_outbox_dead_letters") == 1
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")
    assert [int(r.headers["outbox_id"]) for r in kafka.consume(topic, expect=3)] == [r.id for r in held]
    row = db.execute(sql.SQL("SELECT discard_reason, discarded_by FROM {}").format(table.dead_letters)).fetchone()
    assert row == ("corrupt order", f"dagster run {result.run_id}")


def test_building_a_strategys_indexes_from_the_launchpad_makes_its_relay_start_and_drops_the_rest_when_asked(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    db: psycopg.Connection,
    table: OutboxTable,
) -> None:
    db.execute(sql.SQL("DROP INDEX {}").format(table.ident("outbox_messages_serial")))
    config = {"ops": {"build_outbox_strategy_indexes": {"config": {"strategy": "serialized", "drop_others": True}}}}

    result = _job("build_strategy_indexes", dagster_resources).execute_in_process(instance=instance, run_config=config)

    assert result.output_for_node("build_outbox_strategy_indexes") == ["outbox_messages_serial"]
    require_indexes(db, table, "serialized")  # a serialized relay would start
    with pytest.raises(SchemaError, match="outbox_messages_position"):
        require_indexes(db, table, "partitioned")


class _Launchpad:
    """Runs launched as from the UI's launchpad, against the deployment's code location loaded in process: each run has
    the job's origin, the job's run tags and the tags the launchpad reads for the chosen partition."""

    def __init__(self, instance: dg.DagsterInstance, workspace: WorkspaceRequestContext) -> None:
        self.instance = instance
        self.workspace = workspace
        [self.location] = workspace.code_location_names
        [self.repository] = workspace.get_code_location(self.location).get_repositories().values()

    def launch(self, job_name: str, key: str, *, running: bool = False) -> dg.DagsterRun:
        """Submitted to the instance's run coordinator (queued, for the daemon to dequeue); ``running``: dequeued
        before and running now."""
        job = self.repository.get_full_job(job_name)
        selector = RepositorySelector(location_name=self.location, repository_name=self.repository.name)
        partition = self.workspace.get_partition_tags(selector, job_name, key, self.instance, None)
        assert isinstance(partition, PartitionTagsSnap), partition
        run = self.instance.add_run(
            dg.DagsterRun(
                job_name=job_name,
                run_id=str(uuid.uuid4()),
                # The snapshot's field is declared Mapping[str, object]; Dagster builds it from string tags only.
                tags={**job.run_tags, **cast(Mapping[str, str], partition.tags)},
                status=dg.DagsterRunStatus.STARTED if running else dg.DagsterRunStatus.NOT_STARTED,
                remote_job_origin=job.get_remote_origin(),
                job_code_origin=job.get_python_origin(),
            )
        )
        return run if running else self.instance.submit_run(run.run_id, self.workspace)


@pytest.fixture
def launchpad() -> Iterator[_Launchpad]:
    """The local stack's instance (its dagster.yaml's run queue) and the deployment's code location."""
    template = resources.files("outbox_pipeline.localstack").joinpath("dagster.yaml").read_text()
    with dg.instance_for_test(overrides={"concurrency": yaml.safe_load(template)["concurrency"]}) as instance:
        origin = LoadableTargetOrigin(module_name="outbox_pipeline.definitions", working_directory=str(ROOT))
        with in_process_test_workspace(instance, origin) as workspace:
            yield _Launchpad(instance, workspace)


def _dequeued(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    """The queued runs the daemon launches at its next iteration: its own choice, with the queue's limits."""
    daemon = QueuedRunCoordinatorDaemon(interval_seconds=1)
    return daemon._get_runs_to_dequeue(instance, instance.get_concurrency_config(), fixed_iteration_time=None)


def test_operator_jobs_of_a_partition_start_at_once_while_a_relay_run_of_it_hangs(launchpad: _Launchpad) -> None:
    """Issue 40, case 21: release_lease and replay_partition, which rescue a partition from a hung relay_partition run,
    queued behind that very run (the one-run-per-partition limit was on ``dagster/partition``, which they carry too)."""
    launchpad.launch("relay_partition", "orders:3", running=True)  # hung
    queued = {
        launchpad.launch(job, "orders:3").run_id: f"{job} orders:3"
        for job in ("release_lease", "replay_partition", "relay_partition")
    }
    queued[launchpad.launch("relay_partition", "orders:4").run_id] = "relay_partition orders:4"

    starting = sorted(queued[run.run_id] for run in _dequeued(launchpad.instance))

    # Only the second relay run of the hung partition waits.
    assert starting == ["relay_partition orders:4", "release_lease orders:3", "replay_partition orders:3"]
