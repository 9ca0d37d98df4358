"""`outbox status`: per partition, what blocks it, in words: the xmin horizon, a key held behind a poison
message, a backoff after failures, or simply no worker."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.cli import main
from outbox_pipeline.store import set_topic_partitions
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain, make_relay


def _status(
    db: psycopg.Connection, table: OutboxTable, strategy: str, capsys: pytest.CaptureFixture[str]
) -> dict[str, Any]:
    assert main(["status", "--strategy", strategy, "--dsn", db.info.dsn, "--schema", table.schema, "--json"]) == 0
    return {f"{s['topic']}:{s['partition']}": s for s in json.loads(capsys.readouterr().out)}


def test_a_caught_up_outbox_says_so(
    db: psycopg.Connection, table: OutboxTable, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--strategy", "partitioned", "--dsn", db.info.dsn, "--schema", table.schema]) == 0
    assert "every partition is caught up" in capsys.readouterr().out


def test_rows_nobody_relays_say_no_worker_has_taken_them(
    db: psycopg.Connection, table: OutboxTable, capsys: pytest.CaptureFixture[str]
) -> None:
    enqueue_many(db, [Message("orders", {"n": 1}, key="k", partition=2)], table=table)

    [status] = _status(db, table, "partitioned", capsys).values()
    assert (status["pending"], status["blocked_by"]) == (1, ["no worker has taken it yet (is a relay running?)"])


def test_an_open_transaction_is_named_as_the_blocker_of_the_partitions_it_holds_back(
    db: psycopg.Connection,
    table: OutboxTable,
    open_transaction: psycopg.Connection,
    capsys: pytest.CaptureFixture[str],
) -> None:
    enqueue_many(db, [Message("orders", {"n": i}, key="k", partition=1) for i in range(3)], table=table)

    status = _status(db, table, "partitioned", capsys)["orders:1"]

    assert status["pending"] == 3
    [blocker] = status["blocked_by"]
    pid = open_transaction.info.backend_pid
    assert blocker.startswith(f"horizon: 3 committed rows wait for pid {pid} ") and "idle in transaction" in blocker


def test_a_key_held_behind_a_poison_message_and_its_dead_letter_are_shown(
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = new_topic()
    set_topic_partitions(db, table, topic, 1)
    rows = [Message(topic, {"blob": "x" * 20_000}, key="order-7"), Message(topic, {"n": 1}, key="order-7")]
    poison, _ = enqueue_many(db, rows, table=table)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "serialized", producer={"message.max.bytes": 10_000})

    status = _status(db, table, "serialized", capsys)[f"{topic}:0"]

    assert (status["held"], status["dead_letters"]) == (1, 1)
    assert status["blocked_by"] == [f"poison: key 'order-7' held behind dead letter {poison.id} (1 rows)"]


def test_a_partition_backing_off_after_failures_says_until_when_and_why(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = f"missing-{uuid.uuid4().hex[:8]}"  # never created; the producer may not create it
    enqueue_many(db, [Message(missing, {"n": 1}, key="k", partition=0)], table=table)
    relay = make_relay(
        db.info.dsn, table, kafka.bootstrap_servers, "partitioned", until_empty=False, max_seconds=3,
        producer={"allow.auto.create.topics": False, "message.timeout.ms": 500}, backoff_base_s=60.0,
    )  # fmt: skip
    relay.run()

    status = _status(db, table, "partitioned", capsys)[f"{missing}:0"]

    [blocker] = status["blocked_by"]
    assert (
        blocker.startswith(f"backoff until {status['backoff_until']} UTC after 1 attempt(s): ") and missing in blocker
    )
