"""A comparison: every line once per round for several rounds, so a round shares the machine's conditions; medians and
same-run ratios. See docs/performance.md#the-machine-and-how-to-read-the-figures."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ...model import WAL
from ..runner import RunResult, RunSpec, Servers, run_once
from ..server_jit import JIT_SUFFIX, set_server_jit
from ..wal_outbox import WAL_WORKERS
from .handwritten import HAND_WRITTEN


@dataclass
class Comparison:
    """Interleaved runs of several lines (a baseline, ours, the ceilings), for medians and same-run ratios."""

    specs: dict[str, RunSpec]
    results: dict[str, list[RunResult]] = field(default_factory=dict)

    def median(self, line: str) -> float:
        found = self.results.get(line, [])
        return statistics.median(r.msg_per_s for r in found) if found else 0.0

    def ratio(self, line: str, against: str) -> float:
        base = self.median(against)
        return self.median(line) / base if base else 0.0

    @property
    def complete(self) -> bool:
        return all(
            r.published >= r.spec.messages and r.verified is not False and not r.note
            for found in self.results.values()
            for r in found
        )


# The lines of a comparison, by name.
HEADLINE = "talk v1"  # seed variant 1 on the seed's own table: what a user would write first
OURS = "ours"
PRODUCE_ONLY = "produce-only"
READ_ONLY = "read-only"
BESIDE_WAL = "partitioned"  # the table strategy a wal drain is shown beside


def bench_lines(spec: RunSpec, *, baseline: bool, naive_strategy: str | None = None) -> dict[str, RunSpec]:
    """Ours and both ceilings; with ``baseline`` first seed variant 1 and the strategy's own naive form on
    the seed's table (the headline) and on ours (the second line), and for the ordered strategies the
    hand-written tuned variant (what our machinery and headers cost). ``wal`` has no naive form: see ``wal_lines``."""
    if spec.strategy == WAL:
        return wal_lines(spec, baseline=baseline)
    lines: dict[str, RunSpec] = {}
    if baseline:
        variant = naive_strategy or spec.strategy
        lines[HEADLINE] = replace(spec, kind="talk", strategy="locking")
        if variant != "locking":
            lines[f"talk {variant}"] = replace(spec, kind="talk", strategy=variant)
        lines[f"naive {variant} on our table"] = replace(spec, kind="naive", strategy=variant)
    if baseline and spec.strategy in HAND_WRITTEN:
        lines[f"hand-written {spec.strategy}"] = replace(spec, kind="hand-written")
    lines[OURS] = spec
    lines[PRODUCE_ONLY] = replace(spec, kind="produce-only")
    lines[READ_ONLY] = replace(spec, kind="read-only")
    return lines


def wal_lines(spec: RunSpec, *, baseline: bool) -> dict[str, RunSpec]:
    """A wal backlog drained by one relay (one streams a slot) beside ``partitioned``'s relay draining the same load
    (``spec.workers``), and the ceilings: produce-only from a partitioned outbox's rows (a wal outbox has none to
    read beforehand), read-only the wal relay with Kafka confirming at once (the slot's stream and decoding alone);
    ``baseline``: seed variant 1 first, the headline."""
    wal = replace(spec, workers=WAL_WORKERS)
    lines = {HEADLINE: replace(spec, kind="talk", strategy="locking")} if baseline else {}
    lines[OURS] = wal
    lines[f"{OURS} {BESIDE_WAL}"] = replace(spec, strategy=BESIDE_WAL)
    lines[PRODUCE_ONLY] = replace(spec, kind="produce-only", strategy=BESIDE_WAL)
    lines[READ_ONLY] = replace(wal, kind="read-only")
    return lines


def compare(
    servers: Servers, lines: dict[str, RunSpec], runs: int, progress: Callable[[str], None] = print
) -> Comparison:
    """Every line once per round, ``runs`` rounds: the machine's speed swings, so a round shares its conditions."""
    comparison = Comparison(lines)
    try:
        for n in range(runs):
            for name, spec in lines.items():
                progress(f"round {n + 1}/{runs}: {name}")
                if spec.server_jit is not None:
                    set_server_jit(servers.dsn, spec.server_jit)
                comparison.results.setdefault(name, []).append(run_once(servers, spec, progress))
    finally:
        if any(spec.server_jit is not None for spec in lines.values()):
            set_server_jit(servers.dsn, None)
    return comparison


def with_server_jit(lines: dict[str, RunSpec], values: list[str]) -> dict[str, RunSpec]:
    """Every line once per value of the server's ``jit``, named ``<line> @ jit <value>`` (see ``same_jit``)."""
    return {
        f"{name}{JIT_SUFFIX}{value}": replace(spec, server_jit=value)
        for value in values
        for name, spec in lines.items()
    }


def same_jit(line: str, name: str) -> str:
    """``line``'s counterpart measured at the same server ``jit`` as ``name`` (itself without --server-jit)."""
    _, found, value = name.partition(JIT_SUFFIX)
    return f"{line}{JIT_SUFFIX}{value}" if found else line
