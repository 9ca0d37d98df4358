"""A loopback TCP proxy the fault tests cut and restore: the network between the relay and the broker.

One acceptor thread plus two pump threads per live connection (blocking sockets, so backpressure is
free), at most ``max_connections`` connections at a time. ``cut()`` closes the listening socket (new
connections are refused: ECONNREFUSED, like a host that went away) and shuts down every live
connection in both directions; ``restore()`` listens again on the same port. ``close()`` stops everything
and joins every thread it started.
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType

_ACCEPT_POLL_S = 0.1
_CHUNK = 65536
_JOIN_TIMEOUT_S = 5.0


class TcpProxy:
    def __init__(self, target_port: int, *, host: str = "127.0.0.1", port: int = 0, max_connections: int = 64) -> None:
        self.host = host
        self.target = (host, target_port)
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        # Sockets whose peer pump has finished (the pump reading from them closes the pair).
        self._finishing: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._stopped = threading.Event()
        self._acceptor: threading.Thread | None = None
        self.accepted = 0
        self.rejected = 0
        self.cuts = 0
        self.port = port
        self._listen()
        assert self._listener is not None
        self.port = self._listener.getsockname()[1]

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> TcpProxy:
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"tcp-proxy-{self.port}", daemon=True)
        self._acceptor.start()
        return self

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def is_cut(self) -> bool:
        with self._lock:
            return self._listener is None

    @property
    def live_connections(self) -> int:
        with self._lock:
            return len(self._connections) // 2

    def cut(self) -> None:
        """Refuse new connections and break every live one, now (both directions)."""
        with self._lock:
            listener, self._listener = self._listener, None
            connections = list(self._connections)
            self.cuts += 1
        if listener is not None:
            # shutdown() first: close() alone leaves the socket listening while the acceptor thread still
            # polls it, and a connection arriving meanwhile would be queued instead of refused.
            _shutdown(listener)
            listener.close()
        for sock in connections:
            _shutdown(sock)

    def restore(self) -> None:
        """Accept connections again, on the same port."""
        if not self.is_cut:
            return
        self._listen()

    def close(self) -> None:
        self._stopped.set()
        self.cut()
        if self._acceptor is not None:
            self._acceptor.join(_JOIN_TIMEOUT_S)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(_JOIN_TIMEOUT_S)
        alive = [t.name for t in threads if t.is_alive()]
        if self._acceptor is not None and self._acceptor.is_alive():
            alive.append(self._acceptor.name)
        if alive:
            raise RuntimeError(f"tcp proxy threads did not stop: {alive}")

    # -- internals -------------------------------------------------------------------------------

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.host, self.port))
            listener.listen(self.max_connections)
            listener.settimeout(_ACCEPT_POLL_S)
        except BaseException:
            listener.close()
            raise
        with self._lock:
            self._listener = listener

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            with self._lock:
                listener = self._listener
            if listener is None:
                self._stopped.wait(_ACCEPT_POLL_S)
                continue
            try:
                client, _ = listener.accept()
            except (TimeoutError, OSError):  # timeout, or the listener was closed by cut()
                continue
            with self._lock:
                refuse = self._listener is not listener or len(self._connections) // 2 >= self.max_connections
            if refuse:
                self.rejected += 1
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2.0)
            except OSError:
                self.rejected += 1
                client.close()
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # cut while we were connecting upstream
                    client.close()
                    upstream.close()
                    continue
                self.accepted += 1
                self._connections.update((client, upstream))
                for src, dst in ((client, upstream), (upstream, client)):
                    thread = threading.Thread(target=self._pump, args=(src, dst), daemon=True)
                    self._threads.add(thread)
                    thread.start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            # One direction ended: end the other one too. The second pump of the pair to finish closes
            # both sockets (closing earlier could hand a reused descriptor to the other pump).
            _shutdown(src)
            _shutdown(dst)
            with self._lock:
                self._threads.discard(threading.current_thread())
                last = src in self._finishing
                if last:
                    self._finishing.discard(src)
                    self._connections.discard(src)
                    self._connections.discard(dst)
                else:
                    self._finishing.add(dst)
            if last:
                src.close()
                dst.close()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
