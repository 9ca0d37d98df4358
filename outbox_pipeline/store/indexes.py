"""The message table's indexes, one set per relay strategy, because every index costs each writer's transaction and an
outbox runs one strategy at a time. See docs/operations.md#indexes-only-what-the-strategy-reads."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..config import OutboxTable
from ..errors import OutboxError, SchemaError
from ..model import RECORDED_NAMES

ROW_STRATEGIES = ("locking", "advisory", "lease")
DROP_LOCK_TIMEOUT = "5s"  # how long dropping an index may queue writers and relays behind it


@dataclass(frozen=True)
class Index:
    name: str
    definition: str  # columns and predicate, after ON table
    readers: tuple[str, ...]  # the strategies that read by it


INDEXES = (
    # Unsent rows, highest priority first, then oldest; partial, so rows kept after sending (mark-sent) cost nothing.
    Index("outbox_messages_pending", "(priority DESC, id) WHERE sent_at IS NULL", ROW_STRATEGIES),
    # The oldest unsent rows regardless of priority: the anti-starvation share of each claim.
    Index("outbox_messages_pending_oldest", "(id) WHERE sent_at IS NULL", ROW_STRATEGIES),
    # Virtual partitions (seed variant 3): read past a (transaction_id, id) position.
    Index("outbox_messages_position", "(topic, partition, transaction_id, id)", ("partitioned",)),
    # Serialized writers (seed variant 4): read past an id position.
    Index("outbox_messages_serial", "(topic, partition, id)", ("serialized",)),
)


def indexes_for(strategies: Iterable[str]) -> tuple[Index, ...]:
    wanted = set(strategies)
    if unknown := wanted - set(RECORDED_NAMES):
        raise OutboxError(f"unknown strategy {', '.join(sorted(unknown))}: choose from {', '.join(RECORDED_NAMES)}")
    return tuple(index for index in INDEXES if wanted & set(index.readers))


@dataclass(frozen=True)
class IndexState:
    name: str
    exists: bool
    valid: bool  # a parent index is valid once every partition's index is attached


def states(conn: psycopg.Connection, table: OutboxTable) -> dict[str, IndexState]:
    """The strategy indexes of the message table as the catalog has them."""
    rows = conn.execute(
        """
        SELECT c.relname, i.indisvalid
        FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE i.indrelid = to_regclass(%s) AND c.relname = ANY(%s)
        """,
        (table.messages.as_string(conn), [index.name for index in INDEXES]),
    ).fetchall()
    found = {name: valid for name, valid in rows}
    return {i.name: IndexState(i.name, i.name in found, bool(found.get(i.name))) for i in INDEXES}


def command_for(table: OutboxTable, strategy: str) -> str:
    schema = "" if table.schema == OutboxTable().schema else f" --schema {table.schema}"
    return f"outbox indexes --strategy {strategy}{schema}"


def require_indexes(conn: psycopg.Connection, table: OutboxTable, strategy: str) -> None:
    """Fail with the command that builds them when ``strategy``'s indexes are missing or still building: without
    them every claim reads the whole table."""
    found = states(conn, table)
    lacking = [i.name for i in indexes_for([strategy]) if not found[i.name].valid]
    if lacking:
        building = [name for name in lacking if found[name].exists]
        state = f" ({', '.join(building)} not finished building)" if building else ""
        raise SchemaError(
            f"the {strategy} strategy reads the outbox {table.schema!r} by {', '.join(lacking)}, which it lacks"
            f"{state}: build it without blocking writers with `{command_for(table, strategy)}`"
        )


def drop_except(conn: psycopg.Connection, table: OutboxTable, strategies: Sequence[str]) -> list[str]:
    """Drop the strategy indexes none of ``strategies`` reads; their names. A relay of another strategy
    then refuses to start until they are built again."""
    keep = {index.name for index in indexes_for(strategies)}
    found = states(conn, table)
    dropped = [i.name for i in INDEXES if i.name not in keep and found[i.name].exists]
    try:
        with conn.transaction():
            # DROP INDEX takes the table's ACCESS EXCLUSIVE lock (no concurrent drop on a partitioned table): waiting
            # for it behind an open transaction queues every writer and relay behind it, so it waits a bounded time.
            conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(DROP_LOCK_TIMEOUT)))
            for name in dropped:
                conn.execute(sql.SQL("DROP INDEX IF EXISTS {}").format(table.ident(name)))
    except psycopg.errors.LockNotAvailable:
        raise OutboxError(
            f"dropping the other strategies' indexes did not get its lock on the outbox within {DROP_LOCK_TIMEOUT}: "
            "a transaction holds the message table (a relay's claim, a writer's transaction left open: `outbox "
            "status` names a long one); nothing was dropped, run it again"
        ) from None
    return dropped


def build(conn: psycopg.Connection, table: OutboxTable, index: Index) -> list[str]:
    """Build ``index`` without blocking writers (see the module docstring); the partitions it built it on.

    ``conn`` must be in autocommit: CREATE INDEX CONCURRENTLY cannot run in a transaction block."""
    if not conn.autocommit:
        raise OutboxError("building an index concurrently needs an autocommit connection")
    parent = table.ident(index.name)
    definition = sql.SQL(index.definition)
    conn.execute(
        # CREATE INDEX takes a bare name: an index lives in its table's schema.
        sql.SQL("CREATE INDEX IF NOT EXISTS {name} ON ONLY {messages} {definition}").format(
            name=sql.Identifier(index.name), messages=table.messages, definition=definition
        )
    )
    built: list[str] = []
    for partition, attached, child, child_valid in _partitions(conn, table, index):
        if attached:
            continue
        child_name = f"{partition}_{index.name.removeprefix('outbox_messages_')}"
        if child is not None and not child_valid:  # an interrupted concurrent build leaves an invalid index
            conn.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(table.ident(child)))
            child = None
        if child is None:
            conn.execute(
                sql.SQL("CREATE INDEX CONCURRENTLY IF NOT EXISTS {child} ON {partition} {definition}").format(
                    child=sql.Identifier(child_name), partition=table.ident(partition), definition=definition
                )
            )
            child = child_name
            built.append(partition)
        conn.execute(
            sql.SQL("ALTER INDEX {parent} ATTACH PARTITION {child}").format(parent=parent, child=table.ident(child))
        )
    return built


def _partitions(conn: psycopg.Connection, table: OutboxTable, index: Index) -> list[tuple[str, bool, str | None, bool]]:
    """Each partition of the message table: its name, whether an index is attached to ``index``'s parent, and a
    partition index named as ``build`` names them (and whether it is valid)."""
    suffix = index.name.removeprefix("outbox_messages_")
    return [
        (partition, bool(attached), child, bool(valid))
        for partition, attached, child, valid in conn.execute(
            """
            SELECT p.relname,
                   EXISTS (SELECT 1 FROM pg_inherits ii JOIN pg_index x ON x.indexrelid = ii.inhrelid
                           WHERE ii.inhparent = parent.oid AND x.indrelid = p.oid),
                   own.relname, own.indisvalid
            FROM pg_inherits h
            JOIN pg_class p ON p.oid = h.inhrelid
            CROSS JOIN (SELECT to_regclass(%(parent)s) AS oid) parent
            LEFT JOIN LATERAL (
                SELECT c.relname, x.indisvalid FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid
                WHERE x.indrelid = p.oid AND c.relname = p.relname || '_' || %(suffix)s
            ) own ON true
            WHERE h.inhparent = to_regclass(%(messages)s)
            ORDER BY p.relname
            """,
            {
                "parent": table.ident(index.name).as_string(conn),
                "messages": table.messages.as_string(conn),
                "suffix": suffix,
            },
        ).fetchall()
    ]
