"""What the sensors read of runs: the job type they take, which runs are in flight, Dagster's tags. See
docs/dagster.md#sensors."""

from typing import TYPE_CHECKING, TypeAlias

import dagster as dg

if TYPE_CHECKING:  # the type define_asset_job returns; Dagster does not export its name, nothing imports it at run time
    from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

# A job as sensors take it: a job, or what define_asset_job returns.
Job: TypeAlias = "dg.JobDefinition | UnresolvedAssetJobDefinition"

PARTITION_TAG = "dagster/partition"
WILL_RETRY_TAG = "dagster/will_retry"
# Runs that hold (or are about to hold) their partitions.
IN_FLIGHT_STATUSES = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]
