"""The probe and metrics server under hostile requests: a request target it cannot parse,
and a flood of ``/metrics`` requests. Any pod can reach the port; the kubelet's
``/healthz`` must still be answered (docs/reconciler.md, "Running it").
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from loguru import logger
from prometheus_client import CollectorRegistry

from neonvm.leader.health import HealthServer

pytestmark = pytest.mark.unit


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` on a new connection and read the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    return answer


@pytest.fixture
def server() -> Iterator[HealthServer]:
    health = HealthServer(0, CollectorRegistry(), host="127.0.0.1", read_timeout=5.0,
                          workers=2, max_connections=64)
    health.add_check("always", lambda: None)
    with health:
        yield health


class TestAnUnparsableTarget:
    def test_is_answered_400_logged_once_at_warning_without_traceback_and_costs_nothing_else(
            self, server: HealthServer) -> None:
        records: list[dict[str, object]] = []
        sink = logger.add(lambda m: records.append(dict(m.record)), level="DEBUG")
        try:
            answer = exchange(server.port, b"GET http://[ HTTP/1.1\r\n\r\n")
        finally:
            logger.remove(sink)
        assert answer.startswith(b"HTTP/1.1 400 "), answer
        assert get(server.port, "/healthz") == (200, "ok\n")
        loud = [r for r in records if r["level"].no >= 30]  # type: ignore[attr-defined]
        assert len(loud) == 1 and loud[0]["level"].name == "WARNING", loud  # type: ignore[attr-defined]
        assert loud[0]["exception"] is None
        assert "127.0.0.1" in str(loud[0]["message"])
