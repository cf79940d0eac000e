"""The runner's HTTP endpoints, served from a thread so probes answer whatever QEMU does.

* ``GET /healthz`` 200 while the runner is alive and QEMU runs (or disks are still being
  prepared), else 503. The liveness probe.
* ``GET /ready`` 200 while the guest is ready (see :mod:`neonvm.runner.state`), else 503
  with the reason as text. The readiness probe.
* ``GET /status`` the :class:`~neonvm.runner.state.Snapshot` as JSON.
* ``GET /metrics`` Prometheus text format from the runner's own registry.
* ``GET /scale`` what QEMU has plugged (asked over QMP now), what the guest last reported,
  and the last applied scaling fence. 503 while QMP is not connected.
* ``PUT /scale`` a live CPU/memory change, authenticated by a bearer token and fenced
  (:mod:`neonvm.runner.scaling`): 200 applied, 400 bad request or out of bounds, 401 not
  authenticated, 409 stale fence, 503 QMP not connected, 504 the guest did not finish.

The probe endpoints read one snapshot and never touch QEMU or QMP, so a stuck guest cannot
make a probe time out.

Connections are bounded (docs/runner.md, "Health and readiness"): each request must
arrive whole within ``REQUEST_DEADLINE`` of the connection (or of the previous answer on a
kept-alive connection), every read times out after ``READ_TIMEOUT``, a request's line and
headers together take at most ``MAX_HEAD`` bytes (431 and closed beyond), a body at most
``MAX_BODY``, and at most ``MAX_CONNECTIONS`` are open at once (one thread each). A new
connection over the cap closes the oldest one still waiting for its request, never one
being answered, so a pod that holds connections open, idle or trickling, cannot keep the
kubelet's probe out, nor make the runner hold more than a few MiB for them.

``PUT /scale`` is the only way in to QEMU through this port, and it
does nothing without the token (the port listens on the pod's IP for the kubelet's
probes). Any other method gets 501 from the standard library. Not guaranteed: TLS; anyone
who can reach the pod's IP can read the status and metrics, and the token crosses the pod
network in clear (docs/runner.md, "Live scaling").
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from loguru import logger
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from neonvm.api.scale_protocol import ScaleError
from neonvm.runner.errors import HostError
from neonvm.runner.scaling import Scaler
from neonvm.runner.state import RunnerState

MAX_BODY = 64 * 1024
"""Bytes of a ``PUT`` body at most (413 beyond)."""
MAX_HEAD = 16 * 1024
"""Bytes of a request's line and headers at most (431 beyond, and the connection closed):
the standard library alone reads up to about 6.5 MB of them, and copies them several
times, so 32 connections could hold hundreds of MiB of a pod whose memory limit leaves
the runner and QEMU 256 MiB over the guest. ``MAX_CONNECTIONS * (MAX_HEAD + MAX_BODY)``
stays a few MiB."""
MAX_CONNECTIONS = 32
"""Open connections (one thread each) at most; a new one closes the oldest waiting one."""
READ_TIMEOUT = 10.0
"""Seconds any single read from a client may block."""
REQUEST_DEADLINE = 10.0
"""Seconds a connection has to deliver a whole request (headers and body), counted from
its accept or from the previous answer; then it is closed."""


class _HeadTooLarge(Exception):
    """A request's line and headers went past :data:`MAX_HEAD`."""


class _HeadLimit:
    """The handler's ``rfile``: counts the bytes of each request's head (reset by
    :meth:`start`, ended by :meth:`end`) and raises :class:`_HeadTooLarge` past the
    limit, having read at most one byte more than it. Bodies are read as they are."""

    def __init__(self, raw: Any, limit: int) -> None:
        self._raw = raw
        self._limit = limit
        self._count = 0
        self._in_head = True

    def start(self) -> None:
        self._count, self._in_head = 0, True

    def end(self) -> None:
        self._in_head = False

    def readline(self, size: int | None = -1) -> bytes:
        if not self._in_head:
            return bytes(self._raw.readline(size))
        room = self._limit - self._count
        want = room + 1 if size is None or size < 0 else min(size, room + 1)
        line = bytes(self._raw.readline(want))
        self._count += len(line)
        if self._count > self._limit:
            raise _HeadTooLarge
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT  # socket timeout for every read and write (StreamRequestHandler)
    rfile: Any

    def setup(self) -> None:
        super().setup()
        self.rfile = _HeadLimit(self.rfile, MAX_HEAD)

    def handle_one_request(self) -> None:
        self.rfile.start()
        try:
            super().handle_one_request()
        except _HeadTooLarge:
            logger.debug("http: a request head over {} bytes from {}: 431", MAX_HEAD,
                         self.client_address)
            body = f"request line and headers over {MAX_HEAD} bytes\n".encode()
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.wfile.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                                 b"Content-Type: text/plain; charset=utf-8\r\n"
                                 b"Connection: close\r\n"
                                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)

    def parse_request(self) -> bool:
        try:
            return super().parse_request()
        finally:
            self.rfile.end()

    def do_GET(self) -> None:
        self.server.busy(self.connection)
        try:
            self._get()
        finally:
            self.server.waiting(self.connection)

    def _get(self) -> None:
        path = self.path.split("?", 1)[0]
        state = self.server.state
        if path == "/healthz":
            ok, why = state.healthy()
            self._send(200 if ok else 503, "text/plain; charset=utf-8", f"{why}\n".encode())
        elif path == "/ready":
            snap = state.snapshot()
            body = "ready\n" if snap.ready else f"not ready: {snap.not_ready_because}\n"
            self._send(200 if snap.ready else 503, "text/plain; charset=utf-8", body.encode())
        elif path == "/status":
            data = json.dumps(state.snapshot().as_json(), indent=2).encode() + b"\n"
            self._send(200, "application/json", data)
        elif path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, generate_latest(self.server.registry))
        elif path == "/scale":
            self._scale_report()
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found\n")

    def do_PUT(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY:
            self._send_json(413, {"error": f"Content-Length must be 0..{MAX_BODY}"})
            self.close_connection = True
            return
        body = self.rfile.read(length) if length else b""
        if len(body) < length:
            self.close_connection = True
            return
        self.server.busy(self.connection)
        try:
            self._put(path, body)
        finally:
            self.server.waiting(self.connection)

    def _put(self, path: str, body: bytes) -> None:
        if path != "/scale":
            self._send(404, "text/plain; charset=utf-8", b"not found\n")
            return
        scaler = self.server.scaler
        if scaler is None:
            self._send_json(404, {"error": "live scaling is not available in this runner"})
            return
        try:
            result = scaler.scale(self.headers.get("Authorization"), body)
        except ScaleError as exc:
            logger.info("PUT /scale refused ({}): {}", exc.status, exc)
            headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
            answer: dict[str, Any] = {"error": str(exc)}
            if exc.refused:
                answer["refused"] = list(exc.refused)
            if exc.reason:
                answer["reason"] = exc.reason
            self._send_json(exc.status, answer, headers)
            return
        self._send_json(200, result)

    def _scale_report(self) -> None:
        scaler = self.server.scaler
        if scaler is None:
            self._send_json(404, {"error": "live scaling is not available in this runner"})
            return
        snap = self.server.state.snapshot()
        try:
            last = scaler.last_applied()
            size = scaler.query()
        except ScaleError as exc:
            self._send_json(exc.status, {"error": str(exc)})
            return
        self._send_json(200, {
            "mode": scaler.mode,
            "qemu": {"vcpus": size.vcpus, "memorySlots": size.memory_slots,
                     "memoryBytes": size.memory_bytes},
            "guest": {"cpusOnline": snap.guest_cpus_online,
                      "memTotalKiB": snap.guest_mem_total_kb,
                      "reportedAt": snap.guest_reported_at},
            "limits": {"minVcpus": scaler.limits.min_vcpus, "maxVcpus": scaler.limits.max_vcpus,
                       "minMemorySlots": scaler.limits.min_slots,
                       "maxMemorySlots": scaler.limits.max_slots,
                       "memorySlotBytes": scaler.limits.slot_bytes},
            "lastApplied": last.as_json() if last is not None else None,
            # The pod this runner runs in (downward API): the controller adopts a size
            # only from the runner of the pod it means, not from a reused IP's.
            "podUid": scaler.pod_uid,
            # Removals started and not finished: the guest may still eject these, so the
            # size above is not settled (the controller commits none while any is left).
            "pendingRemovals": scaler.pending_removals(size),
        })

    def _send_json(self, code: int, doc: Any, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(doc, indent=2).encode() + b"\n"
        self.send_response(code)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("http: {}", format % args)


class _Server(ThreadingHTTPServer):
    """A threading server with a cap on connections and a deadline on each request.

    ``_waiting`` maps each open connection to the time it began waiting for its next
    request, or to None while a request is being answered. Connections are closed (their
    thread's read returns at once) when their deadline passes, checked on every accept and
    every poll of ``serve_forever``, or when a new connection needs their place.
    """

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up mid-request is not the runner's problem: no traceback."""
        logger.opt(exception=True).debug("http: request from {} failed", client_address)

    def __init__(self, address: tuple[str, int], state: RunnerState,
                 registry: CollectorRegistry, scaler: Scaler | None,
                 max_connections: int = MAX_CONNECTIONS,
                 request_deadline: float = REQUEST_DEADLINE) -> None:
        self.state = state
        self.registry = registry
        self.scaler = scaler
        self.max_connections = max_connections
        self.request_deadline = request_deadline
        self._waiting: dict[socket.socket, float | None] = {}
        self._lock = threading.Lock()
        self.evicted = 0
        """Connections closed to make room or because their deadline passed."""
        super().__init__(address, _Handler)

    def open_connections(self) -> int:
        with self._lock:
            return len(self._waiting)

    def busy(self, conn: socket.socket) -> None:
        with self._lock:
            if conn in self._waiting:
                self._waiting[conn] = None

    def waiting(self, conn: socket.socket) -> None:
        with self._lock:
            if conn in self._waiting:
                self._waiting[conn] = time.monotonic()

    def _close_locked(self, conn: socket.socket) -> None:
        del self._waiting[conn]
        self.evicted += 1
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)  # the handler's read returns; it closes

    def _expire_locked(self, now: float) -> None:
        for conn, since in list(self._waiting.items()):
            if since is not None and now - since > self.request_deadline:
                self._close_locked(conn)

    def service_actions(self) -> None:
        with self._lock:
            self._expire_locked(time.monotonic())

    def process_request(self, request: Any, client_address: Any) -> None:
        now = time.monotonic()
        with self._lock:
            self._expire_locked(now)
            while len(self._waiting) >= self.max_connections:
                idle = [(since, c) for c, since in self._waiting.items() if since is not None]
                if not idle:
                    break
                self._close_locked(min(idle, key=lambda item: item[0])[1])
            if len(self._waiting) >= self.max_connections:
                # Every slot is answering a request: this one waits for none of them.
                logger.debug("http: {} connections busy, refusing {}", len(self._waiting),
                             client_address)
                self.shutdown_request(request)
                return
            self._waiting[request] = now
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._waiting.pop(request, None)
        super().shutdown_request(request)


class RunnerHTTPServer:
    """Start with :meth:`start` (binds, raising HostError if it cannot), stop with :meth:`stop`."""

    def __init__(self, state: RunnerState, registry: CollectorRegistry,
                 address: str, port: int, scaler: Scaler | None = None,
                 max_connections: int = MAX_CONNECTIONS,
                 request_deadline: float = REQUEST_DEADLINE) -> None:
        self._max_connections = max_connections
        self._request_deadline = request_deadline
        self._scaler = scaler
        self._state = state
        self._registry = registry
        self._address = address
        self._port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            self._server = _Server((self._address, self._port), self._state, self._registry,
                                   self._scaler, self._max_connections,
                                   self._request_deadline)
        except OSError as exc:
            raise HostError(f"cannot listen on {self._address}:{self._port}: "
                            f"{exc.strerror or exc}") from None
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.2},
                                        name="runner-http", daemon=True)
        self._thread.start()

    def open_connections(self) -> int:
        """Connections open now (waiting for a request or being answered)."""
        assert self._server is not None
        return self._server.open_connections()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.server_address[1])

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None
