"""The seed's relay variants, literally, as the baseline to beat, on the seed's own table and on ours. See
docs/performance.md#the-baselines-the-seeds-variants-and-a-hand-written-relay."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from confluent_kafka import Producer
from psycopg import sql
from psycopg.rows import DictRow, dict_row

from ...config import OutboxTable

NAIVE_BATCH = 100
# The seed's lock key for variant 1.1.
ADVISORY_KEY = (-1613257171, -31457281)


Conn = psycopg.Connection[DictRow]
Row = dict[str, Any]


@dataclass(frozen=True)
class NaiveResult:
    published: int
    elapsed_s: float


def _send(producer: Producer, rows: list[Row]) -> None:
    """SendBatchToKafka: produce each message, then flush the batch."""
    for row in rows:
        producer.produce(
            str(row["topic"]),
            json.dumps(row["payload"]).encode(),
            str(row["key"]).encode() if row["key"] is not None else None,
            # The seed's table has no message_id; ours does, and verify finds messages by it.
            headers={"message_id": str(row["message_id"])} if "message_id" in row else None,
        )
    producer.flush()


def _in_list(rows: list[Row]) -> tuple[sql.Composable, list[object]]:
    ids = [row["id"] for row in rows]
    return sql.SQL(", ").join(sql.Placeholder() * len(ids)), ids


def _send_and_delete(conn: Conn, t: OutboxTable, producer: Producer, rows: list[Row]) -> None:
    """SendBatchToKafka, then DeleteMessages by an IN list of the batch's ids."""
    _send(producer, rows)
    marks, ids = _in_list(rows)
    conn.execute(sql.SQL("DELETE FROM {} WHERE id IN ({})").format(t.messages, marks), ids)


def variant_1(conn: Conn, t: OutboxTable, producer: Producer, worker: str) -> int:
    """One long transaction: SELECT ... FOR UPDATE SKIP LOCKED, send, DELETE, COMMIT."""
    with conn.transaction():
        rows = conn.execute(
            sql.SQL("SELECT * FROM {} ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED").format(t.messages), (NAIVE_BATCH,)
        ).fetchall()
        if rows:
            _send_and_delete(conn, t, producer, rows)
    return len(rows)


def variant_1_1(conn: Conn, t: OutboxTable, producer: Producer, worker: str) -> int:
    """Advisory lock: lock, SELECT, send, DELETE, unlock."""
    conn.execute("SELECT pg_advisory_lock(%s, %s)", ADVISORY_KEY)
    try:
        rows = conn.execute(
            sql.SQL("SELECT * FROM {} ORDER BY id LIMIT %s").format(t.messages), (NAIVE_BATCH,)
        ).fetchall()
        if rows:
            _send_and_delete(conn, t, producer, rows)
    finally:
        conn.execute("SELECT pg_advisory_unlock(%s, %s)", ADVISORY_KEY)
    return len(rows)


def variant_2(conn: Conn, t: OutboxTable, producer: Producer, worker: str) -> int:
    """Two short transactions: lease with UPDATE ... FROM (SELECT ... SKIP LOCKED) RETURNING *, then DELETE."""
    rows = conn.execute(
        sql.SQL(
            """
            UPDATE {m} SET available_after = now() + interval '30 seconds'
            FROM (SELECT id FROM {m} WHERE available_after < now() ORDER BY available_after LIMIT %s
                  FOR UPDATE SKIP LOCKED) locked_messages
            WHERE {m}.id = locked_messages.id
            RETURNING {m}.*
            """
        ).format(m=t.messages),
        (NAIVE_BATCH,),
    ).fetchall()
    if rows:
        _send_and_delete(conn, t, producer, rows)
    return len(rows)


def _lease_offsets(conn: Conn, t: OutboxTable) -> Row | None:
    return conn.execute(
        sql.SQL(
            """
            UPDATE {o} SET available_after = now() + interval '30 seconds'
            FROM (SELECT topic, partition FROM {o} WHERE available_after < now() ORDER BY available_after LIMIT 1
                  FOR UPDATE SKIP LOCKED) locked_offsets
            WHERE {o}.topic = locked_offsets.topic AND {o}.partition = locked_offsets.partition
            RETURNING {o}.*
            """
        ).format(o=t.offsets)
    ).fetchone()


def _update_offsets(conn: Conn, t: OutboxTable, lease: Row, last: Row | None) -> None:
    # Variant 4's table has no transaction_id (its position is the id alone): the offsets row keeps its xid.
    xid = last.get("transaction_id") if last else None
    conn.execute(
        sql.SQL(
            """
            UPDATE {o} SET available_after = now(),
                last_processed_transaction_id = coalesce(%s::xid8, last_processed_transaction_id),
                last_processed_id = coalesce(%s, last_processed_id)
            WHERE topic = %s AND partition = %s
            """
        ).format(o=t.offsets),
        (xid, last["id"] if last else None, lease["topic"], lease["partition"]),
    )


def variant_3(conn: Conn, t: OutboxTable, producer: Producer, worker: str) -> int:
    """Virtual partitions: lease a partition, SELECT past the xid8 position, send, UPDATE the position."""
    lease = _lease_offsets(conn, t)
    if lease is None:
        return 0
    rows = conn.execute(
        sql.SQL(
            """
            SELECT * FROM {m}
            WHERE topic = %(topic)s AND partition = %(partition)s
              AND transaction_id >= %(xid)s::xid8
              AND (transaction_id > %(xid)s::xid8 OR transaction_id = %(xid)s::xid8 AND id > %(id)s)
              AND transaction_id < pg_snapshot_xmin(pg_current_snapshot())
            ORDER BY transaction_id, id
            LIMIT %(limit)s
            """
        ).format(m=t.messages),
        {
            "topic": lease["topic"],
            "partition": lease["partition"],
            "xid": lease["last_processed_transaction_id"],
            "id": lease["last_processed_id"],
            "limit": NAIVE_BATCH,
        },
    ).fetchall()
    if rows:
        _send(producer, rows)
    _update_offsets(conn, t, lease, rows[-1] if rows else None)
    return len(rows)


def variant_4(conn: Conn, t: OutboxTable, producer: Producer, worker: str) -> int:
    """Serialized writers: lease a partition, SELECT id > last_processed_id, send, UPDATE the position."""
    lease = _lease_offsets(conn, t)
    if lease is None:
        return 0
    rows = conn.execute(
        sql.SQL("SELECT * FROM {m} WHERE topic = %s AND partition = %s AND id > %s ORDER BY id LIMIT %s").format(
            m=t.messages
        ),
        (lease["topic"], lease["partition"], lease["last_processed_id"], NAIVE_BATCH),
    ).fetchall()
    if rows:
        _send(producer, rows)
    _update_offsets(conn, t, lease, rows[-1] if rows else None)
    return len(rows)


NaiveVariant = Callable[[Conn, OutboxTable, Producer, str], int]
NAIVE_VARIANTS: dict[str, NaiveVariant] = {
    "locking": variant_1,
    "advisory": variant_1_1,
    "lease": variant_2,
    "partitioned": variant_3,
    "serialized": variant_4,
}


# Indexes the seed's schema has for a variant and ours does not need: without them the variant would be
# slower than the seed's (variant 2 orders by available_after: a sort of the whole table per batch).
NAIVE_INDEXES: dict[str, str] = {
    "lease": "CREATE INDEX ix_outbox_messages_available_after ON {m} USING btree (available_after)",
}


def prepare_naive_schema(conn: psycopg.Connection[Any], table: OutboxTable, strategy: str) -> None:
    """The seed's indexes for ``strategy``'s variant, created after the load as a DBA would."""
    if strategy in NAIVE_INDEXES:
        conn.execute(sql.SQL(NAIVE_INDEXES[strategy]).format(m=table.messages))
        conn.execute(sql.SQL("ANALYZE {}").format(table.messages))


def run_naive(strategy: str, dsn: str, table: OutboxTable, bootstrap: str, worker: str) -> NaiveResult:
    """Drain with the seed variant for ``strategy`` until a pass finds nothing."""
    variant = NAIVE_VARIANTS[strategy]
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all"})
    published = 0
    empty_passes = 0
    started = time.monotonic()
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        # Partitioned variants go round all partitions: stop after a full round found nothing.
        while empty_passes < 8:
            count = variant(conn, table, producer, worker)
            published += count
            empty_passes = 0 if count else empty_passes + 1
    return NaiveResult(published, time.monotonic() - started)
