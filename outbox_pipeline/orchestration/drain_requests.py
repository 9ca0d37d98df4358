"""When `outbox_lag_sensor` asks for a bulk drain on Spark, and when not: an accelerator for a large backlog, never
requested in a loop. See docs/dagster.md#when-the-sensor-asks-for-a-bulk-drain."""

from collections.abc import Sequence

import dagster as dg

from outbox_pipeline.drain.engine import drainable
from outbox_pipeline.drain.values import DRAIN_STRATEGIES
from outbox_pipeline.observe.lag import PartitionLag

from .runs import IN_FLIGHT_STATUSES, Job
from .settings import OrchestrationSettings

# Set by a bulk drain run once it planned: how many partitions it leased ("0": it could take none).
DRAINED_TAG = "outbox/drained_partitions"


def bulk_drain_request(
    instance: dg.DagsterInstance,
    job: Job,
    cfg: OrchestrationSettings,
    strategy: str,
    lags: Sequence[PartitionLag],
    now: float,
) -> tuple[dg.RunRequest | None, str]:
    """A bulk drain run for the outbox's own strategy (``strategy``, as the sensor resolved it), or None; with a note
    for the tick's log."""
    total = sum(lag.pending for lag in lags)
    if total < cfg.bulk_drain_threshold:
        return None, ""
    if strategy not in DRAIN_STRATEGIES:
        return None, f"; no bulk drain: it serves {' and '.join(DRAIN_STRATEGIES)}, not {strategy}"
    if instance.get_runs(dg.RunsFilter(job_name=job.name, statuses=IN_FLIGHT_STATUSES), limit=1):
        return None, f"; {job.name} is draining"
    previous = instance.get_run_records(dg.RunsFilter(job_name=job.name), limit=1)
    if previous and (wait := _cooldown(previous[0], job, cfg, now)):
        return None, wait
    free = sum(lag.pending for lag in lags if drainable(lag))
    if free < cfg.bulk_drain_threshold:
        return None, (
            f"; no bulk drain: {total} pending rows, {free} of them in partitions a drain could take (the others "
            f"leased by relay workers, backing off or holding a key), below {cfg.bulk_drain_threshold}"
        )
    request = dg.RunRequest(
        job_name=job.name,
        run_key=f"bulk-drain/after:{previous[0].dagster_run.run_id if previous else 'none'}",
        run_config={"ops": {"bulk_drain": {"config": {"strategy": strategy}}}},
        tags={"outbox/pending": str(total), "outbox/strategy": strategy},
    )
    return request, f"; bulk drain requested ({free} pending rows free to drain)"


def _cooldown(record: dg.RunRecord, job: Job, cfg: OrchestrationSettings, now: float) -> str:
    """Why no drain may follow the last one yet ('' if one may)."""
    run = record.dagster_run
    if run.status == dg.DagsterRunStatus.CANCELED:
        return (
            f"; the last {job.name} was canceled (run {run.run_id[:8]}): no other until an operator launches one "
            "(Jobs -> bulk_drain_job -> Launchpad, or re-execute the canceled run)"
        )
    if run.status == dg.DagsterRunStatus.FAILURE:
        what = "failed"
    elif run.status == dg.DagsterRunStatus.SUCCESS and run.tags.get(DRAINED_TAG) == "0":
        what = "took no partition (relay workers held them)"
    else:
        return ""
    ended = record.end_time or record.update_timestamp.timestamp()
    if now - ended >= cfg.bulk_drain_cooldown_s:
        return ""
    return (
        f"; the last {job.name} {what} {now - ended:.0f} s ago: none other for {cfg.bulk_drain_cooldown_s:g} s "
        "(the relay runs publish the backlog meanwhile)"
    )
