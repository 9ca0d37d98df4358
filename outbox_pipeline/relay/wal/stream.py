"""One streaming replication connection to one logical slot, started where the recorded or confirmed position says, so a
backlog is decoded once. See docs/wal.md#the-replication-stream."""

from __future__ import annotations

import getpass
import os
import re
import select
import time
from dataclasses import dataclass
from types import TracebackType

import psycopg
from psycopg import errors, sql
from psycopg.conninfo import conninfo_to_dict

from ...errors import OutboxError
from .pgoutput import (
    Keepalive,
    Message,
    Other,
    StreamEvent,
    decode_frame,
    format_lsn,
    parse_lsn,
    pg_clock_us,
    standby_status,
)

#: How often an idle stream tells the server it is alive (and where it stands): well inside PostgreSQL's default
#: wal_sender_timeout (60 s), past which the server ends a stream it has not heard from.
DEFAULT_STATUS_INTERVAL_S = 10.0
#: pgoutput streams logical decoding messages (its ``messages`` option) from PostgreSQL 14 on.
MESSAGES_SINCE_SERVER_VERSION = 140000
_FLUSH_WAIT_MS = 1000


class ReplicationStreamError(OutboxError):
    """A slot cannot be streamed for a reason retrying the connection does not fix."""


class SlotNotFoundError(ReplicationStreamError):
    """The slot does not exist in the stream's database."""

    def __init__(self, slot: str) -> None:
        super().__init__(
            f"replication slot {slot!r} does not exist in this database: create it with "
            f"SELECT pg_create_logical_replication_slot({slot!r}, 'pgoutput')"
        )
        self.slot = slot


class SlotInUseError(ReplicationStreamError):
    """Another process streams the slot (one stream per slot): ``pid`` is its server process, None if the server's
    message did not name it."""

    def __init__(self, slot: str, pid: int | None) -> None:
        held = f"PID {pid}" if pid is not None else "another process"
        super().__init__(
            f"replication slot {slot!r} is active for {held}: a slot streams to one process at a time. Wait for "
            f"it to end, or end it if it is stale: SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
            f"WHERE slot_name = {slot!r}"
        )
        self.slot = slot
        self.pid = pid


class ReplicationNotPermittedError(ReplicationStreamError):
    """The relay's role may not stream (no REPLICATION attribute): retrying cannot fix it, an operator's grant does."""

    def __init__(self, role: str) -> None:
        super().__init__(
            f"the role {role!r} has no REPLICATION attribute: PostgreSQL refuses it the replication connection a wal "
            f"relay streams its slot over. Grant it (ALTER ROLE {role} REPLICATION; on RDS: GRANT rds_replication TO "
            f"{role}) or run the relay as a role that has it, then start the relay again"
        )
        self.role = role


# The server's refusal of a role without REPLICATION: PostgreSQL 16 on, then 14 and 15.
_NOT_PERMITTED = ("permission denied to start WAL sender", "must be superuser or replication role to start walsender")


def _connect(dsn: str) -> psycopg.Connection:
    """A replication connection; a role the server refuses one is a ReplicationNotPermittedError, not an outage."""
    try:
        return psycopg.connect(dsn, replication="database", autocommit=True)
    except psycopg.OperationalError as exc:
        if not any(words in str(exc) for words in _NOT_PERMITTED):
            raise
        role = conninfo_to_dict(dsn).get("user") or os.environ.get("PGUSER") or getpass.getuser()
        raise ReplicationNotPermittedError(str(role)) from None


class StreamEndedError(psycopg.OperationalError):
    """The server ended the stream (it shuts down, or its walsender was terminated): for the relay, as any lost
    connection, the database is unavailable until a new stream opens."""


@dataclass(frozen=True)
class Resume:
    """Where a relay's stream of a slot may start: the server (its system identifier and timeline) and the position
    recorded on it, every message before which Kafka has."""

    system: str
    timeline: int
    lsn: int


class ReplicationStream:
    """A logical slot streamed through pgoutput with ``messages 'true'``: Begin, Message, Commit in commit order, and
    the server's keepalives. Not thread-safe: one relay loop reads, confirms and closes it. Open with ``open()``."""

    def __init__(
        self, conn: psycopg.Connection, slot: str, confirmed: int, status_interval_s: float, server: tuple[str, int]
    ) -> None:
        self.slot = slot
        self._server = server
        self._conn = conn
        self._pgconn = conn.pgconn
        self._confirmed = confirmed
        self._status_interval_s = status_interval_s
        self._status_due = time.monotonic() + status_interval_s
        self._readable = select.poll()  # not select(): a descriptor past 1,024 is fine
        self._readable.register(self._pgconn.socket, select.POLLIN)
        self._flushable = select.poll()
        self._flushable.register(self._pgconn.socket, select.POLLIN | select.POLLOUT)

    @classmethod
    def open(
        cls,
        dsn: str,
        slot: str,
        publication: str,
        start_lsn: int = 0,
        *,
        status_interval_s: float = DEFAULT_STATUS_INTERVAL_S,
        resume: Resume | None = None,
    ) -> ReplicationStream:
        """Stream ``slot`` from ``start_lsn``; 0 (``0/0``) starts at the slot's confirmed position, as does any
        position before it; ``resume``, the position the relays recorded, if it is later and on this server and
        timeline. ``publication`` must exist (pgoutput requires one; an empty one sends no row changes)."""
        conn = _connect(dsn)
        try:
            version = conn.info.server_version
            if version < MESSAGES_SINCE_SERVER_VERSION:
                raise ReplicationStreamError(
                    f"PostgreSQL {version // 10000} cannot stream logical decoding messages: pgoutput sends them "
                    f"(its messages option) from PostgreSQL 14 on"
                )
            row = conn.execute("IDENTIFY_SYSTEM").fetchone()
            assert row is not None  # one row, always
            server, flushed = (str(row[0]), int(row[1])), parse_lsn(str(row[2]))
            if resume is not None and (resume.system, resume.timeline) == server and resume.lsn <= flushed:
                start_lsn = max(start_lsn, resume.lsn)
            conn.execute(_start_replication(slot, publication, start_lsn))
        except errors.UndefinedObject as exc:
            conn.close()
            raise SlotNotFoundError(slot) from exc
        except errors.ObjectInUse as exc:
            conn.close()
            raise SlotInUseError(slot, _pid_in(exc, slot)) from exc
        except BaseException:
            conn.close()
            raise
        return cls(conn, slot, start_lsn, status_interval_s, server)

    @property
    def confirmed(self) -> int:
        """The highest position confirmed to the slot by this stream (its start position until the first)."""
        return self._confirmed

    @property
    def server(self) -> tuple[str, int]:
        """The server streamed: its system identifier and timeline (IDENTIFY_SYSTEM)."""
        return self._server

    def read(self, timeout_s: float) -> list[StreamEvent]:
        """Everything the server has sent so far, decoded; if nothing, waits up to ``timeout_s`` for the first
        frames. Answers the server's reply requests at once, and sends a status update whenever
        ``status_interval_s`` has passed since the last. Raises ``psycopg.OperationalError`` when the stream ends
        or the connection is lost."""
        events: list[StreamEvent] = []
        try:
            self._drain(events)
            if not events:
                self._pgconn.consume_input()  # what the socket holds now, without waiting
                self._drain(events)
            deadline = time.monotonic() + timeout_s
            while not events:
                now = time.monotonic()
                if now >= self._status_due:
                    self._send_status()
                if now >= deadline:
                    break
                self._readable.poll(1000 * min(deadline, self._status_due) - 1000 * now)
                self._pgconn.consume_input()
                self._drain(events)
            if time.monotonic() >= self._status_due:
                self._send_status()
        except StreamEndedError:
            raise
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from exc
        return events

    def confirm(self, lsn: int) -> None:
        """Every message before ``lsn`` is done with (for a transaction: its Commit's ``end_lsn``): the slot may
        release the WAL before it, and a later stream starts there. Sent at once; a lower position is ignored."""
        if lsn > self._confirmed:
            self._confirmed = lsn
        try:
            self._send_status()
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from exc

    def close(self) -> None:
        """End the connection; the server releases the slot once its process has seen the end."""
        self._conn.close()

    def __enter__(self) -> ReplicationStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _drain(self, events: list[StreamEvent]) -> None:
        """Decode the frames libpq has buffered (``get_copy_data(1)`` does not read the socket)."""
        get_copy_data = self._pgconn.get_copy_data
        append = events.append
        while True:
            size, frame = get_copy_data(1)
            if size <= 0:
                if size == 0:
                    return
                self._ended()
            event = decode_frame(frame)
            if type(event) is Message:  # the common case first, by exact type (cheaper than isinstance)
                append(event)
            elif type(event) is Keepalive:
                if event.reply_requested:
                    self._send_status()
                append(event)
            elif not isinstance(event, Other):
                append(event)

    def _send_status(self) -> None:
        lsn = self._confirmed
        self._pgconn.put_copy_data(standby_status(lsn, lsn, lsn, pg_clock_us(time.time())))
        while self._pgconn.flush():  # 1: not all sent yet (psycopg's connections are nonblocking)
            # As libpq's docs say: wait until the socket takes more or has input, and read that input meanwhile.
            self._flushable.poll(_FLUSH_WAIT_MS)
            self._pgconn.consume_input()
        self._status_due = time.monotonic() + self._status_interval_s

    def _ended(self) -> None:
        """The server ended the COPY: its result says why."""
        result = self._pgconn.get_result()
        reason = result.error_message.decode(errors="replace").strip() if result is not None else ""
        raise StreamEndedError(
            f"the server ended the replication stream of slot {self.slot!r}: {reason or 'no reason given'}"
        )

    def _lost(self, exc: psycopg.OperationalError) -> psycopg.OperationalError:
        return psycopg.OperationalError(f"the replication stream of slot {self.slot!r} is lost: {exc}")


def _start_replication(slot: str, publication: str, start_lsn: int) -> sql.Composed:
    """START_REPLICATION of ``slot`` through pgoutput with logical decoding messages, from ``start_lsn``."""
    # A replication command takes no parameters (its grammar has none, and a walsender speaks only the simple query
    # protocol), so the values are quoted here, each as the server reads it back exactly: the slot as an identifier
    # (sql.Identifier); the publication as one double-quoted name inside the option's string (pgoutput splits
    # publication_names as a list of identifiers: quoted, a name is taken as written), the string with its quotes
    # doubled, the only escape the replication scanner knows (sql.Literal would write E'...' for a backslash, which
    # it does not parse). The position is our own hex. Nothing else reaches the text.
    names = '"' + publication.replace('"', '""') + '"'
    return sql.SQL(
        "START_REPLICATION SLOT {slot} LOGICAL {lsn} (proto_version '1', publication_names {names}, messages 'true')"
    ).format(
        slot=sql.Identifier(slot),
        lsn=sql.SQL(format_lsn(start_lsn)),
        names=sql.SQL("'" + names.replace("'", "''") + "'"),
    )


def _pid_in(exc: psycopg.Error, slot: str) -> int | None:
    """The PID in 'replication slot "s" is active for PID n', in whichever language the server speaks: the one
    number left once the slot's name is taken out."""
    found = re.search(r"\d+", (exc.diag.message_primary or str(exc)).replace(slot, ""))
    return int(found[0]) if found else None
