"""A message as a service hands it to the outbox, checked and encoded before the first byte reaches PostgreSQL. See
docs/payloads.md#a-payload-is-json-or-bytes."""

from __future__ import annotations

import base64
import json
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ..errors import InvalidMessageError
from ..partitioning import key_hash
from .header_rules import BYTES_HEADER_FIELD, RESERVED_HEADERS
from .record_size import RELAY_BASE, RecordLimit, header_bytes, jsonb_text_bytes
from .topic_names import is_valid_topic

_SMALLINT = range(-32768, 32768)
_INT4 = range(0, 2**31)
# json.dumps with any argument makes an encoder per call (a microsecond a row); this one is made once. Like the
# encoder json.dumps keeps for its defaults, it holds only its settings. The separators are those of PostgreSQL's text
# of a jsonb, which the relay publishes: the text's size is then the published size (but for a few numbers, see
# record_size.jsonb_text_bytes), at the cost of a byte per separator on the way to the server.
_to_json = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(", ", ": ")).encode
# jsonb cannot store U+0000; json.dumps writes it as \u0000 preceded by an even number of backslashes.
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


@dataclass(frozen=True, slots=True)
class Message:
    """One message to enqueue; the fields mirror ``enqueue``'s arguments."""

    topic: str
    payload: Any
    key: str | None = None
    headers: Mapping[str, str | bytes] | None = None
    type: str | None = None
    priority: int = 0
    partition: int | None = None


NO_HEADERS = "{}"  # the headers column of a row with none, as enqueue encodes it


@dataclass(slots=True)
class Row:
    """A validated message, as its columns (not frozen: a frozen dataclass sets each field through a call)."""

    topic: str
    key: str | None
    key_utf8: bytes | None
    type: str | None
    payload: str | None  # JSON text
    payload_bytes: bytes | None  # or bytes, published unchanged
    headers: str
    priority: int
    partition: int | None
    hash: int
    size: int  # of the relay's record of it (record_size.py)


def validate(m: Message, limit: RecordLimit, index: int, topics: set[str], *, hashed: bool = True) -> Row:
    """``topics``: the call's topics already checked (a topic's check is a regular expression). The size checked is
    the relay's record of the message (record_size.py). ``hashed=False``: no key hash (``Row.hash`` 0), for a wal
    outbox, whose relay routes by key itself (the hash in Python is a fifth of a row's client time)."""
    where = f"message {index}"
    topic = m.topic
    if not isinstance(topic, str) or topic not in topics:
        topics.add(_check_topic(topic, where))
    key = m.key
    key_bytes = _text_bytes(key, "key", where) if key is not None else b""
    type_ = m.type
    type_size = None if type_ is None else len(_text_bytes(type_, "type", where))
    payload, payload_bytes, payload_size = _encode_payload(m.payload, where)
    headers, headers_size, own = _encode_headers(m.headers, where)
    if isinstance(m.priority, bool) or not isinstance(m.priority, int) or m.priority not in _SMALLINT:
        raise InvalidMessageError(f"{where}: priority must be an integer in -32768..32767, got {m.priority!r}")
    if m.partition is not None and (
        isinstance(m.partition, bool) or not isinstance(m.partition, int) or m.partition not in _INT4
    ):
        raise InvalidMessageError(f"{where}: partition must be an integer in 0..2^31-1, got {m.partition!r}")
    size = RELAY_BASE + len(key_bytes) + payload_size + headers_size
    if type_size is not None:
        size += header_bytes(4, type_size)  # "type"
    if limit.cloud_events is not None:
        added, dropped = limit.cloud_events_bytes(topic, type_size, own, payload_bytes is not None)
        size += added - dropped
    if size > limit.max_bytes:
        raise InvalidMessageError(
            f"{where} to topic {topic!r} is {size} bytes, over the maximum of {limit.max_bytes} bytes "
            "(OUTBOX_MAX_MESSAGE_BYTES; counted as the relay sends it: the key, the payload as published, every "
            "header, the record's overhead)"
        )
    return Row(
        topic=topic,
        key=key,
        key_utf8=key_bytes if key is not None else None,
        type=type_,
        payload=payload,
        payload_bytes=payload_bytes,
        headers=headers,
        priority=m.priority,
        partition=m.partition,
        # No key: spread evenly over the topic's partitions. Not hashed: 0 (a wal outbox's relay routes by key).
        hash=(key_hash(key_bytes) if key is not None else random.getrandbits(31)) if hashed else 0,
        size=size,
    )


def _check_topic(topic: object, where: str) -> str:
    if not isinstance(topic, str) or not topic:
        raise InvalidMessageError(f"{where}: topic must be a non-empty string, got {topic!r}")
    if not is_valid_topic(topic):
        raise InvalidMessageError(
            f"{where}: invalid Kafka topic name {topic[:260]!r}: use 1..249 characters from [a-zA-Z0-9._-], "
            "not '.' or '..'"
        )
    return topic


def _text_bytes(value: object, field: str, where: str) -> bytes:
    """A text column's value as UTF-8, checked: a str, no NUL (PostgreSQL's text cannot hold it), encodable."""
    if not isinstance(value, str):
        raise InvalidMessageError(f"{where}: {field} must be a string or None, got {type(value).__name__}")
    if "\x00" in value:
        raise InvalidMessageError(f"{where}: {field} must not contain NUL characters")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidMessageError(f"{where}: {field} is not valid Unicode text: {exc.reason}") from None


def _encode_payload(payload: Any, where: str) -> tuple[str | None, bytes | None, int]:
    """(JSON text, None, the size of PostgreSQL's text of it in UTF-8, which the relay publishes) for a JSON payload;
    (None, the bytes, their size) for bytes, stored and published as given."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        raw = bytes(payload)
        return None, raw, len(raw)
    try:
        text = _to_json(payload)
    except (TypeError, ValueError) as exc:
        raise InvalidMessageError(f"{where}: payload is not JSON-serialisable: {exc}") from None
    except RecursionError:
        raise InvalidMessageError(f"{where}: payload is nested too deeply to serialise") from None
    if "\\u0000" in text and _JSON_NUL.search(text):
        raise InvalidMessageError(f"{where}: payload contains a NUL character, which jsonb cannot store")
    try:
        return text, None, jsonb_text_bytes(text)
    except UnicodeEncodeError as exc:
        raise InvalidMessageError(f"{where}: payload is not valid Unicode text: {exc.reason}") from None
    except RecursionError:
        raise InvalidMessageError(f"{where}: payload is nested too deeply to serialise") from None


_NO_OWN: Mapping[str, int] = MappingProxyType({})


def _encode_headers(headers: Mapping[str, str | bytes] | None, where: str) -> tuple[str, int, Mapping[str, int]]:
    """(the headers column's JSON, the headers' bytes in the record, each one's value length by name)."""
    if headers is None:
        return NO_HEADERS, 0, _NO_OWN
    if not isinstance(headers, Mapping):
        raise InvalidMessageError(f"{where}: headers must be a mapping of str to str or bytes")
    stored: dict[str, object] = {}
    lengths: dict[str, int] = {}
    size = 0
    for name, value in headers.items():
        if not isinstance(name, str) or not name:
            raise InvalidMessageError(f"{where}: header names must be non-empty strings, got {name!r}")
        if name in RESERVED_HEADERS:
            raise InvalidMessageError(f"{where}: header {name!r} is reserved: the relay sets it")
        name_size = len(_text_bytes(name, f"header name {name!r}", where))
        if isinstance(value, str):
            value_size = len(_text_bytes(value, f"header {name!r}", where))
            stored[name] = value
        elif isinstance(value, (bytes, bytearray)):
            stored[name] = {BYTES_HEADER_FIELD: base64.b64encode(value).decode("ascii")}
            value_size = len(value)
        else:
            raise InvalidMessageError(f"{where}: header {name!r} must be str or bytes, got {type(value).__name__}")
        lengths[name] = value_size
        size += header_bytes(name_size, value_size)
    return _to_json(stored), size, lengths
