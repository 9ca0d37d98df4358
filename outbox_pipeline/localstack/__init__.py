"""Starts local dev/test servers (PostgreSQL, Tansu or Apache Kafka); never imports Dagster or Spark."""

from .broker import Broker, BrokerSpec, LocalBroker
from .kafka_broker import KafkaUnavailableError, LocalKafka, install_kafka, local_broker
from .ports import LocalStackError, PortInUseError, ensure_port_free, free_port, wait_for_tcp
from .postgres import LocalPostgres, PostgresSpec

__all__ = [
    "Broker",
    "KafkaUnavailableError",
    "LocalKafka",
    "install_kafka",
    "local_broker",
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
