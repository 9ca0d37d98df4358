"""The table strategies' relay: claim, publish the whole batch, wait for every delivery report, ack only what Kafka
confirmed; pipelined, paced under steady traffic, woken by NOTIFY when idle, backing off with jitter when PostgreSQL or
Kafka fail. Its place lives in PostgreSQL, never in the worker (docs/architecture.md#the-relay-loop)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import psycopg

from ..model import AckResult, Claim, OutboxRecord, PublishOutcome
from ..strategies.base import Strategy, StrategyConfig
from .publisher import PendingBatch
from .relay_settings import Backoff, Pacer, RelaySettings
from .stats import BatchMetrics, NullInstruments, RelayInstruments, RelayStats, database_error

log = logging.getLogger(__name__)

# Called with every batch's outcome after its ack (in the relay's thread): per-partition accounting.
OutcomeObserver = Callable[[PublishOutcome], None]

# What a turn of the loop ended with: a batch moved, nothing to do (wait for work), or the run is over.
Step = Literal["busy", "idle", "done"]


class Sessions(Protocol):
    """What the loop asks of the database besides its strategies' statements (relay/sessions.py)."""

    config: StrategyConfig
    registered: threading.Event

    @property
    def listening(self) -> bool: ...
    def strategies(self) -> list[Strategy]: ...
    def upkeep(self) -> bool | None: ...
    def announced(self) -> bool: ...
    def wait_for_work(self, timeout_s: float) -> bool: ...
    def stand_by(self, timeout_s: float) -> None: ...
    def pending(self) -> bool: ...
    def explain_pending(self) -> list[str]: ...
    def disconnect(self, *, deregister: bool = False) -> None: ...


class Publisher(Protocol):
    """What the loop asks of Kafka (relay/publisher.py)."""

    def warm_up(self) -> None: ...
    def start(self, records: Sequence[OutboxRecord], until: float = ...) -> PendingBatch: ...
    def finish(self, pending: PendingBatch) -> PublishOutcome: ...
    def publish_transactions(
        self,
        records: Sequence[OutboxRecord],
        transactional_ids: Mapping[tuple[str, int], str],
        still_owns: Callable[[tuple[str, int]], bool] | None = ...,
    ) -> PublishOutcome: ...
    def retain_transactional(self, ids: frozenset[str] | None) -> None: ...
    def close(self, timeout_s: float = ...) -> None: ...


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


@dataclass
class _LoopState:
    """Everything the loop carries from one turn to the next."""

    idle_wait_s: float
    deadline: float | None
    in_flight: _InFlight | None = None
    settled: _Settled | None = None  # its ack goes with the next claim
    # Whether a claim may find anything: False after an empty or partial one, until a NOTIFY arrives (or the poll
    # interval passes); a claim that could only find nothing costs statements at every cycle.
    may_have_work: bool = True
    woken: bool = False  # the last idle wait ended at a NOTIFY (not at its poll interval)
    turn: int = 0  # which strategy instance claims next (two when each claim is an open transaction)
    strategy: Strategy | None = field(default=None, repr=False)  # this turn's


class Relay:
    """One table relay worker: its sessions (and through them its strategy instances), a publisher, and the loop."""

    def __init__(
        self,
        sessions: Sessions,
        publisher: Publisher,
        settings: RelaySettings,
        stop: threading.Event,
        *,
        observer: OutcomeObserver | None = None,
        instruments: RelayInstruments | None = None,
    ) -> None:
        self.sessions = sessions
        self.publisher = publisher
        self.settings = settings
        self.stop = stop
        self.observer = observer
        self.instruments = instruments or NullInstruments()
        self.stats = RelayStats()
        self.registered = sessions.registered  # set once this worker is in the registry
        self._pacer = Pacer(settings.min_cycle_s)
        self._backoff = Backoff(settings)
        self._state = _LoopState(settings.poll_interval_s, None)

    @property
    def strategy(self) -> Strategy:
        """The (first) strategy instance, connected on first use."""
        return self.sessions.strategies()[0]

    def prepare(self) -> None:
        """Connect and start the producer now, before a measurement's clock starts (``run`` does both as needed)."""
        self.sessions.strategies()
        self._warm_up()

    def _warm_up(self) -> None:
        if not self.sessions.config.kafka_transactions:  # those publish with producers of their own
            self.publisher.warm_up()

    def close(self) -> None:
        self.sessions.disconnect(deregister=True)
        self.publisher.close()

    def run_once(self) -> BatchMetrics | None:
        """Claim, publish and ack one batch, unpipelined; None when there was nothing to claim."""
        claim = self._claim(self.strategy)
        if claim is None:
            return None
        batch = self._publish(self.strategy, claim)
        return self._ack(batch, self._finish(batch))

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> RelayStats:
        """Relay until stopped, until nothing is pending (``until_empty``) or claimable (``until_idle``), or
        ``max_seconds``. Pipelined: while Kafka confirms batch N the worker reads batch N+1; N+1 goes to Kafka once N
        is acked, so at most one batch is published and not acked."""
        max_s = self.settings.max_seconds
        self._state = _LoopState(self.settings.poll_interval_s, time.monotonic() + max_s if max_s else None)
        self._warm_up()
        try:
            while self._running():
                self.instruments.loop()
                step = self._turn()
                if step == "done":
                    break
                if step == "idle":
                    self._wait_for_work()
            self._confirm_last()
            if self.settings.until_empty and not self.stop.is_set():
                self.stats.remaining = self.sessions.explain_pending()
        finally:
            self.close()
        return self.stats

    def _running(self) -> bool:
        deadline = self._state.deadline
        return not self.stop.is_set() and (deadline is None or time.monotonic() < deadline)

    def _turn(self) -> Step:
        """One turn: upkeep, a claim if one may find work, the batch in Kafka settled and acked, the next published."""
        state = self._state
        try:
            if self._upkeep():
                state.idle_wait_s, state.may_have_work = self.settings.poll_interval_s, True
            strategies = self.sessions.strategies()
            strategy = state.strategy = strategies[state.turn % len(strategies)]
            claim = self._claim(strategy, state.in_flight) if self._ready_to_claim(strategy) else None
            if state.in_flight is not None:
                return self._settle_then_publish(strategy, claim)
            if claim is not None:
                self._start(strategy, claim)
                return "busy"
            self._ack_settled()  # no claim now: the batch kept for one is acked before the relay waits
            # Asks the database too: a restart or a terminated session here is one more reconnect, not a crash.
            if self.settings.until_idle or (self.settings.until_empty and not self.sessions.pending()):
                return "done"
            return "idle"
        except psycopg.OperationalError as exc:
            self._database_down(exc)
            return "busy"

    def _upkeep(self) -> bool:
        """Heartbeat and reap when due (relay/sessions.py); True when dead workers' work was freed."""
        reaped = self.sessions.upkeep()
        if reaped is None:
            return False
        self.instruments.database_ok()
        return reaped

    def _ready_to_claim(self, strategy: Strategy) -> bool:
        """Whether to claim now. Paced (the last claim took everything there was), a batch in Kafka is finished and
        acked first, and with none the pause is waited out (commits gather meanwhile). Then one look at the control
        connection: commits announced since the last claim (or no way to hear of them) mean work, unless the strategy
        knows they cannot be visible yet (Strategy.commits_visible)."""
        state = self._state
        if state.in_flight is not None and not self.settings.pipeline:
            return False
        if (pause := self._pacer.pause_s()) > 0:
            if state.in_flight is not None:
                return False
            self.stop.wait(pause)
        heard = self.sessions.announced() or state.woken
        state.woken = False
        if not self.sessions.listening or (heard and strategy.commits_visible()):
            state.may_have_work = True
        return state.may_have_work

    def _settle_then_publish(self, strategy: Strategy, claim: Claim | None) -> Step:
        """The batch in Kafka settled and acked (or its ack kept for the next claim) before ``claim``, read
        meanwhile, is published: a crash then leaves at most one published-but-unacked batch (the duplicates
        bound). A broker that took nothing of it backs the relay off."""
        state = self._state
        previous, state.in_flight = state.in_flight, None
        assert previous is not None
        outcome = self._finish(previous)
        kafka_down = bool(previous.claim.records) and not outcome.delivered
        if claim is None and self._keeps_ack(previous, outcome):
            state.settled = _Settled(previous, outcome)
        else:
            self._ack(previous, outcome)
        if outcome.failed:
            state.may_have_work = True  # what Kafka did not confirm is to publish again
        if claim is not None:
            self._publish_read_ahead(strategy, claim, kafka_down)
        if kafka_down and self.settings.until_idle:
            return "done"  # a run that cannot progress ends; its orchestrator retries it
        if kafka_down:
            self.stop.wait(self._backoff.next_s())  # the broker is down or unreachable: back off, don't spin
        else:
            self._backoff.reset()
            state.idle_wait_s = self.settings.poll_interval_s
        return "busy"

    def _publish_read_ahead(self, strategy: Strategy, claim: Claim, kafka_down: bool) -> None:
        """A claim read while the previous batch was in Kafka: the strategy renews it, trims it, or gives it back when
        that batch did not ack in full (publishing past it would only add duplicates)."""
        if kafka_down:
            strategy.give_back(claim, "Kafka accepted nothing of the previous batch")
        elif (ready := strategy.before_publish(claim)) is not None:
            self._start(strategy, ready)
            return
        self._state.may_have_work = True  # given back: its rows are still to publish

    def _database_down(self, exc: psycopg.OperationalError) -> None:
        """Batches in flight are abandoned: their rows or partitions go back when the transaction dies or the lease
        ends (at-least-once: published again). Reconnect after a back-off."""
        state = self._state
        state.in_flight, state.settled, state.may_have_work = None, None, True
        log.warning("database unavailable (%s); reconnecting", database_error(self.stats, self.instruments, exc))
        self.sessions.disconnect()
        self.stop.wait(self._backoff.next_s())

    def _wait_for_work(self) -> None:
        """Idle: wait for a NOTIFY or the poll interval (which doubles while nothing comes); a standby waits for its
        turn to ask for the active role again. A poll looks again; a NOTIFY only if what it announces may be visible
        (``_ready_to_claim``)."""
        state = self._state
        self.stats.idle_waits += 1
        if state.strategy is not None and state.strategy.standing_by:
            state.may_have_work = True
            self.sessions.stand_by(min(self.settings.poll_interval_s, self.settings.upkeep_interval_s))
            return
        state.woken = self.sessions.wait_for_work(min(state.idle_wait_s, self.settings.upkeep_interval_s))
        state.may_have_work = not state.woken
        state.idle_wait_s = min(state.idle_wait_s * 2, self.settings.max_poll_interval_s)

    def _confirm_last(self) -> None:
        """Stopping: ack what is out there. A database that goes away now leaves one more batch published but not
        acked, as a crash would: it is published again. The stop still ends as asked, without an exception."""
        try:
            self._ack_settled()
            if (in_flight := self._state.in_flight) is not None:
                self._state.in_flight = None
                self._ack(in_flight, self._finish(in_flight))
        except psycopg.OperationalError as exc:
            reason = database_error(self.stats, self.instruments, exc)
            log.warning("stopping: the last batch could not be confirmed (%s); it will be published again", reason)

    # -- one batch ---------------------------------------------------------------------------

    def _claim(self, strategy: Strategy, in_flight: _InFlight | None = None) -> Claim | None:
        """The next batch (with the kept ack folded into its statement), or None; paces the claim after it."""
        avoid = [r.id for r in (*in_flight.claim.records, *in_flight.claim.withheld)] if in_flight is not None else ()
        started = time.monotonic()
        if (settled := self._state.settled) is not None:
            self._state.settled = None
            result, claim = settled.batch.strategy.ack_and_claim(
                self.settings.batch_size, settled.batch.claim, settled.outcome
            )
            self._acked(settled.batch, settled.outcome, result, started)
        else:
            claim = strategy.claim(self.settings.batch_size, avoid)
        rows = len(claim.records) + len(claim.withheld) if claim is not None else 0
        if claim is not None:
            self.instruments.claimed(time.monotonic() - started, rows, claim.collisions)
        # Claim again at once only if more may be there: a full batch, or other work seen waiting.
        more = claim is not None and (rows >= self.settings.batch_size or claim.others_waiting)
        self._pacer.claimed(started, rows, took_all=not more)
        return self._claimed(strategy, claim, more)

    def _claimed(self, strategy: Strategy, claim: Claim | None, more: bool) -> Claim | None:
        """What a claim means for the next one: none found, none until a NOTIFY; one whose every candidate another
        worker took first, no batch but the collisions counted and another claim at once."""
        if claim is None:
            self._state.may_have_work = False  # until a NOTIFY says otherwise, or the poll interval passes
            return None
        if not claim.records and not claim.withheld:
            self.stats.collisions += claim.collisions
            strategy.give_back(claim, "empty claim")
            self._state.may_have_work = True
            return None
        self._state.may_have_work = more
        return claim

    def _start(self, strategy: Strategy, claim: Claim) -> None:
        self._state.in_flight = self._publish(strategy, claim)
        self._state.turn += 1

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
        if (settled := self._state.settled) is not None:
            self._state.settled = None
            self._ack(settled.batch, settled.outcome)

    def _keeps_ack(self, batch: _InFlight, outcome: PublishOutcome) -> bool:
        """Whether this settled batch's ack goes with the next claim: the relay is paced (that claim comes within
        the linger if commits wait for it; if none does, the ack goes alone before the relay waits), Kafka took all of
        it, and its strategy acks and claims in one statement. The next batch is never published before it."""
        strategies = self.sessions.strategies()
        return (
            batch.strategy.folds_ack
            and not outcome.failed
            and bool(outcome.delivered)
            and self._pacer.pause_s() > 0
            and strategies[self._state.turn % len(strategies)] is batch.strategy
        )

    def _acked(self, batch: _InFlight, outcome: PublishOutcome, result: AckResult, ack_started: float) -> BatchMetrics:
        publish_s = (batch.settled_at or ack_started) - batch.started
        self.instruments.acked_batch(publish_s, time.monotonic() - ack_started, outcome, result)
        self.publisher.retain_transactional(batch.strategy.transactional_ids())
        metrics = self.stats.record(batch.strategy.name, batch.claim, outcome, result, batch.started)
        if self.observer is not None:
            self.observer(outcome)
        return metrics
