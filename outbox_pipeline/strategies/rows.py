"""Delivery state on the row, shared by the row strategies (locking, advisory, lease): delete or mark sent, back off,
dead-letter, each one statement over an id array. See docs/strategies.md#failures."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..model import AckResult, DeliveryFailure, OutboxRecord, PublishOutcome
from ..timestamps import created_at_bounds
from .base import DEAD_LETTER_MOVED, RECORD_COLUMNS, StrategyConfig, fetch_records, scope_condition


def select_pending_sql(config: StrategyConfig, *, order: str, lock: bool) -> sql.Composed:
    """Unsent, currently available rows in ``order`` ("priority" or "id"), optionally locked, except
    the ids in ``%(exclude)b`` (this worker's batch in flight; may be empty).

    Available means ``available_after <= clock_timestamp()``, read after the statement's snapshot, not ``now()``
    (the claim's transaction start, before its snapshot): a row is available from its writer's own ``now()``, so
    a writer that began after the claim did and committed before its snapshot wrote a visible row that ``now()``
    left out, while a later row of its key went first."""
    order_by = "m.priority DESC, m.id" if order == "priority" else "m.id"
    return sql.SQL(
        """
        SELECT {columns}
        FROM {messages} m
        WHERE m.sent_at IS NULL AND m.available_after <= clock_timestamp() {scope} {exclude}
        ORDER BY {order_by}
        LIMIT %(limit)s
        {lock}
        """
    ).format(
        columns=sql.SQL(RECORD_COLUMNS),
        messages=config.table.messages,
        scope=scope_condition(config, "m"),
        # A hashed subplan: one hash lookup per row walked, and the statement stays prepared. Measured
        # with 5,000 ids: ``NOT (id = ANY(array constant))`` is hashed too (PostgreSQL >= 14) but only
        # unprepared, and its planning estimates every element against every daily partition (7 ms
        # per claim); prepared, that array is a parameter compared element by element (700 ms).
        # ``%(exclude)b``: id lists go in binary (see mark_delivered).
        exclude=sql.SQL("AND m.id NOT IN (SELECT unnest(%(exclude)b::bigint[]))"),
        order_by=sql.SQL(order_by),
        lock=sql.SQL("FOR UPDATE OF m SKIP LOCKED") if lock else sql.SQL(""),
    )


def one_priority_sql(config: StrategyConfig) -> sql.Composed:
    """Whether every unsent row has the same priority: two ends of the pending index, no scan."""
    pending = sql.SQL("FROM {messages} m WHERE m.sent_at IS NULL {scope}").format(
        messages=config.table.messages, scope=scope_condition(config, "m")
    )
    return sql.SQL(
        """
        SELECT (SELECT m.priority {pending} ORDER BY m.priority DESC, m.id LIMIT 1)
            IS NOT DISTINCT FROM (SELECT m.priority {pending} ORDER BY m.priority, m.id DESC LIMIT 1)
        """
    ).format(pending=pending)


@dataclass(frozen=True)
class FairPick:
    """The statements of ``claim_fair``, composed once per strategy instead of on every claim."""

    one_priority: sql.Composed
    oldest: sql.Composed
    urgent: sql.Composed

    @classmethod
    def build(cls, config: StrategyConfig, *, lock: bool) -> FairPick:
        return cls(
            one_priority=one_priority_sql(config),
            oldest=select_pending_sql(config, order="id", lock=lock),
            urgent=select_pending_sql(config, order="priority", lock=lock),
        )


def oldest_share(conn: psycopg.Connection, config: StrategyConfig, one_priority: sql.Composed, limit: int) -> int:
    """How many rows of a batch to take oldest-first: none when all pending rows share one priority.

    Then the priority order is the id order and one read serves both, instead of two reads that each
    walk past the rows in flight (measured, locking, 5,000 rows: 11 ms for the oldest 500). A row of
    another priority committed after this check is still taken in priority order by the one read;
    nothing can starve within a batch that is all one priority.
    """
    share = int(limit * config.oldest_share)
    if share and conn.execute(one_priority, prepare=True).fetchone() == (True,):
        return 0
    return share


def claim_fair(
    conn: psycopg.Connection, config: StrategyConfig, pick: FairPick, limit: int, avoid: Collection[int] = ()
) -> list[OutboxRecord]:
    """Highest priority first, plus an oldest-first share so old low-priority rows are never starved.

    The two reads may return the same rows (they do when all priorities are equal): duplicates are
    dropped here rather than excluded in SQL, where ``id <> ALL(...)`` costs a comparison per array
    element per row walked. ``avoid``: rows this worker already has in flight, skipped before any
    lock is tried (a second batch in flight would otherwise re-walk the first one's locked rows).
    """
    params: dict[str, object] = {"exclude": list(avoid)}
    records: list[OutboxRecord] = []
    oldest = oldest_share(conn, config, pick.one_priority, limit)
    if oldest:
        records = fetch_records(conn, pick.oldest, {**params, "limit": oldest}, prepare=True)
    rest = limit - len(records)
    if rest > 0:
        # Asking for as many as the oldest share may overlap keeps the batch full; rows locked beyond
        # the batch stay unsent and are released at commit.
        seen = {r.id for r in records}
        more = fetch_records(conn, pick.urgent, {**params, "limit": rest + len(records)}, prepare=True)
        records.extend([r for r in more if r.id not in seen][:rest])
    return records


def finish(
    conn: psycopg.Connection,
    config: StrategyConfig,
    outcome: PublishOutcome,
    *,
    owner: str | None = None,
) -> AckResult:
    """Apply one batch's outcome to its rows. With ``owner``, touch only rows still leased to it."""
    acked = mark_delivered(conn, config, outcome.delivered, owner=owner)
    retry, dead = split_failures(outcome.failed, config.max_attempts)
    retried = schedule_retry(conn, config, retry, owner=owner)
    dead_lettered = dead_letter(conn, config, dead, owner=owner)
    lost = (len(outcome.delivered) - acked) + (len(retry) - retried) + (len(dead) - dead_lettered)
    return AckResult(acked=acked, lost_ownership=lost, retried=retried, dead_lettered=dead_lettered)


def split_failures(
    failures: Sequence[DeliveryFailure], max_attempts: int
) -> tuple[list[DeliveryFailure], list[DeliveryFailure]]:
    """(to retry, to dead-letter): permanent errors and rows out of attempts go to the dead letters.

    Transport failures never run out of attempts: the row waits for the broker however long it takes.
    """
    retry = [f for f in failures if not f.permanent and (not f.counts or f.record.attempts + 1 < max_attempts)]
    retry_ids = {f.record.id for f in retry}
    return retry, [f for f in failures if f.record.id not in retry_ids]


def _owner_clause(owner: str | None) -> sql.Composable:
    return sql.SQL("AND m.locked_by = %(owner)s") if owner is not None else sql.SQL("")


def mark_delivered(
    conn: psycopg.Connection, config: StrategyConfig, records: Sequence[OutboxRecord], *, owner: str | None
) -> int:
    """Delete or mark sent, by id. The batch's created_at range lets PostgreSQL prune to the daily
    partitions that hold it: ``id = ANY(...)`` alone probes every partition's key for every id."""
    if not records:
        return 0
    # ``%(ids)b``: psycopg sends a list parameter as text unless told otherwise, built in Python at
    # 6.8 ms per 5,000 ids against 2 ms in binary (measured); a row strategy sends two such lists
    # per batch, about 2 s of relay CPU per million rows.
    if config.mode == "delete":
        query = sql.SQL("DELETE FROM {messages} m WHERE m.id = ANY(%(ids)b::bigint[]) {within} {owner}")
    else:
        query = sql.SQL(
            "UPDATE {messages} m SET sent_at = now(), locked_by = NULL "
            "WHERE m.id = ANY(%(ids)b::bigint[]) {within} {owner}"
        )
    params = {"ids": [r.id for r in records], "owner": owner, **created_at_bounds([r.created_at for r in records])}
    within = sql.SQL("AND m.created_at BETWEEN %(from)s::timestamptz AND %(to)s::timestamptz")
    cur = conn.execute(query.format(messages=config.table.messages, within=within, owner=_owner_clause(owner)), params)
    return cur.rowcount


def schedule_retry(
    conn: psycopg.Connection, config: StrategyConfig, failures: Sequence[DeliveryFailure], *, owner: str | None
) -> int:
    """attempts + 1 and an exponential backoff with jitter, computed per row by the server.

    A transport failure (see FailureKind) changes neither: the relay itself backs off while the broker
    takes nothing, and the rows keep their place, so `advisory` still publishes them before the rows
    behind them once the broker answers.

    From clock_timestamp(), not now(): in the locking strategy now() is when the claim's transaction
    began, before a publish that may have waited out the whole message timeout, so a backoff from
    now() would already be over and the failing row would be in every following batch.
    """
    if not failures:
        return 0
    cur = conn.execute(
        sql.SQL(
            """
            UPDATE {messages} m
            SET attempts = m.attempts + f.counts::int,
                last_error = f.error,
                locked_by = NULL,
                available_after = clock_timestamp() + CASE
                    WHEN f.counts THEN make_interval(
                        secs => least(%(max)s, %(base)s * power(2, m.attempts)) * (0.5 + random() / 2))
                    ELSE '0'::interval END
            FROM unnest(%(ids)s::bigint[], %(errors)s::text[], %(counts)s::boolean[]) AS f(id, error, counts)
            WHERE m.id = f.id {owner}
            """
        ).format(messages=config.table.messages, owner=_owner_clause(owner)),
        {
            "ids": [f.record.id for f in failures],
            "errors": [f.error for f in failures],
            "counts": [f.counts for f in failures],
            "max": config.backoff_max_s,
            "base": config.backoff_base_s,
            "owner": owner,
        },
    )
    return cur.rowcount


def dead_letter(
    conn: psycopg.Connection, config: StrategyConfig, failures: Sequence[DeliveryFailure], *, owner: str | None
) -> int:
    """Move rows to the dead-letter table with their error, in one statement."""
    if not failures:
        return 0
    cur = conn.execute(
        sql.SQL(
            """
            WITH moved AS (
                DELETE FROM {messages} m
                USING unnest(%(ids)s::bigint[], %(errors)s::text[]) AS f(id, error)
                WHERE m.id = f.id {owner}
                RETURNING m.*, f.error
            )
            {dead_letter}
            """
        ).format(
            messages=config.table.messages,
            dead_letter=sql.SQL(DEAD_LETTER_MOVED).format(dead_letters=config.table.dead_letters),
            owner=_owner_clause(owner),
        ),
        {
            "ids": [f.record.id for f in failures],
            "errors": [f.error for f in failures],
            "owner": owner,
            "worker": config.worker_id,
        },
    )
    return cur.rowcount
