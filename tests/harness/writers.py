"""Writers of every kind at once, each a thread with its own session as the application's role: Python ``enqueue``
and ``enqueue_many``, SQL ``outbox.enqueue(...)``, and a plain INSERT (naming ``payload_bytes`` for bytes, and now and
then a ``created_at`` days ahead, which lands in the DEFAULT partition until maintenance moves it). Payloads are JSON
or bytes, keys and headers carry non-ASCII text the database's encoding can store.

Now and then a transaction carries one bad row instead (alone, so a refusal rolls back nothing good):
- ``oversize``: over the producers' message.max.bytes, under enqueue's limit: stored, the relay dead-letters it;
- ``missing-topic``: a topic that does not exist: stored, dead-lettered after ``max_attempts``;
- ``bad-headers``: a header that is neither a string nor ``{"base64": ...}`` (bad padding): refused at enqueue;
- ``nul``: a JSON payload with U+0000, which jsonb cannot store: refused;
- ``unencodable-key``: a key the database's encoding lacks (LATIN1): refused;
- ``reserved-header``: a header named as one the relay sets (``outbox_id``): refused.
Each writer records every row it meant to write and what came of it: committed (when, by the wall clock), refused
(the error), failed (the connection went before the commit) or in doubt (it went during the commit); and, for the
order a wal outbox promises (ledger.py), which of its transactions the row was in and when that transaction's COMMIT
was sent and returned.

On a wal outbox (``OutboxTable(write_to="wal")``) the same forms emit logical decoding messages; the plain INSERT names
its ``message_id`` (the trigger keeps no row, so RETURNING returns none). ``LongTransaction`` is the nemesis's
transaction left open while the writers commit around it.
"""

from __future__ import annotations

import base64
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from outbox_pipeline import Message, enqueue, enqueue_many
from outbox_pipeline.store import SERIALIZED_LOCK_CLASS

from .cluster import MAX_MESSAGE_BYTES, Outbox
from .schedule import Setup

KINDS = ("enqueue", "enqueue_many", "sql", "insert")
MAX_ROWS_PER_STATEMENT_TX = 3  # rows of a transaction of enqueue, SQL enqueue or INSERT (enqueue_many: 5 to 20)
# What the checker expects of each bad row: refused at enqueue, or dead-lettered with an error matching this.
BAD_ROWS: dict[str, str | None] = {
    "oversize": r"(?i)too large|MSG_SIZE_TOO_LARGE",
    "missing-topic": r"(?i)does not exist|unknown topic",
    "bad-headers": None,  # refused by every writer form (migration 12)
    "nul": None,
    "reserved-header": None,  # a header the relay sets itself (outbox_id): refused by enqueue, Python or SQL
    "unencodable-key": None,
}
# A missing topic's row costs every batch it is in message.timeout.ms per try: rarer than the others.
BAD_WEIGHTS = {"missing-topic": 0.3}
LATIN1_TEXT = ("plain", "café", "naïve Zürich", "½ façade")
WIDE_TEXT = ("東京 ☕", "ελληνικά")  # good in UTF8 only


@dataclass
class Written:
    """One row a writer meant to write, and what came of it."""

    writer: str
    topic: str
    key: str | None
    payload: Any  # a JSON value or bytes, as given
    headers: dict[str, str | bytes]
    bad: str | None = None  # the kind of bad row, None for a good one
    future: bool = False  # created_at days ahead (plain INSERT)
    message_id: str | None = None
    outcome: str = "unsent"  # committed | refused | failed | in-doubt | rolled-back
    committed_at: float | None = None  # wall clock, just after the commit returned
    error: str | None = None
    tx: int = 0  # the writer's transaction it was in (one writer commits one at a time, in this order)
    sent_at: float | None = None  # monotonic: just before its COMMIT was sent
    returned_at: float | None = None  # monotonic: just after its COMMIT returned
    refusable: bool = False  # a good message the database may refuse (issue 50: the fixes refuse it): not expected then

    @property
    def good(self) -> bool:
        return self.bad is None


class Writer(threading.Thread):
    """One writer of one kind; ``written`` is its ledger (read once the thread has ended)."""

    def __init__(self, kind: str, index: int, seed: int, outbox: Outbox, setup: Setup, stop: threading.Event) -> None:
        super().__init__(name=f"writer-{kind}-{index}", daemon=True)
        self.kind, self.outbox, self.setup, self.stop = kind, outbox, setup, stop
        self.written: list[Written] = []
        self.crash: BaseException | None = None
        self.rng = random.Random(seed * 1000 + index)  # the rows it means to write are seeded too
        self.serialized = setup.strategy == "serialized"
        self.utf8 = setup.encoding == "UTF8"
        self.keys = writer_keys(self.utf8)
        self.wal = outbox.table.write_to == "wal"
        self._tx = 0

    def run(self) -> None:
        conn: psycopg.Connection | None = None
        try:
            while not self.stop.is_set():
                batch = self._next_transaction()
                if conn is None or conn.closed:
                    conn = self._connect()
                    if conn is None:
                        for w in batch:
                            w.outcome, w.error = "failed", "no connection"
                        continue
                self._write(conn, batch)
                self.written.extend(batch)
                self.stop.wait(self.rng.uniform(0, 2 * self.setup.pause_s))
        except BaseException as exc:  # a writer bug, not a refusal: reported by the run
            self.crash = exc
        finally:
            if conn is not None:
                conn.close()

    def _connect(self) -> psycopg.Connection | None:
        try:
            return psycopg.connect(self.outbox.app_dsn, connect_timeout=5)
        except psycopg.OperationalError:
            self.stop.wait(0.2)
            return None

    # -- what to write -------------------------------------------------------------------------------

    def _next_transaction(self) -> list[Written]:
        rng = self.rng
        self._tx += 1
        if rng.random() < self.setup.bad_rate:
            batch = [self._bad(rng.choices(sorted(BAD_ROWS), [BAD_WEIGHTS.get(b, 1) for b in sorted(BAD_ROWS)])[0])]
        else:
            count = rng.randint(5, 20) if self.kind == "enqueue_many" else rng.randint(1, MAX_ROWS_PER_STATEMENT_TX)
            batch = [self._good() for _ in range(count)]
        for w in batch:
            w.tx = self._tx
        return batch

    def _good(self) -> Written:
        rng = self.rng
        text = rng.choice(LATIN1_TEXT + (WIDE_TEXT if self.utf8 else ()))
        payload: Any = (
            bytes(rng.randrange(256) for _ in range(rng.randint(1, 48)))
            if rng.random() < 0.3
            else {"w": self.name, "n": len(self.written), "text": text}
        )
        headers: dict[str, str | bytes] = {}
        if rng.random() < 0.3:
            headers["note"] = text
        if rng.random() < 0.2:
            headers["bin"] = bytes((0, 255, rng.randrange(256)))
        key = None if rng.random() < 0.1 else rng.choice(self.keys)
        future = self.kind == "insert" and rng.random() < 0.03
        return Written(self.kind, rng.choice(self.outbox.topics), key, payload, headers, future=future)

    def _bad(self, bad: str) -> Written:
        row = self._good()
        row.bad, row.future = bad, False
        if bad == "oversize":
            row.payload = {"blob": "x" * (MAX_MESSAGE_BYTES + 50_000)}
        elif bad == "missing-topic":
            row.topic = self.outbox.missing_topic
        elif bad == "bad-headers":
            row.headers = {"sig": {"base64": "abc"}}  # type: ignore[dict-item]  # what no writer may store
        elif bad == "nul":
            row.payload = {"s": "a\u0000b"}
        elif bad == "reserved-header":
            row.headers = {"outbox_id": "0"}
        elif bad == "unencodable-key":
            row.key = "東京"
            if self.utf8:
                row.bad = None  # a good row where the encoding has it
        return row

    # -- writing it ----------------------------------------------------------------------------------

    def _write(self, conn: psycopg.Connection, batch: list[Written]) -> None:
        try:
            with conn.transaction():
                try:
                    self._statements(conn, batch)
                except (psycopg.OperationalError, psycopg.InterfaceError):
                    raise
                except Exception as exc:  # refused: InvalidMessageError, a CHECK, an encoding error, RAISE
                    for w in batch:
                        w.outcome, w.error = "refused", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
                    raise _Refused() from None
                for w in batch:
                    w.outcome = "in-doubt"  # until the commit returns
                sent = time.monotonic()
            now, returned = time.time(), time.monotonic()
            for w in batch:
                w.outcome, w.committed_at, w.sent_at, w.returned_at = "committed", now, sent, returned
        except _Refused:  # rolled back (or the connection went meanwhile: nothing was written either way)
            pass
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            for w in batch:
                if w.outcome != "in-doubt":
                    w.outcome = "failed"
                w.error = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
            conn.close()

    def _statements(self, conn: psycopg.Connection, batch: list[Written]) -> None:
        table = self.outbox.table
        if self.kind in ("enqueue", "enqueue_many"):
            messages = [Message(w.topic, w.payload, w.key, w.headers or None) for w in batch]
            if self.kind == "enqueue":
                written = [
                    enqueue(
                        conn, m.topic, m.payload, key=m.key, headers=m.headers, serialized=self.serialized, table=table
                    )
                    for m in messages
                ]
            else:
                written = enqueue_many(conn, messages, serialized=self.serialized, table=table)
            for w, row in zip(batch, written, strict=True):
                w.message_id = str(row.message_id)
            return
        for w in batch:
            headers = Jsonb({k: _stored(v) for k, v in w.headers.items()})
            binary = isinstance(w.payload, bytes)
            json_payload, bytes_payload = (None, w.payload) if binary else (Jsonb(w.payload), None)
            if self.kind == "sql":
                query = sql.SQL(
                    "SELECT message_id::text FROM {}(topic => %s, payload => %s, key => %s, headers => %s, "
                    "serialized => %s, payload_bytes => %s)"
                ).format(table.ident("enqueue"))
                params: tuple[object, ...] = (w.topic, json_payload, w.key, headers, self.serialized, bytes_payload)
            else:
                if self.serialized:  # a hand-written SQL writer takes the serialized writers' lock itself
                    conn.execute(
                        "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (SERIALIZED_LOCK_CLASS, table.schema)
                    )
                if self.wal:  # the trigger emits and keeps no row: the INSERT returns none, the id is the writer's
                    w.message_id = str(uuid.uuid4())
                    conn.execute(
                        sql.SQL(
                            "INSERT INTO {} (message_id, topic, key, payload, payload_bytes, headers, created_at) "
                            "VALUES (%s, %s, %s, %s, %s, %s, now() + %s * interval '1 day')"
                        ).format(table.messages),
                        (w.message_id, w.topic, w.key, json_payload, bytes_payload, headers, 30 if w.future else 0),
                    )
                    continue
                query = sql.SQL(
                    "INSERT INTO {} (topic, key, payload, payload_bytes, headers, created_at) "
                    "VALUES (%s, %s, %s, %s, %s, now() + %s * interval '1 day') RETURNING message_id::text"
                ).format(table.messages)
                params = (w.topic, w.key, json_payload, bytes_payload, headers, 30 if w.future else 0)
            stored = conn.execute(query, params).fetchone()
            assert stored is not None
            w.message_id = stored[0]


def writer_keys(utf8: bool) -> list[str]:
    """The keys writers draw from (and the long transaction writes every one of)."""
    return [f"k{i}" for i in range(12)] + ["café", "naïve-ü"] + (["東京"] if utf8 else [])


class LongTransaction:
    """The nemesis's transaction left open (wal): a message under every key of the writers on each good topic, written
    at once (``begin``), committed or rolled back when the nemesis says (``end``). ``written`` is its ledger."""

    def __init__(self, outbox: Outbox, setup: Setup, choice: int) -> None:
        self.outbox = outbox
        keys = writer_keys(setup.encoding == "UTF8")
        self.written = [
            Written("long-transaction", topic, key, {"long": choice, "key": key}, {}, tx=choice)
            for topic in outbox.topics
            for key in keys
        ]
        self.conn: psycopg.Connection | None = None
        self.failed = False

    def begin(self) -> str:
        try:
            self.conn = psycopg.connect(self.outbox.app_dsn, connect_timeout=5)
            messages = [Message(w.topic, w.payload, w.key) for w in self.written]
            for w, row in zip(self.written, enqueue_many(self.conn, messages, table=self.outbox.table), strict=True):
                w.message_id, w.outcome = str(row.message_id), "open"
        except psycopg.Error as exc:  # the server went: nothing was written
            self._close()
            self.failed = True
            for w in self.written:
                w.outcome, w.error = "failed", str(exc).strip()[:200]
            return f"not begun: {type(exc).__name__}"
        return f"{len(self.written)} messages written, left open"

    def end(self, *, commit: bool) -> str:
        assert self.conn is not None
        try:
            if not commit:
                self.conn.rollback()
                for w in self.written:
                    w.outcome = "rolled-back"
                return f"{len(self.written)} messages rolled back"
            for w in self.written:
                w.outcome = "in-doubt"
            sent = time.monotonic()
            self.conn.commit()
            now, returned = time.time(), time.monotonic()
            for w in self.written:
                w.outcome, w.committed_at, w.sent_at, w.returned_at = "committed", now, sent, returned
            return f"{len(self.written)} messages committed"
        except psycopg.Error as exc:
            for w in self.written:
                if w.outcome == "open":
                    w.outcome = "failed"
                w.error = str(exc).strip()[:200]
            return f"{'commit' if commit else 'rollback'} failed: {type(exc).__name__}"
        finally:
            self._close()

    def _close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class _Refused(Exception):
    """A row was refused: the transaction rolls back."""


def _stored(value: object) -> object:
    """A header as the headers column stores it: text, or bytes as {"base64": ...}."""
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode("ascii")}
    return value


class Utf8ClientWriter(Writer):
    """A wal writer whose ``client_encoding`` is UTF8 in a LATIN1 database (Django sets it; so does PGCLIENTENCODING):
    ordinary messages, messages with characters LATIN1 lacks (the database may refuse them: ``refusable``), and now
    and then an oversize one under such a key, which the relay must dead-letter (issue 50, case 4)."""

    KEY = "東京"

    def __init__(self, index: int, seed: int, outbox: Outbox, setup: Setup, stop: threading.Event) -> None:
        super().__init__("enqueue", index, seed, outbox, setup, stop)
        self.name = f"writer-{UTF8_CLIENT}-{index}"

    def _connect(self) -> psycopg.Connection | None:
        try:
            return psycopg.connect(self.outbox.app_dsn, connect_timeout=5, client_encoding="UTF8")
        except psycopg.OperationalError:
            self.stop.wait(0.2)
            return None

    def _next_transaction(self) -> list[Written]:
        self._tx += 1
        roll = self.rng.random()
        row = self._bad("oversize") if roll < 0.03 else self._good()
        row.writer, row.tx = UTF8_CLIENT, self._tx
        if roll < 0.5:  # what LATIN1 cannot hold: in the key, and in a header or the payload
            row.key, row.refusable = self.KEY, row.good
            row.headers["note"] = WIDE_TEXT[0]
        return [row]


UTF8_CLIENT = "utf8-client"


def start_writers(outbox: Outbox, setup: Setup, seed: int, stop: threading.Event) -> list[Writer]:
    writers = [Writer(kind, i, seed, outbox, setup, stop) for i, kind in enumerate(KINDS)]
    if outbox.table.write_to == "wal" and setup.encoding == "LATIN1":
        writers.append(Utf8ClientWriter(len(KINDS), seed, outbox, setup, stop))
    for writer in writers:
        writer.start()
    return writers
