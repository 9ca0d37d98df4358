"""Spark test harness: one local Spark session for the whole test session (a cold one takes 10-25 s
here), and the Dagster resources the Spark assets need, pointed at the session's PostgreSQL and broker."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from outbox_pipeline.config import OutboxTable
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.resources.kafka import KafkaResource
from outbox_pipeline.resources.postgres import PostgresResource
from outbox_pipeline.resources.spark import SparkResource
from tests.kit.kafka import KafkaProbe

LOCAL_SPARK = {
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "2",
    # Python workers are reused across tasks: pay the interpreter start once per worker.
    "spark.python.worker.reuse": "true",
}


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkResource]:
    """A started local session; resources built from the same config attach to it (getOrCreate)."""
    resource = SparkResource(master="local[2]", spark_conf=LOCAL_SPARK)
    session = resource.session
    try:
        yield resource
    finally:
        session.stop()


@pytest.fixture
def spark_resources(dsn: str, table: OutboxTable, kafka: KafkaProbe, spark: SparkResource) -> dict[str, object]:
    return {
        "postgres": PostgresResource(dsn=dsn, schema_name=table.schema),
        "kafka": KafkaResource(bootstrap_servers=kafka.bootstrap_servers, properties={"message.timeout.ms": "10000"}),
        "spark": SparkResource(master="local[2]", spark_conf=LOCAL_SPARK),
        # A deployment that names its strategy: an outbox that records none takes it (a relay's first run would).
        "orchestration": OrchestrationSettings(strategy="partitioned"),
    }
