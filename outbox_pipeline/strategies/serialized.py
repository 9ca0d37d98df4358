"""Strategy `serialized`: writers take a transaction-scoped advisory lock, so ids are drawn in commit order and the
reader simply reads `id > last_processed_id`. See docs/strategies.md#serialized-writers-in-commit-order."""

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
