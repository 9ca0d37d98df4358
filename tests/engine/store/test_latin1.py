"""An outbox in a LATIN1 database (issue 40, case 3): every writer form stores a key as the same characters, so one
key stays one Kafka key, and a character the database cannot hold is refused before anything is written. Before,
``enqueue_many`` sent UTF-8 bytes whatever the client encoding: ``café`` was stored as ``cafÃ©``."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from outbox_pipeline import InvalidMessageError, Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.localstack import LocalPostgres
from outbox_pipeline.operate.dead_letters import discard_dead_letters
from outbox_pipeline.store.schema import init_db
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
        with pytest.raises(InvalidMessageError, match="cannot be stored in this database's client encoding"):
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
            with pytest.raises(InvalidMessageError, match="cannot be stored in this database's client encoding"):
                with conn.transaction():
                    enqueue_many(conn, [Message("orders", {"n": 0}, key="東京")], table=table)
        finally:
            drop_slot(conn, table)
