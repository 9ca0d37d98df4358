"""The outbox's partitions as dynamic Dagster partitions keyed `topic:partition` (Kafka topic names have no colon). See
docs/dagster.md#partitions."""

import dagster as dg

OUTBOX_PARTITIONS_NAME = "outbox_partitions"

outbox_partitions = dg.DynamicPartitionsDefinition(name=OUTBOX_PARTITIONS_NAME)


def partition_key(topic: str, partition: int) -> str:
    return f"{topic}:{partition}"


def parse_partition_key(key: str) -> tuple[str, int]:
    """``orders:3`` -> ("orders", 3); a clear error for anything else (keys typed in the UI included)."""
    topic, sep, number = key.rpartition(":")
    if not sep or not topic or not number.isdigit():
        raise ValueError(f"outbox partition key {key!r} is not 'topic:partition' (e.g. 'orders:3')")
    return topic, int(number)


def is_valid_key(key: str) -> bool:
    """Dagster refuses some substrings in partition keys ('...', control characters)."""
    return "..." not in key and key.isprintable()
