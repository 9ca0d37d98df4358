"""Scenario 1: a relay worker process is killed with SIGKILL at random points, again and again, while a
writer keeps writing; each time it is restarted with the same worker id. Nothing may be lost or invented,
and the duplicates are bounded by what each killed run had published and not acked: at most one batch per
kill (the relay may hold a second claim, read ahead, but hands it to Kafka only after the ack)."""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial

import psycopg
import pytest

from outbox_pipeline import OutboxTable
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import pending, wait_until
from tests.kit.workers import Event, WorkerProcess
from tests.kit.writer import Writer, write

from .helpers import IN_FLIGHT_BATCHES, STRATEGIES, consume, report, tally

pytestmark = pytest.mark.faults

KILLS = 10
BATCH = 50
# Written before each restart, so the worker is busy when the kill comes (it drains ~10k msg/s here).
BURST = 300
# The kill comes this long (uniformly drawn) after the restarted worker's first ack: in steady state, past
# the producer's connection set-up, anywhere in claim, produce, delivery, ack or idle.
MAX_KILL_DELAY_S = 0.05

# Where the worker was when SIGKILL landed, from the last step it logged.
_PHASE_OF_LAST_STEP = {
    "claim-begin": "claim",
    "claim": "produce",  # claimed (a 0-row claim is reclassified as idle below)
    "produce": "delivery",  # producing, waiting for every delivery report
    "delivered": "ack",  # Kafka confirmed, the ack has not started
    "ack-begin": "ack",
    "acked": "idle",
    "give-back": "idle",
    "start": "startup",
}


def _phase(run: list[Event]) -> str:
    last = run[-1]
    if last.step == "claim" and last.numbers == (0,):
        return "idle"
    return _PHASE_OF_LAST_STEP.get(last.step, last.step)


def _unacked(run: list[Event]) -> int:
    """Rows the run claimed and did not see acked (acks come in claim order): what a restart may publish again."""
    claimed = [e.numbers[0] for e in run if e.step == "claim" and e.numbers[0] > 0]
    acks = sum(1 for e in run if e.step == "acked")
    return sum(claimed[acks:])


def _run(events: list[Event], number: int) -> list[Event]:
    """The events of the worker's ``number``-th run (1-based; every run begins with `start`)."""
    starts = [i for i, e in enumerate(events) if e.step == "start"]
    if len(starts) < number:
        return []
    return events[starts[number - 1] : starts[number] if len(starts) > number else None]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sigkill_at_random_points_loses_nothing_and_duplicates_only_what_each_kill_left_unacked(
    strategy: str,
    dsn: str,
    outbox_tables: Callable[[str], OutboxTable],
    workers: Callable[..., WorkerProcess],
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    started = time.monotonic()
    seed = int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)
    table = outbox_tables(dsn)
    topic = new_topic(partitions=2)
    with psycopg.connect(dsn, autocommit=True) as db:
        set_topic_partitions(db, table, topic, 4)
    serialized = strategy == "serialized"
    committed: list[str] = []
    stop = threading.Event()
    writer = Writer(dsn, table, topic, serialized=serialized, per_tx=5, pause_s=0.02, stop=stop)
    victim = workers(
        "victim",
        dsn=dsn,
        table=table,
        bootstrap=kafka.bootstrap_servers,
        strategy=strategy,
        batch_size=BATCH,
        settings={"poll_interval_s": 0.05, "max_poll_interval_s": 0.5},
    )
    phases: Counter[str] = Counter()
    at_risk: list[int] = []
    writer.start()
    try:
        for _ in range(KILLS):
            committed += write(dsn, table, topic, BURST, serialized=serialized)
            run = victim.start().runs
            victim.wait_for("a first ack", partial(lambda run, ev: any(e.step == "acked" for e in _run(ev, run)), run))
            time.sleep(rng.uniform(0, MAX_KILL_DELAY_S))  # the fault: a kill at a random point of the loop
            victim.kill()
            phases[_phase(_run(victim.events(), run))] += 1
            at_risk.append(_unacked(_run(victim.events(), run)))
    finally:
        stop.set()
        writer.join(30)
    writer.check()
    committed += writer.committed

    # Restarted once more with the same id, it drains everything (PostgreSQL says when).
    victim.start()
    wait_until("the restarted worker to drain the outbox", lambda: pending(dsn, table, strategy) == 0, 60)
    assert victim.terminate() == 0, victim.log()
    final = victim.stats()
    records = consume(kafka.bootstrap_servers, [topic], committed)
    result = tally(committed, records)
    report(
        "kill-9",
        strategy,
        **result.figures,
        seconds=time.monotonic() - started,
        kills=KILLS,
        batch=BATCH,
        unacked_at_kill=f"{sum(at_risk)}(max {max(at_risk)})",
        phases=",".join(f"{k}:{v}" for k, v in sorted(phases.items())),
        seed=seed,
    )
    assert not result.lost, f"{len(result.lost)} committed messages never arrived (seed {seed})"
    assert not result.phantom, f"{len(result.phantom)} messages arrived that were never committed"
    assert result.dupes <= sum(at_risk), (
        f"{result.dupes} duplicates, more than the {sum(at_risk)} rows unacked at kills"
    )
    assert max(at_risk) <= IN_FLIGHT_BATCHES * BATCH, f"a killed run had {max(at_risk)} rows claimed and unacked"
    # The relay acks a batch before it hands the next to Kafka: at most one batch is published and
    # unacked when a worker dies, so each kill costs at most one batch of duplicates.
    assert result.dupes <= KILLS * BATCH, f"{result.dupes} duplicates for {KILLS} kills of batch {BATCH}"
    assert final["lost_ownership"] == 0  # the same id reclaims its own leases: nothing to lose
    assert sum(phases.values()) == KILLS
