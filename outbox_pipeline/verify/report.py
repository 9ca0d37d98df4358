"""What `outbox verify` found, and how it says it. See docs/operations.md#checking-delivery-outbox-verify."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MessageRef:
    """One lost or phantom message, as far as it is known (lost ones have no Kafka position)."""

    message_id: str | None
    outbox_id: int | None = None
    topic: str | None = None
    key: str | None = None
    partition: int | None = None  # Kafka partition
    offset: int | None = None


@dataclass(frozen=True)
class OrderViolation:
    """In ``topic``/``partition``, ``key``'s message ``outbox_id`` (at ``offset``) belongs before the one
    at ``previous_offset`` (``previous_outbox_id``), which Kafka holds first."""

    topic: str
    partition: int
    key: str
    previous_offset: int
    previous_outbox_id: int | None
    offset: int
    outbox_id: int | None


@dataclass(frozen=True)
class Latency:
    """created_at -> broker timestamp of each message's first copy, in milliseconds."""

    messages: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float


@dataclass(frozen=True)
class VerifyReport:
    topics: tuple[str, ...]
    ledger: str  # "table" or "file"
    ledger_messages: int  # committed messages verify expects in Kafka (dead letters excluded)
    partitions: int  # Kafka partitions consumed
    consumed_records: int
    ignored_records: int  # outside the table ledger's --since / --id-from range
    complete: bool  # False: stopped by max_s before every partition was idle
    elapsed_s: float
    lost: int
    phantom: int
    duplicate_copies: int  # records beyond the first copy of each message
    duplicated_messages: int
    worst_duplicate_key: str | None
    worst_duplicate_key_copies: int
    dead_letters: int  # not lost: the relay gave up on them (`outbox dead-letters list`)
    held: int  # not lost: held behind a dead letter of their key (quarantine; `outbox lag`)
    ordered: str | None
    order_checked: int  # messages whose order was checked
    order_violations: int
    order_example: OrderViolation | None
    latency: Latency | None
    lost_examples: tuple[MessageRef, ...] = ()
    phantom_examples: tuple[MessageRef, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """No loss, no phantom, no order violation (duplicates are at-least-once, not an error)."""
        return self.lost == 0 and self.phantom == 0 and self.order_violations == 0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ok": self.ok}

    def render(self) -> str:
        """The human-readable report."""
        lines = [
            f"topics       {', '.join(self.topics)}",
            f"ledger       {self.ledger_messages:,} committed messages ({self.ledger})",
            f"consumed     {self.consumed_records:,} records from {self.partitions} "
            f"partition{'' if self.partitions == 1 else 's'} in "
            f"{self.elapsed_s:.1f} s (read_committed)"
            + (f", {self.ignored_records:,} outside the ledger's range ignored" if self.ignored_records else ""),
            f"lost         {self.lost:,}",
        ]
        lines += [f"  lost       {_describe(m)}" for m in self.lost_examples]
        lines.append(f"phantom      {self.phantom:,}")
        lines += [f"  phantom    {_describe(m)}" for m in self.phantom_examples]
        dupes = f"duplicates   {self.duplicate_copies:,} extra copies of {self.duplicated_messages:,} messages"
        if self.duplicate_copies:
            dupes += f"; worst key {_show_key(self.worst_duplicate_key)} ({self.worst_duplicate_key_copies:,} extra)"
        lines.append(dupes)
        if self.ordered is None:
            lines.append("order        not checked (give --ordered partitioned|serialized|advisory)")
        else:
            lines.append(
                f"order        {self.order_violations:,} violations in {self.order_checked:,} keyed messages "
                f"({self.ordered})"
            )
            if self.order_example is not None:
                e = self.order_example
                lines.append(
                    f"  example    {e.topic}/{e.partition} key {_show_key(e.key)}: outbox id {e.outbox_id} at offset "
                    f"{e.offset} comes after outbox id {e.previous_outbox_id} at offset {e.previous_offset}"
                )
        if self.latency is None:
            lines.append("latency      no record with both a created_at header and a broker timestamp")
        else:
            la = self.latency
            lines.append(
                f"latency      p50 {la.p50_ms:,.1f} ms, p95 {la.p95_ms:,.1f} ms, p99 {la.p99_ms:,.1f} ms, "
                f"max {la.max_ms:,.1f} ms over {la.messages:,} messages (created_at -> broker timestamp)"
            )
        lines.append(f"dead letters {self.dead_letters:,} (not counted as lost: `outbox dead-letters list`)")
        if self.held:
            lines.append(
                f"held         {self.held:,} behind dead letters of their keys (not counted as lost: `outbox lag`)"
            )
        lines += [f"note: {n}" for n in self.notes]
        if self.ok:
            lines.append(
                "OK: every committed message is in Kafka, nothing else is" + (", in order" if self.ordered else "")
            )
        else:
            problems = [
                f"{n:,} {what}"
                for n, what in ((self.lost, "lost"), (self.phantom, "phantom"), (self.order_violations, "out of order"))
                if n
            ]
            lines.append("FAILED: " + ", ".join(problems))
        return "\n".join(lines)


def _show_key(key: str | None) -> str:
    return "(no key)" if key is None else repr(key)


def _describe(m: MessageRef) -> str:
    parts = [f"message_id={m.message_id or '(none)'}"]
    if m.outbox_id is not None:
        parts.append(f"outbox_id={m.outbox_id}")
    if m.topic is not None:
        parts.append(f"topic={m.topic}" + (f"/{m.partition}@{m.offset}" if m.partition is not None else ""))
    parts.append(f"key={_show_key(m.key)}")
    return " ".join(parts)
