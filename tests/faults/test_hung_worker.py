"""Issue 40 case 7: a hung worker's home partition is taken by a busy worker within ``lease_s``. Two position workers
share a topic of 2 partitions; worker "b" is busy at home (a backlog that outlasts the scenario), worker "a" is
frozen with SIGSTOP for four leases while rows keep arriving in its home partition. Its session (and so its liveness
lock) lives on, so the reaper never frees what it held: its lease must run out and its stale heartbeat must take it
out of the deal, and "b", although busy, must serve the partition. The longest wait of a row written during the
freeze is bounded by the lease plus one deal and one steal, not by the freeze."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable

import psycopg
import pytest

from outbox_pipeline import Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.observe import partition_lag
from outbox_pipeline.store import set_topic_partitions
from outbox_pipeline.strategies.positions import DEAL_INTERVAL_S, STEAL_AFTER_S
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import pending, wait_until
from tests.kit.workers import WorkerProcess

from .helpers import POSITION_STRATEGIES, consume, report, tally

pytestmark = [pytest.mark.faults, pytest.mark.timing]

LEASE_S = 2.0
FROZEN_S = 4 * LEASE_S
# "b"'s home backlog: more than it relays in the scenario, so every claim of "b" finds work at home.
BACKLOG = 40_000
WRITE_EVERY_S = 0.1
# The lease runs out, the stale heartbeat leaves the deal (looked at every DEAL_INTERVAL_S), a claim takes it.
BOUND_S = LEASE_S + DEAL_INTERVAL_S + STEAL_AFTER_S + 1.0


def _pending_in(dsn: str, table: OutboxTable, strategy: str, partition: int) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return sum(p.pending for p in partition_lag(conn, table, strategy) if p.partition == partition)


@pytest.mark.parametrize("strategy", sorted(POSITION_STRATEGIES))
def test_a_frozen_workers_home_partition_is_served_by_a_busy_worker_within_the_lease(
    strategy: str,
    dsn: str,
    outbox_tables: Callable[[str], OutboxTable],
    workers: Callable[..., WorkerProcess],
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    started = time.monotonic()
    table = outbox_tables(dsn)
    topic = new_topic(partitions=2)
    serialized = strategy == "serialized"
    committed: list[str] = []
    with psycopg.connect(dsn, autocommit=True) as db:
        set_topic_partitions(db, table, topic, 2)
        # "a" (first by id) is dealt partition 0, "b" partition 1.
        for chunk in range(0, BACKLOG, 5_000):
            rows = [Message(topic, {"n": n}, key=f"b{n % 16}", partition=1) for n in range(chunk, chunk + 5_000)]
            committed += [str(e.message_id) for e in enqueue_many(db, rows, serialized=serialized, table=table)]
        rows = [Message(topic, {"n": n}, key="a", partition=0) for n in range(10)]
        committed += [str(e.message_id) for e in enqueue_many(db, rows, serialized=serialized, table=table)]
    common = {
        "dsn": dsn,
        "table": table,
        "bootstrap": kafka.bootstrap_servers,
        "strategy": strategy,
        "batch_size": 5,  # small batches: "b" stays busy at home longer than the scenario
        "config": {"lease_s": LEASE_S},
    }
    a, b = workers("a", **common).start(), workers("b", **common).start()
    a.wait_for("a to be dealt partition 0", lambda ev: any(e.step == "home" and e.numbers == (0,) for e in ev))
    b.wait_for("b to be dealt partition 1", lambda ev: any(e.step == "home" and e.numbers == (1,) for e in ev))
    wait_until("a to relay its home partition", lambda: _pending_in(dsn, table, strategy, 0) == 0, 30)

    a.freeze()
    frozen_at = time.time()
    try:
        with psycopg.connect(dsn) as db:
            while time.time() - frozen_at < FROZEN_S:
                written = enqueue(db, topic, {"n": -1}, key="a", partition=0, serialized=serialized, table=table)
                db.commit()
                committed.append(str(written.message_id))
                time.sleep(WRITE_EVERY_S)  # the writers' rhythm, not a wait for a condition
        still_busy = _pending_in(dsn, table, strategy, 1)
    finally:
        a.thaw()
    thawed_at = time.time()
    wait_until("everything to be relayed", lambda: pending(dsn, table, strategy) == 0, 120, interval_s=0.5)
    a.request_stop()
    b.request_stop()
    assert a.wait(30) == 0, a.log()
    assert b.wait(30) == 0, b.log()

    records = consume(kafka.bootstrap_servers, [topic], committed)
    result = tally(committed, records)
    first: dict[str, float] = {}
    for r in records:
        if r.partition == 0:
            oid = r.headers["outbox_id"].decode()
            first[oid] = min(first.get(oid, float("inf")), r.timestamp_ms / 1000)
    waits = []
    for r in records:
        created = dt.datetime.fromisoformat(r.headers["created_at"].decode().replace("Z", "+00:00")).timestamp()
        if r.partition == 0 and frozen_at <= created <= thawed_at:
            waits.append(first[r.headers["outbox_id"].decode()] - created)
    longest = max(waits, default=float("nan"))
    report(
        "hung-worker",
        strategy,
        **result.figures,
        seconds=time.monotonic() - started,
        lease=f"{LEASE_S:.0f}s",
        frozen=f"{FROZEN_S:.0f}s",
        rows_written_frozen=len(waits),
        longest_wait=f"{longest:.2f}s",
        busy_backlog_left=still_busy,
    )
    assert not result.lost and not result.phantom, result.figures
    assert still_busy > 0, "b ran out of work at home before the freeze ended: the scenario did not keep it busy"
    assert waits, "no row written during the freeze arrived"
    assert longest <= BOUND_S, f"a row of the frozen worker's partition waited {longest:.2f} s (bound {BOUND_S} s)"
