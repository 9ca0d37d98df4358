"""The Kafka resource: bootstrap servers and librdkafka properties by config, secrets only by the names of their
environment variables. See docs/dagster.md#resources."""

import os

import dagster as dg
from pydantic import Field, PrivateAttr

from outbox_pipeline.config import kafka_config_from_env, redact_kafka_config
from outbox_pipeline.errors import ConfigurationError
from outbox_pipeline.relay.publisher import KafkaPublisher, check_producer_config


class KafkaResource(dg.ConfigurableResource):
    """The cluster the relay publishes to."""

    bootstrap_servers: str = Field(description="host:port list (EnvVar('KAFKA_BOOTSTRAP_SERVERS'))")
    properties: dict[str, str] = Field(
        default_factory=dict,
        description="extra librdkafka properties, not secret (security.protocol, sasl.mechanism, "
        "ssl.ca.location, message.timeout.ms, ...)",
    )
    secret_env: dict[str, str] = Field(
        default_factory=dict,
        description="librdkafka property -> environment variable holding its value, e.g. "
        "{'sasl.password': 'KAFKA_SASL_PASSWORD'}; read at execution, never shown",
    )
    include_kafka_env: bool = Field(
        default=False,
        description="also take every KAFKA_* environment variable as a property (KAFKA_SASL_USERNAME -> "
        "sasl.username), the convention of the `outbox` CLI; explicit config wins",
    )

    _publishers: list[KafkaPublisher] = PrivateAttr(default_factory=list)

    def producer_config(self) -> dict[str, str]:
        """The librdkafka properties (secrets included: never log this, log ``display_config``)."""
        config: dict[str, str] = {}
        if self.include_kafka_env:
            config.update(kafka_config_from_env({**os.environ, "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap_servers}))
        config.update(self.properties)
        for prop, variable in self.secret_env.items():
            value = os.environ.get(variable)
            if not value:
                raise ConfigurationError(f"{variable} is not set (it holds the Kafka property {prop!r})")
            config[prop] = value
        config["bootstrap.servers"] = self.bootstrap_servers
        return config

    @property
    def display_config(self) -> dict[str, object]:
        return redact_kafka_config(self.producer_config())

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        # Fail the step at start with a readable error when a property is wrong, not mid-relay.
        check_producer_config(self.producer_config())

    def publisher(self) -> KafkaPublisher:
        """A fresh publisher (idempotent producer) for this execution; the relay closes it when done."""
        publisher = KafkaPublisher(self.producer_config())
        self._publishers.append(publisher)
        return publisher

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        # Safety net for a step that died before closing its publisher: nothing here is confirmed.
        for publisher in self._publishers:
            publisher.close(timeout_s=5.0)
        self._publishers.clear()
