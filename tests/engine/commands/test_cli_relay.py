"""`outbox relay`: worker processes against the real servers, one run per strategy."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from outbox_pipeline.cli import main
from outbox_pipeline.config import OutboxTable
from outbox_pipeline.model import STRATEGY_NAMES
from tests.kit.kafka import KafkaProbe
from tests.kit.relay import message_ids

COUNT = 3000


def _available(name: str) -> bool:
    return importlib.util.find_spec(f"outbox_pipeline.strategies.{name}") is not None


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(name, marks=pytest.mark.skipif(not _available(name), reason=f"strategy module {name} not written"))
        for name in STRATEGY_NAMES
    ],
)
def test_relay_command_with_2_worker_processes_delivers_every_loaded_message(
    strategy: str,
    dsn: str,
    db: psycopg.Connection,
    table: OutboxTable,
    kafka: KafkaProbe,
    new_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = new_topic()
    assert main(["load", str(COUNT), "--dsn", dsn, "--schema", table.schema, "--topics", topic, "--size", "64"]) == 0
    loaded = {r[0] for r in db.execute(sql.SQL("SELECT message_id::text FROM {}").format(table.messages)).fetchall()}
    capsys.readouterr()
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)

    code = main(
        [
            "relay",
            "--dsn",
            dsn,
            "--schema",
            table.schema,
            "--strategy",
            strategy,
            "--workers",
            "2",
            "--batch-size",
            "500",
            "--until-empty",
            "--max-seconds",
            "120",
        ]
    )

    out = capsys.readouterr().out
    print(out)
    assert code == 0
    assert set(message_ids(kafka.consume(topic, expect=COUNT))) == loaded
    total = re.search(r"^total: published=(\d+) ", out, re.MULTILINE)
    assert total is not None, out
    # Exactly once here: no lease can expire (60 s) and no publish fails in a run this short, so no
    # batch is published twice. At-least-once in general: an expired lease or a failed ack republishes.
    assert int(total.group(1)) == COUNT
    assert len(re.findall(r"^worker \d \(.+\): published=", out, re.MULTILINE)) == 2


def test_relay_command_without_kafka_servers_exits_2_with_one_line(
    dsn: str, table: OutboxTable, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    code = main(["relay", "--dsn", dsn, "--schema", table.schema, "--strategy", "locking", "--until-empty"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == ["error: KAFKA_BOOTSTRAP_SERVERS is not set (or pass --bootstrap-servers)"]


def test_relay_command_never_prints_a_kafka_secret_in_a_config_error(
    dsn: str, table: OutboxTable, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = "k4fka-S3cret"
    monkeypatch.setenv("KAFKA_SASL_PASSWORD", secret)
    monkeypatch.setenv("KAFKA_NO_SUCH_PROPERTY", "x")
    code = main(
        ["relay", "--dsn", dsn, "--schema", table.schema, "--strategy", "locking", "--bootstrap-servers", "127.0.0.1:1"]
    )
    captured = capsys.readouterr()
    assert code == 2
    assert "invalid Kafka configuration" in captured.err
    assert secret not in captured.err + captured.out


def _children(pid: int) -> list[int]:
    text = open(f"/proc/{pid}/task/{pid}/children").read()  # noqa: SIM115 - one read of a /proc file
    return [int(child) for child in text.split()]


@pytest.mark.parametrize("children", [1, 2, 3], ids=["1-child", "2-children", "3-children"])
def test_sigterm_while_the_workers_start_stops_them_all_and_the_relay_exits_0(
    children: int, dsn: str, table: OutboxTable, kafka: KafkaProbe
) -> None:
    """A pod stopped as it starts (a rollout). Seen in a fresh clone under load as exit 1 with a worker that never
    reported; on main the supervisor did not exit at all: a worker started after the signal never heard it. The
    children are multiprocessing's resource tracker and the two workers, so the signal lands at each stage."""
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers}
    relay = subprocess.Popen(
        [sys.executable, "-m", "outbox_pipeline.cli", "relay", "--dsn", dsn, "--schema", table.schema]
        + ["--strategy", "lease", "--workers", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while len(_children(relay.pid)) < children and relay.poll() is None:  # spawned, still starting
            pass
        relay.send_signal(signal.SIGTERM)
        out, err = relay.communicate(timeout=20)
    finally:
        if relay.poll() is None:
            for child in _children(relay.pid):
                os.kill(child, signal.SIGKILL)
            relay.kill()
            relay.communicate()
    assert relay.returncode == 0, out + err
    assert "crashed=0" in out


def test_sigterm_stops_every_worker_and_the_relay_exits_0_with_its_summary(
    dsn: str, table: OutboxTable, kafka: KafkaProbe, new_topic: Callable[..., str]
) -> None:
    topic = new_topic()
    assert main(["load", "200", "--dsn", dsn, "--schema", table.schema, "--topics", topic, "--size", "64"]) == 0
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers}
    relay = subprocess.Popen(
        [sys.executable, "-m", "outbox_pipeline.cli", "relay", "--dsn", dsn, "--schema", table.schema]
        + ["--strategy", "lease", "--workers", "2", "--batch-size", "50"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert len(kafka.consume(topic, expect=200)) == 200  # the workers are running and idle now
        relay.send_signal(signal.SIGTERM)
        out, err = relay.communicate(timeout=60)
    finally:
        if relay.poll() is None:
            relay.kill()
    assert relay.returncode == 0, out + err  # the summary names a worker that crashed
    assert "total: published=200 " in out
    assert "crashed=0" in out
