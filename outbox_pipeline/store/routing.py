"""The routing functions and trigger in the database, so a writer in any language picks the same virtual partition as
Kafka's Java partitioner. See docs/operations.md#routing-in-the-database."""

from __future__ import annotations

import psycopg
from psycopg import sql

from ..config import OutboxTable
from .header_rules import RESERVED_HEADERS, sendable_header
from .partition_counts import create_partition_count_guard

# Class id for the transaction-scoped lock that serialized writers take: (class, hashtext(schema)).
SERIALIZED_LOCK_CLASS = 0x4F53  # "OS"
# Headers the relay sets on every Kafka record; a user header of the same name would be ambiguous.

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


_TOPIC_PARTITIONS = """
    CREATE FUNCTION {topic_partitions}(topic text) RETURNS integer
    LANGUAGE sql STABLE PARALLEL SAFE AS $fn$
        SELECT coalesce(
            (SELECT t.partitions FROM {topics} t WHERE t.topic = $1),
            (SELECT d.partitions FROM {topics} d WHERE d.topic = {default_row}),
            1)
    $fn$
"""

# Only rows that arrive without a partition run it (the trigger's WHEN): the Python API computes the same
# partition itself, so its inserts pay nothing. A keyless row goes to a random partition, as in Python.
_ROUTE = """
    CREATE FUNCTION {route}() RETURNS trigger LANGUAGE plpgsql AS $fn$
    BEGIN
        NEW.partition := coalesce(
            {partition_for}(NEW.topic, NEW.key),
            floor(random() * {topic_partitions}(NEW.topic))::integer);
        RETURN NEW;
    END
    $fn$
"""

# What every SQL writer of a message checks (enqueue here, and the wal outbox's emit: store/wal/objects.py), in a
# function with the parameters topic, payload, payload_bytes, key, headers, type and the variables bad, size, max_bytes.
_CHECKS = """{payload_check}
        IF topic IS NULL OR topic !~ {topic_pattern} OR length(topic) > 249 OR topic IN ('.', '..') THEN
            RAISE EXCEPTION 'outbox enqueue: invalid Kafka topic name %: use 1..249 characters from '
                '[a-zA-Z0-9._-], not "." or ".."', coalesce(quote_literal(topic), 'NULL')
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        headers := coalesce(headers, '{{}}');
        IF jsonb_typeof(headers) <> 'object' THEN
            RAISE EXCEPTION 'outbox enqueue: headers must be a JSON object of name -> string, got %',
                jsonb_typeof(headers) USING ERRCODE = 'invalid_parameter_value';
        END IF;
        SELECT h.name INTO bad FROM jsonb_object_keys(headers) AS h(name) WHERE h.name = ANY({reserved}) LIMIT 1;
        IF bad IS NOT NULL THEN
            RAISE EXCEPTION 'outbox enqueue: header "%" is reserved: the relay sets it', bad
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        SELECT h.key INTO bad FROM jsonb_each(headers) AS h WHERE NOT {header_ok} LIMIT 1;
        IF bad IS NOT NULL THEN
            RAISE EXCEPTION 'outbox enqueue: header "%" must be a string, or {{"base64": "..."}} for bytes (padded '
                'base64, no whitespace), under a non-empty name', bad USING ERRCODE = 'invalid_parameter_value';
        END IF;{size_check}"""

# The SQL twin of enqueue.py's enqueue(): the same checks (the size limit from migration 13 on: record_size.py; before,
# only the relay's producer refused an oversize row, which was dead-lettered), the same routing, the same
# serialized writers' lock. OUT parameters, so ``SELECT id, message_id FROM <schema>.enqueue(...)``. From migration 11
# on the payload is JSON or bytes: ``enqueue('t', '{{"a": 1}}')`` or ``enqueue('t', payload_bytes => '\\x0102')``
# (a second function of the same name taking bytea would make every untyped literal payload ambiguous).
_ENQUEUE = """
    CREATE OR REPLACE FUNCTION {enqueue}(
        topic text, payload jsonb{payload_default}, key text DEFAULT NULL, headers jsonb DEFAULT '{{}}',
        type text DEFAULT NULL, priority integer DEFAULT 0, serialized boolean DEFAULT false{bytes_param},
        OUT id bigint, OUT message_id uuid)
    LANGUAGE plpgsql VOLATILE AS $fn$
    #variable_conflict use_variable
    DECLARE
        bad text;{size_variables}
    BEGIN
        {checks}
        IF priority IS NULL OR priority NOT BETWEEN -32768 AND 32767 THEN
            RAISE EXCEPTION 'outbox enqueue: priority must be in -32768..32767, got %', priority
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF serialized THEN
            -- Before the INSERT draws an id, held to commit: ids become visible in commit order (strategy
            -- serialized). Enqueue last in the transaction.
            PERFORM pg_advisory_xact_lock({lock_class}, hashtext({schema}));
        END IF;
        INSERT INTO {messages} AS m (topic, key, type, payload, {bytes_column}headers, priority)
        VALUES (topic, key, type, payload, {bytes_value}headers, priority::smallint)
        RETURNING m.id, m.message_id INTO id, message_id;
    END
    $fn$
"""


def create_sql_writers(conn: psycopg.Connection, t: OutboxTable, *, default_row: str, topic_pattern: str) -> None:
    """Migration 7: route rows that arrive without a partition, ``<schema>.enqueue``, the partition-count guard."""
    names = {
        "messages": t.messages,
        "offsets": t.offsets,
        "topics": t.topics,
        "default_row": sql.Literal(default_row),
        "topic_partitions": t.ident("topic_partitions"),
        "partition_for": t.ident("partition_for"),
    }
    conn.execute(sql.SQL(_TOPIC_PARTITIONS).format(**names))
    conn.execute(sql.SQL(_ROUTE).format(route=t.ident("outbox_route"), **names))
    conn.execute(sql.SQL("ALTER TABLE {messages} ALTER COLUMN partition DROP DEFAULT").format(**names))
    conn.execute(
        sql.SQL(
            "CREATE TRIGGER outbox_messages_route BEFORE INSERT ON {messages} "
            "FOR EACH ROW WHEN (NEW.partition IS NULL) EXECUTE FUNCTION {route}()"
        ).format(route=t.ident("outbox_route"), **names)
    )
    replace_sql_enqueue(conn, t, topic_pattern=topic_pattern)
    # Which order a partition's position is in (see _GUARD); written by the position strategies.
    conn.execute(sql.SQL("ALTER TABLE {offsets} ADD COLUMN read_by text").format(**names))
    create_partition_count_guard(conn, t, default_row=default_row, with_holds=False)
    conn.execute(
        sql.SQL(
            "CREATE TRIGGER outbox_topics_guard BEFORE INSERT OR UPDATE OR DELETE ON {topics} "
            "FOR EACH ROW EXECUTE FUNCTION {guard}()"
        ).format(guard=t.ident("outbox_topics_guard"), **names)
    )


_JSON_PAYLOAD_CHECK = """IF payload IS NULL THEN
            RAISE EXCEPTION 'outbox enqueue: payload must not be NULL' USING ERRCODE = 'null_value_not_allowed';
        END IF;"""
_ONE_PAYLOAD_CHECK = """IF num_nonnulls(payload, payload_bytes) <> 1 THEN
            RAISE EXCEPTION 'outbox enqueue: give the payload as JSON (payload) or as bytes (payload_bytes), '
                'one of them' USING ERRCODE = 'null_value_not_allowed';
        END IF;"""


def sql_checks(
    *, topic_pattern: str, binary_payloads: bool = False, size_check: sql.Composable | None = None
) -> sql.Composed:
    """The checks of every SQL writer (_CHECKS), for a function body."""
    return sql.SQL(_CHECKS).format(
        payload_check=sql.SQL(_ONE_PAYLOAD_CHECK if binary_payloads else _JSON_PAYLOAD_CHECK),
        topic_pattern=sql.Literal(topic_pattern),
        header_ok=sendable_header(),
        reserved=sql.Literal(sorted(RESERVED_HEADERS)),
        size_check=size_check or sql.SQL(""),
    )


def replace_sql_enqueue(
    conn: psycopg.Connection,
    t: OutboxTable,
    *,
    topic_pattern: str,
    binary_payloads: bool = False,
    size_check: sql.Composable | None = None,
) -> None:
    """``<schema>.enqueue``, created or replaced (migrations 7 and 10; 11 with ``binary_payloads``; 13 with the
    ``size_check`` of record_size.py, which uses the variables ``size`` and ``max_bytes``)."""
    conn.execute(
        sql.SQL(_ENQUEUE).format(
            size_variables=sql.SQL("\n        size bigint;\n        max_bytes bigint;" if size_check else ""),
            checks=sql_checks(topic_pattern=topic_pattern, binary_payloads=binary_payloads, size_check=size_check),
            payload_default=sql.SQL(" DEFAULT NULL" if binary_payloads else ""),
            bytes_param=sql.SQL(", payload_bytes bytea DEFAULT NULL" if binary_payloads else ""),
            bytes_column=sql.SQL("payload_bytes, " if binary_payloads else ""),
            bytes_value=sql.SQL("payload_bytes, " if binary_payloads else ""),
            enqueue=t.ident("enqueue"),
            messages=t.messages,
            lock_class=sql.Literal(SERIALIZED_LOCK_CLASS),
            schema=sql.Literal(t.schema),
        )
    )
