"""Engine room (relay, wal): what the failures of a batch Kafka settled mean for the stream: which messages are dead
letters now, which wait behind their held key, and from where the stream is published again (docs/wal.md, The
relay). Plain values and decisions, no session: the relay does the writing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ...store.wal.format import MALFORMED_TOPIC
from ...strategies.base import DeliveryFailure, OutboxRecord, PublishOutcome
from .pgoutput import Message

_NO_ID = b"00000000-0000-0000-0000-000000000000"


@dataclass
class Attempts:
    """The failed deliveries of each message Kafka refused for now (the "record" kind), by its position: after
    ``max_attempts`` of them it is a dead letter, as the table strategies count them (strategies/base.py)."""

    max_attempts: int
    failed: dict[int, int] = field(default_factory=dict)

    def dead_letter(self, failure: DeliveryFailure) -> DeliveryFailure | None:
        """The failure to dead-letter (its record's ``attempts``: the deliveries that failed before), or None: never
        for the transport, at once for a message Kafka will never take."""
        if failure.kind == "transport":
            return None
        if failure.kind == "permanent":
            return failure
        attempts = self.failed.get(failure.record.id, 0) + 1
        if attempts >= self.max_attempts:
            self.failed.pop(failure.record.id, None)
            return DeliveryFailure(failure.record._replace(attempts=attempts - 1), failure.error, failure.kind)
        self.failed[failure.record.id] = attempts
        return None


@dataclass(frozen=True)
class Settlement:
    settled: int  # the records from the first that are done: delivered, dead-lettered or held
    withheld: list[OutboxRecord]  # not sent, an earlier message of their key refused: held now (quarantine)
    again: bool  # the rest is published again, after a back-off (Kafka was down, or refused one for now)
    acked: int  # delivered among the settled
    retried: int  # messages Kafka refused for now, to be tried again


def settle(
    records: Sequence[OutboxRecord],
    outcome: PublishOutcome,
    dead: Sequence[DeliveryFailure],
    held: Callable[[OutboxRecord], bool],
) -> Settlement:
    """The batch's settlement once its ``dead`` letters are written (their keys held: ``held`` says so): what the
    producer did not send behind a refused message of its key is held, not a transport failure (under skip, sent
    again); anything else that failed is published again from its place."""
    dead_ids = {f.record.id for f in dead}
    withheld = [f.record for f in outcome.failed if f.kind == "transport" and held(f.record)]
    withheld_ids = {r.id for r in withheld}
    again = {f.record.id for f in outcome.failed if f.record.id not in dead_ids | withheld_ids}
    settled = next((i for i, r in enumerate(records) if r.id in again), len(records))
    failed = {f.record.id for f in outcome.failed}
    done = records[:settled]  # the rest stays in the batch, where withhold() takes the held
    return Settlement(
        settled,
        [r for r in done if r.id in withheld_ids],
        bool(again),
        sum(1 for r in done if r.id not in failed),
        sum(1 for f in outcome.failed if f.kind == "record" and f.record.id in again),
    )


def malformed(event: Message, commit: str, error: str) -> DeliveryFailure:
    """Bytes under the prefix that are no transactional message of ours, as a dead letter (payload_bytes)."""
    record = OutboxRecord(
        event.lsn, MALFORMED_TOPIC, None, bytes(event.content), "{}", _NO_ID, b"", 0, None, -1, commit, 0, True
    )
    return DeliveryFailure(record, error, "permanent")
