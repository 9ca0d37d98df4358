"""When a partition was not served: the check of "no row waits past ``lease_s`` plus a steal while a worker could
serve it", made robust to backlogs. A silence is how long a keyed row's partition published nothing (no copy of
anything) between the row's commit, or the partition's previous publish if later, and the row's first copy (Kafka's
CreateTime), less the outages in between: a server fault, every worker slot frozen, killed or cut off from Kafka at
once, or every relay stopped for a switch of strategy, each followed by RECOVERY_S. A partition drained slowly, or
publishing again after a rewind, is not silent; one whose worker hangs while another could take it is.

wal: one relay streams the slot and the others wait; a waiting relay takes over a killed streamer at once and a frozen
one after ``lease_s`` (the harness's takeover time), so the same bound holds, once the successor has waited for the
frozen relay's producer (``wal_fence_s``: an outage). A streamer cut off from Kafka keeps the
slot (it still answers its walsender) and nothing is published until it reaches Kafka again (docs/wal.md, Kafka
down): for wal a cut of any worker is an outage."""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from outbox_pipeline.relay.wal.leader import FENCE_MARGIN_S
from tests.faults.helpers import TimedRecord

from .context import Span
from .relays import MESSAGE_TIMEOUT_MS
from .schedule import WAL, Setup
from .writers import Written

STEAL_S = 3.0  # after a lease runs out: 0.5 s before another worker takes a partition, upkeep 1 s, a claim, slack
RECOVERY_S = 5.0  # after a server fault or a total outage ends: reconnects, producers' ids, backoffs of 1 s
WORKER_FAULTS = ("freeze", "kill", "kafka-cut")  # the slot's worker does not serve meanwhile
SERVER_FAULTS = ("pg-restart", "broker-freeze", "broker-restart", "terminate-backends")
STOPPED = ("switch-strategy",)  # the operator stops every relay (and starts them again with another strategy)


def wal_fence_s(setup: Setup) -> float:
    """wal: the relay that took over a frozen streamer streams only once what the frozen producer queued has expired
    (its message.timeout.ms, the setup's where it draws a long one, plus the margin: relay/wal/leader.py)."""
    return (setup.message_timeout_ms or MESSAGE_TIMEOUT_MS) / 1000 + FENCE_MARGIN_S


def _outages(spans: Sequence[Span], workers: int, strategy: str) -> list[tuple[float, float]]:
    """When no relay could serve (wall clock), each followed by RECOVERY_S: a server fault, every slot's worker
    frozen, killed or cut off at once, or a switch of strategy; for wal, any worker cut off from Kafka."""
    stopping = SERVER_FAULTS + STOPPED + (("kafka-cut",) if strategy == WAL else ())
    windows = [(s.start, s.end + RECOVERY_S) for s in spans if s.action in stopping]
    edges = sorted((t, d) for s in spans if s.action in WORKER_FAULTS for t, d in ((s.start, 1), (s.end, -1)))
    down, since = 0, 0.0
    for t, d in edges:
        down += d
        if d == 1 and down == workers:
            since = t
        elif d == -1 and down == workers - 1:
            windows.append((since, t + RECOVERY_S))
    return windows


def silences(
    setup: Setup,
    written: Sequence[Written],
    spans: Sequence[Span],
    good: dict[str, Written],
    first: dict[str, TimedRecord],
    records: Sequence[TimedRecord],
    dead: Sequence[DeadRowLike] = (),
) -> tuple[list[Stall], float, tuple[float, str]]:
    """(the silences past the bound, the longest silence, the longest any row waited from its commit to its first
    copy).

    A silence: a keyed row's partition published nothing between the row's commit (or the partition's previous
    publish, if later) and the row's first copy, less the outages in between. A partition that is being drained,
    however long its backlog, is not silent; one whose worker hangs is. Keyed rows only (a keyless row's virtual
    partition is drawn at random); every virtual partition is the Kafka partition of the same number. A row of a key
    held behind a bad row's dead letter (from the bad row's commit until the operator retried or discarded it) waits
    for the operator: left out while it was held, checked again after."""
    outages = _merged(_outages(spans, setup.workers, setup.strategy) + _fences(spans, setup))
    holds = _holds(written, dead)
    published: dict[tuple[str, int], list[float]] = defaultdict(list)
    for copy in records:  # every copy: a partition publishing again after a rewind is being served
        published[(copy.topic, copy.partition)].append(copy.timestamp_ms / 1000)
    for times in published.values():
        times.sort()
    stalls: list[Stall] = []
    loudest = 0.0
    longest = (0.0, "")
    for m, w in good.items():
        r = first.get(m)
        if r is None or w.committed_at is None:
            continue
        end = r.timestamp_ms / 1000
        if w.key is not None and any(a <= end and w.committed_at <= b for a, b in holds.get((w.topic, w.key), ())):
            continue  # its key was held behind a bad row's dead letter meanwhile: it waited for the operator
        if end - w.committed_at > longest[0]:
            where = f"{r.topic[-8:]}[{r.partition}]{'' if w.key else ' no key'}"
            longest = (end - w.committed_at, f"@{where}({m},{w.writer},committed {clock(w.committed_at)})")
        if w.key is None:
            continue  # its virtual partition is not its Kafka partition
        times = published[(r.topic, r.partition)]
        before = times[bisect.bisect_left(times, end) - 1] if bisect.bisect_left(times, end) > 0 else float("-inf")
        start = max(w.committed_at, before)
        silent = end - start - sum(max(0.0, min(end, b) - max(start, a)) for a, b in outages)
        loudest = max(loudest, silent)
        if silent > setup.lease_s + STEAL_S:
            during = "; ".join(str(s) for s in spans if s.start <= end and s.end >= start)
            stalls.append(Stall(silent, f"{r.topic}[{r.partition}]", start, end, m, during))
    return stalls, loudest, longest


def _fences(spans: Sequence[Span], setup: Setup) -> list[tuple[float, float]]:
    """wal: after a freeze past the takeover time, the successor's wait for the frozen producer (docs/wal.md)."""
    if setup.strategy != WAL:
        return []
    return [
        (s.start + setup.lease_s, s.start + setup.lease_s + wal_fence_s(setup))
        for s in spans
        if s.action == "freeze" and s.end - s.start > setup.lease_s
    ]


class DeadRowLike(Protocol):
    """A dead letter as the checker reads it (ledger.DeadRow)."""

    @property
    def message_id(self) -> str: ...

    @property
    def closed_at(self) -> float | None: ...


def _holds(written: Sequence[Written], dead: Sequence[DeadRowLike]) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """When each key may have been held: from a stored bad row's commit until its dead letter was retried or
    discarded (for good, if it never was)."""
    closed: dict[str, float] = {}
    for d in dead:  # a retried bad row is dead-lettered again: its key is held until the last is closed
        at = float("inf") if d.closed_at is None else d.closed_at
        closed[d.message_id] = max(closed.get(d.message_id, at), at)
    holds: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for w in written:
        if not w.good and w.outcome in ("committed", "in-doubt") and w.key is not None:
            since = w.committed_at if w.committed_at is not None else float("-inf")
            holds[(w.topic, w.key)].append((since, closed.get(w.message_id or "", float("inf"))))
    return holds


@dataclass(frozen=True)
class Stall:
    seconds: float
    partition: str
    start: float
    end: float
    message_id: str
    during: str

    def __str__(self) -> str:
        return (
            f"{self.partition} published nothing for {self.seconds:.1f}s while {self.message_id} waited "
            f"(until {clock(self.end)}); meanwhile: {self.during[:500]}"
        )


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}"


def _merged(windows: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(windows):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
