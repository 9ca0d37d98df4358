"""Dagster resources around the engine's PostgreSQL and Kafka access, alert delivery and the Spark session. Each
module: docs/architecture.md#assets-and-resources."""

from .alerts import Alert, AlertResource
from .kafka import KafkaResource
from .postgres import PostgresResource
from .spark import SparkResource

__all__ = ["Alert", "AlertResource", "KafkaResource", "PostgresResource", "SparkResource"]
