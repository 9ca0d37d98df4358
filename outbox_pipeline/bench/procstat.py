"""CPU seconds of other processes, read from /proc (Linux). See docs/performance.md#how-a-bulk-run-is-measured."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def _fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def parent_pid(pid: int) -> int | None:
    """The parent of a process on this machine (of a PostgreSQL backend: the postmaster); None if not visible."""
    fields = _fields(pid)
    return int(fields[1]) if fields is not None else None


def process_cpu_s(pid: int, *, with_reaped_children: bool = False) -> float:
    """utime + stime of ``pid`` (all threads); plus children it has reaped, if asked."""
    fields = _fields(pid)
    if fields is None:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if with_reaped_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _TICKS


def wait_for_client_backends_to_end(root: int, timeout_s: float = 10.0) -> None:
    """Ended backends count once the postmaster has reaped them; wait for that before reading."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        children = [
            _cmdline(int(stat.parent.name))
            for stat in Path("/proc").glob("[0-9]*/stat")
            if (fields := _fields(int(stat.parent.name))) is not None and int(fields[1]) == root
        ]
        if not any(b"127.0.0.1(" in cmd or b"[local]" in cmd for cmd in children):
            return
        time.sleep(0.05)  # polling /proc: no event tells us another process's child was reaped


def _cmdline(pid: int) -> bytes:
    """Its command line; empty once it has ended (a backend may end between listing and reading: ESRCH)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def tree_cpu_s(root: int) -> float:
    """A server's CPU: the root (with the children it reaped, e.g. ended backends) plus live children."""
    total = process_cpu_s(root, with_reaped_children=True)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _fields(int(stat.parent.name))
        if fields is not None and int(fields[1]) == root:
            total += process_cpu_s(int(stat.parent.name))
    return total


def own_cpu_s() -> float:
    """This process's CPU so far, every thread's (a producer's librdkafka threads too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def own_peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM). Not ``ru_maxrss``: Linux keeps that across execve, so a
    spawned worker would report its parent's peak (the bench process after a verify) as its own."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat: the whole machine, every process."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def busy_cores(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Average cores busy between two machine_busy() readings."""
    total = after[1] - before[1]
    return (os.cpu_count() or 1) * (after[0] - before[0]) / total if total > 0 else 0.0


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""
