"""Writers that are not Python: plain SQL inserts and ``<schema>.enqueue(...)`` get the routing the Python API
gets, and a topic's partition count cannot change under pending rows (a key would live in two partitions)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import OutboxTable, enqueue
from outbox_pipeline.errors import OutboxError
from outbox_pipeline.localstack import LocalPostgres
from outbox_pipeline.partitioning import partition_for
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain, order_by_key

KEYS = ["customer-1", "customer-2", "é☃-3", "中文-4", "k" * 300]


def _partitions(db: psycopg.Connection, table: OutboxTable, topic: str) -> dict[str | None, set[int]]:
    rows = db.execute(
        sql.SQL("SELECT key, partition FROM {} WHERE topic = %s").format(table.messages), (topic,)
    ).fetchall()
    seen: dict[str | None, set[int]] = {}
    for key, partition in rows:
        seen.setdefault(key, set()).add(partition)
    return seen


def test_a_plain_sql_insert_without_a_partition_is_routed_like_the_python_api(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    set_topic_partitions(db, table, "orders", 8)
    for key in KEYS:
        db.execute(
            sql.SQL("INSERT INTO {} (topic, key, payload) VALUES ('orders', %s, '{{}}')").format(table.messages), (key,)
        )

    assert _partitions(db, table, "orders") == {key: {partition_for(key, 8)} for key in KEYS}


def test_plain_sql_rows_without_a_key_spread_over_the_topics_partitions(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    set_topic_partitions(db, table, "clicks", 4)
    db.execute(
        sql.SQL("INSERT INTO {} (topic, payload) SELECT 'clicks', '{{}}' FROM generate_series(1, 400)").format(
            table.messages
        )
    )

    assert _partitions(db, table, "clicks")[None] == {0, 1, 2, 3}


def test_a_partition_the_writer_gives_is_kept(db: psycopg.Connection, table: OutboxTable) -> None:
    db.execute(
        sql.SQL("INSERT INTO {} (topic, key, payload, partition) VALUES ('orders', 'k', '{{}}', 5)").format(
            table.messages
        )
    )

    assert _partitions(db, table, "orders") == {"k": {5}}


def test_the_sql_enqueue_returns_the_id_and_message_id_and_routes_the_key(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    set_topic_partitions(db, table, "orders", 8)
    returned = db.execute(
        sql.SQL(
            "SELECT id, message_id FROM {}(topic => 'orders', payload => '{{\"total\": 12}}', key => 'customer-1', "
            "headers => '{{\"trace\": \"abc\"}}', type => 'OrderPlaced', priority => 3)"
        ).format(table.ident("enqueue"))
    ).fetchone()

    assert returned is not None
    stored = db.execute(
        sql.SQL("SELECT message_id, partition, payload, headers, type, priority FROM {} WHERE id = %s").format(
            table.messages
        ),
        (returned[0],),
    ).fetchone()
    assert stored == (returned[1], partition_for("customer-1", 8), {"total": 12}, {"trace": "abc"}, "OrderPlaced", 3)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("'orders', NULL", "give the payload as JSON .payload. or as bytes .payload_bytes., one of them"),
        ("'orders', '{}', payload_bytes => '\\x01'", "give the payload as JSON .payload. or as bytes"),
        ("'orders', '{}', headers => '[1]'", "headers must be a JSON object"),
        ("'orders', '{}', headers => '{\"message_id\": \"x\"}'", 'header "message_id" is reserved'),
        ("'orders', '{}', headers => '{\"n\": 1}'", 'header "n" must be a string'),
        ("'bad topic', '{}'", "invalid Kafka topic name"),
        ("'orders', '{}', priority => 40000", "priority must be in -32768..32767"),
    ],
)
def test_the_sql_enqueue_refuses_bad_input_with_a_clear_error_and_stores_nothing(
    db: psycopg.Connection, table: OutboxTable, call: str, message: str
) -> None:
    with pytest.raises(psycopg.Error, match=message):
        db.execute(f'SELECT * FROM "{table.schema}".enqueue({call})')

    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(table.messages)).fetchone() == (0,)


def test_changing_the_partition_count_of_a_topic_with_pending_rows_is_refused(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    set_topic_partitions(db, table, "orders", 8)
    enqueue(db, "orders", {"n": 1}, key="customer-1", table=table)

    with pytest.raises(OutboxError, match="orders.*1 pending row.*drain"):
        set_topic_partitions(db, table, "orders", 16)
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
        db.execute(sql.SQL("UPDATE {} SET partitions = 16 WHERE topic = 'orders'").format(table.topics))
    set_topic_partitions(db, table, "*", 3)  # allowed: orders has a row of its own, the default does not cover it
    assert db.execute(sql.SQL("SELECT partitions FROM {} WHERE topic = 'orders'").format(table.topics)).fetchone() == (
        8,
    )


def test_the_default_partition_count_cannot_change_under_pending_rows_of_topics_it_covers(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    enqueue(db, "clicks", {"n": 1}, key="k", table=table)

    with pytest.raises(OutboxError, match="clicks"):
        set_topic_partitions(db, table, "*", 3)
    with pytest.raises(OutboxError, match="clicks"):
        set_topic_partitions(db, table, "clicks", 3)  # its own row would move it off the default


def test_the_partition_count_changes_once_the_topic_is_drained(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic("resize")
    set_topic_partitions(db, table, topic, 8)
    enqueue(db, topic, {"n": 1}, key="customer-1", table=table)
    set_topic_partitions(db, table, topic, 8)  # unchanged: always allowed

    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")
    set_topic_partitions(db, table, topic, 16)
    enqueue(db, topic, {"n": 2}, key="customer-1", table=table)

    assert _partitions(db, table, topic)["customer-1"] == {
        partition_for("customer-1", 8),
        partition_for("customer-1", 16),
    }


def _python_enqueue(conn: psycopg.Connection, table: OutboxTable) -> None:
    enqueue(conn, "orders", {"n": 1}, key="customer-1", table=table)


def _sql_enqueue(conn: psycopg.Connection, table: OutboxTable) -> None:
    conn.execute(
        sql.SQL("SELECT {}(topic => 'orders', payload => '{{}}', key => 'customer-1')").format(table.ident("enqueue"))
    )


def _plain_insert(conn: psycopg.Connection, table: OutboxTable) -> None:
    conn.execute(
        sql.SQL("INSERT INTO {} (topic, key, payload) VALUES ('orders', 'customer-1', '{{}}')").format(table.messages)
    )


# How each kind of writer inserts one row with key "customer-1" into "orders".
_WRITERS = {"python enqueue": _python_enqueue, "sql enqueue": _sql_enqueue, "plain insert": _plain_insert}


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
@pytest.mark.parametrize("writer", sorted(_WRITERS))
@pytest.mark.parametrize("before", [8, None], ids=["own-row", "default-row"])
def test_a_writer_whose_snapshot_predates_a_partition_count_change_fails_and_its_retry_routes_with_the_new_count(
    before: int | None,
    writer: str,
    isolation: str,
    db: psycopg.Connection,
    table: OutboxTable,
    connect: Callable[[], psycopg.Connection],
) -> None:
    """The guard waits for writers in flight, but a writer whose snapshot is its transaction's reads the partition
    counts of that snapshot: it routed "customer-1" with the old count after the change, one key in two partitions.
    Now it gets a serialization failure, which such writers retry."""
    if before is not None:
        set_topic_partitions(db, table, "orders", before)  # the topic's own row; else the '*' default (8) counts
    stale = connect()
    stale.execute(f"BEGIN ISOLATION LEVEL {isolation}")
    stale.execute("SELECT 1")  # its snapshot is taken

    set_topic_partitions(db, table, "orders", 16)  # nothing pending: allowed

    with pytest.raises(psycopg.errors.SerializationFailure):
        _WRITERS[writer](stale, table)
    stale.execute("ROLLBACK")
    stale.execute(f"BEGIN ISOLATION LEVEL {isolation}")
    _WRITERS[writer](stale, table)
    stale.execute("COMMIT")
    assert _partitions(db, table, "orders") == {"customer-1": {partition_for("customer-1", 16)}}


class Psql:
    """An interactive psql session (the embedded server's own client), driven line by line."""

    def __init__(self, bin_dir: Path, dsn: str) -> None:
        self._proc = subprocess.Popen(
            [str(bin_dir / "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", dsn],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._marker = 0

    def run(self, statement: str) -> list[str]:
        """Run one statement and wait for it: the lines it printed."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._marker += 1
        marker = f"--done {self._marker}--"
        self._proc.stdin.write(f"{statement}\n\\echo {marker}\n")
        self._proc.stdin.flush()
        lines: list[str] = []
        while (line := self._proc.stdout.readline()) != "":
            if line.rstrip("\n") == marker:
                return lines
            lines.append(line.rstrip("\n"))
        raise AssertionError(f"psql ended: {lines}")

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(timeout=30)


@pytest.fixture
def psql(pg_server: LocalPostgres) -> Iterator[Psql]:
    session = Psql(pg_server.bin_dir, pg_server.dsn)
    yield session
    session.close()


def test_python_and_psql_writers_of_the_same_keys_share_one_partition_per_key_and_keep_commit_order(
    db: psycopg.Connection,
    table: OutboxTable,
    psql: Psql,
    connect: Callable[[], psycopg.Connection],
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
) -> None:
    """Each round both transactions begin and write business rows before either enqueues, and they commit in
    alternating order, so transaction ids and commit order disagree every other round. Both writers take the
    serialized writers' lock (``serialized``), which makes ids commit-ordered: per key, Kafka gets the messages
    in the order their transactions committed."""
    topic = new_topic("mixed", partitions=4)
    set_topic_partitions(db, table, topic, 4)
    python = connect()
    python.autocommit = False
    for session in (python, psql):
        session.execute("CREATE TEMP TABLE business (n int)") if session is python else psql.run(
            "CREATE TEMP TABLE business (n int);"
        )
    python.commit()
    enqueue_sql = f"SELECT id FROM {table.schema}.enqueue('{topic}', '{{}}', key => '%s', serialized => true);"
    committed: dict[str, list[int]] = {key: [] for key in KEYS}
    for round_ in range(6):
        psql.run("BEGIN; INSERT INTO business VALUES (1);")
        python.execute("INSERT INTO business VALUES (1)")
        order = ("python", "psql") if round_ % 2 == 0 else ("psql", "python")
        for writer in order:
            if writer == "psql":
                ids = [int(psql.run(enqueue_sql % key)[0]) for key in KEYS]
                psql.run("COMMIT;")
            else:
                ids = [
                    enqueue(python, topic, {"round": round_}, key=key, serialized=True, table=table).id for key in KEYS
                ]
                python.commit()
            for key, id_ in zip(KEYS, ids, strict=True):
                committed[key].append(id_)

    assert _partitions(db, table, topic) == {key: {partition_for(key, 4)} for key in KEYS}
    drain(db.info.dsn, table, kafka.bootstrap_servers, "serialized")
    arrived = order_by_key(kafka.consume(topic, expect=len(KEYS) * 12))
    assert {key.decode(): ids for key, ids in arrived.items() if key is not None} == committed
