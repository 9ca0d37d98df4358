"""Dagster's sensors, jobs and schedules that operate the engine; no SQL or Kafka logic lives here. Each module:
docs/architecture.md#dagster."""

from typing import Any

from ..lazy_exports import lazy_exports

# Names resolve on first use (PEP 562): assets/ imports partitions.py, and jobs.py imports assets/, so importing every
# module here would be an import cycle.
_EXPORTS = {
    **dict.fromkeys(
        ["build_dead_letter_sensor", "build_lag_slo_sensor", "build_relay_failure_sensor"], ".alert_sensors"
    ),
    "DRAINED_TAG": ".drain_requests",
    **dict.fromkeys(["build_relay_partition_job", "relay_partition_job"], ".jobs"),
    "build_outbox_lag_sensor": ".lag_sensor",
    "OPERATOR_JOBS": ".operator_jobs",
    **dict.fromkeys(
        ["OUTBOX_PARTITIONS_NAME", "outbox_partitions", "parse_partition_key", "partition_key"], ".partitions"
    ),
    **dict.fromkeys(
        ["REGISTERED_TAG", "RELAYED_OUTBOX", "relay_stream_job", "stopping_on_terminate", "stream_worker_id"],
        ".relay_stream",
    ),
    "OrchestrationSettings": ".settings",
}

__all__ = sorted(_EXPORTS)


_resolve = lazy_exports(__name__, _EXPORTS)


def __getattr__(name: str) -> Any:
    return _resolve(name)
