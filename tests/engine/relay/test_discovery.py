"""How a position worker learns of a new partition (strategies/positions/discovery.py): a partition is nobody's to lease
until it has an offsets row, and the frequent look at the rows written since the last one must find a partition's first
row even when that row's transaction drew its id before others and committed after them (issue 40, case 22)."""

from __future__ import annotations

from collections.abc import Callable

import psycopg

from outbox_pipeline import Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.strategies.positions import Discovery
from tests.kit.probes import positions

TOPIC = "late"


def test_a_new_partition_whose_first_row_committed_after_higher_ids_is_found_by_the_next_recent_look(
    db: psycopg.Connection, table: OutboxTable, connect: Callable[[], psycopg.Connection]
) -> None:
    discovery = Discovery(connect(), table, found=lambda: None)
    enqueue(db, TOPIC, {"n": 0}, key="k", partition=0, table=table)
    discovery.everything()
    late = connect()
    late.autocommit = False
    low = enqueue(late, TOPIC, {"late": True}, key="k", partition=1, table=table)  # draws its id, commits later
    written = enqueue_many(db, [Message(TOPIC, {"n": n}, key="k", partition=0) for n in range(1, 4)], table=table)
    assert low.id < min(w.id for w in written)
    discovery.recent()  # sees the higher ids; the lower one is not committed yet
    late.commit()

    discovery.recent()

    assert (TOPIC, 1) in positions(db, table), "the late partition's first row waits for the full discovery"
