"""The relay as Dagster drives it, for `outbox bench --dagster --latency RATE ...`, with Dagster as a child process,
never imported. See docs/performance.md#how-the-latency-bench-measures."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

from ... import settings
from ...config import OutboxTable
from ...localstack.dagster_runs import graphql
from ...localstack.dev import group_members, wait_group_gone
from ...localstack.ports import free_port
from ..procstat import cmdline, process_cpu_s
from ..runner import Servers
from .relays import RelayCounters, wait_until_registered

START_TIMEOUT_S = 240.0  # dagster dev up, the sensor's first tick, the run launched and registered
_RUNS_QUERY = '{ runsOrError(filter: {pipelineName: "relay_stream"}) { ... on Runs { results { status } } } }'


def _group(command: str) -> str:
    if "dagster_webserver" in command:
        return "dagster webserver"
    if "dagster._daemon" in command:
        return "dagster daemon"
    if "multiprocessing" in command or "execute_run" in command:
        return "dagster runs"
    if "grpc" in command or "code-server" in command or " api " in command:
        return "dagster code server"
    return "dagster dev"


class DagsterRelay:
    """`dagster dev` with its lag sensor driving the relay, in its own process group."""

    name = "dagster"

    def __init__(self, strategy: str, project: Path | None = None) -> None:
        self.strategy = strategy
        self.project = (project or Path(settings.PROJECT_DIR.read() or os.getcwd())).resolve()
        if not (self.project / "workspace.yaml").exists():
            raise RuntimeError(
                f"no workspace.yaml in {self.project}: run from the project (or set {settings.PROJECT_DIR.name})"
            )
        self.port = free_port()
        self._home = tempfile.TemporaryDirectory(prefix="bench-dagster-")
        self._process: subprocess.Popen[bytes] | None = None
        self._seen: dict[int, tuple[str, float]] = {}

    def start(self, servers: Servers, table: OutboxTable) -> None:
        home = Path(self._home.name)
        template = resources.files("outbox_pipeline.localstack").joinpath("dagster.yaml").read_text()
        (home / "dagster.yaml").write_text(template)
        env = {
            **os.environ,
            "DAGSTER_HOME": str(home),
            settings.PG_DSN.name: servers.dsn,
            settings.SCHEMA.name: table.schema,
            "KAFKA_BOOTSTRAP_SERVERS": servers.bootstrap,
            settings.RELAY_STRATEGY.name: self.strategy,
        }
        dagster = shutil.which("dagster", path=str(Path(sys.executable).parent)) or "dagster"
        argv = [dagster, "dev", "-h", "127.0.0.1", "-p", str(self.port), "-w", "workspace.yaml"]
        with open(home / "dagster-dev.log", "wb") as log:
            self._process = subprocess.Popen(
                argv, cwd=self.project, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_until_registered(servers.dsn, table, START_TIMEOUT_S, self._process)

    def stop(self) -> None:
        """SIGINT to the group, as a terminal's Ctrl-C: the run stops after its batch and deregisters."""
        if self._process is not None:
            try:
                os.killpg(self._process.pid, signal.SIGINT)
                self._process.wait(timeout=60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            if not wait_group_gone(self._process.pid, 30.0):
                os.killpg(self._process.pid, signal.SIGKILL)
        self._home.cleanup()

    def cpu_s(self) -> dict[str, float]:
        """Per group, the CPU of every process of the stack seen so far (an ended run keeps its last reading)."""
        if self._process is not None:
            for pid in group_members(self._process.pid):
                self._seen[pid] = (_group(cmdline(pid)), process_cpu_s(pid))
        groups: dict[str, float] = {}
        for group, seconds in self._seen.values():
            groups[group] = groups.get(group, 0.0) + seconds
        return groups

    def counters(self) -> RelayCounters | None:
        """The relay runs inside Dagster's run process: no metrics port of its own here."""
        return None

    def runs(self) -> tuple[int, int] | None:
        results = graphql(self.port, _RUNS_QUERY)["data"]["runsOrError"]["results"]  # type: ignore[index]
        return len(results), sum(1 for run in results if run["status"] == "QUEUED")
