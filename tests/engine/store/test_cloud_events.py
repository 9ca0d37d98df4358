"""CloudEvents binary content mode, on request (issue 31): with ``OUTBOX_CLOUDEVENTS`` naming a topic (or ``all``),
its messages carry ``ce_*`` headers and ``content-type``, and the CloudEvents SDK's Kafka binding parses each as a
valid event; other topics get none."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from cloudevents.core.bindings.kafka import KafkaMessage, from_binary_event

from outbox_pipeline import Message, OutboxTable, enqueue_many
from tests.kit.kafka import KafkaProbe, Record
from tests.kit.relay import drain


def _event(record: Record) -> Any:
    assert record.value is not None
    return from_binary_event(KafkaMessage(headers=record.headers, key=record.key, value=record.value))


def test_messages_of_a_cloudevents_topic_parse_as_cloudevents_and_other_topics_get_no_ce_headers(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events, plain = new_topic("events"), new_topic("plain")
    monkeypatch.setenv("OUTBOX_CLOUDEVENTS", f"{events}, some-other-topic")
    monkeypatch.setenv("OUTBOX_CLOUDEVENTS_SOURCE", "/shop/orders")
    written = enqueue_many(
        db,
        [
            Message(events, {"id": 42, "status": "paid"}, key="order-42", type="order.paid"),
            Message(events, b"\x00\x01avro", key="order-42"),
            Message(events, {"n": 1}, headers={"content-type": "application/cloudevents-test+json"}),
            Message(plain, {"n": 2}, key="k"),
        ],
        table=table,
    )
    created = db.execute("SELECT now()").fetchone()
    db.commit()

    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")

    by_id = {r.headers["message_id"].decode(): r for r in kafka.consume(events, expect=3)}
    paid, binary, own_type = (by_id[str(w.message_id)] for w in written[:3])
    event = _event(paid)
    assert event.get_specversion() == "1.0"
    assert event.get_id() == str(written[0].message_id)
    assert event.get_type() == "order.paid"
    assert event.get_source() == "/shop/orders"
    assert event.get_datacontenttype() == "application/json"
    assert event.get_data() == {"id": 42, "status": "paid"}
    assert created is not None
    assert abs(event.get_time() - created[0]) < dt.timedelta(seconds=1)
    # No type: the topic's name; bytes: octet-stream; a row's own header wins over the relay's.
    assert _event(binary).get_type() == events
    assert binary.headers["content-type"] == b"application/octet-stream"
    assert [v for k, v in own_type.headers.items() if k == "content-type"] == [b"application/cloudevents-test+json"]
    [other] = kafka.consume(plain, expect=1)
    assert not [name for name in other.headers if name.startswith("ce_")]


def test_an_empty_type_or_an_empty_own_ce_attribute_never_makes_an_empty_required_attribute(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 40, case 28: ``type=''`` gave ``ce_type: ''``, and a row's own empty ``ce_source`` replaced ours; both
    are required, non-empty attributes (a CloudEvents SDK refuses the record)."""
    events = new_topic("events")
    monkeypatch.setenv("OUTBOX_CLOUDEVENTS", "all")
    monkeypatch.setenv("OUTBOX_CLOUDEVENTS_SOURCE", "/shop/orders")
    written = enqueue_many(
        db,
        [
            Message(events, {"n": 1}, key="k", type=""),
            Message(events, {"n": 2}, key="k", headers={"ce_source": "", "ce_type": "", "ce_subject": "s"}),
        ],
        table=table,
    )
    db.commit()

    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")

    by_id = {r.headers["message_id"].decode(): r for r in kafka.consume(events, expect=2)}
    for w in written:
        record = by_id[str(w.message_id)]
        event = _event(record)
        assert (event.get_type(), event.get_source()) == (events, "/shop/orders")
        assert all(value for name, value in record.headers.items() if name.startswith("ce_"))
