"""`relayed_outbox`, one partition per outbox (topic, virtual partition), so each partition's Partitions tab is its
relay history. See docs/dagster.md#per-partition-runs."""

from typing import Literal

import dagster as dg
from pydantic import Field

from outbox_pipeline.orchestration.partitions import outbox_partitions, parse_partition_key
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.relay.relay_settings import RelaySettings
from outbox_pipeline.resources.kafka import KafkaResource
from outbox_pipeline.resources.postgres import PostgresResource
from outbox_pipeline.runs.partition_run import PartitionRunReport, end_backoff, relay_partition
from outbox_pipeline.strategies.base import StrategyConfig


class RelayRunConfig(dg.Config):
    """How one partition's relay run works; the defaults suit the lag sensor's runs."""

    strategy: str | None = Field(
        default=None, description="relay strategy; empty: OUTBOX_RELAY_STRATEGY, else the outbox's own"
    )
    max_seconds: float | None = Field(
        default=None, description="time budget in seconds; empty: OUTBOX_RELAY_MAX_SECONDS (default 60)"
    )
    batch_size: int = Field(
        default=1000, description="rows per claim (table strategies; a wal run hands Kafka what its stream holds)"
    )
    mode: Literal["delete", "mark-sent"] = Field(default="delete", description="row strategies: delete or keep rows")
    kafka_transactions: bool = Field(
        default=False, description="partitioned/serialized: one Kafka transaction per batch"
    )
    lease_s: float = Field(default=60.0, description="partition/row lease; longer than one batch's publish")
    backoff_max_s: float = Field(
        default=30.0, description="longest engine backoff after a delivery failure (the job's RetryPolicy retries too)"
    )


@dg.asset(
    partitions_def=outbox_partitions,
    group_name="outbox",
    kinds={"postgres", "kafka"},
    description="Outbox rows of one (topic, virtual partition) relayed to Kafka; one run per partition.",
)
def relayed_outbox(
    context: dg.AssetExecutionContext,
    config: RelayRunConfig,
    postgres: PostgresResource,
    kafka: KafkaResource,
    orchestration: OrchestrationSettings,
) -> dg.MaterializeResult:
    topic, partition = parse_partition_key(context.partition_key)
    settings = orchestration
    # Retries of this run (op retries, run retries, a rerun from the UI) share the root run id, so they
    # share the worker id and take back this run's lease at once; other runs wait for it to end.
    worker_id = f"dagster-{context.run.root_run_id or context.run.run_id}"
    strategy_config = StrategyConfig(
        table=postgres.table,
        worker_id=worker_id,
        mode=config.mode,
        lease_s=config.lease_s,
        backoff_max_s=config.backoff_max_s,
        kafka_transactions=config.kafka_transactions,
        on_poison=settings.poison,
    )
    relay_settings = RelaySettings.from_env(
        batch_size=config.batch_size, listen=False, max_seconds=config.max_seconds or settings.relay_max_seconds
    )
    with postgres.connect() as conn:
        strategy = settings.strategy_of(conn, postgres.table, config.strategy)
        # This attempt is the retry: the engine's own backoff would only make it find nothing to claim.
        if end_backoff(conn, postgres.table, strategy, topic, partition):
            context.log.info("%s: ended the engine's backoff after earlier delivery failures", context.partition_key)
        report = relay_partition(
            conn, postgres.dsn, strategy, strategy_config, topic, partition, kafka.publisher(), relay_settings
        )
    metadata = _metadata(report)
    context.log.info(
        "%s: published %d in %.1f s (%.0f msg/s), pending %d -> %d",
        context.partition_key,
        report.published,
        report.elapsed_s,
        report.msg_per_s,
        report.pending_before,
        report.pending_after,
    )
    if report.delivery_error is not None:
        raise dg.Failure(
            description=f"{context.partition_key}: Kafka did not take the partition's rows: {report.delivery_error}",
            metadata=metadata,
            allow_retries=True,
        )
    if report.leased_elsewhere:
        context.log.warning(
            "%s is being relayed by %s; this run left it to them", context.partition_key, report.leased_elsewhere
        )
    return dg.MaterializeResult(metadata=metadata)


def _metadata(report: PartitionRunReport) -> dict[str, dg.MetadataValue]:
    after = report.lag_after
    return {
        "rows_published": dg.MetadataValue.int(report.published),
        "duplicates_risked": dg.MetadataValue.int(report.duplicates_risked),
        "dead_lettered": dg.MetadataValue.int(report.dead_lettered),
        "msg_per_s": dg.MetadataValue.float(round(report.msg_per_s, 1)),
        "lag_before": dg.MetadataValue.int(report.pending_before),
        "lag_after": dg.MetadataValue.int(report.pending_after),
        "oldest_pending_age_after_s": dg.MetadataValue.float(round(report.oldest_pending_age_after_s or 0.0, 3)),
        "strategy": dg.MetadataValue.text(report.strategy),
        "position_after": dg.MetadataValue.text((after.position if after else None) or "-"),
        "claimed": dg.MetadataValue.int(report.claimed),
        "retried": dg.MetadataValue.int(report.retried),
        "batches": dg.MetadataValue.int(report.batches),
        "elapsed_s": dg.MetadataValue.float(round(report.elapsed_s, 3)),
        "worker_id": dg.MetadataValue.text(report.worker_id),
        "last_error": dg.MetadataValue.text((after.last_error if after else None) or "-"),
        "pending_reasons": dg.MetadataValue.text("\n".join(report.pending_reasons) or "-"),
    }
