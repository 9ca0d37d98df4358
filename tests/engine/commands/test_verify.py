"""`outbox verify`: the ledger check, against real PostgreSQL and the real broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline import Enqueued, Message, OutboxTable, enqueue_many
from outbox_pipeline.cli import main
from outbox_pipeline.errors import OutboxError
from outbox_pipeline.store import set_topic_partitions
from outbox_pipeline.verify import VerifyReport, verify
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import drain, make_wal_relay

IDLE_S = 1.0


def _write(
    db: psycopg.Connection, table: OutboxTable, topic: str, count: int, keys: int = 10, **kw: object
) -> list[Enqueued]:
    return enqueue_many(db, [Message(topic, {"n": i}, key=f"key-{i % keys}") for i in range(count)], table=table, **kw)  # type: ignore[arg-type]


def _verify(db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, topic: str, **kw: object) -> VerifyReport:
    report = verify(db, table, {"bootstrap.servers": kafka.bootstrap_servers}, [topic], idle_s=IDLE_S, **kw)  # type: ignore[arg-type]
    print(report.render())
    return report


def _produce(kafka: KafkaProbe, topic: str, key: str, headers: dict[str, str]) -> None:
    producer = kafka.producer()
    producer.produce(topic, b"{}", key.encode(), headers=[(k, v.encode()) for k, v in headers.items()])
    assert producer.flush(10) == 0


def _headers(db: psycopg.Connection, table: OutboxTable, outbox_id: int) -> dict[str, str]:
    """The headers the relay would send for one row."""
    row = db.execute(
        sql.SQL(
            "SELECT message_id::text, id::text, "
            """to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') FROM {} WHERE id = %s"""
        ).format(table.messages),
        (outbox_id,),
    ).fetchone()
    assert row is not None
    return {"message_id": row[0], "outbox_id": row[1], "created_at": row[2]}


def test_a_clean_partitioned_relay_verifies_ok_with_nothing_lost_phantom_or_duplicated(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=3)
    set_topic_partitions(db, table, topic, 4)
    _write(db, table, topic, 500)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")

    report = _verify(db, table, kafka, topic, ordered="partitioned")

    assert report.ok
    assert (report.ledger_messages, report.consumed_records, report.partitions) == (500, 500, 3)
    assert (report.lost, report.phantom, report.duplicate_copies, report.dead_letters) == (0, 0, 0, 0)
    assert (report.order_checked, report.order_violations) == (500, 0)
    assert report.complete


def test_a_committed_row_never_relayed_is_lost_and_the_command_exits_1(
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = new_topic()
    _write(db, table, topic, 20)
    drain(dsn, table, kafka.bootstrap_servers, "partitioned")
    [never_relayed] = _write(db, table, topic, 1)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)

    code = main(["verify", topic, "--dsn", dsn, "--schema", table.schema, "--idle-s", str(IDLE_S)])

    out = capsys.readouterr().out
    print(out)
    assert code == 1
    assert "lost         1" in out
    assert f"message_id={never_relayed.message_id} outbox_id={never_relayed.id}" in out
    assert out.rstrip().endswith("FAILED: 1 lost")


def test_a_record_with_a_message_id_the_outbox_never_committed_is_phantom(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    _write(db, table, topic, 10)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")
    stranger = str(uuid.uuid4())
    _produce(kafka, topic, "key-1", {"message_id": stranger, "outbox_id": "999999"})

    report = _verify(db, table, kafka, topic)

    assert not report.ok
    assert (report.phantom, report.lost) == (1, 0)
    assert report.phantom_examples[0].message_id == stranger
    assert report.phantom_examples[0].key == "key-1"


def test_a_record_produced_twice_counts_as_one_duplicate_of_its_key_and_still_verifies_ok(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    written = _write(db, table, topic, 10)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")
    _produce(kafka, topic, "key-3", _headers(db, table, written[3].id))

    report = _verify(db, table, kafka, topic)

    assert report.ok
    assert (report.duplicate_copies, report.duplicated_messages) == (1, 1)
    assert (report.worst_duplicate_key, report.worst_duplicate_key_copies) == ("key-3", 1)


def test_two_records_of_one_key_in_the_wrong_order_are_an_order_violation_for_serialized(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    first, second = _write(db, table, topic, 2, keys=1, serialized=True)
    _produce(kafka, topic, "key-0", _headers(db, table, second.id))
    _produce(kafka, topic, "key-0", _headers(db, table, first.id))

    report = _verify(db, table, kafka, topic, ordered="serialized")

    assert not report.ok
    assert (report.lost, report.phantom, report.order_checked, report.order_violations) == (0, 0, 2, 1)
    example = report.order_example
    assert example is not None
    assert (example.key, example.outbox_id, example.previous_outbox_id) == ("key-0", first.id, second.id)
    assert example.offset == example.previous_offset + 1


def test_latency_percentiles_cover_every_message_and_are_non_negative(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    _write(db, table, topic, 100)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")

    latency = _verify(db, table, kafka, topic).latency

    assert latency is not None
    assert latency.messages == 100
    assert 0 <= latency.p50_ms <= latency.p95_ms <= latency.p99_ms <= latency.max_ms


def test_a_ledger_file_verifies_a_delete_mode_drain_whose_rows_are_gone(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic = new_topic(partitions=2)
    written = _write(db, table, topic, 200)
    ledger = tmp_path / "ledger.txt"
    ledger.write_text("".join(f"{w.message_id}\n" for w in written))
    drain(db.info.dsn, table, kafka.bootstrap_servers, "locking", mode="delete")
    assert db.execute(sql.SQL("SELECT count(*) FROM {}").format(table.messages)).fetchone() == (0,)

    report = _verify(db, table, kafka, topic, ledger_file=ledger)

    assert report.ok
    assert (report.ledger, report.ledger_messages, report.consumed_records, report.lost) == ("file", 200, 200, 0)


def test_a_table_ledger_after_a_delete_mode_drain_reports_phantoms_and_points_to_the_ledger_file(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    _write(db, table, topic, 5)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "locking", mode="delete")

    report = _verify(db, table, kafka, topic)

    assert (report.ok, report.ledger_messages, report.phantom) == (False, 0, 5)
    assert any("--ledger-file" in note for note in report.notes)


def test_a_dead_lettered_message_is_reported_as_a_dead_letter_not_as_lost(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    set_topic_partitions(db, table, topic, 1)
    messages = [Message(topic, {"n": i}, key="k") for i in range(6)]
    messages.insert(3, Message(topic, {"blob": "x" * 20_000}, key="k"))
    enqueue_many(db, messages, table=table)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned", producer={"message.max.bytes": 10_000})

    report = _verify(db, table, kafka, topic, ordered="partitioned")

    assert report.ok
    # The poison row's key is held behind it (quarantine): its 3 later rows are held, not lost.
    assert (report.ledger_messages, report.lost, report.dead_letters, report.held) == (3, 0, 1, 3)
    assert report.order_checked == 3


def test_since_and_id_from_restrict_the_ledger_and_ignore_older_records(
    db: psycopg.Connection, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    old = _write(db, table, topic, 10)
    drain(db.info.dsn, table, kafka.bootstrap_servers, "partitioned")
    # Older history whose rows are gone (a dropped partition): without the range it would be phantom.
    db.execute(sql.SQL("DELETE FROM {} WHERE id <= %s").format(table.messages), (old[4].id,))

    report = _verify(db, table, kafka, topic, id_from=old[5].id)

    assert report.ok
    assert (report.ledger_messages, report.ignored_records, report.phantom) == (5, 5, 0)


def test_a_missing_ledger_file_exits_2_with_one_line(
    dsn: str,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
    missing = tmp_path / "nope.txt"
    code = main(["verify", new_topic(), "--dsn", dsn, "--schema", table.schema, "--ledger-file", str(missing)])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.strip().splitlines() == [
        f"error: cannot read --ledger-file {missing}: No such file or directory"
    ]
    assert "Traceback" not in captured.err


def test_an_unknown_topic_exits_2_with_one_line(
    dsn: str, table: OutboxTable, kafka: KafkaProbe, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
    topic = f"never-created-{uuid.uuid4().hex[:8]}"
    code = main(["verify", topic, "--dsn", dsn, "--schema", table.schema])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and f"topic {topic!r} cannot be read" in err


def test_verify_imports_neither_dagster_nor_spark() -> None:
    code = (
        "import sys, outbox_pipeline.verify\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in ('dagster', 'pyspark'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.nightly  # a run at size: make test-nightly (the 20-minute budget of make test)
def test_200k_messages_relayed_by_2_partitioned_workers_verify_ok(
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    count = 200_000
    topic = new_topic(partitions=4)
    base = ["--dsn", dsn, "--schema", table.schema]
    assert main(["load", str(count), *base, "--topics", topic]) == 0
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
    assert main(["relay", *base, "--strategy", "partitioned", "--workers", "2", "--until-empty"]) == 0
    capsys.readouterr()

    # Its own process, so the peak RSS measured is verify's alone (RUSAGE_SELF, in KiB on Linux).
    runner = (
        "import resource, sys\n"
        "from outbox_pipeline.cli import main\n"
        "code = main(sys.argv[1:])\n"
        "print(f'peak_rss_kib={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}', file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", runner, "verify", topic, *base, "--ordered", "partitioned", "--json"],
        env={**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers},
        capture_output=True,
        text=True,
        timeout=600,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    peak_kib = int(proc.stderr.rsplit("peak_rss_kib=", 1)[1].split()[0])
    print(
        f"verify of {count:,} messages: {elapsed:.1f} s wall in a fresh process "
        f"(of which report elapsed_s={report['elapsed_s']}, 5 s idle wait included), "
        f"peak RSS {peak_kib / 1024:.0f} MB; latency {report['latency']}"
    )
    assert report["ok"]
    assert (report["ledger_messages"], report["lost"], report["phantom"]) == (count, 0, 0)
    assert report["consumed_records"] >= count
    assert report["order_violations"] == 0


def test_a_wal_outbox_is_verified_against_the_writers_ledger_file(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic = new_topic(partitions=2)
    with db.transaction():
        written = enqueue_many(db, [Message(topic, {"n": i}, key=f"k{i % 7}") for i in range(200)], table=wal_outbox)
    ledger = tmp_path / "ledger.txt"
    ledger.write_text("".join(f"{w.message_id}\n" for w in written))
    ledger_with_one_never_written = tmp_path / "more.txt"
    ledger_with_one_never_written.write_text(ledger.read_text() + f"{uuid.uuid4()}\n")
    make_wal_relay(db.info.dsn, wal_outbox, kafka.bootstrap_servers).run()

    report = _verify(db, wal_outbox, kafka, topic, ledger_file=ledger)
    short = _verify(db, wal_outbox, kafka, topic, ledger_file=ledger_with_one_never_written)

    assert report.ok
    assert (report.ledger_messages, report.consumed_records, report.lost, report.phantom) == (200, 200, 0, 0)
    assert short.lost == 1 and not short.ok


def test_a_wal_outbox_without_a_ledger_file_is_refused_with_what_to_give(
    db: psycopg.Connection, wal_outbox: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    with pytest.raises(OutboxError, match="wal outbox: it keeps no rows .* give the message ids"):
        _verify(db, wal_outbox, kafka, new_topic())
