"""Key-scoped quarantine (the ordered strategies' default ``on_poison``): a dead letter holds back the rest of its
key, every other key flows, and the operator's retry or discard releases the key in order, with no hole."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.cli import main
from outbox_pipeline.errors import OutboxError
from outbox_pipeline.observe import held_keys, partition_lag
from outbox_pipeline.operate import discard_dead_letters, list_dead_letters, retry_dead_letters, rewind_partition
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.quarantine import POISON, SMALL_PRODUCER, arrived_by_key, poisoned, write_keys
from tests.kit.relay import drain

ORDERED = ["partitioned", "serialized", "advisory"]


@pytest.mark.parametrize("strategy", ORDERED)
def test_a_dead_letter_holds_the_rest_of_its_key_while_other_keys_of_the_partition_flow(
    strategy: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    written = poisoned(strategy, db, table, kafka, topic)

    assert arrived_by_key(kafka, topic, expect=14) == {"A": written["A"][:POISON], "B": written["B"]}
    [dead] = list_dead_letters(db, table)
    assert (dead.id, dead.holding, dead.held_rows) == (written["A"][POISON], True, 5)
    [lag] = [lag for lag in partition_lag(db, table, strategy) if lag.topic == topic]
    assert (lag.pending, lag.held, lag.lag) == (0, 5, 5)
    [key] = held_keys(db, table)
    assert key.describe() == (
        f"key 'A' of {topic}:0 held behind dead letter {dead.id}, 5 rows (retry or discard the dead letter to release)"
    )


@pytest.mark.parametrize("strategy", ORDERED)
def test_retrying_the_dead_letter_publishes_it_then_the_held_rows_and_the_key_flows_again(
    strategy: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    written = poisoned(strategy, db, table, kafka, topic)
    assert retry_dead_letters(db, table, ids=[written["A"][POISON]]) == 1
    later = write_keys(db, table, topic, "AB", 2, start=10)  # written after the retry, before the relay runs

    drain(db.info.dsn, table, kafka.bootstrap_servers, strategy, batch_size=3)

    arrived = arrived_by_key(kafka, topic, expect=24)
    assert arrived == {"A": written["A"] + later["A"], "B": written["B"] + later["B"]}
    assert held_keys(db, table) == [] and list_dead_letters(db, table) == []


@pytest.mark.parametrize("strategy", ORDERED)
def test_discarding_the_dead_letter_releases_the_held_rows_without_it_and_records_why(
    strategy: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    written = poisoned(strategy, db, table, kafka, topic)

    assert discard_dead_letters(db, table, [written["A"][POISON]], reason="oversize test row", by="ops") == 1
    drain(db.info.dsn, table, kafka.bootstrap_servers, strategy, producer=SMALL_PRODUCER, batch_size=3)

    expected_a = [i for i in written["A"] if i != written["A"][POISON]]
    assert arrived_by_key(kafka, topic, expect=19) == {"A": expected_a, "B": written["B"]}
    assert list_dead_letters(db, table) == []
    [dead] = list_dead_letters(db, table, include_retried=True)
    assert (dead.discard_reason, dead.discarded_at is not None) == ("oversize test row", True)
    assert held_keys(db, table) == []


@pytest.mark.parametrize("strategy", ORDERED)
def test_rows_of_a_held_key_written_later_are_held_too_across_a_relay_restart_under_a_new_id(
    strategy: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    written = poisoned(strategy, db, table, kafka, topic)
    later = write_keys(db, table, topic, "AB", 3, start=10)

    drain(db.info.dsn, table, kafka.bootstrap_servers, strategy, worker_id="restarted", batch_size=3)

    assert arrived_by_key(kafka, topic, expect=17) == {"A": written["A"][:POISON], "B": written["B"] + later["B"]}
    [key] = held_keys(db, table)
    assert (key.key, key.rows) == ("A", 8)


@pytest.mark.parametrize("strategy", ORDERED)
def test_with_on_poison_skip_the_key_flows_on_without_its_dead_letter(
    strategy: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    set_topic_partitions(db, table, topic, 1)
    written = write_keys(db, table, topic, "AB", 10, poison=POISON)

    drain(
        db.info.dsn, table, kafka.bootstrap_servers, strategy, producer=SMALL_PRODUCER, batch_size=3, on_poison="skip"
    )

    expected_a = [i for i in written["A"] if i != written["A"][POISON]]
    assert arrived_by_key(kafka, topic, expect=19) == {"A": expected_a, "B": written["B"]}
    assert held_keys(db, table) == []


def test_rows_without_a_key_are_never_held(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    set_topic_partitions(db, table, topic, 1)
    rows = enqueue_many(
        db, [Message(topic, {"i": i, "pad": "x" * (5000 if i == 2 else 0)}) for i in range(6)], table=table
    )

    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned", producer=SMALL_PRODUCER, batch_size=3)

    records = kafka.consume(topic, expect=5)
    assert [int(r.headers["outbox_id"]) for r in records] == [r.id for r in rows if r is not rows[2]]
    assert held_keys(db, table) == []


def test_the_cli_lists_the_dead_letter_with_what_it_holds_and_discards_it_with_a_reason(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = new_topic()
    written = poisoned("partitioned", db, table, kafka, topic)
    args = ["--dsn", db.info.dsn, "--schema", table.schema]

    assert main(["dead-letters", "list", *args]) == 0
    assert f"HOLDING key 'A' of {topic}:0 held behind it, 5 rows" in capsys.readouterr().out
    assert main(["dead-letters", "discard", *args, "--id", str(written["A"][POISON])]) == 2
    assert "needs a reason" in capsys.readouterr().err
    assert main(["dead-letters", "discard", *args, "--id", str(written["A"][POISON]), "--reason", "bad row"]) == 0
    assert "discarded 1 dead letters" in capsys.readouterr().out
    row = db.execute(sql.SQL("SELECT discard_reason, discarded_by FROM {}").format(table.dead_letters)).fetchone()
    assert row is not None and row[0] == "bad row" and "outbox CLI" in row[1]


def test_a_topic_with_a_held_key_cannot_change_its_partition_count(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """Its dead letter and held rows would go out in the old partition while new rows of the key go to another."""
    topic = new_topic()
    poisoned("partitioned", db, table, kafka, topic)

    with pytest.raises(OutboxError, match=f"{topic}.*6 pending row"):
        set_topic_partitions(db, table, topic, 4)


@pytest.mark.parametrize("strategy", ["partitioned", "serialized"])
def test_a_discarded_dead_letter_that_fails_again_after_a_rewind_holds_its_key_only_until_released(
    strategy: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """Rewound past a discarded poison row, the relay dead-letters it again. That is a new dead letter: listed, and
    retry and discard take it (they refused one still marked discarded, and its key stayed held for good)."""
    topic = new_topic()
    written = poisoned(strategy, db, table, kafka, topic)
    poison = written["A"][POISON]
    discard_dead_letters(db, table, [poison], reason="oversize test row", by="ops")
    drain(db.info.dsn, table, kafka.bootstrap_servers, strategy, producer=SMALL_PRODUCER, batch_size=3)

    rewind_partition(db, table, topic, 0, to_id=0)
    drain(db.info.dsn, table, kafka.bootstrap_servers, strategy, producer=SMALL_PRODUCER, batch_size=3)

    assert [d.id for d in list_dead_letters(db, table)] == [poison]
    assert [(key.key, key.rows) for key in held_keys(db, table)] == [("A", 5)]
    assert retry_dead_letters(db, table, ids=[poison]) == 1
    drain(db.info.dsn, table, kafka.bootstrap_servers, strategy, batch_size=3)
    assert held_keys(db, table) == []
    assert poison in arrived_by_key(kafka, topic)["A"]
