"""Engine room: strategy `serialized`, the talk's variant 4 (writers serialized, ids in commit order).

Writers enqueue with ``serialized=True``: a transaction-scoped advisory lock, held from the insert to
the commit, so no writer draws an id while another's rows are still invisible. Ids then become
visible in order and the reader can simply read ``id > last_processed_id``; long transactions do not
hold the reader back. The cost moves to the writers: serialized writers of one outbox queue behind
each other from their enqueue to their commit, so enqueue last, right before COMMIT (the talk moves
the outbox insert to the end of the unit of work for the same reason). Rows written without the lock
(plain ``enqueue``, COPY loads) void the guarantee while writers run concurrently.

Seed fix: the talk's ``LOCK TABLE outbox_messages IN ROW EXCLUSIVE MODE`` does not serialize writers:
ROW EXCLUSIVE does not conflict with itself (every INSERT already takes it). A self-conflicting lock
is needed; ``pg_advisory_xact_lock`` is one and blocks no reader.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any, ClassVar

from ..model import OutboxRecord
from .positions import PositionStrategy

_ID = attrgetter("id")


class SerializedStrategy(PositionStrategy):
    name: ClassVar[str] = "serialized"
    work_condition: ClassVar[str] = "m.id > o.last_processed_id"
    read_order: ClassVar[str] = "m.id"

    @staticmethod
    def order_key(record: OutboxRecord) -> tuple[int, int]:
        return 0, record.id

    @staticmethod
    def order_keys(records: Sequence[OutboxRecord]) -> list[Any]:
        return list(map(_ID, records))
