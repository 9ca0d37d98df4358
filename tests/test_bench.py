"""`outbox bench` against the test servers: small sizes, checking what it reports, never how fast."""

from __future__ import annotations

import re

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline.cli import main
from outbox_pipeline.localstack import LocalBroker


@pytest.fixture
def bench_servers(monkeypatch: pytest.MonkeyPatch, dsn: str, broker: LocalBroker) -> str:
    monkeypatch.setenv("OUTBOX_PG_DSN", dsn)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", broker.bootstrap_servers)
    return dsn


def _bench_schemas(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'bench%%'").fetchall()
    return [r[0] for r in rows]


def test_bench_with_baseline_verifies_every_message_and_prints_the_ratio(
    bench_servers: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["bench", "--strategy", "partitioned", "--messages", "3000", "--batch-size", "500", "--baseline",
                 "--verify"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"partitioned ours w=2 b=500 +3,000 msgs .* verified", out), out
    assert re.search(r"partitioned naive w=2 b=100 +3,000 msgs", out), out
    assert re.search(r"ratio \d+\.\dx", out), out
    assert _bench_schemas(bench_servers) == []  # every run drops its schema


@pytest.mark.parametrize("strategy", ["lease", "partitioned"])
def test_bench_retained_reports_claim_latency_with_plans_bounded_by_the_batch(
    strategy: str, bench_servers: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["bench", "--strategy", strategy, "--retained", "0,5000", "--pending", "1000", "--batch-size", "200"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = re.findall(r"^ +([\d,]+) +[\d.]+ +[\d.]+ +\S+ % +(yes|NO) +(.*)$", out, re.MULTILINE)
    assert [(retained, bounded) for retained, bounded, _ in rows] == [("0", "yes"), ("5,000", "yes")], out
    assert all("Index Scan" in plan for _, _, plan in rows), out
    assert _bench_schemas(bench_servers) == []


def test_bench_held_times_claims_with_a_held_key_and_shows_they_never_read_the_held_rows(
    bench_servers: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["bench", "--strategy", "serialized", "--held", "0,300", "--batch-size", "200"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = re.findall(r"^ +([\d,]+) +[\d.]+ +[\d.]+ +\S+ % +(yes|NO) +(.*)$", out, re.MULTILINE)
    assert [(held, bounded) for held, bounded, _ in rows] == [("0", "yes"), ("300", "yes")], out
    assert all("outbox_held" not in plan for _, _, plan in rows), out
    assert _bench_schemas(bench_servers) == []


def test_bench_rejects_descending_retained_steps(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--retained", "1000,0"])
    assert "ascending" in capsys.readouterr().err


def test_bench_latency_reports_percentiles_once_every_committed_message_arrived(
    bench_servers: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["bench", "--strategy", "partitioned", "--workers", "1", "--latency", "200", "--seconds", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    found = re.search(r"p50 [\d.]+ ms, p95 [\d.]+ ms, p99 [\d.]+ ms, max [\d.]+ ms \(([\d,]+)/([\d,]+) arrived", out)
    assert found is not None, out
    assert found.group(1) == found.group(2) != "0"
    assert _bench_schemas(bench_servers) == []


def test_bench_writers_compares_routing_in_python_and_in_the_database_against_a_plain_insert(
    bench_servers: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["bench", "--writers", "--runs", "1", "--transactions", "50", "--messages", "500"])
    out = capsys.readouterr().out
    assert code == 0, out
    writers = (
        "INSERT naming its partition (baseline)",
        "Python enqueue()",
        "INSERT without partition (trigger)",
        "SQL enqueue()",
        "outbox load, partition from Python",
        "outbox load --route-in-db (trigger)",
    )
    for writer in writers:
        assert re.search(rf"^\| {re.escape(writer)} \| [\d,]+ \| \d+\.\d\d \|$", out, re.MULTILINE), out
    assert _bench_schemas(bench_servers) == []


def test_bench_dagster_drives_the_relay_with_one_run_and_compares_it_with_the_cli_relay(
    bench_servers: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["bench", "--dagster", "--latency", "50", "--seconds", "4", "--runs", "1"])
    out = capsys.readouterr().out
    assert code == 0, out  # every committed message arrived, in both modes
    assert re.search(r"^\| dagster \| [\d.]+ \| [\d.]+ \| [\d.]+ \| 1 \| 0 \|$", out, re.MULTILINE), out
    assert re.search(r"^\| cli \| [\d.]+ \| [\d.]+ \| [\d.]+ \| - \| - \|$", out, re.MULTILINE), out
    assert re.search(r"dagster: .*dagster runs [\d.]+", out), out  # the run's CPU is counted as its own group
    assert re.search(r"Dagster-driven / CLI relay: [\d.]+x", out), out
    assert _bench_schemas(bench_servers) == []


def test_bench_load_turns_the_wakeup_trigger_back_on_before_the_drain(dsn: str, broker: LocalBroker) -> None:
    from outbox_pipeline.bench.runner import RunSpec, Servers, prepare

    table, _topics, _load_s = prepare(
        Servers(dsn, broker.bootstrap_servers), RunSpec(strategy="partitioned", messages=500), lambda _: None
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        enabled = conn.execute(
            "SELECT tgenabled FROM pg_trigger WHERE tgname = 'outbox_messages_notify' AND tgrelid = %s::regclass",
            (f"{table.schema}.outbox_messages",),
        ).fetchone()
        loaded = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table.messages)).fetchone()
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(table.schema)))
    assert enabled == ("O",)  # "O": fires in origin sessions, i.e. enabled
    assert loaded == (500,)
