"""What the wal relay may confirm to the slot (relay/wal/batches.py): only whole transactions whose every message is
done, however a batch cuts them. No server: the slot's position is a number here."""

from __future__ import annotations

from outbox_pipeline.relay.wal.batches import Batch
from tests.kit.fakes import record


def batch(*transactions: int) -> Batch:
    """Transactions of the given sizes, one after another; transaction n ends at LSN 100 * (n + 1)."""
    records, commits, count = [], [], 0
    for n, size in enumerate(transactions):
        records += [record(count + i) for i in range(size)]
        count += size
        commits.append((count, 100 * (n + 1)))
    return Batch(records, commits)


def test_a_transaction_is_confirmable_once_its_last_message_is_done() -> None:
    three = batch(2, 3, 1)  # ends after messages 2, 5 and 6

    assert [three.confirmable(done) for done in range(7)] == [None, None, 100, 100, 100, 200, 300]


def test_a_transaction_cut_by_the_batch_is_not_confirmed_with_the_part_kafka_has() -> None:
    cut = batch(4, 4)

    assert cut.confirmable(7) == 100  # the second transaction's last message is not done


def test_dropping_the_done_messages_keeps_the_commits_of_the_rest_in_their_places() -> None:
    rest = batch(2, 3, 1)

    rest.drop(3)

    assert [r.id for r in rest.records] == [3, 4, 5]
    assert rest.commits == [(2, 200), (3, 300)]
    assert rest.confirmable(2) == 200


def test_withheld_messages_leave_their_transactions_confirmable_by_what_is_left() -> None:
    held = batch(2, 2)

    taken = held.withhold(lambda r: r.id in (1, 2))

    assert [r.id for r in taken] == [1, 2]
    assert held.commits == [(1, 100), (2, 200)]
    assert held.confirmable(1) == 100
