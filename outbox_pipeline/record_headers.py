"""Engine room: the Kafka headers a relayed row carries, built in one place for every producer (publisher.py,
transactional.py).

Every message gets ``message_id`` (the consumer's idempotency key), ``outbox_id`` and ``created_at``; ``type`` when
the row has one; then the row's own headers column, as written (enqueue.py encodes it).
"""

from __future__ import annotations

import json

from .enqueue import decode_headers
from .timestamps import CreatedAtStamps

Headers = list[tuple[str, str | bytes | None]]


def record_headers(
    stamps: CreatedAtStamps,
    message_id: bytes,
    outbox_id: bytes,
    created_at: int,
    type_: bytes | None,
    headers_json: str,
) -> Headers:
    """The Kafka headers of a row: its ids and creation time, its type, then the row's own headers. Takes the
    record's fields, not the record: the hot loop has them unpacked already."""
    headers: Headers = [
        ("message_id", message_id),
        ("outbox_id", outbox_id),
        ("created_at", stamps.get(created_at) or stamps.format(created_at)),
    ]
    if type_ is not None:
        headers.append(("type", type_))
    if headers_json != "{}":
        headers.extend(decode_headers(json.loads(headers_json)))
    return headers
