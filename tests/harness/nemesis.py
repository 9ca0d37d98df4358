"""The nemesis: faults of processes, network and servers, each one function registered with its lane and weight
(schedule.py draws them), and the executor that plays a schedule: one thread per lane (the server, each worker slot,
the operator), each running its events in order at their times. Every event becomes a Span in the run's timeline:
from its start to its end (a freeze to its thaw, a kill to the replacement's start), which the checker reads to know
when a worker was not serving and when the whole system was down.

For ``wal`` the same faults apply (one relay streams the slot, the others wait to take over), ending the relays'
own sessions is told apart (``terminate_backends``), and one more applies to it alone: a transaction left open on
the database while everything else commits (``long_transaction``), which holds nothing back there.
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Literal

import psycopg

from outbox_pipeline.store.wal.objects import names_of

from .cluster import admin, wait_for_server
from .context import Context, Span
from .schedule import ALL, WAL, WAL_ONLY, Event, Registered, Registry, Schedule, Setup
from .writers import LongTransaction

FAULTS = Registry()


def _freeze_s(rng: random.Random, setup: Setup) -> float:
    """Half of them short (a GC pause, a slow node), half around and past ``lease_s`` (a hung worker)."""
    return rng.uniform(0.1, 1.0) if rng.random() < 0.5 else rng.uniform(0.5 * setup.lease_s, 2.5 * setup.lease_s)


@FAULTS.action("worker", 2, strategies=ALL, duration=_freeze_s)
def freeze(ctx: Context, event: Event) -> str:
    """SIGSTOP a worker, SIGCONT it after the duration: its session stays alive, its leases run out."""
    assert event.slot is not None
    worker = ctx.pool.slots[event.slot]
    worker.freeze()
    try:
        ctx.stop.wait(event.duration_s)
    finally:
        worker.thaw()
    return worker.name


@FAULTS.action("worker", 1.5, strategies=ALL)
def kill(ctx: Context, event: Event) -> str:
    """SIGKILL a worker and start its replacement under a NEW worker id (a Deployment's pod)."""
    assert event.slot is not None
    with ctx.pool.lock:  # a switch of strategy replaces every slot meanwhile: this one kills what is there after it
        old = ctx.pool.slots[event.slot].name
        return f"{old} -> {ctx.pool.replace(event.slot).name}"


# A kafka-cut whose choice has this bit ends with the worker killed while still cut off (and replaced, as a kill
# does): what it had handed to Kafka never arrives. Drawn choices are below it (schedule.py): chosen schedules set it.
KILL_WHILE_CUT = 1 << 30


@FAULTS.action("worker", 1.5, strategies=ALL, duration=lambda rng, setup: rng.uniform(0.5, 2.5 * setup.lease_s))
def kafka_cut(ctx: Context, event: Event) -> str:
    """Cut one worker off from the broker only (PostgreSQL stays reachable): its connections break, new ones drop.
    The worker is picked as a kill picks it (after a switch of strategy in progress: its new worker)."""
    assert event.slot is not None
    with ctx.pool.lock:
        worker = ctx.pool.slots[event.slot]
    cut = ctx.servers.proxy.isolate(worker.pid)
    killed = ""
    try:
        ctx.stop.wait(event.duration_s)
        if event.choice & KILL_WHILE_CUT:
            with ctx.pool.lock:
                if ctx.pool.slots[event.slot] is worker:
                    killed = f"; killed while cut off -> {ctx.pool.replace(event.slot).name}"
    finally:
        ctx.servers.proxy.rejoin(worker.pid)
    return f"{worker.name}: {cut} connections cut{killed}"


@FAULTS.action("server", 2, strategies=ALL)
def terminate_backends(ctx: Context, event: Event) -> str:
    """pg_terminate_backend of the relays' sessions: of one worker (odd choice) or of every relay process."""
    if ctx.relaying.strategy == WAL:
        return _terminate_wal(ctx, event)
    worker = ctx.pool.slots[event.choice % len(ctx.pool.slots)].spec["worker_id"]
    pattern = f"outbox {worker}" if event.choice % 2 else "outbox %"
    with admin(ctx.outbox) as conn:
        ended = conn.execute(
            "SELECT count(*), count(DISTINCT application_name) FROM ("
            " SELECT pg_terminate_backend(pid), application_name FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name LIKE %s AND pid <> pg_backend_pid()) t",
            (pattern,),
        ).fetchone()
    assert ended is not None
    return f"{ended[0]} sessions of {ended[1]} relays ({pattern!r})"


# The wal relay's sessions: its ordinary one (the leader's lock; application_name set by relay/wal/leader.py) and the
# walsender of its stream (a replication connection: no application name, but the only walsenders on this database).
_WAL_SESSIONS = """
    SELECT count(*), count(*) FILTER (WHERE walsender) FROM (
        SELECT pg_terminate_backend(pid), backend_type = 'walsender' AS walsender FROM pg_stat_activity
        WHERE datname = current_database() AND pid <> pg_backend_pid()
          AND (backend_type = 'walsender' OR (application_name = 'outbox-relay-wal' AND %(every)s))) t
"""


def _terminate_wal(ctx: Context, event: Event) -> str:
    """wal: the walsender alone (odd choice: the stream breaks under the streamer, its lock stays) or every relay's
    sessions (the streamer's lock and stream, the waiting relays' sessions). Only the streamer publishes: one relay
    hit either way."""
    with admin(ctx.outbox) as conn:
        ended = conn.execute(_WAL_SESSIONS, {"every": event.choice % 2 == 0}).fetchone()
    assert ended is not None
    what = "every wal relay session" if event.choice % 2 == 0 else "the walsender"
    return f"{ended[0]} sessions ({ended[1]} walsenders) of 1 relays ({what})"


@FAULTS.action("server", 1, strategies=ALL, duration=lambda rng, setup: rng.uniform(0.0, 2.0))
def pg_restart(ctx: Context, event: Event) -> str:
    """Stop PostgreSQL (fast, or immediate: a crash), keep it down for the duration, start it again. With ``choice``'s
    second bit a CHECKPOINT comes first: a crash then keeps the slot's confirmed position, where without one it goes
    back to the last checkpoint's and hides what a relay confirmed too early (docs/faults.md, mutation runs)."""
    mode: Literal["fast", "immediate"] = "immediate" if event.choice % 2 else "fast"
    before = _slot_confirmed(ctx) if ctx.relaying.strategy == WAL else None
    if event.choice & 2:
        with admin(ctx.outbox) as conn:
            conn.execute("CHECKPOINT")
        mode_note = f"{mode} after a checkpoint"
    else:
        mode_note = mode
    ctx.servers.pg.stop(mode, force=True)
    try:
        time.sleep(event.duration_s)  # not cut short by the end of the nemesis: the server must come back
    finally:
        ctx.servers.pg.start()
        wait_for_server(ctx.outbox)
    if before is None:
        return mode_note
    return f"{mode_note}; slot confirmed {before} -> {_slot_confirmed(ctx)}"


def _slot_confirmed(ctx: Context) -> int:
    """wal: the slot's confirmed position as PostgreSQL holds it (in memory; after a restart, as it last saved it: a
    relay that takes the stream over before the streamer confirmed again starts there, ledger.py)."""
    with admin(ctx.outbox) as conn:
        row = conn.execute(
            "SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots WHERE slot_name = %s",
            (names_of(ctx.outbox.table).slot,),
        ).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


@FAULTS.action("server", 1, strategies=ALL, duration=lambda rng, setup: rng.uniform(0.5, 4.0))
def broker_freeze(ctx: Context, event: Event) -> str:
    """SIGSTOP the broker: every connection stays open and nothing is answered."""
    ctx.servers.broker.freeze()
    try:
        ctx.stop.wait(event.duration_s)
    finally:
        ctx.servers.broker.thaw()
    return ""


@FAULTS.action("server", 0.5, strategies=ALL)
def broker_restart(ctx: Context, event: Event) -> str:
    """kill -9 the broker and start it again, its log directory kept (Apache Kafka: every acknowledged record stays).
    A broker that keeps its records in memory (Tansu) would lose them: skipped there."""
    broker = ctx.servers.broker
    if not broker.durable:
        return f"skipped: {broker.name} keeps its records in memory (OUTBOX_TEST_BROKER=kafka)"
    broker.kill()
    broker.start()
    return f"{broker.name} killed and started again"


@FAULTS.action("server", 1.5, strategies=WAL_ONLY, duration=lambda rng, setup: rng.uniform(1.0, 2 * setup.lease_s))
def long_transaction(ctx: Context, event: Event) -> str:
    """A transaction that emits a message under every key of the writers, then stays open for the duration while
    everything else commits (wal: it holds nothing back; its messages go when it commits, after what committed
    meanwhile), then commits; one in four rolls back (nothing of it may arrive)."""
    txn = LongTransaction(ctx.outbox, ctx.setup, event.choice)
    ctx.record(txn.written)
    note = txn.begin()
    if not txn.failed:
        ctx.stop.wait(event.duration_s)
        note = txn.end(commit=event.choice % 4 != 0)
    return note


class Nemesis:
    """Plays a schedule against a context: ``start()``, then ``stop()`` ends every lasting action at once (thawed,
    rejoined, restarted) and waits for the lanes."""

    def __init__(self, ctx: Context, schedule: Schedule, actions: Mapping[str, Registered]) -> None:
        self.ctx, self.actions = ctx, actions
        self.lanes: dict[tuple[str, int | None], list[Event]] = defaultdict(list)
        for event in schedule.events:
            self.lanes[(actions[event.action].spec.lane, event.slot)].append(event)
        self.threads: list[threading.Thread] = []
        self.errors: list[str] = []
        self.t0 = 0.0
        # A chosen schedule (Schedule.chosen): each switch's end, which the events after it wait for.
        self.switches = [e for e in schedule.events if e.to is not None] if schedule.chosen else []
        self.switched = {e.at_s: threading.Event() for e in self.switches}
        self.switched_at: dict[float, float] = {}

    def start(self) -> None:
        self.t0 = time.monotonic()
        for lane, events in sorted(self.lanes.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
            thread = threading.Thread(target=self._play, args=(events,), name=f"nemesis-{lane[0]}-{lane[1]}")
            thread.start()
            self.threads.append(thread)

    def stop(self) -> None:
        self.ctx.stop.set()
        for thread in self.threads:
            thread.join()

    def join(self, timeout_s: float) -> None:
        """Wait, up to ``timeout_s`` in all, for every lane to have played its events (a chosen schedule's events
        after a slow switch come later than planned)."""
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _due(self, event: Event) -> float | None:
        """When the event is due (monotonic); after a switch of a chosen schedule, timed from the switch's actual end
        once it has ended (None: the run stopped first)."""
        before = [s for s in self.switches if s.at_s < event.at_s]
        if not before:
            return self.t0 + event.at_s
        switch = before[-1]
        while not self.switched[switch.at_s].wait(0.2):
            if self.ctx.stop.is_set():
                return None
        return self.switched_at[switch.at_s] + event.at_s - (switch.at_s + switch.duration_s)

    def _play(self, events: list[Event]) -> None:
        for event in events:
            due = self._due(event)
            if due is None or self.ctx.stop.wait(max(0.0, due - time.monotonic())):
                return
            start = time.time()
            action, relaying = self.actions[event.action], self.ctx.relaying
            if not relaying.applies(action.spec):  # drawn for the strategy a switch given up would have set
                self.ctx.timeline.add(Span(event.action, event.slot, start, start, f"skipped: not for {relaying}"))
                continue
            try:
                note = action.run(self.ctx, event)
            except psycopg.OperationalError as exc:  # the server is restarting: an operator tries again later
                note = f"server unreachable: {str(exc).strip().splitlines()[0][:120]}"
            except Exception as exc:
                note = f"ERROR {type(exc).__name__}: {str(exc).strip()[:300]}"
                with self.ctx.lock:
                    self.errors.append(f"{event}: {note}")
            self.ctx.timeline.add(Span(event.action, event.slot, start, time.time(), note))
            if event.at_s in self.switched and event.to is not None:
                self.switched_at[event.at_s] = time.monotonic()
                self.switched[event.at_s].set()
