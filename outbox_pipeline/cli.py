"""Engine room: the ``outbox`` command line.

Configuration comes from the environment (``OUTBOX_PG_DSN``, ``OUTBOX_SCHEMA``, ``KAFKA_*``); flags
override it. Errors a user can fix print one line and exit 2; DSN passwords are never printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import getpass
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from multiprocessing.process import BaseProcess

import psycopg

from . import operations, schema
from .config import (
    OutboxTable,
    kafka_config_from_env,
    parse_timestamp,
    pg_dsn_from_env,
    redact_dsn,
    redact_kafka_config,
)
from .enqueue import enqueue
from .errors import ConfigurationError, OutboxError
from .horizon import find_horizon
from .lag import PartitionLag, describe_holders, held_keys, holders, partition_lag
from .liveness import holders_alive, liveness_from_env
from .publisher import check_producer_config
from .relay import RelaySettings
from .strategies import STRATEGY_NAMES, strategy_class
from .strategies.base import Strategy
from .strategies.positions import PositionStrategy
from .strategies.quarantine import ON_POISON_CHOICES, on_poison_from_env
from .workers import WorkerResult, WorkerSpec, run_worker_processes

log = logging.getLogger("outbox")


def _add_db_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", help="libpq DSN or URI (default: $OUTBOX_PG_DSN)")
    parser.add_argument("--schema", help="schema holding the outbox tables (default: $OUTBOX_SCHEMA or 'outbox')")


def _table(args: argparse.Namespace) -> OutboxTable:
    base = OutboxTable.from_env()
    return OutboxTable(schema=args.schema or base.schema, max_message_bytes=base.max_message_bytes)


def _dsn(args: argparse.Namespace) -> str:
    return args.dsn or pg_dsn_from_env()


def cmd_init_db(args: argparse.Namespace) -> int:
    table = _table(args)
    with psycopg.connect(_dsn(args), autocommit=True) as conn:
        applied = schema.init_db(conn, table, days_ahead=args.days_ahead)
        if args.partitions is not None:
            schema.set_topic_partitions(conn, table, schema.DEFAULT_TOPIC_ROW, args.partitions)
        for topic_spec in args.topic or []:
            name, _, count = topic_spec.partition(":")
            schema.set_topic_partitions(conn, table, name, int(count))
        version = schema.current_version(conn, table)
    names = ", ".join(f"{m.version} ({m.name})" for m in applied) or "none (already current)"
    print(f"schema {table.schema!r} at version {version}; applied: {names}")
    return 0


def cmd_enqueue(args: argparse.Namespace) -> int:
    try:
        payload = json.loads(args.payload)
    except json.JSONDecodeError as exc:
        raise OutboxError(f"--payload is not valid JSON: {exc}") from None
    headers = dict(h.split("=", 1) for h in args.header or [])
    with psycopg.connect(_dsn(args)) as conn:
        result = enqueue(
            conn,
            args.topic,
            payload,
            key=args.key,
            headers=headers,
            type=args.type,
            priority=args.priority,
            partition=args.partition,
            serialized=args.serialized,
            table=_table(args),
        )
    print(json.dumps({"id": result.id, "message_id": str(result.message_id)}))
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    from .demo import load, print_progress

    elapsed = load(
        _dsn(args),
        _table(args),
        args.count,
        payload_bytes=args.size,
        topics=args.topics.split(","),
        keys=args.keys,
        rows_per_transaction=args.rows_per_transaction,
        route_in_db=args.route_in_db,
        progress=print_progress,
    )
    sys.stderr.write("\n")
    rate = args.count / elapsed if elapsed > 0 else 0.0
    print(f"loaded {args.count:,} messages of {args.size} B in {elapsed:.2f} s ({rate:,.0f} msg/s)")
    return 0


def cmd_demo_traffic(args: argparse.Namespace) -> int:
    from .demo import TrafficSpec, run_traffic

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    spec = TrafficSpec(
        rate=args.rate,
        topics=tuple(args.topics.split(",")),
        keys=args.keys,
        rollback_every=args.rollback_every,
        long_tx_every_s=args.long_tx_every,
    )
    print(f"demo traffic: {spec.rate} msg/s to {', '.join(spec.topics)} in {redact_dsn(_dsn(args))}", flush=True)
    stats = run_traffic(_dsn(args), _table(args), spec, stop)
    print(f"demo traffic stopped: {stats}", flush=True)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.command import run

    return run(args)


def cmd_dev(args: argparse.Namespace) -> int:
    from .localstack.dev import DevSettings, run_dev

    return run_dev(DevSettings.from_env(with_dagster=not args.no_dagster, traffic_rate=args.rate))


# -- relay ------------------------------------------------------------------------------------

# `outbox relay --until-empty` stopped by --max-seconds with rows still pending (1: a worker crashed,
# 2: a usage or configuration error).
EXIT_NOT_EMPTY = 3


def _strategy(name: str) -> type[Strategy]:
    try:
        return strategy_class(name)
    except ImportError as exc:
        raise OutboxError(f"strategy {name!r} is not available in this installation ({exc})") from None


def _kafka_config(args: argparse.Namespace) -> dict[str, str]:
    """``KAFKA_*`` from the environment, ``--bootstrap-servers`` winning; checked by building a producer."""
    env = dict(os.environ)
    if args.bootstrap_servers:
        env["KAFKA_BOOTSTRAP_SERVERS"] = args.bootstrap_servers
    config = kafka_config_from_env(env)
    check_producer_config(config)
    log.debug("kafka config: %s", redact_kafka_config(config))
    return config


def cmd_relay(args: argparse.Namespace) -> int:
    cls = _strategy(args.strategy)
    if args.workers < 1 or args.batch_size < 1:
        raise OutboxError("--workers and --batch-size must be >= 1")
    if args.kafka_transactions and not issubclass(cls, PositionStrategy):
        raise OutboxError(f"--kafka-transactions needs a position strategy (partitioned, serialized), not {cls.name!r}")
    dsn, table = _dsn(args), _table(args)
    kafka = _kafka_config(args)
    with psycopg.connect(dsn, autocommit=True) as conn:
        schema.require_current(conn, table)
    settings = RelaySettings(
        batch_size=args.batch_size,
        listen=not args.no_listen,
        until_empty=args.until_empty,
        max_seconds=args.max_seconds,
        liveness=liveness_from_env(),
    )
    specs = [
        WorkerSpec(
            index=n,
            worker_id=f"{args.worker_id}-{n}" if args.worker_id else None,
            dsn=dsn,
            schema=table.schema,
            max_message_bytes=table.max_message_bytes,
            strategy=args.strategy,
            mode=args.mode,
            kafka_transactions=args.kafka_transactions,
            on_poison=args.on_poison or on_poison_from_env(),
            kafka_config=kafka,
            settings=settings,
            metrics_port=args.metrics_port,
            log_level=logging.DEBUG if args.verbose else logging.INFO,
        )
        for n in range(args.workers)
    ]
    print(f"relay: {args.workers} x {args.strategy} on schema {table.schema!r} ({redact_dsn(dsn)})", flush=True)
    processes, collected = run_worker_processes(specs)
    return _print_summary(processes, collected)


def _print_summary(processes: Sequence[BaseProcess], collected: Mapping[int, WorkerResult]) -> int:
    crashed = 0
    for index, process in enumerate(processes):
        result = collected.get(index)
        if result is None or result.error is not None or process.exitcode != 0:
            crashed += 1
            reason = result.error if result and result.error else f"exit code {process.exitcode}"
            print(f"worker {index} ({result.worker_id if result else process.name}) crashed: {reason}")
        if result is not None:
            print(f"worker {index} ({result.worker_id}): {result.summary}")
    done = list(collected.values())
    published = sum(r.published for r in done)
    elapsed = max((r.elapsed_s for r in done), default=0.0)
    rate = published / elapsed if elapsed > 0 else 0.0
    print(
        f"total: published={published} msg/s={rate:,.0f} collisions={sum(r.collisions for r in done)} "
        f"published_but_ack_failed={sum(r.lost_ownership for r in done)} "
        f"dead_lettered={sum(r.dead_lettered for r in done)} retried={sum(r.retried for r in done)} "
        f"workers={len(processes)} crashed={crashed}",
        flush=True,
    )
    remaining = [line for r in done for line in r.remaining]
    if remaining and not crashed:
        print(f"not empty after --max-seconds: {len(remaining)} reason(s)", flush=True)
        for line in dict.fromkeys(remaining):  # workers of one relay see the same pending rows
            print(f"  {line}", flush=True)
        return EXIT_NOT_EMPTY
    return 1 if crashed else 0


# -- lag and operator actions -----------------------------------------------------------------


def _connect(args: argparse.Namespace) -> psycopg.Connection:
    conn = psycopg.connect(_dsn(args), autocommit=True)
    try:
        schema.require_current(conn, _table(args))
    except BaseException:
        conn.close()
        raise
    return conn


def cmd_lag(args: argparse.Namespace) -> int:
    _strategy(args.strategy)
    if args.cap is not None and args.cap < 1:
        raise OutboxError("--cap must be >= 1")
    with _connect(args) as conn:
        lags = partition_lag(conn, _table(args), args.strategy, cap=args.cap)
        alive = holders_alive(conn, _table(args), holders(lags))
        held = [key for key in held_keys(conn, _table(args)) if key.rows or not key.released]
        horizon = find_horizon(conn, _table(args)) if args.strategy == "partitioned" else None
    if args.json:
        print(json.dumps([{**dataclasses.asdict(lag), "holders": _holders_json(lag, alive)} for lag in lags]))
    else:
        print(_lag_table(lags, args.cap, alive))
        for key in held:
            print(key.describe())
        for line in horizon.describe() if horizon else []:
            print(line)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from . import status

    _strategy(args.strategy)
    with _connect(args) as conn:
        statuses = status.partition_status(conn, _table(args), args.strategy)
    if args.json:
        print(json.dumps([dataclasses.asdict(s) for s in statuses]))
    else:
        print(status.render(statuses))
    return 0


def _holders_json(lag: PartitionLag, alive: Mapping[str, bool | None]) -> dict[str, bool | None]:
    return {h: alive.get(h) for h in (lag.leased_by or "").split(",") if h}


def _lag_table(lags: Sequence[PartitionLag], cap: int | None, alive: Mapping[str, bool | None]) -> str:
    header = (
        "topic",
        "partition",
        "pending",
        "held",
        "oldest_s",
        "position",
        "held_by",
        "until",
        "attempts",
        "backoff",
        "last_error",
    )
    rows = [
        (
            lag.topic,
            str(lag.partition),
            f"{lag.pending}+" if cap is not None and lag.pending >= cap else str(lag.pending),
            str(lag.held),
            f"{lag.oldest_pending_age_s:.1f}" if lag.oldest_pending_age_s is not None else "-",
            lag.position or "-",
            describe_holders(lag.leased_by, alive) if lag.leased_by else "-",
            lag.until or "-",
            str(lag.attempts),
            "yes" if lag.in_backoff else "no",
            (lag.last_error or "-").replace("\n", " ")[:60],
        )
        for lag in lags
    ]
    if not rows:
        return "nothing pending"
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=False)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in (header, *rows)]
    total = sum(lag.pending for lag in lags)
    return "\n".join(
        [*lines, f"total pending: {total}{'+' if cap is not None and any(r[2].endswith('+') for r in rows) else ''}"]
    )


def _timestamp(text: str) -> dt.datetime:
    """ISO-8601; a time without an offset is UTC (argparse reports the error with the flag's name)."""
    try:
        return parse_timestamp(text)
    except ConfigurationError:
        raise argparse.ArgumentTypeError(f"not an ISO-8601 timestamp: {text!r}") from None


def cmd_replay(args: argparse.Namespace) -> int:
    table = _table(args)
    rewind_flags = [args.to_id, args.to_xid, args.since]
    row_filters = [args.key, args.id_from, args.id_to, args.created_from, args.created_to]
    if args.partition is None:
        if any(f is not None for f in rewind_flags) or args.force:
            raise OutboxError(
                "--to-id, --to-xid, --since and --force rewind one partition: give --topic and --partition"
            )
        with _connect(args) as conn:
            count = operations.replay_sent(
                conn,
                table,
                topic=args.topic,
                key=args.key,
                id_from=args.id_from,
                id_to=args.id_to,
                created_from=args.created_from,
                created_to=args.created_to,
                all=args.all,
            )
        hint = "" if count else " (only rows kept by `relay --mode mark-sent` can be replayed)"
        print(f"replayed {count} sent rows (they are pending again){hint}")
        return 0
    if args.topic is None:
        raise OutboxError("--partition needs --topic")
    if any(f is not None for f in row_filters) or args.all:
        raise OutboxError("a partition rewind takes --to-id [--to-xid] or --since, not row filters")
    with _connect(args) as conn:
        rewound = operations.rewind_partition(
            conn,
            table,
            args.topic,
            args.partition,
            to_id=args.to_id,
            to_xid=args.to_xid,
            since=args.since,
            force=args.force,
        )
    print(
        f"rewound {rewound.topic}/{rewound.partition} from xid={rewound.from_xid} id={rewound.from_id} "
        f"to xid={rewound.to_xid} id={rewound.to_id}"
    )
    return 0


def cmd_dead_letters(args: argparse.Namespace) -> int:
    table = _table(args)
    with _connect(args) as conn:
        if args.action == "retry":
            count = operations.retry_dead_letters(conn, table, ids=args.id, topic=args.topic, by=_operator())
            print(f"retried {count} dead letters (back in the outbox, before the rows held behind them)")
            return 0
        if args.action == "discard":
            count = operations.discard_dead_letters(
                conn, table, args.id or [], reason=args.reason or "", by=_operator()
            )
            print(f"discarded {count} dead letters (the rows held behind them are released)")
            return 0
        letters = operations.list_dead_letters(conn, table, args.limit, include_retried=args.include_retried)
    if args.json:
        print(json.dumps([dataclasses.asdict(d) for d in letters], default=str))
        return 0
    for d in letters:
        retried = f" retried_at={d.retried_at.isoformat()}" if d.retried_at else ""
        discarded = f" discarded_at={d.discarded_at.isoformat()} reason={d.discard_reason!r}" if d.discarded_at else ""
        holding = f" HOLDING {d.describe_hold()}" if d.holding else ""
        print(
            f"id={d.id} message_id={d.message_id} {d.topic}/{d.partition} key={d.key} attempts={d.attempts} "
            f"at={d.dead_lettered_at.isoformat()} by={d.dead_lettered_by}{retried}{discarded}{holding} "
            f"error={d.last_error}"
        )
    print(f"{len(letters)} dead letters{' (limit reached)' if len(letters) == args.limit else ''}")
    return 0


def _operator() -> str:
    """Who ran an operator action, as recorded with it."""
    return f"{getpass.getuser()}@{socket.gethostname()} (outbox CLI)"


def cmd_release_lease(args: argparse.Namespace) -> int:
    with _connect(args) as conn:
        released = operations.release_lease(conn, _table(args), args.topic, args.partition)
    print(
        f"released the lease on {args.topic}/{args.partition}"
        if released
        else f"{args.topic}/{args.partition} was not leased"
    )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .verify import parse_start_offset, verify

    starts: dict[tuple[str, int], int] = {}
    for spec in args.from_offsets or []:
        topic, partition, offset = parse_start_offset(spec)
        starts[(topic, partition)] = offset
    if args.ledger_file is not None and (args.since is not None or args.id_from is not None):
        raise OutboxError("--since and --id-from narrow the table ledger; a --ledger-file is the whole ledger")
    kafka = _kafka_config(args)
    with _connect(args) as conn:
        report = verify(
            conn,
            _table(args),
            kafka,
            args.topics,
            ledger_file=args.ledger_file,
            ordered=args.ordered,
            since=args.since,
            id_from=args.id_from,
            start_offsets=starts,
            idle_s=args.idle_s,
            max_s=args.max_seconds,
        )
    print(json.dumps(report.to_dict(), default=str) if args.json else report.render(), flush=True)
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="outbox", description="Transactional outbox relay: PostgreSQL -> Kafka")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init-db", help="create or migrate the outbox schema (idempotent)")
    _add_db_args(p)
    p.add_argument("--days-ahead", type=int, default=schema.DEFAULT_DAYS_AHEAD, help="daily partitions to create ahead")
    p.add_argument("--partitions", type=int, help="default number of virtual partitions per topic")
    p.add_argument("--topic", action="append", metavar="NAME:PARTITIONS", help="virtual partitions of one topic")
    p.set_defaults(func=cmd_init_db)

    p = sub.add_parser("enqueue", help="enqueue one message in its own transaction")
    _add_db_args(p)
    p.add_argument("--topic", required=True)
    p.add_argument("--payload", required=True, help="JSON text")
    p.add_argument("--key")
    p.add_argument("--type")
    p.add_argument("--header", action="append", metavar="NAME=VALUE")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--partition", type=int)
    p.add_argument("--serialized", action="store_true", help="take the serialized-writer lock")
    p.set_defaults(func=cmd_enqueue)

    p = sub.add_parser("load", help="bulk-load demo messages with COPY")
    _add_db_args(p)
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
    _add_db_args(p)
    p.add_argument("--rate", type=float, default=20.0, help="messages per second")
    p.add_argument("--topics", default="orders,payments,shipments")
    p.add_argument("--keys", type=int, default=50)
    p.add_argument("--rollback-every", type=int, default=25, help="every Nth transaction rolls back (0: never)")
    p.add_argument("--long-tx-every", type=float, default=30.0, help="seconds between long transactions (0: never)")
    p.set_defaults(func=cmd_demo_traffic)

    p = sub.add_parser("relay", help="run relay workers (one process each) until stopped")
    _add_db_args(p)
    p.add_argument("--strategy", required=True, choices=STRATEGY_NAMES)
    p.add_argument("--workers", type=int, default=1, help="worker processes")
    p.add_argument("--batch-size", type=int, default=RelaySettings.batch_size)
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

    p = sub.add_parser(
        "status",
        help="why a partition is not moving: owner, position, pending, held, backoff, dead letters, blocker",
    )
    _add_db_args(p)
    p.add_argument("--strategy", required=True, choices=STRATEGY_NAMES, help="as this strategy sees the outbox")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("lag", help="pending rows per topic and virtual partition")
    _add_db_args(p)
    p.add_argument("--strategy", required=True, choices=STRATEGY_NAMES, help="pending as this strategy sees it")
    p.add_argument("--cap", type=int, help="count at most this many rows per partition (cheap on huge backlogs)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_lag)

    p = sub.add_parser(
        "replay",
        help="publish again: sent rows (mark-sent mode) by filter, or rewind one partition's position",
        description="Without --partition: mark matching sent rows pending again (row strategies, mark-sent mode). "
        "With --topic and --partition: move that partition's position back (partitioned, serialized).",
    )
    _add_db_args(p)
    p.add_argument("--topic")
    p.add_argument("--key")
    p.add_argument("--id-from", type=int, help="ids from (inclusive)")
    p.add_argument("--id-to", type=int, help="ids to (inclusive)")
    p.add_argument("--created-from", type=_timestamp, help="created at or after (ISO-8601, UTC by default)")
    p.add_argument("--created-to", type=_timestamp, help="created before (ISO-8601, UTC by default)")
    p.add_argument("--all", action="store_true", help="replay every sent row (no filter)")
    p.add_argument("--partition", type=int, help="rewind this virtual partition of --topic")
    p.add_argument("--to-id", type=int, help="rewind to just after this id (0: the whole partition)")
    p.add_argument("--to-xid", help="with --to-id: the position's transaction id")
    p.add_argument("--since", type=_timestamp, help="rewind to just before the rows created since then")
    p.add_argument("--force", action="store_true", help="rewind even while a live worker leases the partition")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("dead-letters", help="list dead letters or put them back into the outbox")
    _add_db_args(p)
    p.add_argument("action", choices=("list", "retry", "discard"))
    p.add_argument("--id", type=int, action="append", help="retry, discard: this dead letter (repeatable)")
    p.add_argument("--reason", help="discard: why (recorded with the dead letter)")
    p.add_argument("--topic", help="retry: the dead letters of this topic")
    p.add_argument("--limit", type=int, default=100, help="list: at most this many")
    p.add_argument("--include-retried", action="store_true", help="list: retried ones too")
    p.add_argument("--json", action="store_true", help="list: as JSON")
    p.set_defaults(func=cmd_dead_letters)

    p = sub.add_parser("release-lease", help="free a stuck partition lease (partitioned, serialized)")
    _add_db_args(p)
    p.add_argument("topic")
    p.add_argument("partition", type=int)
    p.set_defaults(func=cmd_release_lease)

    p = sub.add_parser(
        "verify",
        help="check Kafka against the outbox ledger: lost, phantom, duplicates, order, latency",
        description="Consume the topics (read_committed, every partition, until idle) and match records to the "
        "outbox ledger by message_id. Exit 0 when nothing is lost, phantom or out of order, 1 otherwise.",
    )
    _add_db_args(p)
    p.add_argument("topics", nargs="+", metavar="TOPIC", help="Kafka topics to verify")
    p.add_argument(
        "--from",
        dest="from_offsets",
        action="append",
        metavar="TOPIC:PARTITION:OFFSET",
        help="start this partition here instead of at the beginning (repeatable)",
    )
    p.add_argument("--ledger-file", help="message ids, one per line, instead of the outbox table (delete mode)")
    p.add_argument("--since", type=_timestamp, help="table ledger: rows created at or after (ISO-8601, UTC default)")
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
    from .bench.command import add_arguments as add_bench_arguments

    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("dev", help="run PostgreSQL, the broker, demo traffic and dagster dev locally")
    p.add_argument("--no-dagster", action="store_true", help="start the servers and traffic only")
    p.add_argument("--rate", type=float, default=None, help="demo traffic, messages per second")
    p.set_defaults(func=cmd_dev)
    return parser


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


if __name__ == "__main__":
    sys.exit(main())
