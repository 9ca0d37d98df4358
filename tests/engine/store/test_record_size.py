"""The size limit is the relay's record: what enqueue accepts (Python or SQL) the relay's producer takes, and a message
one byte larger is refused at enqueue, with its size and the limit.

The relay sends a JSON payload as PostgreSQL renders the jsonb (``{"a": 1, "b": [1, 2]}``, numbers as numeric prints
them), with its own headers (``message_id``, ``outbox_id``, ``created_at``, ``type``; CloudEvents attributes when on)
beside the row's, and librdkafka counts each header's lengths and a record's overhead against ``message.max.bytes``.
Every row here has an id of 19 digits (the outbox's sequence is moved there), the widest the relay ever sends, so the
record enqueue counted is byte for byte the one the relay sends.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from psycopg import sql
from psycopg.types.json import Jsonb

from outbox_pipeline import Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.errors import InvalidMessageError
from outbox_pipeline.localstack import LocalPostgres
from outbox_pipeline.store import (
    RESERVED_HEADERS,
    WIDEST_ID,
    CloudEvents,
    RecordHeaders,
    RecordLimit,
    init_db,
    record_bytes,
)
from outbox_pipeline.store.messages import validate
from outbox_pipeline.strategies import RECORD_COLUMNS, fetch_records
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain

LIMIT = 2000  # the producer's message.max.bytes (librdkafka's least is 1000) and enqueue's limit
FIRST_WIDE_ID = 10 ** (WIDEST_ID - 1)  # 19 digits, like every bigint id from here to 9223372036854775807


@dataclass(frozen=True)
class Shape:
    """A message whose size grows one byte with ``pad``."""

    kind: str  # "json" or "bytes"

    def message(self, topic: str, key: str, pad: int) -> Message:
        headers: dict[str, str | bytes] = {"trace": "t-1", "sig": b"\x00\x01\x02"}
        if self.kind == "bytes":
            return Message(topic, b"\x00" * pad, key=key, headers=headers, type="order.paid")
        # Separators that PostgreSQL's text adds a space to, and numbers it prints otherwise than Python.
        payload: dict[str, Any] = {"items": list(range(40)), "price": 1.5e16, "tiny": 2.5e-7, "pad": "x" * pad}
        return Message(topic, payload, key=key, headers=headers, type="order.paid")


def _stored_headers(m: Message) -> dict[str, object]:
    return {
        name: value if isinstance(value, str) else {"base64": base64.b64encode(value).decode()}
        for name, value in (m.headers or {}).items()
    }


def _insert_past_enqueue(db: psycopg.Connection, table: OutboxTable, m: Message) -> None:
    """The message as a plain INSERT stores it: no size check."""
    payload, payload_bytes = (None, m.payload) if isinstance(m.payload, bytes) else (Jsonb(m.payload), None)
    db.execute(
        sql.SQL(
            "INSERT INTO {} (topic, key, type, payload, payload_bytes, headers) VALUES (%s, %s, %s, %s, %s, %s)"
        ).format(table.messages),
        (m.topic, m.key, m.type, payload, payload_bytes, Jsonb(_stored_headers(m))),
    )


def _python_enqueue(db: psycopg.Connection, table: OutboxTable, m: Message) -> None:
    enqueue(
        db, m.topic, m.payload, key=m.key, headers=m.headers, type=m.type, table=replace(table, max_message_bytes=LIMIT)
    )


def _sql_enqueue(db: psycopg.Connection, table: OutboxTable, m: Message) -> None:
    payload, payload_bytes = (None, m.payload) if isinstance(m.payload, bytes) else (Jsonb(m.payload), None)
    db.execute("SELECT set_config('outbox.max_message_bytes', %s, false)", (str(LIMIT),))
    db.execute(
        sql.SQL(
            "SELECT id FROM {}(topic => %s, payload => %s, key => %s, headers => %s, type => %s, payload_bytes => %s)"
        ).format(table.ident("enqueue")),
        (m.topic, payload, m.key, Jsonb(_stored_headers(m)), m.type, payload_bytes),
    )


WRITERS: dict[str, Callable[[psycopg.Connection, OutboxTable, Message], None]] = {
    "python": _python_enqueue,
    "sql": _sql_enqueue,
}
REFUSALS: dict[str, type[Exception]] = {"python": InvalidMessageError, "sql": psycopg.errors.ProgramLimitExceeded}


def _accepted(db: psycopg.Connection, table: OutboxTable, writer: str, m: Message) -> bool:
    """Whether the writer accepts the message (nothing is kept either way)."""
    try:
        with db.transaction(force_rollback=True):
            WRITERS[writer](db, table, m)
    except REFUSALS[writer]:
        return False
    return True


def _largest_pad(db: psycopg.Connection, table: OutboxTable, writer: str, shape: Shape, topic: str) -> int:
    low, high = 0, LIMIT  # accepted at low, refused at high
    assert _accepted(db, table, writer, shape.message(topic, "fits", low))
    assert not _accepted(db, table, writer, shape.message(topic, "fits", high))
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (
            (middle, high) if _accepted(db, table, writer, shape.message(topic, "fits", middle)) else (low, middle)
        )
    return low


@pytest.mark.parametrize("cloud_events", ["off", "all"])
@pytest.mark.parametrize("kind", ["json", "bytes"])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_the_largest_message_enqueue_accepts_is_delivered_and_one_byte_more_is_refused_at_enqueue(
    writer: str,
    kind: str,
    cloud_events: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 40, case 23: enqueue counted the payload's compact JSON, the key and the row's own headers; the relay
    sends more, and a message accepted near the limit was dead-lettered as too large."""
    monkeypatch.setenv("OUTBOX_CLOUDEVENTS", cloud_events)  # the writer's and the relay's, as deployed together
    db.execute("SELECT set_config('outbox.cloudevents', %s, false)", (cloud_events,))  # the SQL writers' twin
    db.execute(
        sql.SQL("SELECT setval({}, %s)").format(sql.Literal(f"{table.schema}.outbox_messages_id_seq")),
        (FIRST_WIDE_ID,),
    )
    topic = new_topic("size")
    shape = Shape(kind)
    pad = _largest_pad(db, table, writer, shape, topic)

    WRITERS[writer](db, table, shape.message(topic, "fits", pad))
    with pytest.raises(REFUSALS[writer], match=rf"is {LIMIT + 1} bytes, over the maximum of {LIMIT} bytes"):
        WRITERS[writer](db, table, shape.message(topic, "fits", pad + 1))
    _insert_past_enqueue(db, table, shape.message(topic, "over", pad + 1))
    drain(db.info.dsn, table, kafka.bootstrap_servers, "locking", producer={"message.max.bytes": LIMIT})

    dead = db.execute(sql.SQL("SELECT key, last_error FROM {}").format(table.dead_letters)).fetchall()
    assert [key for key, _ in dead] == ["over"], dead
    assert f"a record of {LIMIT + 1} bytes as librdkafka counts it, over message.max.bytes {LIMIT}" in dead[0][1]
    [delivered] = kafka.consume(topic, expect=1)
    assert delivered.key == b"fits"
    if kind == "json":
        assert delivered.value is not None and json.loads(delivered.value)["pad"] == "x" * pad


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
header_names = st.sampled_from(["trace", "ce_type", "ce_source", "ce_time", "content-type", "ce_x", "é"]) | st.text(
    min_size=1, max_size=6
).filter(lambda name: name not in RESERVED_HEADERS)
storable_messages = st.builds(
    Message,
    topic=st.sampled_from(["orders", "payments.v1"]),
    payload=json_values | st.binary(max_size=8),
    key=st.none() | st.text(max_size=12),
    headers=st.none() | st.dictionaries(header_names, st.text(max_size=8) | st.binary(max_size=8), max_size=4),
    type=st.none() | st.text(max_size=12),
)


@pytest.fixture(scope="module")
def sized_outbox(pg_server: LocalPostgres) -> Iterator[tuple[psycopg.Connection, OutboxTable]]:
    table = OutboxTable(schema=f"s_{uuid.uuid4().hex[:10]}")
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        init_db(conn, table)
        yield conn, table
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(table.schema_ident))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(message=storable_messages, source=st.sampled_from([None, "/shop", "/é/longer-source"]))
def test_python_enqueue_sql_enqueue_and_the_relay_count_a_record_alike(
    sized_outbox: tuple[psycopg.Connection, OutboxTable], message: Message, source: str | None
) -> None:
    """Python's count, SQL's ``record_bytes`` of the stored row, and librdkafka's count of the record the relay builds
    from that row (with a 19-digit ``outbox_id``) are one number, CloudEvents on or off."""
    conn, table = sized_outbox
    cloud = None if source is None else CloudEvents(None, source)
    try:
        python = validate(message, RecordLimit(10**9, cloud), 0, set()).size
    except InvalidMessageError:
        assume(False)
    [stored] = enqueue_many(conn, [message], table=table)
    conn.execute("SELECT set_config('outbox.cloudevents', %s, false)", ("off" if source is None else "all",))
    conn.execute("SELECT set_config('outbox.cloudevents_source', %s, false)", (source or "",))
    in_sql = conn.execute(
        sql.SQL("SELECT {}(topic, key, type, payload, payload_bytes, headers) FROM {} WHERE id = %s").format(
            table.ident("record_bytes"), table.messages
        ),
        (stored.id,),
    ).fetchone()
    query = sql.SQL(f"SELECT {RECORD_COLUMNS} FROM {{}} m WHERE m.id = %(id)s").format(table.messages)
    [r] = fetch_records(conn, query, {"id": stored.id})
    headers = RecordHeaders(cloud).of(
        r.topic, r.message_id, b"9" * WIDEST_ID, r.created_at, r.type, r.headers, r.binary
    )
    relay = record_bytes(r.key, r.payload, headers)

    assert (python, in_sql) == (relay, (relay,))
