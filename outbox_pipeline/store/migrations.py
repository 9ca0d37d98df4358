"""The outbox schema's versioned migrations, in order; a released migration is never edited, a change is a new one. See
docs/operations.md#upgrading-the-schema."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..config import OutboxTable
from .header_rules import refuse_reserved_headers, refuse_unsendable_headers
from .partition_counts import check_snapshot_writers, create_partition_count_guard, lock_counts_as_owner
from .record_size import create_record_bytes, sql_enqueue_size_check
from .routing import create_routing_functions, create_sql_writers, replace_sql_enqueue
from .strategy_record import allow_wal
from .strategy_record import create_table as create_strategy_record
from .topic_names import TOPIC_CHECK_PATTERN, TOPIC_PATTERN

# outbox_topics row that gives the partition count of topics not listed there.
DEFAULT_TOPIC_ROW = "*"
DEFAULT_VIRTUAL_PARTITIONS = 8
DEFAULT_DAYS_AHEAD = 7
# Key for pg_advisory_xact_lock(class, hashtext(schema)) taken by migrators.
MIGRATION_LOCK_CLASS = 0x4F4D  # "OM"


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    apply: Callable[[psycopg.Connection, OutboxTable], None]


# The columns a copy of an outbox row keeps besides its ids, topic and key (dead letters, rows held behind one), as
# migrations 1 and 8 created them; migration 11 adds ``payload_bytes bytea`` and lets ``payload`` be NULL.
MESSAGE_BODY_COLUMNS = """
    type           text,
    payload        jsonb       NOT NULL,
    headers        jsonb       NOT NULL,
    partition      integer     NOT NULL,
    priority       smallint    NOT NULL,
    transaction_id xid8        NOT NULL,
    created_at     timestamptz NOT NULL,
"""


def _create_quarantine_tables(conn: psycopg.Connection, t: OutboxTable) -> None:
    """Migration 8."""
    conn.execute(
        sql.SQL(
            """
            CREATE TABLE {holds} (
                topic           text        NOT NULL,
                key             text        NOT NULL,
                partition       integer     NOT NULL,
                dead_letter_id  bigint      NOT NULL,
                held_since      timestamptz NOT NULL DEFAULT now(),
                released_at     timestamptz,
                release         text        CHECK (release IN ('retry', 'discard')),
                released_by     text,
                available_after timestamptz NOT NULL DEFAULT now(),
                PRIMARY KEY (topic, key)
            )
            """
        ).format(holds=t.holds)
    )
    conn.execute(sql.SQL("CREATE INDEX outbox_holds_partition ON {} (topic, partition)").format(t.holds))
    conn.execute(
        sql.SQL(
            """
            CREATE TABLE {held} (
                id             bigint      PRIMARY KEY,
                message_id     uuid        NOT NULL,
                topic          text        NOT NULL,
                key            text        NOT NULL,
                {body}
                attempts       integer     NOT NULL DEFAULT 0,
                last_error     text,
                held_at        timestamptz NOT NULL DEFAULT now()
            )
            """
        ).format(held=t.held, body=sql.SQL(MESSAGE_BODY_COLUMNS.strip()))
    )
    conn.execute(sql.SQL("CREATE INDEX outbox_held_key ON {} (topic, key, transaction_id, id)").format(t.held))
    for column in ("discarded_at timestamptz", "discarded_by text", "discard_reason text"):
        conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN " + column).format(t.dead_letters))


def _m001_base(conn: psycopg.Connection, t: OutboxTable) -> None:
    """Migration 1: the message table and its partitions' default, the offsets, the dead letters and the topics."""
    for statement in [*_messages_table(conn, t), *_offsets_table(t), *_dead_letters_table(t), *_topics_table(t)]:
        conn.execute(statement)


def _messages_table(conn: psycopg.Connection, t: OutboxTable) -> list[sql.Composed]:
    """The partitioned message table, its id sequence, its default partition and the strategies' indexes."""
    seq = t.ident("outbox_messages_id_seq")
    seq_regclass = sql.Literal(seq.as_string(conn))
    return [
        # A plain sequence instead of an identity column: identity columns on partitioned tables need
        # PostgreSQL 17, and production may run anything from 13 on.
        sql.SQL("CREATE SEQUENCE {seq} AS bigint").format(seq=seq),
        sql.SQL(
            """
            CREATE TABLE {messages} (
                id              bigint      NOT NULL DEFAULT nextval({seq}::regclass),
                message_id      uuid        NOT NULL DEFAULT gen_random_uuid(),
                topic           text        NOT NULL
                    CONSTRAINT outbox_messages_topic_valid
                    CHECK (topic ~ {topic_pattern} AND topic NOT IN ('.', '..')),
                key             text,
                type            text,
                payload         jsonb       NOT NULL,
                headers         jsonb       NOT NULL DEFAULT '{{}}'::jsonb,
                partition       integer     NOT NULL DEFAULT 0 CHECK (partition >= 0),
                priority        smallint    NOT NULL DEFAULT 0,
                transaction_id  xid8        NOT NULL DEFAULT pg_current_xact_id(),
                created_at      timestamptz NOT NULL DEFAULT now(),
                available_after timestamptz NOT NULL DEFAULT now(),
                locked_by       text,
                attempts        integer     NOT NULL DEFAULT 0,
                last_error      text,
                sent_at         timestamptz,
                PRIMARY KEY (id, created_at)
            ) PARTITION BY RANGE (created_at)
            """
        ).format(messages=t.messages, seq=seq_regclass, topic_pattern=sql.Literal(TOPIC_PATTERN)),
        sql.SQL("ALTER SEQUENCE {seq} OWNED BY {messages}.id").format(seq=seq, messages=t.messages),
        # The safety net: a row whose day has no partition yet lands here instead of failing the
        # writer's transaction. Maintenance reports and moves such rows.
        sql.SQL("CREATE TABLE {default} PARTITION OF {messages} DEFAULT").format(
            default=t.ident("outbox_messages_default"), messages=t.messages
        ),
        # Row-claiming strategies (locking, advisory, lease): unsent rows, highest priority first,
        # then oldest. Partial, so sent rows kept for replay (mark-sent mode) cost the claim nothing.
        sql.SQL("CREATE INDEX outbox_messages_pending ON {messages} (priority DESC, id) WHERE sent_at IS NULL").format(
            messages=t.messages
        ),
        # Virtual partitions (seed variant 3): read past a (transaction_id, id) position.
        sql.SQL("CREATE INDEX outbox_messages_position ON {messages} (topic, partition, transaction_id, id)").format(
            messages=t.messages
        ),
        # Serialized writers (seed variant 4): read past an id position.
        sql.SQL("CREATE INDEX outbox_messages_serial ON {messages} (topic, partition, id)").format(messages=t.messages),
    ]


def _offsets_table(t: OutboxTable) -> list[sql.Composed]:
    """The position strategies' offsets: one row per (topic, virtual partition)."""
    return [
        sql.SQL(
            """
            CREATE TABLE {offsets} (
                topic                         text        NOT NULL,
                partition                     integer     NOT NULL CHECK (partition >= 0),
                last_processed_transaction_id xid8        NOT NULL DEFAULT '0',
                last_processed_id             bigint      NOT NULL DEFAULT 0,
                available_after               timestamptz NOT NULL DEFAULT now(),
                locked_by                     text,
                attempts                      integer     NOT NULL DEFAULT 0,
                last_error                    text,
                updated_at                    timestamptz NOT NULL DEFAULT now(),
                PRIMARY KEY (topic, partition)
            )
            """
        ).format(offsets=t.offsets),
        sql.SQL("CREATE INDEX outbox_offsets_available ON {offsets} (available_after)").format(offsets=t.offsets),
    ]


def _dead_letters_table(t: OutboxTable) -> list[sql.Composed]:
    """The dead letters: a copy of each message the relay gave up on, with why."""
    return [
        sql.SQL(
            """
            CREATE TABLE {dead_letters} (
                id               bigint      PRIMARY KEY,
                message_id       uuid        NOT NULL,
                topic            text        NOT NULL,
                key              text,
                {body}
                attempts         integer     NOT NULL,
                last_error       text        NOT NULL,
                dead_lettered_at timestamptz NOT NULL DEFAULT now(),
                dead_lettered_by text,
                retried_at       timestamptz
            )
            """
        ).format(dead_letters=t.dead_letters, body=sql.SQL(MESSAGE_BODY_COLUMNS.strip())),
    ]


def _topics_table(t: OutboxTable) -> list[sql.Composed]:
    """Each topic's count of virtual partitions, and the default row for topics not listed."""
    return [
        sql.SQL(
            """
            CREATE TABLE {topics} (
                topic      text        PRIMARY KEY
                    CHECK (topic = {default_row} OR (topic ~ {topic_pattern} AND topic NOT IN ('.', '..'))),
                partitions integer     NOT NULL CHECK (partitions BETWEEN 1 AND 100000),
                updated_at timestamptz NOT NULL DEFAULT now()
            )
            """
        ).format(
            topics=t.topics,
            default_row=sql.Literal(DEFAULT_TOPIC_ROW),
            topic_pattern=sql.Literal(TOPIC_PATTERN),
        ),
        sql.SQL("INSERT INTO {topics} (topic, partitions) VALUES ({row}, {n})").format(
            topics=t.topics, row=sql.Literal(DEFAULT_TOPIC_ROW), n=sql.Literal(DEFAULT_VIRTUAL_PARTITIONS)
        ),
    ]


def notify_channel(table: OutboxTable) -> str:
    """The LISTEN/NOTIFY channel of one outbox (hashed: channel names are limited to 63 bytes)."""
    return "outbox_" + hashlib.md5(table.schema.encode("utf-8")).hexdigest()[:16]


def _m002_wakeups_and_fairness(conn: psycopg.Connection, t: OutboxTable) -> None:
    statements = [
        # One NOTIFY per inserting statement (not per row), delivered at commit: an idle relay wakes
        # in milliseconds instead of waiting out its poll interval. Rolled-back inserts notify nobody.
        sql.SQL(
            """
            CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                PERFORM pg_notify({channel}, '');
                RETURN NULL;
            END $$
            """
        ).format(function=t.ident("outbox_notify"), channel=sql.Literal(notify_channel(t))),
        sql.SQL(
            "CREATE TRIGGER outbox_messages_notify AFTER INSERT ON {messages} "
            "FOR EACH STATEMENT EXECUTE FUNCTION {function}()"
        ).format(messages=t.messages, function=t.ident("outbox_notify")),
        # Oldest unsent rows regardless of priority: the anti-starvation share of each claim.
        sql.SQL("CREATE INDEX outbox_messages_pending_oldest ON {messages} (id) WHERE sent_at IS NULL").format(
            messages=t.messages
        ),
    ]
    for statement in statements:
        conn.execute(statement)


def _m003_lease_table(conn: psycopg.Connection, t: OutboxTable) -> None:
    # Strategy `lease` keeps its leases here instead of on the message row. Updating a wide message row
    # writes a whole new version of it and, once its page is full (a batch leases every row of a page
    # in one statement), an entry in each of the six indexes: measured 160-380 ms to lease 5,000 rows,
    # against ~30 ms to insert 5,000 rows of this narrow table. Churn is constant (rows live for one
    # publish), hence vacuum at 1 % dead rows.
    conn.execute(
        sql.SQL(
            """
            CREATE TABLE {leases} (
                id          bigint      PRIMARY KEY,
                created_at  timestamptz NOT NULL,
                locked_by   text        NOT NULL,
                expires_at  timestamptz NOT NULL
            ) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_insert_scale_factor = 0.01,
                    autovacuum_vacuum_cost_delay = 0)
            """
        ).format(leases=t.leases)
    )


# The setting a writer's transaction sets to 'off' to insert without a NOTIFY (see _m004).
NOTIFY_SETTING = "outbox.notify"


def _m004_notify_opt_out(conn: psycopg.Connection, t: OutboxTable) -> None:
    # PostgreSQL refuses PREPARE TRANSACTION after NOTIFY ("cannot PREPARE a transaction that has
    # executed LISTEN, UNLISTEN, or NOTIFY"), so an XA/2PC writer could not use the outbox at all. Such
    # a writer runs ``SET LOCAL outbox.notify = off`` (``enqueue(..., notify=False)`` does it): its rows
    # send no wake-up and the relay finds them by polling (at most ``max_poll_interval_s`` later).
    conn.execute(
        sql.SQL(
            """
            CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF coalesce(current_setting({setting}, true), '') <> 'off' THEN
                    PERFORM pg_notify({channel}, '');
                END IF;
                RETURN NULL;
            END $$
            """
        ).format(
            function=t.ident("outbox_notify"),
            setting=sql.Literal(NOTIFY_SETTING),
            channel=sql.Literal(notify_channel(t)),
        )
    )


def _m005_worker_registry(conn: psycopg.Connection, t: OutboxTable) -> None:
    # Running relay workers (see liveness.py): a session-bound worker that no session holds the lock of is
    # dead, and every worker's upkeep frees what it held at once instead of after lease_s.
    conn.execute(
        sql.SQL(
            """
            CREATE TABLE {workers} (
                worker_id        text        PRIMARY KEY,
                kind             text        NOT NULL,
                liveness         text        NOT NULL CHECK (liveness IN ('session', 'expiry')),
                backend_pid      integer,
                application_name text,
                registered_at    timestamptz NOT NULL DEFAULT now(),
                heartbeat_at     timestamptz NOT NULL DEFAULT now()
            )
            """
        ).format(workers=t.workers)
    )


def _m008_quarantine(conn: psycopg.Connection, t: OutboxTable) -> None:
    _create_quarantine_tables(conn, t)
    create_partition_count_guard(conn, t, default_row=DEFAULT_TOPIC_ROW, with_holds=True)


def _m010_cheap_topic_check(conn: psycopg.Connection, t: OutboxTable) -> None:
    # Added NOT VALID, then validated: the ALTER's exclusive lock is held for the catalog change only, and the check
    # of every existing row (about 0.5 us a row) runs under VALIDATE's lock, which lets writers write.
    conn.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT outbox_messages_topic_valid").format(t.messages))
    conn.execute(
        sql.SQL(
            """
            ALTER TABLE {messages} ADD CONSTRAINT outbox_messages_topic_valid
                CHECK (topic ~ {pattern} AND length(topic) <= 249 AND topic NOT IN ('.', '..')) NOT VALID
            """
        ).format(messages=t.messages, pattern=sql.Literal(TOPIC_CHECK_PATTERN))
    )
    conn.execute(sql.SQL("ALTER TABLE {} VALIDATE CONSTRAINT outbox_messages_topic_valid").format(t.messages))
    replace_sql_enqueue(conn, t, topic_pattern=TOPIC_CHECK_PATTERN)


def _m011_binary_payloads(conn: psycopg.Connection, t: OutboxTable) -> None:
    # A payload is JSON (``payload``, queryable as before) or bytes (``payload_bytes``, published unchanged), exactly
    # one of them. No table rewrite: the new column is NULL in every retained row, dropping NOT NULL changes the
    # catalog only, and the check is added NOT VALID (every retained row has a JSON payload, the column being NOT
    # NULL until now); new rows are checked. ``ALTER TABLE ... VALIDATE CONSTRAINT`` proves it for the old rows
    # later, reading them without blocking writers.
    copies = ((t.messages, "outbox_messages"), (t.dead_letters, "outbox_dead_letters"), (t.held, "outbox_held"))
    for target, name in copies:
        conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN payload_bytes bytea").format(target))
        conn.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN payload DROP NOT NULL").format(target))
        check = "ALTER TABLE {} ADD CONSTRAINT {} CHECK (num_nonnulls(payload, payload_bytes) = 1) NOT VALID"
        conn.execute(sql.SQL(check).format(target, sql.Identifier(f"{name}_one_payload")))
    old = sql.SQL("DROP FUNCTION {}(text, jsonb, text, jsonb, text, integer, boolean)").format(t.ident("enqueue"))
    conn.execute(old)
    replace_sql_enqueue(conn, t, topic_pattern=TOPIC_CHECK_PATTERN, binary_payloads=True)


def _m012_sendable_headers(conn: psycopg.Connection, t: OutboxTable) -> None:
    refuse_unsendable_headers(conn, t)
    replace_sql_enqueue(conn, t, topic_pattern=TOPIC_CHECK_PATTERN, binary_payloads=True)


def _m013_writers_and_snapshots(conn: psycopg.Connection, t: OutboxTable) -> None:
    # Functions only: nothing here locks or reads the message table.
    create_partition_count_guard(
        conn, t, default_row=DEFAULT_TOPIC_ROW, with_holds=True, announce=True, read_committed_only=True
    )
    lock_counts_as_owner(
        conn, t, default_row=DEFAULT_TOPIC_ROW, notify_setting=NOTIFY_SETTING, channel=notify_channel(t)
    )
    create_record_bytes(conn, t)
    replace_sql_enqueue(
        conn, t, topic_pattern=TOPIC_CHECK_PATTERN, binary_payloads=True, size_check=sql_enqueue_size_check(t)
    )


MIGRATIONS: Sequence[Migration] = (
    Migration(1, "base tables and indexes", _m001_base),
    Migration(2, "NOTIFY on insert; index of the oldest unsent rows", _m002_wakeups_and_fairness),
    Migration(3, "lease table for strategy lease", _m003_lease_table),
    Migration(4, "writers may opt out of the NOTIFY (two-phase commit)", _m004_notify_opt_out),
    Migration(5, "registry of running workers (crash failover)", _m005_worker_registry),
    Migration(
        6,
        "routing in SQL: murmur2 and partition_for",
        lambda conn, t: create_routing_functions(conn, t, DEFAULT_TOPIC_ROW),
    ),
    Migration(
        7,
        "writers in any language: rows without a partition are routed, SQL enqueue, partition-count guard",
        lambda conn, t: create_sql_writers(conn, t, default_row=DEFAULT_TOPIC_ROW, topic_pattern=TOPIC_PATTERN),
    ),
    Migration(8, "key-scoped quarantine: holds and held rows; discarded dead letters", _m008_quarantine),
    Migration(
        9,
        "writers with a transaction snapshot cannot route with a partition count changed after it",
        lambda conn, t: check_snapshot_writers(
            conn, t, default_row=DEFAULT_TOPIC_ROW, notify_setting=NOTIFY_SETTING, channel=notify_channel(t)
        ),
    ),
    Migration(10, "topic names checked without a bounded regex (17 us a row for writers)", _m010_cheap_topic_check),
    Migration(11, "payloads as bytes as well as JSON (payload_bytes), no table rewrite", _m011_binary_payloads),
    Migration(
        12, "headers the relay can send: base64 checked; the table refuses others in new rows", _m012_sendable_headers
    ),
    Migration(
        13,
        "partition-count changes in READ COMMITTED only; snapshot writers need no UPDATE on outbox_topics; SQL "
        "enqueue refuses a message over the relay's record size",
        _m013_writers_and_snapshots,
    ),
    Migration(14, "the outbox records the strategy that relays it", create_strategy_record),
    Migration(
        15,
        "the table refuses headers named as the relay's own (message_id, type, outbox_id, created_at)",
        refuse_reserved_headers,
    ),
    Migration(16, "the wal strategy can be recorded (its SQL comes with init-db --strategy wal)", allow_wal),
)
LATEST_VERSION = MIGRATIONS[-1].version
