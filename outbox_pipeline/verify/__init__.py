"""``outbox verify``: the delivery ledger check a user runs against a deployment: lost, phantom, duplicates, order,
latency (docs/operations.md#checking-delivery-outbox-verify). Each module: docs/architecture.md#commands."""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psycopg

from ..config import OutboxTable
from ..errors import OutboxError
from ..model import WAL
from ..store import strategy_record
from .checks import ORDERED_STRATEGIES, OrderedStrategy, Workspace
from .consume import consume_topics, make_consumer
from .report import Latency, MessageRef, OrderViolation, VerifyReport

__all__ = ["VerifyReport", "make_consumer", "parse_start_offset", "verify"]

log = logging.getLogger(__name__)

DEFAULT_IDLE_S = 5.0


def parse_start_offset(text: str) -> tuple[str, int, int]:
    """``topic:partition:offset`` (Kafka topic names cannot contain ``:``)."""
    parts = text.rsplit(":", 2)
    try:
        if len(parts) != 3 or not parts[0]:
            raise ValueError
        topic, partition, offset = parts[0], int(parts[1]), int(parts[2])
        if partition < 0 or offset < 0:
            raise ValueError
    except ValueError:
        raise OutboxError(f"--from takes TOPIC:PARTITION:OFFSET with non-negative numbers, got {text!r}") from None
    return topic, partition, offset


def verify(
    conn: psycopg.Connection,
    table: OutboxTable,
    bootstrap_config: Mapping[str, object],
    topics: Sequence[str],
    *,
    ledger_file: str | Path | None = None,
    ordered: OrderedStrategy | None = None,
    since: dt.datetime | None = None,
    id_from: int | None = None,
    start_offsets: Mapping[tuple[str, int], int] | None = None,
    idle_s: float = DEFAULT_IDLE_S,
    max_s: float | None = None,
) -> VerifyReport:
    """Check what ``topics`` hold against the outbox ledger; see the module docstring.

    The ledger is the outbox table's rows of ``topics`` (the strategies that keep rows: partitioned,
    serialized, mark-sent mode), optionally from ``since`` (created_at) / ``id_from`` (outbox id), or the
    message ids in ``ledger_file`` (one per line: for delete mode, whose relayed rows are gone). Pending
    dead letters are not in it. ``conn`` may be in autocommit mode; verify's own transactions are short
    (one per COPY chunk), so it never holds back the ``partitioned`` relay's snapshot horizon.
    ``max_s`` bounds the consumption (for topics that never go idle); the report then says so.
    """
    names = tuple(dict.fromkeys(topics))
    _check_arguments(
        names, ordered, ledger_file, narrowed=since is not None or id_from is not None, idle_s=idle_s, max_s=max_s
    )
    if since is not None and since.tzinfo is None:
        since = since.replace(tzinfo=dt.UTC)
    _refuse_table_ledger_of_wal(conn, table, ledger_file)
    starts = _start_offsets(names, start_offsets)

    started = time.monotonic()
    work = Workspace(conn, table)
    try:
        work.create()
        # The ledger is taken before consuming: rows committed while verify runs are not expected, and
        # when they arrive anyway they are still found in the outbox table (not phantom).
        dead_letters, held = (
            work.load_ledger_file(Path(ledger_file))
            if ledger_file is not None
            else work.load_ledger_table(names, since, id_from)
        )
        log.debug("verify: ledger loaded in %.1f s", time.monotonic() - started)
        consumed = consume_topics(make_consumer(bootstrap_config), names, starts, idle_s, max_s, work)
        return work.report(
            names,
            ledger="file" if ledger_file is not None else "table",
            dead_letters=dead_letters,
            held=held,
            consumed=consumed,
            ordered=ordered,
            since=since,
            id_from=id_from,
            from_offsets=bool(starts),
            elapsed_s=time.monotonic() - started,
        )
    finally:
        work.drop()


def _check_arguments(
    names: tuple[str, ...],
    ordered: OrderedStrategy | None,
    ledger_file: str | Path | None,
    *,
    narrowed: bool,
    idle_s: float,
    max_s: float | None,
) -> None:
    """Refuse what no verification can mean, before anything is read (one line each, as the CLI prints it)."""
    if not names:
        raise OutboxError("give at least one topic to verify")
    if ordered is not None and ordered not in ORDERED_STRATEGIES:
        raise OutboxError(f"--ordered takes one of {', '.join(ORDERED_STRATEGIES)}, not {ordered!r}")
    if ledger_file is not None and narrowed:
        raise OutboxError("--since and --id-from narrow the table ledger; a --ledger-file is the whole ledger")
    if idle_s <= 0 or (max_s is not None and max_s <= 0):
        raise OutboxError("--idle-s and --max-seconds must be > 0")


def _refuse_table_ledger_of_wal(conn: psycopg.Connection, table: OutboxTable, ledger_file: str | Path | None) -> None:
    """A wal outbox keeps no rows: its table is no ledger, its writers' message ids are."""
    recorded = strategy_record.recorded(conn, table)
    if ledger_file is None and recorded is not None and recorded.strategy == WAL:
        raise OutboxError(
            f"the outbox {table.schema!r} is a wal outbox: it keeps no rows to take the ledger from; give the message "
            "ids your writers committed as --ledger-file (one per line, as for the delete mode)"
        )


def _start_offsets(
    names: tuple[str, ...], start_offsets: Mapping[tuple[str, int], int] | None
) -> dict[tuple[str, int], int]:
    """Where to start the partitions given one (every other starts at the beginning), each of a topic verified."""
    starts = dict(start_offsets or {})
    for topic, _partition in starts:
        if topic not in names:
            raise OutboxError(f"--from names topic {topic!r}, which is not one of the topics to verify")
    return starts


__all__ = [
    "DEFAULT_IDLE_S",
    "ORDERED_STRATEGIES",
    "Latency",
    "MessageRef",
    "OrderViolation",
    "OrderedStrategy",
    "VerifyReport",
    "parse_start_offset",
    "verify",
]
