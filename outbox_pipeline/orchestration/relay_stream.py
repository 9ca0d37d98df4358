"""`relay_stream`, the long-lived relay run the lag sensor keeps alive: a registered relay worker for a window,
recording each partition's progress. See docs/dagster.md#long-lived-relay-runs."""

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

import dagster as dg
from prometheus_client import delete_from_gateway, push_to_gateway
from pydantic import Field

from outbox_pipeline.observe.metrics import RelayMetrics
from outbox_pipeline.relay.relay_settings import RelaySettings
from outbox_pipeline.resources.kafka import KafkaResource
from outbox_pipeline.resources.postgres import PostgresResource
from outbox_pipeline.runs.stream_run import PartitionProgress, StreamReport, StreamRun
from outbox_pipeline.settings import METRICS_PUSHGATEWAY
from outbox_pipeline.strategies.base import StrategyConfig

from .partitions import OUTBOX_PARTITIONS_NAME, is_valid_key, partition_key
from .settings import OrchestrationSettings

RELAY_STREAM_JOB_NAME = "relay_stream"
RELAYED_OUTBOX = dg.AssetKey("relayed_outbox")
# Tags the sensor reads: the window a run was launched with (its successor starts before it ends), and
# that its worker registered (from then on, a run whose worker is not alive covers nothing). The registered tag's
# value is the run's own id: a retry or re-execution inherits its parent's tags, and a "true" made a retry that
# had not registered yet look registered and dead, so the sensor launched a second run beside it.
WINDOW_TAG = "outbox/window_s"
REGISTERED_TAG = "outbox/registered"


def registered(run: dg.DagsterRun) -> bool:
    """Whether this run's own worker registered (not a parent's it inherited the tag from)."""
    return run.tags.get(REGISTERED_TAG) == run.run_id


# How often the run checks that the process which launched it is still there.
ORPHAN_CHECK_S = 1.0
# The pushgateway job of relay runs' metrics (grouped by worker id).
PUSH_JOB = "outbox_relay"


def stream_worker_id(run: dg.DagsterRun) -> str:
    """The relay worker id of a run: a rerun (from failure, from the UI) shares the root run id, so it
    takes back the same id; the sensor finds a run's worker in the registry by it."""
    return f"dagster-{run.root_run_id or run.run_id}"


class RelayStreamConfig(dg.Config):
    """How a long-lived relay run works; empty fields take the deployment's settings (environment)."""

    strategy: str | None = Field(
        default=None, description="relay strategy; empty: OUTBOX_RELAY_STRATEGY, else the outbox's own"
    )
    window_s: float | None = Field(default=None, description="seconds to relay; empty: OUTBOX_RELAY_WINDOW_S")
    report_interval_s: float | None = Field(
        default=None,
        description="seconds between per-partition materializations; empty: OUTBOX_RELAY_REPORT_INTERVAL_S",
    )
    batch_size: int = Field(
        default=1000, description="rows per claim (table strategies; a wal run hands Kafka what its stream holds)"
    )
    lease_s: float = Field(default=60.0, description="partition/row lease; the fallback when liveness is expiry")
    kafka_transactions: bool = Field(default=False, description="partitioned/serialized: a Kafka transaction per batch")


@dg.op(description="Relay the outbox for a window as one registered worker, recording each partition's progress.")
def relay_outbox_stream(
    context: dg.OpExecutionContext,
    config: RelayStreamConfig,
    postgres: PostgresResource,
    kafka: KafkaResource,
    orchestration: OrchestrationSettings,
) -> None:
    settings = orchestration
    with postgres.connect() as conn:
        strategy = settings.strategy_of(conn, postgres.table, config.strategy)
    window_s = config.window_s or settings.relay_window_s
    worker_id = stream_worker_id(context.run)
    pusher = MetricsPusher.create(settings.metrics_pushgateway, strategy, worker_id, context)
    run = StreamRun(
        postgres.dsn,
        strategy,
        StrategyConfig(
            table=postgres.table,
            worker_id=worker_id,
            lease_s=config.lease_s,
            kafka_transactions=config.kafka_transactions,
            on_poison=settings.poison,
        ),
        kafka.publisher(),
        RelaySettings.from_env(batch_size=config.batch_size, max_seconds=window_s, listen=True),
        report_every_s=config.report_interval_s or settings.report_interval_s,
        instruments=pusher.metrics if pusher else None,
    )
    context.log.info("%s relays the outbox (%s) for %.0f s", worker_id, strategy, window_s)
    done = threading.Event()
    watchdog = threading.Thread(target=_watch, args=(context, run, done, os.getppid()), daemon=True)
    watchdog.start()
    published = 0
    try:
        with stopping_on_terminate(run.stop):
            for report in run.reports():
                published += report.published
                _record(context, report, worker_id)
                if pusher:
                    pusher.push()
    finally:
        run.close()  # after the batch in flight is acked: the worker deregisters, nobody waits for it
        done.set()
        if pusher:
            pusher.finish()
    context.log.info("%s stopped after publishing %d rows", worker_id, published)


@dataclass
class MetricsPusher:
    """The run's relay metrics, pushed to a Prometheus pushgateway at every report (grouped by worker id) and
    deleted when the run ends, so a finished run leaves no stale series behind."""

    url: str
    worker_id: str
    metrics: RelayMetrics
    log: logging.Logger | dg.DagsterLogManager

    @classmethod
    def create(cls, url: str, strategy: str, worker_id: str, context: dg.OpExecutionContext) -> "MetricsPusher | None":
        if not url:
            context.log.info(
                "relay metrics are not exported: %s is not set (a run has no port Prometheus could scrape; the "
                "outbox_lag_slo check and the relayed_outbox history carry the lag)",
                METRICS_PUSHGATEWAY.name,
            )
            return None
        return cls(url, worker_id, RelayMetrics(strategy), context.log)

    def push(self) -> None:
        try:
            push_to_gateway(
                self.url, job=PUSH_JOB, grouping_key={"worker": self.worker_id}, registry=self.metrics.registry
            )
        except OSError as exc:
            self.log.warning("could not push relay metrics to %s: %s", self.url, exc)

    def finish(self) -> None:
        self.push()
        try:
            delete_from_gateway(self.url, job=PUSH_JOB, grouping_key={"worker": self.worker_id})
        except OSError as exc:
            self.log.warning("could not delete this run's metrics from %s: %s", self.url, exc)


@contextmanager
def stopping_on_terminate(stop: Callable[[], None]) -> Iterator[None]:
    """SIGTERM and SIGINT stop the relay first, then reach the handler that was there (Dagster's, which raises its
    interrupt into the run). Python swallows an exception raised inside a weakref callback or ``__del__`` ("Exception
    ignored in ..."), and Dagster's interrupt landed in one (SQLAlchemy's, in a fresh clone's CI): the run then relayed
    on, terminated but never stopping. Main thread only (where Python runs signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {int(signum): signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum: int, frame: FrameType | None) -> None:
        stop()
        before = previous[signum]
        if callable(before):
            before(signum, frame)
        elif before == signal.SIG_DFL and signum == signal.SIGINT:
            raise KeyboardInterrupt
        elif before == signal.SIG_DFL:
            raise SystemExit(128 + signum)

    for signum in previous:
        signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)


def _watch(context: dg.OpExecutionContext, run: StreamRun, done: threading.Event, parent: int) -> None:
    """Tags the run once its worker is registered, and stops it when orphaned: `dagster dev` stopping ends
    its code server, and a run it launched must not relay on unseen."""
    tagged = False
    while not done.wait(ORPHAN_CHECK_S):
        if not tagged and run.relay.registered.is_set():
            context.instance.add_run_tags(context.run_id, {REGISTERED_TAG: context.run_id})
            tagged = True
        if os.getppid() != parent:
            context.log.warning("the process that launched this run is gone: stopping")
            run.stop()
            return


def _record(context: dg.OpExecutionContext, report: StreamReport, worker_id: str) -> None:
    keys = {partition_key(p.topic, p.partition): p for p in report.partitions}
    keys = {key: p for key, p in keys.items() if is_valid_key(key)}
    known = set(context.instance.get_dynamic_partitions(OUTBOX_PARTITIONS_NAME))
    if missing := sorted(set(keys) - known):
        context.instance.add_dynamic_partitions(OUTBOX_PARTITIONS_NAME, missing)
    for key, progress in keys.items():
        context.log_event(
            dg.AssetMaterialization(
                asset_key=RELAYED_OUTBOX, partition=key, metadata=_metadata(progress, report, worker_id)
            )
        )
    failing = [key for key, p in keys.items() if p.failed]
    summary = (
        f"{report.published} published in {report.interval_s:.0f} s over {len(keys)} partitions; "
        f"duplicates risked {report.duplicates_risked}, dead-lettered {report.dead_lettered}, "
        f"database errors {report.errors}"
    )
    if failing:
        context.log.warning("%s; deliveries failing in %s", summary, ", ".join(failing))
    else:
        context.log.info(summary)


def _metadata(p: PartitionProgress, report: StreamReport, worker_id: str) -> dict[str, dg.MetadataValue]:
    lag = p.lag
    return {
        "rows_published": dg.MetadataValue.int(p.published),
        "msg_per_s": dg.MetadataValue.float(round(p.msg_per_s, 1)),
        "lag": dg.MetadataValue.int(lag.pending if lag else 0),
        "oldest_pending_age_s": dg.MetadataValue.float(round((lag.oldest_pending_age_s if lag else None) or 0.0, 3)),
        "failed_deliveries": dg.MetadataValue.int(p.failed),
        "last_error": dg.MetadataValue.text(p.last_failure or (lag.last_error if lag else None) or "-"),
        "position": dg.MetadataValue.text((lag.position if lag else None) or "-"),
        "interval_s": dg.MetadataValue.float(round(p.interval_s, 1)),
        "dealt_to_this_run": dg.MetadataValue.bool(p.home),
        # The run's interval totals (its batches span partitions for row strategies).
        "run_duplicates_risked": dg.MetadataValue.int(report.duplicates_risked),
        "run_dead_lettered": dg.MetadataValue.int(report.dead_lettered),
        "run_errors": dg.MetadataValue.int(report.errors),
        "worker_id": dg.MetadataValue.text(worker_id),
    }


def build_relay_stream_job(name: str = RELAY_STREAM_JOB_NAME) -> dg.JobDefinition:
    @dg.job(
        name=name,
        executor_def=dg.in_process_executor,
        description="Relay the outbox for a window (minutes) as one registered worker; the lag sensor keeps one "
        "live and adds more while partitions lag.",
        tags={"outbox/kind": "relay-stream"},
    )
    def relay_stream() -> None:
        relay_outbox_stream()

    return relay_stream


relay_stream_job = build_relay_stream_job()
