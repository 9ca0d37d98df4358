"""`outbox relay`: worker processes from the flags, and the summary they end with. See
docs/operations.md#command-line."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence
from multiprocessing.process import BaseProcess

from .. import server
from ..config import redact_dsn
from ..errors import OutboxError
from ..model import WAL
from ..relay.relay_settings import RelaySettings
from ..relay.workers import WorkerResult, WorkerSpec, run_worker_processes
from ..store import schema
from ..store.relayable import require_relayable
from ..strategies.base import StrategyConfig
from ..strategies.positions import PositionStrategy
from ..strategies.quarantine import on_poison_from_env
from .common import dsn_of, kafka_config_of, strategy_named, table_of

# `outbox relay --until-empty` stopped by --max-seconds with rows still pending (1: a worker crashed,
# 2: a usage or configuration error).
EXIT_NOT_EMPTY = 3


def cmd_relay(args: argparse.Namespace) -> int:
    if args.workers < 1 or args.batch_size < 1:
        raise OutboxError("--workers and --batch-size must be >= 1")
    dsn, table = dsn_of(args), table_of(args)
    kafka = kafka_config_of(args)
    with server.connect(dsn, autocommit=True) as conn:
        schema.require_current(conn, table)
        strategy = require_relayable(conn, table, args.strategy)
    if args.kafka_transactions and (strategy == WAL or not issubclass(strategy_named(strategy), PositionStrategy)):
        raise OutboxError(f"--kafka-transactions needs a position strategy (partitioned, serialized), not {strategy!r}")
    settings = RelaySettings.from_env(
        batch_size=args.batch_size,
        listen=not args.no_listen,
        until_empty=args.until_empty,
        max_seconds=args.max_seconds,
    )
    config = StrategyConfig(
        table=table,
        mode=args.mode,
        kafka_transactions=args.kafka_transactions,
        on_poison=args.on_poison or on_poison_from_env(),
    )
    specs = [
        WorkerSpec(
            dsn=dsn,
            strategy=strategy,
            kafka_config=kafka,
            settings=settings,
            config=config,
            worker_id=f"{args.worker_id}-{n}" if args.worker_id else None,
            index=n,
            metrics_port=args.metrics_port,
            log_level=logging.DEBUG if args.verbose else logging.INFO,
        )
        for n in range(args.workers)
    ]
    print(f"relay: {args.workers} x {strategy} on schema {table.schema!r} ({redact_dsn(dsn)})", flush=True)
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
