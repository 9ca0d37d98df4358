"""The Kafka headers a relayed row carries, built in one place for every producer. See
docs/payloads.md#the-kafka-headers-the-relay-sets."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .. import settings
from ..timestamps import CreatedAtStamps
from .header_rules import UnencodableHeaders, decode_headers

Headers = list[tuple[str, str | bytes | None]]
# Distinct own-header texts kept decoded per publisher (the rows of a transaction share theirs: its trace context).
MAX_DECODED = 4096
CE_SPECVERSION = b"1.0"


@dataclass(frozen=True)
class CloudEvents:
    """CloudEvents binary content mode for ``topics`` (None: every topic), with ``source`` as ``ce_source``."""

    topics: frozenset[str] | None
    source: str

    def __post_init__(self) -> None:
        if not self.source.strip():
            raise ValueError("CloudEvents source must not be empty (ce_source is required: a URI reference)")

    def covers(self, topic: str) -> bool:
        return self.topics is None or topic in self.topics


def cloud_events_from_env() -> CloudEvents | None:
    """OUTBOX_CLOUDEVENTS (off, all, or topics) and OUTBOX_CLOUDEVENTS_SOURCE."""
    wanted = settings.CLOUDEVENTS.read()
    if wanted == "off":
        return None
    topics = None if wanted == "all" else frozenset(t.strip() for t in wanted.split(",") if t.strip())
    return CloudEvents(topics, settings.CLOUDEVENTS_SOURCE.read())


@dataclass(frozen=True, slots=True)
class _Own:
    """A row's own headers, decoded, and their names."""

    pairs: list[tuple[str, bytes]]
    kept_under_ce: list[tuple[str, bytes]]  # the pairs but empty ce_* attributes, for a CloudEvents record
    given: frozenset[str]  # the names of those


class RecordHeaders:
    """The headers of each row a publisher sends; keeps the formatted timestamps and decoded own headers it made."""

    def __init__(self, cloud_events: CloudEvents | None = None) -> None:
        self.stamps = CreatedAtStamps()
        self.cloud_events = cloud_events
        self._own: dict[str, _Own] = {}

    def of(
        self,
        topic: str,
        message_id: bytes,
        outbox_id: bytes,
        created_at: int,
        type_: bytes | None,
        headers_json: str,
        binary: bool,
    ) -> Headers:
        """Takes the record's fields, not the record: the hot loop has them unpacked already."""
        created = self.stamps.get(created_at) or self.stamps.format(created_at)
        headers: Headers = [("message_id", message_id), ("outbox_id", outbox_id), ("created_at", created)]
        if type_ is not None:
            headers.append(("type", type_))
        own = None
        cloud = self.cloud_events is not None and self.cloud_events.covers(topic)
        if headers_json != "{}":
            own = self._own.get(headers_json) or self._decode(headers_json)  # no call per row once decoded
            # A CloudEvents record carries no empty ce_* attribute of the row's own: ours stand for them.
            headers.extend(own.kept_under_ce if cloud else own.pairs)
        if cloud:
            headers.extend(self._cloud_event(topic, message_id, created, type_, binary, own))
        return headers

    def _decode(self, headers_json: str) -> _Own:
        if len(self._own) >= MAX_DECODED:
            self._own.clear()
        try:
            stored = json.loads(headers_json)
        except ValueError as exc:  # a wal message's headers come as its writer made them (store/wal/format.py)
            raise UnencodableHeaders(f"headers are not JSON: {exc}") from None
        pairs = decode_headers(stored)
        kept = [(name, value) for name, value in pairs if value or not name.startswith("ce_")]
        own = self._own[headers_json] = _Own(pairs, kept, frozenset(name for name, _ in kept))
        return own

    def _cloud_event(
        self, topic: str, message_id: bytes, created: bytes, type_: bytes | None, binary: bool, own: _Own | None
    ) -> Headers:
        assert self.cloud_events is not None
        attributes: Headers = [
            ("ce_specversion", CE_SPECVERSION),
            ("ce_id", message_id),
            ("ce_type", type_ or topic.encode()),  # required and non-empty: an empty type is none
            ("ce_source", self.cloud_events.source.encode()),
        ]
        if created[:1].isdigit():  # not 'infinity': ce_time must be an RFC 3339 timestamp
            attributes.append(("ce_time", created))
        attributes.append(("content-type", b"application/octet-stream" if binary else b"application/json"))
        if own is None:
            return attributes
        # A row's own attribute replaces ours, unless it is empty (ce_type and ce_source must not be).
        return [(name, value) for name, value in attributes if name not in own.given]
