"""The `outbox_archive` PySpark data source and the archive job built on it: Spark reads one daily partition in id
slices and writes the Parquet. See
docs/spark.md#outbox_partition_maintenance-job-outbox_partition_maintenance_job-daily-partitions."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    InputPartition,
)
from pyspark.sql.types import StructType

from outbox_pipeline import server
from outbox_pipeline.config import OutboxTable
from outbox_pipeline.drain.values import DEFAULT_FETCH_ROWS
from outbox_pipeline.operate.maintenance import (
    ARCHIVE_COLUMNS,
    BINARY_COLUMNS,
    CHECKSUM_COLUMNS,
    NULL_TEXT,
    TIMESTAMP_COLUMNS,
    Fingerprint,
    fetch_archive_rows,
)

OPT_DSN = "secret.pg_dsn"
OPT_PAGE_ROWS = "page_rows"

_ARCHIVE_TYPES: Mapping[str, tuple[pa.DataType, str]] = {
    "id": (pa.int64(), "BIGINT"),
    "partition": (pa.int32(), "INT"),
    "priority": (pa.int32(), "INT"),
    "attempts": (pa.int32(), "INT"),
    "created_at": (pa.timestamp("us", tz="UTC"), "TIMESTAMP"),
    "available_after": (pa.timestamp("us", tz="UTC"), "TIMESTAMP"),
    "sent_at": (pa.timestamp("us", tz="UTC"), "TIMESTAMP"),
    "payload_bytes": (pa.binary(), "BINARY"),
}
ARCHIVE_ARROW_SCHEMA = pa.schema(
    [(name, _ARCHIVE_TYPES.get(name, (pa.string(), ""))[0]) for name, _ in ARCHIVE_COLUMNS]
)
ARCHIVE_DDL = ", ".join(f"`{name}` {_ARCHIVE_TYPES.get(name, (None, 'STRING'))[1]}" for name, _ in ARCHIVE_COLUMNS)


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
        with server.connect(self.dsn, autocommit=True) as conn:
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
    every column, timestamps as epoch microseconds, bytes as lowercase hex, NULL as ``\\N``."""

    def text(name: str) -> Column:
        column = F.col(name)
        if name in TIMESTAMP_COLUMNS:
            column = F.unix_micros(column)
        elif name in BINARY_COLUMNS:
            column = F.lower(F.hex(column))
        return F.coalesce(column.cast("string"), F.lit(NULL_TEXT))

    joined = F.concat_ws("|", *[text(c) for c in CHECKSUM_COLUMNS])
    row_hash = F.conv(F.substring(F.md5(joined), 1, 8), 16, 10).cast("bigint")
    result: Any = frame.agg(F.count(F.lit(1)).alias("rows"), F.coalesce(F.sum(row_hash), F.lit(0)).alias("sum")).first()
    return Fingerprint(int(result["rows"]), int(result["sum"]))
