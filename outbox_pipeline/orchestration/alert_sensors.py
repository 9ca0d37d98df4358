"""The alert sensors: the lag SLO, dead letters and failed relay runs, each announced once per incident and once on
recovery. See docs/dagster.md#alerts."""

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

import dagster as dg

from outbox_pipeline.assets.backlog import (
    BACKLOG_KEY,
    DEAD_LETTER_CHECK,
    LAG_SLO_CHECK,
    backlog_metadata,
    check_evaluation,
    dead_letter_evaluation,
    read_dead_letters,
    read_lag,
)
from outbox_pipeline.errors import OutboxError
from outbox_pipeline.observe.lag import DeadLetterBacklog
from outbox_pipeline.observe.lag_slo import LagVerdict, Severity
from outbox_pipeline.resources.alerts import Alert, AlertResource
from outbox_pipeline.resources.postgres import PostgresResource

from .partitions import partition_key
from .runs import PARTITION_TAG, WILL_RETRY_TAG, Job
from .settings import OrchestrationSettings


@dataclass(frozen=True)
class AlertState:
    """What the webhook was last told: "ok" (nothing open) or the severity of the open incident."""

    announced: Severity = "ok"
    since: str | None = None

    @classmethod
    def from_cursor(cls, cursor: str | None) -> "AlertState":
        if not cursor:
            return cls()
        try:
            return cls(**json.loads(cursor))
        except (ValueError, TypeError):
            return cls()  # a cursor from another version: start over, at worst one extra alert

    def to_cursor(self) -> str:
        return json.dumps(asdict(self))


def _partitions(verdict: LagVerdict) -> list[dict[str, object]]:
    return [
        {
            "partition": partition_key(lag.topic, lag.partition),
            "pending": lag.pending,
            "oldest_pending_age_s": round(lag.oldest_pending_age_s or 0.0, 1),
            "leased_by": lag.leased_by,
            "last_error": lag.last_error,
        }
        for lag in verdict.worst
    ]


def lag_alert(verdict: LagVerdict, state: AlertState) -> Alert | None:
    """The alert this verdict calls for, given what was announced: a new incident or a recovery."""
    if not verdict.passed and state.announced == "ok":
        worst = ", ".join(partition_key(lag.topic, lag.partition) for lag in verdict.worst) or "-"
        where = "" if verdict.wal is not None else f"; worst partitions: {worst}"  # a wal outbox has none
        return Alert(
            alert=LAG_SLO_CHECK,
            status="firing",
            severity=verdict.severity.upper(),
            text=f"outbox lag {verdict.summary()}{where}",
            partitions=_partitions(verdict),
            details=_details(verdict),
        )
    if verdict.passed and state.announced != "ok":
        return Alert(
            alert=LAG_SLO_CHECK,
            status="resolved",
            severity="OK",
            text=f"outbox lag recovered: {verdict.summary()} (incident since {state.since})",
            details=_details(verdict),
        )
    return None


Evaluate = Callable[
    [OrchestrationSettings, dg.SensorEvaluationContext, PostgresResource, AlertResource], dg.SensorResult
]


def _check_sensor(
    name: str,
    settings: OrchestrationSettings | None,
    default_status: dg.DefaultSensorStatus,
    description: str,
    evaluate: Evaluate,
) -> dg.SensorDefinition:
    """A sensor that launches no run: it evaluates a check at an interval and alerts through ``alerts``."""
    cfg = settings or OrchestrationSettings.from_env()

    @dg.sensor(
        name=name,
        minimum_interval_seconds=cfg.check_interval_s,
        default_status=default_status,
        description=description.format(interval_s=cfg.check_interval_s),
    )
    def check_sensor(
        context: dg.SensorEvaluationContext, postgres: PostgresResource, alerts: AlertResource
    ) -> dg.SensorResult:
        return evaluate(cfg, context, postgres, alerts)

    return check_sensor


def _details(verdict: LagVerdict) -> dict[str, object]:
    details: dict[str, object] = {
        "total_pending": verdict.total_pending,
        "oldest_pending_age_s": verdict.oldest_pending_age_s,
    }
    if verdict.wal is not None:
        slot = verdict.wal.slot
        details.update(
            slot=slot.slot,
            retained_bytes=slot.retained_bytes,
            unconfirmed_bytes=slot.unconfirmed_bytes,
            wal_status=slot.wal_status,
            problem=verdict.wal.problem,
        )
    return details


def _evaluate_lag(
    cfg: OrchestrationSettings, context: dg.SensorEvaluationContext, postgres: PostgresResource, alerts: AlertResource
) -> dg.SensorResult:
    try:
        verdict = read_lag(postgres, cfg)
    except OutboxError as exc:  # no strategy to read the outbox as (none recorded, none set): said, not raised
        return dg.SensorResult(skip_reason=f"lag not measured: {exc}")
    state = AlertState.from_cursor(context.cursor)
    alert = lag_alert(verdict, state)
    if alert is not None and alerts.send(alert, context.log):
        state = AlertState(verdict.severity, alert.at if alert.status == "firing" else None)
    return dg.SensorResult(
        skip_reason=verdict.summary(),
        cursor=state.to_cursor(),
        asset_events=[
            dg.AssetObservation(asset_key=BACKLOG_KEY, metadata=backlog_metadata(verdict)),
            check_evaluation(verdict),
        ],
    )


def build_lag_slo_sensor(
    settings: OrchestrationSettings | None = None,
    *,
    name: str = "outbox_lag_slo_sensor",
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
) -> dg.SensorDefinition:
    description = f"Evaluates {LAG_SLO_CHECK} every {{interval_s}} s (no run) and alerts when it fails and recovers."
    return _check_sensor(name, settings, default_status, description, _evaluate_lag)


def dead_letter_alert(backlog: DeadLetterBacklog, state: AlertState) -> Alert | None:
    """A new incident when dead letters appear while none was announced; a recovery when none is left.
    More dead letters during an open incident do not alert again (the check's history shows them)."""
    partitions = [
        {"partition": partition_key(t, p), "dead_letters": n, "last_error": e} for t, p, n, e in backlog.worst
    ]
    if backlog.open and state.announced == "ok":
        return Alert(
            alert=DEAD_LETTER_CHECK,
            status="firing",
            severity="ERROR",
            text=f"{backlog.open} outbox messages dead-lettered (consumers skipped them); newest "
            f"{backlog.newest_at}. Retry with the retry_dead_letters job once the cause is fixed.",
            partitions=partitions,
            details={"dead_letters": backlog.open, "newest_at": backlog.newest_at},
        )
    if not backlog.open and state.announced != "ok":
        return Alert(
            alert=DEAD_LETTER_CHECK,
            status="resolved",
            severity="OK",
            text=f"no dead letters left to retry (incident since {state.since})",
        )
    return None


def _evaluate_dead_letters(
    _cfg: OrchestrationSettings, context: dg.SensorEvaluationContext, postgres: PostgresResource, alerts: AlertResource
) -> dg.SensorResult:
    backlog = read_dead_letters(postgres)
    state = AlertState.from_cursor(context.cursor)
    alert = dead_letter_alert(backlog, state)
    if alert is not None and alerts.send(alert, context.log):
        state = AlertState("error", alert.at) if alert.status == "firing" else AlertState()
    return dg.SensorResult(
        skip_reason=f"{backlog.open} dead letters",
        cursor=state.to_cursor(),
        asset_events=[dead_letter_evaluation(backlog)],
    )


def build_dead_letter_sensor(
    settings: OrchestrationSettings | None = None,
    *,
    name: str = "outbox_dead_letter_alert",
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
) -> dg.SensorDefinition:
    description = (
        f"Evaluates {DEAD_LETTER_CHECK} every {{interval_s}} s (no run) and alerts once when messages are "
        "dead-lettered, and once when none is left to retry."
    )
    return _check_sensor(name, settings, default_status, description, _evaluate_dead_letters)


class _ErrorInfo(Protocol):
    """What a run failure's error carries (Dagster's SerializableErrorInfo, which it does not export)."""

    @property
    def message(self) -> str: ...

    @property
    def cls_name(self) -> str | None: ...

    @property
    def cause(self) -> "_ErrorInfo | None": ...


def _root_cause(error: _ErrorInfo) -> str:
    """The innermost cause's message: what went wrong, not how Dagster wrapped it."""
    while error.cause is not None:
        error = error.cause
    message = error.message.strip()
    prefix, sep, rest = message.partition(": ")
    return rest if sep and error.cls_name and prefix.endswith(error.cls_name) else message


def build_relay_failure_sensor(
    *relay_jobs: Job,
    name: str = "relay_run_failure_alert",
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
) -> dg.SensorDefinition:
    @dg.run_failure_sensor(
        name=name,
        monitored_jobs=list(relay_jobs),
        default_status=default_status,
        description=f"Alerts when a {' or '.join(j.name for j in relay_jobs)} run fails for good (after its retries).",
    )
    def relay_run_failure_alert(context: dg.RunFailureSensorContext, alerts: AlertResource) -> None:
        run = context.dagster_run
        if run.tags.get(WILL_RETRY_TAG) == "true":
            context.log.info("run %s failed and will be retried by the instance: no alert yet", run.run_id)
            return
        partition = run.tags.get(PARTITION_TAG, "all partitions dealt to it")
        errors = [event.step_failure_data.error for event in context.get_step_failure_events()]
        errors.append(getattr(context.failure_event.event_specific_data, "error", None))
        reasons = [_root_cause(error) for error in errors if error is not None]
        reason = reasons[0] if reasons else (context.failure_event.message or "run failed")
        alerts.send(
            Alert(
                alert="relay_run_failed",
                status="firing",
                severity="ERROR",
                text=f"relay run for {partition} failed after its retries: {reason.splitlines()[0]}",
                partitions=[{"partition": partition}],
                details={"run_id": run.run_id, "job": run.job_name, "root_run_id": run.root_run_id},
            ),
            context.log,
        )

    return relay_run_failure_alert
