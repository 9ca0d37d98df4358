"""Dagster room: the PySpark assets (bulk drain, daily partition maintenance), their jobs and schedule.

Resource keys: ``postgres`` (PostgresResource), ``kafka`` (KafkaResource, bulk_drain only) and
``spark`` (SparkResource).
"""

from .bulk_drain import (
    DEFAULT_BULK_DRAIN_THRESHOLD,
    ENV_BULK_DRAIN_THRESHOLD,
    BulkDrainConfig,
    bulk_drain,
    bulk_drain_job,
    bulk_drain_threshold,
)
from .partition_maintenance import (
    MaintenanceConfig,
    maintenance_partitions,
    outbox_partition_maintenance,
    outbox_partition_maintenance_job,
    outbox_partition_maintenance_schedule,
)

spark_assets = [bulk_drain, outbox_partition_maintenance]
spark_jobs = [bulk_drain_job, outbox_partition_maintenance_job]
spark_schedules = [outbox_partition_maintenance_schedule]

__all__ = [
    "DEFAULT_BULK_DRAIN_THRESHOLD",
    "ENV_BULK_DRAIN_THRESHOLD",
    "BulkDrainConfig",
    "MaintenanceConfig",
    "bulk_drain",
    "bulk_drain_job",
    "bulk_drain_threshold",
    "maintenance_partitions",
    "outbox_partition_maintenance",
    "outbox_partition_maintenance_job",
    "outbox_partition_maintenance_schedule",
    "spark_assets",
    "spark_jobs",
    "spark_schedules",
]
