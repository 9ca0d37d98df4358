"""A wal outbox's writers (issue 42): every form emits one transactional logical decoding message per message, no
row, in one commit order; the checks and their errors are those of the table's writers."""

from __future__ import annotations

import datetime as dt
import uuid

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import InvalidMessageError, Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.errors import OutboxError, SchemaError
from outbox_pipeline.relay.wal.pgoutput import Message as PgMessage
from outbox_pipeline.relay.wal.pgoutput import decode_pgoutput
from outbox_pipeline.store import init_db
from outbox_pipeline.store.wal import objects as wal_objects
from outbox_pipeline.store.wal.format import WalMessage, decode
from outbox_pipeline.store.wal.objects import drop_slot, names_of
from outbox_pipeline.store.wal.slot import slot_state
from tests.kit.probes import wait_until

_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)


def emitted(conn: psycopg.Connection, table: OutboxTable) -> list[WalMessage]:
    """What the outbox's slot would stream, read without consuming it. Decoding stops at the WAL flushed so far and
    the test server commits asynchronously: a marker committed last tells when everything before it is there."""
    names = names_of(table)
    marker = uuid.uuid4().bytes
    conn.execute("SELECT pg_logical_emit_message(true, %s, %s::bytea)", (names.prefix, marker))
    messages: list[bytes] = []

    def marked() -> bool:
        rows = conn.execute(
            """
            SELECT data FROM pg_logical_slot_peek_binary_changes(
                %s, NULL, NULL, 'proto_version', '1', 'publication_names', %s, 'messages', 'true')
            """,
            (names.slot, names.publication),
        ).fetchall()
        events = [decode_pgoutput(bytes(data)) for (data,) in rows]
        messages[:] = [e.content for e in events if isinstance(e, PgMessage) and e.prefix == names.prefix.encode()]
        return marker in messages

    wait_until("the marker's commit decoded", marked, 10.0)
    return [decode(content) for content in messages[: messages.index(marker)]]


def stored_rows(conn: psycopg.Connection, table: OutboxTable) -> int:
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table.messages)).fetchone()
    return int(row[0]) if row else -1


def test_enqueue_emits_the_message_whole_and_stores_no_row(db: psycopg.Connection, wal_outbox: OutboxTable) -> None:
    with db.transaction():
        result = enqueue(
            db, "orders", {"n": 1, "name": "é☃"}, key="k1", headers={"h": "v"}, type="order.created", table=wal_outbox
        )
    [m] = emitted(db, wal_outbox)
    assert (m.topic, m.key, m.type, m.payload, m.binary) == (
        "orders",
        b"k1",
        b"order.created",
        '{"n": 1, "name": "é☃"}'.encode(),
        False,
    )
    assert m.message_id == str(result.message_id).encode()
    assert m.headers == '{"h": "v"}'
    assert abs(_PG_EPOCH + dt.timedelta(microseconds=m.created_at) - dt.datetime.now(dt.UTC)) < dt.timedelta(
        minutes=1
    )  # the database's now(), stamped by the emitting function
    assert stored_rows(db, wal_outbox) == 0


def test_enqueue_many_emits_each_message_with_the_message_id_it_returns(
    db: psycopg.Connection, wal_outbox: OutboxTable
) -> None:
    with db.transaction():
        results = enqueue_many(db, [Message("orders", {"n": n}, key=f"k{n}") for n in range(50)], table=wal_outbox)
    emitted_now = emitted(db, wal_outbox)
    assert [m.message_id for m in emitted_now] == [str(r.message_id).encode() for r in results]
    assert [m.key for m in emitted_now] == [f"k{n}".encode() for n in range(50)]


def test_a_bytes_payload_is_emitted_byte_for_byte(db: psycopg.Connection, wal_outbox: OutboxTable) -> None:
    payload = bytes(range(256))
    with db.transaction():
        enqueue(db, "blobs", payload, key="k", table=wal_outbox)
    [m] = emitted(db, wal_outbox)
    assert (m.payload, m.binary) == (payload, True)


def test_a_rolled_back_transaction_emits_nothing(db: psycopg.Connection, wal_outbox: OutboxTable) -> None:
    with db.transaction(force_rollback=True):
        enqueue_many(db, [Message("orders", {"n": i}, key="k") for i in range(3)], table=wal_outbox)
    assert emitted(db, wal_outbox) == []


def test_sql_enqueue_emits_and_returns_the_message_id(db: psycopg.Connection, wal_outbox: OutboxTable) -> None:
    with db.transaction():
        row = db.execute(
            sql.SQL("SELECT id, message_id FROM {}('orders', '{{\"a\": 1}}', 'k', '{{\"h\": \"v\"}}', 'T')").format(
                wal_outbox.ident("enqueue")
            )
        ).fetchone()
    assert row is not None
    [m] = emitted(db, wal_outbox)
    assert (m.topic, m.key, m.type, m.payload, m.headers) == ("orders", b"k", b"T", b'{"a": 1}', '{"h": "v"}')
    assert m.message_id == str(row[1]).encode()


def test_a_plain_insert_emits_the_row_and_keeps_no_row(db: psycopg.Connection, wal_outbox: OutboxTable) -> None:
    given = uuid.uuid4()
    with db.transaction():
        cur = db.execute(
            sql.SQL(
                "INSERT INTO {} (message_id, topic, key, payload_bytes, partition) VALUES (%s, 'orders', 'k', %s, 5)"
            ).format(wal_outbox.messages),
            (given, b"\x00\x01"),
        )
        assert cur.rowcount == 0  # what a JDBC executeUpdate returns here
    [m] = emitted(db, wal_outbox)
    assert (m.message_id, m.topic, m.key, m.payload, m.binary, m.partition) == (
        str(given).encode(),
        "orders",
        b"k",
        b"\x00\x01",
        True,
        5,
    )
    assert stored_rows(db, wal_outbox) == 0


def test_every_writer_form_in_one_transaction_keeps_the_order_they_wrote_in(
    db: psycopg.Connection, wal_outbox: OutboxTable
) -> None:
    with db.transaction():
        enqueue(db, "orders", {"n": 1}, key="k", table=wal_outbox)
        db.execute(sql.SQL("SELECT {}('orders', '{{\"n\": 2}}', 'k')").format(wal_outbox.ident("enqueue")))
        db.execute(
            sql.SQL("INSERT INTO {} (topic, key, payload) VALUES ('orders', 'k', '{{\"n\": 3}}')").format(
                wal_outbox.messages
            )
        )
        enqueue_many(db, [Message("orders", {"n": 4}, key="k"), Message("orders", {"n": 5}, key="k")], table=wal_outbox)
    assert [m.payload for m in emitted(db, wal_outbox)] == [b'{"n": %d}' % n for n in range(1, 6)]


def test_a_plain_insert_with_an_invalid_topic_is_refused_as_the_table_refuses_it(
    db: psycopg.Connection, wal_outbox: OutboxTable
) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="invalid Kafka topic name"):
        with db.transaction():
            db.execute(
                sql.SQL("INSERT INTO {} (topic, key, payload) VALUES ('no spaces', 'k', '{{}}')").format(
                    wal_outbox.messages
                )
            )
    assert emitted(db, wal_outbox) == []


def test_sql_enqueue_refuses_a_header_the_relay_sets(db: psycopg.Connection, wal_outbox: OutboxTable) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match='header "message_id" is reserved'):
        with db.transaction():
            db.execute(
                sql.SQL("SELECT {}('orders', '{{}}', 'k', '{{\"message_id\": \"x\"}}')").format(
                    wal_outbox.ident("enqueue")
                )
            )
    assert emitted(db, wal_outbox) == []


def test_python_enqueue_refuses_bad_input_before_emitting_and_the_transaction_goes_on(
    db: psycopg.Connection, wal_outbox: OutboxTable
) -> None:
    with db.transaction():
        with pytest.raises(InvalidMessageError):
            enqueue(db, "orders", {"n": 1}, key="k", headers={"type": "reserved"}, table=wal_outbox)
        enqueue(db, "orders", {"n": 2}, key="k", table=wal_outbox)
    assert [m.payload for m in emitted(db, wal_outbox)] == [b'{"n": 2}']


def test_writing_the_wal_way_to_an_outbox_that_is_not_one_fails_and_writes_nothing(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    wal_writer = OutboxTable(schema=table.schema, write_to="wal")
    with pytest.raises(SchemaError, match="is not a wal outbox"):
        with db.transaction():
            enqueue(db, "orders", {"n": 1}, key="k", table=wal_writer)
    assert stored_rows(db, table) == 0


def test_the_wal_strategy_serves_an_outbox_alone(dsn: str) -> None:
    table = OutboxTable(schema=f"w_{uuid.uuid4().hex[:12]}")
    with psycopg.connect(dsn, autocommit=True) as conn, pytest.raises(OutboxError, match="serves an outbox alone"):
        init_db(conn, table, strategies=["wal", "partitioned"])


def test_init_db_waits_out_an_open_transaction_names_it_and_the_rerun_it_asks_for_makes_the_outbox(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL creates a slot once every transaction that has written and runs now has ended: a BEGIN left open in
    psql over lunch. init-db waits (30 s; 1 here), names the session, and asks for a rerun once it has ended."""
    monkeypatch.setattr(wal_objects, "SLOT_CREATE_TIMEOUT_S", 1)
    table = OutboxTable(schema=f"w_{uuid.uuid4().hex[:12]}", write_to="wal")
    try:
        with psycopg.connect(dsn) as lunch:
            lunch.execute("SELECT pg_current_xact_id()")  # a transaction with an xid, as one that has written
            with psycopg.connect(dsn, autocommit=True) as conn:
                with pytest.raises(
                    SchemaError, match=rf"pid {lunch.info.backend_pid} .* run `outbox init-db --strategy wal` again"
                ):
                    init_db(conn, table, strategies=["wal"])
                assert not slot_state(conn, table).exists
            lunch.rollback()  # the operator ends it, as the message says
        with psycopg.connect(dsn, autocommit=True) as conn:
            init_db(conn, table, strategies=["wal"])  # and runs init-db again
            assert slot_state(conn, table).exists
            with conn.transaction():
                enqueue(conn, "orders", {"n": 1}, key="k", table=table)
            assert [m.payload for m in emitted(conn, table)] == [b'{"n": 1}']
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            drop_slot(conn, table)
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(table.schema_ident))


@pytest.mark.parametrize("how_many", [1, 3])
def test_a_python_writer_left_at_write_to_table_is_relayed_through_the_insert_trigger(
    db: psycopg.Connection, wal_outbox: OutboxTable, how_many: int
) -> None:
    """docs/wal.md, Writers: a writer not yet set to ``wal`` goes through the trigger (issue 50, case 11). Before, the
    INSERT's RETURNING gave no id and the call raised (``outbox insert returned ids []``)."""
    table_writer = OutboxTable(schema=wal_outbox.schema, write_to="table")
    with db.transaction():
        enqueued = enqueue_many(db, [Message("orders", {"n": n}, key="k") for n in range(how_many)], table=table_writer)

    messages = emitted(db, wal_outbox)
    assert [(m.topic, m.key, m.payload) for m in messages] == [
        ("orders", b"k", b'{"n": %d}' % n) for n in range(how_many)
    ]
    assert [str(e.message_id) for e in enqueued] == [m.message_id.decode() for m in messages]
    assert stored_rows(db, wal_outbox) == 0
