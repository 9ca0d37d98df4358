"""Stand-ins for the table relay loop's seams (relay/loop.py's ``Sessions``, ``Publisher`` and a ``Strategy``), so that
the loop's decisions are tested in milliseconds without any server. They keep one shared log of what happened, in
order: ``("claim", ids)``, ``("start", ids)``, ``("finish", ids)``, ``("ack", ids)``, ``("fold", ids)`` (an ack made
in the next claim's statement), ``("give-back", ids)``, ``("wait", seconds)`` and ``("notify", ...)``."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import ClassVar

from outbox_pipeline.model import AckResult, Claim, DeliveryFailure, OutboxRecord, PublishOutcome
from outbox_pipeline.relay import PendingBatch, Relay, RelaySettings
from outbox_pipeline.strategies import Strategy, StrategyConfig

Log = list[tuple[str, object]]


def record(n: int) -> OutboxRecord:
    return OutboxRecord(n, "t", b"k", b"{}", "{}", b"m", str(n).encode(), 0, None, 0, "1", 0, False)


def ids(records: Iterable[OutboxRecord]) -> tuple[int, ...]:
    return tuple(r.id for r in records)


class RecordingStop(threading.Event):
    """The relay's stop event; every wait is logged and returns at once (a back-off or a pause costs no time)."""

    def __init__(self, log: Log) -> None:
        super().__init__()
        self.log = log

    def wait(self, timeout: float | None = None) -> bool:
        self.log.append(("wait", timeout))
        return self.is_set()


class FakeStrategy(Strategy):
    """Rows 1..n to publish, ``limit`` at a time; what is not acked as delivered goes back to the front."""

    name = "fake"
    ordered = True

    def __init__(self, log: Log, rows: int, *, visible: bool = True) -> None:  # no super(): there is no connection
        self.config = StrategyConfig()
        self.log = log
        self.todo: deque[OutboxRecord] = deque(record(n) for n in range(1, rows + 1))
        self.visible = visible  # what commits_visible answers
        self.fail_claims: list[Exception] = []  # raised by the next claims, first one first

    def claim(self, limit: int, avoid: Collection[int] = ()) -> Claim | None:
        if self.fail_claims:
            raise self.fail_claims.pop(0)
        taken = [self.todo.popleft() for _ in range(min(limit, len(self.todo)))]
        self.log.append(("claim", ids(taken)))
        return Claim(taken) if taken else None

    def ack(self, claim: Claim, outcome: PublishOutcome) -> AckResult:
        self.log.append(("ack", ids(claim.records)))
        self.todo.extendleft(reversed([f.record for f in outcome.failed]))
        return AckResult(acked=len(outcome.delivered))

    def give_back(self, claim: Claim, error: str) -> None:
        self.log.append(("give-back", ids(claim.records)))
        self.todo.extendleft(reversed(claim.records))

    def commits_visible(self) -> bool:
        return self.visible


class FoldingStrategy(FakeStrategy):
    """Acks a settled batch in the next claim's statement (Strategy.folds_ack)."""

    folds_ack: ClassVar[bool] = True

    def ack_and_claim(self, limit: int, previous: Claim, outcome: PublishOutcome) -> tuple[AckResult, Claim | None]:
        self.log.append(("fold", ids(previous.records)))
        return super().ack_and_claim(limit, previous, outcome)


class FakeSessions:
    """The loop's database side: its strategy, and NOTIFYs as scripted. ``wakes``: how each idle wait ends (True: at a
    NOTIFY, False: at its poll); ``announced``: whether commits were announced at each look before a claim (after
    the script: none); the ``stop_after_waits``-th idle wait sets ``stop``."""

    def __init__(
        self,
        log: Log,
        strategy: FakeStrategy,
        stop: threading.Event,
        *,
        wakes: Sequence[bool] = (),
        announced: Sequence[bool] = (),
        stop_after_waits: int | None = None,
    ) -> None:
        self.config = StrategyConfig()
        self.registered = threading.Event()
        self.log = log
        self.strategy = strategy
        self.stop = stop
        self.wakes = list(wakes)
        self.announcements = list(announced)
        self.waits_left = stop_after_waits
        self.listening = True
        self.disconnects: list[bool] = []  # deregister, per disconnect

    def strategies(self) -> list[Strategy]:
        self.registered.set()
        return [self.strategy]

    def upkeep(self) -> bool | None:
        return None

    def announced(self) -> bool:
        return self.announcements.pop(0) if self.announcements else False

    def wait_for_work(self, timeout_s: float) -> bool:
        woken = self.wakes.pop(0) if self.wakes else False
        self.log.append(("notify" if woken else "poll", timeout_s))
        self._waited()
        return woken

    def stand_by(self, timeout_s: float) -> None:
        self.log.append(("stand-by", timeout_s))
        self._waited()

    def _waited(self) -> None:
        if self.waits_left is not None:
            self.waits_left -= 1
            if self.waits_left <= 0:
                self.stop.set()

    def pending(self) -> bool:
        return bool(self.strategy.todo)

    def explain_pending(self) -> list[str]:
        return [f"{len(self.strategy.todo)} rows"] if self.strategy.todo else []

    def disconnect(self, *, deregister: bool = False) -> None:
        self.disconnects.append(deregister)


class FakePublisher:
    """Kafka that confirms everything, except the first ``down`` batches, of which it takes nothing (the transport)."""

    def __init__(self, log: Log, down: int = 0, on_finish: Callable[[], None] | None = None) -> None:
        self.log = log
        self.down = down
        self.on_finish = on_finish
        self.closed = False

    def warm_up(self) -> None:
        pass

    def start(self, records: Sequence[OutboxRecord], until: float = math.inf) -> PendingBatch:
        self.log.append(("start", ids(records)))
        return PendingBatch(records, time.monotonic())

    def finish(self, pending: PendingBatch) -> PublishOutcome:
        self.log.append(("finish", ids(pending.records)))
        if self.on_finish is not None:
            self.on_finish()
        if self.down > 0:
            self.down -= 1
            return PublishOutcome([], [DeliveryFailure(r, "broker down", "transport") for r in pending.records])
        return PublishOutcome(pending.records, [])

    def publish_transactions(
        self,
        records: Sequence[OutboxRecord],
        transactional_ids: Mapping[tuple[str, int], str],
        still_owns: Callable[[tuple[str, int]], bool] | None = None,
    ) -> PublishOutcome:
        raise NotImplementedError

    def retain_transactional(self, ids: frozenset[str] | None) -> None:
        pass

    def close(self, timeout_s: float = 10.0) -> None:
        self.closed = True


def fake_relay(
    log: Log,
    strategy: FakeStrategy,
    publisher: FakePublisher,
    *,
    wakes: Sequence[bool] = (),
    announced: Sequence[bool] = (),
    stop_after_waits: int | None = None,
    **settings: object,
) -> tuple[Relay, FakeSessions]:
    """A relay over the fakes (FakeSessions says what the other arguments script); ``settings`` override
    RelaySettings. Waits cost no time (RecordingStop): a 5 s max_seconds bounds a test that would loop."""
    stop = RecordingStop(log)
    sessions = FakeSessions(log, strategy, stop, wakes=wakes, announced=announced, stop_after_waits=stop_after_waits)
    fields: dict[str, object] = {"batch_size": 2, "max_seconds": 5.0, "min_cycle_s": 0.0, **settings}
    relay = Relay(sessions, publisher, RelaySettings(**fields), stop)  # type: ignore[arg-type]
    return relay, sessions
