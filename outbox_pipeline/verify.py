"""Engine room: ``outbox verify``, the delivery ledger check a user runs against a deployment.

Consumes the target topics (every partition, ``assign()``ed explicitly, read_committed) from the start or
from given offsets until every partition is idle, and compares what arrived with the outbox ledger:

* **lost**: committed in PostgreSQL, never in Kafka;
* **phantom**: in Kafka, committed nowhere in PostgreSQL;
* **duplicates**: extra copies (at-least-once delivery makes some; they are not an error);
* **order violations** (``ordered=``): per key, the first occurrence of each message in Kafka against the
  order the strategy promises;
* **latency**: ``created_at`` header -> broker timestamp, percentiles.

Memory stays flat in the number of records: consumed records go to a TEMP table in PostgreSQL with COPY,
one chunk at a time, and every answer is a SQL query. The broker's high watermarks only tell where a
partition ended when verify started; "all consumed" is decided by the partitions staying idle (the local
broker's watermarks run behind the real end of a partition).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import re
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import psycopg
from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)
from psycopg import sql

from .config import OutboxTable, redact_kafka_error
from .errors import ConfigurationError, OutboxError

log = logging.getLogger(__name__)

OrderedStrategy = Literal["partitioned", "serialized", "advisory"]
ORDERED_STRATEGIES: tuple[OrderedStrategy, ...] = ("partitioned", "serialized", "advisory")

# Rows per COPY: the only records Python holds at once.
CHUNK_ROWS = 10_000
# How many lost / phantom messages the report names.
EXAMPLES = 5
DEFAULT_IDLE_S = 5.0
# work_mem of verify's own queries (hash joins and sorts over every record), on the PostgreSQL server.
WORK_MEM = "64MB"

# A consumer that reads everything once and commits nothing. The prefetch queue is librdkafka's memory,
# not Python's: bounded so that verify stays well inside the benchmark's memory budget.
DEFAULT_CONSUMER_CONFIG: Mapping[str, object] = {
    "queued.max.messages.kbytes": 16_384,
    "queued.min.messages": 20_000,
    "max.partition.fetch.bytes": 4 << 20,
    "fetch.max.bytes": 16 << 20,
}
REQUIRED_CONSUMER_CONFIG: Mapping[str, object] = {
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "enable.partition.eof": False,
    "isolation.level": "read_committed",
    "auto.offset.reset": "earliest",
}
# Producer-only properties users may have in KAFKA_* for the relay: a consumer warns about each one.
_PRODUCER_ONLY = re.compile(
    r"^(acks|enable\.idempotence|linger\.ms|batch\.|queue\.buffering\.|message\.timeout\.ms|compression\.|"
    r"partitioner|transactional\.id|transaction\.timeout\.ms|retries|delivery\.timeout\.ms|"
    r"request\.required\.acks|sticky\.partitioning)"
)
_UUID = re.compile(rb"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_MAX_BIGINT = 2**63 - 1


@dataclass(frozen=True)
class MessageRef:
    """One lost or phantom message, as far as it is known (lost ones have no Kafka position)."""

    message_id: str | None
    outbox_id: int | None = None
    topic: str | None = None
    key: str | None = None
    partition: int | None = None  # Kafka partition
    offset: int | None = None


@dataclass(frozen=True)
class OrderViolation:
    """In ``topic``/``partition``, ``key``'s message ``outbox_id`` (at ``offset``) belongs before the one
    at ``previous_offset`` (``previous_outbox_id``), which Kafka holds first."""

    topic: str
    partition: int
    key: str
    previous_offset: int
    previous_outbox_id: int | None
    offset: int
    outbox_id: int | None


@dataclass(frozen=True)
class Latency:
    """created_at -> broker timestamp of each message's first copy, in milliseconds."""

    messages: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float


@dataclass(frozen=True)
class VerifyReport:
    topics: tuple[str, ...]
    ledger: str  # "table" or "file"
    ledger_messages: int  # committed messages verify expects in Kafka (dead letters excluded)
    partitions: int  # Kafka partitions consumed
    consumed_records: int
    ignored_records: int  # outside the table ledger's --since / --id-from range
    complete: bool  # False: stopped by max_s before every partition was idle
    elapsed_s: float
    lost: int
    phantom: int
    duplicate_copies: int  # records beyond the first copy of each message
    duplicated_messages: int
    worst_duplicate_key: str | None
    worst_duplicate_key_copies: int
    dead_letters: int  # not lost: the relay gave up on them (`outbox dead-letters list`)
    held: int  # not lost: held behind a dead letter of their key (quarantine; `outbox lag`)
    ordered: str | None
    order_checked: int  # messages whose order was checked
    order_violations: int
    order_example: OrderViolation | None
    latency: Latency | None
    lost_examples: tuple[MessageRef, ...] = ()
    phantom_examples: tuple[MessageRef, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """No loss, no phantom, no order violation (duplicates are at-least-once, not an error)."""
        return self.lost == 0 and self.phantom == 0 and self.order_violations == 0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ok": self.ok}

    def render(self) -> str:
        """The human-readable report."""
        lines = [
            f"topics       {', '.join(self.topics)}",
            f"ledger       {self.ledger_messages:,} committed messages ({self.ledger})",
            f"consumed     {self.consumed_records:,} records from {self.partitions} "
            f"partition{'' if self.partitions == 1 else 's'} in "
            f"{self.elapsed_s:.1f} s (read_committed)"
            + (f", {self.ignored_records:,} outside the ledger's range ignored" if self.ignored_records else ""),
            f"lost         {self.lost:,}",
        ]
        lines += [f"  lost       {_describe(m)}" for m in self.lost_examples]
        lines.append(f"phantom      {self.phantom:,}")
        lines += [f"  phantom    {_describe(m)}" for m in self.phantom_examples]
        dupes = f"duplicates   {self.duplicate_copies:,} extra copies of {self.duplicated_messages:,} messages"
        if self.duplicate_copies:
            dupes += f"; worst key {_show_key(self.worst_duplicate_key)} ({self.worst_duplicate_key_copies:,} extra)"
        lines.append(dupes)
        if self.ordered is None:
            lines.append("order        not checked (give --ordered partitioned|serialized|advisory)")
        else:
            lines.append(
                f"order        {self.order_violations:,} violations in {self.order_checked:,} keyed messages "
                f"({self.ordered})"
            )
            if self.order_example is not None:
                e = self.order_example
                lines.append(
                    f"  example    {e.topic}/{e.partition} key {_show_key(e.key)}: outbox id {e.outbox_id} at offset "
                    f"{e.offset} comes after outbox id {e.previous_outbox_id} at offset {e.previous_offset}"
                )
        if self.latency is None:
            lines.append("latency      no record with both a created_at header and a broker timestamp")
        else:
            la = self.latency
            lines.append(
                f"latency      p50 {la.p50_ms:,.1f} ms, p95 {la.p95_ms:,.1f} ms, p99 {la.p99_ms:,.1f} ms, "
                f"max {la.max_ms:,.1f} ms over {la.messages:,} messages (created_at -> broker timestamp)"
            )
        lines.append(f"dead letters {self.dead_letters:,} (not counted as lost: `outbox dead-letters list`)")
        if self.held:
            lines.append(
                f"held         {self.held:,} behind dead letters of their keys (not counted as lost: `outbox lag`)"
            )
        lines += [f"note: {n}" for n in self.notes]
        if self.ok:
            lines.append(
                "OK: every committed message is in Kafka, nothing else is" + (", in order" if self.ordered else "")
            )
        else:
            problems = [
                f"{n:,} {what}"
                for n, what in ((self.lost, "lost"), (self.phantom, "phantom"), (self.order_violations, "out of order"))
                if n
            ]
            lines.append("FAILED: " + ", ".join(problems))
        return "\n".join(lines)


def _show_key(key: str | None) -> str:
    return "(no key)" if key is None else repr(key)


def _describe(m: MessageRef) -> str:
    parts = [f"message_id={m.message_id or '(none)'}"]
    if m.outbox_id is not None:
        parts.append(f"outbox_id={m.outbox_id}")
    if m.topic is not None:
        parts.append(f"topic={m.topic}" + (f"/{m.partition}@{m.offset}" if m.partition is not None else ""))
    parts.append(f"key={_show_key(m.key)}")
    return " ".join(parts)


def parse_start_offset(text: str) -> tuple[str, int, int]:
    """``topic:partition:offset`` (Kafka topic names cannot contain ``:``)."""
    parts = text.rsplit(":", 2)
    try:
        if len(parts) != 3 or not parts[0]:
            raise ValueError
        topic, partition, offset = parts[0], int(parts[1]), int(parts[2])
        if partition < 0 or offset < 0:
            raise ValueError
    except ValueError:
        raise OutboxError(f"--from takes TOPIC:PARTITION:OFFSET with non-negative numbers, got {text!r}") from None
    return topic, partition, offset


def verify(
    conn: psycopg.Connection,
    table: OutboxTable,
    bootstrap_config: Mapping[str, object],
    topics: Sequence[str],
    *,
    ledger_file: str | Path | None = None,
    ordered: OrderedStrategy | None = None,
    since: dt.datetime | None = None,
    id_from: int | None = None,
    start_offsets: Mapping[tuple[str, int], int] | None = None,
    idle_s: float = DEFAULT_IDLE_S,
    max_s: float | None = None,
) -> VerifyReport:
    """Check what ``topics`` hold against the outbox ledger; see the module docstring.

    The ledger is the outbox table's rows of ``topics`` (the strategies that keep rows: partitioned,
    serialized, mark-sent mode), optionally from ``since`` (created_at) / ``id_from`` (outbox id), or the
    message ids in ``ledger_file`` (one per line: for delete mode, whose relayed rows are gone). Pending
    dead letters are not in it. ``conn`` may be in autocommit mode; verify's own transactions are short
    (one per COPY chunk), so it never holds back the ``partitioned`` relay's snapshot horizon.
    ``max_s`` bounds the consumption (for topics that never go idle); the report then says so.
    """
    names = tuple(dict.fromkeys(topics))
    if not names:
        raise OutboxError("give at least one topic to verify")
    if ordered is not None and ordered not in ORDERED_STRATEGIES:
        raise OutboxError(f"--ordered takes one of {', '.join(ORDERED_STRATEGIES)}, not {ordered!r}")
    if ledger_file is not None and (since is not None or id_from is not None):
        raise OutboxError("--since and --id-from narrow the table ledger; a --ledger-file is the whole ledger")
    if idle_s <= 0 or (max_s is not None and max_s <= 0):
        raise OutboxError("--idle-s and --max-seconds must be > 0")
    if since is not None and since.tzinfo is None:
        since = since.replace(tzinfo=dt.UTC)
    starts = dict(start_offsets or {})
    for topic, _partition in starts:
        if topic not in names:
            raise OutboxError(f"--from names topic {topic!r}, which is not one of the topics to verify")

    started = time.monotonic()
    work = _Workspace(conn, table)
    try:
        work.create()
        # The ledger is taken before consuming: rows committed while verify runs are not expected, and
        # when they arrive anyway they are still found in the outbox table (not phantom).
        if ledger_file is not None:
            dead_letters, held = work.load_ledger_file(Path(ledger_file))
        else:
            dead_letters, held = work.load_ledger_table(names, since, id_from)
        log.debug("verify: ledger loaded in %.1f s", time.monotonic() - started)
        consumed = _consume(_consumer(bootstrap_config), names, starts, idle_s, max_s, work)
        return work.report(
            names,
            ledger="file" if ledger_file is not None else "table",
            dead_letters=dead_letters,
            held=held,
            consumed=consumed,
            ordered=ordered,
            since=since,
            id_from=id_from,
            from_offsets=bool(starts),
            elapsed_s=time.monotonic() - started,
        )
    finally:
        work.drop()


# -- consuming --------------------------------------------------------------------------------------


def _consumer(bootstrap_config: Mapping[str, object]) -> Consumer:
    config: dict[str, object] = {
        **DEFAULT_CONSUMER_CONFIG,
        **{k: v for k, v in bootstrap_config.items() if not _PRODUCER_ONLY.match(k)},
        **REQUIRED_CONSUMER_CONFIG,
        "group.id": f"outbox-verify-{uuid.uuid4().hex}",  # never commits: the group only names the client
    }
    try:
        return Consumer(config)
    except KafkaException as exc:
        raise ConfigurationError(f"invalid Kafka configuration: {redact_kafka_error(exc, config)}") from None


@dataclass
class _Consumed:
    records: int = 0
    partitions: int = 0
    complete: bool = True


def _consume(
    consumer: Consumer,
    topics: Sequence[str],
    starts: Mapping[tuple[str, int], int],
    idle_s: float,
    max_s: float | None,
    work: _Workspace,
) -> _Consumed:
    """Read every partition of ``topics`` into the workspace until each is idle past its start watermark."""
    try:
        try:
            metadata = consumer.list_topics(timeout=15)
        except KafkaException as exc:
            raise OutboxError(f"cannot read Kafka metadata: {redact_kafka_error(exc, {})}") from None
        assignment: list[TopicPartition] = []
        for topic in topics:
            info = metadata.topics.get(topic)
            if info is None or info.error is not None or not info.partitions:
                reason = info.error.str() if info is not None and info.error is not None else "no such topic"
                raise OutboxError(f"topic {topic!r} cannot be read: {reason}")
            assignment += [TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(info.partitions)]
        known = {(tp.topic, tp.partition) for tp in assignment}
        for topic, partition in starts:
            if (topic, partition) not in known:
                raise OutboxError(f"--from {topic}:{partition}: the topic has no partition {partition}")
        # What "caught up" means at the start; records keep arriving after it until the topics are idle.
        remaining: dict[tuple[str, int], int] = {}
        for tp in assignment:
            try:
                low, high = consumer.get_watermark_offsets(tp, timeout=15, cached=False)
            except KafkaException as exc:
                raise OutboxError(f"cannot read {tp.topic}/{tp.partition}: {redact_kafka_error(exc, {})}") from None
            start = starts.get((tp.topic, tp.partition))
            if start is not None:
                tp.offset = start
            if high > max(low, start or 0):
                remaining[(tp.topic, tp.partition)] = high
        consumer.assign(assignment)
        log.info("verify: consuming %d partitions of %s", len(assignment), ", ".join(topics))

        result = _Consumed(partitions=len(assignment))
        chunk: list[tuple[object, ...]] = []
        began = last_record = time.monotonic()
        while True:
            messages = consumer.consume(num_messages=CHUNK_ROWS, timeout=0.5)
            now = time.monotonic()
            for msg in messages:
                error = msg.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        continue
                    if error.fatal() or error.code() in (
                        KafkaError.UNKNOWN_TOPIC_OR_PART,
                        KafkaError.TOPIC_AUTHORIZATION_FAILED,
                    ):
                        raise OutboxError(f"consuming {msg.topic()}/{msg.partition()} failed: {error.str()}")
                    log.warning("verify: consumer error (retrying): %s", error.str())
                    continue
                row = _row(msg)
                chunk.append(row)
                topic_partition = cast("tuple[str, int]", row[1:3])
                target = remaining.get(topic_partition)
                if target is not None and cast(int, row[3]) + 1 >= target:
                    del remaining[topic_partition]
            if messages:
                last_record = now
            if len(chunk) >= CHUNK_ROWS:
                work.write_consumed(chunk)
                result.records += len(chunk)
                chunk.clear()
            if remaining and not messages:
                _drop_reached(consumer, remaining)
            if not remaining and now - last_record >= idle_s:
                break
            if max_s is not None and now - began >= max_s:
                result.complete = False
                log.warning("verify: stopped after %.0f s before every partition was idle", max_s)
                break
        work.write_consumed(chunk)
        result.records += len(chunk)
        log.debug("verify: consumed %d records in %.1f s", result.records, time.monotonic() - began)
        return result
    finally:
        consumer.close()


def _drop_reached(consumer: Consumer, remaining: dict[tuple[str, int], int]) -> None:
    """Partitions whose position passed their start watermark without a record there (a transaction
    marker, or an aborted record read_committed skips)."""
    positions = consumer.position([TopicPartition(t, p) for t, p in remaining])
    for tp in positions:
        if tp.offset >= 0 and tp.offset >= remaining[(tp.topic, tp.partition)]:
            del remaining[(tp.topic, tp.partition)]


def _row(msg: Message) -> tuple[object, ...]:
    """(message_id, topic, partition, offset, key, outbox_id, created_at, broker_ms) of one record."""
    message_id = outbox_id = created_at = None
    headers = cast("list[tuple[str, bytes | None]]", msg.headers() or [])
    for name, value in headers:
        if value is None:
            continue
        if name == "message_id":
            message_id = _uuid(value)
        elif name == "outbox_id":
            outbox_id = _bigint(value)
        elif name == "created_at":
            created_at = _timestamp(value)
    ts_type, ts = msg.timestamp()
    raw_key = msg.key()
    key = None
    if raw_key is not None:
        key = raw_key.decode("utf-8", "backslashreplace") if isinstance(raw_key, bytes) else str(raw_key)
        key = key.replace("\x00", "\\x00")  # PostgreSQL text cannot hold NUL
    broker_ms = ts if ts_type != TIMESTAMP_NOT_AVAILABLE and ts >= 0 else None
    return (message_id, msg.topic(), msg.partition(), msg.offset(), key, outbox_id, created_at, broker_ms)


def _uuid(value: bytes | str) -> str | None:
    raw = value.encode() if isinstance(value, str) else value
    if _UUID.fullmatch(raw):
        return raw.decode()
    try:
        return str(uuid.UUID(raw.decode()))
    except (ValueError, UnicodeDecodeError):
        return None


def _bigint(value: bytes | str) -> int | None:
    try:
        number = int(value)
    except ValueError:
        return None
    return number if 0 <= number <= _MAX_BIGINT else None


def _timestamp(value: bytes | str) -> dt.datetime | None:
    try:
        parsed = dt.datetime.fromisoformat(value.decode() if isinstance(value, bytes) else value)
    except (ValueError, UnicodeDecodeError):
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=dt.UTC)


# -- the workspace: temp tables and the questions asked of them -------------------------------------


class _Workspace:
    """TEMP tables on ``conn``: the ledger, the consumed records, the phantom candidates. Every step is its
    own short transaction (a savepoint inside a caller's transaction), with room to hash and sort."""

    def __init__(self, conn: psycopg.Connection, table: OutboxTable) -> None:
        self.conn = conn
        self.table = table
        suffix = uuid.uuid4().hex[:12]
        self.ledger = sql.Identifier("pg_temp", f"outbox_verify_ledger_{suffix}")
        self.consumed = sql.Identifier("pg_temp", f"outbox_verify_consumed_{suffix}")
        self.phantoms = sql.Identifier("pg_temp", f"outbox_verify_phantoms_{suffix}")
        self._raw = sql.Identifier("pg_temp", f"outbox_verify_raw_{suffix}")
        self._created = False

    def _sql(self, text: str, **extra: sql.Composable) -> sql.Composed:
        return sql.SQL(text).format(
            ledger=self.ledger,
            consumed=self.consumed,
            phantoms=self.phantoms,
            raw=self._raw,
            messages=self.table.messages,
            dead_letters=self.table.dead_letters,
            held=self.table.held,
            **extra,
        )

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        with self.conn.transaction():
            # Joins and sorts over millions of rows: hashed in memory instead of spilled in many batches.
            self.conn.execute("SELECT set_config('work_mem', %s, true)", (WORK_MEM,))
            yield

    def create(self) -> None:
        with self._transaction():
            self._created = True
            self.conn.execute(
                self._sql(
                    "CREATE TEMP TABLE {ledger} (message_id uuid NOT NULL, outbox_id bigint, topic text, key text, "
                    "transaction_id xid8)"
                )
            )
            self.conn.execute(
                self._sql(
                    "CREATE TEMP TABLE {consumed} (message_id uuid, topic text NOT NULL, kafka_partition integer "
                    "NOT NULL, kafka_offset bigint NOT NULL, key text, outbox_id bigint, created_at timestamptz, "
                    "broker_ms bigint)"
                )
            )

    def drop(self) -> None:
        if not self._created:
            return
        try:
            with self.conn.transaction():
                self.conn.execute(self._sql("DROP TABLE IF EXISTS {ledger}, {consumed}, {phantoms}, {raw}"))
        except psycopg.Error as exc:  # the session ends some day and takes its temp tables along
            log.debug("verify: could not drop its temp tables: %s", exc)

    def load_ledger_table(
        self, topics: Sequence[str], since: dt.datetime | None, id_from: int | None
    ) -> tuple[int, int]:
        """The outbox rows of ``topics`` (in range) minus pending dead letters and held rows, one per message_id
        (a retried dead letter of a position strategy has two rows); returns (pending dead letters, held)."""
        params = {"topics": list(topics), "since": since, "id_from": id_from}
        with self._transaction():
            self.conn.execute(
                self._sql(
                    """
                    INSERT INTO {ledger} (message_id, outbox_id, topic, key, transaction_id)
                    SELECT DISTINCT ON (m.message_id) m.message_id, m.id, m.topic, m.key, m.transaction_id
                    FROM {messages} m
                    WHERE m.topic = ANY(%(topics)s::text[])
                      AND (%(since)s::timestamptz IS NULL OR m.created_at >= %(since)s::timestamptz)
                      AND (%(id_from)s::bigint IS NULL OR m.id >= %(id_from)s::bigint)
                      AND NOT EXISTS (
                          SELECT 1 FROM {dead_letters} d WHERE d.message_id = m.message_id AND d.retried_at IS NULL)
                      AND NOT EXISTS (SELECT 1 FROM {held} x WHERE x.message_id = m.message_id)
                    ORDER BY m.message_id, m.id DESC
                    """
                ),
                params,
            )
            row = self.conn.execute(
                self._sql(
                    """
                    SELECT
                        (SELECT count(*) FROM {dead_letters} d
                         WHERE d.retried_at IS NULL AND d.topic = ANY(%(topics)s::text[])
                           AND (%(since)s::timestamptz IS NULL OR d.created_at >= %(since)s::timestamptz)
                           AND (%(id_from)s::bigint IS NULL OR d.id >= %(id_from)s::bigint)),
                        (SELECT count(*) FROM {held} x
                         WHERE x.topic = ANY(%(topics)s::text[])
                           AND (%(since)s::timestamptz IS NULL OR x.created_at >= %(since)s::timestamptz)
                           AND (%(id_from)s::bigint IS NULL OR x.id >= %(id_from)s::bigint)
                           AND NOT EXISTS (SELECT 1 FROM {dead_letters} d
                                           WHERE d.message_id = x.message_id AND d.retried_at IS NULL))
                    """
                ),
                params,
            ).fetchone()
            self.conn.execute(self._sql("ANALYZE {ledger}"))
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def load_ledger_file(self, path: Path) -> tuple[int, int]:
        """Message ids from ``path`` (one per line; blank lines and ``#`` comments skipped), minus pending
        dead letters and held rows, with what the outbox table still knows of them; returns (dead letters, held)."""
        try:
            handle = path.open("rb")
        except OSError as exc:
            raise OutboxError(f"cannot read --ledger-file {path}: {exc.strerror or exc}") from None
        with handle, self._transaction():
            self.conn.execute(self._sql("CREATE TEMP TABLE {raw} (message_id uuid NOT NULL)"))
            try:
                with self.conn.cursor() as cur, cur.copy(self._sql("COPY {raw} (message_id) FROM STDIN")) as copy:
                    for block in _ledger_blocks(handle):
                        copy.write(block)
            except psycopg.errors.DataError as exc:
                detail = exc.diag.message_primary or str(exc)
                raise OutboxError(f"--ledger-file {path}: {detail}") from None
            # Rows still in the table (mark-sent mode, position strategies) name the examples and give
            # `partitioned` its order; rows deleted by the relay leave those columns NULL.
            self.conn.execute(
                self._sql(
                    """
                    INSERT INTO {ledger} (message_id, outbox_id, topic, key, transaction_id)
                    SELECT DISTINCT ON (r.message_id) r.message_id, m.id, m.topic, m.key, m.transaction_id
                    FROM {raw} r LEFT JOIN {messages} m ON m.message_id = r.message_id
                    WHERE NOT EXISTS (
                        SELECT 1 FROM {dead_letters} d WHERE d.message_id = r.message_id AND d.retried_at IS NULL)
                      AND NOT EXISTS (SELECT 1 FROM {held} x WHERE x.message_id = r.message_id)
                    ORDER BY r.message_id, m.id DESC NULLS LAST
                    """
                )
            )
            row = self.conn.execute(
                self._sql(
                    """
                    SELECT (SELECT count(DISTINCT d.message_id) FROM {dead_letters} d JOIN {raw} r USING (message_id)
                            WHERE d.retried_at IS NULL),
                           (SELECT count(DISTINCT x.message_id) FROM {held} x JOIN {raw} r USING (message_id)
                            WHERE NOT EXISTS (SELECT 1 FROM {dead_letters} d
                                              WHERE d.message_id = x.message_id AND d.retried_at IS NULL))
                    """
                )
            ).fetchone()
            self.conn.execute(self._sql("DROP TABLE {raw}"))
            self.conn.execute(self._sql("ANALYZE {ledger}"))
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def write_consumed(self, rows: Sequence[tuple[object, ...]]) -> None:
        if not rows:
            return
        statement = self._sql(
            "COPY {consumed} (message_id, topic, kafka_partition, kafka_offset, key, outbox_id, created_at, "
            "broker_ms) FROM STDIN"
        )
        with self.conn.transaction(), self.conn.cursor() as cur, cur.copy(statement) as copy:
            for row in rows:
                copy.write_row(row)

    def report(
        self,
        topics: tuple[str, ...],
        *,
        ledger: str,
        dead_letters: int,
        held: int,
        consumed: _Consumed,
        ordered: OrderedStrategy | None,
        since: dt.datetime | None,
        id_from: int | None,
        from_offsets: bool,
        elapsed_s: float,
    ) -> VerifyReport:
        # Records the ledger's range says nothing about (it is only a range with a table ledger).
        in_range = sql.SQL(
            "(%(since)s::timestamptz IS NULL OR c.created_at IS NULL OR c.created_at >= %(since)s::timestamptz) "
            "AND (%(id_from)s::bigint IS NULL OR c.outbox_id IS NULL OR c.outbox_id >= %(id_from)s::bigint)"
        )
        params: dict[str, Any] = {"since": since, "id_from": id_from, "examples": EXAMPLES}
        with self._transaction():
            self.conn.execute(self._sql("ANALYZE {consumed}"))

        ledger_messages = self._scalar("SELECT count(*) FROM {ledger}", params)
        ignored = self._scalar("SELECT count(*) FROM {consumed} c WHERE NOT ({in_range})", params, in_range=in_range)

        lost = self._scalar(
            "SELECT count(*) FROM {ledger} l WHERE NOT EXISTS (SELECT 1 FROM {consumed} c "
            "WHERE c.message_id = l.message_id)",
            params,
        )
        lost_examples = tuple(
            MessageRef(message_id=str(r[0]), outbox_id=r[1], topic=r[2], key=r[3])
            for r in (
                self._rows(
                    """
                    SELECT l.message_id, l.outbox_id, l.topic, l.key FROM {ledger} l
                    WHERE NOT EXISTS (SELECT 1 FROM {consumed} c WHERE c.message_id = l.message_id)
                    ORDER BY l.outbox_id NULLS LAST, l.message_id LIMIT %(examples)s
                    """,
                    params,
                )
                if lost
                else []
            )
        )

        phantom, phantom_examples = self._phantoms(in_range, params)

        dup = self._rows(
            """
            WITH copies AS (
                SELECT c.message_id, min(c.key) AS key, count(*) - 1 AS extra
                FROM {consumed} c WHERE c.message_id IS NOT NULL AND ({in_range})
                GROUP BY c.message_id HAVING count(*) > 1
            ), per_key AS (
                SELECT key, sum(extra) AS extra FROM copies GROUP BY key ORDER BY sum(extra) DESC, key LIMIT 1
            )
            SELECT (SELECT coalesce(sum(extra), 0) FROM copies), (SELECT count(*) FROM copies),
                   (SELECT key FROM per_key), (SELECT coalesce(sum(extra), 0) FROM per_key)
            """,
            params,
            in_range=in_range,
        )[0]

        order_checked, order_violations, order_example = 0, 0, None
        if ordered is not None:
            order_checked, order_violations, order_example = self._order(ordered, in_range, params)

        lat = self._rows(
            """
            SELECT count(*), percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY ms), max(ms)
            FROM (
                SELECT min(c.broker_ms) - extract(epoch FROM min(c.created_at))::float8 * 1000 AS ms
                FROM {consumed} c
                WHERE c.message_id IS NOT NULL AND c.broker_ms IS NOT NULL AND c.created_at IS NOT NULL
                  AND ({in_range})
                GROUP BY c.message_id
            ) x
            """,
            params,
            in_range=in_range,
        )[0]
        latency = (
            Latency(int(lat[0]), round(lat[1][0], 3), round(lat[1][1], 3), round(lat[1][2], 3), round(lat[2], 3))
            if lat[0]
            else None
        )

        notes: list[str] = []
        if not consumed.complete:
            notes.append(
                "stopped at --max-seconds before every partition was idle: messages still arriving may show as lost"
            )
        if since is not None or id_from is not None:
            notes.append(
                f"ledger restricted to {_range_text(since, id_from)}: records outside it "
                f"(by their created_at / outbox_id headers) are ignored, not phantom"
            )
        if from_offsets:
            notes.append("consumed from given offsets: ledger messages published before them count as lost")
        if ledger == "table" and ledger_messages == 0 and phantom:
            notes.append(
                "the outbox table holds no rows for these topics: in delete mode relayed rows are gone, "
                "give the ledger with --ledger-file"
            )
        if ordered is not None:
            notes.append(
                "order: each message's first copy per key and Kafka partition, against "
                + ("(transaction_id, id)" if ordered == "partitioned" else "outbox id")
                + "; keyless and dead-lettered messages are not checked"
            )
        return VerifyReport(
            topics=topics,
            ledger=ledger,
            ledger_messages=ledger_messages,
            partitions=consumed.partitions,
            consumed_records=consumed.records,
            ignored_records=ignored,
            complete=consumed.complete,
            elapsed_s=round(elapsed_s, 3),
            lost=lost,
            phantom=phantom,
            duplicate_copies=int(dup[0]),
            duplicated_messages=int(dup[1]),
            worst_duplicate_key=dup[2],
            worst_duplicate_key_copies=int(dup[3]),
            dead_letters=dead_letters,
            held=held,
            ordered=ordered,
            order_checked=order_checked,
            order_violations=order_violations,
            order_example=order_example,
            latency=latency,
            lost_examples=lost_examples,
            phantom_examples=phantom_examples,
            notes=tuple(notes),
        )

    def _phantoms(self, in_range: sql.Composable, params: Mapping[str, Any]) -> tuple[int, tuple[MessageRef, ...]]:
        """Records committed nowhere in PostgreSQL: not in the ledger, nor in the outbox table as it is now
        (rows committed after the ledger was taken, rows of other topics), nor among the dead letters. A
        record without a readable message_id header matches nothing. Counted per message."""
        with self._transaction():
            self.conn.execute(
                self._sql(
                    """
                    CREATE TEMP TABLE {phantoms} AS
                    SELECT c.* FROM {consumed} c
                    WHERE ({in_range})
                      AND (c.message_id IS NULL
                           OR NOT EXISTS (SELECT 1 FROM {ledger} l WHERE l.message_id = c.message_id))
                    """,
                    in_range=in_range,
                ),
                params,
            )
            # Usually empty: the outbox table is only scanned when some record is not in the ledger.
            cur = self.conn.execute(self._sql("SELECT 1 FROM {phantoms} LIMIT 1"))
            if cur.fetchone() is not None:
                self.conn.execute(
                    self._sql(
                        """
                        DELETE FROM {phantoms} p
                        WHERE EXISTS (SELECT 1 FROM {messages} m WHERE m.message_id = p.message_id)
                           OR EXISTS (SELECT 1 FROM {dead_letters} d WHERE d.message_id = p.message_id)
                        """
                    )
                )
        count = self._scalar(
            "SELECT count(DISTINCT p.message_id) + count(*) FILTER (WHERE p.message_id IS NULL) FROM {phantoms} p",
            params,
        )
        examples = tuple(
            MessageRef(
                message_id=str(r[0]) if r[0] is not None else None,
                outbox_id=r[5],
                topic=r[1],
                key=r[4],
                partition=r[2],
                offset=r[3],
            )
            for r in (
                self._rows(
                    "SELECT p.message_id, p.topic, p.kafka_partition, p.kafka_offset, p.key, p.outbox_id "
                    "FROM {phantoms} p ORDER BY p.topic, p.kafka_partition, p.kafka_offset LIMIT %(examples)s",
                    params,
                )
                if count
                else []
            )
        )
        return count, examples

    def _order(
        self, ordered: OrderedStrategy, in_range: sql.Composable, params: Mapping[str, Any]
    ) -> tuple[int, int, OrderViolation | None]:
        """Adjacent inversions per (topic, Kafka partition, key) among each message's first copy.

        Same key -> same Kafka partition, so offsets order a key's records. Only ledger messages are
        checked (phantoms have no expected place), and never one that was dead-lettered: its retry is
        published after its successors by design.
        """
        if ordered == "partitioned":
            expected = sql.SQL("l.transaction_id AS r1, coalesce(l.outbox_id, c.outbox_id) AS r2")
            known = sql.SQL("l.transaction_id IS NOT NULL AND coalesce(l.outbox_id, c.outbox_id) IS NOT NULL")
        else:
            expected = sql.SQL("coalesce(c.outbox_id, l.outbox_id) AS r1, 0::bigint AS r2")
            known = sql.SQL("coalesce(c.outbox_id, l.outbox_id) IS NOT NULL")
        rows = self._rows(
            """
            WITH firsts AS (
                SELECT c.topic, c.kafka_partition, c.kafka_offset, c.key, coalesce(c.outbox_id, l.outbox_id) AS id,
                       {expected}
                FROM {consumed} c JOIN {ledger} l ON l.message_id = c.message_id
                WHERE c.key IS NOT NULL AND ({in_range}) AND {known}
                  AND NOT EXISTS (
                      SELECT 1 FROM {consumed} e WHERE e.message_id = c.message_id
                         AND (e.kafka_partition, e.kafka_offset) < (c.kafka_partition, c.kafka_offset))
                  AND NOT EXISTS (SELECT 1 FROM {dead_letters} d WHERE d.message_id = c.message_id)
            ), paired AS (
                SELECT f.*, lag(r1) OVER w AS p1, lag(r2) OVER w AS p2, lag(kafka_offset) OVER w AS prev_offset,
                       lag(id) OVER w AS prev_id
                FROM firsts f
                WINDOW w AS (PARTITION BY topic, kafka_partition, key ORDER BY kafka_offset)
            )
            SELECT count(*) OVER (), count(*) FILTER (WHERE (p1, p2) > (r1, r2)) OVER (),
                   topic, kafka_partition, key, prev_offset, prev_id, kafka_offset, id, (p1, p2) > (r1, r2)
            FROM paired
            ORDER BY ((p1, p2) > (r1, r2)) IS TRUE DESC, topic, kafka_partition, kafka_offset
            LIMIT 1
            """,
            params,
            in_range=in_range,
            expected=expected,
            known=known,
        )
        if not rows:
            return 0, 0, None
        checked, violations, topic, partition, key, prev_offset, prev_id, offset, oid, bad = rows[0]
        example = OrderViolation(topic, partition, key, prev_offset, prev_id, offset, oid) if bad else None
        return int(checked), int(violations), example

    def _rows(self, text: str, params: Mapping[str, Any], **extra: sql.Composable) -> list[tuple[Any, ...]]:
        started = time.monotonic()
        with self._transaction():
            rows = self.conn.execute(self._sql(text, **extra), params).fetchall()
        log.debug("verify: %.2f s for %s", time.monotonic() - started, " ".join(text.split())[:60])
        return rows

    def _scalar(self, text: str, params: Mapping[str, Any], **extra: sql.Composable) -> int:
        return int(self._rows(text, params, **extra)[0][0])


def _ledger_blocks(lines: Iterable[bytes], block_bytes: int = 1 << 20) -> Iterable[bytes]:
    buf = bytearray()
    for line in lines:
        text = line.strip()
        if not text or text.startswith(b"#"):
            continue
        buf += text + b"\n"
        if len(buf) >= block_bytes:
            yield bytes(buf)
            buf.clear()
    if buf:
        yield bytes(buf)


def _range_text(since: dt.datetime | None, id_from: int | None) -> str:
    parts = []
    if since is not None:
        parts.append(f"created_at >= {since.isoformat()}")
    if id_from is not None:
        parts.append(f"outbox id >= {id_from}")
    return " and ".join(parts)
