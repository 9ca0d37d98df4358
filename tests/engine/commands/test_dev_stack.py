"""`outbox dev`: brings up PostgreSQL, the broker, demo traffic and `dagster dev`, and SIGINT (Ctrl-C)
stops every process it started, leaving none behind; a second run reuses the data."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_pipeline.localstack import free_port
from outbox_pipeline.localstack.dev import DevSettings, _reap_stale, _write_pid
from tests.kit.net import LOOPBACK, listening_hosts

ROOT = Path(__file__).resolve().parents[3]


def _descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = (int(x) for x in line.split())
        children.setdefault(parent, []).append(child)
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.split(")")[-1].split()[0] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return "?"


def _graphql(port: int, query: str) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=json.dumps({"query": query}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


class DevRun:
    def __init__(self, home: Path, **extra_env: str) -> None:
        self.home = home
        self.pg_port, self.kafka_port, self.dagster_port = free_port(), free_port(), free_port()
        env = dict(os.environ)
        env.update(
            OUTBOX_HOME=str(home),
            OUTBOX_DEV_PG_PORT=str(self.pg_port),
            OUTBOX_DEV_KAFKA_PORT=str(self.kafka_port),
            OUTBOX_DEV_DAGSTER_PORT=str(self.dagster_port),
            OUTBOX_DEMO_RATE="50",
            **extra_env,
        )
        self.log = open(home.parent / f"dev-{self.pg_port}.log", "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "outbox_pipeline.cli", "dev"],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.pg_port} user=postgres dbname=postgres connect_timeout=2"

    def wait_for(self, what: str, check: Callable[[], bool], deadline_s: float = 120.0) -> None:
        start = time.monotonic()
        while time.monotonic() - start < deadline_s:
            assert self.process.poll() is None, f"outbox dev exited early: {self.output()}"
            try:
                if check():
                    return
            except Exception:
                pass
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}: {self.output()}")

    def pending_rows(self) -> int:
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute("SELECT count(*) FROM outbox.outbox_messages").fetchone()
            return int(row[0]) if row else 0

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def interrupt(self) -> int:
        os.killpg(self.process.pid, signal.SIGINT)
        return self.process.wait(timeout=120)


@pytest.fixture
def dev_home(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "outbox-home"
    yield home
    # Safety net for a failed test: stop whatever is still running from this home.
    pidfile = home / "pg" / "postmaster.pid"
    if pidfile.exists():
        subprocess.run(["pkill", "-f", str(home)], check=False)


def test_dev_runs_the_stack_with_demo_traffic_and_ctrl_c_leaves_no_process(dev_home: Path) -> None:
    run = DevRun(dev_home)
    run.wait_for("demo traffic in the outbox table", lambda: run.pending_rows() > 20)
    run.wait_for("dagster dev to answer GraphQL", lambda: "data" in _graphql(run.dagster_port, "{ version }"))
    assert listening_hosts(run.dagster_port) == {LOOPBACK}, "dagster dev must bind 127.0.0.1 only"
    assert listening_hosts(run.pg_port) == {LOOPBACK} and listening_hosts(run.kafka_port) == {LOOPBACK}
    started = _descendants(run.process.pid)
    postmaster = int((dev_home / "pg" / "postmaster.pid").read_text().split()[0])
    started.add(postmaster)

    assert run.interrupt() == 0, run.output()
    assert "outbox dev stopped." in run.output()
    still_running = {pid: _cmdline(pid) for pid in started if _alive(pid)}
    assert still_running == {}, f"orphans left behind: {still_running}"
    assert not (dev_home / "pg" / "postmaster.pid").exists()
    assert list((dev_home / "run").glob("*.pid")) == []


def test_dev_can_run_apache_kafka_instead_of_tansu_and_says_so_and_ctrl_c_leaves_no_process(dev_home: Path) -> None:
    run = DevRun(dev_home, OUTBOX_DEV_BROKER="kafka")
    run.wait_for("the stack to be up", lambda: "outbox dev is up" in run.output(), deadline_s=300)
    if "running on Tansu instead" in run.output():
        pytest.skip(f"Apache Kafka cannot be installed here: {run.output()}")
    assert f"Kafka       127.0.0.1:{run.kafka_port} (Apache Kafka, KRaft" in run.output()
    run.wait_for("demo traffic in the outbox table", lambda: run.pending_rows() > 5)
    broker = _cmdline(int((dev_home / "run" / "broker.pid").read_text().split()[0]))
    assert "kafka.Kafka" in broker
    started = _descendants(run.process.pid)

    assert run.interrupt() == 0, run.output()
    still_running = {pid: _cmdline(pid) for pid in started if _alive(pid)}
    assert still_running == {}, f"orphans left behind: {still_running}"


def test_dev_restarted_reuses_its_data(dev_home: Path) -> None:
    first = DevRun(dev_home)
    first.wait_for("demo traffic", lambda: first.pending_rows() > 5)
    with psycopg.connect(first.dsn) as conn:
        marker = conn.execute("SELECT message_id FROM outbox.outbox_messages ORDER BY id LIMIT 1").fetchone()
    assert first.interrupt() == 0, first.output()

    second = DevRun(dev_home)
    second.wait_for("the stack to be up again", lambda: "outbox dev is up" in second.output())
    with psycopg.connect(second.dsn) as conn:
        found = conn.execute(
            "SELECT count(*) FROM outbox.outbox_messages WHERE message_id = %s", (marker[0] if marker else None,)
        ).fetchone()
    assert second.interrupt() == 0, second.output()
    assert found == (1,)


def _run_statuses(port: int) -> list[str]:
    data = _graphql(port, "{ runsOrError { ... on Runs { results { status } } } }")["data"]
    return [str(run["status"]) for run in data["runsOrError"]["results"]]


def test_ctrl_c_cancels_the_relay_run_so_the_next_start_shows_no_failed_run(dev_home: Path) -> None:
    """Ctrl-C is an operator's stop, not a crash: the long-lived relay run ends canceled, asked through Dagster before
    `dagster dev` gets its SIGINT. Interrupted instead, it was a failed run at every restart, retried by the daemon
    and counted by the failure alert."""
    first = DevRun(dev_home)
    first.wait_for("a relay run in progress", lambda: "STARTED" in _run_statuses(first.dagster_port), deadline_s=240.0)
    assert first.interrupt() == 0, first.output()

    second = DevRun(dev_home)
    second.wait_for("dagster dev to answer GraphQL", lambda: "data" in _graphql(second.dagster_port, "{ version }"))
    statuses = _run_statuses(second.dagster_port)
    assert second.interrupt() == 0, second.output()
    assert "FAILURE" not in statuses and "CANCELED" in statuses, statuses


def test_dev_with_a_taken_port_says_which_variable_to_change(dev_home: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = dict(os.environ, OUTBOX_HOME=str(dev_home), OUTBOX_DEV_KAFKA_PORT=str(taken.getsockname()[1]))
        result = subprocess.run(
            [sys.executable, "-m", "outbox_pipeline.cli", "dev", "--no-dagster"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1
    assert "already in use" in result.stderr and "OUTBOX_DEV_KAFKA_PORT" in result.stderr


def test_a_stale_pid_file_stops_only_the_process_it_named_never_one_that_reused_its_pid(tmp_path: Path) -> None:
    """Issue 40, case 30: a pid file of an earlier run was trusted on the pid and a word in the command line, so a
    reused pid (another dagster, say) had its process group signalled."""
    settings = DevSettings(home=tmp_path, project_dir=tmp_path)
    settings.run_dir.mkdir(parents=True)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)  # dagster"]
    ours = subprocess.Popen(sleeper, start_new_session=True)
    reused = subprocess.Popen(sleeper, start_new_session=True)
    try:
        _write_pid(settings.run_dir / "ours.pid", ours.pid)
        # What a pid file of a process long gone looks like when the pid now belongs to another: its start differs.
        (settings.run_dir / "reused.pid").write_text(f"{reused.pid} 1")

        _reap_stale(settings)

        assert ours.wait(10) == -signal.SIGTERM
        assert reused.poll() is None  # left alone
        assert list(settings.run_dir.glob("*.pid")) == []
    finally:
        for process in (ours, reused):
            process.kill()
            process.wait()
