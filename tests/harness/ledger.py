"""The checker: what the writers committed, what arrived in Kafka, what the database says at the end and what the
nemesis did when, held against the product's promises. Each finding is one line naming the check.

- every committed good row is in Kafka, with its key, value and headers as written on every copy (a key is its UTF-8
  bytes whatever the database's encoding), and nothing arrives that no one committed;
- per key, first arrivals in the strategy's order (partitioned: (transaction id, id); serialized: id, = commit order;
  advisory: id, except a row committed after a higher id went out); locking and lease keep no order
  (docs/strategies.md). Across a switch of strategy the order is
  promised only where both keep it: a first copy belongs to the strategy that relayed when it was stamped, and the
  key's first copies are checked within each stretch of ordered strategies (partitioned then serialized, or back,
  is one stretch, by (transaction id, id): the run's writers took the serialized lock before their first write, so
  that order is also their ids'); a stretch of a row strategy is not checked;
- duplicates within the documented bound, per fault that did something (duplicates.py): IN_FLIGHT_BATCHES batches
  per relay it hit (tests/faults/helpers), one per failed attempt of a dead-lettered row, plus what an operator
  replayed on purpose, plus what each switch publishes again (the rows relayed past its new positions,
  docs/operations.md), plus a fault per worker it killed; per row, no more copies than those could make; across each
  switch, no more than it and the faults just before it publish again;
- every bad row refused at enqueue or dead-lettered with its reason, never delivered; no good row dead-lettered;
- no hold left without its open dead letter (checked by the run before its last operator step);
- no partition silent longer than ``lease_s`` plus a steal while a keyed row of it waited and a worker could serve it
  (silences.py);
- no password in any process's output or log; no traceback or hang from an operator command, and its exit code read
  with what it printed (exits.py).

A wal outbox (issue 42) keeps no rows, so its ledger is what the writers committed (``Written``: each message's id,
its writer's transaction, when that transaction's COMMIT was sent and when it returned), and two of the promises are
checked otherwise:
- order: the slot streams transactions in the order of their commit records, which the writers cannot see across
  connections. What the ledger can prove is checked, per key, on first copies in log order: a transaction whose COMMIT
  returned before another's COMMIT was sent committed first (its commit record was in the WAL before the other's was
  written; this covers one writer's own transactions, one after the other on its connection, and the long
  transaction left open by the nemesis against every transaction that committed while it was open), and the
  messages of one transaction arrive in the order they were written. Transactions whose commits overlapped in time
  are not ordered by the check;
- duplicates: only the streaming relay publishes. What it publishes again after a fault is what it had published and
  not confirmed to the slot: the batch in Kafka (``batch_max``, the run's batch size), a batch more that a thawed,
  cut off or restarted streamer's producer still sends or that it read ahead from its stream, and the part of one
  transaction split across two batches (the slot is confirmed only at a transaction's end: at most the largest
  transaction less one). So ``IN_FLIGHT_BATCHES`` batches plus the largest transaction per fault, counting one per
  fault since only the streamer publishes (a drain beside it may take the stream over; a broker frozen for longer
  than the producers' message timeout counts once more per timeout: each batch handed to it may be appended when it
  thaws), plus the held messages a
  released key published (published again if a fault comes before their hold is ended), plus one batch per failed
  attempt of a dead-lettered message. And what a PostgreSQL crash made the slot forget: PostgreSQL writes a slot's
  confirmed position down only now and then; the streamer resumes from its own, but a relay that takes the stream
  over before the streamer confirmed again starts from the saved one. The pg-restart fault notes both positions;
  allowed: the messages between them (their positions are the records' ``outbox_id``) and, for the transactions
  that had begun before the saved position and committed after it, the largest transaction per writer connection.
"""

from __future__ import annotations

import bisect
import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tests.faults.helpers import TimedRecord

from . import duplicates, exits
from .context import CliResult, Span, Switch
from .relays import MESSAGE_TIMEOUT_MS
from .schedule import POSITION_STRATEGIES, WAL, Setup
from .silences import STEAL_S, Stall, silences
from .writers import BAD_ROWS, Written

# Defects the harness found and reported, not fixed yet: a finding (or a failed command's whole output) that matches
# is listed as KNOWN instead of failing the run. Remove an entry with its fix: the harness then fails on it again.
KNOWN_DEFECTS: dict[str, re.Pattern[str]] = {
    # Fixed: after a PostgreSQL crash the slot streamed again a message whose dead letter the operator had discarded
    # meanwhile, and the wal relay held its key behind the closed dead letter for good (found by the wal CI schedule,
    # 2026-11-29; relay/wal/holds.py dead_letters_not_confirmed: a dead letter the stream sends again is skipped).
    # Fixed: `outbox relay --until-empty` crashed when the database went away as it asked what is still pending
    # (seeds 7 partitioned, 22 locking); a plain INSERT stored a header named as the relay's own and the relay sent
    # both (seed 66 partitioned).
}


@dataclass(frozen=True)
class DeadRow:
    message_id: str
    error: str
    attempts: int
    retried: bool
    discarded: bool
    closed_at: float | None = None  # when it was retried or discarded (wall clock): its key's hold ended


@dataclass
class Evidence:
    """Everything a run leaves for the checker."""

    setup: Setup
    written: list[Written]
    records: list[TimedRecord]
    dead: list[DeadRow]
    order: dict[str, tuple[int, int]]  # message_id -> (transaction id, id): its place in the ordered strategies' orders
    spans: list[Span]
    replayed: list[tuple[str, int]]
    commands: list[CliResult]
    outputs: dict[str, str]  # every process's output and the servers' logs, by name
    secret: str
    problems: list[str] = field(default_factory=list)  # found by the run itself: holds, leftovers, exits, errors
    switches: list[Switch] = field(default_factory=list)  # the switches of strategy done, in order
    # wal: the held messages behind each dead letter the operator released, counted before the command ran
    released: list[int] = field(default_factory=list)
    held: set[str] = field(default_factory=set)  # message ids still held (outbox_held) at the end


@dataclass
class Verdict:
    findings: list[str]
    figures: dict[str, object]
    known: list[str] = field(default_factory=list)  # findings of a defect already reported (KNOWN_DEFECTS)

    @property
    def ok(self) -> bool:
        return not self.findings


def check(ev: Evidence) -> Verdict:
    committed = {w.message_id: w for w in ev.written if w.outcome == "committed" and w.message_id}
    in_doubt = {w.message_id for w in ev.written if w.outcome == "in-doubt" and w.message_id}
    good = {m: w for m, w in committed.items() if w.good}
    first, copies = _arrivals(ev.records)
    dead: dict[str, list[DeadRow]] = defaultdict(list)
    for d in ev.dead:
        dead[d.message_id].append(d)

    discarded_good = {m for m in good if m not in first and any(d.discarded for d in dead.get(m, []))}
    undone = _undone_by_restore(ev.spans, committed)
    lost = set(good) - set(first) - discarded_good - undone
    phantom = set(first) - set(committed) - in_doubt
    findings = [
        *ev.problems,
        *_some("lost: committed, never in Kafka", sorted(lost)),
        *_some("phantom: in Kafka, committed by no one", sorted(phantom)),
        *_some("corrupted: arrived other than written", [p for r in ev.records for p in _corrupted(good, r)]),
        *(
            f"good row dead-lettered: {m} ({good[m].writer}): {rows[-1].error[:200]}"
            for m, rows in sorted(dead.items())
            if m in good
        ),
        *_bad_rows([w for w in ev.written if w.message_id not in undone], first, dead, ev.held),
        *_some(
            "good row refused at enqueue",
            [
                f"{w.writer} {w.key!r}: {w.error}"
                for w in ev.written
                if w.good and w.outcome == "refused" and not w.refusable
            ],
            shown=3,
        ),
        *_some("out of order (first arrivals of a key)", _disorder(ev, good)),
    ]
    if ev.setup.strategy == WAL:  # issue 50's edges (edges.py)
        kept = {m: w for m, w in good.items() if m not in undone}
        findings += _some("out of order (the last record of a key is not its newest message)", _stale_last(ev, kept))
        findings += _some("dead letter of a message no writer wrote (forged under the prefix)", _forged(ev))
        findings += _some("switch-strategy on a wal outbox not refused (exit 2, naming wal)", _switched_wal(ev))
    dupes_found, figures = _duplicates(ev, committed, in_doubt, copies, dead)
    findings += dupes_found
    stalls, silence, longest = silences(ev.setup, ev.written, ev.spans, good, first, ev.records, ev.dead)
    findings += _stalls(ev.setup, stalls)
    findings += _secrets(ev.outputs, ev.secret)
    failed, known = _operator_commands(ev)
    findings += failed
    refused = Counter(f"{w.bad}/{w.writer}" for w in ev.written if w.bad and w.outcome == "refused")
    figures = {
        "committed": len(good),
        "bad_committed": sum(1 for w in committed.values() if not w.good),
        "bad_refused": sum(refused.values()),
        "in_doubt": len(in_doubt),
        "arrived": len(ev.records),
        "lost": len(lost),
        "phantom": len(phantom),
        **figures,
        "dead_letters": len(ev.dead),
        "longest_wait": f"{longest[0]:.1f}s{longest[1]}",
        "longest_silence": f"{silence:.1f}s",
        "faults": dict(Counter(s.action for s in ev.spans)),
        "commands": dict(Counter(f"{c.argv[0]}:{c.code}" for c in ev.commands)),
    }
    if ev.setup.strategy == WAL:
        figures["undone_by_restore"] = len(undone)
    known += [f"{f} [{which}]" for f in findings if (which := _known(f))]
    return Verdict([f for f in findings if not _known(f)], figures, known)


def _disorder(ev: Evidence, good: dict[str, Written]) -> list[str]:
    if ev.setup.strategy == WAL:
        return _out_of_commit_order(ev.written, good, ev.records)
    stretches = _ordered_stretches(ev.setup.strategy, ev.switches)
    ordered = [s for s in stretches if s[2] != {ADVISORY}]
    advisory = [s for s in stretches if s[2] == {ADVISORY}]
    return _out_of_order(ordered, good, ev.records, ev.order) + _out_of_id_order(advisory, good, ev.records)


def _duplicates(
    ev: Evidence,
    committed: dict[str, Written],
    in_doubt: set[str],
    copies: Counter[str],
    dead: dict[str, list[DeadRow]],
) -> tuple[list[str], dict[str, object]]:
    """The run's bound, each row's, and the switches' (duplicates.py); the findings and the figures."""
    attempts = sum(d.attempts for d in ev.dead)
    on_purpose = sum(n for _, n in ev.replayed)
    switched = sum(s.republished for s in ev.switches)
    ours = Counter({m: n for m, n in copies.items() if m in committed or m in in_doubt})
    dupes = sum(n - 1 for n in ours.values())
    if ev.setup.strategy == WAL:
        largest = max(Counter((w.writer, w.tx) for w in committed.values()).values(), default=1)
        writers = len({w.writer for w in ev.written})
        bound = duplicates.wal_bound(ev.setup, ev.spans, attempts, largest, writers, ev.records, ev.released)
    else:
        bound = duplicates.table_bound(ev.setup, ev.spans, attempts, on_purpose, ev.switches)
    findings = []
    if dupes > bound.dupes:
        findings.append(
            f"duplicates: {dupes} over the bound {bound.dupes} ({bound.faults} faults, {on_purpose} replayed, "
            f"{switched} published again by {len(ev.switches)} switches)"
        )
    own_attempts = Counter({m: sum(d.attempts for d in rows) for m, rows in dead.items()})
    findings += _some(
        f"duplicates of one row: more copies than {bound.per_row} faults could make",
        duplicates.over_per_row(ours, bound, own_attempts),
    )
    across = duplicates.across(ev.switches, ev.spans, ev.records)
    allowed = duplicates.across_allowed(ev.setup, ev.switches, ev.spans)
    if across > allowed:
        findings.append(f"copies across switches: {across} over the {allowed} they and the faults before publish again")
    figures: dict[str, object] = {
        "dupes": dupes,
        "dupe_bound": bound.dupes,
        "replayed": on_purpose,
        **({"released": sum(ev.released), "forgotten_by_slot": bound.forgotten} if ev.setup.strategy == WAL else {}),
        "switches": "[" + ",".join(str(s) for s in ev.switches) + "]",
        "switch_dupes": f"{across}/{allowed}",
    }
    return findings, figures


def _arrivals(records: Sequence[TimedRecord]) -> tuple[dict[str, TimedRecord], Counter[str]]:
    """Each message's first copy (by CreateTime) and its number of copies."""
    first: dict[str, TimedRecord] = {}
    copies: Counter[str] = Counter()
    for r in sorted(records, key=lambda r: (r.timestamp_ms, r.topic, r.partition, r.offset)):
        mid = r.headers["message_id"].decode()
        copies[mid] += 1
        first.setdefault(mid, r)
    return first, copies


def _operator_commands(ev: Evidence) -> tuple[list[str], list[str]]:
    """(findings, known): the operator commands whose exit, read with their output, is a failure (exits.py)."""
    findings: list[str] = []
    known: list[str] = []
    for c in ev.commands:
        if exits.failed(c):
            which = _known(c.output)
            why = which or _tail(c.output, ev.secret)
            (known if which else findings).append(f"operator command failed: {c}: {why}")
    return findings, known


def _stalls(setup: Setup, stalls: Sequence[Stall]) -> list[str]:
    worst: dict[str, Stall] = {}
    for stall in stalls:  # the longest silence of each partition, once per silence
        if stall.partition not in worst or stall.seconds > worst[stall.partition].seconds:
            worst[stall.partition] = stall
    limit = f"lease_s {setup.lease_s:g} + steal {STEAL_S:g}"
    return [f"stalled (> {limit}): {s}" for s in sorted(worst.values(), key=lambda s: -s.seconds)]


def _known(text: str) -> str | None:
    return next((name for name, pattern in KNOWN_DEFECTS.items() if pattern.search(text)), None)


def _some(what: str, items: Sequence[str], shown: int = 5) -> list[str]:
    if not items:
        return []
    more = f" (+{len(items) - shown} more)" if len(items) > shown else ""
    return [f"{what}: {len(items)}: {', '.join(items[:shown])}{more}"]


def _differs(w: Written, r: TimedRecord) -> list[str]:
    """What of the first copy differs from what the writer gave: key bytes, value, own headers, topic."""
    wrong = []
    if r.topic != w.topic:
        wrong.append("topic")
    if r.key != (None if w.key is None else w.key.encode("utf-8")):
        wrong.append(f"key {r.key!r} for {w.key!r}")
    if isinstance(w.payload, bytes):
        if r.value != w.payload:
            wrong.append("bytes value")
    elif r.value is None or _json(r.value) != w.payload:
        wrong.append(f"JSON value {r.value[:60]!r}" if r.value else "null value")
    for name, value in w.headers.items():
        expected = value if isinstance(value, bytes) else value.encode("utf-8")
        if r.headers.get(name) != expected:
            wrong.append(f"header {name}")
    return [f"{w.message_id} ({w.writer}): {'; '.join(wrong)}"] if wrong else []


def _json(value: bytes) -> object:
    """A JSON value as a consumer reads it: UTF-8 text (anything else is not what was written)."""
    try:
        return json.loads(value.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError and JSONDecodeError both
        return _NOT_JSON


_NOT_JSON = object()
ADVISORY = "advisory"
ADVISORY_SLACK_S = MESSAGE_TIMEOUT_MS / 1000 + 1.0  # a batch read ahead waits for one publish before its own


def _bad_rows(
    written: Iterable[Written], first: dict[str, TimedRecord], dead: dict[str, list[DeadRow]], held: set[str]
) -> list[str]:
    findings = []
    for w in written:
        if w.good or w.outcome != "committed" or w.bad is None:
            continue
        what = f"bad row {w.bad} by {w.writer} ({w.message_id})"
        pattern = BAD_ROWS[w.bad]
        if w.message_id in first:
            findings.append(f"{what} was delivered to Kafka")
        elif w.message_id in held:
            findings.append(f"{what} is still held at the end (behind a hold that outlived its dead letter)")
        elif not dead.get(w.message_id or ""):
            findings.append(f"{what} was stored and never dead-lettered")
        elif pattern is not None and not any(re.search(pattern, d.error) for d in dead[w.message_id or ""]):
            findings.append(f"{what} dead-lettered with another reason: {dead[w.message_id or ''][0].error[:200]}")
    return findings


def _ordered_stretches(strategy: str, switches: Sequence[Switch]) -> list[tuple[float, float, frozenset[str]]]:
    """(from, to, strategies): the stretches of the run's time in which ordered strategies relayed, one after the
    other; a key's first copies stamped within one are in the stretch's order. ``advisory`` (a global order by id)
    is a stretch of its own."""
    starts = [(float("-inf"), strategy)] + [(s.at, s.new.strategy) for s in sorted(switches, key=lambda s: s.at)]
    stretches: list[tuple[float, float, frozenset[str]]] = []
    for i, (start, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else float("inf")
        if name not in POSITION_STRATEGIES and name != ADVISORY:
            continue
        joins = name != ADVISORY and stretches and ADVISORY not in stretches[-1][2]
        if joins and stretches[-1][1] == start:  # the one before kept the same order
            stretches[-1] = (stretches[-1][0], end, stretches[-1][2] | {name})
        else:
            stretches.append((start, end, frozenset({name})))
    return stretches


def _out_of_id_order(
    stretches: Sequence[tuple[float, float, frozenset[str]]], good: dict[str, Written], records: Sequence[TimedRecord]
) -> list[str]:
    """advisory (docs/strategies.md): rows go out in id order (each record's ``outbox_id``), so per key a first copy
    never follows one of a higher id, unless its transaction committed after that one was published (ids are
    allocation order: it is published after them). "After" with ADVISORY_SLACK_S: a batch is claimed that long at
    most before its copies are stamped."""
    per_key: dict[tuple[str, str, int], list[tuple[int, float, Written]]] = defaultdict(list)
    seen: set[str] = set()
    for r in sorted(records, key=lambda r: (r.topic, r.partition, r.offset)):
        m, t = r.headers["message_id"].decode(), r.timestamp_ms / 1000
        w = good.get(m)
        at = next((i for i, (a, b, _) in enumerate(stretches) if a <= t < b), None)
        if m not in seen and w is not None and w.key is not None and at is not None and "outbox_id" in r.headers:
            per_key[(w.topic, w.key, at)].append((int(r.headers["outbox_id"]), t, w))
        seen.add(m)
    bad = []
    for (topic, key, _), arrived in sorted(per_key.items()):
        highest: list[int] = []  # the highest id among the first i arrivals (never falls: bisect finds the first)
        for oid, _, w in arrived:
            higher = bisect.bisect_right(highest, oid)  # the first arrival of a higher id, in log order
            if higher < len(highest) and (w.committed_at or 0.0) < arrived[higher][1] - ADVISORY_SLACK_S:
                bad.append(f"{topic}/{key!r}: id {oid} ({w.message_id}) after id {highest[higher]}, committed before")
                break
            highest.append(max(oid, highest[-1]) if highest else oid)
    return bad


def _corrupted(good: dict[str, Written], r: TimedRecord) -> list[str]:
    w = good.get(r.headers["message_id"].decode())
    return [] if w is None else _differs(w, r)


def _out_of_order(
    stretches: Sequence[tuple[float, float, frozenset[str]]],
    good: dict[str, Written],
    records: Sequence[TimedRecord],
    order: dict[str, tuple[int, int]],
) -> list[str]:
    """Keys whose first copies, in the log's order (offsets: a copy stamped earlier may be appended later, after a
    broker outage), are not in the order of the stretch they were stamped in (serialized alone: id; with
    partitioned: (transaction id, id))."""
    if not stretches:
        return []
    starts = [start for start, _, _ in stretches]
    seen: set[str] = set()
    per_key: dict[tuple[str, str, int], list[tuple[int, int]]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.topic, r.partition, r.offset)):
        m = r.headers["message_id"].decode()
        w = good.get(m)
        at = bisect.bisect_right(starts, r.timestamp_ms / 1000) - 1
        if m not in seen and w is not None and w.key is not None and m in order and at >= 0:
            if r.timestamp_ms / 1000 < stretches[at][1]:
                xid, oid = order[m]
                per_key[(w.topic, w.key, at)].append((0, oid) if stretches[at][2] == {"serialized"} else (xid, oid))
        seen.add(m)
    bad = []
    for (topic, key, _), ids in sorted(per_key.items()):
        if ids != sorted(ids):
            at = next(i for i in range(1, len(ids)) if ids[i] < ids[i - 1])
            bad.append(f"{topic}/{key!r}: {ids[at - 1]} arrived before {ids[at]}")
    return bad


def _out_of_commit_order(
    written: Sequence[Written], good: dict[str, Written], records: Sequence[TimedRecord]
) -> list[str]:
    """wal: keys whose first copies, in log order, contradict a commit order the ledger proves (the module's
    docstring): a message arrived before one whose transaction's COMMIT returned before the first's COMMIT was sent,
    or before one written earlier in its own transaction."""
    position: dict[str, int] = {}
    counted: Counter[tuple[str, int]] = Counter()
    for w in written:
        if w.message_id is not None:
            position[w.message_id] = counted[(w.writer, w.tx)]
            counted[(w.writer, w.tx)] += 1
    seen: set[str] = set()
    per_key: dict[tuple[str, str], list[Written]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.topic, r.partition, r.offset)):
        m = r.headers["message_id"].decode()
        row = good.get(m)
        if m not in seen and row is not None and row.key is not None and row.sent_at is not None:
            per_key[(row.topic, row.key)].append(row)
        seen.add(m)
    bad = []
    for (topic, key), arrived in sorted(per_key.items()):
        latest: Written | None = None  # of the copies before, the one whose COMMIT was sent last
        last_of: dict[tuple[str, int], Written] = {}  # of the copies before, the last of each transaction
        for w in arrived:
            assert w.sent_at is not None and w.returned_at is not None and w.message_id is not None
            before = last_of.get((w.writer, w.tx))
            if before is not None and position[before.message_id or ""] > position[w.message_id]:
                bad.append(f"{topic}/{key!r}: {before.message_id} ({w.writer}, written after it) before {w.message_id}")
                break
            if latest is not None and latest.sent_at is not None and w.returned_at < latest.sent_at:
                bad.append(
                    f"{topic}/{key!r}: {latest.message_id} ({latest.writer}, committed after it) before "
                    f"{w.message_id} ({w.writer})"
                )
                break
            last_of[(w.writer, w.tx)] = w
            if latest is None or latest.sent_at is None or w.sent_at >= latest.sent_at:
                latest = w
    return bad


_UNDONE = re.compile(r"undid the commits from ([\d.]+) to ([\d.]+)")  # edges.UNDONE, a storage-snapshot's note


def _undone_by_restore(spans: Iterable[Span], committed: dict[str, Written]) -> set[str]:
    """Messages whose COMMIT returned between a storage snapshot and its restore (edges.py): the restore may have
    undone them, so they may be absent (and arrived, they are no phantom: their writer committed them)."""
    windows = [
        (float(m[1]), float(m[2])) for s in spans if s.action == "storage-snapshot" and (m := _UNDONE.search(s.note))
    ]
    return {
        m
        for m, w in committed.items()
        if w.committed_at is not None and any(a <= w.committed_at <= b for a, b in windows)
    }


def _stale_last(ev: Evidence, good: dict[str, Written]) -> list[str]:
    """wal: keys whose last record in the log is a copy of a message published again (it arrived before) that is
    older than another of the key that arrived (its COMMIT sent after the last one's returned, or written after it
    in its transaction): a stale value published last (a thawed streamer's producer, issue 50 case 6), which a
    compacted topic keeps. A relay that publishes again from the slot's position goes on to the newest; a key whose
    first arrivals are out of order is the other rule's."""
    place: dict[str, tuple[str, int, int]] = {}
    counted: Counter[tuple[str, int]] = Counter()
    for w in ev.written:
        if w.message_id is not None:
            place[w.message_id] = (w.writer, w.tx, counted[(w.writer, w.tx)])
            counted[(w.writer, w.tx)] += 1
    last: dict[tuple[str, str], Written] = {}
    again: dict[tuple[str, str], bool] = {}  # whether the key's last record is a second copy
    seen: set[str] = set()
    arrived: dict[tuple[str, str], list[Written]] = defaultdict(list)
    for r in sorted(ev.records, key=lambda r: (r.topic, r.partition, r.offset)):
        row = good.get(r.headers["message_id"].decode())
        if row is not None and row.key is not None and row.sent_at is not None and row.message_id is not None:
            last[(row.topic, row.key)] = row
            again[(row.topic, row.key)] = row.message_id in seen
            seen.add(row.message_id)
            arrived[(row.topic, row.key)].append(row)
    stale = []
    for (topic, key), end in sorted(last.items()):
        if not again[(topic, key)]:
            continue
        assert end.returned_at is not None and end.message_id is not None
        at = place[end.message_id]
        newer = [
            w
            for w in arrived[(topic, key)]
            if (w.sent_at or 0.0) > end.returned_at
            or place[w.message_id or ""][:2] == at[:2]
            and place[w.message_id or ""][2] > at[2]
        ]
        if newer:
            stale.append(f"{topic}/{key!r} ends on {end.message_id} ({end.writer}), older than {newer[-1].message_id}")
    return stale


def _forged(ev: Evidence) -> list[str]:
    """wal: dead letters of messages no writer of the run wrote: bytes a role without grants emitted under the
    outbox's prefix (edges.py: forged-emit), which the relay took (a poison one holds a good key behind it)."""
    ours = {w.message_id for w in ev.written if w.message_id is not None}
    return sorted(f"{d.message_id}: {d.error[:120]}" for d in ev.dead if d.message_id not in ours)


def _switched_wal(ev: Evidence) -> list[str]:
    """wal: `outbox switch-strategy` must refuse a wal outbox, in one message that names it, with exit 2."""
    return [
        f"{c}: {_tail(c.output, ev.secret)[-300:]}"
        for c in ev.commands
        if c.argv[:1] == ("switch-strategy",) and (c.code != 2 or "wal" not in c.output or "Traceback" in c.output)
    ]


def _secrets(outputs: dict[str, str], secret: str) -> list[str]:
    return [
        f"secret shown in {name}: ...{_around(text, secret)}..." for name, text in outputs.items() if secret in text
    ]


def _around(text: str, secret: str) -> str:
    at = text.index(secret)
    return text[max(0, at - 120) : at + len(secret) + 60].replace(secret, "<PASSWORD>").replace("\n", " | ")


def _tail(output: str, secret: str) -> str:
    return output.replace(secret, "<PASSWORD>").strip()[-600:].replace("\n", " | ")
