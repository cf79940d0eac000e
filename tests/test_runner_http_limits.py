"""The runner's HTTP port under a client that holds connections: probes still answer.

Any pod can reach a runner's HTTP port (docs/security.md, "The guest"; docs/runner.md,
"Health and readiness"). These tests run the real server and hold connections the way a
hostile pod would: idle ones that never send a byte, and trickling ones that send a
request a byte at a time. The kubelet's probe must still be answered, and the held
connections must be closed when their request deadline passes.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from neonvm.runner.metrics import runner_registry
from neonvm.runner.server import MAX_CONNECTIONS, RunnerHTTPServer
from neonvm.runner.state import RunnerState, Sizing
from tests.support import wait_for

REPO = Path(__file__).resolve().parent.parent


def fresh_state() -> RunnerState:
    return RunnerState(vm="default/probe", accel="tcg", ready_marker="",
                       sizing=Sizing(vcpus=1, max_vcpus=1, memory_bytes=1 << 30,
                                     max_memory_bytes=1 << 30))


def probe(port: int, path: str = "/healthz") -> int:
    """One kubelet-style probe on a new connection; its status code."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed ``sock`` (EOF or reset); False while it is open."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


@pytest.fixture
def held() -> Iterator[list[socket.socket]]:
    sockets: list[socket.socket] = []
    yield sockets
    for sock in sockets:
        sock.close()


def test_a_runner_under_a_low_fd_limit_answers_its_probe_while_300_connections_are_held(
        held: list[socket.socket]) -> None:
    """300 connections, half idle, half with a request begun and never finished, against a
    runner allowed 128 descriptors.

    Without a cap every held connection costs the runner a descriptor and a thread, and
    none is ever closed: the runner runs out of descriptors, stops accepting, and the
    probe is never answered. With the cap, the oldest waiting connections are closed to
    make room, and the probe (a new connection that sends its request at once) is answered.
    """
    proc = subprocess.Popen([sys.executable, "-m", "tests.programs.runner_http", "128"],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        assert probe(port) == 200
        misses = 0
        for i in range(300):
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:  # the runner no longer accepts: its queue is full
                misses += 1
                if misses == 3:
                    break
                continue
            held.append(sock)
            if i % 2:
                with contextlib.suppress(OSError):  # already closed to make room
                    sock.send(b"GET /ready HTTP/1.1\r\n")  # begun, never finished
        assert probe(port) == 200, f"held {len(held)} connections"
        assert probe(port, "/ready") == 503  # answered: not ready, QEMU never started
        assert proc.poll() is None
        # The server closed held connections to stay under its cap.
        wait_for(lambda: any(closed_by_server(s) for s in held), timeout=60, interval=0.2,
                 what="the runner closing held connections")
    finally:
        proc.kill()
        proc.wait()


def test_idle_trickling_and_kept_alive_connections_are_closed_at_their_deadline(
        held: list[socket.socket]) -> None:
    """A connection must deliver each whole request within the deadline; then it is closed:
    one that never sends, one that sends a request a byte at a time, and one kept alive
    after an answer. A probe in the meantime is answered."""
    state = fresh_state()
    server = RunnerHTTPServer(state, runner_registry(state), "127.0.0.1", 0,
                              max_connections=MAX_CONNECTIONS, request_deadline=1.0)
    server.start()
    try:
        idle = socket.create_connection(("127.0.0.1", server.port))
        trickle = socket.create_connection(("127.0.0.1", server.port))
        kept = socket.create_connection(("127.0.0.1", server.port))
        held += [idle, trickle, kept]
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")
        request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        sent = 0

        def trickled_and_closed() -> bool:
            nonlocal sent
            if closed_by_server(trickle):
                return True
            if sent < len(request) - 1:  # never the last byte
                trickle.send(request[sent:sent + 1])
                sent += 1
            return False

        wait_for(trickled_and_closed, timeout=60, interval=0.2,
                 what="the trickling connection to be closed")
        assert sent < len(request) - 1 or closed_by_server(trickle)
        wait_for(lambda: closed_by_server(idle), timeout=60, interval=0.1,
                 what="the idle connection to be closed")
        wait_for(lambda: closed_by_server(kept), timeout=60, interval=0.1,
                 what="the kept-alive connection to be closed")
        assert probe(server.port) == 200
    finally:
        server.stop()


def test_over_the_cap_the_oldest_waiting_connection_makes_room(
        held: list[socket.socket]) -> None:
    """With a cap of 4 and a long deadline, 4 idle connections fill the server; the probe
    still gets in, and the first idle connection is the one closed for it."""
    state = fresh_state()
    server = RunnerHTTPServer(state, runner_registry(state), "127.0.0.1", 0,
                              max_connections=4, request_deadline=3600)
    server.start()
    try:
        for n in range(1, 5):
            held.append(socket.create_connection(("127.0.0.1", server.port)))
            # each accepted before the next, so their order is the server's order
            wait_for(lambda n=n: server.open_connections() == n,  # type: ignore[misc]
                     timeout=30, interval=0.02, what=f"connection {n} accepted")
        assert probe(server.port) == 200
        wait_for(lambda: closed_by_server(held[0]), timeout=30, interval=0.05,
                 what="the oldest idle connection to be closed")
        assert not any(closed_by_server(s) for s in held[1:])
    finally:
        server.stop()
