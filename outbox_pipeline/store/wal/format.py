"""The bytes of one wal outbox message, as writers emit them and the relay reads them: a fixed header first, so the
relay slices instead of parsing. See docs/wal.md#the-messages-bytes."""

from __future__ import annotations

import struct
from typing import NamedTuple

from ...model import OutboxRecord

VERSION = 1
BYTES_PAYLOAD = 0x01
HEADER = struct.Struct(">BBqiHiii36s")
# The byte offset of ``created`` (SQL's overlay() counts from 1: CREATED_AT_OFFSET + 1).
CREATED_AT_OFFSET = 2
# The prefix of every message of the outbox in ``schema``: a database may hold several outboxes, one slot each.
PREFIX = "outbox:{schema}"


class WalMessage(NamedTuple):
    """One decoded message. A named tuple: the relay builds one per message on its hot path."""

    message_id: bytes  # uuid text, ASCII
    created_at: int
    partition: int  # -1: none given
    topic: str
    key: bytes | None
    type: bytes | None
    headers: str
    payload: bytes
    binary: bool


# The topic a message under the prefix that is not one of ours is dead-lettered under: not a Kafka topic name (the
# parentheses), so no writer's message has it, and there is nothing to retry (operate/dead_letters.py).
MALFORMED_TOPIC = "(malformed)"
# The topic of a message kept as the bytes it was emitted as: the database cannot hold its topic, key, type or headers
# as text (relay/wal/holds.py). Never a Kafka topic name either.
UNSTORABLE_TOPIC = "(unstorable)"
# Dead letters that hold no message a retry could put back: only ``discard`` removes them.
NOT_RETRIABLE_TOPICS = (MALFORMED_TOPIC, UNSTORABLE_TOPIC)


class MalformedMessage(ValueError):
    """Bytes under the outbox's prefix that are not a message of this layout (a writer of another version, or a
    hand-made ``pg_logical_emit_message``)."""


def prefix_of(schema: str) -> str:
    return PREFIX.format(schema=schema)


def encode(
    message_id: bytes,
    topic: bytes,
    key: bytes | None,
    type_: bytes | None,
    headers: bytes,
    payload: bytes,
    *,
    binary: bool,
    partition: int | None,
    created_at: int = 0,
) -> bytes:
    """The message's bytes. ``created_at`` 0: the emitting SQL function stamps the transaction's ``now()`` over it,
    as a row's default would (the writer's clock is not the database's)."""
    header = HEADER.pack(
        VERSION,
        BYTES_PAYLOAD if binary else 0,
        created_at,
        -1 if partition is None else partition,
        len(topic),
        -1 if key is None else len(key),
        -1 if type_ is None else len(type_),
        len(headers),
        message_id,
    )
    return b"".join((header, topic, key or b"", type_ or b"", headers, payload))


def record(content: bytes, lsn: int, xid: str) -> OutboxRecord:
    """The message in ``content`` as the relay publishes it (its LSN the record's id, as text its outbox_id header);
    MalformedMessage when the bytes are not one. The relay's per-message path: one unpack, slices, no copy of the
    payload beyond its own slice."""
    try:
        version, flags, created, part, n_topic, n_key, n_type, n_headers, message_id = _unpack(content)
    except struct.error:
        raise MalformedMessage(f"{len(content)} bytes, shorter than a message's {HEADER.size}-byte header") from None
    at = _SIZE + n_topic
    key = None if n_key < 0 else content[at : at + n_key]
    if key is not None:
        at += n_key
    type_ = None if n_type < 0 else content[at : at + n_type]
    if type_ is not None:
        at += n_type
    end = at + n_headers
    if version != VERSION or end > len(content) or n_key < -1 or n_type < -1 or n_headers < 0:
        raise MalformedMessage(
            f"layout version {version} (this relay reads {VERSION})"
            if version != VERSION
            else f"lengths past the message's {len(content)} bytes"
        )
    try:
        topic = content[_SIZE : _SIZE + n_topic].decode()
        headers = _NO_HEADERS if n_headers == 2 and content[at:end] == b"{}" else content[at:end].decode()
    except UnicodeDecodeError as exc:
        raise MalformedMessage(f"a topic or headers that are not UTF-8: {exc}") from None
    return OutboxRecord(
        lsn,
        topic,
        key,
        content[end:],
        headers,
        message_id,
        str(lsn).encode(),
        created,
        type_,
        part,
        xid,
        0,
        flags & BYTES_PAYLOAD != 0,
    )


def decode(content: bytes) -> WalMessage:
    """The message in ``content``, every field it carries (tests, tools); MalformedMessage when it is not one."""
    r = record(content, 0, "0")
    return WalMessage(r.message_id, r.created_at, r.partition, r.topic, r.key, r.type, r.headers, r.payload, r.binary)


_unpack = HEADER.unpack_from
_SIZE = HEADER.size
_NO_HEADERS = "{}"
