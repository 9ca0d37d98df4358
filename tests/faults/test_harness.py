"""The harness (tests/harness/, docs/faults.md "The harness") in CI: a short seeded schedule of faults and operator
actions per strategy against the real PostgreSQL and broker, with fixed seeds, and one more run with a seed drawn
from today's date (printed, so that a red one can be replayed with ``python -m tests.harness``); `make test` runs
the chosen schedules of tests/harness/ci.py instead (every strategy it relays meets each kind of fault while it
relays), `make test-nightly` the seeds. Each run checks
every promise of the ledger (tests/harness/ledger.py): nothing lost or invented, per-key order, duplicates in their
bound, bad rows refused or dead-lettered, holds with their dead letters, no partition silent past ``lease_s`` plus a
steal while a worker could serve it, no password in any output; partitioned's schedule switches strategy midway,
wal's freezes its streamer past the takeover time and kills the relay that took over. Timing: the silence bound is a
measured time."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import ci
from tests.harness.ci import ci_schedule
from tests.harness.cluster import Servers
from tests.harness.nemesis import KILL_WHILE_CUT
from tests.harness.relays import MESSAGE_TIMEOUT_MS
from tests.harness.run import ACTIONS, Result, run, schedule_for
from tests.harness.schedule import STRATEGIES, SWITCH, Event, Relaying, Schedule

from .helpers import report

pytestmark = [pytest.mark.faults, pytest.mark.timing]

SECONDS = 20.0
FIXED_SEEDS = {"locking": 159, "advisory": 538, "lease": 337, "partitioned": 286, "serialized": 176, "wal": 777}
# `make test` runs the chosen schedules of tests/harness/ci.py (partitioned, switching to advisory; wal); the six
# seeds' drawn schedules and today's seed are `make test-nightly`'s (about four minutes that `make test`'s 20 could
# not hold).
IN_MAKE_TEST = tuple(ci.EVENTS)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """One PostgreSQL and one broker for the module's runs (each run has a database and topics of its own)."""
    with Servers(tmp_path_factory.mktemp("harness")) as started:
        yield started


def _figures(result: Result) -> None:
    f = result.verdict.figures
    report(
        "harness",
        result.schedule.setup.strategy,
        messages=int(str(f["committed"])),
        lost=int(str(f["lost"])),
        phantom=int(str(f["phantom"])),
        dupes=int(str(f["dupes"])),
        seconds=result.seconds,
        seed=result.schedule.seed,
        events=len(result.schedule.events),
        bound=f["dupe_bound"],
        longest_silence=f["longest_silence"],
        dead_letters=f["dead_letters"],
    )


def _stretches(schedule: Schedule) -> list[tuple[str, list[Event]]]:
    """The schedule's events by the strategy that relays when they come (a switch starts a stretch)."""
    stretches: list[tuple[str, list[Event]]] = [(schedule.setup.strategy, [])]
    for event in schedule.events:
        if event.to is not None:
            stretches.append((event.to.strategy, []))
        else:
            stretches[-1][1].append(event)
    return stretches


@pytest.mark.parametrize("strategy", ci.FAULT_SCHEDULES)
def test_every_strategy_a_ci_schedule_relays_meets_kafka_cut_off_a_kill_while_cut_off_a_frozen_broker_and_restarts(
    strategy: str,
) -> None:
    """Each stretch of a CI schedule: a worker cut off from Kafka past the producers' message timeout (its messages
    fail) and killed while still cut off (a batch in flight when the relay dies), a frozen broker, a server fault."""
    schedule = ci_schedule(strategy, ACTIONS)
    for relaying, events in _stretches(schedule):
        actions = {e.action for e in events}
        assert {"kafka-cut", "broker-freeze"} <= actions, (relaying, actions)
        assert actions & {"pg-restart", "terminate-backends"}, (relaying, actions)
        cuts = [e for e in events if e.action == "kafka-cut" and e.choice & KILL_WHILE_CUT]
        assert cuts and all(e.duration_s > 2 * MESSAGE_TIMEOUT_MS / 1000 for e in cuts), (relaying, cuts)


def test_the_ci_schedules_freeze_a_worker_past_its_lease_or_takeover_and_switch_strategy() -> None:
    for strategy in ci.FAULT_SCHEDULES:
        schedule = ci_schedule(strategy, ACTIONS)
        first = _stretches(schedule)[0][1]
        assert any(e.action == "freeze" and e.duration_s > schedule.setup.lease_s for e in first), strategy
    assert [e.to for e in ci_schedule("partitioned", ACTIONS).events if e.action == SWITCH] == [
        Relaying("advisory", "mark-sent")
    ]


def test_each_ci_schedule_kills_the_broker_and_starts_it_again_while_a_relay_relays() -> None:
    """Issue 51: the broker as a nemesis, not only frozen (Apache Kafka keeps its log across the kill)."""
    for strategy in ci.FAULT_SCHEDULES:
        schedule = ci_schedule(strategy, ACTIONS)
        restarts = [e for e in schedule.events if e.action == "broker-restart"]
        assert restarts and all(e.at_s < schedule.setup.seconds - 5 for e in restarts), strategy


def test_the_wal_ci_schedule_ends_the_walsender_of_its_streamer_while_kafka_is_cut_off_from_it() -> None:
    """Slot 0 streams first (relays.py): the stream restarts while its batch waits for Kafka, then it is killed."""
    events = ci_schedule("wal", ACTIONS).events
    cut = next(e for e in events if e.action == "kafka-cut" and e.slot == 0)
    walsender = next(e for e in events if e.action == "terminate-backends" and e.choice % 2)

    assert cut.at_s < walsender.at_s < cut.at_s + cut.duration_s and cut.choice & KILL_WHILE_CUT


def test_the_wal_edges_ci_schedule_plays_every_edge_of_the_wal_lane_in_a_latin1_database() -> None:
    schedule = ci_schedule("wal-edges", ACTIONS)
    edges = {"storage-snapshot", "forged-emit", "replica-insert", "switch-from-wal", "sender-timeout", "stale-thaw"}

    assert edges <= {e.action for e in schedule.events}
    assert schedule.setup.strategy == "wal" and schedule.setup.encoding == "LATIN1"  # the UTF8-client writer writes


def test_a_seed_replays_the_same_schedule() -> None:
    for strategy in STRATEGIES:
        assert schedule_for(1234, strategy, 600) == schedule_for(1234, strategy, 600)
    assert schedule_for(1234, "partitioned", 600) != schedule_for(1235, "partitioned", 600)


@pytest.mark.parametrize("strategy", IN_MAKE_TEST)
def test_a_ci_schedule_of_faults_and_operator_actions_breaks_no_promise(
    strategy: str, servers: Servers, tmp_path: Path
) -> None:
    result = run(servers, ci_schedule(strategy, ACTIONS), tmp_path)
    _figures(result)
    assert result.verdict.ok, result.report()


@pytest.mark.nightly
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_short_seeded_schedule_of_faults_and_operator_actions_breaks_no_promise(
    strategy: str, servers: Servers, tmp_path: Path
) -> None:
    result = run(servers, schedule_for(FIXED_SEEDS[strategy], strategy, SECONDS), tmp_path)
    _figures(result)
    assert result.verdict.ok, result.report()


@pytest.mark.nightly
def test_todays_seed_breaks_no_promise(servers: Servers, tmp_path: Path) -> None:
    seed = int(dt.date.today().strftime("%Y%m%d"))
    strategy = STRATEGIES[seed % len(STRATEGIES)]
    print(
        f"today's harness seed: {seed} ({strategy}); replay: python -m tests.harness --strategy {strategy} "
        f"--seed {seed} --seconds {SECONDS:g}"
    )
    result = run(servers, schedule_for(seed, strategy, SECONDS), tmp_path)
    _figures(result)
    assert result.verdict.ok, result.report()
