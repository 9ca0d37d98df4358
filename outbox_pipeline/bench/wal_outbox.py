"""A wal outbox in the benches: made, written, known to be relayed, and always dropped with its slot (a slot left behind
fills the disk). See docs/performance.md#the-wal-strategy."""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg
from psycopg import sql

from ..config import OutboxTable
from ..model import WAL
from ..relay.relay_settings import RelaySettings
from ..store.wal.objects import WAL_SINCE_SERVER_VERSION, drop_slot, names_of, slot_holder

# One relay streams a slot; a second one waits for it (relay/wal/leader.py): a drain has one worker.
WAL_WORKERS = 1
# How many messages the wal relay hands Kafka at once (its batch; it takes no --batch-size).
WAL_BATCH = RelaySettings().wal_batch_max
# A transactional message under a prefix no outbox reads: the relay passes over it and confirms its commit.
_MARKER_PREFIX = "outbox-bench:marker"


def table_for(schema: str, strategy: str) -> OutboxTable:
    """The outbox a bench makes for ``strategy``: a wal outbox is written the wal way (``write_to="wal"``)."""
    return OutboxTable(schema=schema, write_to="wal" if strategy == WAL else "table")


def why_not_wal(conn: psycopg.Connection) -> str:
    """'' when this server can hold a wal outbox, else why not (a bench leaves the wal lines out and says so)."""
    if conn.info.server_version < WAL_SINCE_SERVER_VERSION:
        return f"PostgreSQL {conn.info.server_version // 10000} (the wal strategy needs 14 or later)"
    row = conn.execute("SELECT current_setting('wal_level')").fetchone()
    if row is None or row[0] != "logical":
        return f"wal_level = {row[0] if row else '?'} (the wal strategy needs logical)"
    return ""


def drop_outbox(dsn: str, table: OutboxTable) -> None:
    """The outbox's slot and publication (if any), then its schema."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        drop_slot(conn, table)
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(table.schema_ident))


def insert_lsn(conn: psycopg.Connection) -> int:
    """Where the server inserts WAL now, in bytes (differences are WAL bytes written meanwhile, by any session)."""
    row = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
    return int(row[0]) if row else 0


def emitted_messages(conn: psycopg.Connection, table: OutboxTable) -> int:
    """The outbox's committed messages the slot holds, decoded as the relay's stream decodes them (peeked: the slot
    does not move). Only for a slot nobody streams, and for bench sizes: each call decodes from the slot's start.
    ``conn`` in autocommit: a marker's durable commit first flushes what an asynchronous commit left in memory (the
    slot decodes flushed WAL only)."""
    names = names_of(table)
    commit_marker(conn)
    row = conn.execute(
        """
        SELECT count(*) FROM pg_logical_slot_peek_binary_changes(
            %s, NULL, NULL, 'proto_version', '1', 'publication_names', %s, 'messages', 'true')
        WHERE get_byte(data, 0) = ascii('M')
          AND substring(data FROM 11 FOR %s) = convert_to(%s, 'UTF8') || '\\x00'::bytea
        """,
        (names.slot, names.publication, len(names.prefix.encode()) + 1, names.prefix),
    ).fetchone()
    return int(row[0]) if row else 0


def commit_marker(conn: psycopg.Connection) -> int:
    """Commit a marker (a transactional message no outbox reads; ``conn`` in autocommit), flushed; its LSN."""
    with conn.transaction():
        conn.execute("SET LOCAL synchronous_commit = on")  # flushed at COMMIT: the slot can decode it at once
        row = conn.execute("SELECT pg_logical_emit_message(true, %s, '') - '0/0'::pg_lsn", (_MARKER_PREFIX,)).fetchone()
    return int(row[0]) if row else 0


def confirmed_lsn(conn: psycopg.Connection, table: OutboxTable) -> int | None:
    """The slot's confirmed position in bytes; None without the slot."""
    row = conn.execute(
        "SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots "
        "WHERE slot_name = %s AND database = current_database()",
        (names_of(table).slot,),
    ).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def wait_confirmed(dsn: str, table: OutboxTable, timeout_s: float) -> bool:
    """Until the relay confirmed to the slot everything committed before now (True), or ``timeout_s`` passed.
    Polling: the slot's position is another process's doing, and no event tells of it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        marker = commit_marker(conn)
        deadline = time.monotonic() + timeout_s
        while (confirmed_lsn(conn, table) or 0) <= marker:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
    return True


def wait_streaming(dsn: str, table: OutboxTable, timeout_s: float, alive: Callable[[], int | None]) -> None:
    """Until a relay streams the outbox's slot (a walsender holds it); ``alive`` returns the relay's exit code once
    it has exited. Polling another process's state."""
    deadline = time.monotonic() + timeout_s
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            if slot_holder(conn, names_of(table).slot)[1] is not None:
                return
            if (code := alive()) is not None:
                raise RuntimeError(f"the relay exited with {code} before streaming the slot")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no relay streamed the slot within {timeout_s:.0f} s")
            time.sleep(0.2)
