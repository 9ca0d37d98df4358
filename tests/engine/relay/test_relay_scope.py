"""A relay scoped to some (topic, partition) pairs publishes those and leaves every other row pending."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.model import STRATEGY_NAMES
from outbox_pipeline.observe import partition_lag
from outbox_pipeline.store import set_topic_partitions
from outbox_pipeline.strategies import StrategyConfig
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain, message_ids


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_a_scoped_relay_publishes_only_its_partition_and_leaves_the_others_pending(
    strategy: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=4)
    set_topic_partitions(db, table, topic, 4)
    messages = [Message(topic, {"n": i}, key=f"k{i}") for i in range(400)]
    enqueue_many(db, messages, serialized=strategy == "serialized", table=table)
    query = sql.SQL("SELECT message_id::text, partition FROM {}").format(table.messages)
    partition_of: dict[str, int] = dict(db.execute(query).fetchall())
    per_partition = Counter(partition_of.values())
    assert len(per_partition) == 4  # 400 keys spread over every partition

    stats = drain(db.info.dsn, table, kafka.bootstrap_servers, strategy, partitions=frozenset({(topic, 1)}))

    arrived = message_ids(kafka.consume(topic, idle_s=2.0))
    assert sorted(arrived) == sorted(m for m, p in partition_of.items() if p == 1)
    assert stats.published == per_partition[1]
    pending = {(lag.topic, lag.partition): lag.pending for lag in partition_lag(db, table, strategy) if lag.pending}
    assert pending == {(topic, p): n for p, n in per_partition.items() if p != 1}


def test_an_empty_scope_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        StrategyConfig(partitions=frozenset())
