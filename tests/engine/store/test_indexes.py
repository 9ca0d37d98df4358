"""Each strategy's own indexes: an outbox keeps only what its strategy reads (every index costs every writer), a
relay refuses to run without its strategy's, and `outbox indexes` builds them on a live outbox."""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.cli import main
from outbox_pipeline.errors import SchemaError
from outbox_pipeline.model import STRATEGY_NAMES
from outbox_pipeline.store import ensure_partitions, init_db, set_topic_partitions
from outbox_pipeline.store.indexes import INDEXES, indexes_for, states
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain, order_by_key

ORDERED = ("partitioned", "serialized", "advisory")


@pytest.fixture
def new_outbox(dsn: str) -> Iterator[Callable[..., OutboxTable]]:
    """``make(strategies)``: a new outbox created by ``init_db(strategies=...)``, dropped after the test."""
    made: list[OutboxTable] = []

    def make(strategies: list[str] | None) -> OutboxTable:
        table = OutboxTable(schema=f"t_{uuid.uuid4().hex[:12]}")
        made.append(table)
        with psycopg.connect(dsn, autocommit=True) as conn:
            init_db(conn, table, strategies=strategies)
        return table

    yield make
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in made:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(table.schema_ident))


def _ready(db: psycopg.Connection, table: OutboxTable) -> set[str]:
    return {name for name, state in states(db, table).items() if state.valid}


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_a_new_outbox_for_one_strategy_has_only_the_indexes_that_strategy_reads(
    strategy: str, db: psycopg.Connection, new_outbox: Callable[..., OutboxTable]
) -> None:
    table = new_outbox([strategy])

    assert _ready(db, table) == {index.name for index in indexes_for([strategy])}
    assert _ready(db, table) < {index.name for index in INDEXES}


def test_a_new_outbox_with_no_strategy_named_serves_every_strategy(
    db: psycopg.Connection, new_outbox: Callable[..., OutboxTable]
) -> None:
    assert _ready(db, new_outbox(None)) == {index.name for index in INDEXES}


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_each_strategy_relays_everything_in_key_order_on_an_outbox_with_only_its_own_indexes(
    strategy: str,
    db: psycopg.Connection,
    new_outbox: Callable[..., OutboxTable],
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    table = new_outbox([strategy])
    topic = new_topic(partitions=4)
    set_topic_partitions(db, table, topic, 4)
    written = enqueue_many(
        db,
        [Message(topic, {"n": i}, key=f"k{i % 7}") for i in range(300)],
        serialized=strategy == "serialized",
        table=table,
    )

    stats = drain(db.info.dsn, table, kafka.bootstrap_servers, strategy)

    by_key = order_by_key(kafka.consume(topic, expect=300))
    assert stats.published == 300 and sorted(oid for ids in by_key.values() for oid in ids) == [w.id for w in written]
    if strategy in ORDERED:
        assert all(ids == sorted(ids) for ids in by_key.values())


def test_a_relay_refuses_to_start_without_its_strategys_index_and_names_the_command_that_builds_it(
    dsn: str,
    db: psycopg.Connection,
    new_outbox: Callable[..., OutboxTable],
    kafka: KafkaProbe,
    capsys: pytest.CaptureFixture[str],
) -> None:
    table = new_outbox(["partitioned"])
    db.execute(sql.SQL("DROP INDEX {}").format(table.ident("outbox_messages_position")))
    enqueue_many(db, [Message("orders", {"n": 1}, key="a")], table=table)

    code = main(["relay", "--dsn", dsn, "--schema", table.schema, "--until-empty",
                 "--bootstrap-servers", kafka.bootstrap_servers])  # fmt: skip
    with pytest.raises(SchemaError, match="outbox_messages_position"):
        drain(dsn, table, kafka.bootstrap_servers, "partitioned")

    assert code == 2
    assert f"`outbox indexes --strategy partitioned --schema {table.schema}`" in capsys.readouterr().err
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(table.messages)).fetchone() == (1,)


def test_switching_to_a_strategy_without_its_index_is_refused_naming_the_command_that_builds_it(
    dsn: str, new_outbox: Callable[..., OutboxTable], capsys: pytest.CaptureFixture[str]
) -> None:
    table = new_outbox(["partitioned"])

    code = main(["switch-strategy", "--dsn", dsn, "--schema", table.schema, "--to", "serialized"])

    assert code == 2
    assert f"`outbox indexes --strategy serialized --schema {table.schema}`" in capsys.readouterr().err


def test_outbox_indexes_builds_a_strategys_index_on_every_partition_and_partitions_made_later_inherit_it(
    dsn: str, db: psycopg.Connection, new_outbox: Callable[..., OutboxTable], capsys: pytest.CaptureFixture[str]
) -> None:
    table = new_outbox(["partitioned"])
    enqueue_many(db, [Message("orders", {"n": i}, key=f"k{i}") for i in range(50)], table=table)

    code = main(["indexes", "--dsn", dsn, "--schema", table.schema, "--strategy", "serialized"])
    ensure_partitions(db, table, today=dt.datetime.now(dt.UTC).date() + dt.timedelta(days=30))

    assert code == 0 and "outbox_messages_serial (serialized): ready" in capsys.readouterr().out
    assert _ready(db, table) == {"outbox_messages_position", "outbox_messages_serial"}
    unindexed = db.execute(
        sql.SQL(
            """
            SELECT p.relname FROM pg_inherits h JOIN pg_class p ON p.oid = h.inhrelid
            WHERE h.inhparent = %s::regclass AND NOT EXISTS (
                SELECT 1 FROM pg_inherits ii WHERE ii.inhparent = %s::regclass
                  AND ii.inhrelid IN (SELECT indexrelid FROM pg_index WHERE indrelid = p.oid))
            """
        ),
        (table.messages.as_string(db), table.ident("outbox_messages_serial").as_string(db)),
    ).fetchall()
    assert unindexed == []


def test_an_interrupted_build_leaves_the_switch_refusing_and_running_the_command_again_finishes_it(
    dsn: str, db: psycopg.Connection, new_outbox: Callable[..., OutboxTable], capsys: pytest.CaptureFixture[str]
) -> None:
    """What a build stopped after its first partition leaves: the parent's index exists, invalid."""
    table = new_outbox(["partitioned"])
    db.execute(sql.SQL("CREATE INDEX outbox_messages_serial ON ONLY {} (topic, partition, id)").format(table.messages))

    refused = main(["switch-strategy", "--dsn", dsn, "--schema", table.schema, "--to", "serialized"])
    assert refused == 2 and "outbox_messages_serial not finished building" in capsys.readouterr().err

    assert main(["indexes", "--dsn", dsn, "--schema", table.schema, "--strategy", "serialized"]) == 0
    assert "outbox_messages_serial" in _ready(db, table)
    assert main(["switch-strategy", "--dsn", dsn, "--schema", table.schema, "--to", "serialized"]) == 0


def test_drop_others_leaves_only_the_named_strategys_indexes(
    dsn: str, db: psycopg.Connection, new_outbox: Callable[..., OutboxTable]
) -> None:
    table = new_outbox(None)

    code = main(["indexes", "--dsn", dsn, "--schema", table.schema, "--strategy", "serialized", "--drop-others"])

    assert code == 0 and _ready(db, table) == {"outbox_messages_serial"}


def test_drop_others_gives_up_within_its_lock_timeout_while_a_transaction_holds_the_table_and_drops_nothing(
    dsn: str, db: psycopg.Connection, new_outbox: Callable[..., OutboxTable], capsys: pytest.CaptureFixture[str]
) -> None:
    """DROP INDEX takes the message table's ACCESS EXCLUSIVE lock: waiting for it behind a relay's open claim, it
    queued every writer and relay behind it, for good when that relay waited on one of them (harness seed 379,
    serialized, `--seconds 30`: locking's worker held its claim open while its other session queued)."""
    table = new_outbox(None)
    done = threading.Event()
    codes: list[int] = []
    argv = ["indexes", "--dsn", dsn, "--schema", table.schema, "--strategy", "serialized", "--drop-others"]

    def drop_then_done() -> None:
        codes.append(main(argv))
        done.set()

    with psycopg.connect(dsn) as relay:
        relay.execute(sql.SQL("SELECT count(*) FROM {}").format(table.messages))  # a claim left open
        dropping = threading.Thread(target=drop_then_done)
        dropping.start()
        returned = done.wait(15)
        relay.rollback()
    dropping.join(60)

    assert returned and codes == [2], "still waiting for its lock 15 s later"
    assert "did not get its lock" in capsys.readouterr().err
    assert _ready(db, table) == {index.name for index in INDEXES}
