"""The switch-strategy procedure of docs/operations.md, as the operator runs it in the middle of a harness run while
the writers write and the nemesis goes on:

1. `outbox indexes --strategy NEW`, everything running;
2. every relay worker stopped: SIGTERM (thawed first), SIGKILL for one still running after ``STOP_WAIT_S`` (frozen
   again meanwhile: a hung pod is killed). A drain is an operator command like this one: none runs meanwhile;
3. `outbox switch-strategy --to NEW --mode M`. When it refuses, the operator follows its message and tries again,
   up to ``ROUNDS`` times: a key held behind a dead letter, or held rows not relayed yet: the open dead letters
   retried, or discarded when their reason says the row can never go (too large, no such topic), then the old
   strategy's relays started again until no row is held; a worker still alive: stopped again at the next round;
   writers' transactions left open, the server restarting: again. Every refusal is kept (Switch.refused) and shown
   on the timeline. After the last, the old strategy's relays start again and the run goes on without the switch;
4. `outbox indexes --strategy NEW --drop-others` while the relays are still stopped (nothing of theirs holds the
   table), then the slots started again with NEW under new worker ids (a Deployment's rollout).

The pool's lock is held from 2 to 4: a kill of the nemesis waits for it rather than starting an old strategy's
worker. What the checker needs is recorded in ``ctx.switches``: when the switch took (copies stamped before are the
old strategy's), and the rows relayed past the new positions, which the new strategy publishes again (the documented
duplicates: counted from the old record of what was relayed, read while the relays were stopped). Before a switch
deletes what an ordered strategy relayed (to a row strategy, delete mode) the rows' order is read (``ctx.order``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TypeVar

import psycopg
from psycopg import sql

from outbox_pipeline.store import BEHIND_POSITION

from .cluster import admin, open_dead_letters, row_order, wait_for_server
from .context import CliResult, Context, Switch
from .schedule import POSITION_STRATEGIES, Event, Relaying, switch_targets
from .writers import BAD_ROWS

SWITCH_S = 10.0  # the operator lane's allowance for a switch: two `outbox indexes`, the stop, the switch, the start
STOP_WAIT_S = 10.0  # SIGTERM to exit; past it a worker is killed (frozen again since: a hung pod)
ROUNDS = 5  # refusals followed before the operator gives up the switch
HELD_WAIT_S = 30.0  # the old strategy's relays' time to relay what was held behind the released dead letters
# A dead letter to discard: its reason says the row can never go (BAD_ROWS' reasons, each case-insensitive).
_NEVER_GOES = re.compile("|".join(p.removeprefix("(?i)") for p in BAD_ROWS.values() if p), re.IGNORECASE)
T = TypeVar("T")


def switch(ctx: Context, event: Event) -> str:
    """Switch to the event's target (schedule.switch_to); returns the timeline's note."""
    assert event.to is not None
    old, new = ctx.relaying, event.to
    if new.strategy not in switch_targets(ctx.setup, old.strategy):
        return f"not from {old} to {new}"
    built = _answered(ctx, "indexes", "--strategy", new.strategy)
    if built.code != 0:
        return f"not now: {built}"
    refused: list[str] = []
    exits: list[tuple[str, int]] = []
    with ctx.pool.lock:
        at: float | None = None  # when the switch took
        republished = 0
        dropped: CliResult | None = None
        # A slot's worker that exited by itself is replaced below: its exit is kept for the checker.
        exits += [(w.name, w.returncode) for w in ctx.pool.slots if w.returncode is not None]
        try:
            for _ in range(ROUNDS):
                exits += ctx.pool.stop(STOP_WAIT_S).items()
                before = _retrying(ctx, lambda: _positions(ctx))
                if old.strategy in POSITION_STRATEGIES and new.strategy not in POSITION_STRATEGIES:
                    if new.mode == "delete":  # the rows an ordered strategy relayed go: their order is read first
                        order = _retrying(ctx, lambda: row_order(ctx.outbox))
                        with ctx.lock:
                            ctx.order.update(order)
                result = ctx.cli("switch-strategy", "--to", new.strategy, "--mode", new.mode)
                if result.code == 0:
                    at = time.time()
                    republished = _retrying(ctx, lambda: _republished(ctx, before, new))  # noqa: B023 (called at once)
                    dropped = _answered(ctx, "indexes", "--strategy", new.strategy, "--drop-others")
                    break
                refused.append(_why(result))
                _follow(ctx, old, result)
        finally:
            ctx.pool.stop(STOP_WAIT_S)  # the old strategy's, when a refusal's round left them running
            ctx.pool.start(new if at is not None else old)
    killed = sum(1 for _, code in exits if code == -9)
    if at is None:
        return f"{old} -> {new} given up after {ROUNDS} refusals ({killed} killed): {' | '.join(refused)}"
    with ctx.lock:
        ctx.switches.append(Switch(at, old, new, republished, killed, tuple(refused), tuple(exits)))
    refusals = f", refused {len(refused)}: {' | '.join(refused)}" if refused else ""
    return f"{old} -> {new}: {republished} to publish again, {killed} killed{refusals}; {dropped}"


def _answered(ctx: Context, *argv: str) -> CliResult:
    """A command, again once the server is back when it answered that it is restarting (exit 2). Dropping the
    other indexes refused for its lock (a writer's transaction held the table) is left for later: each try queues the
    writers behind it for its lock timeout."""
    result = ctx.cli(*argv)
    for _ in range(3):
        if result.code != 2 or "did not get its lock" in result.output:
            break
        wait_for_server(ctx.outbox)
        result = ctx.cli(*argv)
    return result


def _retrying(ctx: Context, read: Callable[[], T]) -> T:
    """A read of the database, again once it is back (a PostgreSQL restart of the nemesis)."""
    for _ in range(5):
        try:
            return read()
        except psycopg.OperationalError:
            wait_for_server(ctx.outbox)
    return read()


def _why(result: CliResult) -> str:
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    return f"exit {result.code}: {lines[-1][:200] if lines else ''}"


def _follow(ctx: Context, old: Relaying, refusal: CliResult) -> None:
    """What the refusal's message tells the operator to do before the next try."""
    text = refusal.output
    if refusal.code == 2 and ("held behind" in text or "dead letters" in text):
        _retrying(ctx, lambda: _resolve_dead_letters(ctx))
        ctx.pool.start(old)
        deadline = time.monotonic() + HELD_WAIT_S
        while time.monotonic() < deadline and not ctx.stop.is_set():
            if _retrying(ctx, lambda: _held(ctx)) == (0, 0):
                return
            _retrying(ctx, lambda: _resolve_dead_letters(ctx))
            time.sleep(0.5)
    elif refusal.code != 0:
        wait_for_server(ctx.outbox)  # the server restarting; else a worker alive or a writer's open transaction


def _resolve_dead_letters(ctx: Context) -> None:
    """Discard the dead letters whose reason says the row can never go, retry the others."""
    letters = open_dead_letters(ctx.outbox)
    discard = [f"--id={i}" for i, error in letters if _NEVER_GOES.search(error)]
    retry = [f"--id={i}" for i, error in letters if not _NEVER_GOES.search(error)]
    if discard:
        ctx.cli("dead-letters", "discard", *discard, "--reason", "harness: switching strategy")
    if retry:
        ctx.cli("dead-letters", "retry", *retry)


def _held(ctx: Context) -> tuple[int, int]:
    """(held rows, keys held behind an open dead letter)."""
    t = ctx.outbox.table
    with admin(ctx.outbox) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT (SELECT count(*) FROM {held}), (SELECT count(*) FROM {holds} WHERE released_at IS NULL)"
            ).format(held=t.held, holds=t.holds)
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


Positions = list[tuple[str, int, str, int, str | None]]


def _positions(ctx: Context) -> Positions:
    """The positions as the old strategy left them (topic, partition, transaction id, id, read_by)."""
    with admin(ctx.outbox) as conn:
        query = sql.SQL(
            "SELECT topic, partition, last_processed_transaction_id::text, last_processed_id, read_by FROM {}"
        )
        return [(t, int(p), x, int(i), r) for t, p, x, i, r in conn.execute(query.format(ctx.outbox.table.offsets))]


# Rows the old record says were relayed (marked sent, or behind the old position) and that are not behind the new
# position: the new strategy publishes them again (docs/operations.md, step 3).
_REPUBLISHED = """
    WITH old AS (
        SELECT * FROM unnest(%(topics)s::text[], %(partitions)s::int[], %(xids)s::text[]::xid8[], %(ids)s::bigint[],
                             %(read_by)s::text[])
            AS o(topic, partition, last_processed_transaction_id, last_processed_id, read_by)
    ),
    relayed AS (
        SELECT m.topic, m.partition, m.transaction_id, m.id FROM {messages} m
        LEFT JOIN old o ON o.topic = m.topic AND o.partition = m.partition
        WHERE m.sent_at IS NOT NULL OR {behind}
    )
    SELECT count(*) FROM relayed m LEFT JOIN {offsets} o ON o.topic = m.topic AND o.partition = m.partition
    WHERE NOT {behind}
"""


def _republished(ctx: Context, before: Positions, new: Relaying) -> int:
    """What a switch to a position strategy publishes again; a row strategy publishes only what no one relayed."""
    if new.strategy not in POSITION_STRATEGIES:
        return 0
    t = ctx.outbox.table
    query = sql.SQL(_REPUBLISHED).format(messages=t.messages, offsets=t.offsets, behind=sql.SQL(BEHIND_POSITION))
    names = ("topics", "partitions", "xids", "ids", "read_by")
    params = {name: [p[column] for p in before] for column, name in enumerate(names)}
    with admin(ctx.outbox) as conn:
        row = conn.execute(query, params).fetchone()
    return int(row[0]) if row else 0
