"""The enqueue API services call inside their own transaction: validated first, one statement per call, so a call stores
all of its messages or none and bad input leaves the caller's transaction usable. See
docs/payloads.md#a-payload-is-json-or-bytes."""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import psycopg
from confluent_kafka.serialization import MessageField, SerializationContext
from psycopg import sql
from psycopg.rows import tuple_row

from .. import settings
from ..config import OutboxTable
from ..errors import InvalidMessageError, SchemaError
from . import wire_arrays
from .database_encoding import database_codec, unholdable, unholdable_message
from .messages import NO_HEADERS, Message, Row, validate
from .migrations import DEFAULT_TOPIC_ROW, NOTIFY_SETTING
from .record_headers import cloud_events_from_env
from .record_size import RecordLimit
from .routing import SERIALIZED_LOCK_CLASS
from .tracing import TRACEPARENT, current_trace_headers
from .wal import format as wal_format
from .wal import objects as wal_objects

# A confluent-kafka ``Serializer`` (AvroSerializer, ProtobufSerializer, JSONSerializer with a Schema Registry client)
# or any callable like one: the payload object and the message's topic in, the bytes to store out.
PayloadSerializer = Callable[[Any, SerializationContext], bytes | None]


@dataclass(frozen=True, slots=True)
class Enqueued:
    id: int
    message_id: uuid.UUID


def enqueue(
    conn: psycopg.Connection,
    topic: str,
    payload: Any,
    *,
    key: str | None = None,
    headers: Mapping[str, str | bytes] | None = None,
    type: str | None = None,
    priority: int = 0,
    partition: int | None = None,
    serialized: bool = False,
    notify: bool = True,
    table: OutboxTable | None = None,
    serializer: PayloadSerializer | None = None,
) -> Enqueued:
    """Store one message in the caller's current transaction; it is relayed once that commits.

    ``serialized=True`` takes the transaction-scoped lock the ``serialized`` strategy relies on (ids in
    commit order): it is held until the caller commits, so keep the enqueue at the end of the transaction.
    ``notify=False`` inserts without waking the relay (the rest of the transaction too): needed before
    ``PREPARE TRANSACTION``, which PostgreSQL refuses after a NOTIFY; the relay's poll finds the rows.

    ``payload``: anything JSON encodes (stored as jsonb), or bytes (stored and published unchanged). With a
    ``serializer`` (a Schema Registry serializer), the bytes it makes of ``payload`` for the topic's value. With
    OpenTelemetry installed, the current span context goes along as ``traceparent``/``tracestate`` headers.
    """
    message = Message(topic, payload, key, headers, type, priority, partition)
    return enqueue_many(conn, [message], serialized=serialized, notify=notify, table=table, serializer=serializer)[0]


def enqueue_many(
    conn: psycopg.Connection,
    messages: Iterable[Message],
    *,
    serialized: bool = False,
    notify: bool = True,
    table: OutboxTable | None = None,
    serializer: PayloadSerializer | None = None,
) -> list[Enqueued]:
    """Store many messages with one statement: all of them or, on any bad message, none.

    ``notify=False``: no wake-up for the relay, for two-phase commit (see ``enqueue``); ``serializer``: every
    payload through it (see ``enqueue``).
    """
    table = table or OutboxTable.from_env()
    if serializer is not None:
        messages = [_serialize(serializer, m, i) for i, m in enumerate(messages)]
    if trace := current_trace_headers():
        # The writer's trace, for the consumer to continue (tracing.py); a message's own traceparent wins.
        messages = [m if m.headers and TRACEPARENT in m.headers else _traced(m, trace) for m in messages]
    topics: set[str] = set()
    limit = RecordLimit(table.max_message_bytes, cloud_events_from_env())  # the relay's CloudEvents attributes count
    wal = table.write_to == "wal"
    rows = [validate(m, limit, i, topics, hashed=not wal) for i, m in enumerate(messages)]
    if not rows:
        return []
    if len(rows) * table.max_message_bytes > MAX_CALL_BYTES:  # each row is within the message limit: mostly no sum
        _check_call_size(rows)
    _refuse_unholdable(conn, rows)
    raw_ids, message_ids = _new_message_ids(len(rows))
    if wal:
        return _emit(conn, table, rows, raw_ids, message_ids)
    if len(rows) == 1:
        # The common call: scalar parameters instead of nine one-element arrays (measured: dumping the arrays
        # was a third of a single-row enqueue's client time).
        r = rows[0]
        query = _insert_one_sql(table)
        params: tuple[object, ...] = (
            message_ids[0],
            r.key,
            r.type,
            r.payload,
            r.payload_bytes,
            r.headers,
            r.priority,
            r.partition,
            r.hash,
            r.topic,
        )
    else:
        query, params = _insert_sql(table), _rows_params(conn, rows, topics, raw_ids)
    ids = _insert(conn, table, query, params, many=len(rows) > 1, notify=notify, serialized=serialized)
    if not ids and _emitted_by_trigger(conn, table):
        return [Enqueued(0, mid) for mid in message_ids]
    # The rows are inserted in the call's order (ORDER BY u.ord), each taking the next id as it goes, and RETURNING
    # gives them as inserted: ascending ids say that this order is the call's. Matching by message_id instead meant
    # a uuid parsed per row.
    if len(ids) != len(rows) or any(a >= b for a, b in zip(ids, ids[1:], strict=False)):
        raise RuntimeError(f"outbox insert returned ids {ids[:5]}... for {len(rows)} messages, not in their order")
    return [Enqueued(oid, mid) for oid, mid in zip(ids, message_ids, strict=True)]


def _rows_params(conn: psycopg.Connection, rows: list[Row], topics: set[str], raw_ids: bytes) -> tuple[object, ...]:
    """A column with nothing to say goes as NULL, not as an array of defaults: unnest pads it with NULLs, and dumping
    an array costs the client per element (most calls give no type, bytes, headers, priority or partition). The
    columns every call fills go as arrays built from their bytes (wire_arrays.py)."""
    payloads = _unless_all([r.payload for r in rows], None)
    if conn.info.encoding in _UTF8_AS_IS:
        topic_utf8 = {topic: topic.encode() for topic in topics}
        topic_column: object = wire_arrays.text_array([topic_utf8[r.topic] for r in rows])
        key_column: object = wire_arrays.text_array([r.key_utf8 for r in rows])
        payload_column: object = (
            None if payloads is None else wire_arrays.text_array([None if p is None else p.encode() for p in payloads])
        )
    else:
        topic_column, key_column, payload_column = _text_columns_encoded(rows, payloads, conn.info.encoding)
    return (
        wire_arrays.uuid_array(raw_ids),
        topic_column,
        key_column,
        _unless_all([r.type for r in rows], None),
        payload_column,
        _unless_all([r.payload_bytes for r in rows], None),
        _unless_all([r.headers for r in rows], NO_HEADERS),
        _unless_all([r.priority for r in rows], 0),
        _unless_all([r.partition for r in rows], None),
        wire_arrays.int8_array([r.hash for r in rows]),
    )


def _text_columns_encoded(rows: list[Row], payloads: list[Any] | None, encoding: str) -> tuple[object, object, object]:
    """Topic, key and payload in a client encoding other than UTF-8 (a LATIN1 database's default): text goes in that
    encoding, as psycopg encodes it, and the server reads it so; UTF-8 bytes would be stored as other characters
    ("café" as "cafÃ©": another Kafka key). A character the encoding lacks fails here, before anything is sent."""
    try:
        return (
            _encoded([r.topic for r in rows], encoding),
            _encoded([r.key for r in rows], encoding),
            _encoded(payloads, encoding),
        )
    except UnicodeEncodeError as exc:
        raise InvalidMessageError(_UNENCODABLE.format(exc.object[exc.start : exc.end], encoding)) from None


def _insert(
    conn: psycopg.Connection,
    table: OutboxTable,
    query: bytes,
    params: tuple[object, ...],
    *,
    many: bool,
    notify: bool,
    serialized: bool,
) -> list[int]:
    """The INSERT, after the NOTIFY switch and the serialized writers' lock if asked; the ids it returned.

    The service's connection, not its defaults: a cursor that binds on the server whatever its cursor_factory (a
    ClientCursor quoted the binary arrays as bytea literals) and returns tuples whatever its row_factory (dict_row
    rows were unpacked as their keys). Both tested in tests/engine/store/test_enqueue.py.
    """
    with psycopg.Cursor(conn, row_factory=tuple_row) as cur:
        if many:
            wire_arrays.register(cur.adapters)
        if not notify:
            # Transaction-local, like SET LOCAL: the caller's later inserts skip the NOTIFY as well.
            cur.execute("SELECT set_config(%s, 'off', true)", (NOTIFY_SETTING,))
        if serialized:
            # Its own statement, before the INSERT draws ids from the sequence: from here to commit no
            # other serialized writer can draw an id, so ids become visible in commit order. Pipelined,
            # the lock and the insert still cost one round trip.
            with conn.pipeline():
                cur.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (SERIALIZED_LOCK_CLASS, table.schema))
                cur.execute(query, params)
        else:
            cur.execute(query, params)
        return [oid for (oid,) in cur.fetchall()]


def _emit(
    conn: psycopg.Connection, table: OutboxTable, rows: list[Row], raw_ids: bytes, ids: list[uuid.UUID]
) -> list[Enqueued]:
    """A wal outbox's messages (store/wal/): one logical decoding message each, built here; ``Enqueued.id`` is the
    message's LSN. ``serialized`` and ``notify`` change nothing: the slot streams in commit order and wakes the
    relay. What the database's encoding cannot hold was refused (``_refuse_unholdable``)."""
    contents = [
        wal_format.encode(
            text_id,
            r.topic.encode(),
            r.key_utf8 if r.key is not None else None,
            None if r.type is None else r.type.encode(),
            r.headers.encode(),
            r.payload_bytes if r.payload_bytes is not None else (r.payload or "").encode(),
            binary=r.payload_bytes is not None,
            partition=r.partition,
        )
        for r, text_id in zip(rows, _uuid_texts(raw_ids), strict=True)
    ]
    with psycopg.Cursor(conn, row_factory=tuple_row) as cur:
        wire_arrays.register(cur.adapters)
        try:
            if len(contents) == 1:
                cur.execute(_emit_one_sql(table), contents)
            else:
                cur.execute(_emit_sql(table), (wire_arrays.bytea_array(contents),))
        except (psycopg.errors.UndefinedFunction, psycopg.errors.InvalidSchemaName):
            raise SchemaError(
                f"{settings.WRITE_TO.name}=wal, but the outbox {table.schema!r} is not a wal outbox (made by `outbox "
                f"init-db --strategy wal`): nothing was written, and this transaction is aborted. Unset "
                f"{settings.WRITE_TO.name} for this outbox"
            ) from None
        lsns = [lsn for (lsn,) in cur.fetchall()]
    return [Enqueued(lsn, mid) for lsn, mid in zip(lsns, ids, strict=True)]


def _refuse_unholdable(conn: psycopg.Connection, rows: list[Row]) -> None:
    """A character the database's encoding cannot hold is refused before anything is sent, whatever the client's
    encoding (a UTF8 client in a LATIN1 database): the server would refuse it in a row, and a wal message is no row,
    but its dead letter or its copy held behind one would be."""
    if (codec := database_codec(conn)) is None:
        return
    for r in rows:
        if (bad := unholdable((r.topic, r.key, r.type, r.headers, r.payload), codec)) is not None:
            raise InvalidMessageError(unholdable_message(bad, conn))


def _emitted_by_trigger(conn: psycopg.Connection, table: OutboxTable) -> bool:
    """Whether the INSERT that returned no row met a wal outbox's trigger, which emitted the rows and kept none (a
    writer left at ``OUTBOX_WRITE_TO=table``): they are relayed, with no id to return (``Enqueued.id`` 0). Asked only
    then; any other INSERT that stores nothing is an error."""
    row = conn.execute(
        "SELECT 1 FROM pg_trigger WHERE tgrelid = %s::regclass AND tgname = %s AND tgenabled <> 'D'",
        (table.messages.as_string(conn), wal_objects.EMIT_TRIGGER),
    ).fetchone()
    return row is not None


def _uuid_texts(raw: bytes) -> list[bytes]:
    """The UUIDs in ``raw`` (16 bytes each) as their ASCII text, sliced from one hex string (``str(uuid)`` per
    message cost a wal writer about 2 us a row)."""
    h = raw.hex().encode()
    return [
        b"-".join((h[i : i + 8], h[i + 8 : i + 12], h[i + 12 : i + 16], h[i + 16 : i + 20], h[i + 20 : i + 32]))
        for i in range(0, len(h), 32)
    ]


@functools.cache
def _emit_one_sql(table: OutboxTable) -> bytes:
    return sql.SQL("SELECT {}(%b::bytea)").format(table.ident("outbox_emit_one")).as_bytes(None)


@functools.cache
def _emit_sql(table: OutboxTable) -> bytes:
    return sql.SQL("SELECT * FROM {}(%b::bytea[])").format(table.ident("outbox_emit_many")).as_bytes(None)


# PostgreSQL reads one protocol message of at most 1 GB; a statement's parameters past that end the connection
# ("invalid message length") instead of failing the call. Room is left for the ids and the arrays' own bytes.
MAX_CALL_BYTES = 900 * 1024 * 1024


def _check_call_size(rows: list[Row]) -> None:
    """Refuse a call whose columns together pass what one statement can carry, before anything is sent."""
    size = 0
    for r in rows:  # ASCII-sized for text: a lower bound, enough to tell a call an order of magnitude too big
        size += len(r.topic) + len(r.key or "") + len(r.payload or "") + len(r.payload_bytes or b"") + len(r.headers)
    if size > MAX_CALL_BYTES:
        raise InvalidMessageError(
            f"enqueue_many: these {len(rows):,} messages are {size:,} bytes together, more than one statement can "
            f"carry ({MAX_CALL_BYTES:,}): split them into several calls (in the same transaction, if they belong "
            "together)"
        )


def _new_message_ids(n: int) -> tuple[bytes, list[uuid.UUID]]:
    """``n`` random (version 4) UUIDs as ``uuid.uuid4()`` makes them, from one read of the system's random source:
    their bytes one after another, and the UUIDs."""
    raw = bytearray(os.urandom(16 * n))
    raw[6::16] = bytes(b & 0x0F | 0x40 for b in raw[6::16])  # version 4
    raw[8::16] = bytes(b & 0x3F | 0x80 for b in raw[8::16])  # the RFC 4122 variant
    data = bytes(raw)
    return data, [uuid.UUID(bytes=data[i : i + 16]) for i in range(0, 16 * n, 16)]


@functools.cache
def _insert_one_sql(table: OutboxTable) -> bytes:
    """One row; the same routing as _insert_sql. Rendered once per outbox: composing costs on every call."""
    return (
        sql.SQL(
            """
            INSERT INTO {messages} (message_id, topic, key, type, payload, payload_bytes, headers, priority, partition)
            SELECT %s::uuid, u.topic, %s::text, %s::text, %s::jsonb, %s::bytea, %s::jsonb, %s::smallint,
                   coalesce(
                       %s::integer,
                       %s::bigint %% coalesce(
                           (SELECT t.partitions FROM {topics} t WHERE t.topic = u.topic),
                           (SELECT d.partitions FROM {topics} d WHERE d.topic = {default_row})))
            FROM (SELECT %s::text AS topic) u
            RETURNING id
            """
        )
        .format(messages=table.messages, topics=table.topics, default_row=sql.Literal(DEFAULT_TOPIC_ROW))
        .as_bytes(None)
    )


@functools.cache
def _insert_sql(table: OutboxTable) -> bytes:
    # The virtual partition is resolved in the same statement: the caller's own partition, else the
    # key's murmur2 hash modulo the topic's partition count (outbox_topics, or its '*' default row).
    return (
        sql.SQL(
            """
        INSERT INTO {messages} (message_id, topic, key, type, payload, payload_bytes, headers, priority, partition)
        SELECT u.message_id, u.topic, u.key, u.type, u.payload::jsonb, u.payload_bytes,
               coalesce(u.headers::jsonb, '{{}}'), coalesce(u.priority, 0),
               coalesce(
                   u.partition,
                   u.hash %% coalesce(t.partitions, (SELECT d.partitions FROM {topics} d WHERE d.topic = {default_row}))
               )
        FROM unnest(
            %b::uuid[], %b::text[], %b::text[], %b::text[], %b::text[], %b::bytea[], %b::text[], %b::smallint[],
            %b::integer[], %b::bigint[]
        ) WITH ORDINALITY AS u(message_id, topic, key, type, payload, payload_bytes, headers, priority, partition, hash,
                               ord)
        LEFT JOIN {topics} t ON t.topic = u.topic
        ORDER BY u.ord
        RETURNING id
        """
        )
        .format(messages=table.messages, topics=table.topics, default_row=sql.Literal(DEFAULT_TOPIC_ROW))
        .as_bytes(None)
    )


# Client encodings that take UTF-8 bytes as they are: UTF8, and SQL_ASCII (no conversion at all).
_UTF8_AS_IS = frozenset({"utf-8", "ascii"})
_UNENCODABLE = (
    "{!r} cannot be sent in this connection's client encoding {}: use client_encoding UTF8, or leave such "
    "characters out"
)


def _encoded(values: Sequence[str | None] | None, encoding: str) -> wire_arrays.TextArray | None:
    """A text column's values in the connection's encoding (see enqueue_many); UnicodeEncodeError if one cannot be."""
    if values is None:
        return None
    return wire_arrays.text_array([None if v is None else v.encode(encoding) for v in values])


def _unless_all(values: list[Any], default: object) -> list[Any] | None:
    """``values``, or None when every one is ``default`` (see enqueue_many)."""
    return None if all(v == default for v in values) else values


def _serialize(serializer: PayloadSerializer, m: Message, index: int) -> Message:
    """The message with its payload serialized for its topic's value; headers the serializer sets (a schema id in a
    header) join the message's own."""
    where = f"message {index} to topic {m.topic!r}"
    added: list[tuple[str, str | bytes | None]] = []
    try:
        value = serializer(m.payload, SerializationContext(m.topic, MessageField.VALUE, added))
    except Exception as exc:  # the serializer's own errors (SerializationError, schema mismatch, registry down)
        raise InvalidMessageError(f"{where}: the serializer refused the payload: {exc}") from exc
    if not isinstance(value, bytes):
        raise InvalidMessageError(f"{where}: the serializer returned {type(value).__name__}, not bytes")
    set_by_serializer = {name: value for name, value in added if value is not None}
    headers = {**(m.headers or {}), **set_by_serializer} if set_by_serializer else m.headers
    return replace(m, payload=value, headers=headers)


def _traced(m: Message, trace: Mapping[str, str]) -> Message:
    return replace(m, headers={**trace, **(m.headers or {})})


__all__: Sequence[str] = ("Message", "Enqueued", "enqueue", "enqueue_many")
