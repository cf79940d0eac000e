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
from pathlib import Path

from neonvm.runner.metrics import runner_registry
from neonvm.runner.server import MAX_CONNECTIONS, RunnerHTTPServer
from neonvm.runner.state import RunnerState, Sizing
from tests.support import closed_by_server, wait_for

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


def _rss_kib(pid: int, field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of process ``pid``, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def _big_head_request(port: int, header_lines: int, line_bytes: int) -> str:
    """Send ``GET /status`` with ``header_lines`` headers of ``line_bytes`` each (what the
    standard library alone accepts: 100 lines of 64 KiB), then read the answer's status
    line: ``431``, ``200`` and so on, or ``closed`` when the server hung up first."""
    line = b"X-Pad: " + b"a" * (line_bytes - 9) + b"\r\n"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"GET /status HTTP/1.1\r\nHost: runner\r\n")
            for _ in range(header_lines):
                sock.sendall(line)
            sock.sendall(b"\r\n")
            status = sock.makefile("rb").readline()
    except OSError:  # reset while sending or reading: refused
        return "closed"
    return status.split(b" ")[1].decode() if status else "closed"


def test_request_heads_over_the_cap_are_refused_and_the_runner_does_not_grow() -> None:
    """32 connections (the cap) each send a request head of about 6.4 MB, as any pod or
    the guest can. Without a cap on the head the runner reads and copies all of it: a few
    hundred MiB, in a pod whose memory limit leaves the runner and QEMU 256 MiB over the
    guest's memory (security review F1). With it, each is refused (431, or closed while
    still sending) after ``MAX_HEAD`` bytes, and the runner's peak memory barely moves."""
    import threading

    from neonvm.runner.server import MAX_HEAD

    proc = subprocess.Popen([sys.executable, "-m", "tests.programs.runner_http", "1024"],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        assert probe(port, "/status") == 200
        before = _rss_kib(proc.pid, "VmRSS")
        answers: list[str] = []
        attackers = [threading.Thread(target=lambda: answers.append(
            _big_head_request(port, header_lines=98, line_bytes=65_536)))
            for _ in range(MAX_CONNECTIONS)]
        for thread in attackers:
            thread.start()
        for thread in attackers:
            thread.join()
        after, peak = _rss_kib(proc.pid, "VmRSS"), _rss_kib(proc.pid, "VmHWM")
        print(f"runner RSS before {before / 1024:.1f} MiB, after {after / 1024:.1f} MiB, "
              f"peak {peak / 1024:.1f} MiB; answers {sorted(set(answers))}")
        assert len(answers) == MAX_CONNECTIONS
        assert set(answers) <= {"431", "closed"}, answers
        assert peak - before < 32 * 1024, (before, peak)  # 32 heads of 6.4 MB: 200 MiB
        # Just over the cap, with nothing left unread to reset the connection: 431.
        assert _big_head_request(port, header_lines=1, line_bytes=MAX_HEAD + 100) == "431"
        # A head within the cap is answered as before.
        assert _big_head_request(port, header_lines=1, line_bytes=MAX_HEAD // 2) == "200"
        assert probe(port) == 200
    finally:
        proc.kill()
        proc.wait()


def test_get_scale_waits_for_qmp_only_briefly(tmp_path: Path) -> None:
    """``GET /scale`` is unauthenticated and holds one of the server's connections while
    it asks QMP (security review F6). QMP that answers after 5 s (QEMU's main loop
    stalled) is not waited for: 504 after ``QUERY_TIMEOUT`` (2 s), where the old wait
    (10 s) answered 200 with the slot held all along. A QMP that answers is answered
    as before."""
    import asyncio
    import json
    import threading

    from neonvm.api.scale_protocol import ScaleLimits, ScaleTarget
    from neonvm.runner.scaling import QUERY_TIMEOUT, Scaler
    from tests.support.runner_scaling import GIB, TOKEN, SlowEjectQMP

    class StalledQMP(SlowEjectQMP):
        stall = 0.0

        async def execute(self, command: str, args: dict[str, object] | None = None) -> object:
            if command == "query-memory-devices":
                await asyncio.sleep(self.stall)
            return await super().execute(command, args)

    assert QUERY_TIMEOUT < 5.0
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    (tmp_path / "token").write_text(TOKEN + "\n")
    limits = ScaleLimits(min_vcpus=1, max_vcpus=1, min_slots=1, max_slots=2, slot_bytes=GIB)
    scaler = Scaler(tmp_path, tmp_path / "token", limits, boot=ScaleTarget(1, 2))
    qmp = StalledQMP(dimms=1)
    scaler.attach(loop, qmp)  # type: ignore[arg-type]
    server = RunnerHTTPServer(fresh_state(), runner_registry(fresh_state()), "127.0.0.1", 0,
                              scaler=scaler)
    server.start()
    try:
        def get_scale() -> tuple[int, dict[str, object]]:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            try:
                conn.request("GET", "/scale")
                answer = conn.getresponse()
                return answer.status, json.loads(answer.read())
            finally:
                conn.close()

        status, doc = get_scale()
        assert status == 200 and doc["qemu"] == {"vcpus": 1, "memorySlots": 2,
                                                 "memoryBytes": 2 * GIB}, doc
        qmp.stall = 5.0
        status, doc = get_scale()
        assert status == 504 and "QMP did not answer in time" in str(doc["error"]), doc
        assert probe(server.port) == 200
    finally:
        server.stop()
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(10)
        loop.close()
