"""Looking without touching: `outbox lag`, `outbox status` and `outbox settings`. See
docs/operations.md#command-line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence

import psycopg

from ..config import settings_in_effect
from ..errors import OutboxError
from ..model import WAL
from ..observe.horizon import find_horizon
from ..observe.lag import PartitionLag, dead_letter_backlog, describe_holders, held_keys, holders, partition_lag
from ..observe.lag_slo import LagThresholds, evaluate_wal_lag
from ..observe.liveness import holders_alive
from ..observe.orphan_slot import orphan_slot
from ..observe.wal_lag import NO_PARTITIONS, wal_lag
from ..store import strategy_record
from ..store.wal import grants
from .common import connect, table_of


def cmd_lag(args: argparse.Namespace) -> int:
    if args.cap is not None and args.cap < 1:
        raise OutboxError("--cap must be >= 1")
    with connect(args) as conn:
        strategy = strategy_record.resolve(conn, table_of(args), args.strategy)
        if strategy == WAL:
            return _print_wal(conn, args)
        lags = partition_lag(conn, table_of(args), strategy, cap=args.cap)
        alive = holders_alive(conn, table_of(args), holders(lags))
        held = [key for key in held_keys(conn, table_of(args)) if key.rows or not key.released]
        horizon = find_horizon(conn, table_of(args)) if strategy == "partitioned" else None
        orphan = orphan_slot(conn, table_of(args), strategy)
    _say_orphan(orphan, args)
    if args.json:
        print(json.dumps([{**dataclasses.asdict(lag), "holders": _holders_json(lag, alive)} for lag in lags]))
    else:
        print(_lagtable_of(lags, args.cap, alive))
        for key in held:
            print(key.describe())
        for line in horizon.describe() if horizon else []:
            print(line)
    return 0


def cmd_settings(args: argparse.Namespace) -> int:
    """Every environment variable the project reads: its value in effect, where it came from, what it means."""
    rows = settings_in_effect()
    if args.json:
        print(json.dumps([dict(zip(("name", "value", "source", "meaning"), row, strict=True)) for row in rows]))
        return 0
    width = max(len(name) for name, *_ in rows)
    for name, value, source, meaning in rows:
        print(f"{name:<{width}}  {value or '(empty)'}  [{source}]\n{'':<{width}}  {meaning}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from ..observe import status

    with connect(args) as conn:
        strategy = strategy_record.resolve(conn, table_of(args), args.strategy)
        if strategy == WAL:
            return _print_wal(conn, args, dead_letters=True)
        statuses = status.partition_status(conn, table_of(args), strategy, show_query=args.show_query)
        orphan = orphan_slot(conn, table_of(args), strategy)
    _say_orphan(orphan, args)
    if args.json:
        print(json.dumps([dataclasses.asdict(s) for s in statuses]))
    else:
        print(status.render(statuses))
    return 0


def _say_orphan(orphan: str | None, args: argparse.Namespace) -> None:
    """A slot no relay of this table outbox reads (observe/orphan_slot.py): on stderr, so that --json stays JSON."""
    if orphan is not None:
        print(orphan, file=sys.stderr)


def _print_wal(conn: psycopg.Connection, args: argparse.Namespace, *, dead_letters: bool = False) -> int:
    """A wal outbox: one line for its slot, and the lag objective's verdict on it (observe/wal_lag.py)."""
    lag = wal_lag(conn, table_of(args))
    verdict = evaluate_wal_lag(lag, LagThresholds.from_env())
    waiting = dead_letter_backlog(conn, table_of(args)).open if dead_letters else None
    exposure = grants.exposure(conn, table_of(args))  # who can emit under its prefix (store/wal/grants.py)
    if args.json:
        extra: dict[str, object] = {"exposed": exposure.describe() if exposure.exposed else None}
        if waiting is not None:
            extra["dead_letters"] = waiting
        print(json.dumps({**lag.as_json(), "severity": verdict.severity, "reasons": list(verdict.reasons), **extra}))
        return 0
    print(lag.describe())
    if exposure.exposed:
        print(exposure.describe())
    for line in lag.notes(table_of(args)):
        print(line)
    print(f"({NO_PARTITIONS})")
    if waiting:
        print(f"{waiting} dead letters wait for an operator (outbox dead-letters list)")
    print(f"lag objective: {verdict.severity.upper()}" + (f": {'; '.join(verdict.reasons)}" if verdict.reasons else ""))
    return 0


def _holders_json(lag: PartitionLag, alive: Mapping[str, bool | None]) -> dict[str, bool | None]:
    return {h: alive.get(h) for h in (lag.leased_by or "").split(",") if h}


def _lagtable_of(lags: Sequence[PartitionLag], cap: int | None, alive: Mapping[str, bool | None]) -> str:
    header = (
        "topic",
        "partition",
        "pending",
        "held",
        "oldest_s",
        "position",
        "held_by",
        "until",
        "attempts",
        "backoff",
        "last_error",
    )
    rows = [
        (
            lag.topic,
            str(lag.partition),
            f"{lag.pending}+" if cap is not None and lag.pending >= cap else str(lag.pending),
            str(lag.held),
            f"{lag.oldest_pending_age_s:.1f}" if lag.oldest_pending_age_s is not None else "-",
            lag.position or "-",
            describe_holders(lag.leased_by, alive) if lag.leased_by else "-",
            lag.until or "-",
            str(lag.attempts),
            "yes" if lag.in_backoff else "no",
            (lag.last_error or "-").replace("\n", " ")[:60],
        )
        for lag in lags
    ]
    if not rows:
        return "nothing pending"
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=False)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in (header, *rows)]
    total = sum(lag.pending for lag in lags)
    return "\n".join(
        [*lines, f"total pending: {total}{'+' if cap is not None and any(r[2].endswith('+') for r in rows) else ''}"]
    )
