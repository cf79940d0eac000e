"""A small HTTP server for probes and metrics: ``/healthz``, ``/readyz``, ``/metrics``.

Reusable by anything that runs as a long-lived process (the controller registers the
elector's check and its own). Checks follow the Kubernetes ``healthz`` convention: a check
is a function that returns normally when healthy and raises when not; the exception's
message is the reason shown. ``/healthz`` runs the liveness checks, ``/readyz`` the
readiness checks, ``/healthz/<name>`` and ``/readyz/<name>`` one check, and ``?verbose``
lists every check. ``/metrics`` serves the caller's own ``CollectorRegistry`` (never the
global one, so several servers and electors can live in one process, as in tests).

What it guarantees: each request runs the checks afresh (no caching), in its own thread,
so one slow check delays only that probe. What it does not: a check that blocks forever
blocks that request forever; keep checks cheap and bounded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from loguru import logger
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

HealthCheck = Callable[[], None]
"""Returns when healthy; raises (any exception, with a reason as message) when not."""


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
    """Serves probes and metrics on ``host:port`` from a daemon thread.

    ``port=0`` picks a free port (read :attr:`port` after :meth:`start`). ``host`` defaults
    to all interfaces because the kubelet probes the pod IP; tests pass ``127.0.0.1``.
    """

    def __init__(self, port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> None:
        self._requested = (host, port)
        self.registry = registry
        self._checks: list[_Registered] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

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
        if self._server is None:
            raise RuntimeError("health server not started")
        return int(self._server.server_address[1])

    def start(self) -> HealthServer:
        handler = _handler_for(self)
        self._server = ThreadingHTTPServer(self._requested, handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="health-server",
                                        daemon=True)
        self._thread.start()
        logger.info("serving /healthz, /readyz, /metrics on {host}:{port}",
                    host=self._requested[0], port=self.port)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None
        self._thread = None

    def __enter__(self) -> HealthServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _handler_for(server: HealthServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            parts = [p for p in url.path.split("/") if p]
            verbose = "verbose" in parse_qs(url.query, keep_blank_values=True)
            if parts == ["metrics"]:
                self._send(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)
                return
            if parts and parts[0] in ("healthz", "readyz") and len(parts) <= 2:
                only = parts[1] if len(parts) == 2 else None
                results = server.run_checks(parts[0], only)
                if only is not None and not results:
                    self._send(404, f"no check named {only}\n".encode())
                    return
                healthy = all(r.ok for r in results)
                if healthy and not verbose:
                    body = "ok\n"
                else:
                    lines = [f"[+]{r.name} ok" if r.ok else f"[-]{r.name} failed: {r.reason}"
                             for r in results]
                    lines.append(f"{parts[0]} check {'passed' if healthy else 'failed'}")
                    body = "\n".join(lines) + "\n"
                self._send(200 if healthy else 500, body.encode())
                return
            self._send(404, b"not found\n")

        def _send(self, status: int, body: bytes,
                  content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            logger.debug("health: {line}", line=format % args)

    return Handler
