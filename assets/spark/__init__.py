"""The PySpark assets (bulk drain, daily partition maintenance), their jobs and schedule; their resource keys are
``postgres``, ``kafka`` (bulk_drain only) and ``spark``. Each module: docs/architecture.md#the-spark-room; the design:
docs/spark.md."""

import importlib
from typing import Any

# Names resolve on first use (PEP 562): executors import ``outbox_pipeline.assets.spark.datasource`` alone, without
# Dagster and the assets. No submodule may share an exported name: an imported submodule becomes an
# attribute of the package and would shadow the export (hence bulk_drain_asset.py).
_EXPORTS = {
    **dict.fromkeys(
        [
            "BulkDrainConfig",
            "bulk_drain",
            "bulk_drain_job",
        ],
        ".bulk_drain_asset",
    ),
    **dict.fromkeys(
        [
            "MaintenanceConfig",
            "maintenance_partitions",
            "outbox_partition_maintenance",
            "outbox_partition_maintenance_job",
            "outbox_partition_maintenance_schedule",
        ],
        ".partition_maintenance",
    ),
}
_GROUPS = {
    "spark_assets": ["bulk_drain", "outbox_partition_maintenance"],
    "spark_jobs": ["bulk_drain_job", "outbox_partition_maintenance_job"],
    "spark_schedules": ["outbox_partition_maintenance_schedule"],
}

__all__ = sorted([*_EXPORTS, *_GROUPS])


def __getattr__(name: str) -> Any:
    if name in _GROUPS:
        return [__getattr__(member) for member in _GROUPS[name]]
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
