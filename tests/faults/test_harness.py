"""The harness (tests/harness/, docs/faults.md "The harness") in CI: a short seeded schedule of faults and operator
actions per strategy against the real PostgreSQL and broker, with fixed seeds, and one more run with a seed drawn
from today's date (printed, so that a red one can be replayed with ``python -m tests.harness``); `make test` runs
two of the seeds, `make test-nightly` the rest. Each run checks
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

from tests.harness.cluster import Servers
from tests.harness.run import Result, run, schedule_for
from tests.harness.schedule import STRATEGIES, SWITCH

from .helpers import report

pytestmark = [pytest.mark.faults, pytest.mark.timing]

SECONDS = 20.0
FIXED_SEEDS = {"locking": 159, "advisory": 538, "lease": 337, "partitioned": 286, "serialized": 176, "wal": 777}
# `make test` runs the seeds that draw the switch of strategy (partitioned) and the wal lane's takeover; the other
# four, and today's seed, are `make test-nightly`'s (about four minutes that `make test`'s 20 could not hold).
IN_MAKE_TEST = frozenset({"partitioned", "wal"})


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


def test_a_ci_schedule_switches_strategy_midway() -> None:
    """The switch-strategy procedure runs in CI: the fixed seed of partitioned draws it (a new action in the
    catalogue changes every schedule: pick a seed that still draws it)."""
    switches = [
        e
        for strategy, seed in FIXED_SEEDS.items()
        for e in schedule_for(seed, strategy, SECONDS).events
        if e.action == SWITCH
    ]

    assert switches, "no CI schedule switches strategy"


def test_the_wal_ci_schedule_freezes_its_streamer_past_the_takeover_and_kills_the_relay_that_took_over() -> None:
    """Slot 0 streams first: its freeze past lease_s (wal's takeover time in the harness) hands the slot to slot 1,
    whose kill hands it back; a poison message needs the higher share of bad rows (a new action in the catalogue of
    wal changes its schedules: pick a seed that still draws these)."""
    schedule = schedule_for(FIXED_SEEDS["wal"], "wal", SECONDS)
    freeze = next(e for e in schedule.events if e.action == "freeze" and e.slot == 0)
    kill = next(e for e in schedule.events if e.action == "kill")

    assert freeze.duration_s > schedule.setup.lease_s and kill.slot == 1
    assert freeze.at_s < kill.at_s < freeze.at_s + freeze.duration_s
    assert schedule.setup.bad_rate == 0.01
    assert {"long-transaction", "pg-restart", "dead-letter-retry"} <= {e.action for e in schedule.events}


def test_a_seed_replays_the_same_schedule() -> None:
    for strategy in STRATEGIES:
        assert schedule_for(1234, strategy, 600) == schedule_for(1234, strategy, 600)
    assert schedule_for(1234, "partitioned", 600) != schedule_for(1235, "partitioned", 600)


@pytest.mark.parametrize(
    "strategy", [pytest.param(s, marks=() if s in IN_MAKE_TEST else pytest.mark.nightly) for s in STRATEGIES]
)
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
