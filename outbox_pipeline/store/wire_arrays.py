"""One-dimensional PostgreSQL arrays in binary, built from their elements' bytes, because psycopg's element-by-element
dump cost writers about 3 us a row. See docs/performance.md#writer-cost-what-the-outbox-costs-a-services-transaction."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import ClassVar

from psycopg.abc import AdaptContext, Buffer
from psycopg.adapt import AdaptersMap, Dumper
from psycopg.pq import Format

_HEADER = struct.Struct("!iiIii")
_LENGTH = struct.Struct("!i").pack
_NULL = _LENGTH(-1)
_UUID_LENGTH = _LENGTH(16)

# Element and array type oids (pg_type; fixed since PostgreSQL 8.3).
_TEXT, _UUID, _INT8, _BYTEA = 25, 2950, 20, 17
_TEXT_ARRAY, _UUID_ARRAY, _INT8_ARRAY, _BYTEA_ARRAY = 1009, 2951, 1016, 1001


class WireArray(bytes):
    """An array parameter already in PostgreSQL's binary form; its subclass names the array type."""

    oid: ClassVar[int]


class TextArray(WireArray):
    oid = _TEXT_ARRAY


class UuidArray(WireArray):
    oid = _UUID_ARRAY


class Int8Array(WireArray):
    oid = _INT8_ARRAY


class ByteaArray(WireArray):
    oid = _BYTEA_ARRAY


class _WireArrayDumper(Dumper):
    format = Format.BINARY

    def __init__(self, cls: type, context: AdaptContext | None = None) -> None:
        super().__init__(cls, context)
        self.oid = cls.oid  # type: ignore[attr-defined]  # a WireArray subclass

    def dump(self, obj: Buffer) -> Buffer:
        return obj


def register(adapters: AdaptersMap) -> None:
    """Let ``adapters`` (a cursor's: nothing outside the call sees it) send WireArrays as they are."""
    adapters.register_dumper(WireArray, _WireArrayDumper)


def text_array(values: Sequence[bytes | None]) -> TextArray:
    """A ``text[]`` of values encoded in the connection's client encoding (None: NULL)."""
    parts = [b""]
    nulls = 0
    for value in values:
        if value is None:
            parts.append(_NULL)
            nulls = 1
        else:
            parts.append(_LENGTH(len(value)))
            parts.append(value)
    parts[0] = _HEADER.pack(1, nulls, _TEXT, len(values), 1)
    return TextArray(b"".join(parts))


def bytea_array(values: Sequence[bytes]) -> ByteaArray:
    """A ``bytea[]`` of ``values`` (a wal writer's messages), none NULL."""
    lengths = [_LENGTH(len(value)) for value in values]
    body = b"".join([part for pair in zip(lengths, values, strict=True) for part in pair])
    return ByteaArray(_HEADER.pack(1, 0, _BYTEA, len(values), 1) + body)


def uuid_array(raw: bytes) -> UuidArray:
    """A ``uuid[]`` of the 16-byte UUIDs ``raw`` holds one after another."""
    count = len(raw) // 16
    elements = [raw[i : i + 16] for i in range(0, 16 * count, 16)]
    return UuidArray(_HEADER.pack(1, 0, _UUID, count, 1) + _UUID_LENGTH + _UUID_LENGTH.join(elements))


def int8_array(values: Sequence[int]) -> Int8Array:
    """A ``bigint[]`` of ``values`` (each element: its length, 8, and the number)."""
    pairs = [n for value in values for n in (8, value)]
    return Int8Array(_HEADER.pack(1, 0, _INT8, len(values), 1) + struct.pack("!" + "iq" * len(values), *pairs))
