"""Writers using two-phase commit (XA): PostgreSQL refuses PREPARE TRANSACTION after a NOTIFY, so such a
writer enqueues with ``notify=False`` (``SET LOCAL outbox.notify = off`` from other languages); the rows are
then delivered by every strategy, found by the relay's poll instead of a wake-up."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Message, OutboxTable, enqueue, enqueue_many
from outbox_pipeline.model import STRATEGY_NAMES
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain, message_ids


def _prepare_and_commit(dsn: str, write: Callable[[psycopg.Connection], None]) -> None:
    gid = f"outbox-test-{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("BEGIN")
        write(conn)
        conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        conn.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_an_enqueue_in_a_prepared_transaction_is_delivered_once_committed(
    strategy: str, dsn: str, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    written: list[str] = []

    def write(conn: psycopg.Connection) -> None:
        messages = [Message(topic, {"n": i}, key="k") for i in range(5)]
        enqueued = enqueue_many(conn, messages, notify=False, serialized=strategy == "serialized", table=table)
        written.extend(str(e.message_id) for e in enqueued)

    _prepare_and_commit(dsn, write)

    drain(dsn, table, kafka.bootstrap_servers, strategy)
    assert message_ids(kafka.consume(topic, expect=5)) == written


def test_without_the_opt_out_prepare_transaction_fails_with_postgresqls_own_error(
    dsn: str, table: OutboxTable, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()

    def write(conn: psycopg.Connection) -> None:
        enqueue(conn, topic, {"n": 1}, table=table)

    with pytest.raises(psycopg.errors.FeatureNotSupported, match="cannot PREPARE a transaction that has executed"):
        _prepare_and_commit(dsn, write)


def test_a_plain_sql_writer_opts_out_with_set_local(
    dsn: str, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    """What a Java or psql writer does: ``SET LOCAL outbox.notify = off`` before its insert."""
    topic = new_topic()

    def write(conn: psycopg.Connection) -> None:
        conn.execute("SET LOCAL outbox.notify = off")
        enqueue(conn, topic, {"n": 1}, key="k", table=table)

    _prepare_and_commit(dsn, write)
    drain(dsn, table, kafka.bootstrap_servers, "locking")
    assert len(message_ids(kafka.consume(topic, expect=1))) == 1
