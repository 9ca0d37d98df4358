"""The guard that keeps a topic's partition count from changing under rows routed with the old one, so a key's rows stay
in one virtual partition. See docs/operations.md#routing-in-the-database."""

from __future__ import annotations

import psycopg
from psycopg import sql

from ..config import OutboxTable

# Refuses a change of a topic's effective partition count (its own row, or the default row for the topics
# without one) while any of its rows is pending: the key's old rows and new rows would sit in two partitions
# relayed independently. The SHARE lock waits for writer transactions in flight (they hold ROW EXCLUSIVE
# from their insert to their commit), so a row routed with the old count but not yet committed is seen; it
# blocks new inserts only until this transaction ends. Pending: not deleted, not marked sent, and not behind
# its partition's position (in the order of the strategy that last advanced it: ``read_by``; with none
# recorded, behind in both orders). From migration 8 on, keys held behind dead letters (quarantine) count too:
# their held rows and the dead letter they wait for would go out in the old partition.
_GUARD = """
    CREATE OR REPLACE FUNCTION {guard}() RETURNS trigger LANGUAGE plpgsql AS $fn$
    DECLARE
        the_topic text := CASE TG_OP WHEN 'DELETE' THEN OLD.topic ELSE NEW.topic END;
        default_n integer := (SELECT d.partitions FROM {topics} d WHERE d.topic = {default_row});
        old_n integer;
        new_n integer;
        pending bigint;
        example text;
    BEGIN
        IF TG_OP = 'UPDATE' AND NEW.topic <> OLD.topic THEN
            RAISE EXCEPTION 'outbox: a topic row cannot be renamed; insert the new topic instead'
                USING ERRCODE = 'object_not_in_prerequisite_state';
        END IF;
        IF TG_OP = 'DELETE' AND OLD.topic = {default_row} THEN
            RAISE EXCEPTION 'outbox: the % row holds the default partition count and cannot be deleted', OLD.topic
                USING ERRCODE = 'object_not_in_prerequisite_state';
        END IF;
        -- An upsert fires the INSERT trigger first: compare with the row it would update, if any.
        old_n := CASE TG_OP WHEN 'INSERT' THEN coalesce(
                     (SELECT t.partitions FROM {topics} t WHERE t.topic = NEW.topic), default_n)
                 ELSE OLD.partitions END;
        new_n := CASE TG_OP WHEN 'DELETE' THEN default_n ELSE NEW.partitions END;
        IF old_n IS NOT DISTINCT FROM new_n THEN
            RETURN CASE TG_OP WHEN 'DELETE' THEN OLD ELSE NEW END;
        END IF;{read_committed_only}
        LOCK TABLE {messages} IN SHARE MODE;
        SELECT count(*), min(m.topic) INTO pending, example
        FROM {messages} m
        LEFT JOIN {offsets} o ON o.topic = m.topic AND o.partition = m.partition
        WHERE m.sent_at IS NULL
          AND CASE WHEN the_topic = {default_row}
                   THEN NOT EXISTS (SELECT 1 FROM {topics} t WHERE t.topic = m.topic)
                   ELSE m.topic = the_topic END
          AND NOT {behind};
        pending := pending + {held};
        IF pending > 0 THEN
            RAISE EXCEPTION 'outbox: cannot change the partition count of topic % from % to %: % pending '
                'row(s) would stay in partitions routed with the old count',
                coalesce(example, the_topic), old_n, new_n, pending
                USING ERRCODE = 'object_not_in_prerequisite_state',
                      HINT = 'drain the topic (stop its writers, run the relay until it is empty), then change it';
        END IF;{announce}
        RETURN CASE TG_OP WHEN 'DELETE' THEN OLD ELSE NEW END;
    END
    $fn$
"""

# From migration 13 on, a change runs in READ COMMITTED only. The count of pending rows runs after the SHARE lock has
# waited for the writers in flight, in the statement's snapshot: in READ COMMITTED one taken after the wait (a trigger's
# statements take their own), in REPEATABLE READ and SERIALIZABLE the transaction's, taken at its first statement at
# the latest, before the wait. Rows committed since (the writers waited for among them) were not counted, and the
# count changed under them. No check inside that snapshot can see them, so such a change is refused.
_READ_COMMITTED_ONLY = """
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            RAISE EXCEPTION 'outbox: cannot change the partition count of topic % from % to % in a % transaction: its '
                'snapshot does not show the rows written since it was taken, so pending rows could not be counted',
                the_topic, old_n, new_n, upper(current_setting('transaction_isolation'))
                USING ERRCODE = 'object_not_in_prerequisite_state',
                      HINT = 'run it in a READ COMMITTED transaction: SET TRANSACTION ISOLATION LEVEL READ COMMITTED';
        END IF;"""

# From migration 9 on, a change of any partition count also updates the default row: writers whose snapshot is
# older than the change lock that row FOR SHARE (see _STATEMENT_CHECKS), which then fails them with a serialization
# failure instead of letting them route with the old count.
_ANNOUNCE = """
        IF the_topic <> {default_row} THEN
            UPDATE {topics} SET updated_at = now() WHERE topic = {default_row};
        END IF;"""


# Once per inserting statement (the notify trigger's function, AFTER INSERT FOR EACH STATEMENT): the wake-up, and
# for a writer whose snapshot is its transaction's (REPEATABLE READ, SERIALIZABLE) a FOR SHARE lock of the default
# topic row. The rows were routed with the partition counts of that snapshot; the partition-count guard updates the
# default row whenever a count changes, so a snapshot older than a change fails here (serialization failure: the
# writer retries and routes with the new count) instead of committing one key into two partitions. A READ
# COMMITTED statement sees every change committed before its table lock, which the guard's SHARE lock orders. The
# lock is taken in the trigger's function until migration 13, through a function of the outbox's owner from then on.
_STATEMENT_CHECKS = """
    CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            {lock_counts};
        END IF;
        IF coalesce(current_setting({setting}, true), '') <> 'off' THEN
            PERFORM pg_notify({channel}, '');
        END IF;
        RETURN NULL;
    END $$
"""


_LOCK_COUNTS = "PERFORM 1 FROM {topics} WHERE topic = {default_row} FOR SHARE"

# From migration 13 on, the lock above is taken by this function, as its owner (the role that migrated the outbox,
# which owns outbox_topics): FOR SHARE takes UPDATE privilege, which a writer's role has no business holding. It
# runs in the writer's transaction, so the lock and its serialization failure are the writer's as before. Callable by
# any role with USAGE on the schema (functions are executable by PUBLIC): all it can do is what every such writer's
# insert does. The fixed search_path keeps a caller's objects out of it.
_LOCK_COUNTS_AS_OWNER = """
    CREATE OR REPLACE FUNCTION {function}() RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    BEGIN
        {lock_counts};
    END $$
"""


# Message row ``m`` is behind offsets row ``o``'s position, in the order of the strategy that last advanced it
# (``read_by``): ``partitioned`` by (transaction id, id), ``serialized`` by id. With none recorded, behind in both
# orders: a "write first, enqueue last" writer commits a lower xid after a higher id, so a row behind in one order
# may be ahead in the other. Whoever asks whether a row was relayed (maintenance, the partition-count guard) asks
# this, never the strategy it was told: a wrong name must not pass an unrelayed row.
BEHIND_POSITION = """
    coalesce(CASE o.read_by
        WHEN 'serialized' THEN m.id <= o.last_processed_id
        WHEN 'partitioned' THEN (m.transaction_id, m.id) <= (o.last_processed_transaction_id, o.last_processed_id)
        ELSE m.id <= o.last_processed_id
             AND (m.transaction_id, m.id) <= (o.last_processed_transaction_id, o.last_processed_id)
    END, false)
"""


def check_snapshot_writers(
    conn: psycopg.Connection, t: OutboxTable, *, default_row: str, notify_setting: str, channel: str
) -> None:
    """Migration 9: writers with a transaction snapshot fail instead of routing with a stale partition count."""
    lock_counts = sql.SQL(_LOCK_COUNTS).format(topics=t.topics, default_row=sql.Literal(default_row))
    _replace_statement_checks(conn, t, lock_counts, notify_setting=notify_setting, channel=channel)
    create_partition_count_guard(conn, t, default_row=default_row, with_holds=True, announce=True)


def lock_counts_as_owner(
    conn: psycopg.Connection, t: OutboxTable, *, default_row: str, notify_setting: str, channel: str
) -> None:
    """Migration 13: the snapshot writers' lock through a SECURITY DEFINER function (see _LOCK_COUNTS_AS_OWNER)."""
    function = t.ident("outbox_lock_partition_counts")
    lock_counts = sql.SQL(_LOCK_COUNTS).format(topics=t.topics, default_row=sql.Literal(default_row))
    conn.execute(sql.SQL(_LOCK_COUNTS_AS_OWNER).format(function=function, lock_counts=lock_counts))
    call = sql.SQL("PERFORM {}()").format(function)
    _replace_statement_checks(conn, t, call, notify_setting=notify_setting, channel=channel)


def _replace_statement_checks(
    conn: psycopg.Connection, t: OutboxTable, lock_counts: sql.Composable, *, notify_setting: str, channel: str
) -> None:
    conn.execute(
        sql.SQL(_STATEMENT_CHECKS).format(
            function=t.ident("outbox_notify"),
            lock_counts=lock_counts,
            setting=sql.Literal(notify_setting),
            channel=sql.Literal(channel),
        )
    )


def create_partition_count_guard(
    conn: psycopg.Connection,
    t: OutboxTable,
    *,
    default_row: str,
    with_holds: bool,
    announce: bool = False,
    read_committed_only: bool = False,
) -> None:
    """The guard's function (migration 7; migration 8 replaces it ``with_holds``, once the hold tables exist;
    migration 9 makes it ``announce`` every change on the default row; migration 13 ``read_committed_only``)."""
    held: sql.Composable = sql.SQL("0")
    if with_holds:
        held = sql.SQL(
            """
            (SELECT count(*) FROM {holds} h
             WHERE CASE WHEN the_topic = {default_row}
                        THEN NOT EXISTS (SELECT 1 FROM {topics} t WHERE t.topic = h.topic)
                        ELSE h.topic = the_topic END)
            + (SELECT count(*) FROM {held_rows} x
               WHERE CASE WHEN the_topic = {default_row}
                          THEN NOT EXISTS (SELECT 1 FROM {topics} t WHERE t.topic = x.topic)
                          ELSE x.topic = the_topic END)
            """
        ).format(holds=t.holds, held_rows=t.held, topics=t.topics, default_row=sql.Literal(default_row))
    conn.execute(
        sql.SQL(_GUARD).format(
            guard=t.ident("outbox_topics_guard"),
            messages=t.messages,
            offsets=t.offsets,
            topics=t.topics,
            default_row=sql.Literal(default_row),
            held=held,
            behind=sql.SQL(BEHIND_POSITION),
            announce=sql.SQL(_ANNOUNCE).format(topics=t.topics, default_row=sql.Literal(default_row))
            if announce
            else sql.SQL(""),
            read_committed_only=sql.SQL(_READ_COMMITTED_ONLY if read_committed_only else ""),
        )
    )
