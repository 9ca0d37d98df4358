"""`outbox status`: per partition, who owns it, what is pending and held, and in words what blocks it, from the same
reads as `outbox lag`. See docs/operations.md#why-is-orders3-not-moving-outbox-status."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..config import OutboxTable
from .horizon import HeldBack, Horizon, find_horizon
from .lag import PartitionLag, describe_holders, held_keys, holders, partition_lag
from .liveness import holders_alive


@dataclass(frozen=True)
class PartitionStatus:
    topic: str
    partition: int
    owner: str | None  # the worker leasing it now, with its liveness ("host-1 (alive)")
    position: str | None
    pending: int
    held: int
    oldest_age_s: float | None
    backoff_until: str | None  # HH:MM:SS UTC
    attempts: int
    last_error: str | None
    dead_letters: int  # not retried or discarded
    blocked_by: tuple[str, ...]  # empty: moving (or nothing to do)

    @property
    def key(self) -> str:
        return f"{self.topic}:{self.partition}"


def partition_status(
    conn: psycopg.Connection,
    table: OutboxTable,
    strategy: str,
    *,
    cap: int | None = 100_000,
    lags: list[PartitionLag] | None = None,
    horizon: Horizon | None = None,
    show_query: bool = False,
) -> list[PartitionStatus]:
    """Every partition with something pending, held or dead-lettered, or owned; see the module docstring.
    ``lags`` and ``horizon``: already read by the caller (the lag check), not read again. ``show_query``: name the
    horizon holders with their SQL text (horizon.find_horizon), for an operator who asks."""
    lags = partition_lag(conn, table, strategy, cap=cap) if lags is None else lags
    alive = holders_alive(conn, table, holders(lags))
    if horizon is None:
        horizon = find_horizon(conn, table, show_query=show_query) if strategy == "partitioned" else Horizon((), ())
    held_back = {(h.topic, h.partition): h for h in horizon.held_back}
    poison = _poison_by_partition(conn, table)
    dead = _dead_letters_by_partition(conn, table)
    seen = {(lag.topic, lag.partition) for lag in lags}
    statuses: list[PartitionStatus] = []
    for lag in lags:
        where = (lag.topic, lag.partition)
        owner = describe_holders(lag.leased_by, alive) if lag.leased_by else None
        back = held_back.get(where)
        blocked = _blockers(lag, owner, alive, horizon, back) + poison.get(where, [])
        if lag.pending and not blocked and not lag.leased_by:
            blocked.append("no worker has taken it yet (is a relay running?)")
        if not (lag.pending or lag.held or owner or dead.get(where) or blocked):
            continue
        ages = [a for a in (lag.oldest_pending_age_s, back.oldest_age_s if back else None) if a is not None]
        statuses.append(
            PartitionStatus(
                lag.topic,
                lag.partition,
                owner,
                lag.position,
                lag.pending + (back.rows if back else 0),
                lag.held,
                max(ages) if ages else None,
                lag.until if lag.in_backoff else None,
                lag.attempts,
                lag.last_error,
                dead.get(where, 0),
                tuple(blocked),
            )
        )
    for where, count in dead.items():
        if where not in seen:
            statuses.append(PartitionStatus(*where, None, None, 0, 0, None, None, 0, None, count, ()))
    return sorted(statuses, key=lambda s: (s.topic, s.partition))


def _blockers(
    lag: PartitionLag, owner: str | None, alive: Mapping[str, bool | None], horizon: Horizon, back: HeldBack | None
) -> list[str]:
    """What keeps a partition from moving, as an operator reads it: the horizon, a dead worker's lease, a backoff."""
    blocked: list[str] = []
    if back is not None:
        first = horizon.holders[0].describe() if horizon.holders else "a transaction that has just ended"
        blocked.append(f"horizon: {back.rows} committed rows wait for {first}")
    if lag.leased_by and any(alive.get(h) is False for h in lag.leased_by.split(",")):
        blocked.append(f"lease of a dead worker: {owner} until {lag.until} UTC (freed within a second)")
    if lag.in_backoff:
        error = (lag.last_error or "-").splitlines()[0][:160]
        blocked.append(f"backoff until {lag.until} UTC after {lag.attempts} attempt(s): {error}")
    return blocked


def _poison_by_partition(conn: psycopg.Connection, table: OutboxTable) -> dict[tuple[str, int], list[str]]:
    """Per partition, a line for each key held behind a dead letter (keys released but not yet cleared left out)."""
    poison: dict[tuple[str, int], list[str]] = defaultdict(list)
    for key in held_keys(conn, table):
        if not key.released:
            poison[(key.topic, key.partition)].append(
                f"poison: key {key.key!r} held behind dead letter {key.dead_letter_id} ({key.rows} rows)"
            )
    return poison


def _dead_letters_by_partition(conn: psycopg.Connection, table: OutboxTable) -> dict[tuple[str, int], int]:
    rows = conn.execute(
        sql.SQL(
            "SELECT topic, partition, count(*) FROM {} WHERE retried_at IS NULL AND discarded_at IS NULL "
            "GROUP BY topic, partition"
        ).format(table.dead_letters)
    ).fetchall()
    return {(t, int(p)): int(n) for t, p, n in rows}


COLUMNS = ("partition", "owner", "position", "pending", "held", "oldest_s", "backoff_until", "dead", "blocked by")


def _cells(s: PartitionStatus) -> tuple[str, ...]:
    return (
        s.key,
        s.owner or "-",
        s.position or "-",
        str(s.pending),
        str(s.held),
        f"{s.oldest_age_s:.1f}" if s.oldest_age_s is not None else "-",
        s.backoff_until or "-",
        str(s.dead_letters),
        "; ".join(s.blocked_by) or ("moving" if s.pending else "-"),
    )


def render(statuses: list[PartitionStatus]) -> str:
    """A plain-text table for a terminal."""
    if not statuses:
        return "every partition is caught up: nothing pending, held or dead-lettered"
    rows = [COLUMNS, *(_cells(s) for s in statuses)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)), row[-1]]) for row in rows)


def markdown(statuses: list[PartitionStatus], limit: int = 20) -> str:
    """The same facts as a Markdown table (Dagster metadata), the partitions with a blocker first."""
    if not statuses:
        return "every partition is caught up"
    ranked = sorted(statuses, key=lambda s: (not s.blocked_by, -(s.oldest_age_s or 0.0)))[:limit]
    header = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    return header + "\n".join("| " + " | ".join(c.replace("|", "/") for c in _cells(s)) + " |" for s in ranked)
