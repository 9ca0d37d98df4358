"""Spark room: PySpark Python data sources over the outbox, and the two Spark jobs built on them.

``outbox_drain`` reads one frozen range per virtual partition (reader partition = outbox partition, so a
Spark task never splits one) and writes it to Kafka: each write task publishes exactly the rows its
read produced, in order, and returns only when Kafka confirmed every one. The writer's ``commit`` runs
on the driver once every task succeeded and advances the positions; ``abort`` releases the leases and
moves nothing. ``outbox_archive`` reads one daily partition in id slices for the Parquet archive.

Everything that touches PostgreSQL or Kafka is the engine's (``outbox_pipeline.drain`` and
``.maintenance``); these classes only carry values between Spark's processes. Options travel as strings:
secrets under option names containing "secret", which Spark redacts wherever it shows options.
Executors need network access to PostgreSQL and Kafka and a Python that imports outbox_pipeline.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from outbox_pipeline.config import OutboxTable
from outbox_pipeline.drain import (
    DEFAULT_FETCH_ROWS,
    DrainOutcome,
    DrainPlan,
    DrainRange,
    RangeDelivery,
    commit_drain,
    release_drain,
)
from outbox_pipeline.drain_ranges import fetch_range, publish_range
from outbox_pipeline.maintenance import (
    ARCHIVE_COLUMNS,
    CHECKSUM_COLUMNS,
    NULL_TEXT,
    TIMESTAMP_COLUMNS,
    Fingerprint,
    fetch_archive_rows,
)
from outbox_pipeline.publisher import KafkaPublisher
from outbox_pipeline.strategies.base import OutboxRecord

OPT_DSN = "secret.pg_dsn"
OPT_KAFKA = "secret.kafka_config"
OPT_PLAN = "plan"
OPT_PAGE_ROWS = "page_rows"
OPT_REPORT = "report_path"

# OutboxRecord's fields, as the drain moves them from the reader to the writer: producer-ready bytes.
RECORD_ARROW_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("topic", pa.string()),
        ("key", pa.binary()),
        ("payload", pa.binary()),
        ("headers", pa.string()),
        ("message_id", pa.binary()),
        ("outbox_id", pa.binary()),
        ("created_at", pa.binary()),
        ("type", pa.binary()),
        ("partition", pa.int32()),
        ("transaction_id", pa.string()),
        ("attempts", pa.int32()),
    ]
)
assert RECORD_ARROW_SCHEMA.names == list(OutboxRecord._fields)
RECORD_DDL = (
    "id BIGINT, topic STRING, key BINARY, payload BINARY, headers STRING, message_id BINARY, outbox_id BINARY, "
    "created_at BINARY, type BINARY, `partition` INT, transaction_id STRING, attempts INT"
)

_ARCHIVE_TYPES: Mapping[str, tuple[pa.DataType, str]] = {
    "id": (pa.int64(), "BIGINT"),
    "partition": (pa.int32(), "INT"),
    "priority": (pa.int32(), "INT"),
    "attempts": (pa.int32(), "INT"),
    "created_at": (pa.timestamp("us", tz="UTC"), "TIMESTAMP"),
    "available_after": (pa.timestamp("us", tz="UTC"), "TIMESTAMP"),
    "sent_at": (pa.timestamp("us", tz="UTC"), "TIMESTAMP"),
}
ARCHIVE_ARROW_SCHEMA = pa.schema(
    [(name, _ARCHIVE_TYPES.get(name, (pa.string(), ""))[0]) for name, _ in ARCHIVE_COLUMNS]
)
ARCHIVE_DDL = ", ".join(f"`{name}` {_ARCHIVE_TYPES.get(name, (None, 'STRING'))[1]}" for name, _ in ARCHIVE_COLUMNS)


class DrainFailed(RuntimeError):
    """The Spark job failed and the drain was aborted: no position moved."""

    def __init__(self, message: str, delivered_before_abort: Sequence[RangeDelivery]) -> None:
        super().__init__(message)
        self.delivered_before_abort = tuple(delivered_before_abort)


# -- drain -----------------------------------------------------------------------------------------


class RangePartition(InputPartition):
    def __init__(self, rng: DrainRange) -> None:
        super().__init__(rng.label)
        self.rng = rng


@dataclass
class DrainCommitMessage(WriterCommitMessage):
    delivery: RangeDelivery | None


class OutboxDrainSource(DataSource):
    """format("outbox_drain"): read a drain plan's ranges, write them to Kafka."""

    @classmethod
    def name(cls) -> str:
        return "outbox_drain"

    def schema(self) -> str:
        return RECORD_DDL

    def reader(self, schema: StructType) -> DataSourceReader:
        return DrainReader(self.options)

    def writer(self, schema: StructType, overwrite: bool) -> DrainWriter:
        return DrainWriter(self.options)


class DrainReader(DataSourceReader):
    def __init__(self, options: Mapping[str, str]) -> None:
        self.plan_json = options[OPT_PLAN]
        self.dsn = options[OPT_DSN]
        self.page_rows = int(options.get(OPT_PAGE_ROWS, DEFAULT_FETCH_ROWS))

    def partitions(self) -> Sequence[InputPartition]:
        return [RangePartition(rng) for rng in DrainPlan.from_json(self.plan_json).ranges]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, RangePartition):
            return  # Spark's single default partition of an empty plan: no rows
        plan = DrainPlan.from_json(self.plan_json)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for page in fetch_range(conn, plan, partition.rng, page_rows=self.page_rows):
                yield pa.RecordBatch.from_arrays(
                    [
                        pa.array(column, type=field.type)
                        for column, field in zip(zip(*page, strict=True), RECORD_ARROW_SCHEMA, strict=True)
                    ],
                    schema=RECORD_ARROW_SCHEMA,
                )


def _records(batch: pa.RecordBatch) -> list[OutboxRecord]:
    columns = [batch.column(name).to_pylist() for name in OutboxRecord._fields]
    return list(map(OutboxRecord._make, zip(*columns, strict=True)))


class DrainWriter(DataSourceArrowWriter):
    def __init__(self, options: Mapping[str, str]) -> None:
        self.plan_json = options[OPT_PLAN]
        self.dsn = options[OPT_DSN]
        self.kafka_config = json.loads(options[OPT_KAFKA])
        self.report_path = options[OPT_REPORT]

    def write(self, iterator: Iterator[pa.RecordBatch]) -> DrainCommitMessage:
        """One task = one range: publish it all, confirm every delivery, report how far it got."""
        plan = DrainPlan.from_json(self.plan_json)
        publisher = KafkaPublisher(self.kafka_config)
        try:
            delivery = publish_range(publisher, plan.strategy, (_records(b) for b in iterator if b.num_rows))
        finally:
            publisher.close(timeout_s=0)
        return DrainCommitMessage(delivery)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        plan = DrainPlan.from_json(self.plan_json)
        deliveries = [m.delivery for m in messages if isinstance(m, DrainCommitMessage)]
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            outcome = commit_drain(conn, plan, deliveries)
        Path(self.report_path).write_text(outcome.to_json())

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        plan = DrainPlan.from_json(self.plan_json)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            release_drain(conn, plan.table, plan.owner)
        delivered = [m.delivery for m in messages if isinstance(m, DrainCommitMessage) and m.delivery is not None]
        Path(self.report_path).write_text(json.dumps({"aborted": True, "delivered": [asdict(d) for d in delivered]}))


def run_drain(
    spark: SparkSession,
    plan: DrainPlan,
    *,
    dsn: str,
    kafka_config: Mapping[str, object],
    page_rows: int = DEFAULT_FETCH_ROWS,
) -> DrainOutcome:
    """Run the drain as one Spark job; the outcome of the writer's commit, or DrainFailed after an abort.

    The commit runs in a Python worker of the driver, not in this process: it reports through a file
    in a private temporary directory (the driver and this process share a host; PySpark runs the
    driver in client mode).
    """
    if (spark.conf.get("spark.speculation") or "false").lower() == "true":
        raise DrainFailed("spark.speculation is on: a second attempt of a task would interleave a partition", [])
    spark.dataSource.register(OutboxDrainSource)
    with tempfile.TemporaryDirectory(prefix="outbox-drain-") as scratch:
        report = Path(scratch) / "report.json"
        options = {
            OPT_PLAN: plan.to_json(),
            OPT_DSN: dsn,
            OPT_KAFKA: json.dumps(dict(kafka_config)),
            OPT_PAGE_ROWS: str(page_rows),
            OPT_REPORT: str(report),
        }
        frame = spark.read.format(OutboxDrainSource.name()).options(**options).load()
        try:
            frame.write.format(OutboxDrainSource.name()).options(**options).mode("append").save()
        except Exception as exc:
            delivered: list[RangeDelivery] = []
            if report.exists():
                delivered = [RangeDelivery(**d) for d in json.loads(report.read_text()).get("delivered", [])]
            raise DrainFailed(f"bulk drain aborted: {_error_line(exc)}", delivered) from exc
        return DrainOutcome.from_json(report.read_text())


def _error_line(exc: BaseException) -> str:
    """The line that names the error: a Python worker's traceback ends with it, after Spark's wrapper."""
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


# -- archive ---------------------------------------------------------------------------------------


class SlicePartition(InputPartition):
    def __init__(self, low: int, high: int) -> None:
        super().__init__((low, high))
        self.low = low
        self.high = high


class OutboxArchiveSource(DataSource):
    """format("outbox_archive"): one daily partition's rows (ARCHIVE_COLUMNS) in id slices."""

    @classmethod
    def name(cls) -> str:
        return "outbox_archive"

    def schema(self) -> str:
        return ARCHIVE_DDL

    def reader(self, schema: StructType) -> DataSourceReader:
        return ArchiveReader(self.options)


class ArchiveReader(DataSourceReader):
    def __init__(self, options: Mapping[str, str]) -> None:
        self.dsn = options[OPT_DSN]
        self.schema_name = options["schema"]
        self.partition_name = options["partition_name"]
        self.slices = [tuple(s) for s in json.loads(options["slices"])]
        self.page_rows = int(options.get(OPT_PAGE_ROWS, DEFAULT_FETCH_ROWS))

    def partitions(self) -> Sequence[InputPartition]:
        return [SlicePartition(int(low), int(high)) for low, high in self.slices]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, SlicePartition):
            return  # Spark's single default partition of an empty partition: no rows
        table = OutboxTable(schema=self.schema_name)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            pages = fetch_archive_rows(
                conn, table, self.partition_name, partition.low, partition.high, page_rows=self.page_rows
            )
            for page in pages:
                yield pa.RecordBatch.from_arrays(
                    [
                        pa.array(column, type=field.type)
                        for column, field in zip(zip(*page, strict=True), ARCHIVE_ARROW_SCHEMA, strict=True)
                    ],
                    schema=ARCHIVE_ARROW_SCHEMA,
                )


def archive_uri(root: str, schema: str, partition_name: str, attempt: str) -> str:
    """Where one archive of a day partition goes: ``root/<schema>/<partition>/<attempt>``.

    Never the same place twice: a day can be archived again (a late row for a dropped day lands in
    DEFAULT, the day is re-created and archived once more), and that archive must not replace the first.
    ``attempt`` is unique per archive (the maintenance run's time and id). Names are made path-safe: a
    schema is any PostgreSQL identifier ("a/../b" included), so anything but ``[A-Za-z0-9_-]`` becomes
    ``_`` and a short hash of the original name keeps two such names apart. A plain path means local disk.
    """
    if "://" not in root:
        root = Path(root).expanduser().resolve().as_uri()
    return f"{root.rstrip('/')}/{path_safe(schema)}/{path_safe(partition_name)}/{path_safe(attempt)}"


def path_safe(name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", name)
    if safe == name and name not in {"", ".", ".."}:
        return name
    return f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def archive_partition(
    spark: SparkSession,
    *,
    dsn: str,
    table: OutboxTable,
    partition_name: str,
    slices: Sequence[tuple[int, int]],
    uri: str,
) -> Fingerprint:
    """Write the partition's rows as Parquet at ``uri`` (which must not exist: an archive is never
    replaced) and return the fingerprint of what was written, read back from the files, to compare
    with PostgreSQL's."""
    spark.dataSource.register(OutboxArchiveSource)
    frame = (
        spark.read.format(OutboxArchiveSource.name())
        .option(OPT_DSN, dsn)
        .option("schema", table.schema)
        .option("partition_name", partition_name)
        .option("slices", json.dumps([list(s) for s in slices]))
        .load()
    )
    frame.write.mode("errorifexists").parquet(uri)
    return parquet_fingerprint(spark.read.parquet(uri))


def parquet_fingerprint(frame: DataFrame) -> Fingerprint:
    """Row count and checksum of archived rows, computed as ``maintenance.fingerprint`` does in SQL:
    every column, timestamps as epoch microseconds, NULL as ``\\N``."""

    def text(name: str) -> Column:
        column = F.unix_micros(F.col(name)) if name in TIMESTAMP_COLUMNS else F.col(name)
        return F.coalesce(column.cast("string"), F.lit(NULL_TEXT))

    joined = F.concat_ws("|", *[text(c) for c in CHECKSUM_COLUMNS])
    row_hash = F.conv(F.substring(F.md5(joined), 1, 8), 16, 10).cast("bigint")
    result: Any = frame.agg(F.count(F.lit(1)).alias("rows"), F.coalesce(F.sum(row_hash), F.lit(0)).alias("sum")).first()
    return Fingerprint(int(result["rows"]), int(result["sum"]))
