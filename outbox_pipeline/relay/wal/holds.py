"""Engine room (relay, wal): dead letters and key-scoped quarantine for the wal relay, in the tables the table
strategies use (``outbox_dead_letters``, ``outbox_holds``, ``outbox_held``), so ``outbox dead-letters`` lists,
retries and discards them the same way.

A message Kafka will never take is dead-lettered whole. With quarantine (``OUTBOX_ON_POISON``, the default) its key
is held: the key's later messages are written to ``outbox_held`` as the stream brings them, before the slot is
confirmed past them (a relay that dies in between writes them again: the id is the message's LSN), and every
other key keeps flowing. An operator's retry (the dead letter at the head of the held messages) or discard releases
the hold; the streaming relay then publishes the held messages in their order, deletes them and the hold, and the
key flows again, in commit order: a wal message keeps its transaction's commit position (the stream's Begin:
``final_lsn``) where a row keeps its transaction id, and its id is its own position, so held messages are read in
(transaction_id, id) order as ``partitioned`` reads its rows (a retried dead letter, committed before what was held
behind it, goes first). A held message Kafka refuses then (the retried dead letter itself, still too large; or one of
the key's later messages) becomes the hold's dead letter again, as for the table strategies
(strategies/quarantine.py): what went before it is done, what comes after it stays held. With ``skip`` the key goes
on without the dead letter.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import psycopg
from psycopg import sql

from ...config import OutboxTable
from ...strategies.base import RECORD_COLUMNS, DeliveryFailure, OutboxRecord, fetch_records
from ...strategies.quarantine import OnPoison, dead_letter_held
from ...timestamps import as_parameter

log = logging.getLogger(__name__)

# A held message and a dead letter keep a message's columns; the stream gives a wal message no priority, and its
# transaction's commit position as its transaction_id.
_VALUES = "%s, %s::uuid, %s, %s, %s, %s::jsonb, %s, %s::jsonb, %s, 0, %s::text::xid8, %s"


def _columns(r: OutboxRecord) -> tuple[object, ...]:
    return (
        r.id,
        r.message_id.decode(),
        r.topic,
        None if r.key is None else r.key.decode(),
        None if r.type is None else r.type.decode(),
        None if r.binary else r.payload.decode(),
        r.payload if r.binary else None,
        r.headers,
        max(r.partition, 0),
        r.transaction_id,
        as_parameter(r.created_at),
    )


class WalHolds:
    """The keys held on one outbox, as the streaming relay sees them (loaded when it starts streaming)."""

    def __init__(self, table: OutboxTable, on_poison: OnPoison, worker_id: str) -> None:
        self.table = table
        self.on_poison = on_poison
        self.worker_id = worker_id
        self.keys: set[tuple[str, bytes]] = set()

    def load(self, conn: psycopg.Connection) -> None:
        rows = conn.execute(sql.SQL("SELECT topic, key FROM {}").format(self.table.holds)).fetchall()
        self.keys = {(topic, key.encode()) for topic, key in rows}

    def holds(self, record: OutboxRecord) -> bool:
        return record.key is not None and (record.topic, record.key) in self.keys

    def dead_letter(self, conn: psycopg.Connection, failures: Sequence[DeliveryFailure]) -> None:
        """Dead-letter each failure, and hold its key (quarantine), in one transaction."""
        with conn.transaction():
            for failure in failures:
                r = failure.record
                log.error("dead-lettering message %s to %s: %s", r.message_id.decode(), r.topic, failure.error)
                conn.execute(
                    sql.SQL(
                        """
                        INSERT INTO {dead_letters} (
                            id, message_id, topic, key, type, payload, payload_bytes, headers, partition, priority,
                            transaction_id, created_at, attempts, last_error, dead_lettered_by)
                        VALUES ({values}, 1, %s, %s)
                        ON CONFLICT (id) DO NOTHING
                        """
                    ).format(dead_letters=self.table.dead_letters, values=sql.SQL(_VALUES)),
                    (*_columns(r), failure.error, self.worker_id),
                )
                if self.on_poison == "quarantine" and r.key is not None and not self.holds(r):
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
        with conn.cursor() as cur:
            cur.executemany(
                sql.SQL(
                    """
                    INSERT INTO {held} (id, message_id, topic, key, type, payload, payload_bytes, headers, partition,
                                        priority, transaction_id, created_at)
                    VALUES ({values}) ON CONFLICT (id) DO NOTHING
                    """
                ).format(held=self.table.held, values=sql.SQL(_VALUES)),
                [_columns(r) for r in records],
            )

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
        return fetch_records(
            conn,
            sql.SQL(
                "SELECT {columns} FROM {held} m WHERE m.topic = %(topic)s AND m.key = %(key)s "
                "ORDER BY m.transaction_id, m.id"
            ).format(columns=sql.SQL(RECORD_COLUMNS), held=self.table.held),
            {"topic": topic, "key": key},
        )

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
