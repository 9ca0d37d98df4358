"""Dagster room: resources wrapping the engine's PostgreSQL and Kafka access."""

from .postgres import PostgresResource

__all__ = ["PostgresResource"]
