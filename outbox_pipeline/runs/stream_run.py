"""One long-lived relay worker for an orchestrator, reporting every partition's progress at intervals, because a run
costs seconds to start yet each partition keeps its own history. See docs/dagster.md#long-lived-relay-runs."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace

import psycopg

from .. import server
from ..model import WAL, OutboxRecord, PublishOutcome
from ..observe.lag import PartitionLag, partition_lag
from ..relay.publisher import KafkaPublisher
from ..relay.relay_settings import RelaySettings
from ..relay.stats import RelayInstruments, RelayStats
from ..relay.workers import WorkerSpec, build_relay
from ..strategies.base import StrategyConfig
from ..strategies.positions import deal
from .wal_partitions import WalPartitions

Pair = tuple[str, int]
# Per-partition count cap of the lag read at each report: exact below it, "at least" above.
REPORT_LAG_CAP = 100_000
# How long a stop waits for the batch in flight (its delivery reports and ack) before giving up on it.
STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class PartitionProgress:
    """One partition over one report interval."""

    topic: str
    partition: int
    published: int  # confirmed by Kafka in the interval
    failed: int  # delivery failures in the interval (retried or dead-lettered, see the run's totals)
    last_failure: str | None  # the last delivery error this worker saw in the interval (a retry may have cleared
    # the position's own last_error by the time the interval is reported)
    interval_s: float
    lag: PartitionLag | None  # at the end of the interval; None: no rows and no position
    home: bool  # dealt to this worker (False: it helped with a partition whose row waited)

    @property
    def msg_per_s(self) -> float:
        return self.published / self.interval_s if self.interval_s > 0 else 0.0


@dataclass(frozen=True)
class StreamReport:
    """What one report interval did, per partition and in total."""

    partitions: tuple[PartitionProgress, ...]
    interval_s: float
    published: int
    duplicates_risked: int  # confirmed by Kafka but not acked: published again later (at-least-once)
    dead_lettered: int
    retried: int
    errors: int  # database errors (reconnected)
    final: bool  # the relay has stopped; this is the last report


class _Tally:
    """Per-partition counts, written by the relay's thread and taken by the reporting one. ``routing``: where a
    record's partition comes from when it carries none (the wal strategy's)."""

    def __init__(self, routing: WalPartitions | None = None) -> None:
        self._routing = routing
        self._lock = threading.Lock()
        self._published: Counter[Pair] = Counter()
        self._failed: Counter[Pair] = Counter()
        self._errors: dict[Pair, str] = {}

    def observe(self, outcome: PublishOutcome) -> None:
        at = self._routing.of if self._routing is not None else _own_partition
        published = Counter(at(r) for r in outcome.delivered)
        failed = Counter(at(f.record) for f in outcome.failed)
        errors = {at(f.record): f.error for f in outcome.failed}
        with self._lock:
            self._published.update(published)
            self._failed.update(failed)
            self._errors.update(errors)

    def take(self) -> tuple[Counter[Pair], Counter[Pair], dict[Pair, str]]:
        with self._lock:
            taken = self._published, self._failed, self._errors
            self._published, self._failed, self._errors = Counter(), Counter(), {}
        return taken


def _own_partition(record: OutboxRecord) -> Pair:
    return record.topic, record.partition


@dataclass(frozen=True)
class _Totals:
    published: int = 0
    acked: int = 0
    dead_lettered: int = 0
    retried: int = 0
    errors: int = 0

    @classmethod
    def of(cls, stats: RelayStats) -> _Totals:
        return cls(stats.published, stats.acked, stats.dead_lettered, stats.retried, stats.errors)


class StreamRun:
    """The relay loop in a thread for a window (``settings.max_seconds``), reporting at intervals."""

    def __init__(
        self,
        dsn: str,
        strategy: str,
        config: StrategyConfig,
        publisher: KafkaPublisher,
        settings: RelaySettings,
        report_every_s: float,
        instruments: RelayInstruments | None = None,
    ) -> None:
        if report_every_s <= 0:
            raise ValueError(f"report_every_s must be > 0, got {report_every_s}")
        self.dsn = dsn
        self.strategy = strategy
        self.config = config
        self.report_every_s = report_every_s
        self._tally = _Tally()
        spec = WorkerSpec(
            dsn,
            strategy,
            {},
            replace(settings, until_empty=False, until_idle=False),
            config,
            worker_id=config.worker_id,
        )
        if strategy == WAL:
            # One relay streams the slot; each message's partition is its key's, as the SQL routing has it.
            self._tally = _Tally(WalPartitions(dsn, config.table))
        self.relay = build_relay(spec, publisher=publisher, instruments=instruments, observer=self._tally.observe)
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        # Set when the relay thread has finished (deregistered). Waited on instead of Thread.join: a join
        # interrupted by a signal handler's exception (Ctrl-C, Dagster's interrupt) marks the thread
        # stopped while it still runs (CPython 3.11, bpo-45274's fix), and every later join returns at once.
        self._finished = threading.Event()
        self._dealt: set[Pair] = set(config.partitions or ())

    def stop(self) -> None:
        """End after the batch in flight is confirmed and acked (the relay deregisters on its way out)."""
        self.relay.stop.set()

    def close(self) -> None:
        """Stop and wait for the relay to finish (bounded). Call it in a ``finally``: an exception raised
        while the caller handles a report leaves the generator suspended, not finished, and a daemon
        thread dies with the process without deregistering. A second interrupt while it waits (an
        orchestrator's terminate after a Ctrl-C) does not cut the wait short; it is raised afterwards."""
        self.stop()
        interrupted = None
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self._thread is not None and (remaining := deadline - time.monotonic()) > 0:
            try:
                if self._finished.wait(timeout=remaining):
                    break
            except BaseException as exc:  # noqa: BLE001 - re-raised once the worker has stopped
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted

    def reports(self) -> Iterator[StreamReport]:
        """Run the relay and yield a report every ``report_every_s`` and a final one when it stops.

        An exception raised into the caller while it waits here stops the relay cleanly and propagates.
        """
        thread = self._thread = threading.Thread(target=self._run, name=f"relay {self.config.worker_id}", daemon=True)
        last = time.monotonic()
        totals = _Totals()
        thread.start()
        conn: psycopg.Connection | None = None
        try:
            while True:
                self._finished.wait(timeout=max(0.0, last + self.report_every_s - time.monotonic()))
                final = self._finished.is_set()
                now = time.monotonic()
                if final and self._failure is not None:
                    raise self._failure
                current = _Totals.of(self.relay.stats)
                try:
                    if conn is None:
                        conn = server.connect(self.dsn, autocommit=True, application_name="outbox stream report")
                    report = self._report(conn, now - last, totals, current, final)
                except psycopg.OperationalError:
                    # The database restarted or ended this session. The relay reconnects by itself; the report
                    # does at its next interval, and this one goes without lag rather than failing the run.
                    _closed(conn)
                    conn = None
                    report = self._report(None, now - last, totals, current, final)
                yield report
                last, totals = now, current
                if final:
                    return
        finally:
            _closed(conn)
            self.close()

    def _run(self) -> None:
        try:
            self.relay.run()
        except BaseException as exc:  # handed to the reporting thread, which raises it
            self._failure = exc
        finally:
            self._finished.set()

    def _report(
        self, conn: psycopg.Connection | None, interval_s: float, before: _Totals, now: _Totals, final: bool
    ) -> StreamReport:
        """``conn`` None: the database cannot be read now; the interval is reported from the relay's own counts."""
        table = self.config.table
        lags = {}
        # The database is read before the tally is taken: a read that fails loses no count.
        if conn is not None and self.strategy != WAL:  # a wal outbox's lag is its slot's, not a partition's
            lags = {
                (lag.topic, lag.partition): lag for lag in partition_lag(conn, table, self.strategy, cap=REPORT_LAG_CAP)
            }
        if conn is not None and self.config.partitions is None and not final and self.strategy != WAL:
            # While registered it is dealt its share; before it registers and once it has deregistered
            # (the final report) it keeps the share it had, so no partition is reported by two workers.
            home = deal(conn, table, self.config.worker_id, self.config.lease_s)
            if not home.everywhere:
                self._dealt = set(zip(home.topics or [], home.partitions or [], strict=True))
        published, failed, errors = self._tally.take()
        if self.strategy == WAL:  # one relay streams every partition: each one it has published to, from then on
            self._dealt |= set(published) | set(failed)
        dealt = self._dealt
        pairs = sorted(dealt | set(published) | set(failed))
        return StreamReport(
            partitions=tuple(
                PartitionProgress(
                    topic=topic,
                    partition=partition,
                    published=published[(topic, partition)],
                    failed=failed[(topic, partition)],
                    last_failure=errors.get((topic, partition)),
                    interval_s=interval_s,
                    lag=lags.get((topic, partition)),
                    home=(topic, partition) in dealt,
                )
                for topic, partition in pairs
            ),
            interval_s=interval_s,
            published=now.published - before.published,
            duplicates_risked=(now.published - now.acked) - (before.published - before.acked),
            dead_lettered=now.dead_lettered - before.dead_lettered,
            retried=now.retried - before.retried,
            errors=now.errors - before.errors,
            final=final,
        )


def _closed(conn: psycopg.Connection | None) -> None:
    """Close ``conn`` if there is one (a broken connection closes without error)."""
    if conn is not None:
        conn.close()
