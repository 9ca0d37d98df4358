"""Dagster room: resources wrapping the engine's PostgreSQL and Kafka access, and alert delivery."""

from .alerts import Alert, AlertResource
from .kafka import KafkaResource
from .postgres import PostgresResource
from .spark import SparkResource

__all__ = ["Alert", "AlertResource", "KafkaResource", "PostgresResource", "SparkResource"]
