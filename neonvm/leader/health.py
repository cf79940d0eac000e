"""A small HTTP server for probes and metrics: ``/healthz``, ``/readyz``, ``/metrics``.

Reusable by anything that runs as a long-lived process (the controller registers the
elector's check and its own). Checks follow the Kubernetes ``healthz`` convention: a check
is a function that returns normally when healthy and raises when not; the exception's
message is the reason shown. ``/healthz`` runs the liveness checks, ``/readyz`` the
readiness checks, ``/healthz/<name>`` and ``/readyz/<name>`` one check, and ``?verbose``
lists every check. ``/metrics`` serves the caller's own ``CollectorRegistry`` (never the
global one, so several servers and electors can live in one process, as in tests).

What it guarantees: each request runs the checks afresh (no caching; ``/metrics`` is
rendered at most once per :data:`METRICS_TTL`). Any pod can reach the port, so no
``/metrics`` client can starve the probes (a ``/healthz`` flood shares their lane:
docs/reconciler.md, "Running it"): one thread reads every connection's request with a selector (an
idle or slow connection costs a socket, not a thread) and closes it if the request has
not arrived within ``read_timeout`` or is larger than :data:`MAX_HEAD`; beyond
``max_connections`` the oldest connection still being read is closed, or else the
oldest ``/metrics`` (or other non-probe) request still waiting for a worker; a fixed
pool of ``workers`` threads answers complete requests, probes (``/healthz``, ``/readyz``
and their checks) first, then the rest oldest first, one per connection
(``Connection: close``), and one more thread answers probes only, so no queue of
``/metrics`` requests is ever ahead of a probe; a worker gives up on a client that does
not read the answer within ``read_timeout``. A request whose handling raises costs its own
connection only (closed, logged at warning with its peer), never a thread. What it does
not: a check that blocks forever keeps a worker forever; keep checks cheap and bounded.
docs/reconciler.md, "Running it".
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

from loguru import logger
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.registry import CollectorRegistry


def add_process_collectors(registry: CollectorRegistry) -> CollectorRegistry:
    """Register the process (``process_*``: CPU, RSS, open file descriptors, start
    time), platform (``python_info``) and garbage collector (``python_gc_*``) collectors
    on ``registry``, as the global registry has them; returns ``registry``."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


HealthCheck = Callable[[], None]
"""Returns when healthy; raises (any exception, with a reason as message) when not."""

MAX_HEAD = 8192
"""The largest request head (request line and headers) read; a larger one is refused."""
TEXT = "text/plain; charset=utf-8"
STUCK_AFTER = 30.0
"""How long the selector may go without a whole turn (seconds, real time) before
:meth:`_Listener.dead_threads` names it: a healthy one turns at least once a second."""
METRICS_TTL = 1.0
"""How long a rendered ``/metrics`` body is served again (seconds): one render per
second at most, whatever the number of scrapers."""
ACCEPTS_PER_TURN = 64
"""Connections accepted per turn of the selector at most: a flood of new connections
waits in the kernel's backlog instead of stopping every read."""


@dataclass(frozen=True)
class _Registered:
    name: str
    check: HealthCheck
    liveness: bool
    readiness: bool


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    reason: str


class HealthServer:
    """Serves probes and metrics on ``host:port`` from daemon threads.

    ``port=0`` picks a free port (read :attr:`port` after :meth:`start`). ``host`` defaults
    to all interfaces because the kubelet probes the pod IP; tests pass ``127.0.0.1``.
    ``read_timeout``, ``workers`` and ``max_connections`` bound what any client can hold
    (see the module doc).
    """

    def __init__(self, port: int, registry: CollectorRegistry, host: str = "0.0.0.0", *,
                 read_timeout: float = 10.0, workers: int = 4,
                 max_connections: int = 256, metrics_ttl: float = METRICS_TTL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if workers < 1 or max_connections < 1 or read_timeout <= 0:
            raise ValueError("workers, max_connections and read_timeout must be positive")
        self._requested = (host, port)
        self.registry = registry
        self.read_timeout = read_timeout
        self.workers = workers
        self.max_connections = max_connections
        self.metrics_ttl = metrics_ttl
        self._clock = clock
        self._checks: list[_Registered] = []
        self._lock = threading.Lock()
        self._metrics_lock = threading.Lock()  # one render at a time, the others reuse it
        self._metrics: tuple[float, bytes] | None = None  # (rendered at, body)
        self._listener: _Listener | None = None

    def add_check(self, name: str, check: HealthCheck, *, liveness: bool = True,
                  readiness: bool = True) -> HealthServer:
        """Register ``check`` under ``name`` for /healthz and/or /readyz."""
        if not name or "/" in name:
            raise ValueError(f"check name must be non-empty without '/': {name!r}")
        with self._lock:
            if any(c.name == name for c in self._checks):
                raise ValueError(f"a check named {name!r} is already registered")
            self._checks.append(_Registered(name, check, liveness, readiness))
        return self

    def run_checks(self, kind: str, only: str | None = None) -> list[CheckResult]:
        """Run the ``kind`` ("healthz" or "readyz") checks, or just the one named ``only``."""
        with self._lock:
            checks = [c for c in self._checks
                      if (c.liveness if kind == "healthz" else c.readiness)
                      and (only is None or c.name == only)]
        results = []
        for c in checks:
            try:
                c.check()
            except Exception as exc:
                results.append(CheckResult(c.name, False, str(exc) or type(exc).__name__))
            else:
                results.append(CheckResult(c.name, True, ""))
        return results

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("health server not started")
        return self._listener.port

    def start(self) -> HealthServer:
        self._listener = _Listener(self._requested, self._respond, self.read_timeout,
                                   self.workers, self.max_connections, probe=_is_probe)
        self._listener.start()
        logger.info("serving /healthz, /readyz, /metrics on {host}:{port}",
                    host=self._requested[0], port=self.port)
        return self

    def waiting(self) -> int:
        """Complete requests waiting for a worker (0 when not started)."""
        return 0 if self._listener is None else self._listener.waiting()

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.stop()
        self._listener = None

    def __enter__(self) -> HealthServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _respond(self, method: str, target: str) -> tuple[int, bytes, str]:
        """The answer (status, body, content type) to one request."""
        if method != "GET":
            return 405, b"only GET\n", TEXT
        try:
            url = urlsplit(target)
        except ValueError:  # "http://[", say: the client's error, not the server's
            return 400, b"bad request target\n", TEXT
        parts = _path_parts(url.path)
        verbose = "verbose" in parse_qs(url.query, keep_blank_values=True)
        if parts == ["metrics"]:
            return 200, self._render_metrics(), CONTENT_TYPE_LATEST
        if parts and parts[0] in ("healthz", "readyz") and len(parts) <= 2:
            only = parts[1] if len(parts) == 2 else None
            results = self.run_checks(parts[0], only)
            if only is not None and not results:
                return 404, f"no check named {only}\n".encode(), TEXT
            healthy = all(r.ok for r in results)
            if healthy and not verbose:
                body = "ok\n"
            else:
                lines = [f"[+]{r.name} ok" if r.ok else f"[-]{r.name} failed: {r.reason}"
                         for r in results]
                lines.append(f"{parts[0]} check {'passed' if healthy else 'failed'}")
                body = "\n".join(lines) + "\n"
            return (200 if healthy else 500), body.encode(), TEXT
        return 404, b"not found\n", TEXT


    def _render_metrics(self) -> bytes:
        """The registry's exposition, rendered at most once per ``metrics_ttl``: a flood
        of ``/metrics`` costs copies, not renders."""
        with self._metrics_lock:
            now = self._clock()
            if self._metrics is None or now - self._metrics[0] >= self.metrics_ttl:
                self._metrics = (now, generate_latest(self.registry))
            return self._metrics[1]


def _path_parts(path: str) -> list[str]:
    """A request path's non-empty segments, as the server answers them."""
    return [p for p in path.split("/") if p]


def _is_probe(request: bytes) -> bool:
    """A ``GET`` of ``/healthz``, ``/readyz`` or one of their checks, parsed as
    :meth:`HealthServer._respond` parses it (so nothing else, ``//healthz/metrics`` for
    one, is answered in the probe lane)."""
    parts = request.split(b"\r\n", 1)[0].split()
    if len(parts) != 3 or parts[0] != b"GET":
        return False
    try:
        path = _path_parts(urlsplit(parts[1].decode("latin-1")).path)
    except ValueError:
        return False
    return bool(path) and path[0] in ("healthz", "readyz") and len(path) <= 2


Responder = Callable[[str, str], tuple[int, bytes, str]]
"""(method, request target) to (status, body, content type)."""

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}


@dataclass
class _Reading:
    """A connection whose request head is still arriving."""

    sock: socket.socket
    deadline: float
    accepted: float
    head: bytearray = field(default_factory=bytearray)
    reads: int = 0
    """The ``recv`` calls that returned data so far."""
    end: int | None = None
    """The whole request's length, once its head has been parsed (a subclass's)."""


@dataclass(frozen=True)
class _Complete:
    """A connection whose request has arrived whole, waiting for a worker."""

    sock: socket.socket
    request: bytes
    accepted: float
    """When its connection was accepted, on the listener's clock."""


class _Listener:
    """The socket side of :class:`HealthServer`: a selector thread that accepts and reads
    request heads, and a fixed pool of worker threads that answer them.

    Complete requests wait in arrival order and are answered oldest first; with
    ``stale_after``, one that has waited that long since its connection was accepted is
    closed unanswered, before any work for it, and ``on_stale()`` is called (the rights
    server's asks, whose runners stop waiting: docs/protocol.md, "Stale asks dropped,
    oldest first"). The health server drops nothing. ``clock`` is monotonic (tests pass
    a fake).

    **No request can stop a thread.** An exception while one connection is accepted, read
    or answered closes that connection (logged at warning with its peer, and
    ``on_error()`` called), and the thread goes on; :meth:`dead_threads` names any thread
    that has ended anyway, for a liveness check. Threads are named ``<name>-server`` and
    ``<name>-worker-<i>``."""

    def __init__(self, address: tuple[str, int], respond: Responder, read_timeout: float,
                 workers: int, max_connections: int, per_source: int | None = None, *,
                 stale_after: float | None = None,
                 on_stale: Callable[[], None] | None = None,
                 on_error: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 name: str = "health",
                 probe: Callable[[bytes], bool] | None = None) -> None:
        self._name = name
        self._probe = probe
        self._on_error = on_error
        self._traced = False  # a failed answer's traceback logged already
        self._stuck_after = STUCK_AFTER
        self._turned = time.monotonic()  # the last whole selector turn (real time)
        self._respond = respond
        self._read_timeout = read_timeout
        self._stale_after = stale_after
        self._on_stale = on_stale
        self._clock = clock
        self._max_connections = max_connections
        self._per_source = per_source  # None: no cap per source address
        self._source_of: dict[socket.socket, str] = {}
        self._sources: dict[str, int] = {}
        self._server = socket.create_server(address, backlog=128)
        self._server.setblocking(False)
        self.port = int(self._server.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._reading: dict[socket.socket, _Reading] = {}  # insertion order: oldest first
        self._answering = 0
        self._count_lock = threading.Lock()
        self._waiting: deque[_Complete] = deque()  # in arrival order: oldest on the left
        self._probes: deque[_Complete] = deque()  # the probe lane (with ``probe`` only)
        lock = threading.Lock()  # guards _waiting and _probes
        self._ready = threading.Condition(lock)  # a request for any worker
        self._probe_ready = threading.Condition(lock)  # a probe, for the probe worker
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._select_loop, name=f"{name}-server",
                                          daemon=True)]
        self._threads += [threading.Thread(target=self._work, name=f"{name}-worker-{i}",
                                           daemon=True) for i in range(workers)]
        if probe is not None:
            self._threads.append(threading.Thread(target=self._work, args=(True,),
                                                  name=f"{name}-probe", daemon=True))

    def start(self) -> None:
        self._turned = time.monotonic()
        self._selector.register(self._server, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        for thread in self._threads:
            thread.start()

    def dead_threads(self) -> list[str]:
        """The names of the threads that have ended while the listener was not stopping,
        and of the selector thread if alive but without a whole turn for
        :data:`STUCK_AFTER` seconds (a turn that fails every time, or is pinned):
        empty while all serve."""
        if self._stopping.is_set():
            return []
        dead = [t.name for t in self._threads if t.ident is not None and not t.is_alive()]
        selector = self._threads[0]
        idle = time.monotonic() - self._turned
        if selector.is_alive() and idle > self._stuck_after:
            dead.append(f"{selector.name} (no whole turn for {idle:.0f} s)")
        return dead

    def stop(self) -> None:
        self._stopping.set()
        self._wake_w.send(b"x")
        with self._ready:
            self._ready.notify_all()
            self._probe_ready.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
        for sock in list(self._reading):
            sock.close()
        self._reading.clear()
        with self._ready:
            left = list(self._waiting) + list(self._probes)
            self._waiting, self._probes = deque(), deque()
        for complete in left:
            complete.sock.close()
        self._selector.close()
        self._server.close()
        self._wake_r.close()
        self._wake_w.close()

    # ---- the selector thread -------------------------------------------------------

    def _select_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self._select_turn()
            except Exception:  # not one connection's: logged, and the next turn tried
                logger.exception("{name}: the selector's turn failed", name=self._name)
                self._count_error()
                self._stopping.wait(0.1)  # no busy loop on a failure that repeats
            else:
                self._turned = time.monotonic()

    def _select_turn(self) -> None:
        for key, _ in self._selector.select(timeout=min(1.0, self._read_timeout)):
            try:
                if key.fileobj is self._server:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    self._wake_r.recv(64)
                else:
                    assert isinstance(key.fileobj, socket.socket)
                    self._read(key.fileobj)
            except Exception as exc:  # a bug one connection hit costs that connection
                self._failed(key.fileobj, exc)
        now = self._clock()
        for sock in [s for s, r in self._reading.items() if r.deadline <= now]:
            self._drop(sock)  # the request did not arrive in time
        with self._ready:
            stale = self._pop_stale(now)
        self._shed(stale)  # not even waiting for a worker to be free

    def _failed(self, fileobj: object, exc: Exception) -> None:
        """An exception while accepting or reading ``fileobj``: a connection still being
        read is closed (its slot freed); the listening socket is tried again next turn."""
        peer = "-"
        self._count_error()  # before the close: whoever sees the close sees the count
        if isinstance(fileobj, socket.socket) and fileobj is not self._server:
            peer = _peer_of(fileobj)
            if fileobj in self._reading:
                self._drop(fileobj)
        logger.opt(exception=exc).warning(
            "{name}: a request from {peer} failed; its connection is closed: {err}",
            name=self._name, peer=peer, err=f"{type(exc).__name__}: {exc}"[:200])

    def _count_error(self) -> None:
        if self._on_error is not None:
            with contextlib.suppress(Exception):
                self._on_error()

    def _accept(self) -> None:
        # At most ACCEPTS_PER_TURN, so that a flood of connections cannot keep the selector
        # from reading (and answering) the connections it has: the listening socket is
        # reported again at the next turn.
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, peer = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, say: retried next turn
                logger.debug("health: accept failed: {err}", err=exc)
                return
            if not self._admit(sock, str(peer[0])):
                sock.close()  # its source holds its share already
                continue
            try:
                self._take_in(sock)
            except Exception:
                self._drop(sock)  # its socket and its source's count, not leaked
                raise

    def _take_in(self, sock: socket.socket) -> None:
        """Start reading an accepted (and admitted) connection, making room for it."""
        sock.setblocking(False)
        with self._count_lock:
            answering = self._answering
        if answering + len(self._reading) >= self._max_connections:
            if self._reading:
                self._drop(next(iter(self._reading)))  # the oldest still being read
            elif not self._evict_waiting():
                self._release(sock)
                sock.close()  # every slot is answering: refuse the newcomer
                return
        now = self._clock()
        self._reading[sock] = _Reading(sock, now + self._read_timeout, now)
        self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, sock: socket.socket) -> None:
        reading = self._reading.get(sock)
        if reading is None:
            return
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sock)
            return
        reading.head += data
        reading.reads += 1
        request = self._request_of(reading)
        if request is None:
            return
        self._selector.unregister(sock)
        del self._reading[sock]
        with self._count_lock:
            self._answering += 1
        complete = _Complete(sock, request, reading.accepted)
        with self._ready:
            if self._probe is not None and self._probe(request):
                self._probes.append(complete)
                self._probe_ready.notify()
            else:
                self._waiting.append(complete)
            self._ready.notify()

    def _evict_waiting(self) -> bool:
        """With a probe lane, make room for a newcomer (it may be the kubelet's probe) by
        closing the oldest request waiting in the other lane, unanswered; False if none."""
        if self._probe is None:
            return False
        with self._ready:
            evicted = self._waiting.popleft() if self._waiting else None
        if evicted is None:
            return False
        self._finish(evicted.sock)
        return True

    def waiting(self) -> int:
        """Complete requests waiting for a worker."""
        with self._ready:
            return len(self._waiting) + len(self._probes)

    def _request_of(self, reading: _Reading) -> bytes | None:
        """The request read so far once complete (here: the head without its blank line),
        ``b""`` for a head over :data:`MAX_HEAD`, None while it is still arriving."""
        data = reading.head
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return None if len(data) <= MAX_HEAD else b""
        return bytes(data[:end])

    def _admit(self, sock: socket.socket, source: str) -> bool:
        """Count ``sock`` against its source address, or refuse it over ``per_source``."""
        if self._per_source is None:
            return True
        with self._count_lock:
            if self._sources.get(source, 0) >= self._per_source:
                return False
            self._sources[source] = self._sources.get(source, 0) + 1
            self._source_of[sock] = source
        return True

    def _release(self, sock: socket.socket) -> None:
        with self._count_lock:
            source = self._source_of.pop(sock, None)
            if source is not None:
                left = self._sources[source] - 1
                if left > 0:
                    self._sources[source] = left
                else:
                    del self._sources[source]

    def _drop(self, sock: socket.socket) -> None:
        self._release(sock)
        self._reading.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):  # not registered (any more)
            self._selector.unregister(sock)
        sock.close()

    # ---- the workers -----------------------------------------------------------------

    def _stale(self, complete: _Complete, now: float) -> bool:
        return self._stale_after is not None and now - complete.accepted >= self._stale_after

    def _pop_stale(self, now: float) -> list[_Complete]:
        """Take the stale requests off the old end of the waiting line, under
        ``self._ready``. Arrival order is near enough acceptance order: a stale one
        behind a fresher one is caught once it reaches the old end, always before a
        worker takes it."""
        stale = []
        while self._waiting and self._stale(self._waiting[0], now):
            stale.append(self._waiting.popleft())
        return stale

    def _shed(self, stale: list[_Complete]) -> None:
        """Count stale requests, then close them unanswered (no work was done for them)."""
        for complete in stale:
            try:
                if self._on_stale is not None:
                    self._on_stale()
            except Exception:  # a counter that raised: the connection is still closed
                logger.exception("{name}: counting a stale request failed", name=self._name)
            finally:
                self._finish(complete.sock)

    def _take(self, probes_only: bool = False) -> _Complete | None:
        """The next request to answer (None: stopping), probes first, shedding stale ones
        first. The probe worker (``probes_only``) takes probes only."""
        if probes_only:
            with self._ready:
                while not self._probes and not self._stopping.is_set():
                    self._probe_ready.wait()
                return None if self._stopping.is_set() else self._probes.popleft()
        while True:
            with self._ready:
                while (not self._waiting and not self._probes
                       and not self._stopping.is_set()):
                    self._ready.wait()
                if self._stopping.is_set():
                    return None
                if self._probes:
                    return self._probes.popleft()
                now = self._clock()
                stale = self._pop_stale(now)  # so the oldest left is not stale
                taken = self._waiting.popleft() if self._waiting else None
            self._shed(stale)
            if taken is not None:
                return taken

    def _work(self, probes_only: bool = False) -> None:
        while True:
            try:
                complete = self._take(probes_only)
            except Exception:  # a bug outside any one request's answer: the next turn
                logger.exception("{name}: a worker's turn failed", name=self._name)
                self._count_error()
                self._stopping.wait(0.1)  # no busy loop on a failure that repeats
                continue
            if complete is None:
                return
            try:
                self._answer(complete.sock, complete.request)
            except OSError as exc:  # the client went away, or did not read in time
                logger.debug("{name}: answer not sent: {err}", name=self._name, err=exc)
            except Exception as exc:  # a bug one request hit: its connection, one line
                self._count_error()
                logger.opt(exception=exc if not self._traced else None).warning(
                    "{name}: a request from {peer} failed; its connection is closed: {err}",
                    name=self._name, peer=_peer_of(complete.sock),
                    err=f"{type(exc).__name__}: {exc}"[:200])
                self._traced = True  # a traceback for the first only: no log flood
            finally:
                with contextlib.suppress(Exception):
                    self._finish(complete.sock)

    def _finish(self, sock: socket.socket) -> None:
        """Close a connection taken for an answer, and free its slot."""
        try:
            self._release(sock)
            sock.close()
        finally:
            with self._count_lock:
                self._answering -= 1

    def _answer(self, sock: socket.socket, head: bytes) -> None:
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split()
        if not head:
            status, body, content_type = 431, b"request head too large\n", TEXT
        elif len(parts) != 3 or not parts[2].startswith("HTTP/"):
            status, body, content_type = 400, b"bad request\n", TEXT
        else:
            status, body, content_type = self._respond(parts[0], parts[1])
        if status == 400:  # a client's error: one debug line, no traceback (any pod can
            # send these, so a louder level would let it flood the log)
            logger.debug("{name}: bad request from {peer}: {line}", name=self._name,
                         peer=_peer_of(sock), line=line[:200])
        else:
            logger.debug("health: {line} {status}", line=line[:200], status=status)
        sock.setblocking(True)
        sock.settimeout(self._read_timeout)
        sock.sendall(
            f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode("latin-1") + body)


def _peer_of(sock: socket.socket) -> str:
    """The client's address for a log line ("-" when unknown, as for a socketpair)."""
    try:
        return str(sock.getpeername()[0]) or "-"
    except (OSError, IndexError, TypeError):
        return "-"
