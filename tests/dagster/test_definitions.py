"""The project's Definitions load and hold what an operator finds in the UI, with the sensors running."""

import dagster as dg

from outbox_pipeline.definitions import defs


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
