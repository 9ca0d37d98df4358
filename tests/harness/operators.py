"""The operator: what a person on call does while all this happens, through the ``outbox`` command line with the
application's DSN (password and all) in OUTBOX_PG_DSN, as docs/operations.md tells them to. Each action is one
function registered with its weight and the strategies it applies to; it picks its target from what the database
shows at that moment with the event's seeded ``choice``, and returns a note for the timeline. An action that publishes
rows again on purpose (a rewind, a replay) says how many (``ctx.replay``): the checker does not count them as
duplicates.

Each uses the strategy that relays the outbox now (``ctx.relaying``): ``switch_strategy`` changes it (switching.py).
On a wal outbox the dead letters, ``init-db``, maintenance, a drain beside the streaming relay, ``status`` and ``lag``
apply; rewinds, replays, leases and switches of strategy do not (it has no positions, rows or leases).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence

import psycopg
from psycopg import sql

from outbox_pipeline import server
from outbox_pipeline.errors import SchemaError
from outbox_pipeline.operate import create_ahead, move_default_rows
from outbox_pipeline.store import DEFAULT_DAYS_AHEAD

from . import switching
from .cluster import admin, open_dead_letters
from .context import Context
from .schedule import ALL, POSITION_STRATEGIES, Event, Registry

OPERATIONS = Registry()
DRAIN_MAX_S = 6.0
_REWOUND = re.compile(r"rewound (\S+)/(\d+) from xid=(\d+) id=(\d+) to xid=(\d+) id=(\d+)")
_REPLAYED = re.compile(r"replayed (\d+) sent rows")


def _pick(options: Sequence[tuple[object, ...]], event: Event) -> tuple[object, ...] | None:
    return options[event.choice % len(options)] if options else None


@OPERATIONS.action("operator", 2, strategies=ALL)
def dead_letter_retry(ctx: Context, event: Event) -> str:
    picked = _pick(open_dead_letters(ctx.outbox), event)
    if picked is None:
        return "no dead letter"
    return str(ctx.cli("dead-letters", "retry", "--id", str(picked[0])))


@OPERATIONS.action("operator", 2, strategies=ALL)
def dead_letter_discard(ctx: Context, event: Event) -> str:
    picked = _pick(open_dead_letters(ctx.outbox), event)
    if picked is None:
        return "no dead letter"
    return str(ctx.cli("dead-letters", "discard", "--id", str(picked[0]), "--reason", "harness: given up"))


@OPERATIONS.action("operator", 2, strategies=POSITION_STRATEGIES)
def rewind(ctx: Context, event: Event) -> str:
    """`outbox replay --topic T --partition P --since <1..5 s ago> --force`: the partition publishes again."""
    with admin(ctx.outbox) as conn:
        query = sql.SQL("SELECT topic, partition FROM {} WHERE last_processed_id > 0 ORDER BY 1, 2")
        picked = _pick(conn.execute(query.format(ctx.outbox.table.offsets)).fetchall(), event)
    if picked is None:
        return "no position yet"
    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1 + event.choice % 5)
    topic, partition = str(picked[0]), str(picked[1])
    result = ctx.cli("replay", "--topic", topic, "--partition", partition, "--since", since.isoformat(), "--force")
    match = _REWOUND.search(result.output)
    if match:
        ctx.replay(f"rewind {topic}/{partition}", _rows_between(ctx, match.groups()))
    return f"{result} {match.group(0) if match else ''}"


def _rows_between(ctx: Context, rewound: tuple[str, ...]) -> int:
    """Rows behind the old position and past the new one, in the strategy's order: what the rewind publishes again."""
    topic, partition, old_xid, old_id, new_xid, new_id = rewound
    if ctx.relaying.strategy == "partitioned":
        where = "(transaction_id, id) > (%(nx)s::xid8, %(ni)s) AND (transaction_id, id) <= (%(ox)s::xid8, %(oi)s)"
    else:
        where = "id > %(ni)s AND id <= %(oi)s"
    query = sql.SQL("SELECT count(*) FROM {} WHERE topic = %(t)s AND partition = %(p)s AND " + where)
    params = {"t": topic, "p": int(partition), "ox": old_xid, "oi": int(old_id), "nx": new_xid, "ni": int(new_id)}
    with admin(ctx.outbox) as conn:
        row = conn.execute(query.format(ctx.outbox.table.messages), params).fetchone()
    return int(row[0]) if row else 0


@OPERATIONS.action("operator", 1, strategies=frozenset({"locking", "advisory", "lease"}), row_mode="mark-sent")
def replay(ctx: Context, event: Event) -> str:
    """`outbox replay --topic T --id-from A --id-to B`: recent sent rows (mark-sent) go out again."""
    topic = ctx.outbox.topics[event.choice % 2]
    with admin(ctx.outbox) as conn:
        query = sql.SQL(
            "SELECT min(id), max(id) FROM (SELECT id FROM {} WHERE topic = %s AND sent_at IS NOT NULL "
            "ORDER BY id DESC LIMIT %s) t"
        )
        row = conn.execute(query.format(ctx.outbox.table.messages), (topic, 5 + event.choice % 50)).fetchone()
    if row is None or row[0] is None:
        return "nothing sent yet"
    result = ctx.cli("replay", "--topic", topic, "--id-from", str(row[0]), "--id-to", str(row[1]))
    match = _REPLAYED.search(result.output)
    if match:
        ctx.replay(f"replay {topic} {row[0]}..{row[1]}", int(match.group(1)))
    return str(result)


@OPERATIONS.action("operator", 1, strategies=POSITION_STRATEGIES)
def release_lease(ctx: Context, event: Event) -> str:
    """`outbox release-lease T P` on a leased partition (its holder may well be alive and busy)."""
    with admin(ctx.outbox) as conn:
        query = sql.SQL("SELECT topic, partition FROM {} WHERE locked_by IS NOT NULL ORDER BY 1, 2")
        picked = _pick(conn.execute(query.format(ctx.outbox.table.offsets)).fetchall(), event)
    if picked is None:
        return "no lease"
    return str(ctx.cli("release-lease", str(picked[0]), str(picked[1])))


@OPERATIONS.action("operator", 1, strategies=ALL)
def maintenance(ctx: Context, event: Event) -> str:
    """What the partition maintenance job does first: create the days ahead, move DEFAULT's rows into their days."""
    try:
        with server.connect(ctx.outbox.app_dsn, autocommit=True) as conn:
            today = dt.datetime.now(dt.UTC).date()
            created = create_ahead(conn, ctx.outbox.table, today=today, days_ahead=DEFAULT_DAYS_AHEAD)
            rescue = move_default_rows(conn, ctx.outbox.table)
    except (psycopg.OperationalError, SchemaError) as exc:  # the server restarting; a writer raced a new day
        return f"not now: {type(exc).__name__}"
    moved = {day.isoformat(): n for day, n in rescue.moved.items()}
    return f"created {len(created)}, moved {moved}, failed {list(rescue.failed.values())}"


@OPERATIONS.action("operator", 1, strategies=ALL)
def init_db(ctx: Context, event: Event) -> str:
    """`outbox init-db` again, as a deploy does: migrations are done, the days ahead are made (DEFAULT's rows too)."""
    return str(ctx.cli("init-db"))


@OPERATIONS.action("operator", 1, strategies=ALL, duration=lambda rng, setup: DRAIN_MAX_S)
def drain(ctx: Context, event: Event) -> str:
    """`outbox relay --until-empty` beside the running workers, same strategy, bounded by --max-seconds."""
    relaying = ctx.relaying
    argv = ["relay", "--strategy", relaying.strategy, "--until-empty", "--max-seconds", f"{DRAIN_MAX_S:g}"]
    argv += ["--batch-size", str(ctx.setup.batch_size), "--worker-id", f"drain-{event.choice % 1000}"]
    if relaying.mode != "delete":
        argv += ["--mode", relaying.mode]
    return str(ctx.cli(*argv, timeout_s=DRAIN_MAX_S + 60))


@OPERATIONS.action("operator", 1, strategies=ALL)
def status(ctx: Context, event: Event) -> str:
    """`outbox status` and `outbox lag` from a second shell: read only, and their output is scanned like the rest."""
    strategy = ctx.relaying.strategy
    return f"{ctx.cli('status', '--strategy', strategy)}; {ctx.cli('lag', '--strategy', strategy)}"


@OPERATIONS.action("operator", 0.5, duration=lambda rng, setup: switching.SWITCH_S)
def switch_strategy(ctx: Context, event: Event) -> str:
    """The documented switch (docs/operations.md) to the event's strategy while writers write and the nemesis goes
    on: indexes, every worker stopped, `outbox switch-strategy` (its refusals followed), workers of the new strategy,
    the other indexes dropped. Targets (schedule.switch_targets): the strategies the run's writers suit, which cannot
    change mid-run: serialized only in a run that began serialized (its writers take the serialized lock)."""
    return switching.switch(ctx, event)
