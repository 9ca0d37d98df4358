"""How far behind the relay is, per topic and virtual partition, in one query, read from PostgreSQL with the strategy's
own condition so lag and relay never disagree. See docs/operations.md#lag-and-the-slo."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import psycopg
from psycopg import sql

from ..config import OutboxTable
from ..errors import OutboxError
from ..model import WAL
from ..strategies import strategy_class
from ..strategies.positions import PositionStrategy, partition_pairs
from .liveness import holders_alive


@dataclass(frozen=True)
class PartitionLag:
    topic: str
    partition: int
    # Rows still to publish; with a cap, at most ``cap`` (a floor, not an exact count).
    pending: int
    oldest_pending_age_s: float | None
    # Position strategies: the stored position ("xid=123 id=456" or "id=456"); None for row strategies.
    position: str | None = None
    # Row strategies: the live leases' workers (strategy lease), comma-separated; position strategies:
    # the partition's.
    leased_by: str | None = None
    # Row strategies: the most attempts of any pending row; position strategies: the partition's head.
    attempts: int = 0
    last_error: str | None = None
    # Backing off after a failure (not leased, not available yet).
    in_backoff: bool = False
    # When the lease or the backoff ends (HH:MM:SS UTC), if one is running.
    until: str | None = None
    # Rows held behind dead letters (quarantine), waiting for an operator to retry or discard them. Released
    # holds' rows are about to be published and count in ``pending`` instead.
    held: int = 0
    # The oldest row a relay can publish now (pending and released holds): ``oldest_pending_age_s`` without the rows
    # held behind dead letters, which wait for an operator whatever the relays do.
    relayable_age_s: float | None = None

    @property
    def lag(self) -> int:
        """Everything not yet in Kafka: pending and held rows."""
        return self.pending + self.held


@dataclass(frozen=True)
class HeldKey:
    """A key held behind a dead letter (quarantine.py)."""

    topic: str
    partition: int
    key: str
    dead_letter_id: int
    rows: int
    released: bool
    oldest_age_s: float | None

    def describe(self) -> str:
        state = "released, publishing" if self.released else "retry or discard the dead letter to release"
        return (
            f"key {self.key!r} of {self.topic}:{self.partition} held behind dead letter {self.dead_letter_id}, "
            f"{self.rows} rows ({state})"
        )


def held_keys(conn: psycopg.Connection, table: OutboxTable) -> list[HeldKey]:
    """Every hold with its held rows, the most rows first."""
    rows = conn.execute(
        sql.SQL(
            """
            SELECT h.topic, h.partition, h.key, h.dead_letter_id, count(x.id), h.released_at IS NOT NULL,
                   extract(epoch FROM now() - min(x.created_at))::float8
            FROM {holds} h LEFT JOIN {held} x ON x.topic = h.topic AND x.key = h.key
            GROUP BY h.topic, h.partition, h.key, h.dead_letter_id, h.released_at
            ORDER BY count(x.id) DESC, h.topic, h.partition, h.key
            """
        ).format(holds=table.holds, held=table.held)
    ).fetchall()
    return [HeldKey(t, int(p), k, int(d), int(n), bool(r), _age(age)) for t, p, k, d, n, r, age in rows]


def _with_held(lags: list[PartitionLag], held: Sequence[HeldKey], only: tuple[str, int] | None) -> list[PartitionLag]:
    """Add held rows to each partition's lag: released ones as pending, the others as held."""
    if not held:
        return lags
    by_partition: dict[tuple[str, int], list[HeldKey]] = defaultdict(list)
    for key in held:
        if only is None or (key.topic, key.partition) == only:
            by_partition[(key.topic, key.partition)].append(key)
    merged: list[PartitionLag] = []
    for lag in lags:
        keys = by_partition.pop((lag.topic, lag.partition), [])
        merged.append(_add_held(lag, keys) if keys else lag)
    for (topic, partition), keys in by_partition.items():
        merged.append(_add_held(PartitionLag(topic, partition, 0, None), keys))
    return sorted(merged, key=lambda lag: (lag.topic, lag.partition))


def _add_held(lag: PartitionLag, keys: Sequence[HeldKey]) -> PartitionLag:
    ages = [a for a in (lag.oldest_pending_age_s, *(k.oldest_age_s for k in keys)) if a is not None]
    relayable = [a for a in (lag.relayable_age_s, *(k.oldest_age_s for k in keys if k.released)) if a is not None]
    return replace(
        lag,
        pending=lag.pending + sum(k.rows for k in keys if k.released),
        held=lag.held + sum(k.rows for k in keys if not k.released),
        oldest_pending_age_s=max(ages) if ages else None,
        relayable_age_s=max(relayable) if relayable else None,
    )


# Row strategies. Per pair, the pending rows oldest first (the (topic, partition, id) index), at most
# %(cap)s of them (LIMIT NULL means all): with a cap a huge backlog costs ``cap`` rows per partition,
# and attempts, errors and leases are then those of the oldest ``cap`` rows.
_ROW_LAG = """
    WITH RECURSIVE {pairs}
    SELECT p.topic, p.partition, w.pending, w.age, NULL::text,
           w.leased_by, w.attempts, w.last_error, w.in_backoff,
           to_char(w.until AT TIME ZONE 'UTC', 'HH24:MI:SS')
    FROM pairs p
    CROSS JOIN LATERAL (
        SELECT count(*) AS pending,
               extract(epoch FROM now() - min(r.created_at))::float8 AS age,
               string_agg(DISTINCT r.leased_by, ',') AS leased_by,
               coalesce(max(r.attempts), 0) AS attempts,
               (array_agg(r.last_error ORDER BY r.attempts DESC, r.id)
                   FILTER (WHERE r.last_error IS NOT NULL))[1] AS last_error,
               coalesce(bool_or(r.locked_by IS NULL AND r.attempts > 0 AND r.available_after > now()), false)
                   AS in_backoff,
               max(greatest(r.lease_until, nullif(greatest(r.available_after, now()), now()))) AS until
        FROM (
            SELECT m.id, m.created_at, m.locked_by, m.available_after, m.attempts, m.last_error,
                   (SELECT l.locked_by FROM {leases} l WHERE l.id = m.id AND l.expires_at > now()) AS leased_by,
                   (SELECT l.expires_at FROM {leases} l WHERE l.id = m.id AND l.expires_at > now()) AS lease_until
            FROM {messages} m
            WHERE m.topic = p.topic AND m.partition = p.partition AND m.sent_at IS NULL
            ORDER BY m.id
            LIMIT %(cap)s
        ) r
    ) w
    WHERE w.pending > 0 {only_p}
    ORDER BY p.topic, p.partition
"""

# Position strategies. One row per offsets row, plus pairs that have rows but no offsets row yet (the
# relay creates it on discovery; until then the position is the start). Pending rows are those the
# strategy's ``work_condition`` (aliases m and o) would still read, at most %(cap)s per partition.
_POSITION_LAG = """
    WITH RECURSIVE {pairs},
    positions AS (
        SELECT topic, partition, last_processed_transaction_id, last_processed_id,
               locked_by, available_after, attempts, last_error
        FROM {offsets}
        UNION ALL
        SELECT p.topic, p.partition, '0'::xid8, 0::bigint, NULL::text, now(), 0, NULL::text
        FROM pairs p
        WHERE NOT EXISTS (SELECT 1 FROM {offsets} x WHERE x.topic = p.topic AND x.partition = p.partition)
    )
    SELECT o.topic, o.partition, w.pending, w.age,
           o.last_processed_transaction_id::text AS xid_text, o.last_processed_id,
           CASE WHEN o.available_after > now() THEN o.locked_by END,
           o.attempts, o.last_error,
           (o.locked_by IS NULL AND o.available_after > now()),
           CASE WHEN o.available_after > now() THEN to_char(o.available_after AT TIME ZONE 'UTC', 'HH24:MI:SS') END
    FROM positions o
    CROSS JOIN LATERAL (
        SELECT count(*) AS pending, extract(epoch FROM now() - min(r.created_at))::float8 AS age
        FROM (
            SELECT m.created_at FROM {messages} m
            WHERE m.topic = o.topic AND m.partition = o.partition AND {work}
            LIMIT %(cap)s
        ) r
    ) w
    WHERE true {only_o}
    ORDER BY o.topic, o.partition
"""


def partition_lag(
    conn: psycopg.Connection,
    table: OutboxTable,
    strategy: str,
    *,
    cap: int | None = None,
    only: tuple[str, int] | None = None,
) -> list[PartitionLag]:
    """Per-partition lag as ``strategy`` sees it, in one query.

    Row strategies list partitions with unsent rows. Position strategies list every offsets row (and
    every partition without one yet), pending or not. For ``partitioned`` pending counts only rows
    the snapshot rule lets the relay read now (``transaction_id < pg_snapshot_xmin``): rows of a
    transaction still running, or behind one, are not counted until it ends.
    """
    if cap is not None and cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    if strategy == WAL:
        raise OutboxError("a wal outbox keeps no rows per partition: its lag is its slot's (observe/wal_lag.py)")
    cls = strategy_class(strategy)
    params: dict[str, object] = {"cap": cap}
    if only is not None:
        params.update(only_topic=only[0], only_partition=only[1])
    if issubclass(cls, PositionStrategy):
        lags = _position_lag(conn, table, cls, only, params)
    else:
        lags = _row_lag(conn, table, only, params)
    return _with_held(lags, held_keys(conn, table) if _has_holds(conn, table) else [], only)


def _only(alias: str, only: tuple[str, int] | None) -> sql.Composable:
    """The condition to one partition (none: every one), on the pair before the lateral count, so the other
    partitions cost an index probe."""
    if only is None:
        return sql.SQL("")
    a = sql.Identifier(alias)
    return sql.SQL("AND {a}.topic = %(only_topic)s AND {a}.partition = %(only_partition)s").format(a=a)


def _row_lag(
    conn: psycopg.Connection, table: OutboxTable, only: tuple[str, int] | None, params: dict[str, object]
) -> list[PartitionLag]:
    """A row strategy's lag: its partitions with unsent rows (no position: it keeps none)."""
    query = sql.SQL(_ROW_LAG).format(
        pairs=partition_pairs(table), messages=table.messages, leases=table.leases, only_p=_only("p", only)
    )
    rows = conn.execute(query, params).fetchall()
    return [
        PartitionLag(
            topic,
            part,
            int(n),
            _age(age),
            None,
            leased,
            int(attempts),
            error,
            bool(backoff),
            until,
            relayable_age_s=_age(age),
        )
        for topic, part, n, age, _, leased, attempts, error, backoff, until in rows
    ]


def _position_lag(
    conn: psycopg.Connection,
    table: OutboxTable,
    cls: type[PositionStrategy],
    only: tuple[str, int] | None,
    params: dict[str, object],
) -> list[PartitionLag]:
    """A position strategy's lag: every partition, pending or not, with its position as the strategy reads it."""
    with_xid = "last_processed_transaction_id" in cls.work_condition
    query = sql.SQL(_POSITION_LAG).format(
        pairs=partition_pairs(table),
        offsets=table.offsets,
        messages=table.messages,
        work=sql.SQL(cls.work_condition),
        only_o=_only("o", only),
    )
    rows = conn.execute(query, params).fetchall()
    return [
        PartitionLag(
            topic,
            part,
            int(n),
            _age(age),
            f"xid={xid} id={last_id}" if with_xid else f"id={last_id}",
            leased,
            int(attempts),
            error,
            bool(backoff),
            until,
            relayable_age_s=_age(age),
        )
        for topic, part, n, age, xid, last_id, leased, attempts, error, backoff, until in rows
    ]


def _has_holds(conn: psycopg.Connection, table: OutboxTable) -> bool:
    row = conn.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(table.holds)).fetchone()
    return bool(row and row[0])


def _age(seconds: float | None) -> float | None:
    """A row's age; never negative (a row committed by a transaction that began a moment after this
    statement's ``now()`` is visible to it, and reads as a few milliseconds from the future)."""
    return None if seconds is None else max(0.0, seconds)


def holders(lags: Sequence[PartitionLag]) -> set[str]:
    return {h for lag in lags for h in (lag.leased_by or "").split(",") if h}


def describe_holders(leased_by: str, alive: Mapping[str, bool | None]) -> str:
    """``host-1 (alive), host-2 (dead)``: each holder with what its session says (see liveness)."""
    state = {True: "alive", False: "dead", None: "liveness unknown"}
    return ", ".join(f"{h} ({state[alive.get(h)]})" for h in leased_by.split(",") if h)


def pending_in_scope(
    conn: psycopg.Connection, table: OutboxTable, strategy: str, scope: Collection[tuple[str, int]] | None = None
) -> bool:
    """Whether any row is still pending in ``scope`` (None: everywhere), leased by others or backing off included."""
    lags = partition_lag(conn, table, strategy, cap=1)
    return any(lag.pending and (scope is None or (lag.topic, lag.partition) in scope) for lag in lags)


def explain_pending(
    conn: psycopg.Connection,
    table: OutboxTable,
    strategy: str,
    scope: Collection[tuple[str, int]] | None = None,
) -> list[str]:
    """One line per reason rows are still pending, for an operator: what ``--until-empty`` prints when it
    stops early, e.g. "659 rows pending in serialized t-a:2, t-b:1, leased by host-123 (alive) until 12:00:03"."""
    lags = [
        lag
        for lag in partition_lag(conn, table, strategy)
        if lag.pending and (scope is None or (lag.topic, lag.partition) in scope)
    ]
    held = [
        key.describe()
        for key in held_keys(conn, table)
        if not key.released and key.rows and (scope is None or (key.topic, key.partition) in scope)
    ]
    alive = holders_alive(conn, table, holders(lags))
    groups: dict[str, list[PartitionLag]] = defaultdict(list)
    for lag in lags:
        until = f" until {lag.until} UTC" if lag.until else ""
        if lag.leased_by:
            reason = f"leased by {describe_holders(lag.leased_by, alive)}{until}"
        elif lag.in_backoff:
            reason = f"backing off{until} after: {(lag.last_error or '-').splitlines()[0][:120]}"
        else:
            reason = "claimable (a worker will take them)"
        groups[reason].append(lag)
    return [
        f"{sum(lag.pending for lag in group)} rows pending in {strategy} "
        f"{', '.join(f'{lag.topic}:{lag.partition}' for lag in group)}, {reason}"
        for reason, group in groups.items()
    ] + held


def pending_by_partition(conn: psycopg.Connection, table: OutboxTable) -> list[PartitionLag]:
    """Unsent rows per partition for the row-claiming strategies (sent rows are deleted or marked)."""
    return partition_lag(conn, table, "locking")


@dataclass(frozen=True)
class DeadLetterBacklog:
    """Dead letters not yet retried: what the dead-letter alert reports.

    ``newest_at`` tells a new incident from the one already announced (a dead letter re-dead-lettered
    after a retry gets a new ``dead_lettered_at`` too).
    """

    open: int
    newest_at: str | None  # ISO-8601 UTC
    # (topic, partition, dead letters, last error) of the partitions with the most, at most 5
    worst: tuple[tuple[str, int, int, str], ...] = ()


def dead_letter_backlog(conn: psycopg.Connection, table: OutboxTable) -> DeadLetterBacklog:
    row = conn.execute(
        sql.SQL(
            """
            SELECT count(*), to_char(max(dead_lettered_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
            FROM {dead_letters} WHERE retried_at IS NULL AND discarded_at IS NULL
            """
        ).format(dead_letters=table.dead_letters)
    ).fetchone()
    count, newest = (row[0], row[1]) if row else (0, None)
    if not count:
        return DeadLetterBacklog(0, None)
    worst = conn.execute(
        sql.SQL(
            """
            SELECT topic, partition, count(*), (array_agg(last_error ORDER BY dead_lettered_at DESC))[1]
            FROM {dead_letters} WHERE retried_at IS NULL AND discarded_at IS NULL
            GROUP BY topic, partition ORDER BY count(*) DESC, topic, partition LIMIT 5
            """
        ).format(dead_letters=table.dead_letters)
    ).fetchall()
    return DeadLetterBacklog(int(count), newest, tuple((t, int(p), int(n), str(e)) for t, p, n, e in worst))
