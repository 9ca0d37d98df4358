"""The relay work a Dagster run executes (a partition caught up, a long-lived stream), as plain functions:
orchestration/ calls them, and they import no Dagster. Each module: docs/architecture.md#runs."""

from .partition_run import PartitionRunReport, end_backoff, lag_of, relay_partition
from .stream_run import PartitionProgress, StreamReport, StreamRun

__all__ = [
    "PartitionProgress",
    "PartitionRunReport",
    "StreamReport",
    "StreamRun",
    "end_backoff",
    "lag_of",
    "relay_partition",
]
