"""Transactions with a snapshot of their own (REPEATABLE READ, SERIALIZABLE) on both sides of a partition-count
change: the change cannot pass a pending row its snapshot does not show, and a writer with only a writer's grants
can write in them."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from outbox_pipeline import OutboxTable, enqueue
from outbox_pipeline.store import set_topic_partitions

SNAPSHOT_ISOLATIONS = ["REPEATABLE READ", "SERIALIZABLE"]
WAIT_S = 30.0
# A writer's grants, as docs/operations.md (Writer roles) gives them.
WRITER_GRANTS = (
    "GRANT USAGE ON SCHEMA {schema} TO {role}",
    "GRANT INSERT, SELECT (id, message_id) ON {messages} TO {role}",
    "GRANT USAGE ON SEQUENCE {sequence} TO {role}",
    "GRANT SELECT ON {topics} TO {role}",
)


def _partition_count(db: psycopg.Connection, table: OutboxTable, topic: str) -> int | None:
    row = db.execute(sql.SQL("SELECT partitions FROM {} WHERE topic = %s").format(table.topics), (topic,)).fetchone()
    return None if row is None else int(row[0])


def _change_count(conn: psycopg.Connection, table: OutboxTable, topic: str, partitions: int) -> None:
    conn.execute(sql.SQL("UPDATE {} SET partitions = %s WHERE topic = %s").format(table.topics), (partitions, topic))


def _waits_for_a_lock(db: psycopg.Connection, pid: int) -> bool:
    row = db.execute("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted)", (pid,)).fetchone()
    assert row is not None  # EXISTS answers one row
    return bool(row[0])


def _wait_until_it_waits_or_ends(db: psycopg.Connection, pid: int, ended: threading.Event) -> None:
    """Until the backend ``pid`` waits for a lock or its statement has ended (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while not ended.is_set() and not _waits_for_a_lock(db, pid):
        assert time.monotonic() < deadline, f"backend {pid} neither waited for a lock nor ended"
        time.sleep(0.01)


@pytest.mark.parametrize("isolation", SNAPSHOT_ISOLATIONS)
def test_a_partition_count_change_whose_snapshot_predates_a_pending_row_is_refused(
    isolation: str, db: psycopg.Connection, table: OutboxTable, connect: Callable[[], psycopg.Connection]
) -> None:
    """The guard counts the topic's pending rows in the change's snapshot: taken before a writer committed, it
    showed none, and the count changed under a pending row (one key in two partitions)."""
    set_topic_partitions(db, table, "orders", 8)
    change = connect()
    change.execute(f"BEGIN ISOLATION LEVEL {isolation}")
    change.execute("SELECT 1")  # its snapshot is taken
    enqueue(db, "orders", {"n": 1}, key="customer-1", table=table)  # committed, pending, not in that snapshot

    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="orders"):
        _change_count(change, table, "orders", 16)
    change.execute("ROLLBACK")
    assert _partition_count(db, table, "orders") == 8


@pytest.mark.parametrize("isolation", ["READ COMMITTED", *SNAPSHOT_ISOLATIONS])
def test_a_partition_count_change_begun_while_a_writer_is_in_flight_is_refused_in_any_isolation(
    isolation: str, db: psycopg.Connection, table: OutboxTable, connect: Callable[[], psycopg.Connection]
) -> None:
    """The change's statement takes its snapshot, then waits for the writer in flight: in REPEATABLE READ and
    SERIALIZABLE the row that writer committed meanwhile was not counted, and the count changed under it."""
    set_topic_partitions(db, table, "orders", 8)
    writer = connect()
    writer.execute("BEGIN")
    enqueue(writer, "orders", {"n": 1}, key="customer-1", table=table)
    change = connect()
    outcome: list[BaseException | None] = []
    ended = threading.Event()

    def run_change() -> None:
        try:
            change.execute(f"BEGIN ISOLATION LEVEL {isolation}")
            _change_count(change, table, "orders", 16)
            change.execute("COMMIT")
            outcome.append(None)
        except psycopg.Error as exc:
            change.execute("ROLLBACK")
            outcome.append(exc)
        ended.set()

    thread = threading.Thread(target=run_change)
    thread.start()
    _wait_until_it_waits_or_ends(db, change.info.backend_pid, ended)
    writer.execute("COMMIT")
    thread.join(WAIT_S)

    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], psycopg.errors.ObjectNotInPrerequisiteState), outcome
    assert _partition_count(db, table, "orders") == 8


@pytest.mark.parametrize("isolation", SNAPSHOT_ISOLATIONS)
def test_set_topic_partitions_changes_a_drained_topic_on_a_connection_whose_transactions_have_a_snapshot(
    isolation: str, dsn: str, table: OutboxTable
) -> None:
    """``init-db --topic`` on a database whose ``default_transaction_isolation`` is not READ COMMITTED."""
    level = psycopg.IsolationLevel[isolation.replace(" ", "_")]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.isolation_level = level
        conn.autocommit = False
        set_topic_partitions(conn, table, "orders", 16)
        conn.commit()
        assert _partition_count(conn, table, "orders") == 16


@pytest.fixture
def writer_dsn(db: psycopg.Connection, table: OutboxTable) -> Iterator[str]:
    """A DSN of a role that is no superuser and has a writer's grants on the outbox only."""
    role = sql.Identifier(f"writer_{uuid.uuid4().hex[:8]}")
    db.execute(sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER").format(role))
    names = {
        "schema": table.schema_ident,
        "messages": table.messages,
        "sequence": table.ident("outbox_messages_id_seq"),
        "topics": table.topics,
        "role": role,
    }
    for grant in WRITER_GRANTS:
        db.execute(sql.SQL(grant).format(**names))
    yield make_conninfo(db.info.dsn, user=role.as_string(db).strip('"'))
    db.execute(sql.SQL("DROP OWNED BY {}").format(role))
    db.execute(sql.SQL("DROP ROLE {}").format(role))


def _python_enqueue(conn: psycopg.Connection, table: OutboxTable, key: str) -> None:
    enqueue(conn, "orders", {"n": 1}, key=key, table=table)


def _sql_enqueue(conn: psycopg.Connection, table: OutboxTable, key: str) -> None:
    conn.execute(
        sql.SQL("SELECT id FROM {}(topic => 'orders', payload => '{{}}', key => %s)").format(table.ident("enqueue")),
        (key,),
    )


def _plain_insert(conn: psycopg.Connection, table: OutboxTable, key: str) -> None:
    conn.execute(
        sql.SQL("INSERT INTO {} (topic, key, payload) VALUES ('orders', %s, '{{}}')").format(table.messages), (key,)
    )


# How each kind of writer inserts one row into "orders".
WRITERS = {"python enqueue": _python_enqueue, "sql enqueue": _sql_enqueue, "plain insert": _plain_insert}


def _keys(db: psycopg.Connection, table: OutboxTable) -> list[str]:
    return [r[0] for r in db.execute(sql.SQL("SELECT key FROM {} ORDER BY id").format(table.messages)).fetchall()]


@pytest.mark.parametrize("isolation", ["READ COMMITTED", *SNAPSHOT_ISOLATIONS])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_role_with_a_writers_grants_writes_in_a_transaction_with_a_snapshot(
    writer: str, isolation: str, writer_dsn: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    """Since migration 9 such a writer's insert locks the default topic row FOR SHARE, which takes UPDATE on
    outbox_topics: "permission denied for table outbox_topics" for a role that only writes."""
    with psycopg.connect(writer_dsn, autocommit=True) as conn:
        conn.execute(f"BEGIN ISOLATION LEVEL {isolation}")
        WRITERS[writer](conn, table, "customer-1")
        conn.execute("COMMIT")

    assert _keys(db, table) == ["customer-1"]


@pytest.mark.parametrize("isolation", SNAPSHOT_ISOLATIONS)
def test_a_writer_roles_snapshot_older_than_a_partition_count_change_still_fails_its_insert(
    isolation: str, writer_dsn: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    """The lock that detects a stale snapshot works the same for a role without UPDATE on outbox_topics."""
    with psycopg.connect(writer_dsn, autocommit=True) as conn:
        conn.execute(f"BEGIN ISOLATION LEVEL {isolation}")
        conn.execute("SELECT 1")  # its snapshot is taken
        set_topic_partitions(db, table, "orders", 16)

        with pytest.raises(psycopg.errors.SerializationFailure):
            _plain_insert(conn, table, "customer-1")
        conn.execute("ROLLBACK")

    assert _keys(db, table) == []
