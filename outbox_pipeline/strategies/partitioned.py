"""Engine room: strategy `partitioned`, the talk's variant 3 (virtual partitions, xid8 positions).

Rows are read in (transaction_id, id) order past the partition's stored position, and only from
transactions older than every transaction still running: ``transaction_id <
pg_snapshot_xmin(pg_current_snapshot())``. A long transaction therefore holds back every partition
until it ends (the variant's cost) but its rows are never skipped, unlike ``id > last_id``, because
ids are drawn at insert time while rows become visible at commit (seed: the xid8 snapshot trick).
xid8 is 64-bit and never wraps, and ``pg_current_xact_id()`` is the top-level transaction's id.

Seed fix: the talk's query also says ``transaction_id > $last_processed_transaction_id AND (...)``.
That first conjunct drops the rest of a transaction whose rows span two batches (same xid, higher
id). The condition here is the row comparison ``(transaction_id, id) > ($xid, $id)``, which the
(topic, partition, transaction_id, id) index serves as one range scan.
"""

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
