"""The flags of `outbox bench`. See docs/performance.md#how-to-run-each-bench."""

from __future__ import annotations

import argparse

from ..model import RECORDED_NAMES, STRATEGY_NAMES
from .latency import latency_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`outbox bench`'s flags, in the order --help shows them: what is loaded, what it is compared with, on which
    servers, then the claim, latency and writer benches."""
    _workload_arguments(parser)
    _baseline_arguments(parser)
    _server_arguments(parser)
    _claim_arguments(parser)
    _writer_arguments(parser)


def _workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--strategy",
        default="partitioned",
        choices=RECORDED_NAMES,
        help="the relay strategy (default partitioned); wal: the slot's backlog drain, beside partitioned's",
    )
    parser.add_argument(
        "--workers", type=int, help="relay workers (default 2; the latency bench: 1; wal streams with one)"
    )
    parser.add_argument("--batch-size", type=int, default=5000)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--payload-bytes", type=int, default=256)
    parser.add_argument(
        "--payload",
        choices=("json", "bytes"),
        default="json",
        help="our table's payloads: JSON, or the same bytes as a binary payload (the baselines' stay JSON)",
    )
    parser.add_argument(
        "--trace-headers",
        nargs="?",
        const="spans",
        choices=("spans", "rows"),
        help="each transaction's rows carry a traceparent header; 'spans' (the default): the relay also records a "
        "span per batch (an SDK, spans dropped); 'rows': it only carries the header (the header's own cost)",
    )
    parser.add_argument("--topics", type=int, default=2, help="topics (the talk: 2)")
    parser.add_argument("--partitions", type=int, default=1, help="partitions per topic (the talk: 1)")
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument(
        "--rows-per-transaction",
        type=_counts,
        metavar="N[,N...]",
        help="load commits every N rows, as services would (default 100); the latency bench's curve: one line per N "
        "(default 10)",
    )
    parser.add_argument("--mode", choices=("delete", "mark-sent"), default="delete")
    parser.add_argument("--runs", type=int, default=1, help="repetitions; medians are reported")


def _baseline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="also run the talk's variant 1 and --strategy's naive variant on the talk's own table (the headline) "
        "and the naive variant on ours, interleaved with ours and the two ceilings",
    )
    parser.add_argument(
        "--baseline-strategy",
        choices=STRATEGY_NAMES,
        help="--baseline: the naive variant to run besides variant 1 (default: --strategy's)",
    )
    parser.add_argument(
        "--matrix", action="store_true", help="every strategy x {1, 2} workers: the talk's table, ours, read-only"
    )
    parser.add_argument(
        "--matrix-strategies",
        type=lambda text: [s for s in text.split(",") if s],
        default=list(STRATEGY_NAMES),
        metavar="S,S,...",
        help="--matrix: only these strategies (default: all)",
    )
    parser.add_argument("--verify", action="store_true", help="check every message_id arrived (outbox verify)")
    parser.add_argument(
        "--statements",
        action="store_true",
        help="after each run, PostgreSQL's top statements by total time during the drain (pg_stat_statements)",
    )


def _server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--embedded", action="store_true", help="use the embedded stack even if servers are set")
    parser.add_argument(
        "--broker",
        choices=("kafka", "tansu"),
        default="kafka",
        help="the embedded stack's broker: kafka (Apache Kafka in KRaft mode, as users run it: the figures "
        "docs/performance.md leads with) or tansu (make dev's development broker)",
    )
    parser.add_argument(
        "--server-jit",
        type=lambda text: [v for v in text.split(",") if v],
        metavar="on,off",
        help="every line (the latency bench: every relay) once per value of the server's own jit (ALTER SYSTEM, a "
        "superuser's), interleaved: a server with JIT against itself without (the embedded server has no JIT)",
    )


def _claim_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--retained",
        type=_steps,
        metavar="N,N,...",
        help="claim latency (p50/p99, plans) with N already-relayed rows kept, e.g. 0,1000000,10000000",
    )
    latency_cli.add_arguments(parser)
    parser.add_argument("--pending", type=int, default=50_000, help="--retained: unsent rows behind the history")
    parser.add_argument(
        "--held",
        type=_steps,
        metavar="N,N,...",
        help="claim latency (p50/p99, plans) with N rows of a key held behind a dead letter, e.g. 0,10000",
    )


def _writer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--writers",
        action="store_true",
        help="what the outbox costs a service's transaction: rows/s and PostgreSQL CPU per row against a plain table's "
        "INSERT, per --rows-per-transaction (default 1,10,100), and COPY loads; interleaved --runs times",
    )
    parser.add_argument(
        "--transactions",
        type=int,
        help="--writers: transactions per writer and size (default: 3,000 rows' worth of 1-row ones, 10,000 of 10, "
        "30,000 of 100)",
    )


def _steps(text: str) -> list[int]:
    try:
        steps = [int(part.replace("_", "")) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated row counts, got {text!r}") from None
    if steps != sorted(steps) or any(n < 0 for n in steps):
        raise argparse.ArgumentTypeError("retained row counts must be >= 0 and ascending")
    return steps


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part.replace("_", "")) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts, got {text!r}") from None
    if any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError("counts must be >= 1")
    return counts
