"""The per-partition relay job `relay_partition`, retried inside the run by its RetryPolicy and run in process. See
docs/dagster.md#per-partition-runs."""

from typing import TYPE_CHECKING

import dagster as dg

if TYPE_CHECKING:  # the type define_asset_job returns; Dagster does not export its name, nothing imports it at run time
    from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

from outbox_pipeline.assets.relay import relayed_outbox

from .partitions import outbox_partitions

RELAY_JOB_NAME = "relay_partition"
# The partition of a relay run, on relay runs only: dagster.yaml limits in-flight runs to one per value of this tag.
# Not on `dagster/partition`, which the operator jobs of a partition carry too: release_lease and replay_partition
# then queued behind the hung relay run they are meant to rescue.
RELAY_PARTITION_TAG = "outbox/relay_partition"
# Runs launched for a partition of the job (launchpad, Partitions tab, re-execution) carry RELAY_PARTITION_TAG; no
# run config comes with the partition (the run's key is its partition).
RELAY_PARTITION_CONFIG = dg.PartitionedConfig(
    partitions_def=outbox_partitions,
    run_config_for_partition_key_fn=lambda _key: {},
    tags_for_partition_key_fn=lambda key: {RELAY_PARTITION_TAG: key},
)
RELAY_MAX_RUNTIME_S = 900

# About 2 s, 4 s, 8 s (+-50 % jitter) between attempts: long enough for a broker blip or a leader
# election, short enough that a partition is not left behind for long.
RELAY_RETRY_POLICY = dg.RetryPolicy(
    max_retries=3, delay=2.0, backoff=dg.Backoff.EXPONENTIAL, jitter=dg.Jitter.PLUS_MINUS
)


def build_relay_partition_job(
    name: str = RELAY_JOB_NAME, retry_policy: dg.RetryPolicy = RELAY_RETRY_POLICY
) -> "UnresolvedAssetJobDefinition":
    return dg.define_asset_job(
        name,
        selection=[relayed_outbox],
        config=RELAY_PARTITION_CONFIG,
        executor_def=dg.in_process_executor,
        op_retry_policy=retry_policy,
        # Run monitoring fails a relay run that hangs far past its time budget, freeing its partition.
        run_tags={"dagster/max_runtime": RELAY_MAX_RUNTIME_S},
        description="Relay one outbox partition (the run's partition key, topic:partition) to Kafka until "
        "caught up or the time budget.",
    )


relay_partition_job = build_relay_partition_job()
