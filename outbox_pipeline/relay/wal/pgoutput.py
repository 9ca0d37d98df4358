"""The wal strategy's wire format decoded without I/O: replication protocol frames and the pgoutput messages inside
them, built for a backlog's speed. See docs/wal.md#the-wire-format."""

from __future__ import annotations

import re
from struct import Struct
from typing import NamedTuple

from ...timestamps import PG_EPOCH

# Frame types (the first byte of a CopyData message of the stream) and pgoutput message types, as ints: indexing a
# memoryview or bytes gives an int.
_XLOG_DATA = ord("w")
_KEEPALIVE = ord("k")
_MESSAGE = ord("M")
_BEGIN = ord("B")
_COMMIT = ord("C")

#: XLogData: Byte1('w'), Int64 dataStart, Int64 walEnd, Int64 sendTime; the pgoutput message follows.
XLOG_DATA_HEADER = 25
#: Primary keepalive, after Byte1('k'): Int64 walEnd, Int64 sendTime, Byte1 replyRequested.
_KEEPALIVE_BODY = Struct(">Qq?")
#: Begin, after Byte1('B'): Int64 final LSN (the commit record's), Int64 commit time, Int32 xid.
_BEGIN_BODY = Struct(">QqI")
#: Commit, after Byte1('C'): Int8 flags, Int64 commit LSN, Int64 end LSN, Int64 commit time.
_COMMIT_BODY = Struct(">BQQq")
#: Message, after Byte1('M'): Int8 flags, Int64 LSN; then String prefix (NUL-terminated), Int32 length, Byten content.
_MESSAGE_HEAD = Struct(">BQ")
_LENGTH = Struct(">I")
_TRANSACTIONAL = 1
#: Standby status update: Byte1('r'), Int64 written, Int64 flushed, Int64 applied, Int64 clock, Byte1 replyRequested.
_STATUS_UPDATE = Struct(">cQQQq?")
_PG_EPOCH_UNIX_S = PG_EPOCH.timestamp()
_LSN_TEXT = re.compile(r"([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})")


class Begin(NamedTuple):
    """A transaction starts; its messages follow, then its Commit. ``final_lsn`` is where its commit record starts
    (the Commit's ``commit_lsn``); ``commit_time`` in microseconds since 2000-01-01 UTC."""

    final_lsn: int
    commit_time: int
    xid: int


class Commit(NamedTuple):
    """A transaction ends. Confirming ``end_lsn`` to the slot means: this transaction and every one before it are
    done, a stream opened later starts after it."""

    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: int


class Message(NamedTuple):
    """A logical decoding message (``pg_logical_emit_message``); a transactional one arrives between its transaction's
    Begin and Commit, a non-transactional one on its own, as soon as it is written."""

    transactional: bool
    lsn: int
    prefix: bytes  # as written: UTF-8 for a prefix written in SQL
    content: bytes


class Keepalive(NamedTuple):
    """The server's heartbeat: where its WAL ends (``wal_end``: a position the relay may confirm when it has nothing
    in flight), and whether it wants a status update at once (it ends the stream at ``wal_sender_timeout`` without
    one)."""

    wal_end: int
    send_time: int
    reply_requested: bool


class Other(NamedTuple):
    """A pgoutput message the relay has no use for (Relation, Insert, Type, Origin, ...), by its type byte."""

    kind: str


#: What a stream's ``read()`` returns.
StreamEvent = Begin | Commit | Message | Keepalive
Event = StreamEvent | Other


def decode_frame(frame: bytes | memoryview) -> Event:
    """One CopyData message of a logical replication stream (as ``get_copy_data`` returns it): an XLogData frame's
    pgoutput message, or a keepalive."""
    kind = frame[0]
    if kind == _XLOG_DATA:
        if frame[XLOG_DATA_HEADER] == _MESSAGE:  # the common case, one call less
            return _message(frame, XLOG_DATA_HEADER + 1)
        return decode_pgoutput(frame, XLOG_DATA_HEADER)
    if kind == _KEEPALIVE:
        wal_end, send_time, reply = _KEEPALIVE_BODY.unpack_from(frame, 1)
        return Keepalive(wal_end, send_time, reply)
    raise ValueError(f"not a frame of a logical replication stream: type {chr(kind)!r}, {len(frame)} bytes")


def decode_pgoutput(buffer: bytes | memoryview, offset: int = 0) -> Event:
    """The pgoutput message (protocol version 1) that starts at ``offset`` of ``buffer``."""
    kind = buffer[offset]
    if kind == _MESSAGE:
        return _message(buffer, offset + 1)
    if kind == _BEGIN:
        final_lsn, commit_time, xid = _BEGIN_BODY.unpack_from(buffer, offset + 1)
        return Begin(final_lsn, commit_time, xid)
    if kind == _COMMIT:
        flags, commit_lsn, end_lsn, commit_time = _COMMIT_BODY.unpack_from(buffer, offset + 1)
        return Commit(flags, commit_lsn, end_lsn, commit_time)
    return Other(chr(kind))


def _message(buffer: bytes | memoryview, at: int) -> Message:
    """A Message's body from ``at``: the frame is copied once, and the prefix and content sliced from the copy."""
    data = buffer.tobytes() if type(buffer) is memoryview else buffer
    flags, lsn = _MESSAGE_HEAD.unpack_from(data, at)
    start = at + _MESSAGE_HEAD.size
    nul = data.find(0, start)
    if nul < 0:
        raise ValueError(f"logical decoding message at {format_lsn(lsn)}: its prefix has no end")
    (size,) = _LENGTH.unpack_from(data, nul + 1)
    begin = nul + 1 + _LENGTH.size
    if begin + size != len(data):
        raise ValueError(
            f"logical decoding message at {format_lsn(lsn)}: {size} bytes of content announced, "
            f"{len(data) - begin} in the frame"
        )
    return Message(flags & _TRANSACTIONAL != 0, lsn, data[start:nul], data[begin:])


def standby_status(written: int, flushed: int, applied: int, clock_us: int, reply_requested: bool = False) -> bytes:
    """A standby status update: the positions the client has written, flushed and applied (for a logical slot,
    ``flushed`` is what the slot confirms), and its clock (``pg_clock_us``)."""
    return _STATUS_UPDATE.pack(b"r", written, flushed, applied, clock_us, reply_requested)


def pg_clock_us(unix_s: float) -> int:
    """A Unix time as the protocol's clock: microseconds since 2000-01-01 UTC."""
    return round((unix_s - _PG_EPOCH_UNIX_S) * 1_000_000)


def format_lsn(lsn: int) -> str:
    """An LSN in PostgreSQL's text form, ``X/Y`` (two 32-bit halves in hex)."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    """An LSN from its text form (``16/B374D848``, as ``pg_lsn`` prints it)."""
    match = _LSN_TEXT.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not an LSN: {text!r} (expected X/Y, two hexadecimal numbers of up to 8 digits)")
    return int(match[1], 16) << 32 | int(match[2], 16)
