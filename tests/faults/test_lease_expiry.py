"""Scenario 7: a worker hangs past its lease. Worker A publishes a batch and is frozen (SIGSTOP) before its ack;
its 2 s lease expires; worker B takes over and delivers everything, A's batch included (published again: each of
its rows arrives twice). When A is resumed
(SIGCONT) it must not ack or advance anything it no longer owns: its metrics count what it published as
published_but_ack_failed, and the rows (lease) or positions (partitioned, serialized) stay as B left them.
What A published is the duplicate price of an expired lease: its batch, and the next one it had already
claimed (the relay pipelines: it publishes that one before it acks the first and learns it lost the lease)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import OutboxTable
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import pending, positions, wait_until
from tests.kit.workers import WorkerProcess
from tests.kit.writer import write

from .helpers import IN_FLIGHT_BATCHES, POSITION_STRATEGIES, consume, report, tally

pytestmark = [pytest.mark.faults, pytest.mark.timing]

LEASE_S = 2.0
BATCH = 50
MESSAGES = 300


def _state(dsn: str, table: OutboxTable, strategy: str) -> object:
    """What an ack changes: positions for the ordered strategies, the rows' delivery state for `lease`."""
    with psycopg.connect(dsn, autocommit=True) as db:
        if strategy in POSITION_STRATEGIES:
            return {k: v.at for k, v in positions(db, table).items()}
        return db.execute(
            sql.SQL("SELECT id, sent_at, locked_by, attempts FROM {} ORDER BY id").format(table.messages)
        ).fetchall()


@pytest.mark.parametrize("strategy", ["lease", "partitioned", "serialized"])
def test_a_worker_frozen_past_its_lease_is_replaced_and_acks_nothing_when_it_wakes(
    strategy: str,
    dsn: str,
    outbox_tables: Callable[[str], OutboxTable],
    workers: Callable[..., WorkerProcess],
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    started = time.monotonic()
    table = outbox_tables(dsn)
    topic = new_topic()
    with psycopg.connect(dsn, autocommit=True) as db:
        set_topic_partitions(db, table, topic, 1)
    committed = write(dsn, table, topic, MESSAGES, serialized=strategy == "serialized")
    common = {
        "dsn": dsn,
        "table": table,
        "bootstrap": kafka.bootstrap_servers,
        "strategy": strategy,
        "batch_size": BATCH,
        # mark-sent keeps the lease strategy's rows, so a late ack would show on them
        "config": {"lease_s": LEASE_S, "mode": "mark-sent"},
        "settings": {"until_empty": True},
    }
    hung = workers("hung", stop_after_publish=1, **common).start()
    hung.wait_for("its first publish, then the freeze", lambda ev: any(e.step == "frozen" for e in ev))
    assert hung.alive()
    [(published_by_hung,)] = {e.numbers[:1] for e in hung.events() if e.step == "delivered"}
    claimed_at = next(e.t for e in hung.events() if e.step == "claim-begin")

    rescuer = workers("rescuer", **{**common, "settings": {"until_empty": False}}).start()
    wait_until("the rescuer to deliver everything", lambda: pending(dsn, table, strategy) == 0, 60)
    took_over_at = next(e.t for e in rescuer.events() if e.step == "claim" and e.numbers[0] > 0)
    assert rescuer.terminate() == 0, rescuer.log()
    before_thaw = _state(dsn, table, strategy)

    hung.thaw()
    assert hung.wait(30) == 0, hung.log()
    late = [e.numbers for e in hung.events() if e.step == "acked"]
    after_thaw = _state(dsn, table, strategy)
    hung_stats, rescuer_stats = hung.stats(), rescuer.stats()

    records = consume(kafka.bootstrap_servers, [topic], committed)
    result = tally(committed, records)
    copies = Counter(r.headers["message_id"].decode() for r in records)
    report(
        "lease-expiry",
        strategy,
        **result.figures,
        seconds=time.monotonic() - started,
        lease=f"{LEASE_S:.0f}s",
        frozen_batch=published_by_hung,
        published_after_thaw=hung_stats["published"] - published_by_hung,
        published_but_ack_failed=hung_stats["lost_ownership"],
        rescuer_published=rescuer_stats["published"],
        takeover_after=f"{took_over_at - claimed_at:.1f}s",
    )
    assert published_by_hung == BATCH
    assert late and all(acked == 0 for acked, *_ in late), f"late acks (acked, lost, retried, dead): {late}"
    assert BATCH <= hung_stats["published"] <= IN_FLIGHT_BATCHES * BATCH, hung_stats
    assert hung_stats["lost_ownership"] == hung_stats["published"], "the resumed worker acked something"
    assert after_thaw == before_thaw, "the resumed worker changed rows or positions it no longer owned"
    assert rescuer_stats["lost_ownership"] == 0
    assert not result.lost and not result.phantom, result.figures
    # The rescuer publishes the frozen batch again (the first BATCH rows: one transaction, claimed in id order), and
    # everything after it: nothing the frozen worker published counts as done.
    published_once = [m for m in committed[:BATCH] if copies[m] < 2]
    assert not published_once, f"{len(published_once)} rows of the frozen batch were not published again"
    assert rescuer_stats["published"] == MESSAGES, rescuer_stats
    assert result.dupes <= hung_stats["published"], "only what the expired worker published may arrive twice"
    if strategy in POSITION_STRATEGIES:
        # The partition was leased to the frozen worker: nobody may read it before the lease ran out.
        assert took_over_at - claimed_at >= LEASE_S, "the partition was taken before the lease expired"
