"""The verify workspace: temp tables in PostgreSQL holding the ledger and what was consumed. See
docs/operations.md#checking-delivery-outbox-verify."""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from ..config import OutboxTable
from ..errors import OutboxError

log = logging.getLogger(__name__)

# work_mem of verify's own queries (hash joins and sorts over every record), on the PostgreSQL server.
WORK_MEM = "64MB"

# -- the workspace: temp tables (the questions asked of them are in checks.py) -----------------------


class Ledger:
    """TEMP tables on ``conn``: the ledger, the consumed records, the phantom candidates. Every step is its
    own short transaction (a savepoint inside a caller's transaction), with room to hash and sort."""

    def __init__(self, conn: psycopg.Connection, table: OutboxTable) -> None:
        self.conn = conn
        self.table = table
        suffix = uuid.uuid4().hex[:12]
        self.ledger = sql.Identifier("pg_temp", f"outbox_verify_ledger_{suffix}")
        self.consumed = sql.Identifier("pg_temp", f"outbox_verify_consumed_{suffix}")
        self.phantoms = sql.Identifier("pg_temp", f"outbox_verify_phantoms_{suffix}")
        self._raw = sql.Identifier("pg_temp", f"outbox_verify_raw_{suffix}")
        self._created = False

    def _sql(self, text: str, **extra: sql.Composable) -> sql.Composed:
        return sql.SQL(text).format(
            ledger=self.ledger,
            consumed=self.consumed,
            phantoms=self.phantoms,
            raw=self._raw,
            messages=self.table.messages,
            dead_letters=self.table.dead_letters,
            held=self.table.held,
            **extra,
        )

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        with self.conn.transaction():
            # Joins and sorts over millions of rows: hashed in memory instead of spilled in many batches.
            self.conn.execute("SELECT set_config('work_mem', %s, true)", (WORK_MEM,))
            yield

    def create(self) -> None:
        with self._transaction():
            self._created = True
            self.conn.execute(
                self._sql(
                    "CREATE TEMP TABLE {ledger} (message_id uuid NOT NULL, outbox_id bigint, topic text, key text, "
                    "transaction_id xid8)"
                )
            )
            self.conn.execute(
                self._sql(
                    "CREATE TEMP TABLE {consumed} (message_id uuid, topic text NOT NULL, kafka_partition integer "
                    "NOT NULL, kafka_offset bigint NOT NULL, key text, outbox_id bigint, created_at timestamptz, "
                    "broker_ms bigint)"
                )
            )

    def drop(self) -> None:
        if not self._created:
            return
        try:
            with self.conn.transaction():
                self.conn.execute(self._sql("DROP TABLE IF EXISTS {ledger}, {consumed}, {phantoms}, {raw}"))
        except psycopg.Error as exc:  # the session ends some day and takes its temp tables along
            log.debug("verify: could not drop its temp tables: %s", exc)

    def load_ledger_table(
        self, topics: Sequence[str], since: dt.datetime | None, id_from: int | None
    ) -> tuple[int, int]:
        """The outbox rows of ``topics`` (in range) minus pending dead letters and held rows, one per message_id
        (a retried dead letter of a position strategy has two rows); returns (pending dead letters, held)."""
        params = {"topics": list(topics), "since": since, "id_from": id_from}
        with self._transaction():
            self.conn.execute(
                self._sql(
                    """
                    INSERT INTO {ledger} (message_id, outbox_id, topic, key, transaction_id)
                    SELECT DISTINCT ON (m.message_id) m.message_id, m.id, m.topic, m.key, m.transaction_id
                    FROM {messages} m
                    WHERE m.topic = ANY(%(topics)s::text[])
                      AND (%(since)s::timestamptz IS NULL OR m.created_at >= %(since)s::timestamptz)
                      AND (%(id_from)s::bigint IS NULL OR m.id >= %(id_from)s::bigint)
                      AND NOT EXISTS (
                          SELECT 1 FROM {dead_letters} d WHERE d.message_id = m.message_id AND d.retried_at IS NULL)
                      AND NOT EXISTS (SELECT 1 FROM {held} x WHERE x.message_id = m.message_id)
                    ORDER BY m.message_id, m.id DESC
                    """
                ),
                params,
            )
            row = self.conn.execute(
                self._sql(
                    """
                    SELECT
                        (SELECT count(*) FROM {dead_letters} d
                         WHERE d.retried_at IS NULL AND d.topic = ANY(%(topics)s::text[])
                           AND (%(since)s::timestamptz IS NULL OR d.created_at >= %(since)s::timestamptz)
                           AND (%(id_from)s::bigint IS NULL OR d.id >= %(id_from)s::bigint)),
                        (SELECT count(*) FROM {held} x
                         WHERE x.topic = ANY(%(topics)s::text[])
                           AND (%(since)s::timestamptz IS NULL OR x.created_at >= %(since)s::timestamptz)
                           AND (%(id_from)s::bigint IS NULL OR x.id >= %(id_from)s::bigint)
                           AND NOT EXISTS (SELECT 1 FROM {dead_letters} d
                                           WHERE d.message_id = x.message_id AND d.retried_at IS NULL))
                    """
                ),
                params,
            ).fetchone()
            self.conn.execute(self._sql("ANALYZE {ledger}"))
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def load_ledger_file(self, path: Path) -> tuple[int, int]:
        """Message ids from ``path`` (one per line; blank lines and ``#`` comments skipped), minus pending
        dead letters and held rows, with what the outbox table still knows of them; returns (dead letters, held)."""
        try:
            handle = path.open("rb")
        except OSError as exc:
            raise OutboxError(f"cannot read --ledger-file {path}: {exc.strerror or exc}") from None
        with handle, self._transaction():
            self.conn.execute(self._sql("CREATE TEMP TABLE {raw} (message_id uuid NOT NULL)"))
            try:
                with self.conn.cursor() as cur, cur.copy(self._sql("COPY {raw} (message_id) FROM STDIN")) as copy:
                    for block in _ledger_blocks(handle):
                        copy.write(block)
            except psycopg.errors.DataError as exc:
                detail = exc.diag.message_primary or str(exc)
                raise OutboxError(f"--ledger-file {path}: {detail}") from None
            # Rows still in the table (mark-sent mode, position strategies) name the examples and give
            # `partitioned` its order; rows deleted by the relay leave those columns NULL.
            self.conn.execute(
                self._sql(
                    """
                    INSERT INTO {ledger} (message_id, outbox_id, topic, key, transaction_id)
                    SELECT DISTINCT ON (r.message_id) r.message_id, m.id, m.topic, m.key, m.transaction_id
                    FROM {raw} r LEFT JOIN {messages} m ON m.message_id = r.message_id
                    WHERE NOT EXISTS (
                        SELECT 1 FROM {dead_letters} d WHERE d.message_id = r.message_id AND d.retried_at IS NULL)
                      AND NOT EXISTS (SELECT 1 FROM {held} x WHERE x.message_id = r.message_id)
                    ORDER BY r.message_id, m.id DESC NULLS LAST
                    """
                )
            )
            row = self.conn.execute(
                self._sql(
                    """
                    SELECT (SELECT count(DISTINCT d.message_id) FROM {dead_letters} d JOIN {raw} r USING (message_id)
                            WHERE d.retried_at IS NULL),
                           (SELECT count(DISTINCT x.message_id) FROM {held} x JOIN {raw} r USING (message_id)
                            WHERE NOT EXISTS (SELECT 1 FROM {dead_letters} d
                                              WHERE d.message_id = x.message_id AND d.retried_at IS NULL))
                    """
                )
            ).fetchone()
            self.conn.execute(self._sql("DROP TABLE {raw}"))
            self.conn.execute(self._sql("ANALYZE {ledger}"))
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def write_consumed(self, rows: Sequence[tuple[object, ...]]) -> None:
        if not rows:
            return
        statement = self._sql(
            "COPY {consumed} (message_id, topic, kafka_partition, kafka_offset, key, outbox_id, created_at, "
            "broker_ms) FROM STDIN"
        )
        with self.conn.transaction(), self.conn.cursor() as cur, cur.copy(statement) as copy:
            for row in rows:
                copy.write_row(row)

    def _rows(self, text: str, params: Mapping[str, Any], **extra: sql.Composable) -> list[tuple[Any, ...]]:
        started = time.monotonic()
        with self._transaction():
            rows = self.conn.execute(self._sql(text, **extra), params).fetchall()
        log.debug("verify: %.2f s for %s", time.monotonic() - started, " ".join(text.split())[:60])
        return rows

    def _scalar(self, text: str, params: Mapping[str, Any], **extra: sql.Composable) -> int:
        return int(self._rows(text, params, **extra)[0][0])


def _ledger_blocks(lines: Iterable[bytes], block_bytes: int = 1 << 20) -> Iterable[bytes]:
    buf = bytearray()
    for line in lines:
        text = line.strip()
        if not text or text.startswith(b"#"):
            continue
        buf += text + b"\n"
        if len(buf) >= block_bytes:
            yield bytes(buf)
            buf.clear()
    if buf:
        yield bytes(buf)


def range_text(since: dt.datetime | None, id_from: int | None) -> str:
    parts = []
    if since is not None:
        parts.append(f"created_at >= {since.isoformat()}")
    if id_from is not None:
        parts.append(f"outbox id >= {id_from}")
    return " and ".join(parts)
