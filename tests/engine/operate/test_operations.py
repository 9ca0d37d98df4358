"""Lag and operator actions (replay, rewind, dead letters, stuck leases) against the real servers."""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, OutboxError, OutboxTable, enqueue_many
from outbox_pipeline.cli import main
from outbox_pipeline.observe import partition_lag
from outbox_pipeline.operate import list_dead_letters, release_lease, replay_sent, retry_dead_letters, rewind_partition
from outbox_pipeline.strategies import AckMode, StrategyConfig, strategy_class
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain, make_relay, message_ids

ORDERED = ["partitioned", "serialized"]


def _write(
    db: psycopg.Connection,
    table: OutboxTable,
    topic: str,
    n: int,
    *,
    partition: int = 0,
    key: str = "k",
    serialized: bool = False,
) -> list[tuple[int, str, str]]:
    """n messages in one transaction; (id, message_id, xid) of each."""
    with db.transaction():
        messages = [Message(topic, {"n": i}, key=key, partition=partition) for i in range(n)]
        written = enqueue_many(db, messages, table=table, serialized=serialized)
        xid = db.execute("SELECT pg_current_xact_id()::text").fetchone()
    assert xid is not None
    return [(w.id, str(w.message_id), xid[0]) for w in written]


def _run_one_batch(
    dsn: str, table: OutboxTable, bootstrap: str, strategy: str, batch: int, mode: AckMode = "delete"
) -> int:
    relay = make_relay(dsn, table, bootstrap, strategy, batch_size=batch, mode=mode)
    try:
        metrics = relay.run_once()
    finally:
        relay.close()
    assert metrics is not None
    return metrics.published


def _position(db: psycopg.Connection, table: OutboxTable, topic: str) -> tuple[str, int]:
    row = db.execute(
        sql.SQL("SELECT last_processed_transaction_id::text, last_processed_id FROM {} WHERE topic = %s").format(
            table.offsets
        ),
        (topic,),
    ).fetchone()
    assert row is not None
    return row[0], row[1]


# -- lag -------------------------------------------------------------------------------------------


def test_row_strategy_lag_counts_unsent_rows_per_partition_after_a_partial_drain(
    dsn: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    _write(db, table, topic, 10, partition=0)
    _write(db, table, topic, 20, partition=1)
    # Oldest ids first: one batch of 10 is exactly partition 0's rows, kept with sent_at set.
    assert _run_one_batch(dsn, table, kafka.bootstrap_servers, "locking", 10, mode="mark-sent") == 10

    [lag] = partition_lag(db, table, "locking")

    assert (lag.topic, lag.partition, lag.pending, lag.position) == (topic, 1, 20, None)
    assert lag.oldest_pending_age_s is not None and lag.oldest_pending_age_s >= 0
    assert (lag.leased_by, lag.attempts, lag.in_backoff) == (None, 0, False)


def test_lag_with_a_cap_counts_at_most_cap_rows_per_partition(db: psycopg.Connection, table: OutboxTable) -> None:
    _write(db, table, "orders", 50, partition=0)
    _write(db, table, "orders", 3, partition=1)

    lags = partition_lag(db, table, "lease", cap=10)

    assert [(lag.partition, lag.pending) for lag in lags] == [(0, 10), (1, 3)]


@pytest.mark.parametrize("strategy", ["lease", "partitioned"])
def test_lag_of_one_partition_reports_only_that_partition(
    strategy: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    _write(db, table, "orders", 5, partition=0)
    _write(db, table, "orders", 3, partition=1)
    _write(db, table, "payments", 2, partition=1)

    lags = partition_lag(db, table, strategy, only=("orders", 1))

    assert [(lag.topic, lag.partition, lag.pending) for lag in lags] == [("orders", 1, 3)]


@pytest.mark.parametrize("strategy", ORDERED)
def test_position_strategy_lag_reports_the_position_and_the_rows_past_it(
    strategy: str,
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    drained, undiscovered = new_topic(), "never-relayed"
    rows = _write(db, table, drained, 10, serialized=strategy == "serialized")
    assert _run_one_batch(dsn, table, kafka.bootstrap_servers, strategy, 4) == 4
    _write(db, table, undiscovered, 3, serialized=strategy == "serialized")  # no offsets row yet

    lags = {lag.topic: lag for lag in partition_lag(db, table, strategy)}

    last_id, _, last_xid = rows[3]
    expected = f"xid={last_xid} id={last_id}" if strategy == "partitioned" else f"id={last_id}"
    assert (lags[drained].pending, lags[drained].position) == (6, expected)
    assert (lags[drained].leased_by, lags[drained].in_backoff) == (None, False)
    start = "xid=0 id=0" if strategy == "partitioned" else "id=0"
    assert (lags[undiscovered].pending, lags[undiscovered].position) == (3, start)


def test_partitioned_lag_does_not_count_rows_behind_a_running_transaction(
    dsn: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    with psycopg.connect(dsn) as open_tx:
        open_tx.execute("SELECT pg_current_xact_id()")  # older than the rows below, still running
        _write(db, table, "orders", 5)
        [lag] = partition_lag(db, table, "partitioned")
        assert lag.pending == 0
    [lag] = partition_lag(db, table, "partitioned")
    assert lag.pending == 5


def test_lag_command_prints_json_per_partition(
    dsn: str, db: psycopg.Connection, table: OutboxTable, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(db, table, "orders", 7, partition=2)
    assert main(["lag", "--dsn", dsn, "--schema", table.schema, "--strategy", "serialized", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert (row["topic"], row["partition"], row["pending"], row["position"]) == ("orders", 2, 7, "id=0")


# -- replay of mark-sent rows ----------------------------------------------------------------------


def test_replay_sent_by_key_publishes_those_rows_again(
    dsn: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    again = _write(db, table, topic, 3, key="a")
    once = _write(db, table, topic, 4, key="b")
    assert drain(dsn, table, kafka.bootstrap_servers, "locking", mode="mark-sent").published == 7

    assert replay_sent(db, table, key="a") == 3
    assert drain(dsn, table, kafka.bootstrap_servers, "locking", mode="mark-sent").published == 3

    arrived = Counter(message_ids(kafka.consume(topic, expect=10)))
    assert arrived == Counter({**{m: 2 for _, m, _ in again}, **{m: 1 for _, m, _ in once}})


def test_replay_sent_without_a_filter_is_refused_and_changes_nothing(
    dsn: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    _write(db, table, new_topic(), 3)
    drain(dsn, table, kafka.bootstrap_servers, "locking", mode="mark-sent")
    with pytest.raises(OutboxError, match="needs a filter"):
        replay_sent(db, table)
    assert partition_lag(db, table, "locking") == []
    assert replay_sent(db, table, all=True) == 3


def test_replay_command_without_a_filter_exits_2_with_one_line(
    dsn: str, table: OutboxTable, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "--dsn", dsn, "--schema", table.schema]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


# -- rewind of a position strategy's partition -----------------------------------------------------


@pytest.mark.parametrize("strategy", ORDERED)
def test_rewind_since_a_time_replays_exactly_the_rows_from_then(
    strategy: str,
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    topic = new_topic()
    serialized = strategy == "serialized"
    _write(db, table, topic, 3, serialized=serialized)
    since_row = db.execute("SELECT now()").fetchone()
    assert since_row is not None
    later = _write(db, table, topic, 2, serialized=serialized) + _write(db, table, topic, 2, serialized=serialized)
    assert drain(dsn, table, kafka.bootstrap_servers, strategy).published == 7

    rewound = rewind_partition(db, table, topic, 0, since=since_row[0])

    assert (rewound.to_xid, rewound.to_id) == (later[0][2], later[0][0] - 1)
    assert drain(dsn, table, kafka.bootstrap_servers, strategy).published == 4
    records = kafka.consume(topic, expect=11)
    assert message_ids(records[7:]) == [m for _, m, _ in later]


@pytest.mark.parametrize("strategy", ORDERED)
def test_rewind_refuses_to_move_a_position_forward(
    strategy: str,
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    topic = new_topic()
    rows = _write(db, table, topic, 5, serialized=strategy == "serialized")
    _run_one_batch(dsn, table, kafka.bootstrap_servers, strategy, 2)
    before = _position(db, table, topic)

    with pytest.raises(OutboxError, match="forward"):
        rewind_partition(db, table, topic, 0, to_id=rows[4][0])

    assert _position(db, table, topic) == before


def test_rewind_refuses_while_a_live_worker_leases_the_partition(
    dsn: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    _write(db, table, "orders", 5)
    with psycopg.connect(dsn, autocommit=True) as conn:
        worker = strategy_class("partitioned")(conn, StrategyConfig(table=table, worker_id="busy", lease_s=60))
        assert worker.claim(10) is not None
        with pytest.raises(OutboxError, match="leased by live worker 'busy'"):
            rewind_partition(db, table, "orders", 0, to_id=0)
        assert rewind_partition(db, table, "orders", 0, to_id=0, force=True).to_id == 0


def test_rewind_to_a_row_id_replays_the_rows_after_it(
    dsn: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    rows = _write(db, table, topic, 5)
    drain(dsn, table, kafka.bootstrap_servers, "partitioned")

    rewound = rewind_partition(db, table, topic, 0, to_id=rows[2][0])

    assert (rewound.to_xid, rewound.to_id) == (rows[2][2], rows[2][0])
    assert drain(dsn, table, kafka.bootstrap_servers, "partitioned").published == 2


# -- dead letters ----------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["locking", "serialized"])
def test_retry_dead_letters_puts_the_row_back_and_it_is_delivered(
    strategy: str,
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    """With on_poison=skip, the retried copy is published after what went out meanwhile (it gets a new id and
    transaction id)."""
    topic = new_topic()
    serialized = strategy == "serialized"
    with db.transaction():
        [big] = enqueue_many(db, [Message(topic, {"pad": "x" * 5000}, key="k")], table=table, serialized=serialized)
    small = _write(db, table, topic, 2, serialized=serialized)
    first = drain(dsn, table, kafka.bootstrap_servers, strategy, producer={"message.max.bytes": 2000}, on_poison="skip")
    assert (first.published, first.dead_lettered) == (2, 1)
    [dead] = list_dead_letters(db, table)
    assert (dead.id, dead.message_id) == (big.id, str(big.message_id))

    assert retry_dead_letters(db, table, ids=[dead.id]) == 1

    assert list_dead_letters(db, table) == []
    assert drain(dsn, table, kafka.bootstrap_servers, strategy).published == 1
    arrived = message_ids(kafka.consume(topic, expect=3))
    assert arrived == [m for _, m, _ in small] + [str(big.message_id)]


@pytest.mark.parametrize("strategy", ORDERED)
def test_a_dead_letter_retried_after_its_day_was_dropped_is_delivered(
    strategy: str,
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    """The original row is gone (its daily partition was archived and dropped), so a copy that kept the
    old id would sit behind the position and never be read; the copy takes a new id, after the position."""
    topic = new_topic()
    with db.transaction():
        [big] = enqueue_many(db, [Message(topic, {"pad": "x" * 5000}, key="k")], table=table, serialized=True)
    _write(db, table, topic, 2, serialized=True)
    first = drain(dsn, table, kafka.bootstrap_servers, strategy, producer={"message.max.bytes": 2000}, on_poison="skip")
    assert first.dead_lettered == 1
    db.execute(sql.SQL("DELETE FROM {} WHERE topic = %s").format(table.messages), [topic])  # the day was dropped

    assert retry_dead_letters(db, table, ids=[big.id]) == 1

    assert drain(dsn, table, kafka.bootstrap_servers, strategy).published == 1
    assert str(big.message_id) in message_ids(kafka.consume(topic, expect=3))
    [(copy_id,)] = db.execute(sql.SQL("SELECT id FROM {} WHERE topic = %s").format(table.messages), [topic]).fetchall()
    assert copy_id != big.id


def test_retry_dead_letters_retries_each_dead_letter_once(
    dsn: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    with db.transaction():
        enqueue_many(db, [Message(topic, {"pad": "x" * 5000})], table=table)
    drain(dsn, table, kafka.bootstrap_servers, "locking", producer={"message.max.bytes": 2000})
    assert retry_dead_letters(db, table, topic=topic) == 1
    assert retry_dead_letters(db, table, topic=topic) == 0


# -- stuck leases ----------------------------------------------------------------------------------


def test_release_lease_frees_a_stuck_lease_so_another_worker_claims_the_partition(
    dsn: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    _write(db, table, "orders", 5)
    cls = strategy_class("partitioned")
    with psycopg.connect(dsn, autocommit=True) as c1, psycopg.connect(dsn, autocommit=True) as c2:
        stuck = cls(c1, StrategyConfig(table=table, worker_id="stuck", lease_s=600))
        other = cls(c2, StrategyConfig(table=table, worker_id="other", lease_s=60))
        stuck_claim = stuck.claim(10)
        assert stuck_claim is not None
        assert other.claim(10) is None

        assert release_lease(db, table, "orders", 0) is True

        claim = other.claim(10)
        assert claim is not None and [r.id for r in claim.records] == [r.id for r in stuck_claim.records]


def test_release_lease_of_a_free_partition_changes_nothing(db: psycopg.Connection, table: OutboxTable) -> None:
    db.execute(sql.SQL("INSERT INTO {} (topic, partition) VALUES ('orders', 0)").format(table.offsets))
    assert release_lease(db, table, "orders", 0) is False


def test_dead_letters_list_command_prints_each_dead_letter(
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = new_topic()
    with db.transaction():
        [big] = enqueue_many(db, [Message(topic, {"pad": "x" * 5000})], table=table)
    drain(dsn, table, kafka.bootstrap_servers, "locking", producer={"message.max.bytes": 2000})
    assert main(["dead-letters", "list", "--dsn", dsn, "--schema", table.schema, "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert (row["id"], row["message_id"], row["retried_at"]) == (big.id, str(big.message_id), None)
    assert "too large" in row["last_error"]
    assert dt.datetime.fromisoformat(row["dead_lettered_at"])
