"""What a row's stored headers may be, one rule for every writer, the table's check and the relay. See
docs/payloads.md#the-kafka-headers-the-relay-sets."""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping

import psycopg
from psycopg import sql

from ..config import OutboxTable

# Header values that are bytes are stored in the jsonb headers column as {"base64": "..."}.
BYTES_HEADER_FIELD = "base64"
BASE64_PATTERN = "^([A-Za-z0-9+/]{4})*([A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
# Headers the relay sets on every record: a row's own of the same name would make a second one.
RESERVED_HEADERS = frozenset({"message_id", "type", "outbox_id", "created_at"})

# One header ``h`` (a row of jsonb_each) the relay can send: the table's check and SQL enqueue both use it.
_HEADER_OK = """(h.key <> '' AND (
                jsonb_typeof(h.value) = 'string'
                OR (jsonb_typeof(h.value) = 'object' AND jsonb_typeof(h.value -> 'base64') = 'string'
                    AND (SELECT count(*) FROM jsonb_object_keys(h.value)) = 1
                    AND (h.value ->> 'base64') ~ {base64})))"""

_SENDABLE = """
    CREATE OR REPLACE FUNCTION {sendable}(headers jsonb) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
        SELECT jsonb_typeof(headers) = 'object' AND NOT EXISTS (
            SELECT 1 FROM jsonb_each(headers) AS h WHERE NOT {header_ok})
    $fn$
"""


# From migration 15 the table's function also refuses the relay's own header names (SQL enqueue refuses them first,
# with its own message; Python's enqueue too).
_SENDABLE_OWN_NAMES_APART = """
    CREATE OR REPLACE FUNCTION {sendable}(headers jsonb) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $fn$
        SELECT jsonb_typeof(headers) = 'object' AND NOT EXISTS (
            SELECT 1 FROM jsonb_each(headers) AS h WHERE NOT {header_ok} OR h.key = ANY({reserved}))
    $fn$
"""


def sendable_header() -> sql.Composed:
    """The rule for one header ``h`` (a row of ``jsonb_each(headers) AS h``), as SQL."""
    return sql.SQL(_HEADER_OK).format(base64=sql.Literal(BASE64_PATTERN))


def refuse_unsendable_headers(conn: psycopg.Connection, t: OutboxTable) -> None:
    """Migration 12: the function, and the message table's CHECK on it for new rows ('{}' costs no call)."""
    sendable = t.ident("headers_sendable")
    conn.execute(sql.SQL(_SENDABLE).format(sendable=sendable, header_ok=sendable_header()))
    conn.execute(
        sql.SQL(
            "ALTER TABLE {messages} ADD CONSTRAINT outbox_messages_headers_sendable "
            "CHECK (headers = '{{}}'::jsonb OR {sendable}(headers)) NOT VALID"
        ).format(messages=t.messages, sendable=sendable)
    )


def refuse_reserved_headers(conn: psycopg.Connection, t: OutboxTable) -> None:
    """Migration 15: the table's check refuses a header named as one the relay sets (the same CHECK, its function
    replaced: no lock on the table, no row read)."""
    conn.execute(
        sql.SQL(_SENDABLE_OWN_NAMES_APART).format(
            sendable=t.ident("headers_sendable"),
            header_ok=sendable_header(),
            reserved=sql.Literal(sorted(RESERVED_HEADERS)),
        )
    )


_BASE64 = re.compile(BASE64_PATTERN)


class UnencodableHeaders(ValueError):
    """A row's stored headers that no Kafka record can carry (a writer stored them past enqueue's checks)."""


def decode_headers(stored: object) -> list[tuple[str, bytes]]:
    """Kafka header pairs from the jsonb headers column (the inverse of enqueue's encoding); UnencodableHeaders for
    anything enqueue would not have stored, so that the relay dead-letters the row instead of failing on it."""
    if not isinstance(stored, Mapping):
        raise UnencodableHeaders(f"headers must be a JSON object, got {type(stored).__name__}")
    pairs: list[tuple[str, bytes]] = []
    for name, value in stored.items():
        if name in RESERVED_HEADERS:
            raise UnencodableHeaders(
                f'header "{name}" is the relay\'s own: it sets {", ".join(sorted(RESERVED_HEADERS))}'
            )
        if isinstance(value, str):
            pairs.append((name, value.encode("utf-8")))
        elif (
            isinstance(value, dict)
            and list(value) == [BYTES_HEADER_FIELD]
            and isinstance(value[BYTES_HEADER_FIELD], str)
        ):
            encoded = value[BYTES_HEADER_FIELD]
            if not _BASE64.match(encoded):
                raise UnencodableHeaders(f'header "{name}": {encoded[:40]!r} is not base64 (padded, no whitespace)')
            pairs.append((name, base64.b64decode(encoded)))
        else:
            raise UnencodableHeaders(f'header "{name}" must be a string or {{"base64": "..."}}, got {value!r:.60}')
    return pairs
