"""What makes an outbox a wal outbox: the SQL that emits (one transactional message per message, in one commit order),
the publication and the slot. See docs/wal.md#the-writer-forms."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ... import settings
from ...config import OutboxTable
from ...errors import SchemaError
from ..record_size import sql_enqueue_size_check
from ..routing import sql_checks
from ..topic_names import TOPIC_CHECK_PATTERN
from . import grants, position, refusals
from .format import CREATED_AT_OFFSET, prefix_of

# PostgreSQL's epoch (2000-01-01) in Unix seconds: format.py's timestamps count from it, as the binary timestamptz.
_PG_EPOCH_S = 946684800
# pgoutput's ``messages`` option, which streams logical decoding messages, came with PostgreSQL 14.
WAL_SINCE_SERVER_VERSION = 140000
# A slot with ``failover = true`` is synced to a standby that asks for it (sync_replication_slots) from PostgreSQL 17
# on, so that a promoted standby has it (docs/operations.md, Failover slots); before 17 the argument does not exist.
FAILOVER_SINCE_SERVER_VERSION = 170000
# How long init-db waits for the transactions running when it creates the slot.
SLOT_CREATE_TIMEOUT_S = 30

# now() or a row's created_at as format.py's ``created`` (microseconds since 2000-01-01; 'infinity' as the bounds).
_MICROS = """CASE WHEN isfinite({at}) THEN ((extract(epoch FROM {at}) - {epoch}) * 1000000)::bigint
                  WHEN {at} > 'epoch'::timestamptz THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END"""

# format.py's layout, built in SQL (int2send/int4send/int8send are big-endian).
_WAL_CONTENT = """
    CREATE OR REPLACE FUNCTION {wal_content}(
        message_id uuid, created_at timestamptz, topic text, key text, type text, payload jsonb, payload_bytes bytea,
        headers jsonb, partition integer) RETURNS bytea
    LANGUAGE sql STABLE PARALLEL SAFE AS $fn$
        SELECT '\\x01'::bytea || CASE WHEN payload_bytes IS NULL THEN '\\x00'::bytea ELSE '\\x01'::bytea END
            || int8send({micros}) || int4send(coalesce(partition, -1))
            || int2send(octet_length(u.topic)::smallint) || int4send(coalesce(octet_length(u.key), -1))
            || int4send(coalesce(octet_length(u.type), -1)) || int4send(octet_length(u.headers))
            || convert_to(message_id::text, 'UTF8') || u.topic || coalesce(u.key, '') || coalesce(u.type, '')
            || u.headers || coalesce(payload_bytes, convert_to(payload::text, 'UTF8'))
        FROM (SELECT convert_to(topic, 'UTF8') AS topic, convert_to(key, 'UTF8') AS key,
                     convert_to(type, 'UTF8') AS type, convert_to(coalesce(headers, '{{}}')::text, 'UTF8') AS headers) u
    $fn$
"""

# The checks of every SQL writer (routing.py), then one message: its LSN as a bigint.
_EMIT = """
    CREATE OR REPLACE FUNCTION {emit}(
        topic text, payload jsonb, key text, headers jsonb, type text, payload_bytes bytea, partition integer,
        message_id uuid, created_at timestamptz) RETURNS bigint
    LANGUAGE plpgsql VOLATILE AS $fn$
    #variable_conflict use_variable
    DECLARE
        bad text;
        size bigint;
        max_bytes bigint;
    BEGIN
        {checks}
        IF partition < 0 THEN
            RAISE EXCEPTION 'outbox enqueue: partition must be >= 0, got %', partition
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        PERFORM {require_slot}();
        RETURN (pg_logical_emit_message(true, {prefix}, {wal_content}(
            coalesce(message_id, gen_random_uuid()), coalesce(created_at, now()), topic, key, type, payload,
            payload_bytes, headers, partition)) - '0/0'::pg_lsn)::bigint;
    END
    $fn$
"""

# The Python writer's messages, checked and built by it: the transaction's now() goes over their created_at, as a row's
# default would stamp it. In the array's order (the tlist's volatile call is evaluated after the ORDER BY's sort).
_EMIT_MANY = """
    CREATE OR REPLACE FUNCTION {emit_many}(contents bytea[]) RETURNS SETOF bigint
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
        SELECT (pg_logical_emit_message(true, {prefix},
                    overlay(u.c PLACING int8send({micros}) FROM {created_from} FOR 8)) - '0/0'::pg_lsn)::bigint
        FROM unnest(contents) WITH ORDINALITY AS u(c, ord)
        WHERE {require_slot}()
        ORDER BY u.ord
    $fn$
"""

# One message (the common call): a bytea parameter, not an array of one, and a scalar function (no set to build).
# SECURITY DEFINER keeps a plan from inlining it: 1.5 us more a call on the server (measured, embedded 18).
_EMIT_ONE = """
    CREATE OR REPLACE FUNCTION {emit_one}(content bytea) RETURNS bigint
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
        SELECT CASE WHEN {require_slot}() THEN (pg_logical_emit_message(true, {prefix},
                    overlay(content PLACING int8send({micros}) FROM {created_from} FOR 8)) - '0/0'::pg_lsn)::bigint END
    $fn$
"""

# enqueue's signature and OUT parameters; the message_id it returns is the message's, the id its LSN.
_ENQUEUE = """
    CREATE OR REPLACE FUNCTION {enqueue}(
        topic text, payload jsonb DEFAULT NULL, key text DEFAULT NULL, headers jsonb DEFAULT '{{}}',
        type text DEFAULT NULL, priority integer DEFAULT 0, serialized boolean DEFAULT false,
        payload_bytes bytea DEFAULT NULL, OUT id bigint, OUT message_id uuid)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
    #variable_conflict use_variable
    BEGIN
        IF priority IS NULL OR priority NOT BETWEEN -32768 AND 32767 THEN
            RAISE EXCEPTION 'outbox enqueue: priority must be in -32768..32767, got %', priority
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        -- serialized and priority change nothing here: the stream is in commit order.
        message_id := gen_random_uuid();
        id := {emit}(topic, payload, key, headers, type, payload_bytes, NULL, message_id, now());
    END
    $fn$
"""

# Named to sort before outbox_messages_route: BEFORE triggers fire in name order, and after one returns NULL the
# others do not fire, so a row without a partition is not routed here (the relay routes by key, as for Python writers).
_EMIT_ROW = """
    CREATE OR REPLACE FUNCTION {emit_row}() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
    BEGIN
        PERFORM {emit}(NEW.topic, NEW.payload, NEW.key, NEW.headers, NEW.type, NEW.payload_bytes, NEW.partition,
                       NEW.message_id, NEW.created_at);
        RETURN NULL;
    END
    $fn$
"""
EMIT_TRIGGER = "outbox_messages_emit"
NOTIFY_TRIGGER = "outbox_messages_notify"


@dataclass(frozen=True)
class WalNames:
    """The database-wide names of an outbox's slot and publication, and its messages' prefix."""

    slot: str
    publication: str
    prefix: str


def names_of(table: OutboxTable) -> WalNames:
    """A slot name is 1..63 of [a-z0-9_]: the schema's name where it fits, else a readable part and a hash."""
    readable = re.sub(r"[^a-z0-9_]", "_", table.schema.lower())
    name = f"outbox_{readable}"
    if readable != table.schema or len(name) > 63:
        name = f"{name[:54]}_{hashlib.sha1(table.schema.encode()).hexdigest()[:8]}"
    return WalNames(slot=name, publication=name, prefix=prefix_of(table.schema))


def install_functions(conn: psycopg.Connection, table: OutboxTable) -> None:
    """The emitting SQL and the INSERT trigger; the NOTIFY trigger off (nobody listens, and a NOTIFY orders every
    committing transaction behind one lock); then who may call them (grants.py). In the caller's transaction."""
    names = names_of(table)
    micros_now = sql.SQL(_MICROS).format(at=sql.SQL("now()"), epoch=sql.Literal(_PG_EPOCH_S))
    common = {
        "wal_content": table.ident("wal_content"),
        "emit": table.ident("outbox_emit"),
        "prefix": sql.Literal(names.prefix),
        "require_slot": table.ident("outbox_require_slot"),
    }
    refusals.install_slot_check(conn, table)
    conn.execute(
        sql.SQL(_WAL_CONTENT).format(
            micros=sql.SQL(_MICROS).format(at=sql.SQL("created_at"), epoch=sql.Literal(_PG_EPOCH_S)), **common
        )
    )
    checks = sql_checks(
        topic_pattern=TOPIC_CHECK_PATTERN, binary_payloads=True, size_check=sql_enqueue_size_check(table)
    )
    conn.execute(sql.SQL(_EMIT).format(checks=checks, **common))
    conn.execute(
        sql.SQL(_EMIT_MANY).format(
            emit_many=table.ident("outbox_emit_many"),
            micros=micros_now,
            created_from=sql.Literal(CREATED_AT_OFFSET + 1),
            **common,
        )
    )
    conn.execute(
        sql.SQL(_EMIT_ONE).format(
            emit_one=table.ident("outbox_emit_one"),
            micros=micros_now,
            created_from=sql.Literal(CREATED_AT_OFFSET + 1),
            **common,
        )
    )
    conn.execute(sql.SQL(_ENQUEUE).format(enqueue=table.ident("enqueue"), **common))
    conn.execute(sql.SQL(_EMIT_ROW).format(emit_row=table.ident("outbox_emit_row"), **common))
    position.create_table(conn, table)  # the relay's recorded position (position.py); on an existing outbox too
    conn.execute(
        sql.SQL("DROP TRIGGER IF EXISTS {trigger} ON {messages}").format(
            trigger=sql.Identifier(EMIT_TRIGGER), messages=table.messages
        )
    )
    conn.execute(
        sql.SQL("CREATE TRIGGER {trigger} BEFORE INSERT ON {messages} FOR EACH ROW EXECUTE FUNCTION {fn}()").format(
            trigger=sql.Identifier(EMIT_TRIGGER), messages=table.messages, fn=table.ident("outbox_emit_row")
        )
    )
    conn.execute(
        sql.SQL("ALTER TABLE {messages} DISABLE TRIGGER {trigger}").format(
            messages=table.messages, trigger=sql.Identifier(NOTIFY_TRIGGER)
        )
    )
    grants.restrict(conn, table)


def slot_here(conn: psycopg.Connection, table: OutboxTable) -> bool:
    """Whether this database has the outbox's slot already; refused when the server cannot stream messages or another
    of its databases has the slot. A slot's name is the server's: one of this name made for another database is not
    this outbox's, and taking it (or later dropping it) would be taking that database's messages. init-db asks before
    it makes anything, so that a refusal leaves nothing behind."""
    names = names_of(table)
    if conn.info.server_version < WAL_SINCE_SERVER_VERSION:
        raise SchemaError(
            f"the wal strategy needs PostgreSQL 14 or later (pgoutput streams logical decoding messages from 14 on); "
            f"this server is {conn.info.server_version // 10000}: use a table strategy (partitioned) here"
        )
    row = conn.execute(
        "SELECT database, database = current_database() FROM pg_replication_slots WHERE slot_name = %s", (names.slot,)
    ).fetchone()
    if row is not None and not row[1]:
        raise SchemaError(
            f"the replication slot {names.slot!r} this outbox would use belongs to the database {row[0]!r} on the "
            f"same server (a slot's name is the server's, and it is made from the outbox's schema, {table.schema!r}, "
            f"which a wal outbox in {row[0]!r} has too): give this database's outbox another schema "
            f"({settings.SCHEMA.name}=...) and run `outbox init-db --strategy wal` again; nothing was created"
        )
    return row is not None


def ensure_slot(conn: psycopg.Connection, table: OutboxTable) -> bool:
    """The publication and the slot, if missing (``conn`` in autocommit); True when the slot was created now."""
    names = names_of(table)
    exists = slot_here(conn, table)
    found = conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (names.publication,)).fetchone()
    if found is None:
        conn.execute(sql.SQL("CREATE PUBLICATION {}").format(sql.Identifier(names.publication)))  # empty: messages
    if exists:
        return False
    try:
        with conn.transaction():
            conn.execute(sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(f"{SLOT_CREATE_TIMEOUT_S}s")))
            conn.execute(_create_slot(conn), (names.slot,))
    except psycopg.errors.QueryCanceled:
        raise SchemaError(
            f"the replication slot {names.slot!r} was not created within {SLOT_CREATE_TIMEOUT_S} s: PostgreSQL creates "
            f"it once every transaction running now has ended, and these have not: {_open_transactions(conn)}. End "
            "them (a session: COMMIT or ROLLBACK, or SELECT pg_terminate_backend(pid); a prepared transaction: as "
            "said) and run `outbox init-db --strategy wal` "
            "again (it goes on from here: the outbox's tables and its publication are made, its slot is not, and "
            "nobody can write to it the wal way until it is)"
        ) from None
    except psycopg.errors.ObjectNotInPrerequisiteState as exc:  # wal_level below logical
        raise SchemaError(
            f"the wal strategy needs wal_level = logical on the server ({str(exc).strip()}): set it (ALTER SYSTEM SET "
            "wal_level = logical, or the managed service's parameter group: rds.logical_replication = 1 on RDS) and "
            "restart PostgreSQL"
        ) from None
    return True


def _create_slot(conn: psycopg.Connection) -> str:
    """(slot name, plugin, temporary, two-phase, failover): the fifth argument exists from PostgreSQL 17 on."""
    if conn.info.server_version >= FAILOVER_SINCE_SERVER_VERSION:
        return "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, false, true)"
    return "SELECT pg_create_logical_replication_slot(%s, 'pgoutput')"


def _open_transactions(conn: psycopg.Connection) -> str:
    rows = conn.execute(
        """
        SELECT pid, coalesce(usename, '?'), coalesce(application_name, ''), now() - xact_start
        FROM pg_stat_activity
        WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
        ORDER BY xact_start LIMIT 5
        """
    ).fetchall()
    sessions = [f"pid {pid} ({user}, {app!r}, open {age})" for pid, user, app, age in rows]
    found = sessions + _prepared_transactions(conn)
    return "; ".join(found) if found else "none is left now (try again)"


def _prepared_transactions(conn: psycopg.Connection) -> list[str]:
    """Prepared transactions (two-phase commit) hold the slot up too, and no session shows them: each named with the
    statement that ends it, run in its database as its owner or a superuser."""
    rows = conn.execute(
        "SELECT gid, owner, database, now() - prepared FROM pg_prepared_xacts ORDER BY prepared LIMIT 5"
    ).fetchall()
    said = []
    for gid, owner, database, age in rows:
        quoted = "'" + str(gid).replace("'", "''") + "'"
        said.append(
            f"prepared transaction {quoted} (owner {owner}, database {database}, prepared {age} ago): its "
            f"transaction manager should finish it; if it is lost, connect to {database} as {owner} and run "
            f"`COMMIT PREPARED {quoted}` or `ROLLBACK PREPARED {quoted}`"
        )
    return said


def slot_holder(conn: psycopg.Connection, slot: str) -> tuple[bool, int | None]:
    """Whether this database has the slot, and the server process streaming it (None: none). Slot names are the
    server's: a slot of this name made for another database is not this outbox's."""
    row = conn.execute(
        "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s AND database = current_database()", (slot,)
    ).fetchone()
    return (False, None) if row is None else (True, row[0])


def drop_slot(conn: psycopg.Connection, table: OutboxTable) -> None:
    """The slot and the publication gone (``conn`` in autocommit); a walsender still on the slot is ended first. What
    the slot had not confirmed is gone with it: only for an outbox that is being dropped or leaves the wal strategy."""
    names = names_of(table)
    for _ in range(50):
        exists, pid = slot_holder(conn, names.slot)
        if not exists:
            break
        if pid is not None:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
            continue
        try:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (names.slot,))
        except psycopg.errors.ObjectInUse:
            continue  # a walsender took it meanwhile
        break
    conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(names.publication)))


def drop_by_hand(table: OutboxTable) -> str:
    """``drop_slot`` as SQL an operator pastes into psql (in the outbox's database, as its owner or a superuser), for
    the advice that asks for it. The names are [a-z0-9_] (``names_of``): quoted as they are."""
    names = names_of(table)
    return f"SELECT pg_drop_replication_slot('{names.slot}'); DROP PUBLICATION IF EXISTS {names.publication}"
