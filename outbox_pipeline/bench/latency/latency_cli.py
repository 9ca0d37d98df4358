"""`outbox bench --latency RATE,... / --hot-key RATE,...`: its flags and its run. See
docs/performance.md#how-to-run-each-bench."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ...strategies import strategy_list
from ..runner import Servers
from . import latency, latency_report
from .scenarios import WARMUP_S


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _traffic_arguments(parser)
    _measurement_arguments(parser)


def _traffic_arguments(parser: argparse.ArgumentParser) -> None:
    """What the latency bench writes, for how long, and through which strategies."""
    parser.add_argument(
        "--latency",
        type=rates,
        metavar="RATE[,RATE...]",
        help="commit -> consumer latency under steady traffic at each RATE msg/s (a curve, per --rows-per-transaction)",
    )
    parser.add_argument(
        "--hot-key",
        type=rates,
        metavar="RATE[,RATE...]",
        help="latency bench: the hot-key scenario, a hot key at each RATE msg/s (0: the quiet keys alone) beside "
        "--quiet-keys quiet ones at 10 msg/s each, one outbox partition each",
    )
    parser.add_argument("--quiet-keys", type=int, default=7, help="--hot-key: quiet keys (default 7)")
    parser.add_argument("--seconds", type=float, default=20.0, help="latency bench: how long each scenario writes")
    parser.add_argument(
        "--hold-open",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="latency bench: each --latency point again with a transaction (one row written to a table of its own) "
        f"held open on the database for SECONDS from the warm-up's end; --seconds must be at least SECONDS + "
        f"{WARMUP_S:.0f}",
    )
    parser.add_argument(
        "--strategies",
        type=strategy_list,
        metavar="S,S,...|all",
        help="latency bench: these strategies in turn (all: the ordered ones first) instead of --strategy; --writers: "
        "the strategies whose index sets the outbox writers write (default partitioned,serialized)",
    )


def _measurement_arguments(parser: argparse.ArgumentParser) -> None:
    """How the latency bench observes, what it compares, and where it writes the numbers."""
    parser.add_argument(
        "--no-observer",
        action="store_true",
        help="latency bench: no consumer (no latencies; the other figures without the observer's cost)",
    )
    parser.add_argument(
        "--idle-seconds", type=float, default=10.0, help="latency bench: the relay's idle CPU over N s first (0: not)"
    )
    parser.add_argument(
        "--observer-wait-ms",
        type=int,
        help=f"latency bench: the observer's fetch.wait.max.ms (default {latency.LatencyOptions.fetch_wait_ms}, the "
        f"client's own; {latency.TANSU_FETCH_WAIT_MS} with --broker tansu)",
    )
    parser.add_argument("--json", type=Path, help="latency bench: where to write every number (default under .outbox)")
    parser.add_argument(
        "--relay-checkout",
        action="append",
        default=[],
        metavar="DIR",
        help="latency bench: also run `outbox relay` from this other checkout of the project, interleaved in every "
        "round (an A/B of two versions of the relay); repeatable",
    )
    parser.add_argument(
        "--dagster",
        action="store_true",
        help="latency bench: also with the relay driven by `dagster dev` (its lag sensor and long-lived relay run), "
        "interleaved with the CLI relay; CPU per process group, runs launched and queued",
    )


def rates(text: str) -> list[float]:
    try:
        rates = [float(part.replace("_", "")) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates (msg/s), got {text!r}") from None
    if any(r < 0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be >= 0")
    return rates


def run(found: Servers, args: argparse.Namespace) -> int:
    """The latency bench: its tables at the end, every number in a JSON file; 1 if a message went missing."""
    if args.hold_open and not args.latency:
        raise SystemExit("outbox bench: --hold-open repeats the --latency points: give --latency RATE")
    if args.hold_open and args.seconds < args.hold_open + WARMUP_S:
        raise SystemExit(
            f"outbox bench: --hold-open {args.hold_open:g} needs --seconds {args.hold_open + WARMUP_S:g} or more (the "
            f"transaction opens after the {WARMUP_S:g} s warm-up and ends before the writers stop)"
        )
    options = latency.LatencyOptions(
        strategies=tuple(args.strategies or [args.strategy]),
        rates=tuple(args.latency or ()),
        rows=tuple(args.rows_per_transaction or [10]),
        hot_rates=tuple(args.hot_key or ()),
        quiet_keys=args.quiet_keys,
        seconds=args.seconds,
        runs=args.runs,
        workers=1 if args.workers is None else args.workers,
        observe=not args.no_observer,
        idle_seconds=args.idle_seconds,
        fetch_wait_ms=observer_wait_ms(args),
        dagster=args.dagster,
        relay_checkouts=tuple(args.relay_checkout),
        traced=args.trace_headers is not None,
        server_jit=tuple(args.server_jit or ()),
        hold_open_s=args.hold_open,
    )
    command = shlex.join(["outbox", *sys.argv[1:]]) if sys.argv[1:2] == ["bench"] else "outbox bench (from Python)"
    bench = latency.run(found, options, command)
    path = bench.write_json(args.json or latency.default_json_path())
    print("\n" + latency_report.render(bench), flush=True)
    print(f"\nevery number: {path.resolve()}")
    return 0 if bench.complete else 1


def observer_wait_ms(args: argparse.Namespace) -> int:
    """--observer-wait-ms, or the default for the broker: Tansu notices new data only part way through a wait."""
    if args.observer_wait_ms is not None:
        return int(args.observer_wait_ms)
    on_tansu = args.embedded and args.broker == "tansu"
    return latency.TANSU_FETCH_WAIT_MS if on_tansu else latency.LatencyOptions.fetch_wait_ms
