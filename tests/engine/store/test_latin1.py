"""An outbox in a LATIN1 database (issue 40, case 3): every writer form stores a key as the same characters, so one
key stays one Kafka key, and a character the database cannot hold is refused before anything is written. Before,
``enqueue_many`` sent UTF-8 bytes whatever the client encoding: ``café`` was stored as ``cafÃ©``."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from outbox_pipeline import InvalidMessageError, Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.localstack import LocalPostgres
from outbox_pipeline.operate import discard_dead_letters
from outbox_pipeline.store import init_db
from outbox_pipeline.store.wal import format as wal_format
from outbox_pipeline.store.wal.objects import drop_slot
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain, make_wal_relay


@pytest.fixture
def latin1_dsn(pg_server: LocalPostgres) -> Iterator[str]:
    name = f"latin1_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE DATABASE {} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0").format(
                sql.Identifier(name)
            )
        )
    yield make_conninfo(pg_server.dsn, dbname=name)
    with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.mark.parametrize("strategy", ["locking", "partitioned"])
def test_every_writer_form_stores_a_latin1_key_as_itself_and_kafka_gets_one_key(
    strategy: str,
    latin1_dsn: str,
    outbox_tables: Callable[[str], OutboxTable],
    new_topic: Callable[..., str],
    kafka: KafkaProbe,
) -> None:
    table = outbox_tables(latin1_dsn)
    topic = new_topic("latin1", partitions=4)
    with psycopg.connect(latin1_dsn) as conn:
        assert conn.info.encoding == "iso8859-1"  # the database's own, as libpq's default gives it
        with conn.transaction():
            enqueue(conn, topic, {"n": 0}, key="café", table=table)
            enqueue_many(conn, [Message(topic, {"n": i}, key="café") for i in (1, 2)], table=table)
            conn.execute(
                sql.SQL("SELECT {}(topic => %s, payload => '{{\"n\": 3}}', key => 'café')").format(
                    table.ident("enqueue")
                ),
                (topic,),
            )
        stored = conn.execute(sql.SQL("SELECT DISTINCT key, partition FROM {}").format(table.messages)).fetchall()
    assert len(stored) == 1 and stored[0][0] == "café", stored  # one key, one partition

    drain(latin1_dsn, table, kafka.bootstrap_servers, strategy)

    records = kafka.consume(topic, expect=4)
    assert {r.key for r in records} == {"café".encode()}
    assert len({r.partition for r in records}) == 1


def test_a_character_the_latin1_database_cannot_hold_is_refused_and_nothing_is_stored(
    latin1_dsn: str, outbox_tables: Callable[[str], OutboxTable]
) -> None:
    table = outbox_tables(latin1_dsn)
    with psycopg.connect(latin1_dsn) as conn:
        with pytest.raises(InvalidMessageError, match="cannot be stored in this database, whose encoding is LATIN1"):
            with conn.transaction():
                enqueue_many(
                    conn, [Message("orders", {"n": i}, key=k) for i, k in enumerate(["café", "東京"])], table=table
                )
        assert conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table.messages)).fetchone() == (0,)


def test_a_wal_outbox_in_a_latin1_database_publishes_every_writer_forms_key_as_one_kafka_key(
    latin1_dsn: str, new_topic: Callable[..., str], kafka: KafkaProbe
) -> None:
    table = OutboxTable(schema=f"w_{uuid.uuid4().hex[:12]}", write_to="wal")
    topic = new_topic("latin1", partitions=4)
    with psycopg.connect(latin1_dsn, autocommit=True) as conn:
        init_db(conn, table, strategies=["wal"])
        try:
            with conn.transaction():
                enqueue(conn, topic, {"n": 0}, key="café", table=table)
                enqueue_many(conn, [Message(topic, {"n": 1}, key="café")], table=table)
                conn.execute(
                    sql.SQL("SELECT {}(topic => %s, payload => '{{\"n\": 2}}', key => 'café')").format(
                        table.ident("enqueue")
                    ),
                    (topic,),
                )
                conn.execute(
                    sql.SQL("INSERT INTO {} (topic, key, payload) VALUES (%s, 'café', '{{\"n\": 3}}')").format(
                        table.messages
                    ),
                    (topic,),
                )
            make_wal_relay(latin1_dsn, table, kafka.bootstrap_servers).run()
        finally:
            drop_slot(conn, table)  # a database with a slot cannot be dropped

    records = kafka.consume(topic, expect=4)
    assert [r.value for r in records] == [b'{"n": %d}' % n for n in range(4)]
    assert {r.key for r in records} == {"café".encode()}


def test_a_wal_outbox_in_a_latin1_database_releases_a_held_keys_messages_as_they_were_written(
    latin1_dsn: str, new_topic: Callable[..., str], kafka: KafkaProbe
) -> None:
    """Found by the harness (seed 185, wal, LATIN1, 20 s): a released key's held messages went to Kafka in the
    database's encoding (``café`` as ``caf\\xe9``: another key, and a JSON value that is not UTF-8)."""
    table = OutboxTable(schema=f"w_{uuid.uuid4().hex[:12]}", write_to="wal")
    topic = new_topic("latin1")
    with psycopg.connect(latin1_dsn, autocommit=True) as conn:
        init_db(conn, table, strategies=["wal"])
        try:
            with conn.transaction():
                enqueue(conn, topic, {"pad": "x" * 5000}, key="café", table=table)  # Kafka refuses it: café held
                enqueue(conn, topic, {"text": "naïve"}, key="café", headers={"note": "Zürich"}, table=table)
            make_wal_relay(latin1_dsn, table, kafka.bootstrap_servers, producer={"message.max.bytes": 2000}).run()
            [(dead_letter,)] = conn.execute(sql.SQL("SELECT id FROM {}").format(table.dead_letters)).fetchall()
            discard_dead_letters(conn, table, [dead_letter], reason="a test")
            make_wal_relay(latin1_dsn, table, kafka.bootstrap_servers).run()
        finally:
            drop_slot(conn, table)

    [record] = kafka.consume(topic)
    assert (record.key, record.value) == ("café".encode(), '{"text": "naïve"}'.encode())
    assert record.headers["note"] == "Zürich".encode()


def test_a_wal_writer_in_a_latin1_database_refuses_a_character_the_database_cannot_hold(latin1_dsn: str) -> None:
    """As every writer form does (the SQL ones by the server's conversion): a dead letter or a held row of such a
    message could not be stored, and the relay would stop at it."""
    table = OutboxTable(schema=f"w_{uuid.uuid4().hex[:12]}", write_to="wal")
    with psycopg.connect(latin1_dsn, autocommit=True) as conn:
        init_db(conn, table, strategies=["wal"])
        try:
            with pytest.raises(
                InvalidMessageError, match="cannot be stored in this database, whose encoding is LATIN1"
            ):
                with conn.transaction():
                    enqueue_many(conn, [Message("orders", {"n": 0}, key="東京")], table=table)
        finally:
            drop_slot(conn, table)


# Issue 50, case 4: a writer whose client_encoding is UTF8 (Django sets it; so does PGCLIENTENCODING) in a LATIN1
# database. Its text reaches the server as UTF-8, which the server converts for a row but not for a wal message's bytes.


def emit_unchecked(conn: psycopg.Connection, table: OutboxTable, topic: str, key: str, payload: str) -> None:
    """A message emitted in this layout by a writer that checks nothing (another language's, or this one's before it
    checked the database's encoding)."""
    content = wal_format.encode(
        str(uuid.uuid4()).encode(),
        topic.encode(),
        key.encode(),
        None,
        b"{}",
        payload.encode(),
        binary=False,
        partition=None,
    )
    conn.execute(sql.SQL("SELECT {}(%s)").format(table.ident("outbox_emit_one")), (content,))


@pytest.fixture
def latin1_wal(latin1_dsn: str) -> Iterator[OutboxTable]:
    table = OutboxTable(schema=f"w_{uuid.uuid4().hex[:12]}", write_to="wal")
    with psycopg.connect(latin1_dsn, autocommit=True) as conn:
        init_db(conn, table, strategies=["wal"])
        yield table
        drop_slot(conn, table)  # a database with a slot cannot be dropped


def test_a_wal_writer_whose_client_speaks_utf8_is_refused_a_character_the_latin1_database_cannot_hold(
    latin1_dsn: str, latin1_wal: OutboxTable, new_topic: Callable[..., str], kafka: KafkaProbe
) -> None:
    """Before, the client's encoding was checked (UTF-8 holds everything) and the message was emitted."""
    topic = new_topic("latin1")
    with psycopg.connect(latin1_dsn, client_encoding="UTF8") as writer:
        assert writer.info.encoding == "utf-8"
        with writer.transaction():
            with pytest.raises(
                InvalidMessageError, match="cannot be stored in this database, whose encoding is LATIN1"
            ):
                enqueue(writer, topic, {"city": "東京"}, key="k", table=latin1_wal)
            enqueue(writer, topic, {"city": "Zürich"}, key="k", table=latin1_wal)  # the transaction goes on

    make_wal_relay(latin1_dsn, latin1_wal, kafka.bootstrap_servers).run()

    assert [r.value for r in kafka.consume(topic)] == ['{"city": "Zürich"}'.encode()]


@pytest.mark.parametrize("form", ["sql enqueue", "insert"])
def test_a_sql_wal_writer_whose_client_speaks_utf8_is_refused_a_character_the_latin1_database_cannot_hold(
    form: str, latin1_dsn: str, latin1_wal: OutboxTable
) -> None:
    """The server converts a statement's text to the database's encoding before the function or the trigger runs."""
    if form == "sql enqueue":
        statement = sql.SQL("SELECT {}(topic => 'orders', payload => %s::jsonb, key => 'k')").format(
            latin1_wal.ident("enqueue")
        )
    else:
        statement = sql.SQL("INSERT INTO {} (topic, key, payload) VALUES ('orders', 'k', %s::jsonb)").format(
            latin1_wal.messages
        )
    with psycopg.connect(latin1_dsn, client_encoding="UTF8") as writer:
        for payload in ('{"city": "東京"}', '{"city": "\\u6771"}'):  # the character, and its JSON escape
            with pytest.raises(psycopg.DataError, match="LATIN1"):
                writer.execute(statement, (payload,))
            writer.rollback()


def test_a_held_keys_message_the_latin1_database_cannot_hold_is_kept_and_released_as_written(
    latin1_dsn: str, latin1_wal: OutboxTable, new_topic: Callable[..., str], kafka: KafkaProbe
) -> None:
    """Before, writing it to outbox_held raised UntranslatableCharacter out of the relay at every start: the whole
    outbox stalled on it."""
    topic = new_topic("latin1")
    with psycopg.connect(latin1_dsn, autocommit=True) as conn:
        with conn.transaction():
            enqueue(conn, topic, {"pad": "x" * 5000}, key="café", table=latin1_wal)  # Kafka refuses it: café held
        with psycopg.connect(latin1_dsn, client_encoding="UTF8") as writer, writer.transaction():
            emit_unchecked(writer, latin1_wal, topic, "café", '{"city": "東京"}')
        enqueue(conn, topic, {"n": 1}, key="other", table=latin1_wal)

        make_wal_relay(latin1_dsn, latin1_wal, kafka.bootstrap_servers, producer={"message.max.bytes": 2000}).run()
        assert [(r.key, r.value) for r in kafka.consume(topic)] == [(b"other", b'{"n": 1}')]

        [(dead_letter,)] = conn.execute(sql.SQL("SELECT id FROM {}").format(latin1_wal.dead_letters)).fetchall()
        discard_dead_letters(conn, latin1_wal, [dead_letter], reason="a test")
        make_wal_relay(latin1_dsn, latin1_wal, kafka.bootstrap_servers).run()

    assert [(r.key, r.value) for r in kafka.consume(topic)] == [
        (b"other", b'{"n": 1}'),
        ("café".encode(), '{"city": "東京"}'.encode()),
    ]


def test_a_message_kafka_refuses_that_the_latin1_database_cannot_hold_is_dead_lettered_as_its_bytes(
    latin1_dsn: str, latin1_wal: OutboxTable, new_topic: Callable[..., str], kafka: KafkaProbe
) -> None:
    """Before, its dead letter raised UntranslatableCharacter out of the relay at every start. Now it is kept whole,
    as the bytes it was emitted as (store/wal/format.py), for the operator; every other key flows."""
    topic = new_topic("latin1")
    payload = json.dumps({"pad": "x" * 5000})
    with psycopg.connect(latin1_dsn, autocommit=True) as conn:
        with psycopg.connect(latin1_dsn, client_encoding="UTF8") as writer, writer.transaction():
            emit_unchecked(writer, latin1_wal, topic, "東京", payload)  # Kafka refuses it
        enqueue(conn, topic, {"n": 1}, key="other", table=latin1_wal)

        for _ in range(2):  # a second start goes on from there too
            make_wal_relay(latin1_dsn, latin1_wal, kafka.bootstrap_servers, producer={"message.max.bytes": 2000}).run()

        [(dead_topic, kept, error)] = conn.execute(
            sql.SQL("SELECT topic, payload_bytes, last_error FROM {}").format(latin1_wal.dead_letters)
        ).fetchall()
    assert [(r.key, r.value) for r in kafka.consume(topic)] == [(b"other", b'{"n": 1}')]
    assert dead_topic == "(unstorable)" and "LATIN1" in error
    message = wal_format.decode(kept)
    assert (message.topic, message.key, message.payload) == (topic, "東京".encode(), payload.encode())


def test_a_dead_letter_whose_json_the_latin1_database_refuses_keeps_its_payload_as_written(
    latin1_dsn: str, latin1_wal: OutboxTable, new_topic: Callable[..., str], kafka: KafkaProbe
) -> None:
    """ASCII text, but jsonb refuses the escape of a character LATIN1 lacks: before, the dead letter's insert raised
    out of the relay at every start."""
    topic = new_topic("latin1")
    payload = json.dumps({"city": "東", "pad": "x" * 5000})  # ensure_ascii: "\u6771"
    with psycopg.connect(latin1_dsn, autocommit=True) as conn:
        with conn.transaction():
            emit_unchecked(conn, latin1_wal, topic, "k", payload)  # Kafka refuses it
        enqueue(conn, topic, {"n": 1}, key="other", table=latin1_wal)

        make_wal_relay(latin1_dsn, latin1_wal, kafka.bootstrap_servers, producer={"message.max.bytes": 2000}).run()

        [(dead_topic, key, kept)] = conn.execute(
            sql.SQL("SELECT topic, key, payload_bytes FROM {}").format(latin1_wal.dead_letters)
        ).fetchall()
    assert [(r.key, r.value) for r in kafka.consume(topic)] == [(b"other", b'{"n": 1}')]
    assert (dead_topic, key, kept) == (topic, "k", payload.encode())
