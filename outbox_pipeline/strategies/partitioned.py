"""Strategy `partitioned`: virtual partitions read in `(transaction_id, id)` order below the snapshot's xmin, so rows of
a late-committing transaction are never skipped. See docs/strategies.md#partitioned-positions-in-transaction-order."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from operator import attrgetter
from typing import Any, ClassVar

import psycopg

from ..model import Claim, OutboxRecord
from .base import StrategyConfig
from .positions import PositionStrategy

_XID, _ID = attrgetter("transaction_id"), attrgetter("id")
_HORIZON = "SELECT pg_snapshot_xmin(pg_current_snapshot())::text"


class PartitionedStrategy(PositionStrategy):
    name: ClassVar[str] = "partitioned"
    work_condition: ClassVar[str] = (
        "(m.transaction_id, m.id) > (o.last_processed_transaction_id, o.last_processed_id) "
        "AND m.transaction_id < pg_snapshot_xmin(pg_current_snapshot())"
    )
    read_order: ClassVar[str] = "m.transaction_id, m.id"

    def __init__(self, conn: psycopg.Connection, config: StrategyConfig) -> None:
        super().__init__(conn, config)
        self._empty_at: int | None = None  # the horizon of the last claim, when it found nothing

    def claim(self, limit: int, avoid: Collection[int] = ()) -> Claim | None:
        claim = super().claim(limit, avoid)
        self._empty_at = self._horizon if claim is None else None
        return claim

    def commits_visible(self) -> bool:
        """False while the horizon stands where it stood at a claim that found nothing: no transaction below it has
        ended since, so the commits announced meanwhile are later ones, held back by an older transaction still open
        (one small statement instead of a lease and a look at each: docs/strategies.md)."""
        if self._empty_at is None:
            return True
        row = self.conn.execute(_HORIZON).fetchone()
        return row is None or int(row[0]) != self._empty_at

    @staticmethod
    def order_key(record: OutboxRecord) -> tuple[int, int]:
        return int(record.transaction_id), record.id

    @staticmethod
    def order_keys(records: Sequence[OutboxRecord]) -> list[Any]:
        return list(zip(map(int, map(_XID, records)), map(_ID, records), strict=True))
