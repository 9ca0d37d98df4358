"""Engine room: the relay loop, the same for every strategy.

claim -> publish the whole batch -> wait for every delivery report -> ack only what Kafka confirmed.
Under steady traffic (paced, see relay_settings.Pacer) a strategy that can (Strategy.folds_ack) makes that ack
part of the next claim's statement, which still runs before the next batch is published. When idle it waits for
a NOTIFY from the outbox's insert trigger (milliseconds) or, without one, for a poll interval that backs off; when
PostgreSQL or Kafka fail it backs off with jitter, reconnects and never loses its place (the place lives in
PostgreSQL, never in the worker).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from ..config import OutboxTable
from ..observe.lag import explain_pending, pending_in_scope
from ..strategies.base import AckResult, Claim, PublishOutcome, Strategy, StrategyConfig
from .publisher import KafkaPublisher, PendingBatch
from .relay_settings import Pacer, RelaySettings
from .sessions import StrategyFactory, WorkerSessions
from .stats import BatchMetrics, RelayInstruments, RelayStats
from .wakeups import WakeUps

log = logging.getLogger(__name__)

# Called with every batch's outcome after its ack (in the relay's thread): per-partition accounting.
OutcomeObserver = Callable[[PublishOutcome], None]


@dataclass
class _InFlight:
    """A batch handed to Kafka and not yet acked: who claimed it, and its producer handle."""

    strategy: Strategy
    claim: Claim
    started: float
    pending: PendingBatch | None = None
    outcome: PublishOutcome | None = None  # known at once for Kafka transactions
    settled_at: float = 0.0  # when Kafka's outcome was known


@dataclass(frozen=True)
class _Settled:
    """A batch Kafka settled whose ack waits for the next claim (Strategy.folds_ack): one statement for both."""

    batch: _InFlight
    outcome: PublishOutcome


class Relay:
    """One relay worker: strategy instance(s), a producer, and the loop between them."""

    def __init__(
        self,
        dsn: str,
        strategy_factory: StrategyFactory,
        strategy_config: StrategyConfig,
        publisher: KafkaPublisher,
        settings: RelaySettings = RelaySettings(),
        stop: threading.Event | None = None,
        observer: OutcomeObserver | None = None,
        instruments: RelayInstruments | None = None,
    ) -> None:
        self.dsn = dsn
        self.observer = observer
        self.instruments = instruments
        self.strategy_config = strategy_config
        self.publisher = publisher
        self.stop = stop or threading.Event()
        self.stats = RelayStats()
        # Set once this worker is in the registry (dealt partitions, visible to orchestrators).
        self.registered = threading.Event()
        self._wake_ups = WakeUps(strategy_config.table, self.stop)
        self._sessions = WorkerSessions(
            dsn, strategy_factory, strategy_config, settings, self._wake_ups, self.stop, self.registered
        )
        # Whether a claim may find anything: False after an empty or partial one, until a NOTIFY arrives (or the
        # poll interval passes); a claim that could only find nothing costs statements at every cycle.
        self._may_have_work = True
        self._woken = False  # the last idle wait ended at a NOTIFY (not at its poll interval)
        self._pacer = Pacer(self.settings.min_cycle_s)
        self._turn = 0
        self._settled: _Settled | None = None

    # -- sessions ----------------------------------------------------------------------------

    # The factory and the settings live with the sessions that use them; set here, the sessions see the change.
    @property
    def strategy_factory(self) -> StrategyFactory:
        return self._sessions.strategy_factory

    @strategy_factory.setter
    def strategy_factory(self, factory: StrategyFactory) -> None:
        self._sessions.strategy_factory = factory

    @property
    def settings(self) -> RelaySettings:
        return self._sessions.settings

    @settings.setter
    def settings(self, settings: RelaySettings) -> None:
        self._sessions.settings = settings

    @property
    def strategy(self) -> Strategy:
        """The (first) strategy instance, connected on first use."""
        return self._sessions.strategies()[0]

    def _upkeep(self) -> bool:
        """Heartbeat and reap when due (relay/sessions.py); True when dead workers' work was freed."""
        reaped = self._sessions.upkeep()
        if reaped is None:
            return False
        if self.instruments is not None:
            self.instruments.database_ok()
        return reaped

    def close(self) -> None:
        self._sessions.disconnect(deregister=True)
        self.publisher.close()

    # -- one cycle, unpipelined --------------------------------------------------------------

    def run_once(self) -> BatchMetrics | None:
        """Claim, publish and ack one batch; None when there was nothing to claim."""
        claim = self._claim(self.strategy)
        if claim is None:
            return None
        batch = self._publish(self.strategy, claim)
        return self._ack(batch, self._finish(batch))

    # -- the pieces --------------------------------------------------------------------------

    def _claim(self, strategy: Strategy, in_flight: _InFlight | None = None) -> Claim | None:
        avoid = [r.id for r in (*in_flight.claim.records, *in_flight.claim.withheld)] if in_flight is not None else ()
        started = time.monotonic()
        if (settled := self._settled) is not None:
            self._settled = None
            result, claim = settled.batch.strategy.claim_settling(
                self.settings.batch_size, settled.batch.claim, settled.outcome
            )
            self._acked(settled.batch, settled.outcome, result, started)
        else:
            claim = strategy.claim(self.settings.batch_size, avoid)
        rows = len(claim.records) + len(claim.withheld) if claim is not None else 0
        if claim is not None and self.instruments is not None:
            self.instruments.claimed(time.monotonic() - started, rows, claim.collisions)
        self._pacer.claimed(started, rows, took_all=claim is None)
        if claim is None:
            self._may_have_work = False  # until a NOTIFY says otherwise, or the poll interval passes
            return None
        if not claim.records and not claim.withheld:
            # Every candidate was taken by another worker first: no batch, but the collisions count.
            self.stats.collisions += claim.collisions
            strategy.give_back(claim, "empty claim")
            self._may_have_work = True
            return None
        # Claim again at once only if more may be there: a full batch, or other work seen waiting.
        more = rows >= self.settings.batch_size or claim.others_waiting
        self._may_have_work = more
        self._pacer.claimed(started, rows, took_all=not more)
        return claim

    def _publish(self, strategy: Strategy, claim: Claim) -> _InFlight:
        batch = _InFlight(strategy, claim, time.monotonic())
        try:
            if not claim.records:  # only rows of held keys (quarantine): nothing for Kafka, the ack moves them
                batch.outcome = PublishOutcome([], [])
            elif claim.transactional_ids is not None:
                batch.outcome = self.publisher.publish_transactions(
                    claim.records, claim.transactional_ids, strategy.still_owns
                )
            else:
                batch.pending = self.publisher.start(claim.records)
        except Exception as exc:
            # Nothing was confirmed, so nothing may be acked: give the whole batch back.
            strategy.give_back(claim, f"publish failed: {exc}")
            raise
        return batch

    def _finish(self, batch: _InFlight) -> PublishOutcome:
        if batch.outcome is None:
            assert batch.pending is not None
            batch.outcome = self.publisher.finish(batch.pending)
        batch.settled_at = time.monotonic()
        return batch.outcome

    def _ack(self, batch: _InFlight, outcome: PublishOutcome) -> BatchMetrics:
        ack_started = time.monotonic()
        return self._acked(batch, outcome, batch.strategy.ack(batch.claim, outcome), ack_started)

    def _ack_settled(self) -> None:
        """Ack the batch kept for the next claim now: no claim comes (stopping, idle, or not this strategy's turn)."""
        if (settled := self._settled) is not None:
            self._settled = None
            self._ack(settled.batch, settled.outcome)

    def _keeps_ack(self, batch: _InFlight, outcome: PublishOutcome) -> bool:
        """Whether this settled batch's ack goes with the next claim: the relay is paced (that claim comes within
        the linger if commits wait for it; if none does, the ack goes alone before the relay waits), Kafka took all of
        it, and its strategy acks and claims in one statement. The next batch is never published before it."""
        return (
            batch.strategy.folds_ack
            and not outcome.failed
            and bool(outcome.delivered)
            and self._pacer.pause_s() > 0
            and (strategies := self._sessions.strategies())[self._turn % len(strategies)] is batch.strategy
        )

    def _acked(self, batch: _InFlight, outcome: PublishOutcome, result: AckResult, ack_started: float) -> BatchMetrics:
        if self.instruments is not None:
            publish_s = (batch.settled_at or ack_started) - batch.started
            self.instruments.acked_batch(publish_s, time.monotonic() - ack_started, outcome, result)
        self.publisher.retain_transactional(batch.strategy.transactional_ids())
        metrics = self.stats.record(batch.strategy.name, batch.claim, outcome, result, batch.started)
        if self.observer is not None:
            self.observer(outcome)
        return metrics

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> RelayStats:
        """Relay until stopped, until nothing is pending (``until_empty``) or claimable (``until_idle``), or
        ``max_seconds``.

        Pipelined: while Kafka confirms batch N, the worker reads batch N+1 from PostgreSQL; once N is
        confirmed and acked, N+1 goes to Kafka. At most one batch is in the producer (published, not
        yet acked) and at most two claims exist.
        """
        idle_wait = self.settings.poll_interval_s
        failures = 0
        deadline = time.monotonic() + self.settings.max_seconds if self.settings.max_seconds else None
        in_flight: _InFlight | None = None
        if not self.strategy_config.kafka_transactions:  # those publish with producers of their own
            self.publisher.warm_up()
        try:
            while not self.stop.is_set() and (deadline is None or time.monotonic() < deadline):
                if self.instruments is not None:
                    self.instruments.loop()
                try:
                    if self._upkeep():
                        idle_wait, self._may_have_work = self.settings.poll_interval_s, True
                    strategies = self._sessions.strategies()
                    strategy = strategies[self._turn % len(strategies)]
                    claim = self._claim(strategy, in_flight) if self._ready_to_claim(strategy, in_flight) else None
                    if in_flight is not None:
                        previous, in_flight = in_flight, None
                        outcome = self._finish(previous)
                        kafka_down = bool(previous.claim.records) and not outcome.delivered
                        # Ack before handing the next batch to Kafka: a crash then leaves at most one
                        # published-but-unacked batch (the duplicates bound), at the cost of one
                        # round trip not overlapped with Kafka. Paced, with nothing read ahead, the ack goes
                        # in the next claim's statement (which precedes that batch's publish).
                        if claim is None and self._keeps_ack(previous, outcome):
                            self._settled = _Settled(previous, outcome)
                        else:
                            self._ack(previous, outcome)
                        if outcome.failed:
                            self._may_have_work = True  # what Kafka did not confirm is to publish again
                        if claim is not None and not kafka_down:
                            # Read while N was in Kafka: the strategy renews it, trims it, or gives it
                            # back when N did not ack in full (then N+1 would only add duplicates).
                            if (ready := strategy.before_publish(claim)) is not None:
                                in_flight = self._publish(strategy, ready)
                                self._turn += 1
                            else:
                                self._may_have_work = True  # given back: its rows are still to publish
                        elif claim is not None:
                            strategy.give_back(claim, "Kafka accepted nothing of the previous batch")
                            self._may_have_work = True
                        if kafka_down and self.settings.until_idle:
                            break  # a run that cannot progress ends; its orchestrator retries it
                        if kafka_down:
                            # The broker is down or unreachable. Back off, don't spin.
                            failures += 1
                            self.stop.wait(self.settings.error_backoff_s(failures))
                        else:
                            failures, idle_wait = 0, self.settings.poll_interval_s
                        continue
                    if claim is not None:
                        in_flight = self._publish(strategy, claim)
                        self._turn += 1
                        continue
                    self._ack_settled()  # no claim now: the batch kept for one is acked before the relay waits
                    # Asks the database too: a restart or a terminated session here is one more reconnect, not a crash.
                    if self.settings.until_idle or (self.settings.until_empty and not pending_in_scope(*self._scope())):
                        break
                except psycopg.OperationalError as exc:
                    # Batches in flight are abandoned: their rows or partitions go back when the
                    # transaction dies or the lease ends (at-least-once: published again).
                    in_flight, self._settled = None, None
                    failures += 1
                    self._may_have_work = True
                    log.warning("database unavailable (%s); reconnecting", self._database_error(exc))
                    self._sessions.disconnect()
                    self.stop.wait(self.settings.error_backoff_s(failures))
                    continue
                self.stats.idle_waits += 1
                if strategy.standing_by:
                    self._may_have_work = True
                    self._stand_by(min(self.settings.poll_interval_s, self.settings.upkeep_interval_s))
                    continue
                # A poll looks again; a NOTIFY only if what it announces may be visible (_ready_to_claim).
                self._woken = self._wait_for_work(min(idle_wait, self.settings.upkeep_interval_s))
                self._may_have_work = not self._woken
                idle_wait = min(idle_wait * 2, self.settings.max_poll_interval_s)
            self._confirm_last(in_flight)
            if self.settings.until_empty and not self.stop.is_set():
                self.stats.remaining = self._explain_remaining()
        finally:
            self.close()
        return self.stats

    def _confirm_last(self, in_flight: _InFlight | None) -> None:
        """Stopping: ack what is out there. A database that goes away now (a restart, a terminated session) leaves
        one more batch published but not acked, as a crash would: its rows go back when the transaction dies or the
        lease ends and are published again. The stop still ends as asked, without an exception."""
        try:
            self._ack_settled()
            if in_flight is not None:
                self._ack(in_flight, self._finish(in_flight))
        except psycopg.OperationalError as exc:
            reason = self._database_error(exc)
            log.warning("stopping: the last batch could not be confirmed (%s); it will be published again", reason)

    def _database_error(self, exc: psycopg.OperationalError) -> str:
        """Count a database error (stats, /metrics); its first line, to log."""
        self.stats.errors += 1
        if self.instruments is not None:
            self.instruments.error()
        return str(exc).strip().splitlines()[0]

    def _explain_remaining(self) -> list[str]:
        """Why rows are still pending when ``--max-seconds`` ended an ``--until-empty`` run: asked of the database,
        which may be the reason it could not finish."""
        try:
            return explain_pending(*self._scope())
        except psycopg.OperationalError as exc:
            return [f"unknown: the database did not answer ({str(exc).strip().splitlines()[0]})"]

    def _ready_to_claim(self, strategy: Strategy, in_flight: _InFlight | None) -> bool:
        """Whether to claim now. Paced (the last claim took everything there was), a batch in Kafka is finished and
        acked first, and with none the pause is waited out (commits gather meanwhile: the next claim takes them
        together). Then one look at the control connection: commits announced since the last claim (or no way to
        hear of them) mean work, unless the strategy knows they cannot be visible yet (Strategy.commits_visible);
        the claim sees what they announce, so they are dropped (a look costs about a tenth of a cycle, and is made
        only where a claim may follow)."""
        if in_flight is not None and not self.settings.pipeline:
            return False
        if (pause := self._pacer.pause_s()) > 0:
            if in_flight is not None:
                return False
            self.stop.wait(pause)
        heard = self._wake_ups.coalesce(self._sessions.control) > 0 or self._woken
        self._woken = False
        if not self._wake_ups.listening or (heard and strategy.commits_visible()):
            self._may_have_work = True
        return self._may_have_work

    def _scope(self) -> tuple[psycopg.Connection, OutboxTable, str, frozenset[tuple[str, int]] | None]:
        return self.strategy.conn, self.strategy_config.table, self.strategy.name, self.strategy_config.partitions

    def _wait_for_work(self, timeout_s: float) -> bool:
        """Wake at the first NOTIFY (a commit that inserted rows) or after the timeout (wakeups.py); True: a NOTIFY."""
        if not self.settings.listen:
            self.stop.wait(timeout_s)
            return False
        try:
            if self._sessions.control is None:
                self._sessions.connect_control()
                return False  # rows committed before LISTEN sent no wake-up: look once more before waiting
            return self._wake_ups.wait(self._sessions.control, timeout_s)
        except psycopg.OperationalError:
            self._sessions.disconnect()
            self.stop.wait(timeout_s)
            return False

    def _stand_by(self, timeout_s: float) -> None:
        """Wait to ask for the active worker's role again (Strategy.standing_by), not listening meanwhile."""
        try:
            self._wake_ups.stand_by(self._sessions.control, timeout_s)
        except psycopg.OperationalError:
            self._sessions.disconnect()
            self.stop.wait(timeout_s)
