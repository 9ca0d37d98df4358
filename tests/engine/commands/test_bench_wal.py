"""`outbox bench` with the wal strategy (issue 42) against the test servers: small sizes, checking what it reports and
that it leaves no replication slot behind, never how fast."""

from __future__ import annotations

import json
import re
from pathlib import Path

import psycopg
import pytest

from outbox_pipeline.cli import main
from outbox_pipeline.localstack import LocalBroker


@pytest.fixture
def bench_servers(monkeypatch: pytest.MonkeyPatch, dsn: str, broker: LocalBroker) -> str:
    monkeypatch.setenv("OUTBOX_PG_DSN", dsn)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", broker.bootstrap_servers)
    return dsn


def _left_behind(dsn: str) -> tuple[list[str], list[str]]:
    """The bench's schemas and replication slots still there (a slot left behind retains WAL for ever)."""
    with psycopg.connect(dsn) as conn:
        schemas = conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'bench%%'").fetchall()
        slots = conn.execute("SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE 'outbox_bench%%'")
        return [r[0] for r in schemas], [r[0] for r in slots.fetchall()]


def test_bench_writers_puts_the_wal_outboxs_writers_beside_a_plain_insert_with_cpu_and_wal_bytes_per_row(
    bench_servers: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Enough transactions for PostgreSQL's CPU to count ticks (10 ms) in every cell: with 100, a 10-row cell's
    # backend could count none, and its ratio printed "-" (a fresh clone, 2026-11-27); with 300, the baseline's
    # one-row cell (about 30 us a transaction: 9 ms) counted none on a loaded fresh clone (2026-11-29).
    code = main(["bench", "--writers", "--strategies", "wal", "--runs", "1", "--transactions", "2000", "--messages",
                 "200", "--rows-per-transaction", "1,10"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    # rows/s and its ratio; PostgreSQL's CPU per row and its ratio, the writer's backend's and its ratio; WAL bytes
    # per row and its ratio (each against the plain table's INSERT of the same run)
    figures = r"[\d,]+ \| \d+\.\d\d \| \d+\.\d \| \d+\.\d\d \| \d+\.\d \| \d+\.\d\d \| [\d,]+ \| \d+\.\d\d"
    for writer in ("plain table, one INSERT (baseline)", "Python enqueue_many()", "INSERT without partition (trigger)"):
        index_set = "-" if writer.startswith("plain") else "wal"
        for size in (1, 10):
            row = rf"^\| {re.escape(writer)} \| {index_set} \| {size} \| {figures} \|$"
            assert re.search(row, out, re.MULTILINE), (row, out)
    wal_lines = re.findall(r"^\| ([^|]+?) \| wal \| (\d+) \|", out, re.MULTILINE)
    assert sorted(wal_lines) == [(w, n) for w in ("INSERT without partition (trigger)", "Python enqueue_many()")
                                 for n in ("1", "10")], out  # fmt: skip
    assert _left_behind(bench_servers) == ([], [])


@pytest.mark.nightly  # a run at size: make test-nightly (the 20-minute budget of make test)
def test_bench_wal_drains_a_backlog_with_one_relay_beside_partitioneds_counting_every_message(
    bench_servers: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["bench", "--strategy", "wal", "--messages", "2000", "--batch-size", "500", "--verify"])
    out = capsys.readouterr().out
    assert code == 0, out
    for line in (r"wal ours w=1 b=\d+", r"partitioned ours w=2 b=500", r"partitioned produce-only w=2 b=500",
                 r"wal read-only w=1 b=\d+"):  # fmt: skip
        assert re.search(line + r" +2,000 msgs .* verified", out), (line, out)
    lines = re.findall(r"^\| ([\w -]+?) \| .* \| [\d,]+ \| - \| \d+ % \| \d+ % \| yes \|$", out, re.M)
    assert lines == ["ours", "ours partitioned", "produce-only", "read-only"], out
    assert _left_behind(bench_servers) == ([], [])


@pytest.mark.nightly  # a run at size: make test-nightly (the 20-minute budget of make test)
def test_bench_latency_runs_the_wal_relay_with_the_observer_for_the_curve_and_the_hot_key(
    bench_servers: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "latency.json"
    code = main(["bench", "--latency", "100", "--hot-key", "40", "--quiet-keys", "3", "--strategies", "wal",
                 "--seconds", "4", "--idle-seconds", "0", "--json", str(out_json)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out  # every committed message arrived
    scenarios = {r["scenario"]: r for r in json.loads(out_json.read_text())["scenarios"]}
    assert sorted(scenarios) == ["100 msg/s x 10", "hot key 40 msg/s"], out
    for r in scenarios.values():
        assert r["strategy"] == "wal" and r["missing"] == 0 and r["duplicates"] == 0, r
        for c in r["classes"]:
            assert c["arrived"] == c["committed"] > 0, c
            assert 0 <= c["p50_ms"] <= c["p95_ms"] <= c["p99_ms"] <= c["max_ms"], c
        assert {"relay", "relay's PostgreSQL sessions", "postgresql", "writers", "observer"} <= set(r["cores"])
        assert r["relay_us_per_message"] > 0  # per message committed in the window: the wal relay has no counter
    for row in ("100 msg/s x 10 | all", "hot key 40 msg/s | quiet", "hot key 40 msg/s | hot", "40"):
        assert re.search(rf"^\| wal \| cli \| {re.escape(row)} \|", out, re.MULTILINE), (row, out)
    assert _left_behind(bench_servers) == ([], [])


def test_bench_latency_on_wal_without_the_observer_waits_for_the_slot_to_confirm_every_message(
    bench_servers: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "latency.json"
    code = main(["bench", "--latency", "100", "--strategies", "wal", "--seconds", "3", "--idle-seconds", "0",
                 "--no-observer", "--json", str(out_json)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    (result,) = json.loads(out_json.read_text())["scenarios"]
    assert result["missing"] == 0 and result["classes"][0]["committed"] > 0, result
    assert _left_behind(bench_servers) == ([], [])


def test_bench_latency_hold_open_needs_the_scenario_to_outlast_the_open_transaction(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit, match="--hold-open 60 needs --seconds 62 or more"):
        main(["bench", "--latency", "2000", "--hold-open", "60", "--seconds", "20"])


@pytest.mark.nightly  # a run at size: make test-nightly (the 20-minute budget of make test)
def test_bench_latency_hold_open_stalls_partitioned_for_the_open_transaction_and_reports_wal_beside_it(
    bench_servers: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "latency.json"
    code = main(["bench", "--latency", "100", "--strategies", "partitioned,wal", "--seconds", "6", "--hold-open", "3",
                 "--idle-seconds", "0", "--json", str(out_json)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out  # every message arrived, the held ones too once the transaction ended
    results = {(r["strategy"], r["scenario"]): r for r in json.loads(out_json.read_text())["scenarios"]}
    held = "100 msg/s x 10, a transaction open 3 s"
    assert set(results) == {(s, n) for s in ("partitioned", "wal") for n in ("100 msg/s x 10", held)}
    # partitioned cannot pass the open transaction: what committed just after it opened waited for it to end
    assert results[("partitioned", held)]["classes"][0]["max_ms"] > 1000, results[("partitioned", held)]
    for strategy in ("partitioned", "wal"):
        number = r"[\d,]+\.\d+"
        row = rf"^\| {strategy} \| cli \| 100 x 10 \| 3 \| {number} \| {number} \| {number} \| {number} \| (yes|NO) \|$"
        assert re.search(row, out, re.MULTILINE), out
    assert _left_behind(bench_servers) == ([], [])
