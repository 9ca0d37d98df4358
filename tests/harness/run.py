"""One harness run: a database and topics of its own on the servers, relay workers of one strategy, the writers,
the nemesis playing the schedule; then the nemesis stops (everything thawed, rejoined, running), the writers stop,
the relays finish, the holds are checked, the operator retries or discards what is left in the dead letters (a good
row retried, a bad one discarded), the relays finish again, and the checker reads Kafka and the database. Whatever
relays the outbox at the end (a switch of strategy may have changed it: ``ctx.relaying``) finishes the run. A wal
outbox keeps no rows: its relays have finished when the slot is confirmed past the WAL written until then.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from psycopg import sql

from tests.faults.helpers import consume
from tests.kit.probes import pending, wait_until

from . import edges  # noqa: F401  (registers the wal lane's edge faults, issue 50)
from .cluster import Outbox, Servers, admin, drop_outbox, row_order, wal_backlog
from .context import Context
from .ledger import DeadRow, Evidence, Verdict, check
from .nemesis import FAULTS, Nemesis
from .operators import OPERATIONS
from .relays import WorkerPool
from .schedule import WAL, Registered, Schedule, Setup, make_schedule
from .silences import clock, wal_fence_s
from .writers import Writer, start_writers

ACTIONS: dict[str, Registered] = {**FAULTS.actions, **OPERATIONS.actions}
FINISH_S = 90.0  # the relays' time to finish once the faults end
AFTER_SWITCH_S = 30.0  # a chosen schedule's events after a switch: the longest they wait past the run's length


def schedule_for(seed: int, strategy: str, seconds: float, *, workers: int = 2, lease_s: float = 5.0) -> Schedule:
    return make_schedule(seed, strategy, ACTIONS, seconds=seconds, workers=workers, lease_s=lease_s)


@dataclass
class Result:
    schedule: Schedule
    verdict: Verdict
    seconds: float

    def report(self) -> str:
        """The figures line, and on failure the findings, the seed and the schedule to replay it."""
        s = self.schedule
        figures = " ".join(f"{k}={v}" for k, v in self.verdict.figures.items())
        verdict = "ok" if self.verdict.ok else "FAILED"
        head = f"HARNESS {s.setup.strategy} seed={s.seed} {verdict} {figures} time={self.seconds:.0f}s"
        head += "".join(f"\n  KNOWN {k}" for k in self.verdict.known)
        if self.verdict.ok:
            return head
        replay = (
            f"replay: python -m tests.harness --ci --strategy {s.setup.strategy} --lease-s {s.setup.lease_s:g}"
            if s.chosen
            else f"replay: python -m tests.harness --strategy {s.setup.strategy} --seed {s.seed} "
            f"--seconds {s.setup.seconds:g} --workers {s.setup.workers} --lease-s {s.setup.lease_s:g}"
        )
        return "\n".join([head, *(f"  FINDING {f}" for f in self.verdict.findings), replay, s.render()])


def run(servers: Servers, schedule: Schedule, directory: Path) -> Result:
    started = time.monotonic()
    setup = schedule.setup
    directory.mkdir(parents=True, exist_ok=True)
    outbox = servers.new_outbox(setup)
    pool = WorkerPool(outbox, setup, directory)
    ctx = Context(servers, outbox, setup, pool, threading.Event())
    problems: list[str] = []
    try:
        writers = _play(ctx, schedule, problems)
    finally:
        pool.kill_all()  # whatever is left after an error: no worker outlives its run
        drop_outbox(outbox)

    written = [w for writer in writers for w in writer.written] + ctx.written
    expected = [w.message_id for w in written if w.outcome == "committed" and w.good and w.message_id]
    records = consume(outbox.bootstrap, outbox.topics, expected, idle_s=10.0, deadline_s=120.0 + len(expected) / 2000)
    outputs = {f"worker {w.name}": w.log(10**9) for w in pool.all()}
    outputs.update({f"{c} #{i}": c.output for i, c in enumerate(ctx.commands)})
    outputs.update(servers.logs())
    outputs["writers"] = "\n".join(w.error or "" for w in written)
    evidence = Evidence(
        setup=setup,
        written=written,
        records=records,
        dead=_dead_letters(outbox),
        order={**ctx.order, **row_order(outbox)},
        spans=list(ctx.timeline.spans),
        replayed=list(ctx.replayed),
        commands=list(ctx.commands),
        outputs=outputs,
        secret=servers.secret,
        problems=problems,
        switches=list(ctx.switches),
        released=list(ctx.released),
        held=_held(outbox),
    )
    result = Result(schedule, check(evidence), time.monotonic() - started)
    _keep(directory, result, ctx, servers.secret)
    return result


def _keep(directory: Path, result: Result, ctx: Context, secret: str) -> None:
    """What happened, for a post-mortem: the report and schedule, the timeline, every operator command's output."""
    (directory / "report.txt").write_text(result.report() + "\n" + result.schedule.render() + "\n")
    spans = sorted(ctx.timeline.spans, key=lambda s: s.start)
    (directory / "timeline.txt").write_text("".join(f"{clock(s.start)} {s}\n" for s in spans))
    commands = "".join(f"$ {c}\n{c.output}\n" for c in ctx.commands)
    (directory / "commands.txt").write_text(commands.replace(secret, "<PASSWORD>"))


def _play(ctx: Context, schedule: Schedule, problems: list[str]) -> list[Writer]:
    """Workers, writers and the nemesis for the schedule's length; then everything brought to rest: relays finished,
    holds checked, the last dead letters retried or discarded, the workers stopped. Returns the writers."""
    setup, outbox, pool = schedule.setup, ctx.outbox, ctx.pool
    pool.start()
    stop_writing = threading.Event()
    writers = start_writers(outbox, setup, schedule.seed, stop_writing)
    nemesis = Nemesis(ctx, schedule, ACTIONS)
    try:
        nemesis.start()
        ctx.stop.wait(setup.seconds)
        if schedule.chosen:  # a chosen schedule: its events after a slow switch are played too
            nemesis.join(AFTER_SWITCH_S)
    finally:
        nemesis.stop()
        stop_writing.set()
        for writer in writers:
            writer.join(60)
    problems += [f"nemesis action failed: {e}" for e in nemesis.errors]
    problems += [f"writer {w.name} crashed: {w.crash!r}" for w in writers if w.crash is not None]
    problems += _revive(pool)

    problems += [
        f"worker {name} exited with {code} (by itself, or when stopped for a switch of strategy)"
        for switch in ctx.switches
        for name, code in switch.exits
        if code not in (0, -9)
    ]
    problems += _finished(outbox, ctx.relaying.strategy, "after the faults", ctx.setup)
    problems += _holds(outbox)
    problems += _last_operator_step(ctx, {w.message_id for wr in writers for w in wr.written if w.good})
    codes = pool.stop()
    problems += [f"worker {name} exited with {code} when stopped" for name, code in codes.items() if code != 0]
    return writers


def _revive(pool: WorkerPool) -> list[str]:
    """A slot whose worker exited by itself (no nemesis kills without replacing) is a finding; it is replaced so
    that the relays can finish."""
    found = []
    for slot, worker in enumerate(list(pool.slots)):
        if not worker.alive():
            found.append(f"worker {worker.name} exited by itself ({worker.returncode}): {worker.log(800)!r}")
            pool.replace(slot)
    return found


def _finished(outbox: Outbox, strategy: str, when: str, setup: Setup) -> list[str]:
    """Wait for nothing to be pending (held rows wait for the operator and are not pending); wal: a takeover of a
    frozen streamer at the end waits out its producer's message timeout first (silences.wal_fence_s)."""
    left = wal_backlog(outbox) if strategy == WAL else lambda: pending(outbox.admin_dsn, outbox.table, strategy)
    what = "bytes of WAL not confirmed, and released holds" if strategy == WAL else "rows still pending"
    within = FINISH_S + (wal_fence_s(setup) if strategy == WAL else 0.0)
    try:
        wait_until(f"the relays to finish {when}", lambda: left() == 0, within, 0.5)
    except AssertionError:
        return [f"stuck {when}: {left()} {what} after {within:.0f}s (see commands.txt, status)"]
    return []


def _holds(outbox: Outbox) -> list[str]:
    """No hold without its open dead letter, no held row without its hold, no released hold left at the end."""
    t = outbox.table
    with admin(outbox) as conn:
        holds = conn.execute(
            sql.SQL(
                "SELECT h.topic, h.key, h.dead_letter_id, h.released_at IS NOT NULL, d.id IS NOT NULL, "
                "d.retried_at IS NOT NULL OR d.discarded_at IS NOT NULL "
                "FROM {holds} h LEFT JOIN {dead} d ON d.id = h.dead_letter_id"
            ).format(holds=t.holds, dead=t.dead_letters)
        ).fetchall()
        orphans = conn.execute(
            sql.SQL(
                "SELECT x.topic, x.key, count(*) FROM {held} x WHERE NOT EXISTS "
                "(SELECT 1 FROM {holds} h WHERE h.topic = x.topic AND h.key = x.key) GROUP BY 1, 2"
            ).format(held=t.held, holds=t.holds)
        ).fetchall()
    found = []
    for topic, key, letter, released, exists, closed in holds:
        if released:
            found.append(f"hold {topic}/{key!r} released and still there once the relays finished")
        elif not exists or closed:
            found.append(f"hold {topic}/{key!r} without its open dead letter {letter} (exists={exists})")
    found += [f"held rows without a hold: {topic}/{key!r}: {n}" for topic, key, n in orphans]
    return found


def _last_operator_step(ctx: Context, good: set[str | None], rounds: int = 20) -> list[str]:
    """Retry the dead letters of good rows (each is a finding already), discard the bad rows' ones, and again for
    those the released rows bring (a bad row held behind another of its key is dead-lettered only once released),
    until no dead letter is open and no row is held."""
    table = ctx.outbox.table
    for _ in range(rounds):
        with admin(ctx.outbox) as conn:
            query = sql.SQL("SELECT id, message_id::text FROM {} WHERE retried_at IS NULL AND discarded_at IS NULL")
            letters = conn.execute(query.format(table.dead_letters)).fetchall()
            held = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table.held)).fetchone()
        if not letters and held == (0,):
            return []
        retry = [f"--id={letter}" for letter, message_id in letters if message_id in good]
        discard = [f"--id={letter}" for letter, message_id in letters if message_id not in good]
        if retry:
            ctx.cli("dead-letters", "retry", *retry)
        if discard:
            ctx.cli("dead-letters", "discard", *discard, "--reason", "harness: end of run")
        if problems := _finished(
            ctx.outbox, ctx.relaying.strategy, "after the last dead letters were retried or discarded", ctx.setup
        ):
            return problems
    return [f"dead letters or held rows still there after {rounds} rounds of retry and discard"]


def _held(outbox: Outbox) -> set[str]:
    with admin(outbox) as conn:
        query = sql.SQL("SELECT message_id::text FROM {}").format(outbox.table.held)
        return {str(row[0]) for row in conn.execute(query).fetchall()}


def _dead_letters(outbox: Outbox) -> list[DeadRow]:
    with admin(outbox) as conn:
        rows = conn.execute(
            sql.SQL(
                "SELECT message_id::text, coalesce(last_error, ''), attempts, retried_at IS NOT NULL, "
                "discarded_at IS NOT NULL, extract(epoch FROM coalesce(retried_at, discarded_at))::float8 FROM {}"
            ).format(outbox.table.dead_letters)
        ).fetchall()
    return [DeadRow(*row) for row in rows]
