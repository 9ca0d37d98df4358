"""Who holds the xmin horizon back, named for an operator, because one forgotten transaction anywhere in the cluster
stops every `partitioned` partition. See docs/operations.md#why-is-orders3-not-moving-outbox-status."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..config import OutboxTable
from ..strategies.positions import partition_pairs

# Running transactions (with an xid) and prepared ones older than the newest held-back transaction. A 32-bit xid
# is placed by its signed 32-bit distance from that transaction (exact whatever the epoch: PostgreSQL keeps every
# live xid within 2^31 of the others), not widened against a snapshot read alongside pg_stat_activity, which put a
# transaction that got its xid between the two reads into the previous epoch, first in line as the blocker. The
# sessions' SQL text stays in the database unless an operator asks for it (``{query}``): it may hold a password.
_HOLDERS = """
    WITH running AS (
        SELECT 'session' AS kind, a.pid, a.datname::text AS database, a.usename::text AS usename,
               a.application_name, host(a.client_addr) AS client_addr, a.state,
               extract(epoch FROM now() - a.xact_start)::float8 AS age_s, {query} AS query,
               NULL::text AS gid, a.backend_xid::text::numeric AS xid32
        FROM pg_stat_activity a
        WHERE a.backend_xid IS NOT NULL AND a.pid <> pg_backend_pid()
        UNION ALL
        SELECT 'prepared', NULL, p.database::text, p.owner::text, NULL, NULL, 'prepared',
               extract(epoch FROM now() - p.prepared)::float8, NULL, p.gid, p.transaction::text::numeric
        FROM pg_prepared_xacts p
    ), placed AS (
        SELECT r.*, mod(r.xid32 - mod(%(newest_held)s::numeric, 4294967296) + 6442450944, 4294967296)
                    - 2147483648 AS delta
        FROM running r
    )
    SELECT kind, pid, database, usename, application_name, client_addr, state, age_s, query, gid,
           (%(newest_held)s::numeric + delta)::text
    FROM placed
    WHERE delta < 0
    ORDER BY delta
    LIMIT %(limit)s
"""

# Rows past their partition's position that the snapshot rule keeps from the relay now, per partition (at
# most %(cap)s each), and the newest such transaction id: every transaction older than it holds some back.
_HELD_BACK = """
    WITH RECURSIVE {pairs},
    positions AS (
        SELECT topic, partition, last_processed_transaction_id, last_processed_id FROM {offsets}
        UNION ALL
        SELECT p.topic, p.partition, '0'::xid8, 0::bigint FROM pairs p
        WHERE NOT EXISTS (SELECT 1 FROM {offsets} x WHERE x.topic = p.topic AND x.partition = p.partition)
    )
    SELECT o.topic, o.partition, count(*), max(h.transaction_id::text::numeric),
           extract(epoch FROM now() - min(h.created_at))::float8
    FROM positions o
    CROSS JOIN LATERAL (
        SELECT m.transaction_id, m.created_at FROM {messages} m
        WHERE m.topic = o.topic AND m.partition = o.partition
          AND (m.transaction_id, m.id) > (o.last_processed_transaction_id, o.last_processed_id)
          AND m.transaction_id >= pg_snapshot_xmin(pg_current_snapshot())
        LIMIT %(cap)s
    ) h
    GROUP BY o.topic, o.partition
    ORDER BY o.topic, o.partition
"""


@dataclass(frozen=True)
class HorizonHolder:
    """A running or prepared transaction older than rows the relay cannot read yet."""

    kind: str  # "session" or "prepared"
    pid: int | None
    database: str | None
    user: str | None
    application_name: str | None
    client_addr: str | None
    state: str | None
    transaction_age_s: float | None
    query: str | None  # its first 200 characters, only when asked for (find_horizon's show_query)
    gid: str | None  # prepared transactions
    xid: str

    def describe(self) -> str:
        age = f"{self.transaction_age_s:.0f} s" if self.transaction_age_s is not None else "?"
        if self.kind == "prepared":
            return (
                f"prepared transaction {self.gid!r} in database {self.database} by {self.user}, prepared {age} ago "
                f"(COMMIT PREPARED or ROLLBACK PREPARED {self.gid!r})"
            )
        where = f"{self.user}@{self.database}"
        client = f" from {self.client_addr}" if self.client_addr else ""
        app = f" application_name={self.application_name!r}" if self.application_name else ""
        query = f", query: {' '.join(self.query.split())[:200]!r}" if self.query is not None else ""
        return (
            f"pid {self.pid} {where}{client}{app}, {self.state}, transaction open {age}{query} "
            f"(SELECT pg_terminate_backend({self.pid}) ends it)"
        )


@dataclass(frozen=True)
class HeldBack:
    topic: str
    partition: int
    rows: int  # at most the cap
    oldest_age_s: float | None


@dataclass(frozen=True)
class Horizon:
    """What the xmin horizon holds back from ``partitioned`` and who holds it; empty when nothing is held."""

    held_back: tuple[HeldBack, ...]
    holders: tuple[HorizonHolder, ...]

    @property
    def rows(self) -> int:
        return sum(h.rows for h in self.held_back)

    def describe(self) -> list[str]:
        if not self.held_back:
            return []
        partitions = ", ".join(f"{h.topic}:{h.partition}" for h in self.held_back[:10])
        more = f" and {len(self.held_back) - 10} more" if len(self.held_back) > 10 else ""
        head = (
            f"{self.rows} committed rows in {partitions}{more} wait for older transactions still open "
            "(strategy partitioned reads a transaction's rows only once every older one has ended):"
        )
        if not self.holders:
            return [head, "  none is open any more: the relay reads them at its next claim"]
        return [head, *(f"  {holder.describe()}" for holder in self.holders)]


def find_horizon(
    conn: psycopg.Connection, table: OutboxTable, *, cap: int = 10_000, limit: int = 10, show_query: bool = False
) -> Horizon:
    """The rows ``partitioned`` cannot read yet because of older open transactions, and those transactions.

    Runs in its own read-only statements; it assigns no transaction id, so it never holds the horizon itself.
    ``show_query``: include each session's SQL text, for an operator at a terminal who asks (``outbox status
    --show-query``); it never goes to the UI, alerts, metrics or logs.
    """
    rows = conn.execute(
        sql.SQL(_HELD_BACK).format(pairs=partition_pairs(table), offsets=table.offsets, messages=table.messages),
        {"cap": cap},
    ).fetchall()
    if not rows:
        return Horizon((), ())
    held = tuple(HeldBack(t, int(p), int(n), None if age is None else max(0.0, age)) for t, p, n, _, age in rows)
    newest = max(row[3] for row in rows)
    query = sql.SQL(_HOLDERS).format(query=sql.SQL("left(a.query, 200)" if show_query else "NULL::text"))
    holders = conn.execute(query, {"newest_held": newest, "limit": limit}).fetchall()
    return Horizon(held, tuple(HorizonHolder(*row) for row in holders))
