"""The runner's HTTP endpoints, served from a thread so probes answer whatever QEMU does.

* ``GET /healthz`` 200 while the runner is alive and QEMU runs (or disks are still being
  prepared), else 503. The liveness probe.
* ``GET /ready`` 200 while the guest is ready (see :mod:`neonvm.runner.state`), else 503
  with the reason as text. The readiness probe.
* ``GET /status`` the :class:`~neonvm.runner.state.Snapshot` as JSON.
* ``GET /metrics`` Prometheus text format from the runner's own registry.

Each request reads one snapshot; handlers never touch QEMU or QMP, so a stuck guest
cannot make a probe time out. Every endpoint is a read (any other method gets 501 from
the standard library): nothing sent to this port reaches QEMU, which is why it may listen
on the pod's IP for the kubelet's probes. Not guaranteed: TLS or authentication; anyone
who can reach the pod's IP can read the status and metrics.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from loguru import logger
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from neonvm.runner.errors import HostError
from neonvm.runner.state import RunnerState


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
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
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found\n")

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("http: {}", format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up mid-request is not the runner's problem: no traceback."""
        logger.opt(exception=True).debug("http: request from {} failed", client_address)

    def __init__(self, address: tuple[str, int], state: RunnerState,
                 registry: CollectorRegistry) -> None:
        self.state = state
        self.registry = registry
        super().__init__(address, _Handler)


class RunnerHTTPServer:
    """Start with :meth:`start` (binds, raising HostError if it cannot), stop with :meth:`stop`."""

    def __init__(self, state: RunnerState, registry: CollectorRegistry,
                 address: str, port: int) -> None:
        self._state = state
        self._registry = registry
        self._address = address
        self._port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            self._server = _Server((self._address, self._port), self._state, self._registry)
        except OSError as exc:
            raise HostError(f"cannot listen on {self._address}:{self._port}: "
                            f"{exc.strerror or exc}") from None
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.2},
                                        name="runner-http", daemon=True)
        self._thread.start()

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
