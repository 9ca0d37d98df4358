"""`demo.load`, the bulk loader behind `outbox load` and `outbox bench`: what lands in the table."""

from __future__ import annotations

import psycopg
from psycopg import sql

from outbox_pipeline.config import OutboxTable
from outbox_pipeline.localstack.demo import load


def test_load_commits_every_rows_per_transaction_rows_like_services_would(
    dsn: str, table: OutboxTable, db: psycopg.Connection
) -> None:
    load(dsn, table, 250, topics=("orders",), keys=7, rows_per_transaction=100)

    sizes = db.execute(
        sql.SQL("SELECT count(*) FROM {} GROUP BY transaction_id ORDER BY min(id)").format(table.messages)
    ).fetchall()
    assert [n for (n,) in sizes] == [100, 100, 50]


def test_load_without_rows_per_transaction_is_one_transaction(
    dsn: str, table: OutboxTable, db: psycopg.Connection
) -> None:
    load(dsn, table, 250, topics=("orders", "payments"), keys=7)

    row = db.execute(
        sql.SQL("SELECT count(*), count(DISTINCT transaction_id), count(DISTINCT topic) FROM {}").format(table.messages)
    ).fetchone()
    assert row == (250, 1, 2)
