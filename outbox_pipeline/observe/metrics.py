"""Prometheus metrics of a relay worker and its liveness probe (`outbox relay --metrics-port`), each worker on its own
registry. See docs/operations.md#metrics-and-liveness---metrics-port."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import psycopg
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from .. import server
from ..config import OutboxTable
from ..model import WAL, AckResult, PublishOutcome
from .horizon import find_horizon
from .lag import partition_lag
from .wal_lag import WalLag, wal_lag

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 10, 50, 100, 250, 500, 1000, 2500, 5000, 10000)


class RelayMetrics:
    """The relay loop's instruments (see Relay's ``metrics``); ``healthy`` answers the liveness probe."""

    def __init__(
        self, strategy: str, registry: CollectorRegistry | None = None, *, stall_after_s: float = 120.0
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.stall_after_s = stall_after_s
        r = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["strategy"], registry=r).labels(strategy)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, ["strategy"], registry=r, buckets=tuple(buckets)).labels(strategy)

        self.published = counter("outbox_relay_published", "Records Kafka confirmed")
        self.acked = counter("outbox_relay_acked", "Records recorded as delivered in PostgreSQL")
        self.retried = counter("outbox_relay_retried", "Records that failed and will be retried")
        self.dead_lettered = counter("outbox_relay_dead_lettered", "Records moved to the dead letters")
        self.collisions = counter("outbox_relay_collisions", "Candidate rows another worker took first")
        self.lost_ownership = counter(
            "outbox_relay_lost_ownership", "Records published whose lease was lost before the ack (sent again)"
        )
        self.errors = counter("outbox_relay_errors", "Database errors the loop recovered from")
        self.claim_seconds = histogram("outbox_relay_claim_seconds", "Time to claim a batch", LATENCY_BUCKETS)
        self.publish_seconds = histogram(
            "outbox_relay_publish_seconds",
            "From handing a batch to the producer to Kafka's last report",
            LATENCY_BUCKETS,
        )
        self.ack_seconds = histogram("outbox_relay_ack_seconds", "Time to ack a batch in PostgreSQL", LATENCY_BUCKETS)
        self.batch_size = histogram("outbox_relay_batch_size", "Rows per claimed batch", BATCH_BUCKETS)
        self._up = Gauge("outbox_relay_up", "1 while the relay loop turns and its database answers", registry=r)
        self._up.set_function(lambda: 1.0 if self.healthy()[0] else 0.0)
        self._loop_at = time.monotonic()
        self._database_at = time.monotonic()
        # Since when every batch failed to reach Kafka (transport failures, nothing delivered); None: it reaches it.
        self._kafka_failing_since: float | None = None

    # -- hooks called by the relay loop ----------------------------------------------------------

    def loop(self) -> None:
        self._loop_at = time.monotonic()

    def database_ok(self) -> None:
        self._database_at = time.monotonic()

    def claimed(self, seconds: float, rows: int, collisions: int) -> None:
        self.claim_seconds.observe(seconds)
        self.batch_size.observe(rows)
        self.collisions.inc(collisions)

    def acked_batch(self, publish_s: float, ack_s: float, outcome: PublishOutcome, result: AckResult) -> None:
        self.publish_seconds.observe(publish_s)
        self.ack_seconds.observe(ack_s)
        self.published.inc(len(outcome.delivered))
        self.acked.inc(result.acked)
        self.retried.inc(result.retried)
        self.dead_lettered.inc(result.dead_lettered)
        self.lost_ownership.inc(result.lost_ownership)
        if outcome.delivered:
            self._kafka_failing_since = None
        elif self._kafka_failing_since is None and any(f.kind == "transport" for f in outcome.failed):
            self._kafka_failing_since = time.monotonic() - outcome.elapsed_s

    def error(self) -> None:
        self.errors.inc()

    def healthy(self) -> tuple[bool, str]:
        now = time.monotonic()
        if now - self._loop_at > self.stall_after_s:
            return False, f"the relay loop has not turned for {now - self._loop_at:.0f} s"
        if now - self._database_at > self.stall_after_s:
            return False, f"no successful database round trip for {now - self._database_at:.0f} s"
        # A worker cut off from Kafka turns its loop and answers its database, and its partitions wait: while it holds
        # them (its session and heartbeat live), only a restart hands them to a worker that can publish.
        if (since := self._kafka_failing_since) is not None and now - since > self.stall_after_s:
            return False, f"nothing delivered to Kafka for {now - since:.0f} s (the broker is down or unreachable)"
        return True, "ok"


@dataclass(frozen=True)
class _LagSnapshot:
    pending: tuple[tuple[str, int, int, float | None, int], ...]  # topic, partition, pending, oldest age, held
    horizon_age_s: float
    read_at: float
    wal: WalLag | None = None  # a wal outbox's slot (no partitions)


class LagSampler(Collector):
    """Per-partition lag from PostgreSQL, one query set per ``interval_s`` in a thread of its own."""

    def __init__(
        self, dsn: str, table: OutboxTable, strategy: str, *, interval_s: float = 15.0, cap: int = 100_000
    ) -> None:
        self.dsn, self.table, self.strategy = dsn, table, strategy
        self.interval_s, self.cap = interval_s, cap
        self._snapshot: _LagSnapshot | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outbox-lag-sampler", daemon=True)

    def start(self) -> LagSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def sample(self) -> None:
        if self.strategy == WAL:
            with server.connect(self.dsn, autocommit=True, application_name="outbox metrics") as conn:
                self._snapshot = _LagSnapshot((), 0.0, time.time(), wal_lag(conn, self.table))
            return
        with server.connect(self.dsn, autocommit=True, application_name="outbox metrics") as conn:
            lags = partition_lag(conn, self.table, self.strategy, cap=self.cap)
            horizon_age = 0.0
            if self.strategy == "partitioned":
                horizon = find_horizon(conn, self.table)
                ages = [h.transaction_age_s or 0.0 for h in horizon.holders]
                horizon_age = max(ages, default=0.0)
        self._snapshot = _LagSnapshot(
            tuple((lag.topic, lag.partition, lag.pending, lag.oldest_pending_age_s, lag.held) for lag in lags),
            horizon_age,
            time.time(),
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except psycopg.Error as exc:
                log.warning("metrics: could not read the outbox lag: %s", str(exc).strip().splitlines()[0])
            self._stop.wait(self.interval_s)

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot
        if snapshot is None:
            return
        if snapshot.wal is not None:
            yield from _wal_gauges(snapshot.wal)
            yield GaugeMetricFamily(
                "outbox_lag_sample_age_seconds", "How old the lag figures are", value=time.time() - snapshot.read_at
            )
            return
        labels = ["topic", "partition"]
        pending = GaugeMetricFamily("outbox_pending_rows", "Rows still to publish, per partition", labels=labels)
        oldest = GaugeMetricFamily(
            "outbox_oldest_pending_age_seconds", "Age of the oldest row still to publish", labels=labels
        )
        held = GaugeMetricFamily("outbox_held_rows", "Rows held behind a dead letter of their key", labels=labels)
        for topic, partition, rows, age, held_rows in snapshot.pending:
            key = [topic, str(partition)]
            pending.add_metric(key, rows)
            oldest.add_metric(key, age or 0.0)
            held.add_metric(key, held_rows)
        yield pending
        yield oldest
        yield held
        yield GaugeMetricFamily(
            "outbox_horizon_age_seconds",
            "Age of the oldest open transaction holding back committed rows (strategy partitioned; 0: none)",
            value=snapshot.horizon_age_s,
        )
        yield GaugeMetricFamily(
            "outbox_lag_sample_age_seconds", "How old the lag figures are", value=time.time() - snapshot.read_at
        )


def _wal_gauges(wal: WalLag) -> Iterator[Metric]:
    """A wal outbox's slot, labelled by its name; a byte count or age the slot cannot give is left out."""
    slot = wal.slot
    families = (
        ("outbox_wal_retained_bytes", "Bytes of WAL the slot keeps on the server (from its restart point)",
         slot.retained_bytes),
        ("outbox_wal_unconfirmed_bytes", "Bytes of WAL after the position the relay last confirmed to the slot",
         slot.unconfirmed_bytes),
        ("outbox_wal_oldest_unpublished_age_seconds", "Age of the oldest commit with a message Kafka has not "
         "confirmed (observe/wal_lag.py says how it is measured)", wal.oldest_unpublished_age_s),
        ("outbox_wal_slot_usable", "1 while the slot exists and is not lost; 0: the relay cannot stream (see "
         "`outbox status`)", 0.0 if wal.problem else 1.0),
        ("outbox_wal_keep_size_used_ratio", "Fraction of max_slot_wal_keep_size the slot has used (1: PostgreSQL "
         "invalidates it; absent without a limit)", slot.kept_fraction),
        ("outbox_wal_stored_rows", "Rows in the wal outbox's message table: no relay reads them (see `outbox status`)",
         wal.stored_rows),
        ("outbox_wal_held_messages", "Messages held behind a dead letter of their key", wal.held_messages),
    )  # fmt: skip
    for name, doc, value in families:
        if value is not None:
            family = GaugeMetricFamily(name, doc, labels=["slot"])
            family.add_metric([slot.slot], float(value))
            yield family


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        """Scrapes every few seconds would flood the worker's log."""


class MetricsServer:
    """``/metrics`` (Prometheus text format) and ``/healthz`` on ``host:port``, in a daemon thread."""

    def __init__(
        self, registry: CollectorRegistry, health: Callable[[], tuple[bool, str]], port: int, host: str = "0.0.0.0"
    ) -> None:
        metrics_app = make_wsgi_app(registry)

        def app(environ: dict[str, object], start_response: Callable[..., object]) -> Iterable[bytes]:
            if environ.get("PATH_INFO") == "/healthz":
                ok, why = health()
                start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
                return [why.encode() + b"\n"]
            return metrics_app(environ, start_response)  # type: ignore[no-any-return]

        self._server: WSGIServer = make_server(
            host, port, app, server_class=ThreadingWSGIServer, handler_class=_QuietHandler
        )
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="outbox-metrics", daemon=True)

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass
class WorkerMetrics:
    """A relay worker's metrics, served: pass ``metrics`` to the Relay as its instruments; ``stop`` at the end."""

    metrics: RelayMetrics
    server: MetricsServer
    sampler: LagSampler | None

    def stop(self) -> None:
        self.server.stop()
        if self.sampler is not None:
            self.sampler.stop()


def serve_worker_metrics(
    port: int,
    dsn: str,
    table: OutboxTable,
    strategy: str,
    *,
    sample_lag: bool = True,
    lag_interval_s: float = 15.0,
    host: str = "0.0.0.0",
) -> WorkerMetrics:
    """Metrics and /healthz on ``port``; ``sample_lag`` adds the outbox's lag gauges (one worker per outbox
    is enough: every worker would read the same figures)."""
    metrics = RelayMetrics(strategy)
    sampler = None
    if sample_lag:
        sampler = LagSampler(dsn, table, strategy, interval_s=lag_interval_s)
        metrics.registry.register(sampler)
        sampler.start()
    server = MetricsServer(metrics.registry, metrics.healthy, port, host).start()
    log.info("metrics on http://%s:%d/metrics, liveness on /healthz", host, server.port)
    return WorkerMetrics(metrics, server, sampler)
