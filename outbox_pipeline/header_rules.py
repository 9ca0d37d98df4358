"""Engine room: what a row's stored headers may be, one rule for every writer and the relay.

Headers are a JSON object of name -> string, or name -> ``{"base64": "..."}`` for bytes, base64 as enqueue writes it
(padded, no whitespace). Python's ``enqueue`` only writes that; SQL ``enqueue`` checks it; from migration 12 the table
refuses anything else from a plain INSERT (a CHECK on new rows, ``NOT VALID`` so that no old row is read under a
lock); and the relay dead-letters a row stored before that with anything else (messages.decode_headers), instead of
failing the batch at every try.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from .config import OutboxTable

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
