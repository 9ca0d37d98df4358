"""What a relay worker counts (RelayStats, BatchMetrics) and the hooks it reports through (RelayInstruments: Prometheus,
or nothing). See docs/operations.md#metrics-and-liveness---metrics-port."""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Protocol

from ..model import AckResult, Claim, PublishOutcome
from ..timestamps import PG_EPOCH

log = logging.getLogger(__name__)


class RelayInstruments(Protocol):
    """What the loop reports as it goes (metrics.RelayMetrics implements it for Prometheus)."""

    def loop(self) -> None: ...
    def database_ok(self) -> None: ...
    def claimed(self, seconds: float, rows: int, collisions: int) -> None: ...
    def acked_batch(self, publish_s: float, ack_s: float, outcome: PublishOutcome, result: AckResult) -> None: ...
    def error(self) -> None: ...


class NullInstruments:
    """Instruments that report nowhere: a relay run without /metrics (tests, the bench, Dagster runs)."""

    def loop(self) -> None:
        pass

    def database_ok(self) -> None:
        pass

    def claimed(self, seconds: float, rows: int, collisions: int) -> None:
        pass

    def acked_batch(self, publish_s: float, ack_s: float, outcome: PublishOutcome, result: AckResult) -> None:
        pass

    def error(self) -> None:
        pass


@dataclass(frozen=True)
class BatchMetrics:
    claimed: int
    published: int
    # Published and recorded as delivered; published - acked were confirmed by Kafka but will be
    # published again (lease lost, or behind an unconfirmed row of an ordered partition).
    acked: int
    collisions: int
    lost_ownership: int
    dead_lettered: int
    retried: int
    oldest_age_s: float | None
    elapsed_s: float

    @property
    def msg_per_s(self) -> float:
        return self.published / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class RelayStats:
    """Cumulative metrics of one relay worker (Merpay's set, plus retries)."""

    batches: int = 0
    claimed: int = 0
    published: int = 0
    acked: int = 0
    collisions: int = 0
    lost_ownership: int = 0
    dead_lettered: int = 0
    retried: int = 0
    errors: int = 0
    idle_waits: int = 0  # times it found nothing to claim and waited for a NOTIFY or a poll
    oldest_age_s: float | None = None
    started: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0
    # until_empty stopped (max_seconds) with rows still pending: one line per reason (lag.explain_pending).
    remaining: list[str] = field(default_factory=list)

    def record(
        self, strategy: str, claim: Claim, outcome: PublishOutcome, result: AckResult, started: float
    ) -> BatchMetrics:
        """Count one acked batch (claimed at ``started``); a batch Kafka did not take in full is logged."""
        metrics = BatchMetrics(
            claimed=len(claim.records),
            published=len(outcome.delivered),
            acked=result.acked,
            collisions=claim.collisions,
            lost_ownership=result.lost_ownership,
            dead_lettered=result.dead_lettered,
            retried=result.retried,
            oldest_age_s=oldest_age_s(claim),
            elapsed_s=time.monotonic() - started,
        )
        self.add(metrics)
        if outcome.failed:
            log.warning(
                "%s: %d of %d not delivered (first: %s); retried %d, dead-lettered %d",
                strategy,
                len(outcome.failed),
                metrics.claimed,
                outcome.failed[0].error,
                result.retried,
                result.dead_lettered,
            )
        log.debug("%s batch: %s", strategy, metrics)
        return metrics

    def add(self, batch: BatchMetrics) -> None:
        self.batches += 1
        self.claimed += batch.claimed
        self.published += batch.published
        self.acked += batch.acked
        self.collisions += batch.collisions
        self.lost_ownership += batch.lost_ownership
        self.dead_lettered += batch.dead_lettered
        self.retried += batch.retried
        self.oldest_age_s = batch.oldest_age_s
        self.busy_s += batch.elapsed_s

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def msg_per_s(self) -> float:
        return self.published / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> str:
        return (
            f"published={self.published} claimed={self.claimed} collisions={self.collisions} "
            f"published_but_ack_failed={self.lost_ownership} dead_lettered={self.dead_lettered} "
            f"retried={self.retried} errors={self.errors} msg/s={self.msg_per_s:,.0f}"
        )


def database_error(stats: RelayStats, instruments: RelayInstruments, exc: Exception) -> str:
    """Count a database error (the relay's stats and /metrics); its first line, to log."""
    stats.errors += 1
    instruments.error()
    return str(exc).strip().splitlines()[0]


_CREATED_AT = attrgetter("created_at")


def oldest_age_s(claim: Claim) -> float | None:
    """Merpay's oldest_task_age: the age of the oldest row in the batch just claimed."""
    if not claim.records:
        return None
    oldest: int = min(map(_CREATED_AT, claim.records))  # no Python call per row
    return (dt.datetime.now(dt.UTC) - PG_EPOCH).total_seconds() - oldest / 1e6
