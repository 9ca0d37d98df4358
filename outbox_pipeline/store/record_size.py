"""A message's size as the relay's producer counts it, so that enqueue refuses what the relay would dead-letter. See
docs/payloads.md#the-size-limit-the-record-the-relay-sends."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import sql

from .. import settings
from ..config import OutboxTable
from .record_headers import CloudEvents

RECORD_OVERHEAD = 36  # librdkafka's RD_KAFKAP_MESSAGE_V2_MAX_OVERHEAD
UUID_TEXT = 36
WIDEST_ID = 19  # digits of 9223372036854775807
CREATED_AT_TEXT = 27  # 2026-11-26T21:30:00.123456Z
CE_SPECVERSION_TEXT = 3  # "1.0"
JSON_CONTENT_TYPE = "application/json"
BYTES_CONTENT_TYPE = "application/octet-stream"


def _varint(length: int) -> int:
    """Bytes of ``length`` as librdkafka writes a header's lengths: zigzag, then 7 bits a byte."""
    return 1 if length < 1 << 6 else 2 if length < 1 << 13 else 3 if length < 1 << 20 else 4 if length < 1 << 27 else 5


def header_bytes(name: int, value: int) -> int:
    """One header of a ``name``-byte name and a ``value``-byte value."""
    return name + value + _varint(name) + _varint(value)


def record_bytes(key: bytes | None, value: bytes | None, headers: Iterable[tuple[str, bytes | str | None]]) -> int:
    """A record's size as librdkafka counts it against ``message.max.bytes``."""
    size = RECORD_OVERHEAD + len(key or b"") + len(value or b"")
    for name, data in headers:
        size += header_bytes(len(name.encode()), len(data.encode() if isinstance(data, str) else data or b""))
    return size


# Every record: the overhead, message_id, outbox_id at its widest, created_at.
RELAY_BASE = (
    RECORD_OVERHEAD
    + header_bytes(len("message_id"), UUID_TEXT)
    + header_bytes(len("outbox_id"), WIDEST_ID)
    + header_bytes(len("created_at"), CREATED_AT_TEXT)
)


@dataclass(frozen=True)
class RecordLimit:
    """The largest record enqueue accepts, and the CloudEvents attributes the relay adds (record_headers.py; None:
    off), as the writer's settings say (enqueue.py reads them as the relay does)."""

    max_bytes: int
    cloud_events: CloudEvents | None = None

    def cloud_events_bytes(
        self, topic: str, type_bytes: int | None, own: Mapping[str, int], binary: bool
    ) -> tuple[int, int]:
        """(the CloudEvents attributes' bytes, the bytes of the row's own headers the relay leaves out) for a row of
        ``topic``; ``own``: the row's own header names and their values' lengths."""
        if self.cloud_events is None or not self.cloud_events.covers(topic):
            return 0, 0
        dropped = sum(header_bytes(len(n.encode()), 0) for n, size in own.items() if size == 0 and n.startswith("ce_"))
        given = {n for n, size in own.items() if size or not n.startswith("ce_")}
        attributes = {
            "ce_specversion": CE_SPECVERSION_TEXT,
            "ce_id": UUID_TEXT,
            "ce_type": type_bytes or len(topic.encode()),
            "ce_source": len(self.cloud_events.source.encode()),
            "ce_time": CREATED_AT_TEXT,
            "content-type": len(BYTES_CONTENT_TYPE if binary else JSON_CONTENT_TYPE),
        }
        added = sum(header_bytes(len(n), size) for n, size in attributes.items() if n not in given)
        return added, dropped


# Python's float text that numeric prints otherwise: an exponent (1e+16, 2.5e-07) or a negative zero.
_NUMBER_PRINTED_OTHERWISE = re.compile(r"[0-9]e[-+][0-9]|-0\.0(?![0-9])")
_text_of = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode


def jsonb_text_bytes(text: str) -> int:
    """UTF-8 bytes of PostgreSQL's text of the jsonb that ``text`` parses to, where ``text`` is a JSON text whose
    separators are already ``", "`` and ``": "`` (messages.py writes so)."""
    size = len(text) if text.isascii() else len(text.encode())
    if not (("e+" in text or "e-" in text or "-0.0" in text) and _NUMBER_PRINTED_OTHERWISE.search(text)):
        return size
    return _rendered_bytes(json.loads(text, parse_float=_Numeric.of, object_pairs_hook=dict))


class _Numeric(str):
    """A JSON number as numeric prints it."""

    @classmethod
    def of(cls, token: str) -> _Numeric:
        number = Decimal(token)
        text = format(number, "f")
        return cls(text.lstrip("-") if number.is_zero() else text)


def _rendered_bytes(value: Any) -> int:
    """Bytes of jsonb's text of a parsed JSON value (no recursion: the value may be nested as deep as JSON allows)."""
    size = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            size += 2 + 2 * max(len(item) - 1, 0) + 2 * len(item)  # braces, ", " between members, ": " in each
            for name, member in item.items():
                size += len(_text_of(name).encode())
                stack.append(member)
        elif isinstance(item, list):
            size += 2 + 2 * max(len(item) - 1, 0)
            stack.extend(item)
        elif isinstance(item, _Numeric):
            size += len(item)
        else:
            size += len(_text_of(item).encode())
    return size


# The SQL twin (migration 13). STABLE: it reads the CloudEvents settings. Text is counted in UTF-8, as the relay sends
# it whatever the database's encoding.
_RECORD_BYTES = """
    CREATE OR REPLACE FUNCTION {function}(
        topic text, key text, type text, payload jsonb, payload_bytes bytea, headers jsonb) RETURNS bigint
    LANGUAGE plpgsql STABLE AS $fn$
    DECLARE
        wanted constant text := btrim(coalesce(current_setting('outbox.cloudevents', true), ''));
        source constant text := coalesce(nullif(current_setting('outbox.cloudevents_source', true), ''), {source});
        cloud constant boolean := lower(wanted) = 'all' OR (wanted <> '' AND lower(wanted) <> 'off'
            AND topic = ANY (SELECT btrim(t) FROM unnest(string_to_array(wanted, ',')) t));
        type_bytes constant integer := octet_length(convert_to(type, 'UTF8'));
        own bigint;
        given text[];
        size bigint;
    BEGIN
        SELECT coalesce(sum({header}(octet_length(convert_to(h.name, 'UTF8')), h.bytes)), 0),
               coalesce(array_agg(h.name), '{{}}')
        INTO own, given
        FROM (SELECT e.key AS name,
                     CASE jsonb_typeof(e.value) WHEN 'string' THEN octet_length(convert_to(e.value #>> '{{}}', 'UTF8'))
                          ELSE length(decode(e.value ->> 'base64', 'base64')) END AS bytes
              FROM jsonb_each(coalesce(headers, '{{}}')) e) h
        WHERE NOT (cloud AND h.bytes = 0 AND h.name LIKE 'ce\\_%');
        size := {base} + coalesce(octet_length(convert_to(key, 'UTF8')), 0)
            + coalesce(octet_length(payload_bytes), octet_length(convert_to(payload::text, 'UTF8')))
            + coalesce({header}(4, type_bytes), 0) + own;
        IF cloud THEN
            size := size + (
                SELECT coalesce(sum({header}(octet_length(a.name), a.bytes)), 0)
                FROM (VALUES ('ce_specversion', {specversion}), ('ce_id', {uuid}),
                             ('ce_type', coalesce(nullif(type_bytes, 0), octet_length(convert_to(topic, 'UTF8')))),
                             ('ce_source', octet_length(convert_to(source, 'UTF8'))),
                             ('ce_time', {created_at}),
                             ('content-type', CASE WHEN payload_bytes IS NULL THEN {json_type} ELSE {bytes_type} END))
                     AS a(name, bytes)
                WHERE a.name <> ALL (given));
        END IF;
        RETURN size;
    END
    $fn$
"""

# One header's bytes from its name's and value's lengths (see header_bytes).
_HEADER_BYTES = """
    CREATE OR REPLACE FUNCTION {function}(name integer, value integer) RETURNS integer
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $fn$
        SELECT $1 + $2
            + CASE WHEN $1 < 64 THEN 1 WHEN $1 < 8192 THEN 2 WHEN $1 < 1048576 THEN 3 WHEN $1 < 134217728 THEN 4
                   ELSE 5 END
            + CASE WHEN $2 < 64 THEN 1 WHEN $2 < 8192 THEN 2 WHEN $2 < 1048576 THEN 3 WHEN $2 < 134217728 THEN 4
                   ELSE 5 END
    $fn$
"""


def create_record_bytes(conn: psycopg.Connection, t: OutboxTable) -> None:
    """Migration 13: ``<schema>.record_bytes(topic, key, type, payload, payload_bytes, headers)`` and its helper."""
    header = t.ident("record_header_bytes")
    conn.execute(sql.SQL(_HEADER_BYTES).format(function=header))
    conn.execute(
        sql.SQL(_RECORD_BYTES).format(
            function=t.ident("record_bytes"),
            header=header,
            source=sql.Literal(settings.CLOUDEVENTS_SOURCE.default),
            base=sql.Literal(RELAY_BASE),
            specversion=sql.Literal(CE_SPECVERSION_TEXT),
            uuid=sql.Literal(UUID_TEXT),
            created_at=sql.Literal(CREATED_AT_TEXT),
            json_type=sql.Literal(len(JSON_CONTENT_TYPE)),
            bytes_type=sql.Literal(len(BYTES_CONTENT_TYPE)),
        )
    )


# The size check of SQL enqueue (migration 13), after its header checks; ``size`` and ``max_bytes`` are its variables.
SQL_ENQUEUE_SIZE_CHECK = """
        size := {record_bytes}(topic, key, type, payload, payload_bytes, headers);
        max_bytes := coalesce(nullif(current_setting('outbox.max_message_bytes', true), '')::bigint, {default_max});
        IF size > max_bytes THEN
            RAISE EXCEPTION 'outbox enqueue: the message to topic % is % bytes, over the maximum of % bytes '
                '(outbox.max_message_bytes)', topic, size, max_bytes
                USING ERRCODE = 'program_limit_exceeded',
                      DETAIL = 'Counted as the relay sends it: the key, the payload as published, every header, the '
                               'record''s overhead.';
        END IF;"""


def sql_enqueue_size_check(t: OutboxTable) -> sql.Composed:
    return sql.SQL(SQL_ENQUEUE_SIZE_CHECK).format(
        record_bytes=t.ident("record_bytes"),
        default_max=sql.Literal(settings.MAX_MESSAGE_BYTES.default),
    )
