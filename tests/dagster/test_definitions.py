"""The project's Definitions load and hold what an operator finds in the UI, with the sensors running."""

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from outbox_pipeline import OutboxTable
from outbox_pipeline.assets import outbox_backlog, outbox_lag_slo
from outbox_pipeline.definitions import defs
from outbox_pipeline.errors import ConfigurationError
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.resources import PostgresResource

from .conftest import Written

ROOT = Path(__file__).resolve().parents[2]


def test_the_definitions_load_with_the_relay_job_operator_jobs_check_and_running_sensors() -> None:
    dg.Definitions.validate_loadable(defs)
    repository = defs.get_repository_def()

    assert {job.name for job in repository.get_all_jobs()} >= {
        "relay_partition",
        "replay_partition",
        "release_lease",
        "retry_dead_letters",
        "build_strategy_indexes",
    }
    assert {(sensor.name, sensor.default_status) for sensor in repository.sensor_defs} >= {
        ("outbox_lag_sensor", dg.DefaultSensorStatus.RUNNING),
        ("outbox_lag_slo_sensor", dg.DefaultSensorStatus.RUNNING),
        ("relay_run_failure_alert", dg.DefaultSensorStatus.RUNNING),
    }
    assert dg.AssetCheckKey(dg.AssetKey("outbox_backlog"), "outbox_lag_slo") in repository.asset_graph.asset_check_keys
    assert repository.get_job("relay_partition").partitions_def is not None


def test_loading_the_code_location_imports_neither_pyspark_nor_pyarrow() -> None:
    """Every run loads the code location: only Spark runs may pay for Spark (issue 15, light code location)."""
    probe = (
        "import sys, outbox_pipeline.definitions; print(sorted(m for m in ('pyspark', 'pyarrow') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert loaded.stdout.strip() == "[]", loaded.stderr[-2000:]


def test_the_orchestration_settings_are_a_resource_showing_each_variable_and_what_it_means() -> None:
    """The UI's resource page shows the values the deployment runs with; each says which variable sets it."""
    env = {"OUTBOX_RELAY_RUNS_MAX": "7", "OUTBOX_LAG_WARN_PENDING": "50"}
    code = (
        "import json, outbox_pipeline.definitions as d\n"
        "r = d.defs.resources['orchestration']\n"
        "described = {n: f.description for n, f in type(r).model_fields.items()}\n"
        "print(json.dumps({'values': r.model_dump(), 'described': described}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin", **env},
    )
    shown = json.loads(out.stdout)
    assert (shown["values"]["relay_runs_max"], shown["values"]["lag_warn_pending"]) == (7, 50)
    assert shown["values"]["strategy"] == ""  # the outbox's own
    assert "$OUTBOX_RELAY_RUNS_MAX" in shown["described"]["relay_runs_max"]
    assert all("$OUTBOX_" in text for text in shown["described"].values())


def test_a_setting_overridden_for_one_run_is_what_that_run_uses(
    instance: dg.DagsterInstance,
    dagster_resources: dict[str, dg.ConfigurableResource[Any]],
    write_rows: Callable[..., Written],
) -> None:
    write_rows(11, partitions=1)
    override = {"resources": {"orchestration": {"config": {"lag_warn_pending": 5, "lag_error_pending": 10}}}}

    default = dg.materialize([outbox_backlog, outbox_lag_slo], resources=dagster_resources, instance=instance)
    lowered = dg.materialize(
        [outbox_backlog, outbox_lag_slo], resources=dagster_resources, instance=instance, run_config=override
    )

    assert [e.passed for e in default.get_asset_check_evaluations()] == [True]
    [evaluation] = lowered.get_asset_check_evaluations()
    assert (evaluation.passed, evaluation.severity) == (False, dg.AssetCheckSeverity.ERROR)


def test_an_invalid_setting_names_its_variable() -> None:
    with pytest.raises(ConfigurationError, match="OUTBOX_RELAY_STRATEGY='fastest': choose one of"):
        OrchestrationSettings.from_env({"OUTBOX_RELAY_STRATEGY": "fastest"})
    with pytest.raises(ConfigurationError, match="OUTBOX_RELAY_RUNS_MAX='many': must be an integer"):
        OrchestrationSettings.from_env({"OUTBOX_RELAY_RUNS_MAX": "many"})


def test_the_postgres_resources_sessions_run_with_jit_off_pooled_or_not(dsn: str, table: OutboxTable) -> None:
    """The lag sensor, the checks and the operator jobs read through this resource: their sessions are engine
    sessions (outbox_pipeline/server.py), JIT off whatever the server's default."""
    resource = PostgresResource(dsn=dsn, schema_name=table.schema)
    with dg.build_init_resource_context() as context:
        resource.setup_for_execution(context)
        try:
            for autocommit in (True, False):  # the pool's, then a fresh one
                with resource.connect(autocommit=autocommit) as conn:
                    assert conn.execute("SHOW jit").fetchone() == ("off",)
        finally:
            resource.teardown_after_execution(context)
