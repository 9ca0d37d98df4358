"""The one module that wires assets, checks, jobs, sensors and resources together for `dagster dev`. See
docs/dagster.md#orchestration-settings."""

import dagster as dg

from outbox_pipeline.assets import outbox_backlog, outbox_dead_letters, outbox_lag_slo, relayed_outbox
from outbox_pipeline.assets.spark import bulk_drain_job, spark_assets, spark_jobs, spark_schedules
from outbox_pipeline.orchestration.alert_sensors import (
    build_dead_letter_sensor,
    build_lag_slo_sensor,
    build_relay_failure_sensor,
)
from outbox_pipeline.orchestration.jobs import relay_partition_job
from outbox_pipeline.orchestration.lag_sensor import build_outbox_lag_sensor
from outbox_pipeline.orchestration.operator_jobs import OPERATOR_JOBS
from outbox_pipeline.orchestration.relay_stream import relay_stream_job
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.resources import AlertResource, KafkaResource, PostgresResource, SparkResource
from outbox_pipeline.settings import PG_DSN, SCHEMA


def build_resources(orchestration: OrchestrationSettings) -> dict[str, dg.ConfigurableResource]:
    """The resources every definition uses, configured from the environment at execution time."""
    return {
        "postgres": PostgresResource(
            dsn=dg.EnvVar(PG_DSN.name),
            # Optional: the default schema unless OUTBOX_SCHEMA names another.
            schema_name=dg.EnvVar(SCHEMA.name) if SCHEMA.is_set() else SCHEMA.default,
        ),
        # Every other KAFKA_* variable becomes a librdkafka property, as for the `outbox` CLI.
        "kafka": KafkaResource(bootstrap_servers=dg.EnvVar("KAFKA_BOOTSTRAP_SERVERS"), include_kafka_env=True),
        "alerts": AlertResource(),
        # SPARK_MASTER: local[*] unless it names a cluster (spark://, k8s://, yarn).
        "spark": SparkResource.from_env(),
        # Read at load (the sensors' intervals are fixed then); the UI shows each value and what it means.
        "orchestration": orchestration,
    }


settings = OrchestrationSettings.from_env()

defs = dg.Definitions(
    assets=[outbox_backlog, relayed_outbox, *spark_assets],
    asset_checks=[outbox_lag_slo, outbox_dead_letters],
    jobs=[relay_stream_job, relay_partition_job, *OPERATOR_JOBS, *spark_jobs],
    schedules=spark_schedules,
    sensors=[
        # Keeps live relay_stream runs (long-lived, registered relay workers) covering every partition; past
        # OUTBOX_BULK_DRAIN_THRESHOLD pending rows it requests one bulk drain on Spark instead.
        # relay_partition stays for operators: one partition, from its page in the UI.
        build_outbox_lag_sensor(relay_stream_job, settings=settings, bulk_drain_job=bulk_drain_job),
        build_lag_slo_sensor(settings),
        build_dead_letter_sensor(settings),
        build_relay_failure_sensor(relay_stream_job, relay_partition_job),
    ],
    resources=build_resources(settings),
)
