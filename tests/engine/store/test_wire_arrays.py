"""Arrays enqueue_many builds in PostgreSQL's binary form arrive as the values they were built from."""

from __future__ import annotations

import uuid

import psycopg

from outbox_pipeline.store import wire_arrays


def _unnest(db: psycopg.Connection, query: str, array: wire_arrays.WireArray) -> list[object]:
    with db.cursor() as cur:
        wire_arrays.register(cur.adapters)
        return [value for (value,) in cur.execute(query, (array,), binary=True).fetchall()]


def test_a_text_array_keeps_each_value_its_order_and_its_nulls(db: psycopg.Connection) -> None:
    values = ["orders", "", None, "é☃ key", "x" * 300]
    array = wire_arrays.text_array([v.encode() if v is not None else None for v in values])
    assert _unnest(db, "SELECT unnest(%b::text[])", array) == values


def test_a_uuid_array_keeps_each_uuid(db: psycopg.Connection) -> None:
    ids = [uuid.uuid4() for _ in range(5)]
    array = wire_arrays.uuid_array(b"".join(u.bytes for u in ids))
    assert _unnest(db, "SELECT unnest(%b::uuid[])", array) == ids


def test_a_bigint_array_keeps_each_number(db: psycopg.Connection) -> None:
    numbers = [0, 1, -1, 2**31 - 1, 2**63 - 1, -(2**63)]
    assert _unnest(db, "SELECT unnest(%b::bigint[])", wire_arrays.int8_array(numbers)) == numbers


def test_a_bytea_array_keeps_each_value_byte_for_byte(db: psycopg.Connection) -> None:
    values = [b"", b"\x00\xff", "é☃".encode(), bytes(range(256)) * 4]
    assert _unnest(db, "SELECT unnest(%b::bytea[])", wire_arrays.bytea_array(values)) == values


def test_an_empty_array_is_an_array_with_no_elements(db: psycopg.Connection) -> None:
    assert _unnest(db, "SELECT cardinality(%b::text[])", wire_arrays.text_array([])) == [0]
