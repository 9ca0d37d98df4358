"""Dead letters and key-scoped quarantine for the wal relay, in the table strategies' tables, so `outbox dead-letters`
lists, retries and discards them the same way. See docs/wal.md#dead-letters-and-held-keys."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from functools import partial

import psycopg
from psycopg import sql

from ...config import OutboxTable
from ...model import DeliveryFailure, OutboxRecord
from ...store.database_encoding import database_codec, unholdable
from ...store.wal import format as wal_format
from ...store.wal.format import UNSTORABLE_TOPIC, MalformedMessage
from ...strategies.base import RECORD_COLUMNS, fetch_records
from ...strategies.quarantine import OnPoison, dead_letter_held
from ...timestamps import as_parameter

log = logging.getLogger(__name__)

# A held message and a dead letter keep a message's columns; the stream gives a wal message no priority, and its
# transaction's commit position as its transaction_id.
_VALUES = "%s, %s::uuid, %s, %s, %s, %s::jsonb, %s, %s::jsonb, %s, 0, %s::text::xid8, %s"
_DEAD_LETTER = """
    INSERT INTO {dead_letters} (
        id, message_id, topic, key, type, payload, payload_bytes, headers, partition, priority, transaction_id,
        created_at, attempts, last_error, dead_lettered_by)
    VALUES ({values}, %s, %s, %s)
    ON CONFLICT (id) DO NOTHING
"""
_KEEP = """
    INSERT INTO {held} (id, message_id, topic, key, type, payload, payload_bytes, headers, partition, priority,
                        transaction_id, created_at)
    VALUES ({values}) ON CONFLICT (id) DO NOTHING
"""


class Unstorable(ValueError):
    """A message whose topic, key, type or headers this database cannot hold as text (a writer that did not check
    the database's encoding, store/database_encoding.py)."""


def _columns(
    r: OutboxRecord, codec: str | None, *, as_bytes: bool = False, extra: tuple[object, ...] = ()
) -> tuple[object, ...]:
    """The message's columns, then ``extra``; its JSON payload as its bytes (``payload_bytes``) when the database cannot
    hold it as jsonb (``as_bytes``, or a character its encoding lacks): published unchanged all the same."""
    try:
        key = None if r.key is None else r.key.decode()
        type_ = None if r.type is None else r.type.decode()
    except UnicodeDecodeError:
        raise Unstorable("a key or type that is not UTF-8") from None
    if codec is not None and (bad := unholdable((r.topic, key, type_, r.headers), codec)) is not None:
        raise Unstorable(f"{bad!r} in its topic, key, type or headers")
    payload = None
    if not (r.binary or as_bytes):
        try:
            payload = r.payload.decode()
        except UnicodeDecodeError:
            payload = None
        if payload is not None and codec is not None and unholdable((payload,), codec) is not None:
            payload = None
    return (
        r.id,
        r.message_id.decode(),
        r.topic,
        key,
        type_,
        payload,
        r.payload if payload is None else None,
        r.headers,
        max(r.partition, 0),
        r.transaction_id,
        as_parameter(r.created_at),
        *extra,
    )


def _held_columns(r: OutboxRecord, codec: str | None, *, plain: bool = False) -> tuple[object, ...]:
    """A held message's columns: the message whole, as emitted, in ``payload_bytes`` (what ``held`` publishes: its
    payload byte for byte, its headers in their order, its payload's kind); topic and key as its hold names them; type
    and headers for whoever reads the table, left out (``plain``, or a character the database lacks) where the
    database cannot hold them. A message id another writer spelled its own way: the columns, as a dead letter's."""
    if r.key is None or not _canonical(r.message_id):
        return _columns(r, codec)
    try:
        type_ = None if plain or r.type is None else r.type.decode()
    except UnicodeDecodeError:
        type_ = None
    headers = "{}" if plain else r.headers
    if codec is not None and unholdable((type_, headers), codec) is not None:
        type_, headers = None, "{}"
    key = r.key.decode()
    if codec is not None and (bad := unholdable((r.topic, key), codec)) is not None:
        raise Unstorable(f"{bad!r} in its topic or key")
    row = (r.id, r.message_id.decode(), r.topic, key, type_, None, _emitted(r), headers, max(r.partition, 0))
    return (*row, r.transaction_id, as_parameter(r.created_at))


def _as_emitted(r: OutboxRecord) -> OutboxRecord:
    """A held row's record, read from the message it keeps whole (``_held_columns``); a row kept otherwise (before
    this version, or a dead letter retried into ``outbox_held``) as its columns say."""
    if not r.binary:
        return r
    try:
        m = wal_format.record(r.payload, r.id, r.transaction_id)
    except MalformedMessage:
        return r
    if (m.message_id, m.topic, m.key) != (r.message_id, r.topic, r.key):
        return r  # a bytes payload, not a message kept whole
    return m._replace(attempts=r.attempts)


def _canonical(message_id: bytes) -> bool:
    try:
        return str(uuid.UUID(message_id.decode())).encode() == message_id
    except ValueError:  # UnicodeDecodeError too: bytes another writer made
        return False


def _uuid_or_nil(message_id: bytes) -> str:
    try:
        return str(uuid.UUID(message_id.decode()))
    except ValueError:  # UnicodeDecodeError too: bytes another writer made
        return str(uuid.UUID(int=0))


def _emitted(r: OutboxRecord) -> bytes:
    """The message as its writer emitted it (store/wal/format.py), for a dead letter that keeps it whole."""
    return wal_format.encode(
        r.message_id,
        r.topic.encode(),
        r.key,
        r.type,
        r.headers.encode(),
        r.payload,
        binary=r.binary,
        partition=None if r.partition < 0 else r.partition,
        created_at=r.created_at,
    )


class WalHolds:
    """The keys held on one outbox, as the streaming relay sees them (loaded when it starts streaming)."""

    def __init__(self, table: OutboxTable, on_poison: OnPoison, worker_id: str) -> None:
        self.table = table
        self.on_poison = on_poison
        self.worker_id = worker_id
        self.keys: set[tuple[str, bytes]] = set()
        self.codec: str | None = None  # the database's encoding, when it cannot hold every character

    def load(self, conn: psycopg.Connection) -> None:
        rows = conn.execute(sql.SQL("SELECT topic, key FROM {}").format(self.table.holds)).fetchall()
        self.keys = {(topic, key.encode()) for topic, key in rows}
        self.codec = database_codec(conn)

    def holds(self, record: OutboxRecord) -> bool:
        return record.key is not None and (record.topic, record.key) in self.keys

    def dead_letter(self, conn: psycopg.Connection, failures: Sequence[DeliveryFailure]) -> None:
        """Dead-letter each failure, and hold its key (quarantine), in one transaction."""
        query = sql.SQL(_DEAD_LETTER).format(dead_letters=self.table.dead_letters, values=sql.SQL(_VALUES))
        with conn.transaction():
            for failure in failures:
                r = failure.record
                log.error(
                    "dead-lettering message %s to %s: %s", r.message_id.decode(errors="replace"), r.topic, failure.error
                )
                error = self._holdable(failure.error)
                attempts = (
                    partial(_columns, r, self.codec, extra=(r.attempts + 1, error, self.worker_id)),
                    partial(_columns, r, self.codec, as_bytes=True, extra=(r.attempts + 1, error, self.worker_id)),
                )
                stored = self._write(conn, query, r, attempts, error)
                if stored and self.on_poison == "quarantine" and r.key is not None and not self.holds(r):
                    conn.execute(
                        sql.SQL(
                            "INSERT INTO {holds} (topic, key, partition, dead_letter_id) VALUES (%s, %s, 0, %s) "
                            "ON CONFLICT (topic, key) DO NOTHING"
                        ).format(holds=self.table.holds),
                        (r.topic, r.key.decode(), r.id),
                    )
                    self.keys.add((r.topic, r.key))

    def keep(self, conn: psycopg.Connection, records: Sequence[OutboxRecord]) -> None:
        """Write held keys' messages to ``outbox_held`` (again, after a crash: nothing changes)."""
        if not records:
            return
        query = sql.SQL(_KEEP).format(held=self.table.held, values=sql.SQL(_VALUES))
        try:
            params = [_held_columns(r, self.codec) for r in records]
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(query, params)
            return
        except (ValueError, psycopg.DataError):  # Unstorable, a message id that is no UUID, what jsonb refuses
            pass  # one of them cannot be stored as it is: one at a time
        for r in records:
            attempts = (partial(_held_columns, r, self.codec), partial(_held_columns, r, self.codec, plain=True))
            self._write(conn, query, r, attempts, "held behind a dead letter of its key")

    def _holdable(self, text: str) -> str:
        """``text`` with what the database cannot hold escaped (an error naming a character it lacks)."""
        return text if self.codec is None else text.encode(self.codec, "backslashreplace").decode(self.codec)

    def _write(
        self,
        conn: psycopg.Connection,
        query: sql.Composed,
        r: OutboxRecord,
        attempts: Sequence[Callable[[], tuple[object, ...]]],
        error: str,
    ) -> bool:
        """Write one message's row with the first of ``attempts`` (its columns) the database takes; False when it
        takes none, and the message was dead-lettered whole instead, as the bytes it was emitted as: never a crash at
        the same message at every start, never lost."""
        reason = ""
        for columns in attempts:
            try:
                params = columns()
                with conn.transaction():
                    conn.execute(query, params)
                return True
            except Unstorable as exc:
                reason = f"{exc}, in a database whose encoding is {conn.info.parameter_status('server_encoding')}"
                break
            except (psycopg.DataError, ValueError) as exc:  # ValueError: a message id that is no UUID
                reason = str(exc).strip().splitlines()[0]
        log.error(
            "message %s to %s cannot be stored in this database (%s): dead-lettered whole under %s, as the bytes it "
            "was emitted as; its key is not held",
            r.message_id.decode(errors="replace"),
            r.topic,
            reason,
            UNSTORABLE_TOPIC,
        )
        params = (
            r.id,
            _uuid_or_nil(r.message_id),
            UNSTORABLE_TOPIC,
            None,
            None,
            None,
            _emitted(r),
            "{}",
            0,
            r.transaction_id,
            as_parameter(r.created_at),
            r.attempts + 1,
            self._holdable(
                f"{error}; this database cannot hold it as a row ({reason}): payload_bytes is the message as emitted "
                "(store/wal/format.py)"
            ),
            self.worker_id,
        )
        dead_letters = sql.SQL(_DEAD_LETTER).format(dead_letters=self.table.dead_letters, values=sql.SQL(_VALUES))
        conn.execute(dead_letters, params)
        return False

    def released(self, conn: psycopg.Connection) -> list[tuple[str, str]]:
        """Keys an operator released (a retry or a discard of their dead letter), oldest first."""
        if not self.keys:
            return []
        return [
            (topic, key)
            for topic, key in conn.execute(
                sql.SQL("SELECT topic, key FROM {} WHERE released_at IS NOT NULL ORDER BY released_at").format(
                    self.table.holds
                )
            ).fetchall()
        ]

    def held(self, conn: psycopg.Connection, topic: str, key: str) -> list[OutboxRecord]:
        """A released key's held messages, in stream order: by commit, then by position in the transaction (a message
        written first may commit last)."""
        return [
            _as_emitted(r)
            for r in fetch_records(
                conn,
                sql.SQL(
                    "SELECT {columns} FROM {held} m WHERE m.topic = %(topic)s AND m.key = %(key)s "
                    "ORDER BY m.transaction_id, m.id"
                ).format(columns=sql.SQL(RECORD_COLUMNS), held=self.table.held),
                {"topic": topic, "key": key},
            )
        ]

    def published(self, conn: psycopg.Connection, ids: Sequence[int]) -> None:
        """Held messages Kafka has now: gone from ``outbox_held`` (the key stays held)."""
        if ids:
            conn.execute(sql.SQL("DELETE FROM {} WHERE id = ANY(%s)").format(self.table.held), (list(ids),))

    def dead_letter_held(self, conn: psycopg.Connection, failure: DeliveryFailure) -> None:
        """A released key's held message Kafka refused: its dead letter again (a retried one is reopened), and the key
        held behind it again, in one transaction."""
        log.error(
            "dead-lettering held message %s to %s: %s",
            failure.record.message_id.decode(),
            failure.record.topic,
            failure.error,
        )
        with conn.transaction():
            dead_letter_held(conn, self.table, [failure], self.worker_id)

    def end(self, conn: psycopg.Connection, topic: str, key: str, published: Sequence[int]) -> None:
        """The key flows again: its published held messages and its hold deleted."""
        with conn.transaction():
            conn.execute(sql.SQL("DELETE FROM {} WHERE id = ANY(%s)").format(self.table.held), (list(published),))
            conn.execute(
                sql.SQL("DELETE FROM {holds} WHERE topic = %s AND key = %s").format(holds=self.table.holds),
                (topic, key),
            )
        self.keys.discard((topic, key.encode()))


def dead_letters_not_confirmed(conn: psycopg.Connection, table: OutboxTable, slot: str) -> set[int]:
    """The dead letters at or past the slot's confirmed position: a relay that dead-lettered them and lost its stream
    before it confirmed past them sees them again, and must neither publish nor hold them (an operator's discard
    would otherwise publish what it discarded)."""
    rows = conn.execute(
        sql.SQL(
            """
            SELECT d.id FROM {dead_letters} d
            WHERE d.id >= (SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots
                           WHERE slot_name = %s AND database = current_database())
            """
        ).format(dead_letters=table.dead_letters),
        (slot,),
    ).fetchall()
    return {int(row[0]) for row in rows}
