"""Transactions with a snapshot of their own (REPEATABLE READ, SERIALIZABLE) on both sides of a partition-count
change: the change cannot pass a pending row its snapshot does not show, and a writer with only a writer's grants
can write in them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import OutboxTable, enqueue
from outbox_pipeline.schema import set_topic_partitions

SNAPSHOT_ISOLATIONS = ["REPEATABLE READ", "SERIALIZABLE"]
WAIT_S = 30.0


def _partition_count(db: psycopg.Connection, table: OutboxTable, topic: str) -> int | None:
    row = db.execute(sql.SQL("SELECT partitions FROM {} WHERE topic = %s").format(table.topics), (topic,)).fetchone()
    return None if row is None else int(row[0])


def _change_count(conn: psycopg.Connection, table: OutboxTable, topic: str, partitions: int) -> None:
    conn.execute(sql.SQL("UPDATE {} SET partitions = %s WHERE topic = %s").format(table.topics), (partitions, topic))


def _wait_until_it_waits_or_ends(db: psycopg.Connection, pid: int, ended: threading.Event) -> None:
    """Until the backend ``pid`` waits for a lock or its statement has ended (bounded)."""
    deadline = time.monotonic() + WAIT_S
    waiting = "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted)"
    while not ended.is_set() and not db.execute(waiting, (pid,)).fetchone()[0]:
        assert time.monotonic() < deadline, f"backend {pid} neither waited for a lock nor ended"
        time.sleep(0.01)


@pytest.mark.parametrize("isolation", SNAPSHOT_ISOLATIONS)
def test_a_partition_count_change_whose_snapshot_predates_a_pending_row_is_refused(
    isolation: str, db: psycopg.Connection, table: OutboxTable, connect: Callable[[], psycopg.Connection]
) -> None:
    """The guard counts the topic's pending rows in the change's snapshot: taken before a writer committed, it
    showed none, and the count changed under a pending row (one key in two partitions)."""
    set_topic_partitions(db, table, "orders", 8)
    change = connect()
    change.execute(f"BEGIN ISOLATION LEVEL {isolation}")
    change.execute("SELECT 1")  # its snapshot is taken
    enqueue(db, "orders", {"n": 1}, key="customer-1", table=table)  # committed, pending, not in that snapshot

    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="orders"):
        _change_count(change, table, "orders", 16)
    change.execute("ROLLBACK")
    assert _partition_count(db, table, "orders") == 8


@pytest.mark.parametrize("isolation", ["READ COMMITTED", *SNAPSHOT_ISOLATIONS])
def test_a_partition_count_change_begun_while_a_writer_is_in_flight_is_refused_in_any_isolation(
    isolation: str, db: psycopg.Connection, table: OutboxTable, connect: Callable[[], psycopg.Connection]
) -> None:
    """The change's statement takes its snapshot, then waits for the writer in flight: in REPEATABLE READ and
    SERIALIZABLE the row that writer committed meanwhile was not counted, and the count changed under it."""
    set_topic_partitions(db, table, "orders", 8)
    writer = connect()
    writer.execute("BEGIN")
    enqueue(writer, "orders", {"n": 1}, key="customer-1", table=table)
    change = connect()
    outcome: list[BaseException | None] = []
    ended = threading.Event()

    def run_change() -> None:
        try:
            change.execute(f"BEGIN ISOLATION LEVEL {isolation}")
            _change_count(change, table, "orders", 16)
            change.execute("COMMIT")
            outcome.append(None)
        except psycopg.Error as exc:
            change.execute("ROLLBACK")
            outcome.append(exc)
        ended.set()

    thread = threading.Thread(target=run_change)
    thread.start()
    _wait_until_it_waits_or_ends(db, change.info.backend_pid, ended)
    writer.execute("COMMIT")
    thread.join(WAIT_S)

    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], psycopg.errors.ObjectNotInPrerequisiteState), outcome
    assert _partition_count(db, table, "orders") == 8


@pytest.mark.parametrize("isolation", SNAPSHOT_ISOLATIONS)
def test_set_topic_partitions_changes_a_drained_topic_on_a_connection_whose_transactions_have_a_snapshot(
    isolation: str, dsn: str, table: OutboxTable
) -> None:
    """``init-db --topic`` on a database whose ``default_transaction_isolation`` is not READ COMMITTED."""
    level = psycopg.IsolationLevel[isolation.replace(" ", "_")]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.isolation_level = level
        conn.autocommit = False
        set_topic_partitions(conn, table, "orders", 16)
        conn.commit()
        assert _partition_count(conn, table, "orders") == 16
