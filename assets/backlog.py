"""The outbox backlog asset and its lag SLO check, measured through the engine's lag query. See
docs/dagster.md#lag-check."""

import dagster as dg

from outbox_pipeline.model import WAL
from outbox_pipeline.observe.horizon import find_horizon
from outbox_pipeline.observe.lag import DeadLetterBacklog, dead_letter_backlog, held_keys, partition_lag
from outbox_pipeline.observe.lag_slo import LagVerdict, evaluate_lag, evaluate_wal_lag
from outbox_pipeline.observe.status import markdown, partition_status
from outbox_pipeline.observe.wal_lag import wal_lag
from outbox_pipeline.orchestration.partitions import partition_key
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.resources.postgres import PostgresResource

BACKLOG_KEY = dg.AssetKey("outbox_backlog")
LAG_SLO_CHECK = "outbox_lag_slo"
DEAD_LETTER_CHECK = "outbox_dead_letters"


def read_lag(postgres: PostgresResource, settings: OrchestrationSettings) -> LagVerdict:
    """The lag verdict, held keys (quarantine) included: they count as lag and are named in it. A wal outbox's is
    its slot's: retained WAL, the oldest unpublished commit, a missing or lost slot (observe/wal_lag.py)."""
    with postgres.connect() as conn:
        strategy = settings.strategy_of(conn, postgres.table)
        if strategy == WAL:
            return evaluate_wal_lag(wal_lag(conn, postgres.table), settings.thresholds)
        lags = partition_lag(conn, postgres.table, strategy, cap=settings.lag_cap)
        held = tuple(key.describe() for key in held_keys(conn, postgres.table) if key.rows and not key.released)
        horizon = find_horizon(conn, postgres.table) if strategy == "partitioned" else None
        statuses = partition_status(conn, postgres.table, strategy, lags=lags, horizon=horizon)
    return evaluate_lag(lags, settings.thresholds, held=held, horizon=horizon, status_table=markdown(statuses))


def backlog_metadata(verdict: LagVerdict) -> dict[str, dg.MetadataValue]:
    """Numbers the UI plots over time, and the worst partitions as a table."""
    t = verdict.thresholds
    rows = [
        f"| {partition_key(lag.topic, lag.partition)} | {lag.pending} | {lag.oldest_pending_age_s or 0:.1f} "
        f"| {lag.leased_by or '-'} | {(lag.last_error or '-').replace('|', '/')[:80]} |"
        for lag in verdict.worst
    ]
    table = "| partition | pending | oldest age s | leased by | last error |\n|---|---|---|---|---|\n" + "\n".join(rows)
    wal: dict[str, dg.MetadataValue] = {}
    if verdict.wal is not None:
        slot = verdict.wal.slot
        wal = {
            "wal_slot": dg.MetadataValue.text(verdict.wal.describe()),
            "retained_wal_bytes": dg.MetadataValue.int(slot.retained_bytes or 0),
            "unconfirmed_wal_bytes": dg.MetadataValue.int(slot.unconfirmed_bytes or 0),
        }
    return {
        **wal,
        "pending_rows": dg.MetadataValue.int(verdict.total_pending),
        "oldest_pending_age_s": dg.MetadataValue.float(round(verdict.oldest_pending_age_s or 0.0, 3)),
        "lagging_partitions": dg.MetadataValue.int(verdict.lagging_partitions),
        "partitions": dg.MetadataValue.int(verdict.partitions),
        "worst_partitions": dg.MetadataValue.md(table if rows else "none lagging"),
        "held_rows": dg.MetadataValue.int(verdict.total_held),
        "held_keys": dg.MetadataValue.md("\n".join(f"- {line}" for line in verdict.held) or "none"),
        "partition_status": dg.MetadataValue.md(verdict.status_table or "-"),
        "horizon": dg.MetadataValue.md(
            "\n".join(f"- {line.strip()}" for line in verdict.horizon) or "nothing held back"
        ),
        "thresholds": dg.MetadataValue.text(
            f"warn: age > {t.warn_age_s:g} s or pending > {t.warn_pending}; "
            f"error: age > {t.error_age_s:g} s or pending > {t.error_pending}; a wal outbox's slot retaining "
            f"> {t.warn_retained_bytes} bytes of WAL warns, > {t.error_retained_bytes} or missing or lost errs"
        ),
    }


def check_evaluation(verdict: LagVerdict) -> dg.AssetCheckEvaluation:
    """The check's result as an event a sensor can record without a run."""
    return dg.AssetCheckEvaluation(
        asset_key=BACKLOG_KEY,
        check_name=LAG_SLO_CHECK,
        passed=verdict.passed,
        severity=dg.AssetCheckSeverity.ERROR if verdict.severity == "error" else dg.AssetCheckSeverity.WARN,
        metadata=backlog_metadata(verdict),
        description=verdict.summary(),
    )


@dg.asset(
    key=BACKLOG_KEY,
    group_name="outbox",
    kinds={"postgres"},
    description="Pending outbox rows per topic and virtual partition, as the relay strategy sees them.",
)
def outbox_backlog(
    context: dg.AssetExecutionContext, postgres: PostgresResource, orchestration: OrchestrationSettings
) -> dg.MaterializeResult:
    verdict = read_lag(postgres, orchestration)
    context.log.info("%s", verdict.summary())
    return dg.MaterializeResult(metadata=backlog_metadata(verdict))


@dg.asset_check(
    asset=BACKLOG_KEY,
    name=LAG_SLO_CHECK,
    description="WARN/ERROR when the oldest pending row or the pending row count is above its threshold "
    "(OUTBOX_LAG_WARN_AGE_S, OUTBOX_LAG_ERROR_AGE_S, OUTBOX_LAG_WARN_PENDING, OUTBOX_LAG_ERROR_PENDING); a wal outbox: "
    "the oldest unpublished commit's age and the WAL its slot retains (OUTBOX_WAL_RETAINED_WARN_BYTES, "
    "OUTBOX_WAL_RETAINED_ERROR_BYTES), ERROR when the slot is missing or lost.",
)
def outbox_lag_slo(postgres: PostgresResource, orchestration: OrchestrationSettings) -> dg.AssetCheckResult:
    verdict = read_lag(postgres, orchestration)
    evaluation = check_evaluation(verdict)
    return dg.AssetCheckResult(
        passed=evaluation.passed,
        severity=evaluation.severity,
        metadata=evaluation.metadata,
        description=evaluation.description,
    )


def read_dead_letters(postgres: PostgresResource) -> DeadLetterBacklog:
    with postgres.connect() as conn:
        return dead_letter_backlog(conn, postgres.table)


def dead_letter_evaluation(backlog: DeadLetterBacklog) -> dg.AssetCheckEvaluation:
    """Fails (ERROR) while any dead letter is waiting for an operator: each one is a message consumers
    have not seen (``outbox dead-letters`` lists them, with the rows of its key held behind it; the
    `retry_dead_letters` and `discard_dead_letters` jobs resolve them)."""
    rows = [f"| {partition_key(t, p)} | {n} | {e.replace('|', '/')[:80]} |" for t, p, n, e in backlog.worst]
    table = "| partition | dead letters | last error |\n|---|---|---|\n" + "\n".join(rows)
    return dg.AssetCheckEvaluation(
        asset_key=BACKLOG_KEY,
        check_name=DEAD_LETTER_CHECK,
        passed=backlog.open == 0,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={
            "dead_letters": dg.MetadataValue.int(backlog.open),
            "newest": dg.MetadataValue.text(backlog.newest_at or "-"),
            "worst_partitions": dg.MetadataValue.md(table if rows else "none"),
        },
        description=f"{backlog.open} dead letters not retried" if backlog.open else "no dead letters",
    )


@dg.asset_check(
    asset=BACKLOG_KEY,
    name=DEAD_LETTER_CHECK,
    description="ERROR while dead letters wait for an operator: retry them (job retry_dead_letters) or give up on "
    "them with a reason (job discard_dead_letters); either releases the rows of their keys held behind them.",
)
def outbox_dead_letters(postgres: PostgresResource) -> dg.AssetCheckResult:
    evaluation = dead_letter_evaluation(read_dead_letters(postgres))
    return dg.AssetCheckResult(
        passed=evaluation.passed,
        severity=evaluation.severity,
        metadata=evaluation.metadata,
        description=evaluation.description,
    )
