"""What the failures of a batch mean for the wal stream: which messages are dead letters now, which wait behind their
held key, and from where the stream is published again; decisions only, the relay writes. See docs/wal.md#the-relay."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...model import DeliveryFailure, OutboxRecord, PublishOutcome
from ...store.wal.format import MALFORMED_TOPIC
from .pgoutput import Message

_NO_ID = b"00000000-0000-0000-0000-000000000000"


def is_dead_letter(failure: DeliveryFailure) -> bool:
    """Whether a failed message is a dead letter now: whatever Kafka refused it for (its size, a topic it does not
    know), never the transport. The table strategies try a record Kafka refused for now again, up to max_attempts,
    backing off its partition; the wal relay has one stream, and trying it again would stop every key for each
    attempt (a missing topic costs message.timeout.ms each): the dead letter holds its key alone, and `outbox
    dead-letters retry` publishes it, then what its key held, once the topic exists (docs/wal.md, The relay)."""
    return failure.kind != "transport"


@dataclass(frozen=True)
class Progress:
    done: int  # the records from the first that are done: delivered, dead-lettered or held
    withheld: list[OutboxRecord]  # not sent, an earlier message of their key refused: held now (quarantine)
    again: bool  # the rest is published again, after a back-off (Kafka was down)
    acked: int  # delivered among the done


def progress_of(
    records: Sequence[OutboxRecord],
    outcome: PublishOutcome,
    dead: Sequence[DeliveryFailure],
    held: Callable[[OutboxRecord], bool],
) -> Progress:
    """How far the batch got once its ``dead`` letters are written (their keys held: ``held`` says so): what the
    producer did not send behind a refused message of its key is held, not a transport failure (under skip, sent
    again); what failed for the transport is published again from its place."""
    dead_ids = {f.record.id for f in dead}
    withheld = [f.record for f in outcome.failed if f.kind == "transport" and held(f.record)]
    withheld_ids = {r.id for r in withheld}
    again = {f.record.id for f in outcome.failed if f.record.id not in dead_ids | withheld_ids}
    done_count = next((i for i, r in enumerate(records) if r.id in again), len(records))
    failed = {f.record.id for f in outcome.failed}
    done = records[:done_count]  # the rest stays in the batch, where withhold() takes the held
    return Progress(
        done_count,
        [r for r in done if r.id in withheld_ids],
        bool(again),
        sum(1 for r in done if r.id not in failed),
    )


def malformed(event: Message, commit: str, error: str) -> DeliveryFailure:
    """Bytes under the prefix that are no transactional message of ours, as a dead letter (payload_bytes)."""
    record = OutboxRecord(
        event.lsn, MALFORMED_TOPIC, None, bytes(event.content), "{}", _NO_ID, b"", 0, None, -1, commit, 0, True
    )
    return DeliveryFailure(record, error, "permanent")
