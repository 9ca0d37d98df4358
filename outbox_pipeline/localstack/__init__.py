"""Starts local dev/test servers (PostgreSQL, a Kafka-compatible broker); never imports Dagster or Spark."""

from .broker import BrokerSpec, LocalBroker
from .ports import LocalStackError, PortInUseError, ensure_port_free, free_port, wait_for_tcp
from .postgres import LocalPostgres, PostgresSpec

__all__ = [
    "BrokerSpec",
    "LocalBroker",
    "LocalPostgres",
    "LocalStackError",
    "PortInUseError",
    "PostgresSpec",
    "ensure_port_free",
    "free_port",
    "wait_for_tcp",
]
