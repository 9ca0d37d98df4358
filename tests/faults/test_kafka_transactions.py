"""Issue 51: `partitioned` with Kafka transactions (``--kafka-transactions``) on Apache Kafka, through faults that land
in the middle of a transaction: its records are in Kafka's log, its commit has not come.

A relay worker process is killed there (kill -9), frozen there (SIGSTOP), or its broker is cut off or killed -9 and
started again on its log directory. Each time: a ``read_committed`` consumer sees every committed message exactly
once, in commit order per key, and nothing of an aborted transaction, while a ``read_uncommitted`` consumer sees the
aborted copies in the log (so each check can fail); nothing is lost, nothing invented, the outbox is drained. The
outbox has one virtual partition: a batch is one transaction, and a batch is acked before the next is published, so
any copy read_committed shows twice could only come from an aborted transaction.

Tansu (`make dev`'s broker) shows aborted records to read_committed consumers: these tests need Apache Kafka.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
import pytest

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.model import OutboxRecord
from outbox_pipeline.relay import KafkaPublisher
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import shows_only_committed
from tests.kit.probes import dead_letters, pending, positions, wait_until
from tests.kit.relay import message_ids, order_by_key
from tests.kit.workers import Event, WorkerProcess
from tests.kit.writer import write

from .conftest import ProxiedBroker
from .helpers import FAST_FAILING_PRODUCER, Tally, TimedRecord, consume, report, tally

pytestmark = pytest.mark.faults

BATCH = 50
MESSAGES = 3 * BATCH
LEASE_S = 2.0
RELAY_SETTINGS = {
    "poll_interval_s": 0.05,
    "max_poll_interval_s": 0.5,
    "error_backoff_base_s": 0.2,
    "error_backoff_max_s": 1.0,
}
# A relay's commit that cannot reach the broker fails after message.timeout.ms + 10 s (transactional.py).
COMMIT_FAILS_WITHIN_S = 30.0
DRAIN_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def kafka_broker(proxied_broker: ProxiedBroker) -> ProxiedBroker:
    """The module's broker behind its proxy, if it hides aborted transactions from read_committed consumers."""
    if not shows_only_committed(proxied_broker.broker):
        pytest.skip(
            f"{proxied_broker.broker.name} shows aborted transactions to read_committed consumers: "
            "run with OUTBOX_TEST_BROKER=kafka"
        )
    return proxied_broker


@dataclass(frozen=True)
class Lane:
    """One outbox (one virtual partition) relayed to one topic (two Kafka partitions)."""

    dsn: str
    table: OutboxTable
    topic: str
    broker: ProxiedBroker
    spawn: Callable[..., WorkerProcess]

    def relay(self, name: str, **hooks: object) -> WorkerProcess:
        """A `partitioned` worker with Kafka transactions, worker id ``name``; ``hooks``: where it dies or freezes."""
        producer = hooks.pop("producer", FAST_FAILING_PRODUCER)
        return self.spawn(
            name,
            dsn=self.dsn,
            table=self.table,
            bootstrap=self.broker.bootstrap,
            strategy="partitioned",
            batch_size=BATCH,
            config={"kafka_transactions": True, "lease_s": LEASE_S},
            producer=producer,
            settings=RELAY_SETTINGS,
            **hooks,
        )

    def pending(self) -> int:
        return pending(self.dsn, self.table, "partitioned")

    def drained(self, what: str) -> None:
        wait_until(what, lambda: self.pending() == 0, DRAIN_DEADLINE_S, interval_s=0.1)


@pytest.fixture
def lane(
    dsn: str,
    outbox_tables: Callable[[str], OutboxTable],
    workers: Callable[..., WorkerProcess],
    kafka_broker: ProxiedBroker,
) -> Lane:
    table = outbox_tables(dsn)
    topic = kafka_broker.new_topic("ktx", partitions=2)
    with psycopg.connect(dsn, autocommit=True) as db:
        set_topic_partitions(db, table, topic, 1)
    return Lane(dsn, table, topic, kafka_broker, workers)


@dataclass(frozen=True)
class Seen:
    """What a read_committed and a read_uncommitted consumer read of the topic, against what was committed."""

    committed: Tally
    log: Tally
    # Keys whose outbox ids read_committed shows out of commit order (one writer: ids ascend in commit order).
    out_of_order: dict[bytes | None, list[int]]
    # Messages the log holds more copies of than read_committed shows: copies in aborted transactions.
    aborted: set[str]

    @property
    def figures(self) -> dict[str, int]:
        return {**self.committed.figures, "aborted_in_log": self.log.arrived - self.committed.arrived}


def read_both(lane: Lane, committed: list[str]) -> Seen:
    shown = consume(lane.broker.bootstrap, [lane.topic], committed, isolation="read_committed")
    logged = consume(lane.broker.bootstrap, [lane.topic], committed, isolation="read_uncommitted")
    shown_count, logged_count = _copies(shown), _copies(logged)
    return Seen(
        tally(committed, shown),
        tally(committed, logged),
        {key: ids for key, ids in order_by_key(shown).items() if ids != sorted(ids)},
        {m for m, n in logged_count.items() if n > shown_count[m]},
    )


def _copies(records: list[TimedRecord]) -> Counter[str]:
    return Counter(message_ids(records))


def assert_exactly_once_in_order(seen: Seen, aborted: set[str]) -> None:
    """read_committed: every committed message once, in commit order per key; the log: ``aborted``'s copies too."""
    assert not seen.committed.lost, f"{len(seen.committed.lost)} committed messages never reached read_committed"
    assert not seen.log.phantom, f"{len(seen.log.phantom)} messages in Kafka were never committed"
    assert seen.committed.dupes == 0, (
        f"read_committed saw {seen.committed.dupes} duplicates: from aborted transactions, or a late commit not fenced"
    )
    assert not seen.out_of_order, f"per-key order broken (outbox ids): {seen.out_of_order}"
    assert seen.aborted == aborted, (
        f"aborted copies in the log: {len(seen.aborted)} messages, expected {len(aborted)} "
        f"({len(seen.aborted - aborted)} unexpected, {len(aborted - seen.aborted)} missing)"
    )


def _after(events: list[Event], step: str) -> list[Event]:
    """The events after the last ``step``."""
    marks = [i for i, e in enumerate(events) if e.step == step]
    return events[marks[-1] + 1 :] if marks else []


def _failed_after(step: str) -> Callable[[list[Event]], bool]:
    """Whether a publish after the last ``step`` ended with nothing delivered."""
    return lambda ev: any(e.step == "delivered" and e.numbers[0] == 0 for e in _after(ev, step))


def _acked_after(step: str) -> Callable[[list[Event]], bool]:
    """Whether a batch was acked after the last ``step``."""
    return lambda ev: any(e.step == "acked" for e in _after(ev, step))


def _in_transaction(worker: WorkerProcess) -> int:
    """The records of the transaction the worker was killed or frozen in (0: it was not in one)."""
    events = worker.events()
    fault = next(i for i, e in enumerate(events) if e.step in ("killed", "frozen"))
    return next((e.numbers[0] for e in reversed(events[:fault]) if e.step == "in-transaction"), 0)


def test_read_committed_sees_nothing_of_a_transaction_aborted_for_a_poison_row_or_a_failure_mid_transaction(
    lane: Lane,
) -> None:
    """Two aborts: the relay's own, for a row Kafka can never take (the rest of the batch goes again in a new
    transaction), and the broker's, for a transaction whose commit could not reach it (cut off between its records
    and its commit: the relay's next producer with that transactional id aborts it)."""
    started = time.monotonic()
    relay = lane.relay(
        "relay", producer={**FAST_FAILING_PRODUCER, "message.max.bytes": 10_000}, pause_in_transaction=2
    ).start()
    with psycopg.connect(lane.dsn) as conn, conn.transaction():
        good = [Message(lane.topic, {"n": n}, key=f"k{n}") for n in range(5)]
        poison = Message(lane.topic, {"blob": "x" * 20_000}, key="poison")
        written = enqueue_many(conn, [*good, poison], table=lane.table)
    first = [str(w.message_id) for w in written[:5]]
    lane.drained("the poison row dead-lettered and the rest relayed")
    with psycopg.connect(lane.dsn, autocommit=True) as db:
        assert set(dead_letters(db, lane.table)) == {str(written[5].message_id)}

    second = write(lane.dsn, lane.table, lane.topic, 20, serialized=False)
    relay.wait_for("its second transaction's records in Kafka", lambda ev: any(e.step == "frozen" for e in ev))
    lane.broker.proxy.cut()
    try:
        relay.thaw()
        relay.wait_for("its commit to fail, cut off", _failed_after("thawed"), COMMIT_FAILS_WITHIN_S)
    finally:
        lane.broker.proxy.restore()
    lane.drained("everything relayed once the network is back")
    assert relay.terminate() == 0, relay.log()

    committed = first + second
    seen = read_both(lane, committed)
    report("ktx-aborted", "partitioned", **seen.figures, seconds=time.monotonic() - started)
    assert_exactly_once_in_order(seen, set(first) | set(second))
    assert _in_transaction(relay) == len(second)


def test_a_relay_killed_mid_transaction_is_replaced_under_a_new_id_and_its_transaction_stays_invisible(
    lane: Lane,
) -> None:
    started = time.monotonic()
    committed = write(lane.dsn, lane.table, lane.topic, MESSAGES, serialized=False)
    victim = lane.relay("victim", kill_in_transaction=2).start()
    victim.wait_for("the kill in its second transaction", lambda ev: any(e.step == "killed" for e in ev))
    victim.wait(10)
    first, open_transaction = committed[:BATCH], committed[BATCH : 2 * BATCH]
    assert _in_transaction(victim) == BATCH
    # The killed relay's transaction is still open: read_committed stops before it, read_uncommitted reads it.
    shown = consume(lane.broker.bootstrap, [lane.topic], first, isolation="read_committed")
    logged = consume(lane.broker.bootstrap, [lane.topic], first + open_transaction)
    assert sorted(message_ids(shown)) == sorted(first), "read_committed read more than the committed transaction"
    assert sorted(message_ids(logged)) == sorted(first + open_transaction)

    successor = lane.relay("successor").start()
    lane.drained("the successor to relay everything")
    assert successor.terminate() == 0, successor.log()

    seen = read_both(lane, committed)
    report("ktx-relay-kill-9", "partitioned", **seen.figures, seconds=time.monotonic() - started)
    assert_exactly_once_in_order(seen, set(open_transaction))
    assert successor.stats()["published"] == MESSAGES - BATCH


def test_the_broker_killed_mid_transaction_and_started_again_on_its_log_loses_and_shows_nothing_aborted(
    lane: Lane,
) -> None:
    """The relay is frozen between its transaction's records and its commit; the broker is killed -9; the relay
    commits against a dead broker (which fails), then the broker is started again on its log directory."""
    started = time.monotonic()
    committed = write(lane.dsn, lane.table, lane.topic, MESSAGES, serialized=False)
    relay = lane.relay("relay", pause_in_transaction=2).start()
    relay.wait_for("its second transaction's records in Kafka", lambda ev: any(e.step == "frozen" for e in ev))
    broker = lane.broker.broker
    broker.kill()
    try:
        relay.thaw()
        relay.wait_for("its commit to fail, the broker dead", _failed_after("thawed"), COMMIT_FAILS_WITHIN_S)
    finally:
        broker.start()
    lane.drained("everything relayed once the broker is back")
    assert relay.terminate() == 0, relay.log()

    seen = read_both(lane, committed)
    report("ktx-broker-kill-9", "partitioned", **seen.figures, seconds=time.monotonic() - started)
    assert _in_transaction(relay) == BATCH
    assert_exactly_once_in_order(seen, set(committed[BATCH : 2 * BATCH]))


# Where the relay that is frozen, replaced and thawed was: in its second transaction (records in the log, its
# producer made long before), or about to begin its first one (its partition claimed, its producer not made yet).
FREEZES = {
    "mid-transaction": {"pause_in_transaction": 2},
    "before-its-first-transaction": {"pause_before_transaction": 1},
}


@pytest.mark.parametrize("freeze", list(FREEZES))
def test_a_relay_frozen_and_replaced_publishes_nothing_visible_and_acks_nothing_when_thawed(
    freeze: str, lane: Lane
) -> None:
    """Its successor's producer fences it (the same transactional id, a newer epoch): a late commit fails. A relay
    that makes its producer only after the thaw fences the successor instead, and must publish nothing: the
    partition is not its own any more. Then the successor relays more rows (past being fenced, if it was)."""
    started = time.monotonic()
    committed = write(lane.dsn, lane.table, lane.topic, MESSAGES, serialized=False)
    zombie = lane.relay("zombie", **FREEZES[freeze]).start()
    zombie.wait_for(f"its freeze {freeze}", lambda ev: any(e.step == "frozen" for e in ev))
    assert _in_transaction(zombie) == (BATCH if freeze == "mid-transaction" else 0)
    acked_before = sum(e.numbers[0] for e in zombie.events() if e.step == "acked")
    aborted = set(committed[acked_before : acked_before + BATCH]) if freeze == "mid-transaction" else set()
    successor = lane.relay("successor").start()
    lane.drained("the successor to take the partition over and relay everything")
    with psycopg.connect(lane.dsn, autocommit=True) as db:
        before_thaw = {k: v.at for k, v in positions(db, lane.table).items()}

    zombie.thaw()
    zombie.wait_for("its late publish and its ack", _acked_after("thawed"), COMMIT_FAILS_WITHIN_S)
    late = _after(zombie.events(), "thawed")
    late = late[: next(i for i, e in enumerate(late) if e.step == "acked") + 1]  # the batch it was frozen with
    with psycopg.connect(lane.dsn, autocommit=True) as db:
        after_thaw = {k: v.at for k, v in positions(db, lane.table).items()}
    # Relayed by the successor (past being fenced by the thawed relay's new producer, if it was) or by the thawed
    # relay, which may lease the partition now: either way once.
    committed += write(lane.dsn, lane.table, lane.topic, BATCH, serialized=False)
    lane.drained("what came after the thaw to be relayed")
    exits = {worker.name: worker.terminate() for worker in (zombie, successor)}

    seen = read_both(lane, committed)
    [late_ack] = [e.numbers for e in late if e.step == "acked"]
    late_delivered = [e.numbers[0] for e in late if e.step == "delivered"]
    report(
        f"ktx-fenced-{freeze}",
        "partitioned",
        **seen.figures,
        seconds=time.monotonic() - started,
        late_delivered=late_delivered,
        late_ack=late_ack,
        successor_published=successor.stats()["published"],
    )
    assert exits == {"zombie": 0, "successor": 0}, f"{exits}\n{zombie.log()}\n{successor.log()}"
    assert_exactly_once_in_order(seen, aborted)
    assert not any(late_delivered), f"the thawed relay's late publishes delivered {late_delivered}"
    assert late_ack[0] == 0, f"the thawed relay acked its late batch (acked, lost, retried, dead): {late_ack}"
    assert after_thaw == before_thaw, "the thawed relay moved the position its successor left"
    if freeze == "mid-transaction":
        assert "fenced" in zombie.log(50_000), f"the late commit failed, but not for being fenced:\n{zombie.log()}"
    else:
        produced = sum(e.numbers[0] for e in late if e.step == "in-transaction")
        assert produced == 0, f"the thawed relay produced {produced} records to a partition it no longer held"
    assert successor.stats()["published"] >= MESSAGES - acked_before


def _record(topic: str, n: int) -> OutboxRecord:
    """Outbox row ``n`` as a claim reads it."""
    message_id = str(uuid.uuid4()).encode()
    return OutboxRecord(n, topic, b"k", b'{"n": %d}' % n, "{}", message_id, b"%d" % n, 0, None, 0, "1", 0, False)


def test_a_relay_whose_transactional_producer_was_fenced_fails_that_batch_and_publishes_the_next(
    kafka_broker: ProxiedBroker,
) -> None:
    """Another relay published to the partition meanwhile (a lease that ran out and came back): its producer with the
    same transactional id fenced ours. Our next batch fails, for the transport (nothing confirmed: retried, never
    counted), and the one after goes out with a new producer."""
    topic = kafka_broker.new_topic("ktx")
    ids = {(topic, 0): f"fenced-{topic}"}
    ours = KafkaPublisher({"bootstrap.servers": kafka_broker.bootstrap, **FAST_FAILING_PRODUCER})
    theirs = KafkaPublisher({"bootstrap.servers": kafka_broker.bootstrap, **FAST_FAILING_PRODUCER})
    records = [_record(topic, n) for n in range(3)]
    try:
        assert len(ours.publish_transactions(records[:1], ids).delivered) == 1
        assert len(theirs.publish_transactions(records[1:2], ids).delivered) == 1  # fences ours
        fenced = ours.publish_transactions(records[2:3], ids)
        again = ours.publish_transactions(records[2:3], ids)
    finally:
        ours.close()
        theirs.close()
    assert not fenced.delivered and [f.kind for f in fenced.failed] == ["transport"], fenced
    assert len(again.delivered) == 1, again
    published = [r.message_id.decode() for r in records[:3]]
    assert message_ids(consume(kafka_broker.bootstrap, [topic], published, isolation="read_committed")) == published
