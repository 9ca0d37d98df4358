"""A row's headers the relay cannot send never stop it (issue 40, case 6): SQL ``enqueue`` refuses them with a clear
error, the table refuses them from a plain INSERT, and a row stored before that check (an outbox upgraded from
migration 11) is dead-lettered with its reason while the rows around it go on; before, the relay failed the batch
at every try ("Incorrect padding") and published the rows before it again and again."""

from __future__ import annotations

import json
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.store import UnencodableHeaders, decode_headers
from tests.kit.kafka import KafkaProbe
from tests.kit.probes import dead_letters
from tests.kit.relay import drain, message_ids

STRATEGIES = ["locking", "advisory", "lease", "partitioned", "serialized"]
UNSENDABLE = [
    {"sig": {"base64": "abc"}},  # bad padding
    {"sig": {"base64": "ab c="}},  # whitespace
    {"sig": {"base64": "YWJj", "more": "x"}},  # more than base64
    {"n": 1},  # not a string
    {"": "x"},  # no name
    ["a", "b"],  # not an object
    {"message_id": "forged"},  # the relay's own: a second message_id header (found by the harness, seed 66)
]


@pytest.mark.parametrize("headers", UNSENDABLE, ids=json.dumps)
def test_sql_enqueue_refuses_headers_the_relay_cannot_send_and_stores_nothing(
    headers: object, db: psycopg.Connection, table: OutboxTable
) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="outbox enqueue: header"):
        db.execute(
            sql.SQL("SELECT {}(topic => 'orders', payload => '{{}}', headers => %s)").format(table.ident("enqueue")),
            (Jsonb(headers),),
        )
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(table.messages)).fetchone() == (0,)


@pytest.mark.parametrize("headers", UNSENDABLE, ids=json.dumps)
def test_a_plain_insert_of_headers_the_relay_cannot_send_is_refused_by_the_table(
    headers: object, db: psycopg.Connection, table: OutboxTable
) -> None:
    with pytest.raises(psycopg.errors.CheckViolation, match="outbox_messages_headers_sendable"):
        db.execute(
            sql.SQL("INSERT INTO {} (topic, key, payload, headers) VALUES ('orders', 'k', '{{}}', %s)").format(
                table.messages
            ),
            (Jsonb(headers),),
        )


def test_valid_headers_pass_every_check_and_decode_to_their_bytes(db: psycopg.Connection, table: OutboxTable) -> None:
    headers = {"trace": "abc", "sig": {"base64": "AAEC/w=="}, "empty": {"base64": ""}}
    db.execute(
        sql.SQL("INSERT INTO {} (topic, key, payload, headers) VALUES ('orders', 'k', '{{}}', %s)").format(
            table.messages
        ),
        (Jsonb(headers),),
    )
    assert decode_headers(headers) == [("trace", b"abc"), ("sig", b"\x00\x01\x02\xff"), ("empty", b"")]
    with pytest.raises(UnencodableHeaders, match="not base64"):
        decode_headers({"sig": {"base64": "abc"}})


@pytest.mark.parametrize(
    ("stored", "reason"),
    [({"sig": {"base64": "abc"}}, "not base64"), ({"outbox_id": "1"}, 'header "outbox_id" is the relay')],
    ids=["bad-base64", "reserved-name"],
)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_row_stored_with_unsendable_headers_before_the_check_is_dead_lettered_and_the_others_are_relayed(
    stored: dict[str, object],
    reason: str,
    strategy: str,
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    new_topic: Callable[..., str],
    kafka: KafkaProbe,
) -> None:
    topic = new_topic("hdr")
    db.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT outbox_messages_headers_sendable").format(table.messages))
    before = [
        str(e.message_id)
        for e in enqueue_many(db, [Message(topic, {"n": i}, key="good") for i in range(3)], table=table)
    ]
    bad = db.execute(
        sql.SQL(
            "INSERT INTO {} (topic, key, payload, headers) VALUES (%s, 'bad', '{{}}', %s) RETURNING message_id::text"
        ).format(table.messages),
        (topic, Jsonb(stored)),
    ).fetchone()
    assert bad is not None
    after = [
        str(e.message_id)
        for e in enqueue_many(db, [Message(topic, {"n": i}, key="good") for i in range(3, 6)], table=table)
    ]

    drain(dsn, table, kafka.bootstrap_servers, strategy, max_attempts=3)

    assert message_ids(kafka.consume(topic, expect=6)) == before + after  # each once, in order
    [(dead_id, (_, error))] = dead_letters(db, table).items()
    assert dead_id == bad[0]
    assert "headers cannot be sent" in error and reason in error
