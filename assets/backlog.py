"""Dagster room: the outbox backlog, observed from PostgreSQL through the engine's lag query."""

import dagster as dg

from outbox_pipeline.lag import pending_by_partition
from resources.postgres import PostgresResource


@dg.asset(description="Unsent outbox rows per topic and virtual partition.", group_name="outbox")
def outbox_backlog(context: dg.AssetExecutionContext, postgres: PostgresResource) -> dg.MaterializeResult:
    with postgres.connect() as conn:
        lags = pending_by_partition(conn, postgres.table)
    pending = sum(lag.pending for lag in lags)
    oldest = max((lag.oldest_pending_age_s or 0.0 for lag in lags), default=0.0)
    context.log.info("%d pending rows in %d partitions, oldest %.1f s", pending, len(lags), oldest)
    return dg.MaterializeResult(
        metadata={
            "pending_rows": pending,
            "lagging_partitions": len(lags),
            "oldest_pending_age_s": round(oldest, 3),
        }
    )
