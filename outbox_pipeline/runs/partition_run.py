"""Relay one (topic, virtual partition) until nothing is claimable or a time budget ends, and report its lag and a
verdict, so an orchestrator keeps one run history per partition. See docs/dagster.md#per-partition-runs."""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import psycopg
from psycopg import sql

from ..config import OutboxTable
from ..observe.lag import PartitionLag, explain_pending, partition_lag
from ..relay.publisher import KafkaPublisher
from ..relay.relay_settings import RelaySettings
from ..relay.workers import WorkerSpec, build_relay
from ..strategies import strategy_class
from ..strategies.base import StrategyConfig
from ..strategies.positions import PositionStrategy


@dataclass(frozen=True)
class PartitionRunReport:
    topic: str
    partition: int
    strategy: str
    worker_id: str
    published: int
    claimed: int
    dead_lettered: int
    # Confirmed by Kafka but not acked (lease lost, or after an unconfirmed row of an ordered
    # partition): those rows are published again later (at-least-once).
    duplicates_risked: int
    retried: int
    errors: int
    batches: int
    elapsed_s: float
    lag_before: PartitionLag | None
    lag_after: PartitionLag | None
    # Why rows are still pending after the run, one line per reason (lag.explain_pending), as
    # ``outbox relay --until-empty`` prints them: leased by whom (alive or dead) until when, backing off...
    pending_reasons: tuple[str, ...] = ()

    @property
    def msg_per_s(self) -> float:
        return self.published / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def pending_before(self) -> int:
        return self.lag_before.pending if self.lag_before else 0

    @property
    def pending_after(self) -> int:
        return self.lag_after.pending if self.lag_after else 0

    @property
    def oldest_pending_age_after_s(self) -> float | None:
        return self.lag_after.oldest_pending_age_s if self.lag_after else None

    @property
    def leased_elsewhere(self) -> str | None:
        """Another live worker holding the partition after this run (so it did not drain it)."""
        after = self.lag_after
        if after is None or after.pending == 0 or not after.leased_by:
            return None
        others = [w for w in after.leased_by.split(",") if w != self.worker_id]
        return ",".join(others) or None

    @property
    def delivery_error(self) -> str | None:
        """Why the partition still has rows Kafka did not take (None when it is not failing).

        Rows left behind a delivery failure: the strategy stored the error and the attempt count
        (offsets row for ordered strategies, the rows themselves otherwise) and is backing off.
        Rows merely written during the run are not a failure.
        """
        after = self.lag_after
        # attempts may be 0: a transport failure (broker down) never counts toward them, but it fails a run
        if after is None or after.pending == 0 or not after.last_error:
            return None
        if self.errors == 0 and self.retried == 0 and not after.in_backoff:
            return None  # an error recorded by someone else, earlier, and no longer holding the partition back
        return after.last_error


# Per-partition count cap of the lag reads around a run: exact below it, "at least" above.
LAG_CAP = 1_000_000


def lag_of(
    conn: psycopg.Connection, table: OutboxTable, strategy: str, topic: str, partition: int, *, cap: int = LAG_CAP
) -> PartitionLag | None:
    """One partition's lag, as ``strategy`` sees it (None: the partition has no rows and no position)."""
    found = partition_lag(conn, table, strategy, cap=cap, only=(topic, partition))
    return found[0] if found else None


def end_backoff(conn: psycopg.Connection, table: OutboxTable, strategy: str, topic: str, partition: int) -> int:
    """Make a partition that is backing off after delivery failures claimable now; returns rows changed.

    For an orchestrated retry or an operator's rerun, which already waited on its own schedule: the
    engine's backoff would otherwise make the retry find nothing to claim. Leases are not touched (a
    live worker keeps its batch), so this never lets two workers publish the same rows.
    """
    if issubclass(strategy_class(strategy), PositionStrategy):
        query = sql.SQL(
            """
            UPDATE {offsets} SET available_after = now(), updated_at = now()
            WHERE topic = %(topic)s AND partition = %(partition)s
              AND locked_by IS NULL AND available_after > now()
            """
        ).format(offsets=table.offsets)
    else:
        query = sql.SQL(
            """
            UPDATE {messages} SET available_after = now()
            WHERE topic = %(topic)s AND partition = %(partition)s AND sent_at IS NULL
              AND locked_by IS NULL AND attempts > 0 AND available_after > now()
            """
        ).format(messages=table.messages)
    return conn.execute(query, {"topic": topic, "partition": partition}).rowcount


def relay_partition(
    conn: psycopg.Connection,
    dsn: str,
    strategy: str,
    config: StrategyConfig,
    topic: str,
    partition: int,
    publisher: KafkaPublisher,
    settings: RelaySettings,
    stop: threading.Event | None = None,
) -> PartitionRunReport:
    """Relay one partition until nothing is claimable or ``settings.max_seconds``; report before/after.

    ``conn`` (autocommit) reads the lag; the relay opens its own sessions from ``dsn``. ``config`` is
    scoped to the partition here, whatever it says. Every batch is confirmed by Kafka before it is
    acked (the relay loop's rule), so when this returns, what it counts as published is in Kafka.
    """
    table = config.table
    scoped = replace(config, partitions=frozenset({(topic, partition)}))
    before = lag_of(conn, table, strategy, topic, partition)
    spec = WorkerSpec(dsn, strategy, {}, replace(settings, until_idle=True), scoped, worker_id=scoped.worker_id)
    relay = build_relay(spec, stop, publisher=publisher)
    stats = relay.run()
    after = lag_of(conn, table, strategy, topic, partition)
    reasons = tuple(explain_pending(conn, table, strategy, scoped.partitions)) if after and after.pending else ()
    return PartitionRunReport(
        topic=topic,
        partition=partition,
        strategy=strategy,
        worker_id=scoped.worker_id,
        published=stats.published,
        claimed=stats.claimed,
        dead_lettered=stats.dead_lettered,
        duplicates_risked=stats.published - stats.acked,
        retried=stats.retried,
        errors=stats.errors,
        batches=stats.batches,
        elapsed_s=stats.elapsed_s,
        lag_before=before,
        lag_after=after,
        pending_reasons=reasons,
    )
