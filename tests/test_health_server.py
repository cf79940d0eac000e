"""The probe and metrics server under clients that hold connections: idle ones, slow
ones, too many. Any pod can reach the port; the kubelet's probe must still be answered.
"""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from neonvm.leader.health import MAX_HEAD, TEXT, HealthServer, _Complete, _Listener
from tests.support import closed_by_server, wait_for
from tests.support.health_client import get, running_server

pytestmark = pytest.mark.unit


def connect(port: int, send: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if send:
        sock.sendall(send)
    return sock



@pytest.fixture
def server() -> Iterator[HealthServer]:
    with running_server(read_timeout=1.0) as health:
        yield health


def test_many_idle_connections_take_no_threads_and_the_probe_is_still_answered(
        server: HealthServer, held: list[socket.socket]) -> None:
    threads_before = set(threading.enumerate())
    held.extend(connect(server.port) for _ in range(200))  # more than max_connections
    held.extend(connect(server.port, b"GET /healthz HTTP/1.1\r\n") for _ in range(20))
    assert get(server.port, "/healthz") == (200, "ok\n")
    assert get(server.port, "/readyz?verbose")[0] == 200
    started = set(threading.enumerate()) - threads_before
    assert not started, started  # no thread per connection


def test_a_connection_that_sends_no_complete_request_is_closed_after_the_read_timeout(
        server: HealthServer, held: list[socket.socket]) -> None:
    idle = connect(server.port)
    trickle = connect(server.port, b"GET /hea")
    held.extend([idle, trickle])
    wait_for(lambda: closed_by_server(idle), 30, what="the idle connection closed")
    wait_for(lambda: closed_by_server(trickle), 30, what="the partial request closed")
    assert get(server.port, "/healthz")[0] == 200


def test_a_request_head_larger_than_the_limit_is_refused(
        server: HealthServer, held: list[socket.socket]) -> None:
    big = connect(server.port, b"GET /healthz HTTP/1.1\r\nX-Pad: " + b"a" * MAX_HEAD)
    held.append(big)
    big.settimeout(10)
    assert big.recv(1024).startswith(b"HTTP/1.1 431 ")


def test_the_answers_are_those_of_the_checks_and_registry(server: HealthServer) -> None:
    def failing() -> None:
        raise RuntimeError("not today")

    server.add_check("flaky", failing, liveness=False)
    assert get(server.port, "/healthz") == (200, "ok\n")
    status, body = get(server.port, "/readyz")
    assert status == 500 and "[-]flaky failed: not today" in body
    assert get(server.port, "/readyz/always") == (200, "ok\n")
    assert get(server.port, "/readyz/nope")[0] == 404
    assert get(server.port, "/elsewhere")[0] == 404
    assert get(server.port, "/metrics")[0] == 200
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}/healthz",
                                     method="POST", data=b"x")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 405


def test_a_stale_request_whose_count_raises_is_still_closed_and_its_slot_freed() -> None:
    """Pure logic of the listener's shedding: each stale request is finished, whatever
    ``on_stale`` does."""
    def raises() -> None:
        raise RuntimeError("a counter's bug")

    listener = _Listener(("127.0.0.1", 0), lambda _m, _t: (200, b"", TEXT), 1.0, 1, 8,
                         on_stale=raises)
    listener.start()
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        listener._answering = 2
        listener._shed([_Complete(ours, b"", 0.0) for ours, _ in pairs])
        assert listener._answering == 0
        assert all(closed_by_server(theirs) for _, theirs in pairs)
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()
        listener.stop()


def test_a_failure_on_a_socket_without_a_peer_address_is_logged_not_raised() -> None:
    """The wake-up socketpair has no peer address (``getpeername()`` is ``''``)."""
    listener = _Listener(("127.0.0.1", 0), lambda _m, _t: (200, b"", TEXT), 1.0, 1, 8)
    ours, theirs = socket.socketpair()
    try:
        listener._failed(ours, RuntimeError("a spurious wake-up"))
    finally:
        ours.close()
        theirs.close()
        listener.start()
        listener.stop()
