"""Schema Registry formats from the writer (issue 31): ``enqueue(..., serializer=...)`` stores the bytes a
confluent-kafka serializer makes for the message's topic, and a consumer reads them back with the matching
deserializer. The registry is confluent-kafka's in-memory one (``mock://``)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import psycopg
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import timestamp_pb2
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.errors import InvalidMessageError
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain

ORDER_SCHEMA = """
{"type": "record", "name": "Order", "namespace": "shop",
 "fields": [{"name": "id", "type": "long"}, {"name": "status", "type": "string"}]}
"""


def _registry() -> SchemaRegistryClient:
    return SchemaRegistryClient.new_client({"url": f"mock://{uuid.uuid4().hex}"})


def test_an_avro_payload_round_trips_through_the_registry_and_the_outbox(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    registry = _registry()
    topic = new_topic()
    orders = [{"id": 42, "status": "paid"}, {"id": 43, "status": "shipped"}]
    serializer = AvroSerializer(registry, ORDER_SCHEMA)
    enqueue(db, topic, orders[0], key="order-42", table=table, serializer=serializer)
    enqueue_many(db, [Message(topic, orders[1], key="order-43")], table=table, serializer=serializer)
    db.commit()

    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")

    deserialize = AvroDeserializer(registry)
    records = kafka.consume(topic, expect=2)
    read = [deserialize(r.value, SerializationContext(topic, MessageField.VALUE)) for r in records]
    assert sorted(read, key=lambda o: o["id"]) == orders
    assert all(r.value is not None and r.value[0] == 0 for r in records)  # the wire format's magic byte
    assert registry.get_latest_version(f"{topic}-value").schema.schema_type == "AVRO"  # TopicNameStrategy


def test_a_protobuf_payload_round_trips_through_the_registry_and_the_outbox(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    registry = _registry()
    topic = new_topic()
    sent = timestamp_pb2.Timestamp(seconds=1_764_190_000, nanos=123)
    serializer = ProtobufSerializer(timestamp_pb2.Timestamp, registry, {"use.deprecated.format": False})
    enqueue(db, topic, sent, key="clock", table=table, serializer=serializer)
    db.commit()

    drain(db.info.dsn, table, kafka.bootstrap_servers, "serialized")

    deserialize = ProtobufDeserializer(timestamp_pb2.Timestamp, {"use.deprecated.format": False})
    [record] = kafka.consume(topic, expect=1)
    assert deserialize(record.value, SerializationContext(topic, MessageField.VALUE)) == sent


def test_a_payload_the_schema_refuses_is_a_clear_error_and_nothing_is_written(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    serializer = AvroSerializer(_registry(), ORDER_SCHEMA)
    with pytest.raises(InvalidMessageError, match="message 1 to topic 'orders': the serializer refused the payload"):
        enqueue_many(
            db,
            [Message("orders", {"id": 1, "status": "paid"}), Message("orders", {"id": "not a long", "status": "x"})],
            table=table,
            serializer=serializer,
        )
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(table.messages)).fetchone() == (0,)
