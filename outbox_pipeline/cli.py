"""Engine room: the ``outbox`` command line.

Configuration comes from the environment (``OUTBOX_PG_DSN``, ``OUTBOX_SCHEMA``, ``KAFKA_*``); flags
override it. Errors a user can fix print one line and exit 2; DSN passwords are never printed.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence

import psycopg

from . import schema
from .config import OutboxTable, pg_dsn_from_env, redact_dsn
from .enqueue import enqueue
from .errors import OutboxError

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


def cmd_dev(args: argparse.Namespace) -> int:
    from .localstack.dev import DevSettings, run_dev

    return run_dev(DevSettings.from_env(with_dagster=not args.no_dagster, traffic_rate=args.rate))


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
    p.set_defaults(func=cmd_load)

    p = sub.add_parser("demo-traffic", help="write steady demo traffic until interrupted")
    _add_db_args(p)
    p.add_argument("--rate", type=float, default=20.0, help="messages per second")
    p.add_argument("--topics", default="orders,payments,shipments")
    p.add_argument("--keys", type=int, default=50)
    p.add_argument("--rollback-every", type=int, default=25, help="every Nth transaction rolls back (0: never)")
    p.add_argument("--long-tx-every", type=float, default=30.0, help="seconds between long transactions (0: never)")
    p.set_defaults(func=cmd_demo_traffic)

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
