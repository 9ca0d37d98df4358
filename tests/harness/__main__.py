"""``python -m tests.harness --strategy partitioned --seed 1234 --minutes 30``: one long run (or ``--strategy all``:
one run per strategy, one after the other, on the same servers). Prints each run's figures line; a failed run also
prints its findings, its seed and its schedule. Exit status 1 when any run failed. ``--print-schedule`` prints the
schedule of a seed and exits (the same seed gives the same schedule). ``--ci``: the chosen schedules `make test` runs
(ci.py: ``--strategy partitioned`` or ``wal`` (its two), or ``all``)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from .ci import EVENTS, STRATEGY, ci_schedule
from .cluster import Servers
from .run import ACTIONS, run, schedule_for
from .schedule import STRATEGIES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.harness", description=__doc__)
    parser.add_argument("--strategy", default="all", choices=(*STRATEGIES, "all"))
    parser.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float)
    length.add_argument("--seconds", type=float)
    parser.add_argument("--workers", type=int, default=2, help="relay worker processes (slots)")
    parser.add_argument("--lease-s", type=float, default=5.0, help="the workers' lease_s")
    parser.add_argument("--ci", action="store_true", help="the chosen schedule `make test` runs (ci.py)")
    parser.add_argument("--print-schedule", action="store_true", help="print the schedule and exit")
    parser.add_argument("--keep", action="store_true", help="keep the run directory (logs, events)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "big")
    seconds = args.seconds or (args.minutes or 1.0) * 60
    strategies: tuple[str, ...] = STRATEGIES if args.strategy == "all" else (args.strategy,)
    if args.ci:
        strategies = tuple(s for s in EVENTS if STRATEGY.get(s, s) in strategies)
        schedules = [ci_schedule(s, ACTIONS, lease_s=args.lease_s) for s in strategies]
    else:
        schedules = [schedule_for(seed, s, seconds, workers=args.workers, lease_s=args.lease_s) for s in strategies]
    if args.print_schedule:
        print("\n".join(s.render() for s in schedules))
        return 0
    directory = Path(tempfile.mkdtemp(prefix="outbox-harness-"))
    what = "the CI schedules" if args.ci else f"seed={seed} {len(schedules)} run(s) of {seconds:.0f}s"
    print(f"harness: {what}, files in {directory}", flush=True)
    failed = 0
    with Servers(directory) as servers:
        for schedule in schedules:
            result = run(servers, schedule, directory / f"{schedule.setup.strategy}-{schedule.seed}")
            print(result.report(), flush=True)
            failed += not result.verdict.ok
    if not args.keep and not failed:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
