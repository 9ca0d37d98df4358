"""A run's plan, made from ``random.Random(seed)`` alone: the setup (database encoding, ack mode, batch size) and a
list of timed nemesis and operator events. The same seed, strategy and length give the same schedule, so a failure
is replayed by its seed; ``Schedule.render()`` prints it.

The actions themselves live in nemesis.py (processes, network, servers) and operators.py (the operator's CLI); each
registers with ``action(...)`` here, naming its lane, weight and the strategies it applies to, so adding one is one
function. Events of one lane never overlap: one server fault at a time, one fault per worker slot at a time, one
operator command at a time (a drain lasts its ``--max-seconds``, a switch of strategy its allowance).

A ``switch-strategy`` event names the strategy (and ack mode) it switches to, drawn here from ``switch_targets``;
the events after it are drawn for that strategy (a rewind only while a position strategy relays).

``wal`` (issue 42) is a strategy of its own: no rows, one streamer per replication slot. An action applies to it only
when it says so (``strategies=ALL`` or ``WAL_ONLY``): the table strategies' catalogue, and so their seeds'
schedules, are the same with or without it. It switches to nothing (``outbox switch-strategy`` does not know it).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

TABLE_STRATEGIES = ("locking", "advisory", "lease", "partitioned", "serialized")
WAL = "wal"
STRATEGIES = (*TABLE_STRATEGIES, WAL)
ALL = frozenset(STRATEGIES)  # an action that applies to every strategy, wal too
WAL_ONLY = frozenset({WAL})
POSITION_STRATEGIES = frozenset({"partitioned", "serialized"})
ROW_STRATEGIES = frozenset({"locking", "advisory", "lease"})
Lane = Literal["server", "worker", "operator"]
SWITCH = "switch-strategy"  # the operator action that changes the strategy (and so which actions apply)

WARMUP_S = 2.0  # no event before this: the workers start their producers, the writers their first rows
COOLDOWN_S = 1.0  # nor this close to the end
MEAN_GAP_S = 1.5  # mean time between events (exponential)
LONG_MESSAGE_TIMEOUT_MS = 120_000  # wal: a producer's message.timeout.ms in some seeds (Setup.message_timeout_ms)


@dataclass(frozen=True)
class Setup:
    """What a run is made of besides its events."""

    strategy: str
    seconds: float
    workers: int
    lease_s: float
    batch_size: int  # the relays' batch (wal: the streamer's batch_max)
    encoding: Literal["UTF8", "LATIN1"]
    mode: Literal["delete", "mark-sent"]  # row strategies: what an ack does (mark-sent allows `outbox replay`)
    bad_rate: float  # share of writer transactions that carry one bad row
    pause_s: float  # each writer's mean pause between transactions: 0.05 a steady load, 0.01 a busy one
    # wal: the relays' producers' message.timeout.ms (relays.py), long in some seeds: a thawed streamer's batch
    # still goes out after a takeover (edges.py: stale-thaw). None: relays.MESSAGE_TIMEOUT_MS
    message_timeout_ms: int | None = None

    def __str__(self) -> str:
        return (
            f"strategy={self.strategy} seconds={self.seconds:.0f} workers={self.workers} lease_s={self.lease_s:g} "
            f"batch={self.batch_size} encoding={self.encoding} mode={self.mode} bad_rate={self.bad_rate:g} "
            f"pause_s={self.pause_s:g}"
        ) + ("" if self.message_timeout_ms is None else f" message_timeout_ms={self.message_timeout_ms}")


@dataclass(frozen=True)
class Relaying:
    """What relays the outbox: a strategy and, for a row strategy, what an ack does (position strategies: delete)."""

    strategy: str
    mode: Literal["delete", "mark-sent"] = "delete"

    def __str__(self) -> str:
        return self.strategy if self.strategy in POSITION_STRATEGIES else f"{self.strategy}/{self.mode}"

    def applies(self, spec: ActionSpec) -> bool:
        """Whether an action is for this strategy (and ack mode)."""
        return self.strategy in spec.strategies and spec.row_mode in (None, self.mode)


def switch_targets(setup: Setup, strategy: str) -> tuple[str, ...]:
    """The strategies a run may switch to from ``strategy``: those its writers suit. They cannot change mid-run and
    enqueue with ``serialized=True`` only in a run that began ``serialized`` (docs/operations.md, step 1), so a run
    that began with another strategy moves among partitioned, locking, advisory and lease, and one that began
    serialized among all five (its writers' rows keep serialized's promise whatever relays them). A wal outbox
    switches to nothing, and nothing switches to wal."""
    if strategy == WAL:
        return ()
    table = TABLE_STRATEGIES
    reachable = table if setup.strategy == "serialized" else tuple(s for s in table if s != "serialized")
    return tuple(s for s in reachable if s != strategy)


def switch_to(setup: Setup, strategy: str, choice: int) -> Relaying:
    """The target a switch event's seeded ``choice`` picks: a strategy, and for a row strategy its ack mode."""
    targets = switch_targets(setup, strategy)
    target = targets[choice % len(targets)]
    mode: Literal["delete", "mark-sent"] = "mark-sent" if target in ROW_STRATEGIES and choice >> 8 & 1 else "delete"
    return Relaying(target, mode)


@dataclass(frozen=True)
class Event:
    """``choice`` is a seeded number the action uses to pick among what it finds then (a dead letter, a
    partition), so the pick is replayed too whenever the state it picks from is the same."""

    at_s: float
    action: str
    slot: int | None = None
    duration_s: float = 0.0
    choice: int = 0
    to: Relaying | None = None  # switch-strategy: the strategy and ack mode it switches to

    def __str__(self) -> str:
        slot = "" if self.slot is None else f" slot={self.slot}"
        duration = f" for {self.duration_s:.2f}s" if self.duration_s else ""
        to = "" if self.to is None else f" to={self.to}"
        return f"{self.at_s:7.2f}s {self.action}{slot}{duration}{to} choice={self.choice}"


@dataclass(frozen=True)
class Schedule:
    seed: int
    setup: Setup
    events: tuple[Event, ...]
    # chosen (ci.py): the events after a switch of strategy are timed from its planned end and wait for its actual
    # one, so that they meet the new strategy's relays however long the switch took (the run lasts until they ran)
    chosen: bool = False

    def render(self) -> str:
        return "\n".join([f"seed={self.seed} {self.setup}", *(f"  {e}" for e in self.events)])


@dataclass(frozen=True)
class ActionSpec:
    """How the schedule draws an action: its lane, relative weight, the strategies it applies to and, for an action
    that lasts, its duration."""

    name: str
    lane: Lane
    weight: float
    strategies: frozenset[str] = frozenset(TABLE_STRATEGIES)
    duration: Callable[[random.Random, Setup], float] | None = None
    row_mode: str | None = None  # only with this ack mode (row strategies), e.g. mark-sent for `outbox replay`


@dataclass(frozen=True)
class Registered:
    spec: ActionSpec
    run: Callable[[Any, Event], str]  # (the run's context, the event) -> a note for the timeline


@dataclass
class Registry:
    """Name -> action; nemesis.py and operators.py each fill one with ``@registry.action(...)``."""

    actions: dict[str, Registered] = field(default_factory=dict)

    def action(
        self,
        lane: Lane,
        weight: float,
        *,
        strategies: frozenset[str] = frozenset(TABLE_STRATEGIES),
        duration: Callable[[random.Random, Setup], float] | None = None,
        row_mode: str | None = None,
    ) -> Callable[[Callable[[Any, Event], str]], Callable[[Any, Event], str]]:
        def register(fn: Callable[[Any, Event], str]) -> Callable[[Any, Event], str]:
            name = fn.__name__.replace("_", "-")
            self.actions[name] = Registered(ActionSpec(name, lane, weight, strategies, duration, row_mode), fn)
            return fn

        return register


def make_setup(rng: random.Random, strategy: str, seconds: float, workers: int, lease_s: float) -> Setup:
    return Setup(
        strategy=strategy,
        seconds=seconds,
        workers=workers,
        lease_s=lease_s,
        batch_size=rng.choice((20, 50, 100)),
        encoding="LATIN1" if rng.random() < 0.3 else "UTF8",
        mode="mark-sent" if strategy in ROW_STRATEGIES and rng.random() < 0.5 else "delete",
        bad_rate=rng.choice((0.005, 0.01)),
        pause_s=rng.choice((0.05, 0.05, 0.01)),
        message_timeout_ms=LONG_MESSAGE_TIMEOUT_MS if strategy == WAL and rng.random() >= 0.7 else None,
    )


def make_schedule(
    seed: int,
    strategy: str,
    catalogue: Mapping[str, Registered],
    *,
    seconds: float,
    workers: int = 2,
    lease_s: float = 5.0,
) -> Schedule:
    """The setup and events of one run, from ``random.Random(seed)`` alone."""
    rng = random.Random(seed)
    setup = make_setup(rng, strategy, seconds, workers, lease_s)
    relaying = Relaying(strategy, setup.mode)
    free_at: dict[tuple[str, int | None], float] = {}  # lane (and slot) -> when its last event ends
    events: list[Event] = []
    t = WARMUP_S
    end = seconds - COOLDOWN_S
    while True:
        t += rng.expovariate(1 / MEAN_GAP_S)
        if t >= end:
            break
        specs = [catalogue[name].spec for name in sorted(catalogue) if relaying.applies(catalogue[name].spec)]
        spec = rng.choices(specs, [s.weight for s in specs])[0]
        slot = rng.randrange(workers) if spec.lane == "worker" else None
        duration = round(spec.duration(rng, setup), 2) if spec.duration else 0.0
        choice = rng.randrange(1 << 30)
        lane = (spec.lane, slot)
        start = max(t, free_at.get(lane, 0.0))
        if start + duration > end:
            continue  # the lane is busy until too late: drop it (the draws above keep the sequence seeded)
        free_at[lane] = start + duration + 0.5
        to = switch_to(setup, relaying.strategy, choice) if spec.name == SWITCH else None
        relaying = to or relaying
        events.append(Event(round(start, 2), spec.name, slot, duration, choice, to))
    return Schedule(seed, setup, tuple(sorted(events, key=lambda e: (e.at_s, e.action, e.slot or 0))))


def chosen_schedule(
    seed: int,
    strategy: str,
    catalogue: Mapping[str, Registered],
    events: tuple[Event, ...],
    *,
    seconds: float,
    workers: int = 2,
    lease_s: float = 5.0,
) -> Schedule:
    """A schedule whose events are chosen (ci.py), its setup drawn from the seed: each event must be an action of
    the catalogue for what relays at its time (a switch changes it), within the run and its lane free by then."""
    setup = make_setup(random.Random(seed), strategy, seconds, workers, lease_s)
    relaying = Relaying(strategy, setup.mode)
    free_at: dict[tuple[str, int | None], float] = {}
    for event in sorted(events, key=lambda e: e.at_s):
        spec = catalogue[event.action].spec
        lane = (spec.lane, event.slot)
        assert relaying.applies(spec), f"{event}: not for {relaying}"
        assert (spec.lane == "worker") == (event.slot is not None) and (event.slot or 0) < workers, str(event)
        assert WARMUP_S <= event.at_s and event.at_s + event.duration_s <= seconds - COOLDOWN_S, str(event)
        assert free_at.get(lane, 0.0) <= event.at_s, f"{event}: its lane is busy until {free_at[lane]:.2f}s"
        free_at[lane] = event.at_s + event.duration_s + 0.5
        relaying = event.to or relaying
    return Schedule(seed, setup, tuple(sorted(events, key=lambda e: (e.at_s, e.action, e.slot or 0))), True)
