"""Binary payloads (issue 31): a payload is JSON or bytes; bytes are stored as given and arrive in Kafka byte for
byte, from Python, from SQL ``enqueue`` and from a plain INSERT, through every strategy, the bulk drain, dead letters,
quarantine and retry."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.drain import commit_drain, drain_owner, fetch_range, plan_drain, publish_range
from outbox_pipeline.errors import InvalidMessageError
from outbox_pipeline.model import STRATEGY_NAMES
from outbox_pipeline.operate import list_dead_letters, retry_dead_letters
from outbox_pipeline.relay import KafkaPublisher
from outbox_pipeline.store import LATEST_VERSION, MIGRATIONS, init_db, schema, set_topic_partitions
from outbox_pipeline.verify import verify
from tests.kit.kafka import KafkaProbe
from tests.kit.quarantine import SMALL_PRODUCER
from tests.kit.relay import drain

# Not UTF-8, with a NUL, the Confluent wire format's magic byte first: what jsonb could never store.
AVRO_LIKE = b"\x00\x00\x00\x00\x2a\x02\xff\xfe\x00"


def _values(kafka: KafkaProbe, topic: str, expect: int) -> list[bytes | None]:
    return [r.value for r in sorted(kafka.consume(topic, expect=expect), key=lambda r: (r.partition, r.offset))]


def _stored(db: psycopg.Connection, table: OutboxTable) -> list[tuple[object, bytes | None]]:
    rows = db.execute(sql.SQL("SELECT payload, payload_bytes FROM {} ORDER BY id").format(table.messages))
    return rows.fetchall()


def test_bytes_from_python_are_stored_as_given_and_arrive_byte_for_byte(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    set_topic_partitions(db, table, topic, 1)
    enqueue(db, topic, AVRO_LIKE, key="k", table=table)
    enqueue_many(
        db,
        [Message(topic, bytearray(b"\x01\x02"), key="k"), Message(topic, memoryview(b"\x03"), key="k")],
        table=table,
    )
    db.commit()

    assert _stored(db, table) == [(None, AVRO_LIKE), (None, b"\x01\x02"), (None, b"\x03")]
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")
    assert _values(kafka, topic, 3) == [AVRO_LIKE, b"\x01\x02", b"\x03"]


def test_bytes_from_the_sql_enqueue_arrive_byte_for_byte(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    db.execute(
        sql.SQL("SELECT * FROM {}(%s, payload_bytes => %s, key => 'k')").format(table.ident("enqueue")),
        (topic, AVRO_LIKE),
    )
    db.commit()

    drain(db.info.dsn, table, kafka.bootstrap_servers, "serialized")
    assert _values(kafka, topic, 1) == [AVRO_LIKE]


def test_bytes_from_a_plain_insert_are_routed_and_arrive_byte_for_byte(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    db.execute(
        sql.SQL("INSERT INTO {} (topic, key, payload_bytes) VALUES (%s, 'k', %s)").format(table.messages),
        (topic, AVRO_LIKE),
    )
    db.commit()

    drain(db.info.dsn, table, kafka.bootstrap_servers, "locking")
    assert _values(kafka, topic, 1) == [AVRO_LIKE]


@pytest.mark.parametrize(
    ("payload", "payload_bytes"), [("{}", b"\x01"), (None, None)], ids=["both payloads", "neither"]
)
def test_the_table_refuses_a_row_with_both_payloads_or_neither(
    db: psycopg.Connection, table: OutboxTable, payload: str | None, payload_bytes: bytes | None
) -> None:
    insert = sql.SQL("INSERT INTO {} (topic, key, payload, payload_bytes) VALUES ('orders', 'k', %s, %s)")
    with pytest.raises(psycopg.errors.CheckViolation, match="one_payload"):
        db.execute(insert.format(table.messages), (payload, payload_bytes))


def test_an_oversize_bytes_payload_is_refused_naming_its_size_and_the_limit(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    with pytest.raises(InvalidMessageError, match=r"is \d+ bytes, over the maximum of \d+ bytes"):
        enqueue(db, "orders", b"\x00" * (table.max_message_bytes + 1), table=table)
    assert _stored(db, table) == []


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_a_mixed_outbox_of_json_and_bytes_relays_every_row_in_key_order(
    strategy: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=2)
    set_topic_partitions(db, table, topic, 2)
    written: dict[str, list[bytes]] = {"A": [], "B": []}
    for i in range(20):
        for key in written:
            payload: object = {"i": i} if i % 2 else f"{key}{i}".encode() + b"\xff"
            enqueue(db, topic, payload, key=key, serialized=strategy == "serialized", table=table)
            written[key].append(b'{"i": %d}' % i if i % 2 else f"{key}{i}".encode() + b"\xff")
        db.commit()

    drain(db.info.dsn, table, kafka.bootstrap_servers, strategy, batch_size=7)

    arrived: dict[str, list[bytes | None]] = {"A": [], "B": []}
    for record in sorted(kafka.consume(topic, expect=40), key=lambda r: (r.partition, r.offset)):
        assert record.key is not None
        arrived[record.key.decode()].append(record.value)
    assert arrived == written


@pytest.mark.parametrize("strategy", ["partitioned", "locking"])
def test_a_binary_dead_letter_keeps_its_bytes_and_its_key_in_order_through_hold_and_retry(
    strategy: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """Key A's third row is too large for the producer: dead-lettered with its bytes, A's later rows held (ordered
    strategies), then retried with a producer that takes it: every row arrives unchanged and A in order."""
    topic = new_topic()
    set_topic_partitions(db, table, topic, 1)
    payloads = [bytes([i]) * (5000 if i == 2 else 10) for i in range(6)]
    for payload in payloads:
        enqueue(db, topic, payload, key="A", table=table)
        db.commit()

    drain(db.info.dsn, table, kafka.bootstrap_servers, strategy, producer=SMALL_PRODUCER, batch_size=2)
    [dead] = list_dead_letters(db, table)
    assert (dead.payload, dead.payload_size) == ("bytes", 5000)  # what the CLI and the Dagster jobs list
    stored = db.execute(sql.SQL("SELECT payload, payload_bytes FROM {}").format(table.dead_letters)).fetchall()
    assert stored == [(None, payloads[2])]
    retry_dead_letters(db, table, ids=[dead.id])
    drain(db.info.dsn, table, kafka.bootstrap_servers, strategy)

    arrived = [r.value for r in sorted(kafka.consume(topic, expect=6), key=lambda r: r.offset)]
    if strategy == "partitioned":  # ordered: A's rows after the dead letter waited for it
        assert arrived == payloads
    else:  # unordered: the retried row comes last, bytes unchanged
        assert arrived == payloads[:2] + payloads[3:] + [payloads[2]]


def test_the_bulk_drain_publishes_bytes_and_json_unchanged(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    set_topic_partitions(db, table, topic, 1)
    enqueue_many(db, [Message(topic, AVRO_LIKE, key="k"), Message(topic, {"n": 1}, key="k")], table=table)
    db.commit()

    plan = plan_drain(db, table, strategy="partitioned", owner=drain_owner("run-bytes"))
    publisher = KafkaPublisher({"bootstrap.servers": kafka.bootstrap_servers})
    reports = [publish_range(publisher, "partitioned", fetch_range(db, plan, rng)) for rng in plan.ranges]
    assert all(reports)
    commit_drain(db, plan, ())

    assert _values(kafka, topic, 2) == [AVRO_LIKE, b'{"n": 1}']


def _files(conn: psycopg.Connection, table: OutboxTable) -> dict[str, int]:
    """Each partition's data file: a rewrite gives a table a new one."""
    rows = conn.execute(
        "SELECT relid::text, pg_relation_filenode(relid) FROM pg_partition_tree(%s::regclass) WHERE isleaf",
        (table.messages.as_string(conn),),
    )
    return dict(rows.fetchall())


def test_an_outbox_with_rows_migrates_to_binary_payloads_without_rewriting_them(
    dsn: str, kafka: KafkaProbe, new_topic: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    topic = new_topic()
    table = OutboxTable(schema=f"migrate_{uuid.uuid4().hex[:8]}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        monkeypatch.setattr(schema, "MIGRATIONS", MIGRATIONS[:10])
        init_db(conn, table)
        set_topic_partitions(conn, table, topic, 1)
        conn.execute(  # rows as a writer of the older schema wrote them
            sql.SQL(
                "INSERT INTO {} (topic, key, payload) SELECT %s, 'k', jsonb_build_object('n', n) "
                "FROM generate_series(0, 299) n"
            ).format(table.messages),
            (topic,),
        )
        monkeypatch.undo()
        before = _files(conn, table)

        applied = init_db(conn, table)  # none of them rewrites the table
        assert [m.version for m in applied] == list(range(11, LATEST_VERSION + 1))

        assert _files(conn, table) == before
        enqueue(conn, topic, AVRO_LIKE, key="k", table=table)
        # A SQL writer's call of before the migration still works: the payload is JSON unless named bytes.
        conn.execute(
            sql.SQL("SELECT * FROM {}(%s, '{{\"n\": 300}}', key => 'k')").format(table.ident("enqueue")), (topic,)
        )
        drain(dsn, table, kafka.bootstrap_servers, "partitioned")
        values = _values(kafka, topic, 302)
        assert values == [b'{"n": %d}' % n for n in range(300)] + [AVRO_LIKE, b'{"n": 300}']
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(table.schema_ident))


def test_outbox_verify_accounts_for_bytes_and_json_messages_alike(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=2)
    set_topic_partitions(db, table, topic, 2)
    messages = [Message(topic, AVRO_LIKE + bytes([i]) if i % 2 else {"i": i}, key=f"k{i % 5}") for i in range(40)]
    enqueue_many(db, messages, table=table)
    db.commit()
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")

    kafka_config = {"bootstrap.servers": kafka.bootstrap_servers}
    report = verify(db, table, kafka_config, [topic], idle_s=1.0, ordered="partitioned")

    assert report.ok and (report.ledger_messages, report.consumed_records) == (40, 40)
    assert (report.lost, report.phantom, report.order_violations) == (0, 0, 0)
