"""The ``outbox_partition_maintenance`` asset against the real PostgreSQL (and Spark for the archive),
and its daily schedule. The run's day is fixed, so which days count as old does not depend on the clock."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pyarrow.parquet as pq
import pytest
from psycopg import sql

from outbox_pipeline.assets.spark import outbox_partition_maintenance, spark_assets, spark_jobs, spark_schedules
from outbox_pipeline.assets.spark.datasource import archive_uri
from outbox_pipeline.config import OutboxTable
from outbox_pipeline.operate import rewind_partition
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.resources.kafka import KafkaResource
from outbox_pipeline.resources.postgres import PostgresResource
from outbox_pipeline.resources.spark import SparkResource
from outbox_pipeline.store import ensure_partitions, partition_name
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain

RUN_DAY = dt.date(2026, 6, 15)
OLD_DAY = dt.date(2026, 5, 1)  # 45 days before RUN_DAY: past a 7-day retention


def _maintain(resources: dict[str, object], archive: Path, **config: object) -> dg.ExecuteInProcessResult:
    result = dg.materialize(
        [outbox_partition_maintenance],
        resources=resources,
        partition_key=RUN_DAY.isoformat(),
        run_config={
            "ops": {
                "outbox_partition_maintenance": {"config": {"archive_uri": str(archive), "retention_days": 7, **config}}
            }
        },
    )
    assert result.success
    return result


def _metadata(result: dg.ExecuteInProcessResult) -> dict[str, Any]:
    [materialization] = result.asset_materializations_for_node("outbox_partition_maintenance")
    return {key: value.value for key, value in materialization.metadata.items()}


def _exists(db: psycopg.Connection, table: OutboxTable, name: str) -> bool:
    row = db.execute("SELECT to_regclass(%s) IS NOT NULL", (table.ident(name).as_string(db),)).fetchone()
    return bool(row and row[0])


def _old_rows(db: psycopg.Connection, table: OutboxTable, topic: str, count: int, *, partitions: int = 2) -> list[str]:
    """Rows created on OLD_DAY (in its own partition), keys k0..k4, every fourth with bytes for its payload (the
    big-endian n); returns their message ids."""
    ensure_partitions(db, table, days_ahead=0, today=OLD_DAY + dt.timedelta(days=1))
    rows = db.execute(
        sql.SQL(
            """
            INSERT INTO {messages} (topic, key, payload, payload_bytes, partition, created_at)
            SELECT %(topic)s, 'k' || (g %% 5), CASE WHEN g %% 4 <> 0 THEN jsonb_build_object('n', g) END,
                   CASE WHEN g %% 4 = 0 THEN int4send(g) END, g %% %(partitions)s,
                   %(day)s::timestamptz + make_interval(secs => g)
            FROM generate_series(1, %(count)s) g
            RETURNING message_id::text
            """
        ).format(messages=table.messages),
        {
            "topic": topic,
            "partitions": partitions,
            "day": dt.datetime.combine(OLD_DAY, dt.time(), dt.UTC),
            "count": count,
        },
    ).fetchall()
    return [r[0] for r in rows]


@pytest.mark.spark
def test_maintenance_creates_the_next_days_partitions(
    db: psycopg.Connection, table: OutboxTable, spark_resources: dict[str, object], tmp_path: Path
) -> None:
    result = _maintain(spark_resources, tmp_path, days_ahead=3)

    ahead = [partition_name(RUN_DAY + dt.timedelta(days=n)) for n in range(-1, 4)]
    assert all(_exists(db, table, name) for name in ahead)
    assert _metadata(result)["partitions_created"] == len(ahead)


@pytest.mark.spark
def test_rows_in_the_default_partition_are_reported_and_moved_into_their_day_partition(
    db: psycopg.Connection, table: OutboxTable, spark_resources: dict[str, object], tmp_path: Path
) -> None:
    far = dt.datetime(2027, 3, 1, 12, tzinfo=dt.UTC)  # no partition that far ahead: lands in DEFAULT
    db.execute(
        sql.SQL("INSERT INTO {} (topic, key, payload, created_at) VALUES ('t', 'k', '{{}}', %s)").format(
            table.messages
        ),
        (far,),
    )

    result = _maintain(spark_resources, tmp_path)

    day_rows = db.execute(sql.SQL("SELECT count(*) FROM {}").format(table.ident(partition_name(far.date())))).fetchone()
    default_rows = db.execute(
        sql.SQL("SELECT count(*) FROM {}").format(table.ident("outbox_messages_default"))
    ).fetchone()
    assert day_rows == (1,) and default_rows == (0,)
    assert _metadata(result)["default_rows_by_day"] == {"2027-03-01": 1}


@pytest.mark.spark
def test_an_old_fully_relayed_partition_is_archived_to_parquet_verified_and_dropped(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    spark_resources: dict[str, object],
    tmp_path: Path,
) -> None:
    topic = new_topic()
    written = _old_rows(db, table, topic, 400)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")
    old = partition_name(OLD_DAY)

    result = _maintain(spark_resources, tmp_path)

    assert not _exists(db, table, old)
    metadata = _metadata(result)
    archived = pq.read_table(_local(metadata["archived"][old]["uri"]))
    assert archived.num_rows == 400
    assert sorted(archived.column("message_id").to_pylist()) == sorted(written)
    binary = [b for b in archived.column("payload_bytes").to_pylist() if b is not None]
    assert sorted(binary) == sorted(n.to_bytes(4, "big") for n in range(4, 401, 4))
    assert metadata["dropped"][old] == 400
    assert metadata["archived"][old]["rows"] == 400
    assert metadata["bytes_freed"] > 0


def _local(uri: str) -> Path:
    assert uri.startswith("file://"), uri
    return Path(uri.removeprefix("file://"))


@pytest.mark.spark
def test_a_day_archived_again_after_a_late_row_keeps_both_archives_and_both_verify(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    spark_resources: dict[str, object],
    tmp_path: Path,
) -> None:
    """A late row for a dropped day (a long transaction's created_at) lands in DEFAULT; the next run moves it
    into a re-created day partition and archives that day again: the first archive must survive."""
    topic = new_topic()
    first_rows = _old_rows(db, table, topic, 20)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")
    old = partition_name(OLD_DAY)
    first = _metadata(_maintain(spark_resources, tmp_path))["archived"][old]
    assert not _exists(db, table, old)

    late = db.execute(
        sql.SQL(
            "INSERT INTO {} (topic, key, payload, partition, created_at) VALUES (%s, 'k', '{{}}', 0, %s) "
            "RETURNING message_id::text"
        ).format(table.messages),
        (topic, dt.datetime.combine(OLD_DAY, dt.time(23, 59), dt.UTC)),
    ).fetchone()
    assert late is not None
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")
    second = _metadata(_maintain(spark_resources, tmp_path))["archived"][old]

    assert first["uri"] != second["uri"]
    assert sorted(pq.read_table(_local(first["uri"])).column("message_id").to_pylist()) == sorted(first_rows)
    assert pq.read_table(_local(second["uri"])).column("message_id").to_pylist() == [late[0]]
    assert (first["rows"], second["rows"]) == (20, 1)  # each verified against PostgreSQL before its drop
    assert not _exists(db, table, old)


def test_a_retention_below_one_day_fails_the_run_with_the_reason(
    spark_resources: dict[str, object], tmp_path: Path
) -> None:
    with pytest.raises(dg.Failure, match="retention_days must be at least 1"):
        _maintain(spark_resources, tmp_path, retention_days=0)


@pytest.mark.spark
def test_an_old_partition_with_a_pending_row_is_kept_and_the_reason_reported(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    spark_resources: dict[str, object],
    tmp_path: Path,
) -> None:
    topic = new_topic()
    _old_rows(db, table, topic, 50)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "locking", mode="mark-sent")
    _old_rows(db, table, topic, 1)  # written late, not relayed yet
    old = partition_name(OLD_DAY)

    result = _maintain(spark_resources, tmp_path, strategy="locking")

    assert _exists(db, table, old)
    assert "1 of 51 rows not relayed yet" in _metadata(result)["skipped"][old]
    assert not (tmp_path / table.schema / old).exists()


@pytest.mark.spark
def test_an_old_partition_with_an_offset_position_inside_it_is_kept_and_the_reason_reported(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    spark_resources: dict[str, object],
    tmp_path: Path,
) -> None:
    topic = new_topic()
    _old_rows(db, table, topic, 10, partitions=1)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")
    fifth = db.execute(sql.SQL("SELECT id FROM {} ORDER BY id OFFSET 4 LIMIT 1").format(table.messages)).fetchone()
    assert fifth is not None
    rewind_partition(db, table, topic, 0, to_id=fifth[0])  # an operator replays the second half
    old = partition_name(OLD_DAY)

    result = _maintain(spark_resources, tmp_path)

    assert _exists(db, table, old)
    assert "is inside this day (5 of 10 rows past it)" in _metadata(result)["skipped"][old]
    assert not (tmp_path / table.schema / old).exists()


def test_the_schedule_maintains_each_day_shortly_after_it_begins() -> None:
    defs = dg.Definitions(
        assets=spark_assets,
        jobs=spark_jobs,
        schedules=spark_schedules,
        resources={
            "postgres": PostgresResource(dsn="host=unused"),
            "kafka": KafkaResource(bootstrap_servers="unused:9092"),
            "spark": SparkResource(),
            "orchestration": OrchestrationSettings(),
        },
    )
    schedule = defs.resolve_schedule_def("outbox_partition_maintenance_schedule")
    tick = dt.datetime(2026, 6, 15, 0, 15, tzinfo=dt.UTC)

    [request] = schedule.evaluate_tick(dg.build_schedule_context(scheduled_execution_time=tick)).run_requests or []

    assert schedule.cron_schedule == "15 0 * * *"
    assert schedule.default_status == dg.DefaultScheduleStatus.RUNNING
    assert request.partition_key == "2026-06-15"
    assert defs.resolve_job_def("bulk_drain_job") is not None


@pytest.mark.parametrize("schema", ["a/../b", "..", "x y", "ütf"])
def test_a_schema_name_goes_into_the_archive_path_as_one_safe_segment(schema: str) -> None:
    uri = archive_uri("/archive", schema, "outbox_messages_p20260501", "20260615T001500Z-abcd1234")
    segments = uri.removeprefix("file:///archive/").split("/")
    assert len(segments) == 3 and all(re.fullmatch(r"[A-Za-z0-9_-]+", s) for s in segments), uri
    assert archive_uri("/archive", schema + "!", "p", "a") != archive_uri("/archive", schema + "?", "p", "a")


@pytest.mark.spark
def test_a_day_with_a_row_the_serialized_relay_has_not_published_is_kept_whatever_the_strategy_named(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    spark_resources: dict[str, object],
    connect: Callable[[], psycopg.Connection],
    tmp_path: Path,
) -> None:
    """A "write first, enqueue last" writer's row: a higher id and a lower transaction id than a row serialized already
    relayed. Read in partitioned's (xid, id) order it looked relayed, and the schedule's default strategy
    (partitioned) dropped the day with it."""
    topic = new_topic()
    ensure_partitions(db, table, days_ahead=0, today=OLD_DAY + dt.timedelta(days=1))
    insert = sql.SQL(
        "INSERT INTO {} (topic, key, payload, partition, created_at) VALUES (%s, 'k', '{{}}', 0, %s) RETURNING id"
    ).format(table.messages)
    old = dt.datetime.combine(OLD_DAY, dt.time(), dt.UTC)
    slow = connect()
    slow.execute("BEGIN")
    slow.execute("SELECT pg_current_xact_id()")  # its business write: the older transaction id
    db.execute(insert, (topic, old))
    drain(db.info.dsn, table, kafka.bootstrap_servers, "serialized")
    late = slow.execute(insert, (topic, old)).fetchone()
    slow.execute("COMMIT")
    name = partition_name(OLD_DAY)

    named = _maintain(spark_resources, tmp_path, strategy="partitioned")
    unnamed = _maintain({**spark_resources, "orchestration": OrchestrationSettings(strategy="serialized")}, tmp_path)

    assert _exists(db, table, name)
    # The outbox records serialized (its relay's): another strategy named is refused, and no day is looked at as it.
    assert "is relayed by serialized" in _metadata(named)["skipped"]["expired days"], _metadata(named)["skipped"]
    assert "1 of 2 rows past it" in _metadata(unnamed)["skipped"][name], _metadata(unnamed)["skipped"]
    assert late is not None
