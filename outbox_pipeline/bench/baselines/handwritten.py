"""The seed's variants 3 and 4 as a user would tune them by hand on the seed's table: what our machinery and headers
cost on this machine. See docs/performance.md#the-baselines-the-seeds-variants-and-a-hand-written-relay."""

from __future__ import annotations

import psycopg
from confluent_kafka import Producer
from psycopg import sql
from psycopg.rows import dict_row

from ...config import OutboxTable
from ...relay.publisher import DEFAULT_PRODUCER_CONFIG, REQUIRED_PRODUCER_CONFIG

# ``AS xid``: an output column named transaction_id (the cast's name) would make ORDER BY transaction_id sort
# by its text, and '1000' < '999' skips rows (the first version of this prototype did).
_READ = {
    "partitioned": """
        SELECT id, key, payload::text AS payload, transaction_id::text AS xid FROM {m}
        WHERE topic = %(topic)s AND partition = %(partition)s
          AND (transaction_id, id) > (%(xid)s::xid8, %(id)s)
          AND transaction_id < pg_snapshot_xmin(pg_current_snapshot())
        ORDER BY transaction_id, id LIMIT %(limit)s
    """,
    "serialized": """
        SELECT id, key, payload::text AS payload, NULL AS xid FROM {m}
        WHERE topic = %(topic)s AND partition = %(partition)s AND id > %(id)s
        ORDER BY id LIMIT %(limit)s
    """,
}
HAND_WRITTEN = frozenset(_READ)
# Lease a partition for 30 s at a time; each batch's position update renews it. A drained partition keeps
# its lease, so the workers stop once nothing is left to lease.
_LEASE = """
    UPDATE {o} SET available_after = now() + interval '30 seconds'
    WHERE id = (SELECT id FROM {o} WHERE available_after < now() ORDER BY available_after LIMIT 1
                FOR UPDATE SKIP LOCKED)
    RETURNING topic, partition, last_processed_transaction_id::text AS xid, last_processed_id AS id
"""
_MOVE = """
    UPDATE {o} SET last_processed_transaction_id = %(xid)s::xid8, last_processed_id = %(id)s,
                   available_after = now() + interval '30 seconds'
    WHERE topic = %(topic)s AND partition = %(partition)s
"""


def run_hand_written(strategy: str, dsn: str, table: OutboxTable, bootstrap: str, batch_size: int) -> int:
    """Drain partitions one lease at a time until none is left to lease; returns the messages sent."""
    producer = Producer({"bootstrap.servers": bootstrap, **DEFAULT_PRODUCER_CONFIG, **REQUIRED_PRODUCER_CONFIG})
    read = sql.SQL(_READ[strategy]).format(m=table.messages)
    sent = 0
    lease, move = (sql.SQL(q).format(o=table.offsets) for q in (_LEASE, _MOVE))
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        while (position := conn.execute(lease).fetchone()) is not None:
            position["limit"] = batch_size
            rows = conn.execute(read, position).fetchall()
            while rows:
                topic = position["topic"]
                for row in rows:
                    producer.produce(topic, row["payload"], row["key"])
                last = rows[-1]
                position = {**position, "id": last["id"], "xid": last["xid"] or position["xid"]}
                ahead = conn.execute(read, position).fetchall()  # while Kafka confirms the batch
                if producer.flush(60):
                    raise RuntimeError(f"{len(producer)} messages unconfirmed after 60 s")
                conn.execute(move, position)
                sent += len(rows)
                rows = ahead
    return sent
