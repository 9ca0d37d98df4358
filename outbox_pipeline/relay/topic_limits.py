"""Each topic's record size limit read once and checked against the producer's, because only that configuration keeps a
key's later rows from overtaking a record the broker refuses. See
docs/payloads.md#the-size-limit-the-record-the-relay-sends."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]  # re-exported

log = logging.getLogger(__name__)

# librdkafka's default for message.max.bytes.
LIBRDKAFKA_MESSAGE_MAX_BYTES = 1_000_000
DESCRIBE_TIMEOUT_S = 2.0


def topic_limit_warning(topic: str, topic_max: int, producer_max: int) -> str | None:
    """The warning for a topic whose records must be smaller than the producer's, or None."""
    if topic_max >= producer_max:
        return None
    return (
        f"topic {topic!r} takes records up to {topic_max} bytes (max.message.bytes) but this producer sends up to "
        f"{producer_max}: a row in between is refused by the broker only after later rows of its key in the batch "
        f"may have been delivered, ahead of its dead letter. Set KAFKA_MESSAGE_MAX_BYTES={topic_max} (or lower) so "
        "such a row is refused before anything of its key passes it"
    )


class TopicLimits:
    """Reads a topic's ``max.message.bytes`` the first time it is seen and warns once when it is below the
    producer's ``message.max.bytes``."""

    def __init__(self, producer_config: Mapping[str, object]) -> None:
        self._config: dict[str, str | int | float | bool] = {
            key: value for key, value in producer_config.items() if isinstance(value, str | int | float | bool)
        }
        self.producer_max = int(str(producer_config.get("message.max.bytes", LIBRDKAFKA_MESSAGE_MAX_BYTES)))
        self._seen: set[str] = set()
        self._admin: AdminClient | None = None
        self._answering = True
        self.warnings: list[str] = []

    def check(self, topic: str) -> None:
        if topic in self._seen or not self._answering:
            return
        self._seen.add(topic)
        topic_max = self._topic_max(topic)
        warning = None if topic_max is None else topic_limit_warning(topic, topic_max, self.producer_max)
        if warning is not None:
            self.warnings.append(warning)
            log.warning("%s", warning)

    def _topic_max(self, topic: str) -> int | None:
        try:
            if self._admin is None:
                self._admin = AdminClient(self._config)
            futures = self._admin.describe_configs(
                [ConfigResource(ConfigResource.Type.TOPIC, topic)], request_timeout=DESCRIBE_TIMEOUT_S
            )
            [future] = futures.values()
            entry = future.result(timeout=DESCRIBE_TIMEOUT_S).get("max.message.bytes")
        except (KafkaException, TimeoutError, ValueError) as exc:
            # The broker does not answer (down, or no describe permission): publishing goes on without the check.
            log.debug("could not read max.message.bytes of topic %r: %s", topic, exc)
            self._answering = False
            return None
        if entry is None or entry.value is None:
            return None
        try:
            return int(entry.value)
        except ValueError:
            return None
