"""The headers every relayed record carries, whoever wrote the row: here a plain-SQL writer choosing created_at."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import OutboxTable
from outbox_pipeline.model import STRATEGY_NAMES
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain, row_count

# Before and after PostgreSQL's own epoch (2000-01-01), a whole second, another time zone, and the infinities a
# plain-SQL writer may store (they land in the DEFAULT partition).
STAMPS = [
    "2026-11-25 16:05:21.123456+00",
    "2026-11-25 16:05:21+00",
    "1999-12-31 23:59:59.999999+00",
    "1970-01-01 00:00:00.000001+00",
    "2026-03-29 01:30:00.5+02",
    "infinity",
    "-infinity",
]
ISO_UTC = """to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')"""


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_created_at_arrives_as_iso_8601_utc_with_microseconds_and_infinity_by_name(
    strategy: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    set_topic_partitions(db, table, topic, 1)
    insert = sql.SQL("INSERT INTO {} (topic, key, payload, created_at) VALUES (%s, 'k', %s, %s) RETURNING id")
    expected: dict[bytes, bytes] = {}
    for n, stamp in enumerate(STAMPS):
        row = db.execute(insert.format(table.messages), (topic, f'{{"n": {n}}}', stamp)).fetchone()
        assert row is not None
        formatted = db.execute(
            sql.SQL("SELECT {} FROM {} WHERE id = %s").format(sql.SQL(ISO_UTC), table.messages), (row[0],)
        ).fetchone()
        assert formatted is not None
        # to_char has no text for the infinities (NULL); the header names them.
        expected[str(row[0]).encode()] = (formatted[0] or stamp).encode()

    stats = drain(db.info.dsn, table, kafka.bootstrap_servers, strategy)

    arrived = kafka.consume(topic, expect=len(STAMPS))
    assert {r.headers["outbox_id"]: r.headers["created_at"] for r in arrived} == expected
    assert stats.published == len(STAMPS)
    if strategy in ("partitioned", "serialized"):
        position = db.execute(sql.SQL("SELECT max(last_processed_id) FROM {}").format(table.offsets)).fetchone()
        assert position == (max(int(oid) for oid in expected),)
    else:
        assert row_count(db, table, "sent_at IS NULL") == 0
