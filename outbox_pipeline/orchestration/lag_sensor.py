"""Dagster room: `outbox_lag_sensor`, which launches relay runs where the lag is.

Every tick reads every partition's lag in one engine query, registers partitions Dagster has not seen
(dynamic partitions), and requests one `relay_partition` run per lagging partition that has no run in
flight, no live lease (another worker relays it) and no delivery backoff. The run key is the
partition's position plus the run it follows, so a tick never requests the same work twice and a
partition whose last run ended gets a new one only while it still lags. When the whole backlog passes
OUTBOX_BULK_DRAIN_THRESHOLD and a bulk drain job is wired in, the sensor requests that instead.
"""

from collections.abc import Sequence

import dagster as dg

# What define_asset_job returns; not re-exported by dagster, but it is the type sensors accept as a job.
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

from assets.relay import RelayRunConfig
from outbox_pipeline.lag import PartitionLag, partition_lag
from resources.postgres import PostgresResource

from .partitions import OUTBOX_PARTITIONS_NAME, is_valid_key, outbox_partitions, partition_key
from .settings import OrchestrationSettings

PARTITION_TAG = "dagster/partition"
WILL_RETRY_TAG = "dagster/will_retry"
# Runs that hold (or are about to hold) their partition.
IN_FLIGHT_STATUSES = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]

Job = dg.JobDefinition | UnresolvedAssetJobDefinition


def _runs(
    instance: dg.DagsterInstance,
    job_name: str,
    *,
    in_flight: bool = False,
    partition: str | None = None,
    limit: int | None = None,
) -> Sequence[dg.DagsterRun]:
    filters = dg.RunsFilter(
        job_name=job_name,
        statuses=IN_FLIGHT_STATUSES if in_flight else [],
        tags={PARTITION_TAG: partition} if partition is not None else {},
    )
    return instance.get_runs(filters=filters, limit=limit)


def relay_run_key(lag: PartitionLag, previous_run_id: str | None) -> str:
    """Where the partition stands (position, or pending rows for row strategies) and the run it follows."""
    where = lag.position.replace(" ", ",") if lag.position else f"pending={lag.pending}"
    return f"{partition_key(lag.topic, lag.partition)}@{where}/after:{previous_run_id or 'none'}"


def build_outbox_lag_sensor(
    relay_job: Job,
    *,
    settings: OrchestrationSettings | None = None,
    bulk_drain_job: Job | None = None,
    name: str = "outbox_lag_sensor",
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
) -> dg.SensorDefinition:
    """The lag sensor for ``relay_job`` (a job over `relayed_outbox`); ``bulk_drain_job`` is optional."""
    cfg = settings or OrchestrationSettings.from_env()
    jobs: list[Job] = [relay_job] if bulk_drain_job is None else [relay_job, bulk_drain_job]

    @dg.sensor(
        name=name,
        jobs=jobs,
        minimum_interval_seconds=cfg.sensor_interval_s,
        default_status=default_status,
        description=f"Reads per-partition lag ({cfg.strategy}) every {cfg.sensor_interval_s} s, registers new "
        f"partitions and launches {relay_job.name} where a partition lags (>= {cfg.trigger_pending} rows or "
        f"oldest >= {cfg.trigger_age_s:g} s) and no run is in flight.",
    )
    def outbox_lag_sensor(
        context: dg.SensorEvaluationContext, postgres: PostgresResource
    ) -> dg.SensorResult | dg.SkipReason:
        with postgres.connect() as conn:
            lags = partition_lag(conn, postgres.table, cfg.strategy, cap=cfg.lag_cap)
        by_key: dict[str, PartitionLag] = {}
        for lag in lags:
            key = partition_key(lag.topic, lag.partition)
            if is_valid_key(key):
                by_key[key] = lag
            else:
                context.log.warning("topic %r cannot be a Dagster partition key; relay it with the CLI", lag.topic)
        known = set(context.instance.get_dynamic_partitions(OUTBOX_PARTITIONS_NAME))
        new_keys = sorted(set(by_key) - known)
        adds = [outbox_partitions.build_add_request(new_keys)] if new_keys else []
        total = sum(lag.pending for lag in by_key.values())

        if bulk_drain_job is not None:
            bulk_running = bool(_runs(context.instance, bulk_drain_job.name, in_flight=True))
            if bulk_running or total >= cfg.bulk_drain_threshold:
                if bulk_running:
                    return _skip(f"{bulk_drain_job.name} is draining {total} pending rows", adds)
                previous = _runs(context.instance, bulk_drain_job.name, limit=1)
                bulk = dg.RunRequest(
                    job_name=bulk_drain_job.name,
                    run_key=f"bulk-drain/after:{previous[0].run_id if previous else 'none'}",
                    tags={"outbox/pending": str(total)},
                )
                return dg.SensorResult(run_requests=[bulk], dynamic_partitions_requests=adds)

        busy = {run.tags.get(PARTITION_TAG) for run in _runs(context.instance, relay_job.name, in_flight=True)}
        requests: list[dg.RunRequest] = []
        waiting: list[str] = []
        for key, lag in sorted(by_key.items()):
            if not cfg.is_lagging(lag.pending, lag.oldest_pending_age_s):
                continue
            if key in busy or lag.leased_by or lag.in_backoff:
                waiting.append(key)  # in flight, relayed by a live worker, or backing off after a failure
                continue
            previous = _runs(context.instance, relay_job.name, partition=key, limit=1)
            if previous and previous[0].tags.get(WILL_RETRY_TAG) == "true":
                waiting.append(key)  # the instance's run retries will relaunch it
                continue
            requests.append(
                dg.RunRequest(
                    job_name=relay_job.name,
                    partition_key=key,
                    run_key=relay_run_key(lag, previous[0].run_id if previous else None),
                    run_config=dg.RunConfig(ops={"relayed_outbox": RelayRunConfig(strategy=cfg.strategy)}),
                    tags={
                        "outbox/pending": str(lag.pending),
                        "outbox/oldest_pending_age_s": f"{lag.oldest_pending_age_s or 0:.1f}",
                        "outbox/position": lag.position or "-",
                    },
                )
            )
        if requests:
            context.log.info("relay runs for %s", ", ".join(r.partition_key or "" for r in requests))
            return dg.SensorResult(run_requests=requests, dynamic_partitions_requests=adds)
        lagging = sum(1 for lag in by_key.values() if lag.pending)
        note = f"; waiting on {', '.join(waiting[:5])}{' ...' if len(waiting) > 5 else ''}" if waiting else ""
        return _skip(f"{total} pending rows in {lagging}/{len(by_key)} partitions, none needs a new run{note}", adds)

    return outbox_lag_sensor


def _skip(reason: str, adds: list[dg.AddDynamicPartitionsRequest]) -> dg.SensorResult | dg.SkipReason:
    return dg.SensorResult(skip_reason=reason, dynamic_partitions_requests=adds) if adds else dg.SkipReason(reason)
