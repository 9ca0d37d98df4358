"""While an older transaction holds every row back (``partitioned`` reads only transactions older than every running
one), the commits around it wake the relay for nothing: after a claim that found nothing it asks PostgreSQL only where
the snapshot's horizon is (Strategy.commits_visible), not to lease partitions and look for new ones at each commit (a
psql ``BEGIN`` left open over lunch cost the database 0.5 cores at 2,000 msg/s:
docs/performance-log.md#kafka-hold-open). Once the transaction ends, everything is claimed, in order."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import pq, sql

from outbox_pipeline import Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.store import set_topic_partitions
from outbox_pipeline.strategies import StrategyConfig, strategy_class

COMMITS = 20


@contextmanager
def statements_sent(conn: psycopg.Connection) -> Iterator[list[int]]:
    """How many statements ``conn`` sends to PostgreSQL meanwhile (libpq's protocol trace: a simple Query, or a Bind
    of the extended protocol, per statement); the count is in the list once the block ends."""
    counted: list[int] = []
    with tempfile.TemporaryFile("w+") as trace:
        conn.pgconn.trace(trace.fileno())
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            yield counted
        finally:
            conn.pgconn.untrace()
        trace.seek(0)
        counted.append(sum(1 for line in trace if line.startswith("F\t") and line.split("\t")[2] in ("Query", "Bind")))


def test_commits_behind_an_open_transaction_cost_the_worker_one_small_statement_each_until_it_ends(
    dsn: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    set_topic_partitions(db, table, "orders", 4)
    db.execute(sql.SQL("CREATE TABLE {}.business (id int PRIMARY KEY)").format(table.schema_ident))
    with psycopg.connect(dsn, autocommit=True) as conn:
        worker = strategy_class("partitioned")(conn, StrategyConfig(table=table, worker_id="w"))
        with psycopg.connect(dsn) as lunch:
            lunch.execute(sql.SQL("INSERT INTO {}.business VALUES (1)").format(table.schema_ident))
            written = [enqueue(db, "orders", {"n": 0}, key="k", table=table).id]
            assert worker.claim(100) is None  # held back by the transaction still open

            with statements_sent(conn) as sent:
                for n in range(1, COMMITS + 1):
                    written.append(enqueue(db, "orders", {"n": n}, key="k", table=table).id)
                    assert not worker.commits_visible()

            assert sent == [COMMITS]  # a look at the horizon each: no lease, no look for new partitions
        written += [w.id for w in enqueue_many(db, [Message("orders", {"n": "after"}, key="k")], table=table)]

        assert worker.commits_visible()
        claim = worker.claim(100)
        assert claim is not None and [r.id for r in claim.records] == written


def test_commits_are_visible_at_once_when_no_older_transaction_is_open(
    dsn: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    set_topic_partitions(db, table, "orders", 4)
    with psycopg.connect(dsn, autocommit=True) as conn:
        worker = strategy_class("partitioned")(conn, StrategyConfig(table=table, worker_id="w"))
        assert worker.claim(100) is None  # nothing written yet
        written = enqueue(db, "orders", {"n": 1}, key="k", table=table).id

        assert worker.commits_visible()
        claim = worker.claim(100)
        assert claim is not None and [r.id for r in claim.records] == [written]
