"""A transaction held open on the outbox's database during a latency scenario (`--hold-open SECONDS`), as a forgotten
psql session holds one. See docs/performance.md#how-the-latency-bench-measures."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import sql

from ...config import OutboxTable

APPLICATION_NAME = "outbox bench: a transaction held open"


@contextmanager
def transaction_held_open(dsn: str, table: OutboxTable) -> Iterator[psycopg.Connection]:
    """A session whose transaction has written a row and stays open until the block ends (or ``rollback()`` on the
    connection it yields); its table sits in the outbox's schema, dropped with it."""
    held_in = table.ident("bench_open_transaction")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (at timestamptz NOT NULL)").format(held_in))
    with psycopg.connect(dsn, application_name=APPLICATION_NAME) as conn:
        conn.execute(sql.SQL("INSERT INTO {} VALUES (clock_timestamp())").format(held_in))
        try:
            yield conn
        finally:
            conn.rollback()
