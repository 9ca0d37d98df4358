"""Whether a connection reaches its PostgreSQL backend directly, told from the socket itself, because session liveness
is sound only then. See docs/operations.md#crashed-workers."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

import psycopg


@dataclass(frozen=True)
class ConnectionPath:
    """What the two ends of one connection say about each other."""

    direct: bool
    reason: str


def connection_path(conn: psycopg.Connection) -> ConnectionPath:
    """Whether ``conn`` is verifiably a direct connection to its backend, and why (for the log)."""
    row = conn.execute("SELECT host(inet_client_addr()), inet_client_port(), pg_backend_pid()").fetchone()
    assert row is not None
    server_sees_host, server_sees_port, backend_pid = row
    with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
        if sock.family == socket.AF_UNIX:
            return _unix_path(sock, server_sees_host, backend_pid)
        local_host, local_port = sock.getsockname()[:2]
    if server_sees_host is None:
        return ConnectionPath(
            False, f"this worker uses TCP ({local_host}:{local_port}) but the server sees a Unix socket"
        )
    same = server_sees_port == local_port and _same_address(server_sees_host, local_host)
    seen = f"the server sees this connection from {server_sees_host}:{server_sees_port}"
    if same:
        return ConnectionPath(True, f"{seen}, this worker's own address")
    return ConnectionPath(False, f"{seen}, not from this worker's {local_host}:{local_port}")


def _same_address(a: str, b: str) -> bool:
    left, right = ipaddress.ip_address(a), ipaddress.ip_address(b)
    left = getattr(left, "ipv4_mapped", None) or left
    right = getattr(right, "ipv4_mapped", None) or right
    return left == right


def _unix_path(sock: socket.socket, server_sees_host: str | None, backend_pid: int) -> ConnectionPath:
    if server_sees_host is not None:
        return ConnectionPath(False, f"this worker uses a Unix socket but the server sees TCP from {server_sees_host}")
    peercred = getattr(socket, "SO_PEERCRED", None)
    if peercred is None:
        return ConnectionPath(False, "a Unix socket whose peer this platform cannot name (no SO_PEERCRED)")
    peer_pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, peercred, struct.calcsize("3i")))[0]
    parent = _parent_pid(backend_pid)
    if parent is None:
        return ConnectionPath(False, f"a Unix socket; backend {backend_pid} is not visible to this worker")
    if parent == peer_pid:
        return ConnectionPath(
            True, f"a Unix socket to the postmaster (pid {peer_pid}) that forked backend {backend_pid}"
        )
    return ConnectionPath(False, f"a Unix socket to pid {peer_pid}, not to the postmaster of backend {backend_pid}")


def _parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` from /proc (None where there is no such process here, or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ")".
    return int(stat.rsplit(")", 1)[1].split()[1])
