"""The relay strategy an outbox is relayed by, recorded in the outbox itself, because another strategy would read the
first one's record of what it relayed wrongly. See docs/operations.md#the-outboxs-strategy-and-switching-it."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..config import OutboxTable
from ..errors import OutboxError
from ..model import POSITION_STRATEGIES, RECORDED_NAMES, STRATEGY_NAMES, WAL
from .wal.objects import drop_by_hand

# Who recorded it (``recorded_by``).
BY_INIT_DB = "init-db"
BY_FIRST_RELAY = "first relay"
BY_SWITCH = "switch-strategy"
BY_POSITIONS = "positions found at upgrade"


class StrategyMismatch(OutboxError):
    """A strategy was named that is not the one the outbox records."""


@dataclass(frozen=True)
class Recorded:
    strategy: str
    recorded_at: dt.datetime
    recorded_by: str


def create_table(conn: psycopg.Connection, table: OutboxTable) -> None:
    """The record: at most one row (migration 14)."""
    conn.execute(
        sql.SQL(
            """
            CREATE TABLE {record} (
                only_one    boolean     PRIMARY KEY DEFAULT true CHECK (only_one),
                strategy    text        NOT NULL CHECK (strategy = ANY ({names})),
                recorded_at timestamptz NOT NULL DEFAULT now(),
                recorded_by text        NOT NULL
            )
            """
        ).format(record=table.strategy_record, names=sql.Literal(list(STRATEGY_NAMES)))
    )
    # An outbox relayed before the record existed: its positions, when they are all in one order, say whose it is.
    conn.execute(
        sql.SQL(
            """
            INSERT INTO {record} (strategy, recorded_by)
            SELECT min(read_by), %(by)s FROM {offsets} WHERE read_by IS NOT NULL
            HAVING count(DISTINCT read_by) = 1
            """
        ).format(record=table.strategy_record, offsets=table.offsets),
        {"by": BY_POSITIONS},
    )


def allow_wal(conn: psycopg.Connection, table: OutboxTable) -> None:
    """Migration 16: the record's check names every strategy there is, the wal lane too."""
    conn.execute(
        sql.SQL(
            """
            ALTER TABLE {record} DROP CONSTRAINT outbox_strategy_strategy_check,
                ADD CONSTRAINT outbox_strategy_strategy_check CHECK (strategy = ANY ({names}))
            """
        ).format(record=table.strategy_record, names=sql.Literal(list(RECORDED_NAMES)))
    )


def recorded(conn: psycopg.Connection, table: OutboxTable) -> Recorded | None:
    row = conn.execute(
        sql.SQL("SELECT strategy, recorded_at, recorded_by FROM {}").format(table.strategy_record)
    ).fetchone()
    return Recorded(*row) if row else None


def resolve(conn: psycopg.Connection, table: OutboxTable, named: str | None) -> str:
    """The strategy to read the outbox as, for what only looks (status, lag, the sensor): the recorded one."""
    found = recorded(conn, table)
    if found is not None:
        _refuse_other(table, found, named)
        return found.strategy
    if named is None:
        raise OutboxError(
            f"the outbox {table.schema!r} records no relay strategy yet (no relay has run it): name one (--strategy; "
            "OUTBOX_RELAY_STRATEGY for Dagster), or record it with `outbox init-db --strategy S`"
        )
    _check_name(named)
    return named


def claim(conn: psycopg.Connection, table: OutboxTable, named: str | None, by: str = BY_FIRST_RELAY) -> str:
    """The strategy to relay the outbox with (relays, drains, init-db): the recorded one, or ``named`` recorded now
    when there is none and nothing another strategy left contradicts it. Two first relays of different strategies
    race for one row: one records, the other is refused."""
    found = recorded(conn, table)
    if found is None:
        if named is None:
            return resolve(conn, table, named)  # refuses: nothing recorded, nothing named
        _check_name(named)
        _refuse_traces(conn, table, named)
        conn.execute(
            sql.SQL("INSERT INTO {} (strategy, recorded_by) VALUES (%s, %s) ON CONFLICT DO NOTHING").format(
                table.strategy_record
            ),
            (named, by),
        )
        return resolve(conn, table, named)
    _refuse_other(table, found, named)
    return found.strategy


def refuse_claim(conn: psycopg.Connection, table: OutboxTable, named: str) -> None:
    """``claim``'s refusals, recording nothing: init-db asks first, before it makes what a refusal would otherwise
    leave behind (a wal outbox's replication slot, which retains WAL)."""
    found = conn.execute("SELECT to_regclass(%s)", (table.strategy_record.as_string(conn),)).fetchone()
    if found is None or found[0] is None:
        return  # a new outbox (or one from before the record): nothing to contradict
    try:
        if (record := recorded(conn, table)) is not None:
            _refuse_other(table, record, named)
        else:
            _refuse_traces(conn, table, named)
    except StrategyMismatch as exc:
        raise StrategyMismatch(f"{exc}; nothing was created") from None


def wal_switch_refusal(table: OutboxTable, current: str, named: str) -> str:
    """Why no switch leads to or from wal, and what to do instead, in commands an operator can run as they are."""
    if current == WAL:
        return (
            f"no procedure moves a wal outbox to {named} yet (its messages are in its replication slot's WAL, not in "
            f"rows {named} reads). Keep relaying it with `outbox relay`. To move its writers to {named}: make a new "
            f"outbox in a schema of its own, `outbox init-db --schema <new schema> --strategy {named}`, point the "
            f"writers at it (OUTBOX_SCHEMA, OUTBOX_WRITE_TO=table), relay this one until `outbox lag --schema "
            f"{table.schema}` shows its oldest unpublished commit at 0.0 s, then drop its slot and publication: "
            f"`{drop_by_hand(table)}` (docs/wal.md)"
        )
    return (
        "no procedure makes a table outbox a wal outbox yet (its rows would be relayed by nobody). For a wal outbox, "
        "make one in a schema of its own: `outbox init-db --schema <new schema> --strategy wal`, point the writers at "
        f"it (OUTBOX_SCHEMA, OUTBOX_WRITE_TO=wal) and relay this one until `outbox lag --schema {table.schema}` shows "
        "nothing pending (docs/wal.md, Setting it up)"
    )


def record_switch(conn: psycopg.Connection, table: OutboxTable, strategy: str) -> None:
    """In the switch's own transaction: the outbox is the new strategy's from its commit on."""
    _check_name(strategy)
    conn.execute(
        sql.SQL(
            """
            INSERT INTO {record} (strategy, recorded_by) VALUES (%s, %s)
            ON CONFLICT (only_one) DO UPDATE SET strategy = excluded.strategy, recorded_at = now(),
                                                 recorded_by = excluded.recorded_by
            """
        ).format(record=table.strategy_record),
        (strategy, BY_SWITCH),
    )


def _refuse_other(table: OutboxTable, found: Recorded, named: str | None) -> None:
    if named is None or named == found.strategy:
        return
    _check_name(named)
    change = (
        wal_switch_refusal(table, found.strategy, named)
        if WAL in (named, found.strategy)
        else f"to change it, stop every relay and run `outbox switch-strategy --to {named}` (docs/operations.md, "
        "The outbox's strategy)"
    )
    raise StrategyMismatch(
        f"the outbox {table.schema!r} is relayed by {found.strategy} (recorded by {found.recorded_by} at "
        f"{found.recorded_at:%Y-%m-%d %H:%M:%S %Z}), not {named}: leave --strategy out to use {found.strategy}; "
        f"{change}"
    )


def _refuse_traces(conn: psycopg.Connection, table: OutboxTable, named: str) -> None:
    """With nothing recorded: what another strategy left behind, that ``named`` would read as not relayed."""
    row = conn.execute(
        sql.SQL(
            """
            SELECT (SELECT min(read_by) FROM {offsets} WHERE read_by IS NOT NULL AND read_by <> %(named)s),
                   %(named)s = ANY(%(positions)s) AND EXISTS (SELECT 1 FROM {messages} WHERE sent_at IS NOT NULL)
            """
        ).format(offsets=table.offsets, messages=table.messages),
        {"named": named, "positions": list(POSITION_STRATEGIES)},
    ).fetchone()
    other, marked = row if row else (None, False)
    if other is None and not marked:
        return
    whose = f"positions of {other}" if other else "rows marked sent by a row strategy (--mode mark-sent)"
    change = (
        wal_switch_refusal(table, str(other), named)
        if named == WAL
        else f"stop every relay and run `outbox switch-strategy --to {named}` (docs/operations.md, The outbox's "
        "strategy)"
    )
    raise StrategyMismatch(
        f"the outbox {table.schema!r} records no strategy, but holds {whose}, which {named} would read as not "
        f"relayed: {change}"
    )


def _check_name(named: str) -> None:
    if named not in RECORDED_NAMES:
        raise OutboxError(f"unknown strategy {named!r}: choose one of {', '.join(RECORDED_NAMES)}")
