"""The project's Definitions load and hold what an operator finds in the UI, with the sensors running."""

import subprocess
import sys
from pathlib import Path

import dagster as dg

from outbox_pipeline.definitions import defs

ROOT = Path(__file__).resolve().parents[2]


def test_the_definitions_load_with_the_relay_job_operator_jobs_check_and_running_sensors() -> None:
    dg.Definitions.validate_loadable(defs)
    repository = defs.get_repository_def()

    assert {job.name for job in repository.get_all_jobs()} >= {
        "relay_partition",
        "replay_partition",
        "release_lease",
        "retry_dead_letters",
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
