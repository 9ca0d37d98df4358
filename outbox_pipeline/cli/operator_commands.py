"""Operator actions that change state (replay, dead letters, leases, switching strategy) and `outbox verify`. See
docs/operations.md#command-line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ..errors import OutboxError
from ..operate import dead_letters, operations
from ..operate.switch import switch_strategy
from .common import connect, kafka_config_of, operator_name, table_of
from .relay_command import EXIT_NOT_EMPTY

# Done in part, and said why the rest was not: as `relay --until-empty` stopped with rows pending.
EXIT_PARTIAL = EXIT_NOT_EMPTY


def cmd_replay(args: argparse.Namespace) -> int:
    table = table_of(args)
    rewind_flags = [args.to_id, args.to_xid, args.since]
    row_filters = [args.key, args.id_from, args.id_to, args.created_from, args.created_to]
    if args.partition is None:
        if any(f is not None for f in rewind_flags) or args.force:
            raise OutboxError(
                "--to-id, --to-xid, --since and --force rewind one partition: give --topic and --partition"
            )
        with connect(args) as conn:
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
    with connect(args) as conn:
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
    table = table_of(args)
    if args.action == "retry" and not (args.id or args.topic or args.all):
        # Without a selector it retried every dead letter: an operator who meant one got them all.
        raise OutboxError("dead-letters retry: say which: --id ID (repeatable), --topic TOPIC, or --all")
    with connect(args) as conn:
        if args.action == "retry":
            left = dead_letters.malformed_among(conn, table, ids=args.id, topic=args.topic)
            count = dead_letters.retry_dead_letters(conn, table, ids=args.id, topic=args.topic, by=operator_name())
            print(f"retried {count} dead letters (back in the outbox, before the rows held behind them)")
            if left:
                _say_malformed(left)
            return EXIT_PARTIAL if left else 0
        if args.action == "discard":
            count = dead_letters.discard_dead_letters(
                conn, table, args.id or [], reason=args.reason or "", by=operator_name()
            )
            print(f"discarded {count} dead letters (the rows held behind them are released)")
            return 0
        letters = dead_letters.list_dead_letters(conn, table, args.limit, include_retried=args.include_retried)
    if args.json:
        print(json.dumps([dataclasses.asdict(d) for d in letters], default=str))
        return 0
    for d in letters:
        retried = f" retried_at={d.retried_at.isoformat()}" if d.retried_at else ""
        discarded = f" discarded_at={d.discarded_at.isoformat()} reason={d.discard_reason!r}" if d.discarded_at else ""
        holding = f" HOLDING {d.describe_hold()}" if d.holding else ""
        print(
            f"id={d.id} message_id={d.message_id} {d.topic}/{d.partition} key={d.key} "
            f"payload={d.payload},{d.payload_size}B attempts={d.attempts} "
            f"at={d.dead_lettered_at.isoformat()} by={d.dead_lettered_by}{retried}{discarded}{holding} "
            f"error={d.last_error}"
        )
    print(f"{len(letters)} dead letters{' (limit reached)' if len(letters) == args.limit else ''}")
    return 0


def _say_malformed(ids: list[int]) -> None:
    listed = " ".join(f"id={i}" for i in ids)
    flags = " ".join(f"--id {i}" for i in ids)
    print(
        f"not retried: {len(ids)} malformed dead letters ({listed}): bytes under the outbox's prefix that no outbox "
        "writer made (a hand-made pg_logical_emit_message, a writer of another version), so there is no message to "
        f"put back. Look at them (`outbox dead-letters list`), then remove them: `outbox dead-letters discard {flags} "
        '--reason "malformed"`',
        file=sys.stderr,
    )


def cmd_release_lease(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        released = operations.release_lease(conn, table_of(args), args.topic, args.partition)
    print(
        f"released the lease on {args.topic}/{args.partition}"
        if released
        else f"{args.topic}/{args.partition} was not leased"
    )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ..verify import parse_start_offset, verify

    starts: dict[tuple[str, int], int] = {}
    for spec in args.from_offsets or []:
        topic, partition, offset = parse_start_offset(spec)
        starts[(topic, partition)] = offset
    if args.ledger_file is not None and (args.since is not None or args.id_from is not None):
        raise OutboxError("--since and --id-from narrow the table ledger; a --ledger-file is the whole ledger")
    kafka = kafka_config_of(args)
    with connect(args) as conn:
        report = verify(
            conn,
            table_of(args),
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


def cmd_switch_strategy(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        done = switch_strategy(conn, table_of(args), args.to, mode=args.mode)
    if done.partitions or not done.rows:
        print(f"positions of {done.partitions} partitions set for {done.strategy}; start its relays now")
    else:
        print(f"{done.rows} relayed rows {'deleted' if args.mode == 'delete' else 'marked sent'} for {done.strategy}")
    return 0
