"""Setting up and feeding an outbox: init-db, enqueue, load, demo-traffic, bench, dev. See
docs/operations.md#command-line."""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import signal
import sys
import threading

from .. import server, settings
from ..config import redact_dsn
from ..errors import OutboxError
from ..model import WAL
from ..store import indexes, schema, strategy_record
from ..store.enqueue import enqueue
from ..store.migrations import DEFAULT_TOPIC_ROW
from ..store.wal import grants, refusals
from ..store.wal.objects import names_of
from .common import dsn_of, table_of


def cmd_init_db(args: argparse.Namespace) -> int:
    table = table_of(args)
    with server.connect(dsn_of(args), autocommit=True) as conn:
        applied = schema.init_db(conn, table, days_ahead=args.days_ahead, strategies=args.strategy)
        if args.partitions is not None:
            schema.set_topic_partitions(conn, table, DEFAULT_TOPIC_ROW, args.partitions)
        for name, count in args.topic or []:
            schema.set_topic_partitions(conn, table, name, count)
        version = schema.current_version(conn, table)
        found = indexes.states(conn, table)
        relayed_by = strategy_record.recorded(conn, table)
        exposure = grants.exposure(conn, table) if relayed_by is not None and relayed_by.strategy == WAL else None
        stored = refusals.stored_rows(conn, table) if relayed_by is not None and relayed_by.strategy == WAL else 0
    names = ", ".join(f"{m.version} ({m.name})" for m in applied) or "none (already current)"
    print(f"schema {table.schema!r} at version {version}; applied: {names}")
    print(f"strategy indexes: {_describe(found)}")
    if relayed_by is None:
        print("relay strategy: none recorded yet (its first relay records its own; or `outbox init-db --strategy S`)")
    else:
        print(
            f"relay strategy: {relayed_by.strategy} (recorded by {relayed_by.recorded_by}; `outbox switch-strategy` "
            "changes it)"
        )
    if relayed_by is not None and relayed_by.strategy == WAL:
        wal = names_of(table)
        print(
            f"wal: replication slot {wal.slot!r}, publication {wal.publication!r}; writers emit with "
            f"{settings.WRITE_TO.name}=wal (an INSERT into the message table emits too, at the cost of the INSERT)"
        )
    if exposure is not None:
        print(f"wal: {exposure.describe()}", file=sys.stderr if exposure.exposed else sys.stdout)
    if stored:
        print(refusals.stored_rows_problem(table, stored))
    return 0


def cmd_indexes(args: argparse.Namespace) -> int:
    table = table_of(args)
    with server.connect(dsn_of(args), autocommit=True) as conn:
        schema.require_current(conn, table)
        for index in indexes.indexes_for(args.strategy or ()):
            built = indexes.build(conn, table, index)
            if built:
                print(f"built {index.name} on {len(built)} partitions")
        if args.drop_others:
            if not args.strategy:
                raise OutboxError("--drop-others needs --strategy: the strategies whose indexes stay")
            for name in indexes.drop_except(conn, table, args.strategy):
                print(f"dropped {name}")
        found = indexes.states(conn, table)
    print(f"strategy indexes of {table.schema!r}: {_describe(found)}")
    return 0


def _describe(found: dict[str, indexes.IndexState]) -> str:
    """Each index with the strategies it serves and its state."""
    parts = []
    for index in indexes.INDEXES:
        state = found[index.name]
        status = "ready" if state.valid else "building (rerun `outbox indexes`)" if state.exists else "absent"
        parts.append(f"{index.name} ({'/'.join(index.readers)}): {status}")
    return "; ".join(parts)


def cmd_enqueue(args: argparse.Namespace) -> int:
    payload: object
    if args.payload_base64 is not None:
        try:
            payload = base64.b64decode(args.payload_base64, validate=True)
        except binascii.Error as exc:
            raise OutboxError(f"--payload-base64 is not valid base64: {exc}") from None
    else:
        try:
            payload = json.loads(args.payload)
        except json.JSONDecodeError as exc:
            raise OutboxError(f"--payload is not valid JSON: {exc}") from None
    headers = dict(args.header or [])
    with server.connect(dsn_of(args)) as conn:
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
            table=table_of(args),
        )
    print(json.dumps({"id": result.id, "message_id": str(result.message_id)}))
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    from ..localstack.demo import load, print_progress

    elapsed = load(
        dsn_of(args),
        table_of(args),
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
    from ..localstack.demo import TrafficSpec, run_traffic

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
    print(f"demo traffic: {spec.rate} msg/s to {', '.join(spec.topics)} in {redact_dsn(dsn_of(args))}", flush=True)
    stats = run_traffic(dsn_of(args), table_of(args), spec, stop)
    print(f"demo traffic stopped: {stats}", flush=True)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ..bench.command import run

    return run(args)


def cmd_dev(args: argparse.Namespace) -> int:
    from ..localstack.dev import DevSettings, run_dev

    return run_dev(DevSettings.from_env(with_dagster=not args.no_dagster, traffic_rate=args.rate))


# -- relay ------------------------------------------------------------------------------------

# `outbox relay --until-empty` stopped by --max-seconds with rows still pending (1: a worker crashed,
