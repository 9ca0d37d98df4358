"""Dagster room: the ``bulk_drain`` asset, a PySpark drain of a large backlog, and ``bulk_drain_job``.

Run by hand from the UI or requested by the lag sensor (by job name) when the backlog passes
``OUTBOX_BULK_DRAIN_THRESHOLD`` rows (declared in orchestration/settings.py). The engine plans and commits on
the driver (this process), Spark publishes one virtual partition per task; see ``outbox_pipeline.drain``
for the protocol.
"""

import time

import dagster as dg
import psycopg
from pydantic import Field

from outbox_pipeline.config import OutboxTable
from outbox_pipeline.drain import (
    DEFAULT_FETCH_ROWS,
    DEFAULT_LEASE_S,
    OWNER_PREFIX,
    backlog_at_least,
    drain_leases,
    drain_owner,
    plan_drain,
    release_drain,
)
from outbox_pipeline.liveness import liveness_from_env, present
from resources.kafka import KafkaResource
from resources.postgres import PostgresResource
from resources.spark import SparkResource


class BulkDrainConfig(dg.Config):
    strategy: str = Field(default="partitioned", description="the relay's position strategy: partitioned or serialized")
    topics: list[str] = Field(default_factory=list, description="drain only these topics (empty: all)")
    max_partitions: int | None = Field(default=None, description="drain at most this many virtual partitions")
    min_pending: int = Field(
        default=0, description="do nothing unless at least this many rows wait (0: drain whatever waits)"
    )
    lease_s: float = Field(
        default=DEFAULT_LEASE_S,
        description="lease on each drained partition, renewed while it is read; the online relay skips it meanwhile",
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
) -> dg.MaterializeResult:
    # pyspark only here, in a Spark run: loading the code location and every other run stay without it.
    from .drain_job import DrainFailed, run_drain

    table = postgres.table
    owner = drain_owner(context.run.run_id)
    # Registered for as long as this driver runs: if it dies, any relay worker frees its leases in a second.
    with present(postgres.dsn, table, owner, kind="drain", liveness=liveness_from_env()):
        with postgres.connect() as conn:
            _release_finished_drains(context, conn, table)
            if config.min_pending and not backlog_at_least(conn, table, config.strategy, config.min_pending):
                context.log.info("fewer than %d rows pending: nothing to do", config.min_pending)
                return dg.MaterializeResult(metadata={"rows": 0, "partitions": 0, "skipped": "below min_pending"})
            plan = plan_drain(
                conn,
                table,
                strategy=config.strategy,
                owner=owner,
                lease_s=config.lease_s,
                topics=config.topics or None,
                max_partitions=config.max_partitions,
            )
        if not plan.ranges:
            context.log.info("no partition with pending rows is free to drain")
            return dg.MaterializeResult(metadata={"rows": 0, "partitions": 0})
        context.log.info("draining %d partitions as %s", len(plan.ranges), owner)
        started = time.monotonic()
        try:
            outcome = run_drain(
                spark.session, plan, dsn=postgres.dsn, kafka_config=kafka.producer_config(), page_rows=config.page_rows
            )
        except DrainFailed as exc:
            delivered = {d.label: d.rows for d in exc.delivered_before_abort}
            raise dg.Failure(
                description=f"{exc}; no position moved, the leases are released (the relay or a rerun publishes "
                "these partitions again)",
                metadata={
                    "partitions_planned": len(plan.ranges),
                    "delivered_before_abort": dg.MetadataValue.json(delivered),
                },
            ) from exc
        finally:
            # Safety net for a failure before Spark's commit or abort ran; releases nothing after a commit.
            with postgres.connect() as conn:
                release_drain(conn, table, owner)
    elapsed = time.monotonic() - started
    rows = sum(d.rows for d in outcome.committed)
    metadata: dict[str, dg.RawMetadataValue] = {
        "rows": rows,
        "bytes": sum(d.bytes for d in outcome.committed),
        "msg_per_s": round(rows / elapsed, 1) if elapsed > 0 else 0.0,
        "elapsed_s": round(elapsed, 3),
        "partitions": len(outcome.committed),
        "per_partition": dg.MetadataValue.json({d.label: d.rows for d in outcome.committed}),
        "positions": dg.MetadataValue.json({d.label: f"xid={d.last_xid} id={d.last_id}" for d in outcome.committed}),
    }
    if outcome.not_committed:
        raise dg.Failure(
            description=f"{len(outcome.not_committed)} partitions were delivered but not committed "
            "(their rows will be published again by their current owner)",
            metadata={**metadata, "not_committed": dg.MetadataValue.json(dict(outcome.not_committed))},
        )
    context.log.info("drained %d rows from %d partitions in %.1f s", rows, len(outcome.committed), elapsed)
    return dg.MaterializeResult(metadata=metadata)


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
