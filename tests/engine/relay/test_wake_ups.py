"""How an idle relay hears of commits (wakeups.py): a NOTIFY wakes it, and those that arrive while it works are dropped
before its next claim."""

from __future__ import annotations

import select
import threading

import psycopg

from outbox_pipeline import OutboxTable, enqueue
from outbox_pipeline.relay import WakeUps
from tests.kit.probes import wait_until


def _listening(dsn: str, table: OutboxTable) -> tuple[psycopg.Connection, WakeUps]:
    conn = psycopg.connect(dsn, autocommit=True)
    wake_ups = WakeUps(table, threading.Event())
    wake_ups.listen(conn)
    assert wake_ups.coalesce(conn) == 0  # nothing committed yet
    return conn, wake_ups


def _commit_rows(dsn: str, table: OutboxTable, commits: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as writer:
        for n in range(commits):
            enqueue(writer, "wake-ups", {"n": n}, table=table)


def test_commits_made_while_the_relay_worked_are_dropped_before_its_claim(dsn: str, table: OutboxTable) -> None:
    conn, wake_ups = _listening(dsn, table)
    with conn:
        _commit_rows(dsn, table, 3)
        dropped = [0]

        def all_three_dropped() -> bool:  # each NOTIFY reaches the socket in its own time
            dropped[0] += wake_ups.coalesce(conn)
            return dropped[0] >= 3

        wait_until("three commits' NOTIFYs", all_three_dropped, 30)
        assert dropped[0] == 3
        assert wake_ups.coalesce(conn) == 0


def test_an_idle_relay_wakes_at_the_first_commit(dsn: str, table: OutboxTable) -> None:
    conn, wake_ups = _listening(dsn, table)
    with conn:
        woke = threading.Event()

        def wait() -> None:
            wake_ups.wait(conn, 60.0)
            woke.set()

        waiter = threading.Thread(target=wait)
        waiter.start()
        _commit_rows(dsn, table, 1)
        assert woke.wait(30.0), "no wake-up within 30 s of a commit (the wait is 60 s)"
        waiter.join()


def test_a_commit_heard_while_the_connection_ran_a_statement_counts_at_the_next_look(
    dsn: str, table: OutboxTable
) -> None:
    conn, wake_ups = _listening(dsn, table)
    with conn:
        _commit_rows(dsn, table, 1)
        readable, _, _ = select.select([conn.fileno()], [], [], 30.0)  # the NOTIFY reached the socket
        assert readable, "no NOTIFY within 30 s of a commit"
        conn.execute("SELECT 1")  # the relay's upkeep runs on this connection: psycopg reads the NOTIFY with its result
        assert wake_ups.coalesce(conn) == 1
        assert wake_ups.coalesce(conn) == 0
