"""Scenario 4: a long transaction stays open for the whole scenario while 4 writers commit around it.

`partitioned` reads only transactions older than every running one, so it stalls behind the long transaction
(as designed), then delivers everything, in (transaction_id, id) order per key, once it commits. The other
strategies deliver the writers' messages while it is still open, and its own messages after it commits.

For `serialized` the long transaction is a plain business transaction that does not enqueue: a serialized
enqueue holds the writers' lock until commit, so every other serialized writer would queue behind it (the
strategy's documented cost), and there would be nothing "around" it. Its reader is not held back by it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import pending, positions, wait_until
from tests.kit.relay import order_by_key
from tests.kit.workers import WorkerProcess
from tests.kit.writer import Writer, write

from .helpers import STRATEGIES, consume, report, tally

pytestmark = pytest.mark.faults

WRITERS = 4
PER_WRITER = 100
BEFORE = 40
LONG_TX_ROWS = 10


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_long_transaction_stalls_only_partitioned_and_everything_is_delivered_once_it_commits(
    strategy: str,
    dsn: str,
    outbox_tables: Callable[[str], OutboxTable],
    workers: Callable[..., WorkerProcess],
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    started = time.monotonic()
    serialized = strategy == "serialized"
    table = outbox_tables(dsn)
    topic = new_topic(partitions=2)
    with psycopg.connect(dsn, autocommit=True) as db:
        set_topic_partitions(db, table, topic, 4)
        db.execute(sql.SQL("CREATE TABLE {}.business (id int PRIMARY KEY)").format(table.schema_ident))
    worker = workers(
        "relay",
        dsn=dsn,
        table=table,
        bootstrap=kafka.bootstrap_servers,
        strategy=strategy,
        settings={"max_poll_interval_s": 0.5},  # idle, it looks again at least this often (besides NOTIFY)
    ).start()
    committed = write(dsn, table, topic, BEFORE, serialized=serialized)
    wait_until("the rows committed before it to be delivered", lambda: pending(dsn, table, strategy) == 0, 30)
    with psycopg.connect(dsn, autocommit=True) as db:
        before = {k: v.at for k, v in positions(db, table).items()}

    with psycopg.connect(dsn) as long_tx:
        # It writes first, so it has the oldest transaction id of the scenario.
        long_tx.execute(sql.SQL("INSERT INTO {}.business VALUES (1)").format(table.schema_ident))
        long_rows: list[str] = []
        if not serialized:
            messages = [Message(topic, {"long": i}, key=f"k{i % 8}") for i in range(LONG_TX_ROWS)]
            long_rows = [str(w.message_id) for w in enqueue_many(long_tx, messages, table=table)]
        opened = time.monotonic()
        writers = [
            Writer(dsn, table, topic, serialized=serialized, name=str(n), per_tx=2, total=PER_WRITER)
            for n in range(WRITERS)
        ]
        for w in writers:
            w.start()
        for w in writers:
            w.join(60)
            w.check()
        around = [m for w in writers for m in w.committed]
        if strategy == "partitioned":
            # Stalled: it looked again after the last commit (NOTIFY woke it) and found nothing to read.
            writers_done = time.monotonic()
            worker.wait_for(
                "two empty claims after the writers' commits",
                lambda ev: sum(1 for e in ev if e.step == "claim" and e.numbers == (0,) and e.t > writers_done) >= 2,
            )
            assert not [e for e in worker.events() if e.step == "produce" and e.t > opened], "published past it"
            with psycopg.connect(dsn, autocommit=True) as db:
                assert {k: v.at for k, v in positions(db, table).items()} == before
        else:
            wait_until("the writers' rows to be delivered", lambda: pending(dsn, table, strategy) == 0, 30)
        commit_ms = int(time.time() * 1000)
        long_tx.commit()
    committed += long_rows + around
    wait_until("everything to be delivered", lambda: pending(dsn, table, strategy) == 0, 30)
    assert worker.terminate() == 0, worker.log()

    records = consume(kafka.bootstrap_servers, [topic], committed)
    result = tally(committed, records)
    around_set = set(around)
    around_records = [r for r in records if r.headers["message_id"].decode() in around_set]
    while_open = sum(1 for r in around_records if r.timestamp_ms <= commit_ms)
    order_ok: bool | None = None
    if strategy in ("partitioned", "serialized"):
        with psycopg.connect(dsn, autocommit=True) as db:
            rows = db.execute(
                sql.SQL("SELECT id, transaction_id::text::bigint, key FROM {}").format(table.messages)
            ).fetchall()
        sort_key = (lambda r: (r[1], r[0])) if strategy == "partitioned" else (lambda r: r[0])
        expected: dict[bytes, list[int]] = {}
        for oid, _, key in sorted(rows, key=sort_key):
            expected.setdefault(key.encode(), []).append(oid)
        order_ok = order_by_key(records) == expected
    report(
        "long-transaction",
        strategy,
        **result.figures,
        seconds=time.monotonic() - started,
        held_open=f"{time.monotonic() - opened:.1f}s",
        writers=WRITERS,
        around=len(around),
        delivered_while_open=while_open,
        long_tx_rows=len(long_rows),
        order="ok" if order_ok else ("n/a" if order_ok is None else "WRONG"),
    )
    assert not result.lost and not result.phantom and result.dupes == 0, result.figures
    if strategy == "partitioned":
        assert while_open == 0, "partitioned published rows of transactions younger than the open one"
    else:
        assert while_open == len(around), f"only {while_open} of {len(around)} delivered while it was open"
    assert order_ok is not False, "per-key Kafka order differs from the strategy's promised order"
