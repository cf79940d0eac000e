"""A TCP proxy on loopback that the infrastructure drills put between a replica and a server.

It can **delay** everything a client sends by a fixed time, changeable while it runs:
every byte from the client reaches the server ``delay`` seconds after it was sent (in
order); answers come back at once. A request on an open connection therefore takes
``delay`` longer; a new TLS connection takes ``delay`` for its handshake and ``delay``
again for its first request (the client's first flight and its first request are each
held back once).

It can **cut** the path (:meth:`FaultProxy.cut`): a black hole, as a network partition
is. Bytes in either direction are dropped, new connections are accepted and then hear
nothing, so clients see timeouts, not refusals. :meth:`FaultProxy.heal` closes every
connection that lived through the cut (their streams lost bytes; a real partition ends
the same way once the peers' retransmissions time out) and lets new ones through.

It speaks TCP only, so TLS passes end to end (the servers' certificates name
127.0.0.1, where the proxy listens). The drills that use it are in
:mod:`neonvm.drills.infra`; see docs/drills.md, "Infrastructure drills".
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType


@dataclass(eq=False)
class _Link:
    """One client connection and, unless it was opened during a cut, its upstream."""

    client: socket.socket
    server: socket.socket | None
    doomed: bool = False
    """Lived through a cut: drops everything, closed at the heal."""
    closed: threading.Event = field(default_factory=threading.Event)

    def close(self) -> None:
        self.closed.set()
        for s in (self.client, self.server):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()


class FaultProxy:
    """``with FaultProxy(("127.0.0.1", port)) as proxy:`` then connect to ``proxy.port``;
    ``proxy.delay = 1.5`` slows it, ``proxy.cut()`` / ``proxy.heal()`` partition it.
    Stops accepting and closes every connection on exit."""

    def __init__(self, upstream: tuple[str, int], delay: float = 0.0) -> None:
        self.upstream = upstream
        self.delay = delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._cut = False
        self._links: set[_Link] = set()
        self._lock = threading.Lock()
        self.connections = 0
        """Connections accepted so far."""

    @property
    def is_cut(self) -> bool:
        return self._cut

    def __enter__(self) -> FaultProxy:
        threading.Thread(target=self._accept, name="fault-proxy", daemon=True).start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            links, self._links = list(self._links), set()
        for link in links:
            link.close()

    def cut(self) -> None:
        """Partition: from now on every byte is dropped, both ways (module docstring)."""
        with self._lock:
            self._cut = True
            for link in self._links:
                link.doomed = True

    def heal(self) -> None:
        """End the partition: connections that lived through it are closed."""
        with self._lock:
            self._cut = False
            doomed = [link for link in self._links if link.doomed]
            self._links -= set(doomed)
        for link in doomed:
            link.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            server: socket.socket | None = None
            if not self._cut:
                try:
                    server = socket.create_connection(self.upstream, timeout=10)
                    server.settimeout(None)
                except OSError:
                    client.close()
                    continue
            link = _Link(client, server, doomed=server is None)
            with self._lock:
                if self._cut:
                    link.doomed = True
                self._links.add(link)
            if server is None:
                threading.Thread(target=self._drain, args=(link,), daemon=True).start()
                continue
            held: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
            for target, args in ((self._hold, (link, held)), (self._release, (link, held)),
                                 (self._pass, (link,))):
                threading.Thread(target=target, args=args, daemon=True).start()

    def _drain(self, link: _Link) -> None:
        """A connection opened during a cut: read and drop until it is closed."""
        try:
            while link.client.recv(65536):
                pass
        except OSError:
            pass

    def _hold(self, link: _Link, held: queue.SimpleQueue[tuple[float, bytes]]) -> None:
        """Client to server, first leg: stamp each chunk with when it may go on."""
        try:
            while chunk := link.client.recv(65536):
                if not link.doomed:
                    held.put((time.monotonic() + self.delay, chunk))
        except OSError:
            pass
        held.put((time.monotonic() + self.delay, b""))

    def _release(self, link: _Link, held: queue.SimpleQueue[tuple[float, bytes]]) -> None:
        """Client to server, second leg: send each chunk when its time has come."""
        assert link.server is not None
        try:
            while True:
                due, chunk = held.get()
                wait = due - time.monotonic()
                if wait > 0 and link.closed.wait(wait):
                    return
                if not chunk:
                    link.server.shutdown(socket.SHUT_WR)
                    return
                if not link.doomed:
                    link.server.sendall(chunk)
        except OSError:
            pass

    def _pass(self, link: _Link) -> None:
        """Server to client: at once (dropped during a cut)."""
        assert link.server is not None
        try:
            while chunk := link.server.recv(65536):
                if not link.doomed:
                    link.client.sendall(chunk)
            link.client.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class LatencyProxy(FaultProxy):
    """A :class:`FaultProxy` with a fixed ``delay`` (the slow-API-server tests' name)."""

    def __init__(self, upstream: tuple[str, int], delay: float) -> None:
        super().__init__(upstream, delay)
