"""Partition upkeep in the engine (no Spark): rescuing DEFAULT rows under concurrent writers, the
archive fingerprint over every column, and the retention floor."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import OutboxTable
from outbox_pipeline.operate.maintenance import (
    ARCHIVE_COLUMNS,
    default_rows_by_day,
    expired,
    fingerprint,
    move_default_rows,
)
from outbox_pipeline.store import DEFAULT_PARTITION, ensure_partitions, init_db, partition_name

LATE_DAY = dt.date(2020, 2, 3)  # no partition that far back: rows for it land in DEFAULT
LATE_START = dt.datetime.combine(LATE_DAY, dt.time(), dt.UTC)


def _insert_late_rows(db: psycopg.Connection, table: OutboxTable, count: int, offset: int = 0) -> None:
    db.execute(
        sql.SQL(
            """
            INSERT INTO {messages} (topic, key, payload, partition, created_at)
            SELECT 't', 'k', jsonb_build_object('n', g), 0, %(start)s::timestamptz + make_interval(secs => g / 1000.0)
            FROM generate_series(%(first)s::int, %(last)s::int) g
            """
        ).format(messages=table.messages),
        {"start": LATE_START, "first": offset + 1, "last": offset + count},
    )


def _rows_of_day(db: psycopg.Connection, table: OutboxTable) -> int:
    row = db.execute(sql.SQL("SELECT count(*) FROM {}").format(table.ident(partition_name(LATE_DAY)))).fetchone()
    return int(row[0]) if row else 0


def test_rescuing_default_rows_under_concurrent_writers_moves_every_row_and_never_fails(
    dsn: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    """A writer keeps committing rows for the rescued day while the rescue runs. A row committed between
    the move and the ATTACH used to fail the ATTACH (CheckViolation), every run; now writers wait."""
    _insert_late_rows(db, table, 100_000)
    stop, written = threading.Event(), [100_000]

    def write() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                _insert_late_rows(conn, table, 1, offset=written[0])
                written[0] += 1

    writer = threading.Thread(target=write)
    writer.start()
    try:
        rescue = move_default_rows(db, table, lock_timeout="30s")
    finally:
        stop.set()
        writer.join()
    assert rescue.failed == {}
    assert written[0] > 100_000, "the writer committed nothing during the rescue"
    assert default_rows_by_day(db, table) == {}, "rows written after the rescue went to DEFAULT"
    assert _rows_of_day(db, table) == written[0]


def test_a_day_whose_rows_cannot_be_locked_is_reported_and_the_other_days_are_moved(
    dsn: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    """A long transaction still writing keeps the rescue from its lock: that day waits for the next run."""
    _insert_late_rows(db, table, 10)
    with psycopg.connect(dsn) as writer:  # a BEGIN left open
        writer.execute(sql.SQL("SELECT 1 FROM {} LIMIT 0").format(table.messages))
        writer.execute(sql.SQL("LOCK TABLE {} IN ROW EXCLUSIVE MODE").format(table.messages))
        rescue = move_default_rows(db, table, lock_timeout="200ms")
        assert list(rescue.failed) == [LATE_DAY] and "LockNotAvailable" in rescue.failed[LATE_DAY]
        assert default_rows_by_day(db, table) == {LATE_DAY: 10}
    assert move_default_rows(db, table).moved == {LATE_DAY: 10}


CHANGES = {
    "message_id": "message_id = gen_random_uuid()",
    "topic": "topic = 'u'",
    "key": "key = 'other'",
    "type": "type = 'changed'",
    "payload": "payload = '{{\"n\": -1}}'",  # braces doubled: these go through sql.SQL.format
    "headers": 'headers = \'{{"h": "v"}}\'',
    "payload_bytes": "payload = NULL, payload_bytes = '\\x01'",  # a JSON payload that became bytes
    "partition": "partition = 1",
    "priority": "priority = 5",
    "transaction_id": "transaction_id = '1'::xid8",
    "created_at": "created_at = created_at + interval '1 microsecond'",
    "available_after": "available_after = available_after + interval '1 microsecond'",
    "locked_by": "locked_by = 'w'",
    "attempts": "attempts = 3",
    "last_error": "last_error = 'boom'",
    "sent_at": "sent_at = now()",
}


def test_every_archived_column_has_a_change_case() -> None:
    assert set(CHANGES) == {name for name, _ in ARCHIVE_COLUMNS} - {"id"}


@pytest.mark.parametrize("column", sorted(CHANGES))
def test_the_archive_fingerprint_changes_when_any_column_changes(
    column: str, db: psycopg.Connection, table: OutboxTable, connect: Callable[[], psycopg.Connection]
) -> None:
    _insert_late_rows(db, table, 3)
    default = table.ident(DEFAULT_PARTITION)
    db.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT IF EXISTS outbox_messages_topic_valid").format(table.messages))
    before = fingerprint(db, table, DEFAULT_PARTITION)
    db.execute(
        sql.SQL("UPDATE {} SET " + CHANGES[column] + " WHERE id = (SELECT min(id) FROM {})").format(default, default)
    )
    after = fingerprint(db, table, DEFAULT_PARTITION)
    assert after.rows == before.rows and after.checksum != before.checksum, f"a change of {column} went unnoticed"


def test_a_retention_below_one_day_is_refused() -> None:
    with pytest.raises(ValueError, match="retention_days must be at least 1"):
        expired([], dt.date(2026, 11, 24), 0)


def test_rows_in_default_for_a_day_entering_the_create_ahead_window_get_their_partition_from_init_db_and_maintenance(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    """Issue 40, case 9: maintenance did not run for longer than days_ahead, so rows of a day past the window landed
    in DEFAULT; once that day enters the window, every init-db and maintenance run failed to create its partition
    ("run partition maintenance to move them first": maintenance itself created before it moved)."""
    today = dt.datetime.now(dt.UTC).date()
    late_day = today + dt.timedelta(days=3)
    ensure_partitions(db, table, days_ahead=1, today=today)
    db.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table.ident(partition_name(late_day))))
    late = dt.datetime.combine(late_day, dt.time(12), dt.UTC)
    inserted = db.execute(
        sql.SQL(
            "INSERT INTO {} (topic, key, payload, partition, created_at) VALUES ('t', 'k', '{{}}', 0, %s) "
            "RETURNING id, message_id::text, transaction_id::text"
        ).format(table.messages),
        (late,),
    ).fetchone()
    assert inserted is not None
    assert default_rows_by_day(db, table) == {late_day: 1}

    init_db(db, table, today=today + dt.timedelta(days=1))  # late_day is now in the window
    ensure_partitions(db, table, today=today + dt.timedelta(days=2))  # maintenance's create_ahead, again

    assert default_rows_by_day(db, table) == {}
    where = db.execute(
        sql.SQL("SELECT tableoid::regclass::text, id, message_id::text, transaction_id::text FROM {}").format(
            table.messages
        )
    ).fetchall()
    assert where == [(f"{table.schema}.{partition_name(late_day)}", *inserted)]  # the row itself, in its own day
