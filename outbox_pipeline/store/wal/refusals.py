"""What a wal outbox refuses, so that nothing is written where no relay reads it: a row in its message table, and a
write while its slot is missing or lost. See docs/wal.md#writers."""

from __future__ import annotations

import psycopg
from psycopg import sql

from ...config import OutboxTable
from ...errors import SchemaError

# Every emit first asks whether the slot can stream what it emits: a message emitted while the slot is lost or missing
# is decoded by nobody, and the writer's commit would say it was stored. Asked once a transaction (the answer is kept
# in a transaction-local setting). Measured in a server-side loop on PostgreSQL 18: 9 to 10 us for the first message
# of a transaction (pg_replication_slots read), 1 to 2 us for each further one (emit_one 1.1-1.3 us -> 2.9 us).
_REQUIRE_SLOT = """
    CREATE OR REPLACE FUNCTION {require_slot}() RETURNS boolean
    LANGUAGE plpgsql VOLATILE AS $fn$
    DECLARE
        status text;
    BEGIN
        IF current_setting({checked}, true) = 'yes' THEN
            RETURN true;
        END IF;
        SELECT coalesce(wal_status, '') INTO status
        FROM pg_replication_slots WHERE slot_name = {slot} AND database = current_database();
        IF NOT FOUND THEN
            RAISE EXCEPTION USING MESSAGE = {missing}, ERRCODE = 'object_not_in_prerequisite_state';
        ELSIF status = 'lost' THEN
            RAISE EXCEPTION USING MESSAGE = {lost}, ERRCODE = 'object_not_in_prerequisite_state';
        END IF;
        PERFORM set_config({checked}, 'yes', true);
        RETURN true;
    END
    $fn$
"""

# A wal outbox's message table keeps no row: the emitting trigger returns NULL before any constraint is checked, so
# only a row written with triggers off meets this one (session_replication_role = replica: logical replication's
# apply, pg_restore's --disable-triggers; a table made before its trigger), and is refused instead of being stored
# where no relay reads it. Constraints hold whatever the triggers do.
REFUSE_ROWS = "outbox_wal_rows_go_to_the_stream"
REFUSE_ROWS_LOCK_TIMEOUT_S = 10


def install_slot_check(conn: psycopg.Connection, table: OutboxTable) -> None:
    """``<schema>.outbox_require_slot()``: refuses a write with slot.py's words when the slot is missing or lost."""
    from .objects import names_of  # objects.py makes the outbox's functions, and calls this
    from .slot import SlotState, unusable_reason

    slot = names_of(table).slot
    refused = "outbox write refused: {}"
    lost = unusable_reason(table, SlotState(slot, True, wal_status="lost"))
    conn.execute(
        sql.SQL(_REQUIRE_SLOT).format(
            require_slot=table.ident("outbox_require_slot"),
            checked=sql.Literal(f"outbox.slot_usable_{slot}"),
            slot=sql.Literal(slot),
            missing=sql.Literal(refused.format(unusable_reason(table, SlotState(slot, False)))),
            lost=sql.Literal(refused.format(lost)),
        )
    )


def refuse_rows(conn: psycopg.Connection, table: OutboxTable) -> None:
    """The message table refuses every row (REFUSE_ROWS); added NOT VALID, so that rows an older wal outbox stored
    are kept for an operator to move (stored_rows_problem), and validated when there are none."""
    found = conn.execute(
        "SELECT convalidated FROM pg_constraint WHERE conrelid = %s::regclass AND conname = %s",
        (table.messages.as_string(conn), REFUSE_ROWS),
    ).fetchone()
    if found is None:
        # The ALTER's exclusive lock queues every writer behind it while it waits: it waits a bounded time.
        conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(f"{REFUSE_ROWS_LOCK_TIMEOUT_S}s")))
        try:
            conn.execute(
                sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} CHECK (false) NOT VALID").format(
                    table.messages, sql.Identifier(REFUSE_ROWS)
                )
            )
        except psycopg.errors.LockNotAvailable:
            raise SchemaError(
                f"init-db did not get its lock on {table.messages.as_string(None)} within {REFUSE_ROWS_LOCK_TIMEOUT_S} "
                "s: a transaction holds it (pg_locks shows it); nothing was changed, run `outbox init-db "
                "--strategy wal` again"
            ) from None
    if (found is None or not found[0]) and stored_rows(conn, table) == 0:
        conn.execute(
            sql.SQL("ALTER TABLE {} VALIDATE CONSTRAINT {}").format(table.messages, sql.Identifier(REFUSE_ROWS))
        )


def stored_rows(conn: psycopg.Connection, table: OutboxTable, cap: int = 1_000_000) -> int:
    """Rows in a wal outbox's message table (at most ``cap`` counted): none is ever relayed."""
    row = conn.execute(
        sql.SQL("SELECT count(*) FROM (SELECT FROM {} LIMIT %s) r").format(table.messages), (cap,)
    ).fetchone()
    return int(row[0]) if row else 0


def stored_rows_problem(table: OutboxTable, rows: int) -> str:
    """What rows in a wal outbox's message table are and the statement that relays them: re-inserted in one
    transaction by a session whose triggers fire, they go through the emitting trigger into the stream."""
    columns = "message_id, created_at, topic, key, type, payload, payload_bytes, headers, partition"
    messages = table.messages.as_string(None)
    return (
        f"{rows} rows stored in {messages}: a wal outbox relays no row (they were written with its triggers off: "
        "session_replication_role = replica, as logical replication's apply and pg_restore --disable-triggers write, "
        "or before init-db had made its trigger), and nothing publishes them. Emit them, in commit order, and delete "
        "them, with session_replication_role = origin (the default), in one transaction: BEGIN; "
        f"INSERT INTO {messages} ({columns}) SELECT {columns} FROM {messages} ORDER BY transaction_id, id; "
        f"DELETE FROM {messages}; COMMIT;"
    )
