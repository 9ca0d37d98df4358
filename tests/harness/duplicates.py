"""Duplicates, bounded per fault from the harness's own evidence (ledger.py): what the nemesis and the operator
actually did (an event skipped for the strategy, a fault that met a server down or reached no relay, a command that
refused publish nothing again and allow nothing), never the relays' own log lines.

- the run's bound: per fault that did something, IN_FLIGHT_BATCHES batches per relay it hit (wal: only the streamer
  publishes, so one, plus the largest transaction less one), one batch per failed attempt of a dead-lettered row,
  what a rewind or replay published again on purpose, what each switch publishes again, and (wal) the held messages
  the operator's releases let out and what a PostgreSQL crash made the slot forget;
- per row: one fault publishes one row again at most once per relay it hit (a frozen broker once more per message
  timeout), so a row's copies past the first are at most what the faults, replays, switches and its own failed
  attempts could make;
- per switch (``switch_dupes``): copies stamped after a switch of rows first stamped before it are at most what it
  publishes again, plus what the faults just before it left in flight and the workers it killed.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tests.faults.helpers import IN_FLIGHT_BATCHES, TimedRecord

from .context import Span, Switch
from .relays import MESSAGE_TIMEOUT_MS
from .schedule import Setup
from .silences import STEAL_S
from .switching import SWITCH_S

# What publishes rows again besides a switch: the worker and server faults, an operator's rewind, release or replay.
REPUBLISHING = (
    *("freeze", "kill", "kafka-cut", "terminate-backends", "pg-restart", "broker-freeze", "broker-restart"),
    *("rewind", "release-lease", "replay"),
)
_COMMANDS = ("rewind", "release-lease", "replay")  # an operator's: it did something only when its command exited 0
_WAL_REPUBLISHING = (*REPUBLISHING, "drain")  # wal: a drain beside the streamer may take the stream over
_NOTHING_DONE = ("skipped", "server unreachable", "ERROR")
_FORGOTTEN = re.compile(r"slot confirmed (\d+) -> (\d+)")


@dataclass(frozen=True)
class Bound:
    dupes: int  # the run's bound
    faults: int  # faults that did something, weighted by the relays they hit
    per_row: int  # extra copies any one row may have (its own failed attempts come on top)
    forgotten: int = 0


def did_something(span: Span) -> bool:
    """Whether a span of the timeline can have made a relay publish again: it ran, and its command (if any) did."""
    if span.note.startswith(_NOTHING_DONE):
        return False
    if span.action in _COMMANDS:
        return "-> exit 0" in span.note
    if span.action == "terminate-backends":
        ended = re.match(r"(\d+) sessions", span.note)
        return ended is None or int(ended.group(1)) > 0
    return True


def _relays_hit(span: Span, workers: int) -> int:
    """Table strategies: the relays a fault can make publish their batches in flight again."""
    if span.action == "terminate-backends":
        hit = re.search(r"of (\d+) relays", span.note)
        return int(hit.group(1)) if hit else workers + 1
    if span.action in ("pg-restart", "broker-freeze", "broker-restart"):
        return workers + 1  # every worker, and a drain if one runs
    return 1 if span.action in ("freeze", "kill", "kafka-cut", "rewind", "release-lease") else 0


def _timeouts(span: Span) -> int:
    """A frozen broker: each batch handed to it may be appended when it thaws, once more per message timeout."""
    return int((span.end - span.start) // (MESSAGE_TIMEOUT_MS / 1000)) if span.action == "broker-freeze" else 0


def table_bound(
    setup: Setup, spans: Sequence[Span], attempts: int, on_purpose: int, switches: Sequence[Switch]
) -> Bound:
    done = [s for s in spans if s.action in REPUBLISHING and did_something(s)]
    faults = sum(_relays_hit(s, setup.workers) for s in done) + attempts + sum(s.killed for s in switches)
    per_row = sum(_relays_hit(s, setup.workers) * (1 + _timeouts(s)) for s in done)
    per_row += sum(1 for s in done if s.action == "replay") + sum(1 + s.killed for s in switches)
    switched = sum(s.republished for s in switches)
    return Bound(IN_FLIGHT_BATCHES * setup.batch_size * faults + on_purpose + switched, faults, per_row)


def wal_bound(
    setup: Setup,
    spans: Sequence[Span],
    attempts: int,
    largest: int,
    writers: int,
    records: Sequence[TimedRecord],
    released: Sequence[int],
) -> Bound:
    """wal (ledger.py's docstring): per fault the streamer's batches in flight and the largest transaction less one."""
    done = [s for s in spans if s.action in _WAL_REPUBLISHING and did_something(s)]
    faults = sum(1 + _timeouts(s) for s in done)
    forgotten = _forgotten(spans, records, largest * writers)
    per_fault = IN_FLIGHT_BATCHES * setup.batch_size + largest - 1
    dupes = per_fault * faults + setup.batch_size * attempts + sum(released) + forgotten
    return Bound(dupes, faults, faults + (1 if forgotten else 0) + len(released), forgotten)


def over_per_row(copies: Counter[str], bound: Bound, attempts: Counter[str]) -> list[str]:
    """Rows with more copies than the faults could make of one row."""
    return [f"{m} x{n}" for m, n in copies.most_common() if n - 1 > bound.per_row + attempts[m]]


def _forgotten(spans: Iterable[Span], records: Sequence[TimedRecord], straddling: int) -> int:
    """wal: what the slot's saved position was behind its confirmed one after each PostgreSQL restart (ledger.py's
    docstring), in messages: those whose position lies between, and ``straddling`` for transactions across it."""
    positions = sorted({int(r.headers["outbox_id"]) for r in records if "outbox_id" in r.headers})
    total = 0
    for s in spans:
        if s.action == "pg-restart" and (found := _FORGOTTEN.search(s.note)):
            confirmed, saved = int(found[1]), int(found[2])
            if saved < confirmed:
                total += bisect.bisect_left(positions, confirmed) - bisect.bisect_left(positions, saved) + straddling
    return total


def across(switches: Sequence[Switch], spans: Sequence[Span], records: Sequence[TimedRecord]) -> int:
    """Copies stamped after a switch of rows first stamped before it, up to the next switch or the next fault or
    operator action that publishes again (a rewind, a replay, a worker or server fault): what the switch published
    again."""
    again = [s.start for s in spans if s.action in REPUBLISHING and did_something(s)]
    ats = sorted(s.at for s in switches)
    windows = [(at, min([t for t in [*again, *ats] if t > at], default=float("inf"))) for at in ats]
    first: dict[str, float] = {}
    count = 0
    for r in sorted(records, key=lambda r: (r.timestamp_ms, r.topic, r.partition, r.offset)):
        m, t = r.headers["message_id"].decode(), r.timestamp_ms / 1000
        if m in first and any(first[m] < at <= t < until for at, until in windows):
            count += 1
        first.setdefault(m, t)
    return count


def across_allowed(setup: Setup, switches: Sequence[Switch], spans: Sequence[Span]) -> int:
    """What the switches publish again, plus the batches in flight of the faults just before each (their relays'
    leases had not run out when it stopped them: the new strategy publishes those batches again) and of the workers
    it killed."""
    before_s = setup.lease_s + STEAL_S + SWITCH_S
    done = [s for s in spans if s.action in REPUBLISHING and did_something(s)]
    hits = sum(
        _relays_hit(s, setup.workers) for sw in switches for s in done if sw.at - before_s <= s.end and s.start < sw.at
    )
    batches = IN_FLIGHT_BATCHES * setup.batch_size * (hits + sum(sw.killed for sw in switches))
    return sum(sw.republished for sw in switches) + batches
