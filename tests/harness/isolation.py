"""The kit's TCP proxy (tests/kit/tcp_proxy.py) with one more fault: cut one process off from the broker while every
other client keeps its connections. The broker advertises the proxy, so every client of the run talks to Kafka
through it; a connection belongs to the process whose socket is its other end (read from /proc).

``isolate(pid)`` shuts down that process's live connections; a connection it opens meanwhile is shut as soon as it is
accepted (the client sees it closed at once, as a network that drops it). ``rejoin(pid)`` ends that.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

from tests.kit.tcp_proxy import TcpProxy, _shutdown


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _client_ports(pid: int, server_port: int) -> set[int]:
    """Local ports of ``pid``'s TCP sockets connected to ``server_port`` on this host (IPv4)."""
    inodes = _socket_inodes(pid)
    ports = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, inode = fields[1], fields[2], int(fields[9])
        if inode in inodes and int(remote.rsplit(":", 1)[1], 16) == server_port:
            ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


class SelectiveProxy(TcpProxy):
    def __init__(self, target_port: int, **kwargs: object) -> None:
        super().__init__(target_port, **kwargs)  # type: ignore[arg-type]
        self._isolated: set[int] = set()
        self._clients: dict[socket.socket, int] = {}  # accepted socket -> its peer's port
        self._guard = threading.Lock()

    def isolate(self, pid: int) -> int:
        """Cut ``pid`` off; returns how many live connections it had."""
        with self._guard:
            self._isolated.add(pid)
            ports = _client_ports(pid, self.port)
            victims = [s for s, port in self._clients.items() if port in ports]
        for sock in victims:
            _shutdown(sock)
        return len(victims)

    def rejoin(self, pid: int) -> None:
        with self._guard:
            self._isolated.discard(pid)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        client = src if _local_port(src) == self.port else None
        if client is not None:
            peer = _peer_port(client)
            with self._guard:
                self._clients[client] = peer
                cut = any(peer in _client_ports(pid, self.port) for pid in self._isolated)
            if cut:
                _shutdown(src)
                _shutdown(dst)
        try:
            super()._pump(src, dst)
        finally:
            if client is not None:
                with self._guard:
                    self._clients.pop(client, None)


def _local_port(sock: socket.socket) -> int | None:
    try:
        return int(sock.getsockname()[1])
    except OSError:
        return None


def _peer_port(sock: socket.socket) -> int:
    try:
        return int(sock.getpeername()[1])
    except OSError:
        return -1
