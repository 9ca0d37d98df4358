"""The ``outbox`` command line: its parser, and how an error ends a command (what a user can fix prints one line and
exits 2; DSN passwords are never printed). Configuration comes from the environment, flags override it, and the
commands live beside this module: docs/architecture.md#commands."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import psycopg

from ..config import redact_dsn
from ..errors import OutboxError
from ..model import RECORDED_NAMES
from ..relay.relay_settings import RelaySettings
from ..store.migrations import DEFAULT_DAYS_AHEAD
from ..strategies import strategy_list
from ..strategies.quarantine import ON_POISON_CHOICES
from .common import add_db_args, header_pair, positive_int, timestamp_arg, topic_partitions
from .inspect_commands import cmd_lag, cmd_settings, cmd_status
from .operator_commands import cmd_dead_letters, cmd_release_lease, cmd_replay, cmd_switch_strategy, cmd_verify
from .relay_command import EXIT_NOT_EMPTY, cmd_relay
from .setup_commands import cmd_bench, cmd_demo_traffic, cmd_dev, cmd_enqueue, cmd_indexes, cmd_init_db, cmd_load

__all__ = ["EXIT_NOT_EMPTY", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """Every command, in the order ``outbox --help`` lists them; each group of commands is built by a function."""
    parser = argparse.ArgumentParser(prog="outbox", description="Transactional outbox relay: PostgreSQL -> Kafka")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _schema_commands(sub)
    _writer_commands(sub)
    _relay_command(sub)
    _inspect_commands(sub)
    _repair_commands(sub)
    _check_commands(sub)
    _dev_command(sub)
    return parser


def _schema_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The outbox's schema: made or migrated, and its strategy indexes built."""
    p = sub.add_parser("init-db", help="create or migrate the outbox schema (idempotent)")
    add_db_args(p)
    p.add_argument("--days-ahead", type=int, default=DEFAULT_DAYS_AHEAD, help="daily partitions to create ahead")
    p.add_argument("--partitions", type=positive_int, help="default number of virtual partitions per topic")
    p.add_argument(
        "--topic",
        type=topic_partitions,
        action="append",
        metavar="NAME:PARTITIONS",
        help="virtual partitions of one topic",
    )
    p.add_argument(
        "--strategy",
        type=strategy_list,
        help="the relay strategies the outbox serves, comma-separated: a new outbox gets only their indexes (each "
        "costs every writer), an existing one gets those it lacks, built without blocking writers (default: every "
        "strategy's); one strategy is also recorded as the outbox's: relays, status and lag use it, and refuse "
        "another until `outbox switch-strategy`",
    )
    p.set_defaults(func=cmd_init_db)

    p = sub.add_parser(
        "indexes", help="show the message table's strategy indexes; build a strategy's without blocking writers"
    )
    add_db_args(p)
    p.add_argument("--strategy", type=strategy_list, help="build these strategies' indexes (comma-separated)")
    p.add_argument(
        "--drop-others", action="store_true", help="then drop the indexes none of them reads (relays of others refuse)"
    )
    p.set_defaults(func=cmd_indexes)


def _writer_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Messages written by hand, in bulk, or as steady demo traffic."""
    p = sub.add_parser("enqueue", help="enqueue one message in its own transaction")
    add_db_args(p)
    p.add_argument("--topic", required=True)
    payload = p.add_mutually_exclusive_group(required=True)
    payload.add_argument("--payload", help="JSON text")
    payload.add_argument("--payload-base64", help="bytes, base64-encoded: published unchanged")
    p.add_argument("--key")
    p.add_argument("--type")
    p.add_argument("--header", type=header_pair, action="append", metavar="NAME=VALUE")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--partition", type=int)
    p.add_argument("--serialized", action="store_true", help="take the serialized-writer lock")
    p.set_defaults(func=cmd_enqueue)

    p = sub.add_parser("load", help="bulk-load demo messages with COPY")
    add_db_args(p)
    p.add_argument("count", type=int, nargs="?", default=1_000_000)
    p.add_argument("--size", type=int, default=256, help="payload bytes per message")
    p.add_argument("--topics", default="topic-1,topic-2")
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--rows-per-transaction", type=int, help="commit every N rows (default: one transaction)")
    p.add_argument(
        "--route-in-db", action="store_true", help="leave the partition to the insert trigger, as a SQL writer does"
    )
    p.set_defaults(func=cmd_load)

    p = sub.add_parser("demo-traffic", help="write steady demo traffic until interrupted")
    add_db_args(p)
    p.add_argument("--rate", type=float, default=20.0, help="messages per second")
    p.add_argument("--topics", default="orders,payments,shipments")
    p.add_argument("--keys", type=int, default=50)
    p.add_argument("--rollback-every", type=int, default=25, help="every Nth transaction rolls back (0: never)")
    p.add_argument("--long-tx-every", type=float, default=30.0, help="seconds between long transactions (0: never)")
    p.set_defaults(func=cmd_demo_traffic)


def _relay_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The relay: its workers, how they claim and wait, and what they do with a row they cannot publish."""
    p = sub.add_parser("relay", help="run relay workers (one process each) until stopped")
    add_db_args(p)
    p.add_argument(
        "--strategy",
        choices=RECORDED_NAMES,
        help="default: the outbox's own (init-db --strategy, switch-strategy; an outbox without one takes this)",
    )
    p.add_argument("--workers", type=int, default=1, help="worker processes")
    p.add_argument(
        "--batch-size",
        type=int,
        default=RelaySettings.batch_size,
        help=f"rows per claim (table strategies); a wal relay hands Kafka what its stream holds, up to "
        f"{RelaySettings.wal_batch_max:,} messages at once, whatever this says",
    )
    p.add_argument(
        "--until-empty",
        action="store_true",
        help="stop when nothing is pending: waits for rows leased by other workers or backing off; if "
        f"--max-seconds ends it first, exits {EXIT_NOT_EMPTY} and prints why rows are still pending",
    )
    p.add_argument("--max-seconds", type=float, help="stop after this long")
    p.add_argument("--mode", choices=("delete", "mark-sent"), default="delete", help="row strategies: after delivery")
    p.add_argument(
        "--worker-id",
        help="stable id prefix (workers are ID-0, ID-1, ...): a restarted worker then takes its leases back at once "
        "(default: <hostname>-<pid>)",
    )
    p.add_argument(
        "--kafka-transactions", action="store_true", help="position strategies: one Kafka transaction a batch"
    )
    p.add_argument("--no-listen", action="store_true", help="poll instead of waiting for NOTIFY")
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus /metrics and a /healthz liveness probe on this port (worker n: port + n)",
    )
    p.add_argument(
        "--on-poison",
        choices=ON_POISON_CHOICES,
        help="ordered strategies, when a row is dead-lettered: hold the rest of its key until the dead letter is "
        "retried or discarded (quarantine), or publish them without it (skip); default $OUTBOX_ON_POISON or "
        "quarantine",
    )
    p.add_argument("--bootstrap-servers", help="Kafka bootstrap servers (default: $KAFKA_BOOTSTRAP_SERVERS)")
    p.set_defaults(func=cmd_relay)


def _inspect_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Read-only views: a partition's status, the settings in effect, the lag."""
    p = sub.add_parser(
        "status",
        help="why a partition is not moving: owner, position, pending, held, backoff, dead letters, blocker (a wal "
        "outbox: its slot, one line)",
    )
    add_db_args(p)
    p.add_argument("--strategy", choices=RECORDED_NAMES, help="as this strategy sees the outbox (default: its own)")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--show-query",
        action="store_true",
        help="show the SQL text of the sessions that hold the horizon (it may hold secrets: shown only when asked)",
    )
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("settings", help="every environment variable read: value in effect, default, meaning")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_settings)

    p = sub.add_parser(
        "lag", help="pending rows per topic and virtual partition (a wal outbox: its slot's WAL and oldest commit)"
    )
    add_db_args(p)
    p.add_argument("--strategy", choices=RECORDED_NAMES, help="pending as this strategy sees it (default: its own)")
    p.add_argument("--cap", type=int, help="count at most this many rows per partition (cheap on huge backlogs)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_lag)


def _repair_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """What an operator changes when something went wrong (docs/operations.md)."""
    p = sub.add_parser(
        "replay",
        help="publish again: sent rows (mark-sent mode) by filter, or rewind one partition's position",
        description="Without --partition: mark matching sent rows pending again (row strategies, mark-sent mode). "
        "With --topic and --partition: move that partition's position back (partitioned, serialized).",
    )
    add_db_args(p)
    p.add_argument("--topic")
    p.add_argument("--key")
    p.add_argument("--id-from", type=int, help="ids from (inclusive)")
    p.add_argument("--id-to", type=int, help="ids to (inclusive)")
    p.add_argument("--created-from", type=timestamp_arg, help="created at or after (ISO-8601, UTC by default)")
    p.add_argument("--created-to", type=timestamp_arg, help="created before (ISO-8601, UTC by default)")
    p.add_argument("--all", action="store_true", help="replay every sent row (no filter)")
    p.add_argument("--partition", type=int, help="rewind this virtual partition of --topic")
    p.add_argument("--to-id", type=int, help="rewind to just after this id (0: the whole partition)")
    p.add_argument("--to-xid", help="with --to-id: the position's transaction id")
    p.add_argument("--since", type=timestamp_arg, help="rewind to just before the rows created since then")
    p.add_argument("--force", action="store_true", help="rewind even while a live worker leases the partition")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("dead-letters", help="list dead letters or put them back into the outbox")
    add_db_args(p)
    p.add_argument("action", choices=("list", "retry", "discard"))
    p.add_argument("--id", type=int, action="append", help="retry, discard: this dead letter (repeatable)")
    p.add_argument("--reason", help="discard: why (recorded with the dead letter)")
    p.add_argument("--topic", help="retry: the dead letters of this topic")
    p.add_argument("--all", action="store_true", help="retry: every dead letter not yet retried or discarded")
    p.add_argument("--limit", type=int, default=100, help="list: at most this many")
    p.add_argument("--include-retried", action="store_true", help="list: retried ones too")
    p.add_argument("--json", action="store_true", help="list: as JSON")
    p.set_defaults(func=cmd_dead_letters)

    p = sub.add_parser(
        "switch-strategy",
        help="make a stopped outbox's record of what was relayed the one another strategy reads (no loss, no reorder)",
        description="Run after building the new strategy's indexes (`outbox indexes --strategy S`) with every relay "
        "stopped; then start relays of the new strategy. See docs/operations.md.",
    )
    add_db_args(p)
    p.add_argument(
        "--to", required=True, choices=RECORDED_NAMES, help="the strategy the relays will run (to or from wal: refused)"
    )
    p.add_argument(
        "--mode", choices=["delete", "mark-sent"], default="delete", help="row strategies: what happens to relayed rows"
    )
    p.set_defaults(func=cmd_switch_strategy)

    p = sub.add_parser("release-lease", help="free a stuck partition lease (partitioned, serialized)")
    add_db_args(p)
    p.add_argument("topic")
    p.add_argument("partition", type=int)
    p.set_defaults(func=cmd_release_lease)


def _check_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Kafka checked against the outbox, and the throughput bench."""
    p = sub.add_parser(
        "verify",
        help="check Kafka against the outbox ledger: lost, phantom, duplicates, order, latency",
        description="Consume the topics (read_committed, every partition, until idle) and match records to the "
        "outbox ledger by message_id. Exit 0 when nothing is lost, phantom or out of order, 1 otherwise.",
    )
    add_db_args(p)
    p.add_argument("topics", nargs="+", metavar="TOPIC", help="Kafka topics to verify")
    p.add_argument(
        "--from",
        dest="from_offsets",
        action="append",
        metavar="TOPIC:PARTITION:OFFSET",
        help="start this partition here instead of at the beginning (repeatable)",
    )
    p.add_argument("--ledger-file", help="message ids, one per line, instead of the outbox table (delete mode)")
    p.add_argument("--since", type=timestamp_arg, help="table ledger: rows created at or after (ISO-8601, UTC default)")
    p.add_argument("--id-from", type=int, help="table ledger: rows with id >= N")
    p.add_argument(
        "--ordered",
        choices=("partitioned", "serialized", "advisory"),
        help="check per-key order as this strategy promises it",
    )
    p.add_argument("--idle-s", type=float, default=5.0, help="stop when every partition is idle this long")
    p.add_argument("--max-seconds", type=float, help="stop consuming after this long even if not idle")
    p.add_argument("--bootstrap-servers", help="Kafka bootstrap servers (default: $KAFKA_BOOTSTRAP_SERVERS)")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("bench", help="load N messages and drain them: msg/s, CPU, RSS; naive baseline")
    from ..bench.arguments import add_arguments as add_bench_arguments

    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)


def _dev_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The servers, demo traffic and Dagster, all local: the way to try the project (README)."""
    p = sub.add_parser("dev", help="run PostgreSQL, the broker, demo traffic and dagster dev locally")
    p.add_argument("--no-dagster", action="store_true", help="start the servers and traffic only")
    p.add_argument("--rate", type=float, default=None, help="demo traffic, messages per second")
    p.set_defaults(func=cmd_dev)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        return int(args.func(args))
    except OutboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except psycopg.OperationalError as exc:
        dsn = getattr(args, "dsn", None) or ""
        where = f" ({redact_dsn(dsn)})" if dsn else ""
        print(f"error: cannot reach PostgreSQL{where}: {str(exc).strip()}", file=sys.stderr)
        return 2
