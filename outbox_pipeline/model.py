"""The records every layer passes around: a row to publish, what Kafka confirmed of a batch, a claim and its ack, and
the names of the strategies. It imports nothing of the package, so the store, the strategies and the relays can all
use it (docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

# The table strategies (strategies/, one module each) and the wal lane (relay/wal/): what an outbox can be relayed by.
STRATEGY_NAMES = ("locking", "advisory", "lease", "partitioned", "serialized")
WAL = "wal"
RECORDED_NAMES = (*STRATEGY_NAMES, WAL)
# The strategies that keep a position per partition (the others mark or delete rows).
POSITION_STRATEGIES = ("partitioned", "serialized")
# Every strategy, the ordered ones first (``all``).
ORDERED_FIRST = ("partitioned", "serialized", "advisory", "lease", "locking")


class OutboxRecord(NamedTuple):
    """One row to publish. A named tuple, not a dataclass: built once per row on the hot path, where a
    frozen dataclass's __init__ cost more than fetching the row."""

    id: int
    topic: str
    key: bytes | None
    payload: bytes  # as published: the row's bytes, or its JSON text in UTF-8
    headers: str  # jsonb text; "{}" when the row has none
    message_id: bytes
    outbox_id: bytes
    created_at: int  # microseconds since 2000-01-01 UTC, the binary timestamptz (timestamps.py)
    type: bytes | None
    partition: int
    transaction_id: str
    attempts: int
    binary: bool  # the payload is bytes (payload_bytes), not JSON text


# Why Kafka did not confirm a record, which decides what the failure costs the record:
# - "permanent": the record can never be delivered (too large, invalid topic name): dead-letter it now;
# - "record": Kafka refused this record (an explicit per-record error, a topic that does not exist):
#   counts toward ``max_attempts``;
# - "transport": the broker was unreachable, timed out or fenced the producer. Not the record's fault,
#   so it never counts: a broker maintenance window must not turn into dead letters. The relay backs
#   off and the lag rises (and alerts) instead.
FailureKind = Literal["permanent", "record", "transport"]


@dataclass(frozen=True, slots=True)
class DeliveryFailure:
    record: OutboxRecord
    error: str
    kind: FailureKind

    @property
    def permanent(self) -> bool:
        return self.kind == "permanent"

    @property
    def counts(self) -> bool:
        """Whether this failure counts toward the record's ``max_attempts``."""
        return self.kind != "transport"


@dataclass(frozen=True, slots=True)
class PublishOutcome:
    """What Kafka confirmed for one batch: ``delivered`` keeps the batch's order."""

    delivered: Sequence[OutboxRecord]
    failed: Sequence[DeliveryFailure]
    elapsed_s: float = 0.0


@dataclass
class Claim:
    """A batch a worker owns until it acks or gives it back. ``state`` is the strategy's own."""

    records: list[OutboxRecord]
    collisions: int = 0
    state: Any = None
    # Set by strategies that publish atomically (Kafka transactions): each (topic, partition)'s transactional id;
    # each partition's rows of the batch are one transaction.
    transactional_ids: Mapping[tuple[str, int], str] | None = None
    # Ordered strategies (quarantine.py): rows read but not published, their key being held; the ack moves
    # them into the hold. A claim may consist of these alone.
    withheld: list[OutboxRecord] = field(default_factory=list)
    # The quarantine version the claim was read under, and whether it publishes released held rows.
    holds_version: int = 0
    release: bool = False
    # Whether other work was waiting when this was claimed (another partition a position strategy could lease): the
    # relay claims again at once. A full batch means the same; otherwise it waits for a NOTIFY or its poll.
    others_waiting: bool = False


@dataclass(frozen=True, slots=True)
class AckResult:
    acked: int = 0
    # Published, but the worker no longer owned the rows when it tried to ack (lease expired and
    # another worker took them): those rows will be published again by their new owner.
    lost_ownership: int = 0
    retried: int = 0
    dead_lettered: int = 0
