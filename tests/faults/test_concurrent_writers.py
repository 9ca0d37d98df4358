"""Scenario 5: 50 concurrent writers, a fifth of their transactions rolled back (and some savepoints), while two
relay worker processes drain. Nothing rolled back may ever be published; everything committed must be.
Each strategy's writers use its enqueue form (`serialized=True` for `serialized`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg
import pytest

from outbox_pipeline import OutboxTable
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import pending, wait_until
from tests.kit.workers import WorkerProcess
from tests.kit.writer import Writer

from .helpers import STRATEGIES, consume, report, tally

pytestmark = pytest.mark.faults

WRITERS = 50
TRANSACTIONS = 10  # per writer
PER_TX = 2
ROLLBACK_EVERY = 5  # 20 % of transactions
SAVEPOINT_ROLLBACK_EVERY = 3


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_50_writers_with_rollbacks_only_committed_messages_are_published(
    strategy: str,
    dsn: str,
    outbox_tables: Callable[[str], OutboxTable],
    workers: Callable[..., WorkerProcess],
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    started = time.monotonic()
    table = outbox_tables(dsn)
    topic = new_topic(partitions=4)
    with psycopg.connect(dsn, autocommit=True) as db:
        set_topic_partitions(db, table, topic, 4)
    relays = [
        workers(f"relay{n}", dsn=dsn, table=table, bootstrap=kafka.bootstrap_servers, strategy=strategy).start()
        for n in range(2)
    ]
    writers = [
        Writer(
            dsn,
            table,
            topic,
            serialized=strategy == "serialized",
            name=str(n),
            keys=16,
            per_tx=PER_TX,
            transactions=TRANSACTIONS,
            rollback_every=ROLLBACK_EVERY,
            savepoint_rollback_every=SAVEPOINT_ROLLBACK_EVERY,
        )
        for n in range(WRITERS)
    ]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
        w.check()
    committed = [m for w in writers for m in w.committed]
    rolled_back = {m for w in writers for m in w.rolled_back}
    wait_until("everything committed to be delivered", lambda: pending(dsn, table, strategy) == 0, 60)
    for relay in relays:
        assert relay.terminate() == 0, relay.log()

    records = consume(kafka.bootstrap_servers, [topic], committed)
    result = tally(committed, records)
    published_rolled_back = rolled_back & {r.headers["message_id"].decode() for r in records}
    report(
        "rollbacks-50-writers",
        strategy,
        **result.figures,
        seconds=time.monotonic() - started,
        writers=WRITERS,
        transactions=WRITERS * TRANSACTIONS,
        rolled_back=len(rolled_back),
        published_rolled_back=len(published_rolled_back),
        relays=len(relays),
    )
    assert len(committed) == WRITERS * (TRANSACTIONS - TRANSACTIONS // ROLLBACK_EVERY) * PER_TX
    assert not published_rolled_back, f"{len(published_rolled_back)} rolled-back messages were published"
    assert not result.phantom and not result.lost, result.figures
    assert result.dupes == 0, "no fault here, so no duplicates either"
