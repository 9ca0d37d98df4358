"""`outbox_partition_maintenance` (one run per UTC day), its job and its daily schedule: nothing unrelayed is ever
dropped. See docs/spark.md#outbox_partition_maintenance-job-outbox_partition_maintenance_job-daily-partitions."""

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg
import psycopg
from pydantic import Field

from outbox_pipeline.errors import OutboxError
from outbox_pipeline.operate.maintenance import (
    DropResult,
    Fingerprint,
    check_relayed,
    create_ahead,
    day_partitions,
    drop_partition,
    expired,
    id_slices,
    move_default_rows,
)
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.resources.postgres import PostgresResource
from outbox_pipeline.resources.spark import SparkResource
from outbox_pipeline.settings import ARCHIVE_URI, HOME
from outbox_pipeline.store.migrations import DEFAULT_DAYS_AHEAD

DEFAULT_RETENTION_DAYS = 7

maintenance_partitions = dg.DailyPartitionsDefinition(
    start_date="2026-01-01",
    timezone="UTC",
    # The current day is a partition too: the schedule maintains "today" shortly after midnight.
    end_offset=1,
)


def default_archive_root() -> str:
    """OUTBOX_ARCHIVE_URI, else ``$OUTBOX_HOME/archive`` (``./.outbox/archive``)."""
    return ARCHIVE_URI.read() or str((Path(HOME.read()) / "archive").resolve())


class MaintenanceConfig(dg.Config):
    days_ahead: int = Field(default=DEFAULT_DAYS_AHEAD, description="daily partitions to keep ready ahead")
    retention_days: int = Field(
        default=DEFAULT_RETENTION_DAYS, description="days older than this are archived and dropped once relayed"
    )
    archive_uri: str = Field(
        default="",
        description="archive root: a local directory or any Hadoop-compatible URI (s3a://, hdfs://, abfss://); "
        "empty: OUTBOX_ARCHIVE_URI, else $OUTBOX_HOME/archive",
    )
    strategy: str = Field(
        default="",
        description="the relay strategy in use, which decides what 'relayed' means; empty: the outbox's own (set: it "
        "must be that one)",
    )
    archive_slices: int = Field(default=4, description="parallel Spark reads per archived day")
    lock_timeout: str = Field(default="2s", description="longest wait for a lock before a step is skipped")


@dg.asset(
    group_name="outbox_spark",
    kinds={"spark", "parquet", "postgres"},
    partitions_def=maintenance_partitions,
    description="Daily upkeep of the outbox's range partitions: create ahead, move DEFAULT rows, archive "
    "fully relayed old days to Parquet, verify, then drop them.",
)
def outbox_partition_maintenance(
    context: dg.AssetExecutionContext,
    config: MaintenanceConfig,
    postgres: PostgresResource,
    spark: SparkResource,
    orchestration: OrchestrationSettings,
) -> dg.MaterializeResult:
    table = postgres.table
    today = (
        dt.date.fromisoformat(context.partition_key) if context.has_partition_key else dt.datetime.now(dt.UTC).date()
    )
    if config.retention_days < 1:
        raise dg.Failure(
            description=f"retention_days must be at least 1 (got {config.retention_days}): with 0, rows still "
            "being written for today would land in a day already dropped"
        )
    root = config.archive_uri or default_archive_root()
    # Unique per run, so an archive is never written where an earlier one is (see archive_uri).
    attempt = f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}-{context.run.run_id[:8]}"
    upkeep = _Upkeep()
    with postgres.connect() as conn:
        # First: the days ahead must exist whatever happens after, or more rows spill into DEFAULT.
        created = create_ahead(conn, table, today=today, days_ahead=config.days_ahead, lock_timeout=config.lock_timeout)
        rescue = move_default_rows(conn, table, lock_timeout=config.lock_timeout)
        for day, reason in rescue.failed.items():
            upkeep.skipped[f"DEFAULT rows of {day.isoformat()}"] = f"not moved this run: {reason}"
        try:  # what "relayed" means is the outbox's strategy's: without it no day is archived or dropped
            strategy = orchestration.strategy_of(conn, table, config.strategy or None)
            candidates = expired(day_partitions(conn, table), today, config.retention_days)
        except OutboxError as exc:
            strategy, candidates = "-", []
            upkeep.skipped["expired days"] = f"not archived or dropped: {exc}"
        retirement = _Retirement(postgres, spark, config, strategy, root, attempt)
        for candidate in candidates:
            _retire(conn, retirement, candidate.name, upkeep)
    for name, reason in upkeep.skipped.items():
        context.log.warning("kept %s: %s", name, reason)
    return dg.MaterializeResult(
        metadata={
            "day": today.isoformat(),
            "strategy": strategy,
            "partitions_created": len(created),
            "created": dg.MetadataValue.json(created),
            "default_rows_moved": sum(rescue.moved.values()),
            "default_rows_by_day": dg.MetadataValue.json({d.isoformat(): n for d, n in rescue.moved.items()}),
            **upkeep.metadata(),
        }
    )


@dataclass
class _Upkeep:
    """What one run did with the days it looked at: archived (where, rows, checksum), dropped, kept and why."""

    archived: dict[str, dict[str, object]] = field(default_factory=dict)
    dropped: list[DropResult] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def metadata(self) -> "dict[str, dg.RawMetadataValue]":
        return {
            "partitions_archived": len(self.archived),
            "archived": dg.MetadataValue.json(self.archived),
            "partitions_dropped": len(self.dropped),
            "dropped": dg.MetadataValue.json({r.name: r.rows for r in self.dropped}),
            "partitions_skipped": len(self.skipped),
            "skipped": dg.MetadataValue.json(self.skipped),
            "bytes_freed": sum(r.bytes_freed for r in self.dropped),
        }


@dataclass(frozen=True)
class _Retirement:
    """How this run retires an expired day: where PostgreSQL and Spark are, its settings, the strategy that says
    what "relayed" means, and where (root, attempt) its archives go."""

    postgres: PostgresResource
    spark: SparkResource
    config: MaintenanceConfig
    strategy: str
    root: str
    attempt: str


def _retire(conn: psycopg.Connection, retirement: _Retirement, name: str, upkeep: _Upkeep) -> None:
    """One expired day: kept unless fully relayed; else archived (if it has rows), verified and dropped."""
    # pyspark only here, in a Spark run: loading the code location and every other run stay without it.
    from .datasource import archive_partition, archive_uri

    table, config = retirement.postgres.table, retirement.config
    check = check_relayed(conn, table, name, retirement.strategy)
    if not check.relayed:
        upkeep.skipped[name] = "; ".join(check.reasons)
        return
    slices = id_slices(conn, table, name, config.archive_slices)
    written = Fingerprint(0, 0)
    if slices:  # an empty day has nothing to archive
        uri = archive_uri(retirement.root, table.schema, name, retirement.attempt)
        written = archive_partition(
            retirement.spark.session,
            dsn=retirement.postgres.dsn,
            table=table,
            partition_name=name,
            slices=slices,
            uri=uri,
        )
        upkeep.archived[name] = {"uri": uri, "rows": written.rows, "checksum": written.checksum}
    result = drop_partition(
        conn,
        table,
        name,
        strategy=retirement.strategy,
        archived=written,
        lock_timeout=config.lock_timeout,
    )
    if result.dropped:
        upkeep.dropped.append(result)
    else:
        upkeep.skipped[name] = result.reason or "not dropped"


outbox_partition_maintenance_job = dg.define_asset_job(
    "outbox_partition_maintenance_job",
    selection=[outbox_partition_maintenance],
    description="Daily partition upkeep of the outbox (one run per UTC day).",
)

# Shortly after midnight UTC, for the day that just began (end_offset=1 makes it the newest partition).
outbox_partition_maintenance_schedule = dg.build_schedule_from_partitioned_job(
    outbox_partition_maintenance_job,
    name="outbox_partition_maintenance_schedule",
    hour_of_day=0,
    minute_of_hour=15,
    default_status=dg.DefaultScheduleStatus.RUNNING,
)
