"""The `bulk_drain` asset and `bulk_drain_job`: a PySpark drain of a large backlog, run by hand or requested by the lag
sensor. See docs/spark.md#bulk_drain-job-bulk_drain_job."""

import time

import dagster as dg
import psycopg
from pydantic import Field

from outbox_pipeline.config import OutboxTable
from outbox_pipeline.drain.engine import backlog_at_least, drain_leases, plan_drain, release_drain
from outbox_pipeline.drain.values import (
    DEFAULT_FETCH_ROWS,
    DEFAULT_LEASE_S,
    OWNER_PREFIX,
    DrainOutcome,
    drain_owner,
    no_drain,
)
from outbox_pipeline.errors import OutboxError
from outbox_pipeline.observe.lag import explain_pending
from outbox_pipeline.observe.liveness import liveness_from_env
from outbox_pipeline.orchestration.drain_requests import DRAINED_TAG
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.relay.presence import present
from outbox_pipeline.resources.kafka import KafkaResource
from outbox_pipeline.resources.postgres import PostgresResource
from outbox_pipeline.resources.spark import SparkResource


class BulkDrainConfig(dg.Config):
    strategy: str = Field(
        default="",
        description="empty: the outbox's own (set: it must be that one); a drain serves partitioned and serialized "
        "only",
    )
    topics: list[str] = Field(default_factory=list, description="drain only these topics (empty: all)")
    max_partitions: int | None = Field(default=None, description="drain at most this many virtual partitions")
    min_pending: int = Field(
        default=0, description="do nothing unless at least this many rows wait (0: drain whatever waits)"
    )
    lease_s: float = Field(
        default=DEFAULT_LEASE_S,
        description="lease on each drained partition, renewed until the commit (by its task while it is read, then "
        "by the driver); the online relay skips it meanwhile",
    )
    page_rows: int = Field(default=DEFAULT_FETCH_ROWS, description="rows per PostgreSQL fetch and Kafka batch")


@dg.asset(
    group_name="outbox_spark",
    kinds={"spark", "kafka", "postgres"},
    description="Drain a large outbox backlog with Spark: one task per virtual partition, order kept, "
    "positions committed only after every task's deliveries were confirmed.",
)
def bulk_drain(
    context: dg.AssetExecutionContext,
    config: BulkDrainConfig,
    postgres: PostgresResource,
    kafka: KafkaResource,
    spark: SparkResource,
    orchestration: OrchestrationSettings,
) -> dg.MaterializeResult:
    # pyspark only here, in a Spark run: loading the code location and every other run stay without it.
    from .drain_job import DrainFailed, run_drain

    table = postgres.table
    with postgres.connect() as conn:
        try:
            strategy = orchestration.strategy_of(conn, table, config.strategy or None)
        except OutboxError as exc:
            raise dg.Failure(description=str(exc)) from None
    if (why := no_drain(strategy)) is not None:
        raise dg.Failure(description=why)
    owner = drain_owner(context.run.run_id)
    # Registered for as long as this driver runs: if it dies, any relay worker frees its leases in a second.
    with present(postgres.dsn, table, owner, kind="drain", liveness=liveness_from_env()):
        with postgres.connect() as conn:
            _release_finished_drains(context, conn, table)
            if config.min_pending and not backlog_at_least(conn, table, strategy, config.min_pending):
                context.log.info("fewer than %d rows pending: nothing to do", config.min_pending)
                return dg.MaterializeResult(metadata={"rows": 0, "partitions": 0, "skipped": "below min_pending"})
            plan = plan_drain(
                conn,
                table,
                strategy=strategy,
                owner=owner,
                lease_s=config.lease_s,
                topics=config.topics or None,
                max_partitions=config.max_partitions,
            )
            # The lag sensor reads it: after a drain that took no partition it requests no other for the cooldown.
            context.instance.add_run_tags(context.run_id, {DRAINED_TAG: str(len(plan.ranges))})
            if not plan.ranges:
                return _nothing_free(context, conn, table, strategy)
        context.log.info("draining %d partitions as %s", len(plan.ranges), owner)
        started = time.monotonic()
        try:
            outcome = run_drain(
                spark.session, plan, dsn=postgres.dsn, kafka_config=kafka.producer_config(), page_rows=config.page_rows
            )
            aborted = None
        except DrainFailed as exc:
            outcome, aborted = exc.outcome, str(exc)
        finally:
            # Safety net for a failure before the commit ran; releases nothing after a commit.
            with postgres.connect() as conn:
                release_drain(conn, table, owner)
    elapsed = time.monotonic() - started
    rows, metadata = _drained(strategy, outcome, elapsed)
    if outcome.failed or outcome.not_committed or aborted:
        raise _stopped_short(outcome, aborted, len(plan.ranges), rows, metadata)
    context.log.info("drained %d rows from %d partitions in %.1f s", rows, len(outcome.committed), elapsed)
    return dg.MaterializeResult(metadata=metadata)


def _drained(strategy: str, outcome: DrainOutcome, elapsed: float) -> "tuple[int, dict[str, dg.RawMetadataValue]]":
    """Rows committed, and the materialization's metadata: what was drained, how fast, and where each partition is."""
    rows = sum(d.rows for d in outcome.committed)
    return rows, {
        "strategy": strategy,
        "rows": rows,
        "bytes": sum(d.bytes for d in outcome.committed),
        "msg_per_s": round(rows / elapsed, 1) if elapsed > 0 else 0.0,
        "elapsed_s": round(elapsed, 3),
        "partitions": len(outcome.committed),
        "per_partition": dg.MetadataValue.json({d.label: d.rows for d in outcome.committed}),
        "positions": dg.MetadataValue.json({d.label: f"xid={d.last_xid} id={d.last_id}" for d in outcome.committed}),
    }


def _stopped_short(
    outcome: DrainOutcome, aborted: str | None, planned: int, rows: int, metadata: "dict[str, dg.RawMetadataValue]"
) -> dg.Failure:
    """The run fails, so the UI shows it; what was confirmed is committed already and the rest is the relay's."""
    stopped = dict(outcome.failed)
    first = next(iter(stopped.items()), None)
    reason = aborted or (
        f"{len(stopped)} of {planned} partitions stopped short: {first[0]}: {first[1]}"
        if first
        else f"{len(outcome.not_committed)} partitions not committed"
    )
    return dg.Failure(
        description=f"{reason}. What Kafka confirmed before that is committed ({rows} rows); the relay publishes "
        "the rest, with its attempts and dead letters for a message Kafka refuses. The lag sensor requests no "
        "other bulk drain for the cooldown (OUTBOX_BULK_DRAIN_COOLDOWN_S).",
        metadata={
            **metadata,
            "stopped": dg.MetadataValue.json(stopped),
            "not_committed": dg.MetadataValue.json(dict(outcome.not_committed)),
        },
    )


def _nothing_free(
    context: dg.AssetExecutionContext, conn: psycopg.Connection, table: OutboxTable, strategy: str
) -> dg.MaterializeResult:
    """No partition was free: say who holds the pending ones (relay workers working through them, backoffs, held
    keys). Not a failure: the relay publishes them."""
    held = explain_pending(conn, table, strategy)
    reason = "no partition with pending rows was free to drain" + (f": {'; '.join(held)}" if held else "")
    context.log.info("%s; the lag sensor requests no other bulk drain for the cooldown", reason)
    return dg.MaterializeResult(metadata={"rows": 0, "partitions": 0, "skipped": reason})


def _release_finished_drains(context: dg.AssetExecutionContext, conn: psycopg.Connection, table: OutboxTable) -> None:
    """Leases left by a drain whose run ended without releasing them (killed process): free them now
    instead of after their expiry, so a rerun can take those partitions at once."""
    for holder in drain_leases(conn, table):
        run = context.instance.get_run_by_id(holder[len(OWNER_PREFIX) :])
        if run is None or run.is_finished:
            released = release_drain(conn, table, holder)
            context.log.warning("released %d partitions still leased by finished drain %s", released, holder)


bulk_drain_job = dg.define_asset_job(
    "bulk_drain_job",
    selection=[bulk_drain],
    description="PySpark bulk drain of the outbox backlog (requested by the lag sensor or run by hand).",
)
