"""Engine room: W3C trace context across the outbox, when OpenTelemetry is installed (the ``tracing`` extra).

``enqueue`` stores the writer's current span context in each row's headers (``traceparent``, ``tracestate``), so the
relay publishes it with the message and a consumer that extracts it continues the writer's trace. The relay makes one
PRODUCER span per batch ("send <topic>", OpenTelemetry's messaging conventions), linked to the trace of every message
in it: a batch carries many traces, so it is linked to them rather than a child of one. Without OpenTelemetry nothing
is imported and nothing is added; with its API but no SDK the span is a no-op and no link is made.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .strategies.base import OutboxRecord

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# One span's links at most (the SDK's own default limit is 128): a batch of thousands links to the first traces.
MAX_LINKS = 128
_TOPIC = attrgetter("topic")
_HEADERS = attrgetter("headers")


@dataclass(frozen=True)
class _OpenTelemetry:
    """The parts of OpenTelemetry used here, imported once."""

    trace: Any
    propagator: Any
    status: Any


@functools.cache
def _open_telemetry() -> _OpenTelemetry | None:
    if importlib.util.find_spec("opentelemetry") is None:
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    from opentelemetry.trace.status import Status, StatusCode

    return _OpenTelemetry(trace, TraceContextTextMapPropagator(), (Status, StatusCode))


def current_trace_headers() -> dict[str, str]:
    """The caller's current span context as W3C headers; empty without OpenTelemetry or outside a span."""
    otel = _open_telemetry()
    if otel is None:
        return {}
    carrier: dict[str, str] = {}
    otel.propagator.inject(carrier)
    return carrier


class BatchSpan:
    """The PRODUCER span of one batch, from handing it to the producer to its last delivery report."""

    def __init__(self, otel: _OpenTelemetry, span: Any) -> None:
        self._otel = otel
        self._span = span
        self._linked: set[str] = set()

    def link(self, headers_json: Iterable[str]) -> None:
        """Link to the traces the rows' own headers (their jsonb text, each distinct one once) carry."""
        for text in headers_json:
            if len(self._linked) >= MAX_LINKS:
                return
            if TRACEPARENT not in text:
                continue
            self._linked.add(text)
            context = self._otel.trace.get_current_span(self._otel.propagator.extract(_string_headers(text)))
            span_context = context.get_span_context()
            if span_context.is_valid:
                self._span.add_link(span_context)

    def end(self, delivered: int, failed: int) -> None:
        status, code = self._otel.status
        if failed:
            self._span.set_status(status(code.ERROR, f"{failed} of {delivered + failed} messages not delivered"))
        self._span.end()


def start_batch_span(records: Sequence[OutboxRecord]) -> BatchSpan | None:
    """A recording span for a batch about to be published, linked to its rows' traces; None without OpenTelemetry or
    with a no-op tracer (then the rows are not looked at). The rows are looked at by C-level set building only: this
    runs on every batch."""
    otel = _open_telemetry()
    if otel is None:
        return None
    attributes: dict[str, str | int] = {
        "messaging.system": "kafka",
        "messaging.operation.name": "send",
        "messaging.operation.type": "send",
        "messaging.batch.message_count": len(records),
    }
    tracer = otel.trace.get_tracer("outbox_pipeline")
    span = tracer.start_span("send", kind=otel.trace.SpanKind.PRODUCER, attributes=attributes)
    if not span.is_recording():
        return None
    topics = set(map(_TOPIC, records))
    if len(topics) == 1:
        (topic,) = topics
        span.update_name(f"send {topic}")
        span.set_attribute("messaging.destination.name", topic)
    batch = BatchSpan(otel, span)
    distinct = set(map(_HEADERS, records))
    distinct.discard("{}")
    batch.link(sorted(distinct))
    return batch


def _string_headers(headers_json: str) -> Mapping[str, str]:
    stored = json.loads(headers_json)
    return {name: value for name, value in stored.items() if isinstance(value, str)}
