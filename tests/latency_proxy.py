"""A TCP proxy on loopback that delays everything a client sends by a fixed time.

For tests of behaviour against a slow API server: every byte from the client reaches the
server ``delay`` seconds after it was sent (in order); answers come back at once. A
request on an open connection therefore takes ``delay`` longer; a new TLS connection
takes ``delay`` for its handshake and ``delay`` again for its first request (the
client's first flight and its first request are each held back once).
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from types import TracebackType


class LatencyProxy:
    """``with LatencyProxy(("127.0.0.1", port), 1.5) as proxy:`` then connect to
    ``proxy.port``. Stops accepting and closes every connection on exit."""

    def __init__(self, upstream: tuple[str, int], delay: float) -> None:
        self.upstream = upstream
        self.delay = delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def __enter__(self) -> LatencyProxy:
        threading.Thread(target=self._accept, name="latency-proxy", daemon=True).start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            held: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
            for target, args in ((self._hold, (client, held)), (self._release, (held, server)),
                                 (self._pass, (server, client))):
                threading.Thread(target=target, args=args, daemon=True).start()

    def _hold(self, source: socket.socket, held: queue.SimpleQueue[tuple[float, bytes]]
              ) -> None:
        """Client to server, first leg: stamp each chunk with when it may go on."""
        try:
            while chunk := source.recv(65536):
                held.put((time.monotonic() + self.delay, chunk))
        except OSError:
            pass
        held.put((time.monotonic() + self.delay, b""))

    def _release(self, held: queue.SimpleQueue[tuple[float, bytes]], sink: socket.socket
                 ) -> None:
        """Client to server, second leg: send each chunk when its time has come."""
        try:
            while True:
                due, chunk = held.get()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not chunk:
                    sink.shutdown(socket.SHUT_WR)
                    return
                sink.sendall(chunk)
        except OSError:
            pass

    def _pass(self, source: socket.socket, sink: socket.socket) -> None:
        """Server to client: at once."""
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass
