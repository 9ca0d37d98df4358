"""`outbox dev` runs PostgreSQL, the broker, demo traffic and `dagster dev` together, and stops them in reverse order on
Ctrl-C. See docs/dagster.md#the-local-stack-outbox-dev."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import psycopg

from .. import settings as catalogue
from ..config import OutboxTable
from ..store.schema import init_db, set_topic_partitions
from .broker import Broker, BrokerSpec
from .dagster_runs import cancel_runs
from .demo import DEMO_TOPICS
from .kafka_broker import local_broker
from .ports import LocalStackError, PortInUseError, ensure_port_free
from .postgres import LocalPostgres, PostgresSpec

log = logging.getLogger(__name__)

DEMO_PARTITIONS = 4
DEV_STRATEGY = "partitioned"  # recorded in a new dev outbox unless OUTBOX_RELAY_STRATEGY names another


@dataclass(frozen=True)
class DevSettings:
    home: Path
    project_dir: Path
    pg_port: int = catalogue.DEV_PG_PORT.default
    kafka_port: int = catalogue.DEV_KAFKA_PORT.default
    dagster_port: int = catalogue.DEV_DAGSTER_PORT.default
    traffic_rate: float = catalogue.DEMO_RATE.default
    with_dagster: bool = True
    broker: str = catalogue.DEV_BROKER.default
    table: OutboxTable = field(default_factory=OutboxTable)

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, with_dagster: bool = True, traffic_rate: float | None = None
    ) -> DevSettings:
        env = os.environ if env is None else env
        project = Path(catalogue.PROJECT_DIR.read(env) or os.getcwd()).resolve()
        return cls(
            home=(project / catalogue.HOME.read(env)).resolve(),
            project_dir=project,
            pg_port=catalogue.DEV_PG_PORT.read(env),
            kafka_port=catalogue.DEV_KAFKA_PORT.read(env),
            dagster_port=catalogue.DEV_DAGSTER_PORT.read(env),
            traffic_rate=traffic_rate if traffic_rate is not None else catalogue.DEMO_RATE.read(env),
            with_dagster=with_dagster,
            broker=catalogue.DEV_BROKER.read(env),
            table=OutboxTable.from_env(env),
        )

    @property
    def dagster_home(self) -> Path:
        return self.home / "dagster_home"

    @property
    def run_dir(self) -> Path:
        return self.home / "run"


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[bytes]
    pid_file: Path
    stop_signal: int = signal.SIGTERM
    grace_s: float = 15.0

    def stop(self) -> None:
        if self.process.poll() is None:
            log.info("stopping %s (pid %d)", self.name, self.process.pid)
            _signal_group(self.process.pid, self.stop_signal)
            try:
                self.process.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing it", self.name, self.grace_s)
                _signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # The leader may exit before its own children (dagster dev's code server shuts down on a
        # heartbeat timeout): stop what is left of the process group, then make sure it is gone.
        if group_members(self.process.pid):
            _signal_group(self.process.pid, signal.SIGTERM)
            if not wait_group_gone(self.process.pid, self.grace_s):
                _signal_group(self.process.pid, signal.SIGKILL)
                wait_group_gone(self.process.pid, self.grace_s)
        self.pid_file.unlink(missing_ok=True)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in a process group, read from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            members.append(int(stat.parent.name))
    return members


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)  # polling /proc for exit: there is no event to wait on for non-children
    return True


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _restore_default_signals() -> None:
    # A shell that started us non-interactively may have set SIGINT/SIGTERM to "ignore", and
    # children inherit that; dagster dev would then ignore our stop request.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _spawn(
    name: str, argv: list[str], env: Mapping[str, str], settings: DevSettings, *, stop_signal: int = signal.SIGTERM
) -> _Child:
    log_path = settings.home / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        process = subprocess.Popen(
            argv,
            env=dict(env),
            cwd=settings.project_dir,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_restore_default_signals,
        )
    pid_file = settings.run_dir / f"{name}.pid"
    _write_pid(pid_file, process.pid)
    log.info("started %s (pid %d), log: %s", name, process.pid, log_path)
    return _Child(name, process, pid_file, stop_signal)


def _start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/<pid>/stat): with the pid, names one process for ever."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return int(fields[19])  # the 22nd field of stat; the first two (pid, comm) are cut off with the ")"
    except (OSError, ValueError, IndexError):
        return None


def _write_pid(pid_file: Path, pid: int) -> None:
    pid_file.write_text(f"{pid} {_start_ticks(pid)}")


def _reap_stale(settings: DevSettings) -> None:
    """Stop children left behind by a supervisor that died without cleaning up.

    Only the very process each pid file names, and only as the leader of its own group (as started): a pid that
    was reused since (by anything, ours or not, the same start time never comes back) is left alone, and so is
    its group."""
    for pid_file in settings.run_dir.glob("*.pid"):
        try:
            pid_text, _, started = pid_file.read_text().strip().partition(" ")
            pid = int(pid_text)
            if not started or started == "None" or _start_ticks(pid) != int(started) or os.getpgid(pid) != pid:
                raise ProcessLookupError  # not the process that was started, or no longer leading its group
            os.killpg(pid, signal.SIGTERM)
            log.warning("stopped %s left over from an earlier run (pid %d)", pid_file.stem, pid)
        except (ValueError, OSError):
            pass
        pid_file.unlink(missing_ok=True)


def _install_dagster_home(settings: DevSettings) -> None:
    settings.dagster_home.mkdir(parents=True, exist_ok=True)
    template = resources.files("outbox_pipeline.localstack").joinpath("dagster.yaml").read_text()
    (settings.dagster_home / "dagster.yaml").write_text(template)


def _broker_banner(name: str) -> str:
    if name == "Tansu":
        return f"Tansu, memory storage; {catalogue.DEV_BROKER.name}=kafka runs Apache Kafka"
    return f"{name}, KRaft, emptied at each start; {catalogue.DEV_BROKER.name}=tansu (the default) runs Tansu"


def run_dev(settings: DevSettings) -> int:
    """Run the whole local stack until SIGINT/SIGTERM; returns the exit code."""
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    _reap_stale(settings)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    pg = LocalPostgres(PostgresSpec(data_dir=settings.home / "pg", port=settings.pg_port))
    # Apache Kafka starts empty each time, as Tansu's memory storage does: the demo needs no old records.
    kafka_data = settings.home / "kafka-dev"
    shutil.rmtree(kafka_data, ignore_errors=True)
    spec = BrokerSpec(port=settings.kafka_port, log_path=settings.home / "logs" / "broker.log")
    broker = local_broker(settings.broker, spec, kafka_data, settings.home)
    children: list[_Child] = []
    try:
        _start_servers(settings, pg, broker)
        _start_children(settings, pg, broker, children)
        _print_banner(settings, pg, broker)
        _watch(settings, children, stop)
        return 0
    except PortInUseError as exc:
        hint = "" if "OUTBOX_DEV_" in str(exc) else f" (set {catalogue.DEV_PG_PORT.name} to use another port)"
        print(f"error: {exc}{hint}", file=sys.stderr)
        return 1
    except LocalStackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        _stop_all(settings, pg, broker, children)


def _start_servers(settings: DevSettings, pg: LocalPostgres, broker: Broker) -> None:
    """PostgreSQL and the broker started, the outbox made for the dev strategy and the demo topics created."""
    # The broker never outlives us, so its port must be free; PostgreSQL may still be running on our
    # data directory after a killed run (then it is reused), so its port is checked by start().
    ensure_port_free("127.0.0.1", settings.kafka_port, "the broker", hint=f"set {catalogue.DEV_KAFKA_PORT.name}")
    if settings.with_dagster:
        ensure_port_free(
            "127.0.0.1", settings.dagster_port, "dagster dev", hint=f"set {catalogue.DEV_DAGSTER_PORT.name}"
        )
    pg.start()
    broker.start()
    if broker.pid is not None:
        _write_pid(settings.run_dir / "broker.pid", broker.pid)
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        # The strategy the Dagster runs relay with, recorded in the outbox, and only its indexes (each costs every
        # write).
        init_db(conn, settings.table, strategies=[catalogue.RELAY_STRATEGY.read() or DEV_STRATEGY])
        for topic in DEMO_TOPICS:
            set_topic_partitions(conn, settings.table, topic, DEMO_PARTITIONS)
    broker.create_topics(DEMO_TOPICS, partitions=DEMO_PARTITIONS)


def _start_children(settings: DevSettings, pg: LocalPostgres, broker: Broker, children: list[_Child]) -> None:
    """Demo traffic and (with Dagster) ``dagster dev``, each appended to ``children`` as soon as it runs, so that
    whatever started is stopped even if a later one fails to."""
    env = dict(os.environ)
    env.update(
        OUTBOX_PG_DSN=pg.dsn,
        KAFKA_BOOTSTRAP_SERVERS=broker.bootstrap_servers,
        OUTBOX_SCHEMA=settings.table.schema,
        DAGSTER_HOME=str(settings.dagster_home),
    )
    outbox_cli = [sys.executable, "-m", "outbox_pipeline.cli"]
    children.append(
        _spawn("demo-traffic", [*outbox_cli, "demo-traffic", "--rate", str(settings.traffic_rate)], env, settings)
    )
    if settings.with_dagster:
        _install_dagster_home(settings)
        dagster = shutil.which("dagster", path=str(Path(sys.executable).parent)) or "dagster"
        argv = [dagster, "dev", "-h", "127.0.0.1", "-p", str(settings.dagster_port), "-w", "workspace.yaml"]
        children.append(_spawn("dagster", argv, env, settings, stop_signal=signal.SIGINT))


def _print_banner(settings: DevSettings, pg: LocalPostgres, broker: Broker) -> None:
    """Where everything runs, once it all started: what a developer connects to."""
    print(
        "\noutbox dev is up:\n"
        f"  PostgreSQL  {pg.dsn}\n"
        f"  Kafka       {broker.bootstrap_servers} ({_broker_banner(broker.name)})\n"
        + (f"  Dagster UI  http://127.0.0.1:{settings.dagster_port}\n" if settings.with_dagster else "")
        + f"  demo traffic {settings.traffic_rate:g} msg/s to {', '.join(DEMO_TOPICS)}\n"
        f"  logs        {settings.home / 'logs'}\n"
        "Press Ctrl-C to stop everything.\n",
        flush=True,
    )


def _watch(settings: DevSettings, children: list[_Child], stop: threading.Event) -> None:
    """Until ``stop`` is set (a signal), checking every second that no child exited: one that did ends the stack."""
    while not stop.wait(1.0):
        for child in children:
            if child.process.poll() is not None:
                raise LocalStackError(
                    f"{child.name} exited with code {child.process.returncode}; "
                    f"see {settings.home / 'logs' / (child.name + '.log')}"
                )


def _stop_all(settings: DevSettings, pg: LocalPostgres, broker: Broker, children: list[_Child]) -> None:
    """Dagster's runs cancelled (an operator's stop), then the children, the broker and PostgreSQL stopped."""
    if settings.with_dagster and any(c.name == "dagster" and c.process.poll() is None for c in children):
        cancel_runs(settings.dagster_port, timeout_s=30.0)  # an operator's stop, not a crash (dagster_runs.py)
    for child in reversed(children):
        child.stop()
    broker.stop()
    (settings.run_dir / "broker.pid").unlink(missing_ok=True)
    # The data directory is ours: stop the server even if an earlier, killed run started it.
    pg.stop("fast", force=True)
    print("outbox dev stopped.", flush=True)
