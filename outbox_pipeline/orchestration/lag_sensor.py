"""`outbox_lag_sensor`, which keeps the outbox's partitions covered by live relay workers, requesting a `relay_stream`
run only when one is needed. See docs/dagster.md#how-the-lag-sensor-decides."""

import time
from collections.abc import Sequence
from dataclasses import dataclass

import dagster as dg
import psycopg

from outbox_pipeline.drain.values import OWNER_PREFIX
from outbox_pipeline.errors import OutboxError
from outbox_pipeline.model import WAL
from outbox_pipeline.observe.lag import PartitionLag, partition_lag
from outbox_pipeline.observe.liveness import LiveWorker, live_workers
from outbox_pipeline.observe.wal_lag import wal_lag
from outbox_pipeline.resources.postgres import PostgresResource
from outbox_pipeline.store.relayable import require_relayable
from outbox_pipeline.strategies.positions import UNSCOPED_KIND

from .drain_requests import bulk_drain_request
from .partitions import OUTBOX_PARTITIONS_NAME, is_valid_key, outbox_partitions, partition_key
from .relay_stream import WINDOW_TAG, RelayStreamConfig, registered, stream_worker_id
from .runs import IN_FLIGHT_STATUSES, WILL_RETRY_TAG, Job
from .settings import OrchestrationSettings

# A run launched this recently whose worker has not registered yet is still starting (queued, loading the
# code location): it counts as an owner. Past it, or once its worker registered and is no longer alive
# (killed: the code server marks the run failed a little later), it covers nothing.
START_GRACE_S = 120.0
# Workers whose heartbeat is this fresh count as alive when their liveness is expiry (behind PgBouncer).
EXPIRY_LIVENESS_S = 60.0


@dataclass(frozen=True)
class Coverage:
    """Who relays the outbox now, as one tick sees it."""

    owners: tuple[str, ...]  # live relay workers: runs and external processes
    warming: tuple[str, ...]  # owners that came up less than the age trigger ago
    starting: tuple[str, ...]  # run ids launched and not registered yet (within START_GRACE_S)
    ending: tuple[str, ...]  # run ids whose window ends within the handover
    runs: int  # in-flight relay runs that are not ending

    @property
    def covered(self) -> bool:
        return len(self.owners) - len(self.ending) + len(self.starting) > 0


def coverage(
    instance: dg.DagsterInstance, job_name: str, workers: Sequence[LiveWorker], cfg: OrchestrationSettings, now: float
) -> Coverage:
    owners = [w.worker_id for w in workers]
    starting: list[str] = []
    ending: list[str] = []
    active = 0
    for record in instance.get_run_records(dg.RunsFilter(job_name=job_name, statuses=IN_FLIGHT_STATUSES)):
        run = record.dagster_run
        began = record.start_time or record.create_timestamp.timestamp()
        window_s = float(run.tags.get(WINDOW_TAG) or cfg.relay_window_s)
        if stream_worker_id(run) in owners:
            if began + window_s - now < cfg.handover_s:
                ending.append(run.run_id)
            else:
                active += 1
        elif not registered(run) and now - record.create_timestamp.timestamp() < START_GRACE_S:
            starting.append(run.run_id)
            active += 1
    # A run that failed (killed) and that the instance is about to retry (run_retries): its retry is coming,
    # so a new run now would only be a second one.
    retrying = dg.RunsFilter(job_name=job_name, statuses=[dg.DagsterRunStatus.FAILURE], tags={WILL_RETRY_TAG: "true"})
    for record in instance.get_run_records(retrying, limit=5):
        if now - record.update_timestamp.timestamp() < START_GRACE_S and not _retried(instance, record.dagster_run):
            starting.append(record.dagster_run.run_id)
            active += 1
    warming = tuple(w.worker_id for w in workers if w.up_s < cfg.trigger_age_s)
    return Coverage(tuple(owners), warming, tuple(starting), tuple(ending), active)


def wal_run_needed(
    instance: dg.DagsterInstance, job_name: str, cfg: OrchestrationSettings, now: float, *, streamed: int | None
) -> str | None:
    """Why a wal outbox needs one more run ("uncovered", "successor"), or None: one run streams its slot, a second
    only waits to take over, so a run is requested when none is in flight (and no relay launched elsewhere streams
    the slot), or when the one in flight is ending its window (its successor waits for the slot meanwhile)."""
    records = instance.get_run_records(dg.RunsFilter(job_name=job_name, statuses=IN_FLIGHT_STATUSES))
    if not records:
        return None if streamed is not None else "uncovered"
    if len(records) > 1:
        return None
    run = records[0].dagster_run
    began = records[0].start_time or records[0].create_timestamp.timestamp()
    window_s = float(run.tags.get(WINDOW_TAG) or cfg.relay_window_s)
    return "successor" if began + window_s - now < cfg.handover_s else None


def _retried(instance: dg.DagsterInstance, run: dg.DagsterRun) -> bool:
    """Whether the instance already created the retry of ``run`` (then the retry itself is counted)."""
    return bool(instance.get_runs(dg.RunsFilter(tags={"dagster/parent_run_id": run.run_id}), limit=1))


@dataclass(frozen=True)
class _LagSensor:
    """What each tick of one lag sensor works with: the relay job, the bulk drain job (if wired in), the settings."""

    relay_job: Job
    bulk_drain_job: "Job | None"
    cfg: OrchestrationSettings


def build_outbox_lag_sensor(
    relay_job: Job,
    *,
    settings: OrchestrationSettings | None = None,
    bulk_drain_job: "Job | None" = None,
    name: str = "outbox_lag_sensor",
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
) -> dg.SensorDefinition:
    """The lag sensor for ``relay_job`` (a `relay_stream` job); ``bulk_drain_job`` is optional."""
    cfg = settings or OrchestrationSettings.from_env()
    jobs: list[Job] = [relay_job] if bulk_drain_job is None else [relay_job, bulk_drain_job]
    sensor = _LagSensor(relay_job, bulk_drain_job, cfg)

    @dg.sensor(
        name=name,
        jobs=jobs,
        minimum_interval_seconds=cfg.sensor_interval_s,
        default_status=default_status,
        description=f"Every {cfg.sensor_interval_s} s: reads per-partition lag (as "
        f"{cfg.strategy or 'the outbox records'}) and the live relay workers, registers new partitions, and launches a "
        f"{relay_job.name} run where no live worker covers the outbox, before a run's window ends, or while partitions "
        f"lag (>= {cfg.trigger_pending} rows or oldest >= {cfg.trigger_age_s:g} s) with fewer than "
        f"{cfg.relay_runs_max} runs.",
    )
    def outbox_lag_sensor(
        context: dg.SensorEvaluationContext, postgres: PostgresResource
    ) -> dg.SensorResult | dg.SkipReason:
        return _tick(sensor, context, postgres)

    return outbox_lag_sensor


def _tick(
    sensor: _LagSensor, context: dg.SensorEvaluationContext, postgres: PostgresResource
) -> dg.SensorResult | dg.SkipReason:
    """One tick: nothing for an outbox a run would refuse, the wal outbox's one run, or the table outbox's runs."""
    cfg = sensor.cfg
    with postgres.connect() as conn:
        try:
            # What a run would refuse at once (missing indexes, another strategy's positions): a run per tick
            # otherwise, each failing after seconds of CPU.
            strategy = require_relayable(conn, postgres.table, cfg.strategy or None)
        except OutboxError as exc:
            context.log.warning("no relay run: %s", exc)
            return dg.SkipReason(f"no relay run: {exc}")
        if strategy == WAL:
            return _wal_tick(sensor, context, conn, postgres)
        lags = partition_lag(conn, postgres.table, strategy, cap=cfg.lag_cap)
        owners = [w for w in live_workers(conn, postgres.table, EXPIRY_LIVENESS_S) if w.kind == UNSCOPED_KIND]
    return _table_tick(sensor, context, strategy, lags, owners)


def _wal_tick(
    sensor: _LagSensor, context: dg.SensorEvaluationContext, conn: psycopg.Connection, postgres: PostgresResource
) -> dg.SensorResult | dg.SkipReason:
    """A wal outbox: its slot reported, and one run kept on it (wal_run_needed)."""
    slot = wal_lag(conn, postgres.table, measure_age=False)  # ticks every few seconds: nothing decoded
    if slot.problem is not None:
        context.log.warning("%s", slot.describe())
        return dg.SkipReason(f"{slot.describe()}; no relay run")
    why = wal_run_needed(context.instance, sensor.relay_job.name, sensor.cfg, time.time(), streamed=slot.streamed_by)
    if why is None:
        return dg.SkipReason(slot.describe())
    request = _relay_request(sensor, context, why, WAL, {})
    context.log.info("relay run (%s) for the wal outbox: %s", why, slot.describe())
    return dg.SensorResult(run_requests=[request])


def _table_tick(
    sensor: _LagSensor,
    context: dg.SensorEvaluationContext,
    strategy: str,
    lags: list[PartitionLag],
    owners: list[LiveWorker],
) -> dg.SensorResult | dg.SkipReason:
    """A table outbox: new partitions registered, a bulk drain if one is due, and a relay run if one is needed."""
    cfg, bulk_drain_job = sensor.cfg, sensor.bulk_drain_job
    by_key = _by_partition_key(context, lags)
    known = set(context.instance.get_dynamic_partitions(OUTBOX_PARTITIONS_NAME))
    new_keys = sorted(set(by_key) - known)
    adds = [outbox_partitions.build_add_request(new_keys)] if new_keys else []
    total = sum(lag.pending for lag in lags)

    drain, drain_note = (
        bulk_drain_request(context.instance, bulk_drain_job, cfg, strategy, lags, time.time())
        if bulk_drain_job is not None
        else (None, "")
    )
    cover = coverage(context.instance, sensor.relay_job.name, owners, cfg, time.time())
    lagging = sorted(key for key, lag in by_key.items() if _more_runs_help(lag, cfg))
    why = _why_a_run(cover, lagging, cfg)
    if why is None:
        reason = f"{total} pending rows in {len(by_key)} partitions; {_no_run_state(cover, lagging, cfg)}{drain_note}"
        if drain is not None:
            context.log.info("%s", reason)
            return dg.SensorResult(run_requests=[drain], dynamic_partitions_requests=adds)
        return _skip(reason, adds)
    lagging_tags = {"outbox/pending": str(total), "outbox/lagging_partitions": str(len(lagging))}
    request = _relay_request(sensor, context, why, strategy, lagging_tags)
    context.log.info(
        "relay run (%s): %d live relay worker(s), %d lagging partition(s)%s",
        why,
        len(cover.owners),
        len(lagging),
        drain_note,
    )
    requests = [request] if drain is None else [drain, request]
    return dg.SensorResult(run_requests=requests, dynamic_partitions_requests=adds)


def _by_partition_key(context: dg.SensorEvaluationContext, lags: list[PartitionLag]) -> dict[str, PartitionLag]:
    """Each partition's lag by its Dagster partition key; a topic no key can name is left to the CLI (a warning)."""
    by_key: dict[str, PartitionLag] = {}
    for lag in lags:
        key = partition_key(lag.topic, lag.partition)
        if is_valid_key(key):
            by_key[key] = lag
        else:
            context.log.warning("topic %r cannot be a Dagster partition key; relay it with the CLI", lag.topic)
    return by_key


def _why_a_run(cover: Coverage, lagging: list[str], cfg: OrchestrationSettings) -> str | None:
    """Why one more relay run ("successor", "uncovered", "lagging"), or None: the runs there are cover the outbox."""
    if not cover.covered:
        return "successor" if cover.ending else "uncovered"
    if lagging and not cover.starting and not cover.warming and cover.runs < cfg.relay_runs_max:
        return "lagging"
    return None


def _no_run_state(cover: Coverage, lagging: list[str], cfg: OrchestrationSettings) -> str:
    """Who covers the outbox, and which partitions lag, for a tick that requests no relay run."""
    state = f"{len(cover.owners)} live relay worker(s), {len(cover.starting)} run(s) starting"
    if cover.warming:
        state += f", {len(cover.warming)} came up < {cfg.trigger_age_s:g} s ago"
    note = f"; lagging: {', '.join(lagging[:5])}{' ...' if len(lagging) > 5 else ''}" if lagging else ""
    return state + note


def _relay_request(
    sensor: _LagSensor, context: dg.SensorEvaluationContext, why: str, strategy: str, tags: dict[str, str]
) -> dg.RunRequest:
    """A relay_stream run for ``why``. Its run key names the latest run it follows, so no tick requests it twice."""
    cfg, job_name = sensor.cfg, sensor.relay_job.name
    previous = context.instance.get_runs(dg.RunsFilter(job_name=job_name), limit=1)
    return dg.RunRequest(
        job_name=job_name,
        run_key=f"relay-stream/{why}/after:{previous[0].run_id if previous else 'none'}",
        run_config=dg.RunConfig(
            ops={"relay_outbox_stream": RelayStreamConfig(strategy=strategy, window_s=cfg.relay_window_s)}
        ),
        tags={WINDOW_TAG: f"{cfg.relay_window_s:g}", "outbox/reason": why, **tags},
    )


def _more_runs_help(lag: PartitionLag, cfg: OrchestrationSettings) -> bool:
    """Whether a partition lags in a way more relay runs can shorten. Not while it backs off after a failure, not
    while a bulk drain leases it (no relay may publish it until the drain commits), and rows held behind a dead letter
    (quarantine) do not count: they wait for an operator, and the dead-letter alert says so."""
    drained = (lag.leased_by or "").startswith(OWNER_PREFIX)
    return not lag.in_backoff and not drained and cfg.is_lagging(lag.pending, lag.relayable_age_s)


def _skip(reason: str, adds: list[dg.AddDynamicPartitionsRequest]) -> dg.SensorResult | dg.SkipReason:
    return dg.SensorResult(skip_reason=reason, dynamic_partitions_requests=adds) if adds else dg.SkipReason(reason)
