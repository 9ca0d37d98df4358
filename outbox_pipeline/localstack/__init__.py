"""The local servers of `make dev`, the tests and the benches (PostgreSQL, Tansu or Apache Kafka), `outbox dev` and
its demo traffic; nothing here imports Dagster or Spark. Each module: docs/architecture.md#commands."""

from .broker import Broker, BrokerSpec, LocalBroker
from .demo import TrafficSpec, print_progress, run_traffic
from .dev import DevSettings, group_members, run_dev, wait_group_gone
from .kafka_broker import SERVER_JVM_OPTIONS, KafkaUnavailableError, LocalKafka, install_kafka, local_broker
from .ports import LocalStackError, PortInUseError, ensure_port_free, free_port, wait_for_tcp
from .postgres import LocalPostgres, PostgresSpec

# demo.load and dagster_runs.graphql are used through their module.
__all__ = [
    "SERVER_JVM_OPTIONS",
    "Broker",
    "BrokerSpec",
    "DevSettings",
    "KafkaUnavailableError",
    "LocalBroker",
    "LocalKafka",
    "LocalPostgres",
    "LocalStackError",
    "PortInUseError",
    "PostgresSpec",
    "TrafficSpec",
    "ensure_port_free",
    "free_port",
    "group_members",
    "install_kafka",
    "local_broker",
    "print_progress",
    "run_dev",
    "run_traffic",
    "wait_for_tcp",
    "wait_group_gone",
]
