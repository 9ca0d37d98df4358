"""Engine room: the database owns the routing, so a writer in any language picks the same virtual partition.

``<schema>.murmur2(bytea)`` is Kafka's murmur2 (the Java client's ``Utils.murmur2``) as an unsigned 32-bit
value in a bigint, and ``<schema>.partition_for(topic, key)`` is the Java default partitioner's choice,
``toPositive(murmur2(utf8(key))) % partitions``, over the topic's virtual partition count (``outbox_topics``,
else its ``'*'`` row). Both equal partitioning.py byte for byte. 32-bit products fit a bigint
(0xFFFFFFFF x 0x5BD1E995 < 2^63), so each step masks to 32 bits exactly as the Java int arithmetic wraps.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from .config import OutboxTable

_MURMUR2 = """
    CREATE OR REPLACE FUNCTION {murmur2}(data bytea) RETURNS bigint
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $fn$
    DECLARE
        m    constant bigint := 1540483477;   -- 0x5BD1E995
        mask constant bigint := 4294967295;   -- 0xFFFFFFFF
        len  constant int := length(data);
        tail constant int := len - (len & 3);
        h    bigint := 2538058380 # len;      -- seed 0x9747B28C
        k    bigint;
        i    int := 0;
    BEGIN
        WHILE i < tail LOOP
            k := get_byte(data, i)::bigint | (get_byte(data, i + 1)::bigint << 8)
                 | (get_byte(data, i + 2)::bigint << 16) | (get_byte(data, i + 3)::bigint << 24);
            k := (k * m) & mask;
            k := k # (k >> 24);
            k := (k * m) & mask;
            h := (h * m) & mask;
            h := h # k;
            i := i + 4;
        END LOOP;
        IF len & 3 = 3 THEN h := h # (get_byte(data, tail + 2)::bigint << 16); END IF;
        IF len & 3 >= 2 THEN h := h # (get_byte(data, tail + 1)::bigint << 8); END IF;
        IF len & 3 >= 1 THEN
            h := h # get_byte(data, tail);
            h := (h * m) & mask;
        END IF;
        h := h # (h >> 13);
        h := (h * m) & mask;
        h := h # (h >> 15);
        RETURN h;
    END
    $fn$
"""

# NULL key: NULL (the caller spreads keyless rows as it likes; they have no order to keep).
_PARTITION_FOR = """
    CREATE OR REPLACE FUNCTION {partition_for}(topic text, key text) RETURNS integer
    LANGUAGE sql STABLE PARALLEL SAFE AS $fn$
        SELECT (({murmur2}(convert_to(key, 'UTF8')) & 2147483647) % coalesce(
            (SELECT t.partitions FROM {topics} t WHERE t.topic = $1),
            (SELECT d.partitions FROM {topics} d WHERE d.topic = {default_row}),
            1))::integer
        WHERE key IS NOT NULL
    $fn$
"""


def create_routing_functions(conn: psycopg.Connection, t: OutboxTable, default_row: str) -> None:
    """``murmur2`` and ``partition_for`` in the outbox's schema (migration 6); ``default_row`` names the
    outbox_topics row holding the default partition count."""
    murmur2 = t.ident("murmur2")
    conn.execute(sql.SQL(_MURMUR2).format(murmur2=murmur2))
    conn.execute(
        sql.SQL(_PARTITION_FOR).format(
            partition_for=t.ident("partition_for"),
            murmur2=murmur2,
            topics=t.topics,
            default_row=sql.Literal(default_row),
        )
    )
