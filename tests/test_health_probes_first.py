"""The probe and metrics server under hostile requests: a request target it cannot parse,
and a flood of ``/metrics`` requests. Any pod can reach the port; the kubelet's
``/healthz`` must still be answered (docs/reconciler.md, "Running it").
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
from loguru import logger
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from neonvm.leader.health import ACCEPTS_PER_TURN, HealthServer, _is_probe, _Listener
from tests.support import wait_for
from tests.support.health_client import get, running_server

pytestmark = pytest.mark.unit


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
    with running_server(read_timeout=5.0) as health:
        yield health


class TestAnUnparsableTarget:
    def test_is_answered_400_logged_once_at_debug_without_traceback_and_costs_nothing_else(
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
        assert loud == []  # any pod can send these: no louder than debug
        bad = [r for r in records if "bad request" in str(r["message"])]
        assert len(bad) == 1 and bad[0]["exception"] is None
        assert "127.0.0.1" in str(bad[0]["message"])


class HeldRender:
    """A registry collector that counts renders and, while ``hold`` is clear, blocks
    every render (so the workers answering ``/metrics`` stay busy)."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.renders = 0

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        self.renders += 1
        self.hold.wait(30)
        yield from ()


class FrozenClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def flooded() -> Iterator[tuple[HealthServer, HeldRender, FrozenClock]]:
    registry = CollectorRegistry()
    render = HeldRender()
    registry.register(render)
    clock = FrozenClock()
    health = HealthServer(0, registry, host="127.0.0.1", read_timeout=5.0, workers=2,
                          max_connections=8, clock=clock)
    health.add_check("always", lambda: None)
    with health:
        yield health, render, clock
        render.hold.set()


METRICS = b"GET /metrics HTTP/1.1\r\n\r\n"


class TestAMetricsFlood:
    def test_does_not_delay_the_probes_even_with_every_worker_and_slot_held(
            self, flooded: tuple[HealthServer, HeldRender, FrozenClock],
            held: list[socket.socket]) -> None:
        server, render, _ = flooded
        for _ in range(8):  # every slot: two workers rendering (held), six waiting
            held.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
            held[-1].sendall(METRICS)
        wait_for(lambda: server.waiting() == 6, 30,
                 what="six /metrics requests waiting behind the two held workers")
        wait_for(lambda: render.renders == 1, 30, what="a worker rendering (held)")
        assert get(server.port, "/healthz") == (200, "ok\n")
        assert get(server.port, "/readyz/always") == (200, "ok\n")
        assert not render.hold.is_set()  # answered while every /metrics was still held

    def test_renders_the_registry_once_per_cache_window(
            self, flooded: tuple[HealthServer, HeldRender, FrozenClock]) -> None:
        server, render, clock = flooded
        render.hold.set()
        first, second = get(server.port, "/metrics"), get(server.port, "/metrics")
        assert first[0] == second[0] == 200 and first == second
        assert render.renders == 1
        clock.now += server.metrics_ttl
        assert get(server.port, "/metrics")[0] == 200
        assert render.renders == 2


class EndlessBacklog:
    """A listening socket whose backlog never runs dry: each ``accept`` hands over a new
    connected socket, as under a flood of new connections."""

    def __init__(self) -> None:
        self.accepted = 0
        self.peers: list[socket.socket] = []

    def accept(self) -> tuple[socket.socket, tuple[str, int]]:
        if self.accepted >= 10 * ACCEPTS_PER_TURN:  # only so that a failing test ends
            raise BlockingIOError
        self.accepted += 1
        ours, theirs = socket.socketpair()
        self.peers.append(theirs)
        return ours, ("192.0.2.1", 40000 + self.accepted)


class TestAFloodOfConnections:
    def test_does_not_keep_the_selector_accepting_for_ever(self) -> None:
        listener = _Listener(("127.0.0.1", 0), lambda _m, _t: (200, b"", "text/plain"),
                             5.0, 1, 64, per_source=0)  # per source 0: every one refused
        flood = EndlessBacklog()
        real_server, listener._server = listener._server, flood  # type: ignore[assignment]
        try:
            listener._accept()  # returns, so the selector reads its connections again
        finally:
            real_server.close()
            for peer in flood.peers:
                peer.close()
        assert flood.accepted == ACCEPTS_PER_TURN


class TestTheProbeLane:
    @pytest.mark.parametrize(("line", "probe"), [
        (b"GET /healthz HTTP/1.1", True),
        (b"GET /readyz/cache-synced?verbose HTTP/1.1", True),
        (b"GET //healthz/metrics HTTP/1.1", False),  # the server reads the path /metrics
        (b"GET /healthz/a/b HTTP/1.1", False),
        (b"GET /metrics HTTP/1.1", False),
        (b"POST /healthz HTTP/1.1", False),
        (b"GET http://[ HTTP/1.1", False),
    ])
    def test_takes_exactly_the_requests_the_server_answers_as_probes(
            self, line: bytes, probe: bool) -> None:
        assert _is_probe(line + b"\r\nHost: x\r\n") is probe
