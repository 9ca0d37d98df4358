"""Creating and checking the outbox schema (idempotent, safe to run concurrently), its daily range partitions and each
topic's virtual partition count. See docs/operations.md#upgrading-the-schema."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator, Sequence

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

from ..config import OutboxTable
from ..errors import OutboxError, SchemaError
from ..model import WAL
from ..server import require_supported
from . import strategy_record
from .indexes import build, drop_except, indexes_for
from .migrations import DEFAULT_DAYS_AHEAD, LATEST_VERSION, MIGRATION_LOCK_CLASS, MIGRATIONS, Migration
from .wal import grants as wal_grants
from .wal import objects as wal_objects
from .wal import refusals as wal_refusals


def init_db(
    conn: psycopg.Connection,
    table: OutboxTable,
    *,
    days_ahead: int = DEFAULT_DAYS_AHEAD,
    today: dt.date | None = None,
    strategies: Sequence[str] | None = None,
) -> list[Migration]:
    """Apply missing migrations and create partitions ahead; returns the migrations it applied.

    ``strategies``: the relay strategies the outbox serves (indexes.py). A new outbox gets only their indexes; an
    existing one gets those it lacks, built without blocking writers, and keeps the others (dropping is
    ``indexes.drop_except``'s, on purpose). None: a new outbox gets every strategy's indexes. One strategy is also
    recorded as the outbox's (strategy_record.py): refused if another one is."""
    indexes_for(strategies or ())  # an unknown name fails before anything is created
    if strategies and WAL in strategies and len(strategies) > 1:
        raise OutboxError(f"the wal strategy serves an outbox alone, not with {', '.join(strategies)}: name only wal")
    require_supported(conn)
    with _tuple_rows(conn):
        return _init_db(conn, table, days_ahead=days_ahead, today=today, strategies=strategies)


@contextlib.contextmanager
def _tuple_rows(conn: psycopg.Connection) -> Iterator[None]:
    """The caller's connection returns tuples meanwhile, whatever its row_factory (dict_row rows have no [0])."""
    caller = conn.row_factory
    conn.row_factory = tuple_row
    try:
        yield
    finally:
        conn.row_factory = caller


def _init_db(
    conn: psycopg.Connection,
    table: OutboxTable,
    *,
    days_ahead: int,
    today: dt.date | None,
    strategies: Sequence[str] | None,
) -> list[Migration]:
    new = current_version(conn, table) == 0
    if strategies is not None and list(strategies) == [WAL]:
        strategy_record.refuse_claim(conn, table, WAL)  # a table outbox: refused before the slot is made
        wal_objects.slot_here(conn, table)  # refuses before anything is made: a refusal leaves nothing behind
        wal_grants.require_emit_right(conn)
    _create_migrations_table(conn, table)
    applied = [migration for migration in MIGRATIONS if _apply(conn, table, migration)]
    if strategies is not None and list(strategies) == [WAL]:
        _make_wal_outbox(conn, table)
    elif strategies is not None and len(strategies) == 1:
        strategy_record.claim(conn, table, strategies[0], by=strategy_record.BY_INIT_DB)
    ensure_partitions(conn, table, days_ahead=days_ahead, today=today)
    if strategies is not None and new:
        drop_except(conn, table, strategies)
    elif strategies is not None:
        for index in indexes_for(strategies):
            build(conn, table, index)
    return applied


def _create_migrations_table(conn: psycopg.Connection, table: OutboxTable) -> None:
    """The schema and its record of applied migrations, made under the migrations lock."""
    with conn.transaction():
        _lock_migrations(conn, table)
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(table.schema_ident))
        conn.execute(
            sql.SQL(
                """
                CREATE TABLE IF NOT EXISTS {migrations} (
                    version    integer     PRIMARY KEY,
                    name       text        NOT NULL,
                    applied_at timestamptz NOT NULL DEFAULT now()
                )
                """
            ).format(migrations=table.migrations)
        )


def _apply(conn: psycopg.Connection, table: OutboxTable, migration: Migration) -> bool:
    """``migration`` in a transaction of its own, recorded with it, unless it was applied already; whether it was
    applied now."""
    with conn.transaction():
        _lock_migrations(conn, table)
        if migration.version <= current_version(conn, table):
            return False
        # DDL on a live table queues every writer behind it while it waits for its lock: it waits a bounded time.
        conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(MIGRATION_LOCK_TIMEOUT)))
        try:
            migration.apply(conn, table)
        except psycopg.errors.LockNotAvailable:
            raise SchemaError(
                f"migration {migration.version} ({migration.name}) did not get its lock on the outbox within "
                f"{MIGRATION_LOCK_TIMEOUT}: a long transaction holds it (outbox status names it); nothing of "
                "it was applied, run `outbox init-db` again"
            ) from None
        conn.execute(
            sql.SQL("INSERT INTO {} (version, name) VALUES (%s, %s)").format(table.migrations),
            (migration.version, migration.name),
        )
        return True


def _make_wal_outbox(conn: psycopg.Connection, table: OutboxTable) -> None:
    """The outbox recorded as wal and its table refusing rows, then its slot, then the functions that emit to it."""
    with conn.transaction():  # an outbox of another strategy is refused before its table would refuse rows
        strategy_record.claim(conn, table, WAL, by=strategy_record.BY_INIT_DB)
        wal_refusals.refuse_rows(conn, table)  # from here on a row is refused, not stored where nobody reads it
    # The slot first: a message emitted before it exists would be decoded by nobody.
    wal_objects.ensure_slot(conn, table)
    with conn.transaction():
        wal_objects.install_functions(conn, table)
        strategy_record.claim(conn, table, WAL, by=strategy_record.BY_INIT_DB)


#: How long a migration waits for a lock on the live table before it gives up (writers queue behind it meanwhile).
MIGRATION_LOCK_TIMEOUT = "10s"


def _lock_migrations(conn: psycopg.Connection, table: OutboxTable) -> None:
    conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (MIGRATION_LOCK_CLASS, table.schema))


def current_version(conn: psycopg.Connection, table: OutboxTable) -> int:
    """The latest applied migration, 0 when the schema has none."""
    exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table.migrations.as_string(conn),)).fetchone()
    if not exists or not exists[0]:
        return 0
    row = conn.execute(sql.SQL("SELECT coalesce(max(version), 0) FROM {}").format(table.migrations)).fetchone()
    return int(row[0]) if row else 0


def require_current(conn: psycopg.Connection, table: OutboxTable) -> None:
    """Fail with a clear message when the server is too old, or the outbox schema is missing or behind this code."""
    require_supported(conn)
    version = current_version(conn, table)
    if version < LATEST_VERSION:
        raise SchemaError(
            f"outbox schema {table.schema!r} is at version {version}, this code needs {LATEST_VERSION}: "
            "run `outbox init-db`"
        )
    if version > LATEST_VERSION:
        # A relay of an older release would relay rows it cannot read right (before migration 11, a bytes payload
        # went out as a null value: a tombstone) and ack them.
        raise SchemaError(
            f"outbox schema {table.schema!r} is at version {version}, newer than this code knows ({LATEST_VERSION}): "
            "run the release that migrated it (docs/operations.md, Upgrading the schema)"
        )


# Storage of each daily partition. Free space per page lets a retry (attempts, last_error,
# available_after: no index covers them) be a HOT update that touches no index. Vacuum and analyze early: rows leave
# the "unsent" indexes in bulk, and dead entries at their head slow every claim until vacuumed; a
# fresh partition's statistics are stale within minutes.
PARTITION_STORAGE = (
    "fillfactor = 80, autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_insert_scale_factor = 0.01, "
    "autovacuum_analyze_scale_factor = 0.01, autovacuum_vacuum_cost_delay = 0"
)


DEFAULT_PARTITION = "outbox_messages_default"


def partition_name(day: dt.date) -> str:
    return f"outbox_messages_p{day:%Y%m%d}"


def ensure_partitions(
    conn: psycopg.Connection,
    table: OutboxTable,
    *,
    days_ahead: int = DEFAULT_DAYS_AHEAD,
    today: dt.date | None = None,
    lock_timeout: str = "5s",
) -> list[str]:
    """Create the daily partitions from yesterday to ``days_ahead`` days ahead (UTC); returns new names.

    A lock timeout keeps partition creation from queueing every writer behind it when a long reader
    holds the parent table: better to fail maintenance and retry than to stall the application.
    """
    today = today or dt.datetime.now(dt.UTC).date()
    created: list[str] = []
    for offset in range(-1, days_ahead + 1):
        day = today + dt.timedelta(days=offset)
        name = partition_name(day)
        with conn.transaction():
            conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(lock_timeout)))
            # Concurrent creators (two init-db runs, maintenance) would race on the catalog.
            _lock_migrations(conn, table)
            exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table.ident(name).as_string(conn),))
            row = exists.fetchone()
            if row and row[0]:
                continue
            start = dt.datetime.combine(day, dt.time(), dt.UTC)
            end = start + dt.timedelta(days=1)
            if _default_holds(conn, table, start, end):
                # Rows of the day landed in DEFAULT while it had no partition (maintenance did not run for longer
                # than days_ahead): the day's partition is made with them, as maintenance moves them. A plain
                # CREATE would fail on them at every init-db and maintenance run.
                move_into_own_partition(conn, table, day)
                created.append(name)
                continue
            try:
                conn.execute(
                    sql.SQL(
                        "CREATE TABLE {part} PARTITION OF {messages} FOR VALUES FROM ({start}) TO ({end}) "
                        "WITH ({storage})"
                    ).format(
                        storage=sql.SQL(PARTITION_STORAGE),
                        part=table.ident(name),
                        messages=table.messages,
                        start=sql.Literal(start),
                        end=sql.Literal(end),
                    )
                )
            except psycopg.errors.CheckViolation as exc:  # a writer committed one since _default_holds looked
                raise SchemaError(
                    f"cannot create partition {name}: a row for {day} was just written to the DEFAULT partition; "
                    "run it again"
                ) from exc
            created.append(name)
    return created


def _default_holds(conn: psycopg.Connection, table: OutboxTable, start: dt.datetime, end: dt.datetime) -> bool:
    row = conn.execute(
        sql.SQL("SELECT EXISTS (SELECT 1 FROM {} d WHERE d.created_at >= %s AND d.created_at < %s)").format(
            table.ident(DEFAULT_PARTITION)
        ),
        (start, end),
    ).fetchone()
    return bool(row and row[0])


def move_into_own_partition(conn: psycopg.Connection, table: OutboxTable, day: dt.date) -> int:
    """Give ``day`` its own partition with its rows from DEFAULT, in the caller's transaction; returns rows moved.

    Writers wait meanwhile (the parent in SHARE ROW EXCLUSIVE mode: a row committed into DEFAULT between the move
    and the ATTACH made the ATTACH fail, for ever under steady writes). Rows keep every column (id, transaction_id),
    so positions and ids mean what they meant; readers see them in DEFAULT until the commit and in the new
    partition after it, never both or neither.
    """
    start = dt.datetime.combine(day, dt.time(), dt.UTC)
    end = start + dt.timedelta(days=1)
    part = table.ident(partition_name(day))
    _lock_migrations(conn, table)
    conn.execute(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(table.messages))
    conn.execute(
        sql.SQL(
            "CREATE TABLE {part} (LIKE {messages} INCLUDING DEFAULTS INCLUDING CONSTRAINTS) WITH ({storage})"
        ).format(part=part, messages=table.messages, storage=sql.SQL(PARTITION_STORAGE))
    )
    cur = conn.execute(
        sql.SQL(
            """
            WITH rescued AS (
                DELETE FROM {default} d
                WHERE d.created_at >= %(start)s AND d.created_at < %(end)s
                RETURNING d.*
            )
            INSERT INTO {part} SELECT * FROM rescued
            """
        ).format(default=table.ident(DEFAULT_PARTITION), part=part),
        {"start": start, "end": end},
    )
    conn.execute(
        sql.SQL("ALTER TABLE {messages} ATTACH PARTITION {part} FOR VALUES FROM ({start}) TO ({end})").format(
            messages=table.messages, part=part, start=sql.Literal(start), end=sql.Literal(end)
        )
    )
    return cur.rowcount


def set_topic_partitions(
    conn: psycopg.Connection, table: OutboxTable, topic: str, partitions: int, *, lock_timeout: str = "10s"
) -> None:
    """Set how many virtual partitions a topic's keys hash into (``*`` sets the default).

    Refused (``OutboxError``) while the topic has pending rows: they would keep partitions routed with the
    old count, and a key would live in two partitions relayed independently. Drain first. The check waits
    for writer transactions in flight, up to ``lock_timeout``.
    """
    fresh = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    try:
        with conn.transaction():
            if fresh:  # the guard refuses a change in a transaction with its own snapshot (routing.py)
                conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(lock_timeout)))
            conn.execute(
                sql.SQL(
                    """
                    INSERT INTO {topics} (topic, partitions) VALUES (%s, %s)
                    ON CONFLICT (topic) DO UPDATE SET partitions = excluded.partitions, updated_at = now()
                    """
                ).format(topics=table.topics),
                (topic, partitions),
            )
    except psycopg.errors.ObjectNotInPrerequisiteState as exc:
        hint = f" ({exc.diag.message_hint})" if exc.diag.message_hint else ""
        raise OutboxError(f"{exc.diag.message_primary}{hint}") from None
    except psycopg.errors.LockNotAvailable:
        raise OutboxError(
            f"cannot change the partition count of topic {topic!r} now: writer transactions on the outbox did "
            f"not end within {lock_timeout} (one left open?); try again"
        ) from None
