"""The `outbox` command line against the real server."""

from __future__ import annotations

import json

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline.cli import main
from outbox_pipeline.config import OutboxTable
from outbox_pipeline.localstack import free_port
from tests.kit.relay import row_count


def test_init_db_reports_the_schema_version_and_is_rerunnable(
    dsn: str, table: OutboxTable, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["init-db", "--dsn", dsn, "--schema", table.schema, "--topic", "orders:16"]) == 0
    assert "already current" in capsys.readouterr().out


def test_enqueue_stores_one_message_and_prints_its_ids(
    dsn: str, db: psycopg.Connection, table: OutboxTable, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "enqueue",
            "--dsn",
            dsn,
            "--schema",
            table.schema,
            "--topic",
            "orders",
            "--key",
            "k1",
            "--payload",
            '{"n": 1}',
            "--header",
            "trace=abc",
        ]
    )
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) == {"id", "message_id"}
    assert row_count(db, table) == 1


def test_enqueue_with_an_invalid_topic_exits_2_with_a_clear_error_and_stores_nothing(
    dsn: str, db: psycopg.Connection, table: OutboxTable, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["enqueue", "--dsn", dsn, "--schema", table.schema, "--topic", "bad topic", "--payload", "{}"])
    assert code == 2
    assert "invalid Kafka topic name 'bad topic'" in capsys.readouterr().err
    assert row_count(db, table) == 0


def test_enqueue_stores_base64_given_bytes_as_a_binary_payload(
    dsn: str, db: psycopg.Connection, table: OutboxTable
) -> None:
    args = ["enqueue", "--dsn", dsn, "--schema", table.schema, "--topic", "orders", "--payload-base64", "AAH/"]
    assert main(args) == 0
    stored = db.execute(sql.SQL("SELECT payload, payload_bytes FROM {}").format(table.messages)).fetchall()
    assert stored == [(None, b"\x00\x01\xff")]


def test_enqueue_with_bad_base64_exits_2_with_a_clear_error_and_stores_nothing(
    dsn: str, db: psycopg.Connection, table: OutboxTable, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["enqueue", "--dsn", dsn, "--schema", table.schema, "--topic", "orders", "--payload-base64", "not base64!"]
    assert main(args) == 2
    assert "--payload-base64 is not valid base64" in capsys.readouterr().err
    assert row_count(db, table) == 0


def test_load_copies_messages_and_prints_its_rate(
    dsn: str, db: psycopg.Connection, table: OutboxTable, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["load", "50000", "--dsn", dsn, "--schema", table.schema, "--size", "256"]) == 0
    out = capsys.readouterr().out
    print(out)  # the rate, for the record; speed is benchmarked, not asserted
    assert "loaded 50,000 messages of 256 B" in out
    assert row_count(db, table) == 50_000
    sizes = db.execute(
        sql.SQL("SELECT min(octet_length(payload::text)), count(DISTINCT topic) FROM {}").format(table.messages)
    ).fetchone()
    assert sizes is not None and sizes[0] >= 250 and sizes[1] == 2


def test_a_missing_dsn_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("OUTBOX_PG_DSN", raising=False)
    assert main(["init-db"]) == 2
    assert "OUTBOX_PG_DSN is not set" in capsys.readouterr().err


def test_an_unreachable_database_error_never_prints_the_password(capsys: pytest.CaptureFixture[str]) -> None:
    secret = "s3cr3t-Pa55"
    dsn = f"host=127.0.0.1 port={free_port()} user=postgres password={secret} dbname=postgres connect_timeout=2"
    assert main(["init-db", "--dsn", dsn]) == 2
    captured = capsys.readouterr()
    assert "cannot reach PostgreSQL" in captured.err
    assert secret not in captured.err + captured.out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["init-db", "--topic", "orders"], "expected NAME:PARTITIONS (a topic and its partition count), got 'orders'"),
        (["init-db", "--topic", "orders:0"], "must be at least 1, got 0"),
        (["init-db", "--partitions", "0"], "must be at least 1, got 0"),
        (["enqueue", "--topic", "t", "--payload", "{}", "--header", "foo"], "expected NAME=VALUE, got 'foo'"),
    ],
)
def test_malformed_arguments_are_refused_with_what_was_expected_before_touching_the_database(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 40, case 29: each was a traceback (ValueError, a CHECK violation from the database)."""
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--dsn", "host=127.0.0.1 port=1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_dead_letters_retry_without_a_selector_retries_nothing_and_says_which_to_give(
    db: psycopg.Connection, table: OutboxTable, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dead-letters", "retry", "--dsn", db.info.dsn, "--schema", table.schema]) == 2
    assert "say which: --id ID (repeatable), --topic TOPIC, or --all" in capsys.readouterr().err
