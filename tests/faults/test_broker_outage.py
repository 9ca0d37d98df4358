"""Scenario 2: the broker goes away while relay worker processes run, then comes back.

Three outages: *unresponsive* (the broker process frozen with SIGSTOP: connections stay open, nothing is
answered), *unreachable* (the TCP proxy that is the broker's advertised address is cut: live connections
break, new ones are refused) and *crashed* (the broker killed -9 and started again on its log directory: Apache
Kafka only, Tansu's memory storage would come back empty). One worker process per strategy runs through the same
outage (each on its own outbox and topic) so the suite stays short. During the outage nothing may be acked (rows
and positions stay as they were), the workers must back off instead of spinning (claims and batches bounded by the
relay's backoff), and afterwards everything arrives.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import psycopg
import pytest

from outbox_pipeline import OutboxTable
from outbox_pipeline.localstack import LocalPostgres
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import dead_letters, pending, positions, unsent_ids, wait_until
from tests.kit.workers import Event, WorkerProcess, steps_between
from tests.kit.writer import write

from .conftest import ProxiedBroker
from .helpers import FAST_FAILING_PRODUCER, POSITION_STRATEGIES, STRATEGIES, consume, report, tally

pytestmark = [pytest.mark.faults, pytest.mark.timing]

OUTAGE_S = 4.0
# A healthy relay is publishing again within a few seconds (reconnect <= 0.5 s, backoffs <= 1 s).
RECOVERY_DEADLINE_S = 10.0
MESSAGES = 200
BATCH = 50
POLL_S = 0.2
ERROR_BACKOFF_S = 0.2  # the relay's error_backoff_base_s
RELAY_SETTINGS = {
    "listen": False,  # poll, so the claim bound below depends only on the relay's own intervals
    "poll_interval_s": POLL_S,
    "max_poll_interval_s": 1.0,
    "error_backoff_base_s": ERROR_BACKOFF_S,
    "error_backoff_max_s": 1.0,
}


class NotRecovered(AssertionError):
    """The relay did not resume by itself after the outage (it once kept a producer the broker had fenced)."""


def claim_bounds(seconds: float) -> tuple[int, int]:
    """(batches, claims) a relay may attempt in ``seconds`` of outage without spinning.

    After a batch Kafka accepted nothing of, the relay waits ``uniform(c/2, c)`` with ``c >= error_backoff_base_s``;
    after an empty claim it waits at least ``poll_interval_s``. So consecutive batches are at least
    ``base/2`` apart, and consecutive claims at least ``min(poll, base/2)``. (Publishing adds the producer's
    message timeout to every batch, which only lowers the real count.)
    """
    batches = 1 + int(seconds / (ERROR_BACKOFF_S / 2))
    claims = 1 + int(seconds / min(POLL_S, ERROR_BACKOFF_S / 2))
    return batches, claims


@dataclass
class Lane:
    """One strategy's worker, outbox and topic in the shared outage."""

    strategy: str
    dsn: str
    table: OutboxTable
    topic: str
    worker: WorkerProcess
    committed: list[str]
    during: list[str] = field(default_factory=list)
    snapshot: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    drained_at: float | None = None

    def pending(self) -> int:
        return pending(self.dsn, self.table, self.strategy)

    def acked_during_outage(self) -> str | None:
        """What the lane acked while Kafka could confirm nothing, or None."""
        with psycopg.connect(self.dsn, autocommit=True) as db:
            if dead_letters(db, self.table):
                return "rows were dead-lettered during the outage"
            if self.strategy in POSITION_STRATEGIES:
                now = {k: v.at for k, v in positions(db, self.table).items()}
                return None if now == self.snapshot else f"positions moved: {self.snapshot} -> {now}"
            acked = set(self.during) - unsent_ids(db, self.table)
        return f"{len(acked)} rows acked" if acked else None


def _failed_publishes(events: list[Event], start: float, end: float) -> int:
    """Publishes begun in [start, end] of which Kafka confirmed nothing (a frozen broker can make the delivery
    reports come later than message.timeout.ms)."""
    failed, began = 0, None
    for e in events:
        if e.step == "produce":
            began = e.t
        elif e.step == "delivered" and began is not None:
            failed += start <= began <= end and e.numbers[0] == 0
            began = None
    return failed


# A long outage: every lane fails the same rows several times over, more often than max_attempts allows.
# Failures of the transport never count toward it, so nothing may be dead-lettered (issue 13, case 1).
LONG_OUTAGE_S = 12.0
LONG_OUTAGE_MAX_ATTEMPTS = 3


@pytest.mark.parametrize("outage", ["freeze", "cut", "freeze-long", "kill"])
def test_broker_outage_backs_off_acks_nothing_then_resumes_and_loses_nothing(
    outage: str,
    dsn: str,
    module_pg: LocalPostgres,
    outbox_tables: Callable[[str], OutboxTable],
    workers: Callable[..., WorkerProcess],
    proxied_broker: ProxiedBroker,
) -> None:
    broker = proxied_broker.broker
    if outage == "kill" and not broker.durable:
        pytest.skip(f"{broker.name} loses its records when killed (memory storage): run with OUTBOX_TEST_BROKER=kafka")
    scenario = {
        "freeze": "broker-frozen",
        "cut": "broker-unreachable",
        "freeze-long": "broker-frozen-long",
        "kill": "broker-killed",
    }[outage]
    start_outage, end_outage = {
        "freeze": (broker.freeze, broker.thaw),
        "freeze-long": (broker.freeze, broker.thaw),
        "cut": (proxied_broker.proxy.cut, proxied_broker.proxy.restore),
        "kill": (broker.kill, broker.start),  # started again on the log directory it had
    }[outage]
    outage_s = LONG_OUTAGE_S if outage == "freeze-long" else OUTAGE_S
    limits = {"max_attempts": LONG_OUTAGE_MAX_ATTEMPTS} if outage == "freeze-long" else {}
    lanes: list[Lane] = []
    for strategy in STRATEGIES:
        # `locking` keeps a transaction open while it publishes (up to message.timeout.ms during the outage);
        # on a shared server that holds back `partitioned`'s snapshot rule, so it gets a server of its own.
        lane_dsn = module_pg.dsn if strategy == "locking" else dsn
        table = outbox_tables(lane_dsn)
        topic = proxied_broker.new_topic(strategy)
        with psycopg.connect(lane_dsn, autocommit=True) as db:
            set_topic_partitions(db, table, topic, 2)
        worker = workers(
            strategy,
            dsn=lane_dsn,
            table=table,
            bootstrap=proxied_broker.bootstrap,
            strategy=strategy,
            batch_size=BATCH,
            config={"backoff_base_s": 0.2, "backoff_max_s": 1.0, **limits},
            producer=FAST_FAILING_PRODUCER,
            settings=RELAY_SETTINGS,
        )
        committed = write(lane_dsn, table, topic, 20, serialized=strategy == "serialized")
        lanes.append(Lane(strategy, lane_dsn, table, topic, worker.start(), committed))
    # Warm: every worker connected and published, nothing pending, before the outage.
    for lane in lanes:
        wait_until(f"{lane.strategy} warm-up", partial(lambda lane: lane.pending() == 0, lane), 30)

    t0 = time.monotonic()
    start_outage()
    try:
        for lane in lanes:
            with psycopg.connect(lane.dsn, autocommit=True) as db:
                lane.snapshot = {k: v.at for k, v in positions(db, lane.table).items()}
            lane.during = write(lane.dsn, lane.table, lane.topic, MESSAGES, serialized=lane.strategy == "serialized")
            lane.committed += lane.during
        violations: dict[str, str] = {}
        while time.monotonic() - t0 < outage_s:
            for lane in lanes:
                if lane.strategy not in violations and (problem := lane.acked_during_outage()):
                    violations[lane.strategy] = problem
            time.sleep(0.2)  # sample the tables a few times over the outage
        t1 = time.monotonic()
    finally:
        end_outage()
    failed_publishes = {lane.strategy: _failed_publishes(lane.worker.events(), t0, t1) for lane in lanes}

    def all_drained() -> bool:
        for lane in lanes:
            if lane.drained_at is None and lane.pending() == 0:
                lane.drained_at = time.monotonic()
        return all(lane.drained_at is not None for lane in lanes)

    try:
        wait_until("every worker to drain after the outage", all_drained, RECOVERY_DEADLINE_S, interval_s=0.1)
    except AssertionError:
        pass  # reported per lane below, with the figures
    stuck = {lane.strategy: lane.pending() for lane in lanes if lane.drained_at is None}
    for lane in lanes:
        assert lane.worker.terminate() == 0, lane.worker.log()

    records = consume(
        proxied_broker.bootstrap, [lane.topic for lane in lanes], [m for ln in lanes for m in ln.committed]
    )
    batch_bound, claim_bound = claim_bounds(t1 - t0)
    failures, not_recovered = [], []
    for lane in lanes:
        result = tally(lane.committed, [r for r in records if r.topic == lane.topic])
        counts = steps_between(lane.worker.events(), t0, t1)
        stats = lane.worker.stats()
        report(
            scenario,
            lane.strategy,
            **result.figures,
            seconds=(lane.drained_at or time.monotonic()) - t0,
            outage=f"{t1 - t0:.1f}s",
            recovered=f"{lane.drained_at - t1:.1f}s" if lane.drained_at else "no",
            batches=counts["batch"],
            claims=counts["claim-begin"],
            bound=f"{batch_bound}/{claim_bound}",
            failed_publishes=failed_publishes[lane.strategy],
            dead_lettered=stats["dead_lettered"],
        )
        checks = {
            "acked during the outage": violations.get(lane.strategy),
            f"failed fewer than {LONG_OUTAGE_MAX_ATTEMPTS} publishes (max_attempts was not exhausted)": (
                outage == "freeze-long" and failed_publishes[lane.strategy] < LONG_OUTAGE_MAX_ATTEMPTS
            )
            or None,
            "claimed no batch during the outage (the outage was not exercised)": counts["batch"] == 0 or None,
            "spun during the outage": (counts["batch"] > batch_bound or counts["claim-begin"] > claim_bound) or None,
            "phantom": result.phantom and f"{len(result.phantom)} messages",
        }
        failures += [f"{lane.strategy}: {what}: {detail}" for what, detail in checks.items() if detail]
        recovery = {
            f"still {stuck.get(lane.strategy)} pending {RECOVERY_DEADLINE_S:.0f}s after the outage": (
                lane.strategy in stuck
            ),
            f"{len(result.lost)} messages lost": bool(result.lost),
            f"{stats['dead_lettered']} rows dead-lettered": bool(stats["dead_lettered"]),
        }
        errors = sorted(set(re.findall(r"\(first: (.*?)\); retried", lane.worker.log(50_000))))
        not_recovered += [
            f"{lane.strategy}: {what} (errors seen: {errors[-3:]})" for what, bad in recovery.items() if bad
        ]
    assert not failures, "\n".join(failures)
    if not_recovered:
        raise NotRecovered("\n".join(not_recovered))


def _pauses(events: list[Event]) -> list[float]:
    """Seconds from the ack of each batch Kafka accepted none of to the next claim."""
    pauses = []
    for i, ack in enumerate(events):
        if ack.step == "acked" and ack.numbers[0] == 0:
            following = next((e for e in events[i:] if e.step == "claim-begin"), None)
            if following is not None:
                pauses.append(round(following.t - ack.t, 2))
    return pauses


def test_while_kafka_fails_every_batch_the_relay_pauses_longer_after_each_one(
    dsn: str,
    outbox_tables: Callable[[str], OutboxTable],
    workers: Callable[..., WorkerProcess],
    kafka: KafkaProbe,
) -> None:
    """The relay's own error backoff, isolated: every publish fails fast (a topic that does not exist, auto-creation
    off, 200 ms message timeout: the broker answers, so the failure is quick to explain), failed rows back off for
    long (so each claim finds fresh rows), and the pauses between failed batches are the relay's ``uniform(c/2, c)``
    with ``c = base * 2**(failures - 1)``: the 4th is at least 4 x base."""
    table = outbox_tables(dsn)
    write(dsn, table, f"missing-{uuid.uuid4().hex[:10]}", 200, serialized=False)
    base = 0.2
    worker = workers(
        "backoff",
        dsn=dsn,
        table=table,
        bootstrap=kafka.bootstrap_servers,
        strategy="lease",
        batch_size=10,
        config={"backoff_base_s": 60.0, "backoff_max_s": 60.0},
        producer={"message.timeout.ms": 200, "allow.auto.create.topics": False},
        settings={**RELAY_SETTINGS, "error_backoff_base_s": base, "error_backoff_max_s": 10.0},
    ).start()
    worker.wait_for("4 failed batches and a claim after them", lambda ev: len(_pauses(ev)) >= 4, 60)
    assert worker.terminate() == 0, worker.log()
    pauses = _pauses(worker.events())[:4]
    print(f"relay pauses after failed batches 1..4: {pauses} s, lower bounds {[base / 2 * 2**k for k in range(4)]}")
    # (Before e034186 the relay reset its failure count after every batch: the pause never grew.)
    assert pauses[3] >= base / 2 * 2**3, f"the pause did not grow over 4 consecutive failed batches: {pauses} s"
