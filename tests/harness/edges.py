"""The wal lane at its edges (issue 50): faults the review replayed against a wal outbox, so that the harness finds the
next ones of their kind. Each is one function registered with the nemesis's or the operator's registry, for wal alone
(``WAL_ONLY``: the table strategies' schedules are what they were). Where a fault is made of faults the checker
already knows (a crash restart, a freeze of a worker, a cut from Kafka), it adds their spans to the timeline as they
happen, so that the duplicates and the silences are judged as for those.

- ``storage-snapshot``: a crash-consistent snapshot of PostgreSQL's data directory taken and restored under the
  running relays; the commits between are undone by the restore (the span's note says when: ledger.py);
- ``sender-timeout``: ``wal_sender_timeout`` shorter than the takeover time while the streamer is frozen past it;
- ``stale-thaw``: the streamer cut from Kafka with a batch in its producer, frozen past the takeover, thawed after
  newer values of the batch's keys were published (with a long ``message.timeout.ms`` its batch still goes out);
- ``forged-emit``: a role without grants emits under the outbox's prefix, a well-formed message and malformed ones;
- ``replica-insert``: a plain INSERT into the wal outbox's table under ``session_replication_role = replica``;
- ``switch-from-wal``: ``outbox switch-strategy`` tried on the wal outbox (it must be refused, exit 2).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from outbox_pipeline import Message, enqueue_many
from outbox_pipeline.relay.wal.leader import WAL_LEADER_LOCK_CLASS
from outbox_pipeline.store.wal.format import encode, prefix_of
from tests.kit.workers import WorkerProcess

from .cluster import APP_ROLE, INTRUDER_ROLE, admin, wait_for_server
from .context import Context, Span
from .isolation import _client_ports
from .nemesis import FAULTS, _slot_confirmed
from .operators import OPERATIONS
from .relays import WorkerPool
from .schedule import TABLE_STRATEGIES, WAL_ONLY, Event
from .writers import Written, writer_keys

UNDONE = "undid the commits from {start:.3f} to {end:.3f}"  # read back by ledger.py (storage-snapshot's note)
STALE_KEYS = 10  # stale-thaw's own keys: no writer writes them, so nothing newer follows its second transaction
STALE_BATCHES = 50  # stale-thaw's first transaction, in the relays' batches: cut when half of them were handed over


def _restart(ctx: Context, mode_note: str, between: list[str]) -> tuple[float, float]:
    """Stop PostgreSQL immediately (a crash), run ``between`` (a copy) while it is down, start it; the span of a
    ``pg-restart`` with the slot's positions before and after, as the nemesis's own restart notes them. Returns when
    it began to stop and when it was down (no commit returns between that and the start)."""
    start = time.time()
    before = _slot_confirmed(ctx)
    ctx.servers.pg.stop("immediate", force=True)
    down = time.time()
    try:
        subprocess.run(["sh", "-c", " && ".join(between)], check=True, capture_output=True, timeout=120)
    finally:
        ctx.servers.pg.start()
        wait_for_server(ctx.outbox)
    end = time.time()
    ctx.timeline.add(
        Span(
            "pg-restart",
            None,
            start,
            end,
            f"immediate ({mode_note}); slot confirmed {before} -> {_slot_confirmed(ctx)}",
        )
    )
    return start, down


@FAULTS.action("server", 1, strategies=WAL_ONLY, duration=lambda rng, setup: rng.uniform(1.0, setup.lease_s))
def storage_snapshot(ctx: Context, event: Event) -> str:
    """A storage snapshot (crash-consistent: the server stopped immediately, its data directory copied) and, the
    duration later and once the relays confirmed past the snapshot, its restore (stopped immediately, the copy put
    back): the same system identifier and timeline, the relays' processes outliving it, the server's log kept.
    Commits between the two are undone. The relays come back late, as after a long back-off: frozen from the restore
    until the WAL written since reaches where they had confirmed (a relay that trusts its own position over the
    slot's then resumes past the new commits)."""
    data = Path(ctx.servers.pg.spec.data_dir).absolute()
    copy = ctx.servers.directory / f"snapshot-{event.choice}"
    taken, _ = _restart(ctx, "snapshot", [f"cp -a '{data}' '{copy}'", f"rm -f '{copy}/server.log'"])
    try:
        since = _wal_end(ctx)
        ctx.stop.wait(event.duration_s)
        _wait_for(lambda: _slot_confirmed(ctx) > since, 3 * ctx.setup.lease_s)  # the relays confirmed past it
        reached = _slot_confirmed(ctx)
    finally:
        restore = [
            f"find '{data}' -mindepth 1 -maxdepth 1 ! -name server.log -exec rm -rf {{}} +",
            f"cp -a '{copy}/.' '{data}/'",
        ]
        with _all_frozen(ctx, "storage-snapshot: back late"):
            _, restored = _restart(ctx, "restore", restore)
            passed = _wait_for(lambda: _wal_end(ctx) > reached, 3 * ctx.setup.lease_s)
        shutil.rmtree(copy, ignore_errors=True)
    late = "once the WAL passed" if passed else "the WAL not past"
    return UNDONE.format(start=taken, end=restored) + f"; the relays back {late} {reached}"


@contextlib.contextmanager
def _all_frozen(ctx: Context, why: str) -> Iterator[None]:
    """Every worker slot frozen meanwhile, with a freeze span each (every worker frozen at once: an outage)."""
    with ctx.pool.lock:
        workers = [(slot, w) for slot, w in enumerate(ctx.pool.slots) if w.alive()]
    start = time.time()
    for _, worker in workers:
        worker.freeze()
    try:
        yield
    finally:
        for slot, worker in workers:
            worker.thaw()
            ctx.timeline.add(Span("freeze", slot, start, time.time(), f"{worker.name} ({why})"))


def _wal_end(ctx: Context) -> int:
    with admin(ctx.outbox) as conn:
        row = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
    return int(row[0]) if row else 0


def _wait_for(condition: Callable[[], bool], within_s: float) -> bool:
    """Whether ``condition`` held within ``within_s`` (a fault's own bounded wait, the writers writing meanwhile)."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _streamer(ctx: Context) -> int | None:
    """The slot of the worker that streams now: the one whose session holds the leader's lock (a drain, or nobody,
    may hold it instead: None)."""
    with admin(ctx.outbox) as conn:
        row = conn.execute(
            "SELECT a.client_port FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = "
            "'advisory' AND l.classid = %s::oid AND l.granted AND l.database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())",
            (WAL_LEADER_LOCK_CLASS,),
        ).fetchone()
    if row is None or row[0] is None:
        return None
    port = ctx.servers.pg.spec.port
    with ctx.pool.lock:
        return next(
            (i for i, w in enumerate(ctx.pool.slots) if w.alive() and row[0] in _client_ports(w.pid, port)), None
        )


def _frozen(ctx: Context, slot: int, seconds: float, why: str) -> None:
    """Freeze a slot's worker for ``seconds`` (cut short by the end of the nemesis), with the span of a freeze."""
    pool: WorkerPool = ctx.pool
    worker, start = pool.slots[slot], time.time()
    worker.freeze()
    try:
        ctx.stop.wait(seconds)
    finally:
        worker.thaw()
        ctx.timeline.add(Span("freeze", slot, start, time.time(), f"{worker.name} ({why})"))


def _set_sender_timeout(ctx: Context, value: str | None) -> None:
    with admin(ctx.outbox) as conn:
        if value is None:
            conn.execute("ALTER SYSTEM RESET wal_sender_timeout")
        else:
            conn.execute(sql.SQL("ALTER SYSTEM SET wal_sender_timeout = {}").format(sql.Literal(value)))
        conn.execute("SELECT pg_reload_conf()")


@FAULTS.action("server", 1, strategies=WAL_ONLY, duration=lambda rng, setup: rng.uniform(1.7, 2.5) * setup.lease_s)
def sender_timeout(ctx: Context, event: Event) -> str:
    """``wal_sender_timeout`` shorter than the takeover time (ALTER SYSTEM, reloaded) while the streamer is frozen
    past the takeover time: its walsender is gone before a waiting relay judges it frozen; then back to the default."""
    slot = _streamer(ctx)
    if slot is None:
        return "no worker streams"
    timeout_ms = int(ctx.setup.lease_s * 1000 * 0.4)
    _set_sender_timeout(ctx, f"{timeout_ms}ms")
    try:
        _frozen(ctx, slot, event.duration_s, f"wal_sender_timeout {timeout_ms} ms")
    finally:
        wait_for_server(ctx.outbox)
        _set_sender_timeout(ctx, None)
    return f"slot {slot} frozen {event.duration_s:.1f}s with wal_sender_timeout {timeout_ms} ms"


def _stale_transaction(ctx: Context, choice: int, value: int, per_key: int) -> tuple[float, int, str]:
    """One transaction of ``per_key`` messages under each of stale-thaw's own keys (no writer writes them), the
    ledger's (recorded for the checker); returns the monotonic time its COMMIT returned, its last message's LSN and
    a note."""
    topic = ctx.outbox.topics[choice % 2]
    keys = [f"stale-{choice % 1000}-{i}" for i in range(STALE_KEYS)]
    written = [
        Written("stale-thaw", topic, key, {"stale": choice, "value": value, "n": n}, {}, tx=choice * 2 + value)
        for n in range(per_key)
        for key in keys
    ]
    ctx.record(written)
    try:
        with psycopg.connect(ctx.outbox.app_dsn, connect_timeout=5) as conn:
            stored = enqueue_many(conn, [Message(w.topic, w.payload, w.key) for w in written], table=ctx.outbox.table)
            for w, row in zip(written, stored, strict=True):
                w.message_id, w.outcome = str(row.message_id), "in-doubt"
            sent = time.monotonic()
        now, returned = time.time(), time.monotonic()
    except psycopg.Error as exc:
        for w in written:
            w.outcome, w.error = ("failed" if w.outcome == "unsent" else w.outcome), str(exc).strip()[:200]
        return time.monotonic(), 0, f"value {value} not written: {type(exc).__name__}"
    for w in written:
        w.outcome, w.committed_at, w.sent_at, w.returned_at = "committed", now, sent, returned
    return returned, stored[-1].id, f"value {value}: {len(written)} messages"


def _just_handed_over(worker: WorkerProcess) -> None:
    """Return as soon as the worker hands its next batch to its producer (its events file says so), within the
    producer's linger (librdkafka's 5 ms): the batch is not on the wire yet. Bounded."""
    events = worker.directory / f"{worker.name}.events"
    size, deadline = events.stat().st_size, time.monotonic() + 2.0
    while time.monotonic() < deadline:
        grown = events.stat().st_size
        if grown > size and b" produce " in events.read_bytes()[size:grown]:
            return
        size = grown


@FAULTS.action("server", 1, strategies=WAL_ONLY, duration=lambda rng, setup: rng.uniform(1.6, 2.2) * setup.lease_s)
def stale_thaw(ctx: Context, event: Event) -> str:
    """A thaw after a takeover: a large transaction under keys of this fault's own; while the streamer publishes it
    (half its batches handed over), the streamer frozen just as it hands a batch to its producer (not sent yet), its
    connections to Kafka ended, frozen past the takeover time; meanwhile a second transaction gives each key a newer
    value, which the relay that took over publishes (the slot confirmed past it); then the first thaws. With a long
    ``message.timeout.ms`` its producer still sends the stale batch: the last record of a key is not its newest."""
    slot = _streamer(ctx)
    if slot is None:
        return "no worker streams"
    worker = ctx.pool.slots[slot]
    committed, _, first = _stale_transaction(ctx, event.choice, 1, STALE_BATCHES * ctx.setup.batch_size // STALE_KEYS)
    half = STALE_BATCHES // 2  # what it had to publish before it is less than that
    inside = _wait_for(lambda: sum(e.step == "produce" and e.t > committed for e in worker.events()) >= half, 10.0)
    _just_handed_over(worker)
    worker.freeze()  # its producer's threads too: the batch it was just handed stays in its queue
    frozen_at = time.time()
    ctx.servers.proxy.isolate(worker.pid)  # its connections to Kafka go; frozen, it opens none before it thaws
    ctx.servers.proxy.rejoin(worker.pid)
    try:
        _, newest, second = _stale_transaction(ctx, event.choice, 2, 1)
        ctx.stop.wait(event.duration_s)
        _wait_for(lambda: _slot_confirmed(ctx) > newest, 3 * ctx.setup.lease_s)  # the newer values are in Kafka
    finally:
        worker.thaw()
        ctx.timeline.add(Span("freeze", slot, frozen_at, time.time(), f"{worker.name} (stale-thaw)"))
    return f"slot {slot}: {first} ({'frozen while publishing it' if inside else 'frozen'}); {second}; thawed"


@OPERATIONS.action("operator", 1, strategies=WAL_ONLY)
def forged_emit(ctx: Context, event: Event) -> str:
    """A role with no grant on the outbox's schema emits under its prefix: a well-formed forged message (a phantom if
    it arrives), one whose headers are not JSON under a writer's key (a poison message holding that key) and bytes
    that are no message at all. Never recorded as written: what of them reaches Kafka or the dead letters is forged."""
    topic = ctx.outbox.topics[event.choice % 2]
    key = writer_keys(ctx.setup.encoding == "UTF8")[event.choice % 12].encode()
    forged = [
        encode(
            str(uuid.uuid4()).encode(), topic.encode(), key, None, b"{}", b'{"forged": 1}', binary=False, partition=None
        ),
        encode(
            str(uuid.uuid4()).encode(),
            topic.encode(),
            key,
            None,
            b"{no",
            b'{"forged": 2}',
            binary=False,
            partition=None,
        ),
        b"forged: not an outbox message",
    ]
    dsn = ctx.outbox.app_dsn.replace(f"//{APP_ROLE}:", f"//{INTRUDER_ROLE}:", 1)
    outcomes = []
    with psycopg.connect(dsn, connect_timeout=5, autocommit=True) as conn:
        for content in forged:
            try:
                conn.execute(
                    "SELECT pg_logical_emit_message(true, %s, %s::bytea)", (prefix_of(ctx.outbox.table.schema), content)
                )
                outcomes.append("emitted")
            except psycopg.errors.InsufficientPrivilege:
                outcomes.append("refused")
    return f"as {INTRUDER_ROLE} under key {key.decode()!r}: {', '.join(outcomes)}"


# A row as a dump (or a subscription's apply) writes it: every column named, the triggers' ones too.
_RESTORED_ROW = (
    "INSERT INTO {} (message_id, topic, key, payload, headers, partition) VALUES (%s, %s, %s, %s, '{{}}', %s)"
)


@OPERATIONS.action("operator", 1, strategies=WAL_ONLY)
def replica_insert(ctx: Context, event: Event) -> str:
    """What pg_restore --disable-triggers and logical replication's apply do: a plain INSERT into the wal outbox's
    table under ``session_replication_role = replica`` (the emitting trigger does not fire). Each message is good
    if stored (it must then be relayed) and may be refused (the fix refuses it): never expected then."""
    keys = writer_keys(ctx.setup.encoding == "UTF8")
    written = [
        Written(
            "replica-insert",
            ctx.outbox.topics[(event.choice + n) % 2],
            keys[(event.choice + n) % len(keys)],
            {"replica": event.choice, "n": n},
            {},
            message_id=str(uuid.uuid4()),
            tx=event.choice,
            refusable=True,
        )
        for n in range(1 + event.choice % 3)
    ]
    ctx.record(written)
    try:
        with admin(ctx.outbox) as conn, conn.transaction():
            conn.execute("SET LOCAL session_replication_role = replica")
            for w in written:
                conn.execute(
                    sql.SQL(_RESTORED_ROW).format(ctx.outbox.table.messages),
                    (w.message_id, w.topic, w.key, Jsonb(w.payload), event.choice % 4),  # what a dump holds
                )
            for w in written:
                w.outcome = "in-doubt"
            sent = time.monotonic()
        now, returned = time.time(), time.monotonic()
    except psycopg.OperationalError as exc:
        for w in written:
            w.outcome, w.error = ("failed" if w.outcome == "unsent" else w.outcome), str(exc).strip()[:200]
        return f"not written: {type(exc).__name__}"
    except psycopg.Error as exc:
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
        for w in written:
            w.outcome, w.error = "refused", error
        return f"{len(written)} refused: {error}"
    for w in written:
        w.outcome, w.committed_at, w.sent_at, w.returned_at = "committed", now, sent, returned
    return f"{len(written)} stored under session_replication_role = replica"


@OPERATIONS.action("operator", 1, strategies=WAL_ONLY)
def switch_from_wal(ctx: Context, event: Event) -> str:
    """The switch procedure of docs/operations.md tried on the wal outbox: `outbox indexes --strategy T`, then
    `outbox switch-strategy --to T`, which must be refused (exit 2, saying why: ledger.py)."""
    target = TABLE_STRATEGIES[event.choice % len(TABLE_STRATEGIES)]
    mode = "mark-sent" if target in ("locking", "advisory", "lease") and event.choice >> 8 & 1 else "delete"
    # A server fault may still hold the server down (a snapshot's restore waits for the relays): a switch refused for
    # an unreachable server says nothing about wal, so the attempt waits for the server as an operator would.
    wait_for_server(ctx.outbox)
    indexes = ctx.cli("indexes", "--strategy", target)
    return f"{indexes}; {ctx.cli('switch-strategy', '--to', target, '--mode', mode)}"
