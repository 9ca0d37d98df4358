"""Enqueue API: stores exactly what it is given inside the caller's transaction, or raises a clear
error and stores nothing."""

from __future__ import annotations

import math
import threading
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from outbox_pipeline import InvalidMessageError, Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.partitioning import partition_for
from outbox_pipeline.store import decode_headers, set_topic_partitions


def _rows(conn: psycopg.Connection, table: OutboxTable) -> list[tuple[Any, ...]]:
    return conn.execute(
        sql.SQL(
            "SELECT id, message_id, topic, key, type, payload, headers, partition, priority FROM {} ORDER BY id"
        ).format(table.messages)
    ).fetchall()


def test_enqueue_in_a_committed_transaction_stores_the_message(db: psycopg.Connection, table: OutboxTable) -> None:
    with db.transaction():
        result = enqueue(
            db,
            "orders",
            {"order": 7, "total": 12.5, "name": "é☃"},
            key="customer-1",
            headers={"trace": "abc", "raw": b"\x00\xff"},
            type="order.created",
            priority=3,
            table=table,
        )
    [(oid, mid, topic, key, type_, payload, headers, _partition, priority)] = _rows(db, table)
    assert (oid, mid) == (result.id, result.message_id)
    assert (topic, key, type_, priority) == ("orders", "customer-1", "order.created", 3)
    assert payload == {"order": 7, "total": 12.5, "name": "é☃"}
    assert sorted(decode_headers(headers)) == [("raw", b"\x00\xff"), ("trace", b"abc")]


def test_enqueue_in_a_rolled_back_transaction_stores_nothing(db: psycopg.Connection, table: OutboxTable) -> None:
    with db.transaction(force_rollback=True):
        enqueue(db, "orders", {"n": 1}, key="k", table=table)
    assert _rows(db, table) == []


def test_enqueue_many_stores_all_messages_in_order_with_distinct_ids(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    with db.transaction():
        results = enqueue_many(db, [Message("orders", {"n": i}, key=f"k{i % 3}") for i in range(50)], table=table)
    rows = _rows(db, table)
    assert [r[5] for r in rows] == [{"n": i} for i in range(50)]
    assert [(r.id, r.message_id) for r in results] == [(r[0], r[1]) for r in rows]
    assert len({r.message_id for r in results}) == 50
    assert {r.message_id.version for r in results} == {4}


BAD_MESSAGES: list[tuple[str, Message, str]] = [
    ("payload not JSON-serialisable", Message("orders", {"s": {1, 2}}), "not JSON-serialisable"),
    ("payload is an object", Message("orders", object()), "not JSON-serialisable"),
    ("payload NaN", Message("orders", {"x": math.nan}), "not JSON-serialisable"),
    ("payload with NUL", Message("orders", {"x": "a\x00b"}), "NUL"),
    ("payload with lone surrogate", Message("orders", "\ud800"), "Unicode"),
    ("empty topic", Message("", {}), "non-empty"),
    ("topic not a string", Message(7, {}), "non-empty"),  # type: ignore[arg-type]
    ("topic a list", Message(["orders"], {}), "non-empty"),  # type: ignore[arg-type]
    ("topic with a space", Message("my topic", {}), "invalid Kafka topic"),
    ("topic with a slash", Message("a/b", {}), "invalid Kafka topic"),
    ("topic too long", Message("t" * 250, {}), "invalid Kafka topic"),
    ("topic '.'", Message(".", {}), "invalid Kafka topic"),
    ("topic '..'", Message("..", {}), "invalid Kafka topic"),
    ("headers not a mapping", Message("orders", {}, headers=[("a", "b")]), "mapping"),  # type: ignore[arg-type]
    ("header value an int", Message("orders", {}, headers={"a": 1}), "must be str or bytes"),  # type: ignore[dict-item]
    ("header name not a str", Message("orders", {}, headers={1: "a"}), "header names"),  # type: ignore[dict-item]
    ("reserved header", Message("orders", {}, headers={"message_id": "x"}), "reserved"),
    ("key not a string", Message("orders", {}, key=5), "key must be a string"),  # type: ignore[arg-type]
    ("priority out of range", Message("orders", {}, priority=40000), "priority"),
    ("negative partition", Message("orders", {}, partition=-1), "partition"),
]


@pytest.mark.parametrize(("case", "bad", "says"), BAD_MESSAGES, ids=[c for c, _, _ in BAD_MESSAGES])
def test_bad_input_raises_a_clear_error_and_writes_nothing(
    db: psycopg.Connection, table: OutboxTable, case: str, bad: Message, says: str
) -> None:
    with db.transaction():
        enqueue(db, "orders", {"before": True}, table=table)
        with pytest.raises(InvalidMessageError, match=says):
            enqueue_many(db, [Message("orders", {"good": 1}), bad], table=table)
        # The caller's transaction is still usable: nothing reached the server.
        enqueue(db, "orders", {"after": True}, table=table)
    assert [r[5] for r in _rows(db, table)] == [{"before": True}, {"after": True}]


def test_a_payload_over_the_configured_maximum_is_refused(db: psycopg.Connection, table: OutboxTable) -> None:
    """The maximum counts the relay's record, its own headers (about 150 bytes) too: test_record_size.py counts it
    exactly."""
    small = OutboxTable(schema=table.schema, max_message_bytes=1000)
    enqueue(db, "orders", "x" * 800, table=small)
    with pytest.raises(InvalidMessageError, match="over the maximum of 1000 bytes"):
        enqueue(db, "orders", "x" * 900, table=small)
    assert len(_rows(db, table)) == 1


def test_a_literal_backslash_u0000_text_is_not_mistaken_for_nul(db: psycopg.Connection, table: OutboxTable) -> None:
    enqueue(db, "orders", {"x": "\\u0000"}, table=table)
    assert _rows(db, table)[0][5] == {"x": "\\u0000"}


def test_virtual_partition_is_kafka_murmur2_of_the_key_modulo_the_topics_partitions(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    set_topic_partitions(db, table, "orders", 12)
    keys = [f"customer-{i}" for i in range(200)]
    enqueue_many(db, [Message("orders", {}, key=k) for k in keys], table=table)
    enqueue_many(db, [Message("payments", {}, key=k) for k in keys], table=table)  # default: 8 partitions
    stored = {(r[2], r[3]): r[7] for r in _rows(db, table)}
    assert all(stored[("orders", k)] == partition_for(k, 12) for k in keys)
    assert all(stored[("payments", k)] == partition_for(k, 8) for k in keys)


def test_messages_without_key_spread_over_all_partitions(db: psycopg.Connection, table: OutboxTable) -> None:
    enqueue_many(db, [Message("orders", {"n": i}) for i in range(400)], table=table)
    assert {r[7] for r in _rows(db, table)} == set(range(8))


def test_an_explicit_partition_is_kept(db: psycopg.Connection, table: OutboxTable) -> None:
    enqueue(db, "orders", {}, key="k", partition=42, table=table)
    assert _rows(db, table)[0][7] == 42


def _wait_until_blocked_on_advisory_lock(conn: psycopg.Connection, pid: int) -> None:
    for _ in range(200):
        row = conn.execute("SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
        if row == ("Lock", "advisory"):
            return
        conn.execute("SELECT pg_sleep(0.05)")
    raise AssertionError(f"backend {pid} never waited for the serialized-writer lock")


def test_serialized_writers_take_ids_in_commit_order(dsn: str, db: psycopg.Connection, table: OutboxTable) -> None:
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        first_result = enqueue(first, "orders", {"n": 1}, key="k", serialized=True, table=table)
        second_results: list[int] = []
        writer = threading.Thread(
            target=lambda: second_results.append(
                enqueue(second, "orders", {"n": 2}, key="k", serialized=True, table=table).id
            )
        )
        writer.start()
        _wait_until_blocked_on_advisory_lock(db, second.info.backend_pid)
        first.commit()
        writer.join()
        second.commit()
    assert second_results[0] > first_result.id


def test_plain_writers_do_not_wait_for_each_other(dsn: str, table: OutboxTable) -> None:
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        enqueue(first, "orders", {"n": 1}, table=table)
        second.execute("SET lock_timeout = '2s'")
        enqueue(second, "orders", {"n": 2}, table=table)  # would time out if it waited for `first`
        second.commit()
        first.rollback()


# A service's connection with its own defaults: ClientCursor binds on the client (PgBouncer in statement mode, say),
# dict_row is common. Neither may change what the outbox stores or returns.
SERVICE_CONNECTIONS: dict[str, dict[str, Any]] = {
    "cursors that bind on the client": {"cursor_factory": psycopg.ClientCursor},
    "rows that are dicts": {"row_factory": dict_row},
}


@pytest.mark.parametrize("options", SERVICE_CONNECTIONS.values(), ids=SERVICE_CONNECTIONS.keys())
def test_enqueue_works_whatever_the_service_connection_defaults(
    dsn: str, table: OutboxTable, options: dict[str, Any]
) -> None:
    with psycopg.connect(dsn, **options) as conn:
        results = enqueue_many(conn, [Message("orders", {"n": i}, key=f"k{i}") for i in range(3)], table=table)
        single = enqueue(conn, "orders", {"n": 3}, key="k3", table=table)
        conn.commit()
    with psycopg.connect(dsn) as conn:
        rows = _rows(conn, table)
    assert [(r[0], r[1], r[5]) for r in rows] == [
        *((r.id, r.message_id, {"n": i}) for i, r in enumerate(results)),
        (single.id, single.message_id, {"n": 3}),
    ]


def test_an_enqueue_many_too_big_for_one_statement_is_refused_before_sending_and_the_connection_lives(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    """Issue 40, case 27: about 1 GiB in one call passed PostgreSQL's limit of one protocol message, and the server
    ended the connection instead of the call failing with a reason."""
    blob = b"x" * 900_000  # one object, referenced by every message: the test allocates it once
    messages = [Message("orders", blob, key=f"k{i}") for i in range(1_250)]  # 1.125 GB together, past 1 GB

    with pytest.raises(InvalidMessageError, match="more than one statement can carry"):
        enqueue_many(db, messages, table=table)

    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(table.messages)).fetchone() == (0,)
    assert enqueue_many(db, messages[:2], table=table)  # the same session goes on
