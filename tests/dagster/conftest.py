"""Fixtures of the Dagster tests: a throwaway Dagster instance, the project's resources pointed at the
session's real PostgreSQL and broker (and this test's outbox schema), and an outbox with rows spread
over several virtual partitions. Sensors and runs are evaluated for real; nothing is mocked."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import dagster as dg
import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.orchestration.partitions import partition_key
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.resources import AlertResource, KafkaResource, PostgresResource
from outbox_pipeline.store import set_topic_partitions
from outbox_pipeline.store.strategy_record import BY_INIT_DB, claim
from tests.kit.kafka import KafkaProbe

# A frozen or unreachable broker fails a batch within 2 s.
FAST_FAILING_KAFKA = {"message.timeout.ms": "2000", "request.timeout.ms": "1000", "retry.backoff.ms": "100"}


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


@pytest.fixture(autouse=True)
def recorded_strategy(request: pytest.FixtureRequest) -> str | None:
    """The test's outbox records its strategy as `outbox init-db --strategy` (what `make dev` runs) leaves it, and
    the deployment's OUTBOX_RELAY_STRATEGY stays empty: ``partitioned``, or the test's ``strategy`` parameter."""
    if "table" not in request.fixturenames:
        return None
    params = getattr(request.node, "callspec", None)
    strategy = str(params.params.get("strategy", "partitioned")) if params else "partitioned"
    table: OutboxTable = request.getfixturevalue("table")
    with psycopg.connect(request.getfixturevalue("dsn"), autocommit=True) as conn:
        claim(conn, table, strategy, by=BY_INIT_DB)
    return strategy


@pytest.fixture
def dagster_resources(dsn: str, table: OutboxTable, kafka: KafkaProbe) -> dict[str, dg.ConfigurableResource[Any]]:
    return {
        "postgres": PostgresResource(dsn=dsn, schema_name=table.schema),
        "kafka": KafkaResource(bootstrap_servers=kafka.bootstrap_servers, properties=FAST_FAILING_KAFKA),
        "alerts": AlertResource(),
        "orchestration": OrchestrationSettings(),
    }


@dataclass(frozen=True)
class Written:
    topic: str
    # partition key ("topic:3") -> message ids written there, in order
    by_key: dict[str, list[str]]

    @property
    def keys(self) -> list[str]:
        return sorted(self.by_key)


def write_outbox_rows(db: psycopg.Connection, table: OutboxTable, topic: str, n: int, *, keys: int = 40) -> Written:
    """n rows to ``topic`` (its partition count already set), spread by key over its partitions."""
    enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i % keys}") for i in range(n)], table=table)
    rows = db.execute(
        sql.SQL("SELECT message_id::text, partition FROM {} WHERE topic = %s ORDER BY id").format(table.messages),
        (topic,),
    ).fetchall()
    by_key: dict[str, list[str]] = defaultdict(list)
    for message_id, partition in rows:
        by_key[partition_key(topic, partition)].append(message_id)
    return Written(topic, dict(by_key))


@pytest.fixture
def write_rows(db: psycopg.Connection, table: OutboxTable, new_topic: Callable[..., str]) -> Callable[..., Written]:
    """``write(n, partitions=4, topic=None)``: n rows to a fresh (or the given) topic, spread by key."""

    def write(n: int, *, partitions: int = 4, topic: str | None = None) -> Written:
        name = topic or new_topic("dg", partitions=partitions)
        set_topic_partitions(db, table, name, partitions)
        return write_outbox_rows(db, table, name, n)

    return write
