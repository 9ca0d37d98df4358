"""The outbox knows its strategy (issue 40, cases 2 and 5): recorded by `init-db --strategy` or its first relay,
changed only by `switch-strategy`; whatever reads the outbox as some strategy uses it, and another is refused
before it publishes or moves anything."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.cli import main
from outbox_pipeline.drain import drain_owner, plan_drain
from outbox_pipeline.store import MIGRATIONS, init_db, schema, set_topic_partitions
from outbox_pipeline.store.strategy_record import BY_POSITIONS, StrategyMismatch, claim, recorded
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain, row_count

ROWS = 200


def _write(db: psycopg.Connection, table: OutboxTable, topic: str, rows: int = ROWS) -> None:
    enqueue_many(db, [Message(topic, {"n": n}, key=f"k{n % 7}") for n in range(rows)], table=table)


def _relay(dsn: str, table: OutboxTable, kafka: KafkaProbe, *flags: str) -> int:
    return main(["relay", "--dsn", dsn, "--schema", table.schema, "--until-empty", "--max-seconds", "60",
                 "--bootstrap-servers", kafka.bootstrap_servers, *flags])  # fmt: skip


def test_a_relay_of_another_strategy_after_a_position_relay_is_refused_and_nothing_is_published_twice(
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Reported: `--strategy partitioned --until-empty`, then `--strategy locking`: 4,000 records for 2,000 rows."""
    topic = new_topic(partitions=2)
    _write(db, table, topic)
    assert _relay(dsn, table, kafka, "--strategy", "partitioned") == 0
    capsys.readouterr()

    refused = _relay(dsn, table, kafka, "--strategy", "locking")

    assert refused == 2
    err = capsys.readouterr().err
    assert "is relayed by partitioned" in err and "outbox switch-strategy --to locking" in err
    assert len(kafka.consume(topic, idle_s=2.0)) == ROWS


def test_a_position_relay_after_a_mark_sent_relay_is_refused_and_nothing_is_published_twice(
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = new_topic(partitions=2)
    _write(db, table, topic)
    assert _relay(dsn, table, kafka, "--strategy", "lease", "--mode", "mark-sent") == 0

    refused = _relay(dsn, table, kafka, "--strategy", "partitioned")

    assert refused == 2 and "outbox switch-strategy --to partitioned" in capsys.readouterr().err
    assert len(kafka.consume(topic, idle_s=2.0)) == ROWS


def test_status_and_lag_with_the_dsn_alone_read_the_outbox_as_its_recorded_strategy(
    dsn: str, db: psycopg.Connection, table: OutboxTable, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["init-db", "--dsn", dsn, "--schema", table.schema, "--strategy", "serialized"]) == 0
    _write(db, table, "orders", rows=5)
    capsys.readouterr()

    assert main(["lag", "--dsn", dsn, "--schema", table.schema]) == 0
    lag = capsys.readouterr().out
    assert main(["status", "--dsn", dsn, "--schema", table.schema]) == 0
    assert main(["lag", "--dsn", dsn, "--schema", table.schema, "--strategy", "partitioned"]) == 2

    assert "orders" in lag
    assert "outbox switch-strategy --to partitioned" in capsys.readouterr().err


def test_status_of_an_outbox_that_records_no_strategy_asks_for_one_and_names_init_db(
    dsn: str, table: OutboxTable, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--dsn", dsn, "--schema", table.schema]) == 2
    assert "outbox init-db --strategy" in capsys.readouterr().err


def test_a_drain_of_another_strategy_is_refused_even_on_a_topic_no_relay_has_read(
    dsn: str, db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """Case 5: the check for another strategy's positions found none on a new topic, and the drain went ahead."""
    relayed, fresh = new_topic(), new_topic()
    _write(db, table, relayed, rows=10)
    drain(dsn, table, kafka.bootstrap_servers, "partitioned")
    set_topic_partitions(db, table, fresh, 1)
    _write(db, table, fresh, rows=10)

    with pytest.raises(StrategyMismatch, match="switch-strategy --to serialized"):
        plan_drain(db, table, strategy="serialized", owner=drain_owner(uuid.uuid4().hex), topics=[fresh])

    leased = db.execute(sql.SQL("SELECT count(*) FROM {} WHERE locked_by IS NOT NULL").format(table.offsets)).fetchone()
    assert leased == (0,)


def test_after_a_switch_relays_without_a_strategy_run_the_new_one_and_the_old_one_is_refused(
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = new_topic(partitions=2)
    _write(db, table, topic, rows=50)
    assert _relay(dsn, table, kafka, "--strategy", "partitioned") == 0
    assert main(["switch-strategy", "--dsn", dsn, "--schema", table.schema, "--to", "serialized"]) == 0
    _write(db, table, topic, rows=50)
    capsys.readouterr()

    assert _relay(dsn, table, kafka) == 0
    ran = capsys.readouterr().out
    with pytest.raises(StrategyMismatch, match="is relayed by serialized"):
        drain(dsn, table, kafka.bootstrap_servers, "partitioned")

    assert "1 x serialized" in ran
    assert len(kafka.consume(topic, idle_s=2.0)) == 100


def test_two_first_relays_of_different_strategies_record_one_and_the_other_is_refused(
    connect: Callable[[], psycopg.Connection], table: OutboxTable
) -> None:
    start = threading.Barrier(2)
    outcomes: dict[str, str] = {}

    def first_relay(strategy: str) -> None:
        with connect() as conn:
            start.wait()
            try:
                outcomes[strategy] = claim(conn, table, strategy)
            except StrategyMismatch:
                outcomes[strategy] = "refused"

    threads = [threading.Thread(target=first_relay, args=(s,)) for s in ("partitioned", "locking")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    winner = next(s for s, outcome in outcomes.items() if outcome == s)
    assert sorted(outcomes.values()) == sorted([winner, "refused"])


def test_an_outbox_relayed_before_the_record_existed_takes_the_strategy_of_its_positions_at_upgrade(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = OutboxTable(schema=f"upgrade_{uuid.uuid4().hex[:8]}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            monkeypatch.setattr(schema, "MIGRATIONS", MIGRATIONS[:13])
            init_db(conn, table)
            conn.execute(  # a serialized relay of the release before left its position
                sql.SQL(
                    "INSERT INTO {} (topic, partition, last_processed_transaction_id, last_processed_id, read_by) "
                    "VALUES ('orders', 0, '1', 10, 'serialized')"
                ).format(table.offsets)
            )
            monkeypatch.undo()

            init_db(conn, table)

            found = recorded(conn, table)
            assert found is not None and (found.strategy, found.recorded_by) == ("serialized", BY_POSITIONS)
            assert row_count(conn, table) == 0
        finally:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(table.schema_ident))
