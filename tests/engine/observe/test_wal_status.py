"""`outbox status` and `outbox lag` on a wal outbox (issue 42): one line for its slot (it has no per-partition rows,
and they say so), the lag objective's verdict, and a missing slot named with its procedure."""

from __future__ import annotations

import json

import psycopg
import pytest

from outbox_pipeline import Message, OutboxTable, enqueue_many
from outbox_pipeline.cli import main
from outbox_pipeline.store.wal.objects import names_of


def test_status_of_a_fresh_wal_outbox_is_one_line_for_its_slot_and_says_no_partition_rows_exist(
    db: psycopg.Connection, wal_outbox: OutboxTable, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--dsn", db.info.dsn, "--schema", wal_outbox.schema]) == 0

    slot_line, note, verdict = capsys.readouterr().out.splitlines()
    assert slot_line.startswith(f"wal slot {names_of(wal_outbox).slot}: ")
    assert "oldest unpublished commit 0.0 s" in slot_line
    assert "no relay streams it" in slot_line and "wal_status reserved" in slot_line
    assert "no per-partition pending" in note
    assert verdict == "lag objective: OK"


def test_lag_of_a_wal_outbox_as_json_carries_the_slots_bytes_and_the_retention_warning(
    db: psycopg.Connection,
    wal_outbox: OutboxTable,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    enqueue_many(db, [Message("orders", {"n": n}, key="k") for n in range(10)], table=wal_outbox)
    monkeypatch.setenv("OUTBOX_WAL_RETAINED_WARN_BYTES", "1")

    assert main(["lag", "--strategy", "wal", "--dsn", db.info.dsn, "--schema", wal_outbox.schema, "--json"]) == 0

    lag = json.loads(capsys.readouterr().out)
    assert (lag["strategy"], lag["slot"], lag["exists"], lag["partitions"]) == (
        "wal",
        names_of(wal_outbox).slot,
        True,
        None,
    )
    assert lag["retained_bytes"] > 0 and lag["unconfirmed_bytes"] > 0
    assert lag["severity"] == "warn" and lag["reasons"][0].endswith("bytes of WAL > warn 1")


def test_status_of_a_wal_outbox_without_its_slot_names_what_happened_and_the_procedure(
    db: psycopg.Connection, wal_outbox: OutboxTable, capsys: pytest.CaptureFixture[str]
) -> None:
    db.execute("SELECT pg_drop_replication_slot(%s)", (names_of(wal_outbox).slot,))

    assert main(["status", "--dsn", db.info.dsn, "--schema", wal_outbox.schema]) == 0

    out = capsys.readouterr().out
    assert "without its replication slot" in out and "Run `outbox init-db --strategy wal`" in out
    assert "lag objective: ERROR: the slot cannot stream" in out
