"""Trace context end to end (issue 31): the writer's span context rides in the row's headers, the relay publishes
it with a PRODUCER span per batch linked to the writers' traces, and a consumer that extracts it continues the
writer's trace. OpenTelemetry's SDK with its in-memory exporter; without OpenTelemetry nothing is imported or
added."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import NamedTuple

import psycopg
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.store import start_batch_span
from tests.kit.kafka import KafkaProbe, Record
from tests.kit.relay import drain
from tests.kit.tracing import finished_spans

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"


def _relay_spans(topic: str) -> list[ReadableSpan]:
    return [
        s
        for s in finished_spans().get_finished_spans()
        if s.kind == SpanKind.PRODUCER and (s.attributes or {}).get("messaging.destination.name") == topic
    ]


class _Row(NamedTuple):
    """What start_batch_span reads of an outbox record."""

    topic: str
    headers: str


def _extract(record: Record) -> Context:
    return TraceContextTextMapPropagator().extract({name: value.decode() for name, value in record.headers.items()})


def test_a_consumer_continues_the_writers_trace_across_the_outbox(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    finished_spans().clear()
    tracer = trace.get_tracer("checkout-service")
    topic = new_topic()
    with tracer.start_as_current_span("checkout") as writer:
        enqueue_many(db, [Message(topic, {"n": n}, key="order-1") for n in range(3)], table=table)
    db.commit()

    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")

    records = kafka.consume(topic, expect=3)
    with tracer.start_as_current_span("process", context=_extract(records[0]), kind=SpanKind.CONSUMER) as consumer:
        pass
    assert isinstance(consumer, ReadableSpan)  # the SDK's span, which knows its parent
    assert consumer.get_span_context().trace_id == writer.get_span_context().trace_id
    assert consumer.parent is not None and consumer.parent.span_id == writer.get_span_context().span_id
    [send] = _relay_spans(topic)
    assert send.name == f"send {topic}"
    assert send.attributes is not None and send.attributes["messaging.system"] == "kafka"
    assert send.attributes["messaging.batch.message_count"] == 3
    # Three messages of one writer's span: one link.
    assert [link.context.span_id for link in send.links] == [writer.get_span_context().span_id]


def test_a_sql_writer_passes_its_traceparent_and_the_relay_links_to_it(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    finished_spans().clear()
    topic = new_topic()
    traceparent = f"00-{TRACE_ID}-{SPAN_ID}-01"
    db.execute(
        sql.SQL("SELECT * FROM {}(%s, '{{}}', key => 'k', headers => %s)").format(table.ident("enqueue")),
        (topic, json.dumps({"traceparent": traceparent})),
    )
    db.commit()

    drain(db.info.dsn, table, kafka.bootstrap_servers, "serialized")

    [record] = kafka.consume(topic, expect=1)
    assert record.headers["traceparent"] == traceparent.encode()
    [send] = _relay_spans(topic)
    assert [(f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") for link in send.links] == [
        (TRACE_ID, SPAN_ID)
    ]


def test_a_messages_own_traceparent_is_kept_over_the_writers_current_span(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    finished_spans()
    own = f"00-{TRACE_ID}-{SPAN_ID}-01"
    with trace.get_tracer("checkout-service").start_as_current_span("checkout"):
        enqueue(db, "orders", {"n": 1}, headers={"traceparent": own}, table=table)
    stored = db.execute(sql.SQL("SELECT headers FROM {}").format(table.messages)).fetchone()
    assert stored == ({"traceparent": own},)


# Headers as rows carry them: valid, then what the W3C format (and so OpenTelemetry's propagator) refuses.
ROW_HEADERS: list[dict[str, object]] = [
    {"traceparent": f"00-{TRACE_ID}-{SPAN_ID}-01"},
    {"traceparent": f"00-{TRACE_ID}-{SPAN_ID}-00", "tracestate": "vendor=a1,other=b2"},
    {"traceparent": f"01-{TRACE_ID}-{SPAN_ID}-01-a-future-field"},
    {"traceparent": f"ff-{TRACE_ID}-{SPAN_ID}-01"},
    {"traceparent": f"00-{TRACE_ID}-{SPAN_ID}-01-extra"},
    {"traceparent": f"00-{'0' * 32}-{SPAN_ID}-01"},
    {"traceparent": f"00-{TRACE_ID}-{'0' * 16}-01"},
    {"traceparent": f"00-{TRACE_ID.upper()}-{SPAN_ID}-01"},
    {"traceparent": "not a trace"},
    {"traceparent": 7},
    {"tracestate": "vendor=a1"},
    {"other": "value"},
]


def test_the_relay_links_to_the_contexts_opentelemetrys_propagator_reads_from_the_rows() -> None:
    finished_spans().clear()
    propagator = TraceContextTextMapPropagator()
    expected = []
    for headers in ROW_HEADERS:
        carrier = {name: value for name, value in headers.items() if isinstance(value, str)}
        context = trace.get_current_span(propagator.extract(carrier)).get_span_context()
        if context.is_valid:
            expected.append(context)
    rows = [_Row("orders", json.dumps(h)) for h in ROW_HEADERS for _ in range(2)]  # a transaction's rows share theirs

    span = start_batch_span(rows)  # type: ignore[arg-type]  # the two fields it reads
    assert span is not None
    span.end(len(rows), 0)

    [send] = _relay_spans("orders")
    assert [link.context for link in send.links] == expected
    assert len(expected) == 3


WITHOUT_OPENTELEMETRY = """
import json, sys
sys.modules["opentelemetry"] = None  # as if it were not installed
import psycopg
from outbox_pipeline import OutboxTable, enqueue
from outbox_pipeline.relay.loop import Relay  # the relay's modules too
table = OutboxTable(schema=sys.argv[2])
with psycopg.connect(sys.argv[1]) as conn:
    enqueue(conn, "orders", {"n": 1}, table=table)
    headers = conn.execute(f'SELECT headers FROM "{sys.argv[2]}".outbox_messages').fetchone()[0]
print(json.dumps({"headers": headers, "imported": sorted(m for m in sys.modules if m.startswith("opentelemetry."))}))
"""


def test_without_opentelemetry_nothing_is_imported_and_no_header_added(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_OPENTELEMETRY, db.info.dsn, table.schema],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(done.stdout) == {"headers": {}, "imported": []}
