"""Property: whatever enqueue_many is given, it either stores exactly that or raises a clear error and
stores nothing (and the caller's transaction stays usable)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from psycopg import sql

from outbox_pipeline import InvalidMessageError, Message, OutboxTable, enqueue_many
from outbox_pipeline.store import decode_headers, init_db

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
payloads = json_values | st.sets(st.integers(), max_size=2) | st.builds(object) | st.binary(max_size=4)
topics = st.from_regex(r"[a-zA-Z0-9._-]{1,30}", fullmatch=True) | st.text(max_size=260)
header_values = st.text(max_size=8) | st.binary(max_size=8) | st.integers()
headers = st.none() | st.dictionaries(st.text(max_size=8) | st.integers(), header_values, max_size=3)
messages = st.builds(
    Message,
    topic=topics,
    payload=payloads,
    key=st.none() | st.text(max_size=12) | st.integers(),
    headers=headers,
    type=st.none() | st.text(max_size=12),
    priority=st.integers(min_value=-40000, max_value=40000),
    partition=st.none() | st.integers(min_value=-2, max_value=2**31),
)

# Mostly well-formed messages (text may still hold NUL or lone surrogates, payloads may be oversize),
# so that storing, not only rejecting, is exercised often.
plausible_messages = st.builds(
    Message,
    topic=st.from_regex(r"[a-zA-Z0-9._-]{1,30}", fullmatch=True),
    payload=json_values,
    key=st.none() | st.text(max_size=12),
    headers=st.none() | st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8) | st.binary(max_size=8)),
    type=st.none() | st.text(max_size=12),
    priority=st.integers(min_value=-32768, max_value=32767),
    partition=st.none() | st.integers(min_value=0, max_value=1000),
)


@pytest.fixture(scope="module")
def property_table(pg_server: Any) -> Iterator[OutboxTable]:
    table = OutboxTable(schema=f"p_{uuid.uuid4().hex[:10]}", max_message_bytes=2000)
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        init_db(conn, table)
    yield table
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(table.schema_ident))


def _normalise(value: Any) -> Any:
    """JSON semantics: numbers compare as decimals (jsonb stores numeric: 1e300 comes back as an int)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    if isinstance(value, list):
        return [_normalise(v) for v in value]
    return {k: _normalise(v) for k, v in value.items()}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(plausible_messages | messages, min_size=1, max_size=4))
def test_enqueue_many_stores_exactly_what_it_is_given_or_nothing(
    pg_server: Any, property_table: OutboxTable, batch: list[Message]
) -> None:
    table = property_table
    with psycopg.connect(pg_server.dsn) as conn:
        newest = conn.execute(sql.SQL("SELECT coalesce(max(id), 0) FROM {}").format(table.messages)).fetchone()
        assert newest is not None
        before = newest[0]
        try:
            results = enqueue_many(conn, batch, table=table)
        except InvalidMessageError as exc:
            event("rejected")
            assert str(exc).startswith("message "), "the error names the offending message"
            conn.execute("SELECT 1")  # the transaction is still usable
            conn.commit()
            after = conn.execute(sql.SQL("SELECT coalesce(max(id), 0) FROM {}").format(table.messages)).fetchone()
            assert after is not None and after[0] == before
            return
        event("stored")
        conn.commit()
        rows = conn.execute(
            sql.SQL(
                "SELECT id, topic, key, type, payload::text, payload_bytes, headers, partition, priority FROM {} "
                "WHERE id > %s ORDER BY id"
            ).format(table.messages),
            (before,),
        ).fetchall()
    assert [r[0] for r in rows] == [r.id for r in results]
    for message, row in zip(batch, rows, strict=True):
        _, topic, key, type_, payload, payload_bytes, stored_headers, partition, priority = row
        assert (topic, key, type_, priority) == (message.topic, message.key, message.type, message.priority)
        if isinstance(message.payload, bytes):  # bytes are stored as given, and only as bytes
            assert (payload, payload_bytes) == (None, message.payload)
        else:
            assert payload_bytes is None and _normalise(json.loads(payload)) == _normalise(message.payload)
        given_headers = {k: v.encode() if isinstance(v, str) else v for k, v in (message.headers or {}).items()}
        assert dict(decode_headers(stored_headers)) == given_headers
        if message.partition is not None:
            assert partition == message.partition
