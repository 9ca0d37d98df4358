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
(the error), failed (the connection went before the commit) or in doubt (it went during the commit).
"""

from __future__ import annotations

import base64
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from outbox_pipeline import Message, enqueue, enqueue_many
from outbox_pipeline.store.routing import SERIALIZED_LOCK_CLASS

from .cluster import MAX_MESSAGE_BYTES, Outbox
from .schedule import Setup

KINDS = ("enqueue", "enqueue_many", "sql", "insert")
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
    outcome: str = "unsent"  # committed | refused | failed | in-doubt
    committed_at: float | None = None  # wall clock, just after the commit returned
    error: str | None = None

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
        self.keys = [f"k{i}" for i in range(12)] + ["café", "naïve-ü"] + (["東京"] if self.utf8 else [])

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
        if rng.random() < self.setup.bad_rate:
            return [self._bad(rng.choices(sorted(BAD_ROWS), [BAD_WEIGHTS.get(b, 1) for b in sorted(BAD_ROWS)])[0])]
        count = rng.randint(5, 20) if self.kind == "enqueue_many" else rng.randint(1, 3)
        return [self._good() for _ in range(count)]

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
            now = time.time()
            for w in batch:
                w.outcome, w.committed_at = "committed", now
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
                query = sql.SQL(
                    "INSERT INTO {} (topic, key, payload, payload_bytes, headers, created_at) "
                    "VALUES (%s, %s, %s, %s, %s, now() + %s * interval '1 day') RETURNING message_id::text"
                ).format(table.messages)
                params = (w.topic, w.key, json_payload, bytes_payload, headers, 30 if w.future else 0)
            stored = conn.execute(query, params).fetchone()
            assert stored is not None
            w.message_id = stored[0]


class _Refused(Exception):
    """A row was refused: the transaction rolls back."""


def _stored(value: object) -> object:
    """A header as the headers column stores it: text, or bytes as {"base64": ...}."""
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode("ascii")}
    return value


def start_writers(outbox: Outbox, setup: Setup, seed: int, stop: threading.Event) -> list[Writer]:
    writers = [Writer(kind, i, seed, outbox, setup, stop) for i, kind in enumerate(KINDS)]
    for writer in writers:
        writer.start()
    return writers
