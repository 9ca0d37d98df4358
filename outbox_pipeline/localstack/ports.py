"""TCP port helpers for the local servers, so a port race fails fast with a message that names the port. See
docs/dagster.md#the-local-stack-outbox-dev."""

from __future__ import annotations

import errno
import socket
import time


class LocalStackError(RuntimeError):
    """A local dev/test server could not be started, reached or stopped."""


class PortInUseError(LocalStackError):
    """The port a local server must listen on is already taken by another process."""


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str = "127.0.0.1") -> int:
    """Return a port the kernel just considered free on `host` (tests use it to avoid fixed ports)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def ensure_port_free(host: str, port: int, what: str, *, hint: str = "") -> None:
    """Raise PortInUseError if `host:port` cannot be bound for listening.

    SO_REUSEADDR mirrors what the servers themselves do, so connections of a just-stopped server lingering
    in TIME_WAIT do not count as "in use" (a restart on the same port must pass this check).
    """
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            suffix = f" ({hint})" if hint else ""
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(f"cannot start {what}: {host}:{port} is already in use{suffix}") from exc
            raise LocalStackError(f"cannot start {what}: cannot bind {host}:{port}: {exc}{suffix}") from exc


def wait_for_tcp(host: str, port: int, deadline_s: float) -> None:
    """Poll until `host:port` accepts a TCP connection; give up `deadline_s` seconds from now.

    Why: a process being alive does not mean its listener is up; callers need the listener.
    """
    deadline = time.monotonic() + deadline_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, remaining))):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise LocalStackError(
                    f"{host}:{port} did not accept TCP connections within {deadline_s:.1f}s (last error: {exc})"
                ) from exc
        time.sleep(0.05)
