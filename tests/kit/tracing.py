"""Test kit: OpenTelemetry's SDK with an in-memory exporter, installed once per test process (the tracer provider is
global and can be set only once)."""

from __future__ import annotations

import functools

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


@functools.cache
def finished_spans() -> InMemorySpanExporter:
    """The exporter every span of this process ends in (clear it at the start of a test)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter
