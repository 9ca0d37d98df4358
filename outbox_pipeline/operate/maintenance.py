"""Upkeep of the outbox's daily range partitions: create ahead, rescue DEFAULT rows, and drop a day only once every row
is relayed and its archive matched. See
docs/spark.md#outbox_partition_maintenance-job-outbox_partition_maintenance_job-daily-partitions."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..config import OutboxTable
from ..model import POSITION_STRATEGIES, STRATEGY_NAMES
from ..store.partition_counts import BEHIND_POSITION
from ..store.schema import DEFAULT_PARTITION, ensure_partitions, move_into_own_partition

_DAY_PARTITION = re.compile(r"^outbox_messages_p(\d{8})$")


# What an archive holds: every column, jsonb and xid8 as their text, so a reader needs no PostgreSQL types.
ARCHIVE_COLUMNS: Sequence[tuple[str, str]] = (
    ("id", "m.id"),
    ("message_id", "m.message_id::text"),
    ("topic", "m.topic"),
    ("key", "m.key"),
    ("type", "m.type"),
    ("payload", "m.payload::text"),
    ("payload_bytes", "m.payload_bytes"),
    ("headers", "m.headers::text"),
    ("partition", "m.partition"),
    ("priority", "m.priority::int"),
    ("transaction_id", "m.transaction_id::text"),
    ("created_at", "m.created_at"),
    ("available_after", "m.available_after"),
    ("locked_by", "m.locked_by"),
    ("attempts", "m.attempts"),
    ("last_error", "m.last_error"),
    ("sent_at", "m.sent_at"),
)
# The checksum: the sum over rows of the first 32 bits of md5 of every archive column's text, '|'-joined,
# NULL as \N. Timestamps enter as epoch microseconds and bytes as lowercase hex, the text forms PostgreSQL and Spark
# agree on. The
# archive's reader computes the same from the archived values (assets/spark/datasource.py). Every column counts:
# an archive that lost an error message or a timestamp must not verify.
CHECKSUM_COLUMNS: tuple[str, ...] = tuple(name for name, _ in ARCHIVE_COLUMNS)
TIMESTAMP_COLUMNS = frozenset({"created_at", "available_after", "sent_at"})
BINARY_COLUMNS = frozenset({"payload_bytes"})
NULL_TEXT = "\\N"


def _checksum_text(name: str, expr: str) -> str:
    if name in TIMESTAMP_COLUMNS:
        expr = f"(extract(epoch FROM {expr}) * 1000000)::bigint"
    if name in BINARY_COLUMNS:
        expr = f"encode({expr}, 'hex')"
    return f"coalesce(({expr})::text, '{NULL_TEXT}')"


_CHECKSUM_SQL = (
    "coalesce(sum(('x' || substr(md5(concat_ws('|', "
    + ", ".join(_checksum_text(name, expr) for name, expr in ARCHIVE_COLUMNS)
    + ")), 1, 8))::bit(32)::bigint), 0)::bigint"
)


@dataclass(frozen=True)
class DayPartition:
    name: str
    day: dt.date
    bytes: int


@dataclass(frozen=True)
class Fingerprint:
    rows: int
    checksum: int


@dataclass(frozen=True)
class RelayCheck:
    """Whether every row of a day partition was relayed; ``reasons`` say what is not (empty when all is)."""

    rows: int
    reasons: tuple[str, ...] = ()

    @property
    def relayed(self) -> bool:
        return not self.reasons


@dataclass(frozen=True)
class DropResult:
    name: str
    dropped: bool
    rows: int = 0
    bytes_freed: int = 0
    reason: str | None = None


# -- what exists -----------------------------------------------------------------------------------


def day_partitions(conn: psycopg.Connection, table: OutboxTable) -> list[DayPartition]:
    """The attached daily partitions (named as ``schema.partition_name`` names them), oldest first."""
    rows = conn.execute(
        """
        SELECT c.relname, pg_total_relation_size(c.oid)
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = %(parent)s::regclass
        """,
        {"parent": table.messages.as_string(conn)},
    ).fetchall()
    found = []
    for name, size in rows:
        match = _DAY_PARTITION.match(name)
        if match:
            found.append(DayPartition(name, dt.datetime.strptime(match.group(1), "%Y%m%d").date(), int(size)))
    return sorted(found, key=lambda p: p.day)


def expired(partitions: Sequence[DayPartition], today: dt.date, retention_days: int) -> list[DayPartition]:
    """Partitions whose whole day is older than the retention window.

    At least one day: with 0, today's writers (a transaction that began before midnight, or a clock a
    little behind) land in a day already dropped, and their rows in DEFAULT, to be archived twice.
    """
    if retention_days < 1:
        raise ValueError(f"retention_days must be at least 1, not {retention_days}")
    cutoff = today - dt.timedelta(days=retention_days)
    return [p for p in partitions if p.day < cutoff]


# -- create ahead, rescue DEFAULT rows ------------------------------------------------------------


def create_ahead(
    conn: psycopg.Connection, table: OutboxTable, *, today: dt.date, days_ahead: int, lock_timeout: str = "5s"
) -> list[str]:
    """Partitions from yesterday to ``days_ahead`` days after ``today``; returns the names created."""
    return ensure_partitions(conn, table, days_ahead=days_ahead, today=today, lock_timeout=lock_timeout)


def default_rows_by_day(conn: psycopg.Connection, table: OutboxTable) -> dict[dt.date, int]:
    """Rows that landed in the DEFAULT partition (their day had no partition), per UTC day."""
    rows = conn.execute(
        sql.SQL(
            "SELECT (m.created_at AT TIME ZONE 'UTC')::date AS day, count(*) FROM {default} m GROUP BY 1 ORDER BY 1"
        ).format(default=table.ident(DEFAULT_PARTITION))
    ).fetchall()
    return {day: int(n) for day, n in rows}


@dataclass(frozen=True)
class Rescue:
    """What ``move_default_rows`` did: rows moved per day, and the days it could not move (why)."""

    moved: dict[dt.date, int]
    failed: dict[dt.date, str]


def move_default_rows(conn: psycopg.Connection, table: OutboxTable, *, lock_timeout: str = "5s") -> Rescue:
    """Give each day found in DEFAULT its own partition, with its rows (schema.move_into_own_partition), one
    transaction a day. Writers wait for the few milliseconds that takes. A day that fails (a lock not granted within
    ``lock_timeout``: a long transaction is writing) is reported and left in DEFAULT for the next run; the other days
    go on."""
    moved: dict[dt.date, int] = {}
    failed: dict[dt.date, str] = {}
    for day in default_rows_by_day(conn, table):
        try:
            moved[day] = _move_day(conn, table, day, lock_timeout)
        except (psycopg.errors.LockNotAvailable, psycopg.errors.CheckViolation) as exc:
            failed[day] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
    return Rescue(moved, failed)


def _move_day(conn: psycopg.Connection, table: OutboxTable, day: dt.date, lock_timeout: str) -> int:
    with conn.transaction():
        conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(lock_timeout)))
        return move_into_own_partition(conn, table, day)


# -- relayed? --------------------------------------------------------------------------------------


def check_relayed(conn: psycopg.Connection, table: OutboxTable, name: str, strategy: str) -> RelayCheck:
    """Whether every row of day partition ``name`` was relayed under ``strategy`` (see the module doc)."""
    if strategy not in STRATEGY_NAMES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGY_NAMES)}")
    part = table.ident(name)
    if strategy not in POSITION_STRATEGIES:
        # Strategy lease keeps its row leases in outbox_leases; the row's own columns are the older form.
        row = conn.execute(
            sql.SQL(
                """
                SELECT count(*), count(*) FILTER (WHERE m.sent_at IS NULL),
                       count(*) FILTER (WHERE l.locked_by IS NOT NULL
                                           OR (m.locked_by IS NOT NULL AND m.available_after > now())),
                       string_agg(DISTINCT coalesce(l.locked_by, m.locked_by), ',')
                           FILTER (WHERE l.locked_by IS NOT NULL OR m.available_after > now())
                FROM {part} m
                LEFT JOIN {leases} l ON l.id = m.id AND l.expires_at > now()
                """
            ).format(part=part, leases=table.leases)
        ).fetchone()
        assert row is not None
        total, pending, leased, holders = int(row[0]), int(row[1]), int(row[2]), row[3]
        reasons = []
        if pending:
            reasons.append(f"{pending} of {total} rows not relayed yet (sent_at is null)")
        if leased:
            reasons.append(f"{leased} rows leased by {holders}")
        return RelayCheck(total, tuple(reasons))
    rows = conn.execute(
        sql.SQL(
            """
            SELECT m.topic, m.partition, count(*) AS rows,
                   count(*) FILTER (WHERE o.topic IS NULL OR NOT {behind}) AS pending,
                   bool_or(o.topic IS NOT NULL) AS has_position,
                   max(o.last_processed_transaction_id::text) AS xid, max(o.last_processed_id) AS last_id,
                   max(o.locked_by) FILTER (WHERE o.available_after > now()) AS leased_by
            FROM {part} m
            LEFT JOIN {offsets} o ON o.topic = m.topic AND o.partition = m.partition
            GROUP BY m.topic, m.partition
            ORDER BY m.topic, m.partition
            """
        ).format(part=part, offsets=table.offsets, behind=sql.SQL(BEHIND_POSITION))
    ).fetchall()
    total = 0
    reasons = []
    for topic, partition, count, pending, has_position, xid, last_id, leased_by in rows:
        total += int(count)
        if not pending:
            continue
        where = f"{topic}/{partition}"
        if not has_position:
            reason = f"{where}: {pending} rows never relayed (no position yet)"
        elif pending == count:
            reason = f"{where}: {pending} pending rows (position xid={xid} id={last_id} is before this day)"
        else:
            reason = f"{where}: position xid={xid} id={last_id} is inside this day ({pending} of {count} rows past it)"
        if leased_by:
            reason += f"; leased by {leased_by}"
        reasons.append(reason)
    return RelayCheck(total, tuple(reasons))


# -- archive support -------------------------------------------------------------------------------


def fingerprint(conn: psycopg.Connection, table: OutboxTable, name: str) -> Fingerprint:
    row = conn.execute(
        sql.SQL("SELECT count(*), {checksum} FROM {part} m").format(
            checksum=sql.SQL(_CHECKSUM_SQL), part=table.ident(name)
        )
    ).fetchone()
    assert row is not None
    return Fingerprint(int(row[0]), int(row[1]))


def id_slices(conn: psycopg.Connection, table: OutboxTable, name: str, slices: int) -> list[tuple[int, int]]:
    """Up to ``slices`` inclusive id ranges covering the partition's rows, for parallel archive reads."""
    row = conn.execute(sql.SQL("SELECT min(m.id), max(m.id) FROM {part} m").format(part=table.ident(name))).fetchone()
    if row is None or row[0] is None:
        return []
    low, high = int(row[0]), int(row[1])
    step = max(1, -(-(high - low + 1) // max(1, slices)))
    return [(start, min(high, start + step - 1)) for start in range(low, high + 1, step)]


def fetch_archive_rows(
    conn: psycopg.Connection, table: OutboxTable, name: str, low: int, high: int, *, page_rows: int = 10_000
) -> Iterator[list[tuple[object, ...]]]:
    """ARCHIVE_COLUMNS of the rows with ``low <= id <= high``, by id, a page at a time (autocommit)."""
    query = sql.SQL(
        "SELECT {columns} FROM {part} m WHERE m.id > %(after)s AND m.id <= %(high)s ORDER BY m.id LIMIT %(limit)s"
    ).format(columns=sql.SQL(", ").join(sql.SQL(expr) for _, expr in ARCHIVE_COLUMNS), part=table.ident(name))
    after = low - 1
    while True:
        page = conn.execute(query, {"after": after, "high": high, "limit": page_rows}).fetchall()
        if not page:
            return
        yield page
        if len(page) < page_rows:
            return
        after = int(page[-1][0])


# -- drop ------------------------------------------------------------------------------------------


def drop_partition(
    conn: psycopg.Connection,
    table: OutboxTable,
    name: str,
    *,
    strategy: str,
    archived: Fingerprint,
    lock_timeout: str = "2s",
) -> DropResult:
    """Detach and drop a day partition if, under a lock, it is still fully relayed and matches its archive.

    One transaction: a SHARE lock on the partition waits out every transaction still writing to it and
    keeps new writes out; the offsets rows of its partitions are locked FOR SHARE so no rewind or relay
    moves them meanwhile; then the relayed check and the fingerprint are taken again. DETACH needs an
    ACCESS EXCLUSIVE lock on the parent: ``lock_timeout`` bounds how long writers queue behind it, and a
    timeout (or a deadlock with a writer) skips the partition until the next run.
    """
    part = table.ident(name)
    try:
        with conn.transaction():
            conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(lock_timeout)))
            conn.execute(sql.SQL("LOCK TABLE {part} IN SHARE MODE").format(part=part))
            if strategy in POSITION_STRATEGIES:
                conn.execute(
                    sql.SQL(
                        """
                        SELECT 1 FROM {offsets} o
                        WHERE (o.topic, o.partition) IN (SELECT DISTINCT m.topic, m.partition FROM {part} m)
                        FOR SHARE OF o
                        """
                    ).format(offsets=table.offsets, part=part)
                )
            check = check_relayed(conn, table, name, strategy)
            if not check.relayed:
                return DropResult(name, False, check.rows, reason="; ".join(check.reasons))
            now = fingerprint(conn, table, name)
            if now != archived:
                return DropResult(
                    name,
                    False,
                    now.rows,
                    reason=f"archive does not match the table: archived {archived.rows} rows "
                    f"(checksum {archived.checksum}), table has {now.rows} (checksum {now.checksum})",
                )
            size_row = conn.execute("SELECT pg_total_relation_size(%s::regclass)", (part.as_string(conn),)).fetchone()
            size = int(size_row[0]) if size_row else 0
            conn.execute(
                sql.SQL("ALTER TABLE {messages} DETACH PARTITION {part}").format(messages=table.messages, part=part)
            )
            conn.execute(sql.SQL("DROP TABLE {part}").format(part=part))
            return DropResult(name, True, now.rows, bytes_freed=size)
    except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected) as exc:
        return DropResult(name, False, reason=f"busy, retried next run: {exc.diag.message_primary or exc}")
