"""What a latency bench reads around its measured window besides latency: CPU per process group, and the relay's own
statements. See docs/performance.md#how-the-latency-bench-measures."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..procstat import busy_cores, machine_busy, process_cpu_s, tree_cpu_s
from ..runner import Servers

RELAY_ROLE = "bench_relay"
SESSION, SESSIONS = "relay session ", "relay's PostgreSQL sessions"


@dataclass(frozen=True)
class CpuReading:
    """Cumulative CPU seconds per group, and the machine's busy/total jiffies, at ``at`` (time.time())."""

    at: float
    groups: dict[str, float]
    machine: tuple[int, int]

    def cores(self, later: CpuReading) -> tuple[dict[str, float], float]:
        """Average cores per group between this reading and ``later``, and the machine's."""
        window = later.at - self.at
        groups: dict[str, float] = {SESSIONS: 0.0}
        for name, seconds in later.groups.items():
            if name.startswith(SESSION):  # a session that ended in the window reads 0 now: not counted
                if seconds >= self.groups.get(name, seconds + 1):
                    groups[SESSIONS] += (seconds - self.groups[name]) / window
            else:
                groups[name] = (seconds - self.groups.get(name, 0.0)) / window
        return groups, busy_cores(self.machine, later.machine)


@dataclass(frozen=True)
class Statements:
    """The relay role's top-level statements since the reset (None and ``why`` when they cannot be counted)."""

    calls: int | None
    top: tuple[tuple[int, str], ...] = ()
    why: str = ""


def with_local_pids(servers: Servers) -> Servers:
    """``servers`` with the PostgreSQL and broker pids filled in when they run on this machine and are readable."""
    postgres_pid, broker_pid = servers.postgres_pid, servers.broker_pid
    if postgres_pid is None:
        with psycopg.connect(servers.dsn, autocommit=True) as conn:
            backend = conn.execute("SELECT pg_backend_pid()").fetchone()
            postgres_pid = _parent(int(backend[0])) if backend else None
    if broker_pid is None:
        broker_pid = _listener(int(servers.bootstrap.split(",")[0].rsplit(":", 1)[1]))
    return replace(servers, postgres_pid=postgres_pid, broker_pid=broker_pid)


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None  # another machine (or container): no CPU group for it


def _listener(port: int) -> int | None:
    """The process with a socket listening on ``port`` (state 0A in /proc/net/tcp*)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) in inodes for fd in fd_dir.iterdir()):
                return int(fd_dir.parent.name)
        except OSError:
            continue
    return None


def read_cpu(servers: Servers, relay_groups: dict[str, float], relay_sessions: list[int], **others: int) -> CpuReading:
    """One reading: the relay's groups, its PostgreSQL sessions, the servers, and ``others`` (name -> pid)."""
    groups = dict(relay_groups)
    groups.update({f"{SESSION}{pid}": process_cpu_s(pid) for pid in relay_sessions})
    if servers.postgres_pid:
        groups["postgresql"] = tree_cpu_s(servers.postgres_pid)
    if servers.broker_pid:
        groups["broker"] = process_cpu_s(servers.broker_pid)
    for name, pid in others.items():
        groups[name] = process_cpu_s(pid)
    return CpuReading(time.time(), groups, machine_busy())


def relay_dsn(servers: Servers) -> tuple[str, str]:
    """A DSN for the relay's own role, created if missing (superuser: the bench's servers are throwaway), and why
    statements cannot be counted if it cannot log in with it (then the relay uses the bench's DSN)."""
    try:
        with psycopg.connect(servers.dsn, autocommit=True) as conn:
            if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (RELAY_ROLE,)).fetchone():
                conn.execute(sql.SQL("CREATE ROLE {} LOGIN SUPERUSER").format(sql.Identifier(RELAY_ROLE)))
        own = make_conninfo(servers.dsn, user=RELAY_ROLE)
        psycopg.connect(own).close()
        return own, ""
    except psycopg.Error as exc:
        user = conninfo_to_dict(servers.dsn).get("user", "the bench's role")
        return servers.dsn, f"the relay runs as {user} like the writers ({str(exc).strip().splitlines()[0]})"


def relay_sessions(dsn: str) -> list[int]:
    """The relay role's backends now (their CPU is the relay's share of PostgreSQL)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE usename = %s", (RELAY_ROLE,)).fetchall()
    return [int(r[0]) for r in rows]


def reset_statements(dsn: str) -> str:
    """'' once pg_stat_statements is reset, else why the relay's statements cannot be counted here."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("SELECT pg_stat_statements_reset()")
        except psycopg.Error as exc:
            return f"pg_stat_statements is not available ({str(exc).strip().splitlines()[0]})"
    return ""


def relay_statements(dsn: str, why_not: str, top: int = 5) -> Statements:
    """The relay role's top-level statement calls since the reset, and its ``top`` statements by calls."""
    if why_not:
        return Statements(None, why=why_not)
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            rows = conn.execute(
                """
                SELECT s.calls, regexp_replace(s.query, '\\s+', ' ', 'g')
                FROM pg_stat_statements s JOIN pg_roles r ON r.oid = s.userid
                WHERE r.rolname = %s AND s.toplevel ORDER BY s.calls DESC
                """,
                (RELAY_ROLE,),
            ).fetchall()
        except psycopg.Error as exc:
            return Statements(None, why=f"pg_stat_statements: {str(exc).strip().splitlines()[0]}")
    return Statements(sum(int(r[0]) for r in rows), tuple((int(c), str(q)[:140]) for c, q in rows[:top]))
