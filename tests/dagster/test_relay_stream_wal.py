"""`relay_stream` on a wal outbox (issue 42): one long-lived run streams the slot and records each partition's
history at intervals, as it does for the table strategies."""

from collections import Counter
from collections.abc import Callable

import dagster as dg
import psycopg

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.orchestration.partitions import partition_key
from outbox_pipeline.orchestration.relay_stream import RELAYED_OUTBOX, relay_stream_job
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.partitioning import partition_for
from outbox_pipeline.resources import AlertResource, KafkaResource, PostgresResource
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import message_ids

from .conftest import FAST_FAILING_KAFKA


def test_one_run_streams_a_wal_outbox_and_records_each_partitions_history(
    instance: dg.DagsterInstance,
    dsn: str,
    db: psycopg.Connection,
    wal_outbox: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    topic = new_topic("dg", partitions=4)
    set_topic_partitions(db, wal_outbox, topic, 4)
    with db.transaction():
        written = enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i % 40}") for i in range(200)], table=wal_outbox)
    per_partition = Counter(partition_key(topic, partition_for(f"k{i % 40}", 4)) for i in range(200))
    resources = {
        "postgres": PostgresResource(dsn=dsn, schema_name=wal_outbox.schema),
        "kafka": KafkaResource(bootstrap_servers=kafka.bootstrap_servers, properties=FAST_FAILING_KAFKA),
        "alerts": AlertResource(),
        "orchestration": OrchestrationSettings(),
    }
    config = {"ops": {"relay_outbox_stream": {"config": {"window_s": 4.0, "report_interval_s": 1.0}}}}

    result = relay_stream_job.execute_in_process(run_config=config, instance=instance, resources=resources)

    assert result.success
    assert sorted(message_ids(kafka.consume(topic, idle_s=2.0))) == sorted(str(w.message_id) for w in written)
    for key, count in per_partition.items():
        history = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=RELAYED_OUTBOX, asset_partitions=[key]), limit=1000
        ).records
        assert len(history) >= 3, f"{key}: {len(history)} materializations in a 4 s window reported every 1 s"
        assert sum(r.asset_materialization.metadata["rows_published"].value for r in history) == count  # type: ignore[union-attr,misc]
