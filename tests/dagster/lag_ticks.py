"""Ticks of `outbox_lag_sensor` as the daemon evaluates them, and what they asked for (the lag sensor's test modules
share these)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import dagster as dg
import psycopg

from outbox_pipeline import OutboxTable
from outbox_pipeline.relay import present
from outbox_pipeline.strategies.positions import UNSCOPED_KIND


def tick(
    sensor: dg.SensorDefinition, instance: dg.DagsterInstance, resources: dict[str, dg.ConfigurableResource[Any]]
) -> dg.SensorResult | dg.SkipReason:
    with dg.build_sensor_context(instance=instance, resources=resources) as context:
        result = sensor(context)
    assert isinstance(result, dg.SensorResult | dg.SkipReason), result
    return result


def added(result: dg.SensorResult | dg.SkipReason) -> list[str]:
    """The partition keys the tick registered."""
    if isinstance(result, dg.SkipReason):
        return []
    return sorted(key for request in result.dynamic_partitions_requests or [] for key in request.partition_keys or [])


def requested(result: dg.SensorResult | dg.SkipReason) -> list[dg.RunRequest]:
    return [] if isinstance(result, dg.SkipReason) else list(result.run_requests or [])


def skip_message(result: dg.SensorResult | dg.SkipReason) -> str:
    if isinstance(result, dg.SkipReason):
        return result.skip_message or ""
    return (result.skip_reason.skip_message or "") if result.skip_reason else ""


@contextmanager
def live_worker(db: psycopg.Connection, table: OutboxTable, worker_id: str) -> Iterator[None]:
    """A registered relay worker alive by its session, as an `outbox relay` process or a run holds it."""
    with present(db.info.dsn, table, worker_id, kind=UNSCOPED_KIND, liveness="session"):
        yield
