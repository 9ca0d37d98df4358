"""Dagster room: when `outbox_lag_sensor` asks for a bulk drain on Spark, and when not.

A drain serves the position strategies only and must read in the relay's own order, so the request names the
relay's strategy. It is an accelerator for a large backlog: the relay runs keep covering the outbox whatever
happens to it, so the sensor asks for one only when it can help, and never in a loop:

- not while one is in flight;
- not unless at least OUTBOX_BULK_DRAIN_THRESHOLD pending rows are in partitions a drain could lease now (relay
  workers working through a backlog lease theirs between batches; a drain planned then takes nothing);
- not after one that was canceled (an operator terminated it from the UI) until an operator launches one: then
  the sensor goes on as before;
- not within OUTBOX_BULK_DRAIN_COOLDOWN_S of one that failed (what stopped it is the relay's to retry or
  dead-letter: a new one would stop at the same row and republish what it did deliver) or of one that took no
  partition (every partition was taken between the tick and its plan).

The drain run tags itself with how many partitions it took (DRAINED_TAG), which is how the sensor knows.
"""

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
