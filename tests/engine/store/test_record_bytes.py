"""What Kafka gets is UTF-8 whatever the database's encoding: the relay reads text columns as raw bytes."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from outbox_pipeline import OutboxTable
from outbox_pipeline.model import STRATEGY_NAMES
from outbox_pipeline.store import init_db, set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_a_latin1_database_still_sends_key_payload_and_type_as_utf8(
    strategy: str, db: psycopg.Connection, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    name = f"latin1_{uuid.uuid4().hex[:10]}"
    db.execute(
        sql.SQL("CREATE DATABASE {} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0").format(
            sql.Identifier(name)
        )
    )
    try:
        dsn = make_conninfo(db.info.dsn, dbname=name)
        table = OutboxTable(schema="outbox")
        topic = new_topic()
        with psycopg.connect(dsn, autocommit=True) as latin1:
            init_db(latin1, table)
            set_topic_partitions(latin1, table, topic, 1)
            latin1.execute(
                sql.SQL("INSERT INTO {} (topic, key, type, payload) VALUES (%s, 'café', 'größe', %s)").format(
                    table.messages
                ),
                (topic, '{"name": "Zoë"}'),
            )

        stats = drain(dsn, table, kafka.bootstrap_servers, strategy)

        [record] = kafka.consume(topic, expect=1)
        assert (record.key, record.value, record.headers["type"]) == (
            "café".encode(),
            '{"name": "Zoë"}'.encode(),
            "größe".encode(),
        )
        assert stats.published == 1
    finally:
        db.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))
