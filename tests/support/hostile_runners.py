"""Runners for the controller to talk to, on loopback: hostile ones, and an honest one.

A :class:`HostileRunner` is a plain TCP server that answers every request with one
attack (docs/security.md, "The runner as seen by the controller"): a body far over the
controller's limit, an answer that trickles in a byte at a time, a redirect to another
server, or answers that are not what a runner says. It records what it was asked and
how much it managed to send. An :class:`HonestRunner` answers ``GET /scale`` and ``PUT
/scale`` as a runner does (no guest behind it: a PUT's size is what it reports next),
and can be told to answer PUT like a runner whose guest never finishes an unplug (504
after a wait).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30
ATTACKS = ("big_body", "big_body_unannounced", "trickle", "redirect", "garbage_json",
           "not_an_object", "wrong_types")
"""Every answer :class:`HostileRunner` can give."""


@dataclass
class Asked:
    """One request a server received."""

    method: str
    path: str
    at: float


@dataclass
class HostileRunner:
    """Answers every request with ``attack`` (one of :data:`ATTACKS`).

    ``big_body*``: 200 and ``body_bytes`` of JSON-looking bytes (announced in
    Content-Length or not), streamed until the caller hangs up. ``trickle``: a status
    line, then one byte every ``trickle_interval`` seconds, ``trickle_bytes`` in all.
    ``redirect``: 302 to ``redirect_to``. ``garbage_json``, ``not_an_object``,
    ``wrong_types``: 200 with a body that is not JSON, a JSON list, or a report whose
    fields have the wrong types."""

    attack: str
    port: int = 0
    body_bytes: int = GIB
    trickle_interval: float = 0.1
    trickle_bytes: int = 300
    redirect_to: str = ""
    asked: list[Asked] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    """Bytes sent per answer, up to the moment the caller hung up (or the end)."""
    hung_up: list[bool] = field(default_factory=list)
    """Per answer: whether the caller hung up before the whole attack was sent."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> HostileRunner:
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        self._server = Server(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self, sock: socket.socket) -> None:
        head = _read_request(sock)
        if head is None:
            return
        method, path = head
        with self._lock:
            self.asked.append(Asked(method, path, time.monotonic()))
        sent, complete = 0, False
        with contextlib.suppress(OSError):
            sent, complete = self._attack(sock)
        with self._lock:
            self.sent.append(sent)
            self.hung_up.append(not complete)

    def _attack(self, sock: socket.socket) -> tuple[int, bool]:
        """Send the attack; (bytes sent, whether all of it was sent)."""
        if self.attack in ("big_body", "big_body_unannounced"):
            length = (f"Content-Length: {self.body_bytes}\r\n"
                      if self.attack == "big_body" else "")
            sock.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{length}"
                         f"Connection: close\r\n\r\n".encode())
            chunk = b" " * (1 << 20)
            sent = 0
            while sent < self.body_bytes:
                # JSON-looking: an object that never ends.
                piece = (b'{"qemu": ' + chunk if sent == 0 else chunk)[:self.body_bytes - sent]
                try:
                    sock.sendall(piece)
                except OSError:
                    return sent, False
                sent += len(piece)
            return sent, True
        if self.attack == "trickle":
            sock.sendall(b"HTTP/1.1 200 OK\r\n")
            for n in range(self.trickle_bytes):
                time.sleep(self.trickle_interval)
                try:
                    sock.sendall(b"X")
                except OSError:
                    return n, False
            return self.trickle_bytes, True
        if self.attack == "redirect":
            answer = (f"HTTP/1.1 302 Found\r\nLocation: {self.redirect_to}\r\n"
                      f"Content-Length: 0\r\nConnection: close\r\n\r\n").encode()
        else:
            body = {"garbage_json": b"{ this is not JSON",
                    "not_an_object": b"[1, 2, 3]",
                    "wrong_types": json.dumps({
                        "mode": "QmpScaling", "qemu": {"vcpus": "many", "memorySlots": [],
                                                       "memoryBytes": 1e300},
                        "lastApplied": {"fence": {"epoch": True, "token": "x"}},
                        "pendingRemovals": {"a": 1}}).encode()}[self.attack]
            answer = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                      ).encode() + body
        sock.sendall(answer)
        return len(answer), True


def _read_request(sock: socket.socket) -> tuple[str, str] | None:
    """Read one request (head and its Content-Length body); (method, path)."""
    sock.settimeout(30)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                return None
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        while len(rest) < length:
            chunk = sock.recv(4096)
            if not chunk:
                break
            rest += chunk
    except (OSError, ValueError):
        return None
    method, path, *_ = lines[0].split(" ")
    return method, path


class RecordingServer:
    """An HTTP server that only records who asked it (a redirect's target)."""

    def __init__(self) -> None:
        self.asked: list[Asked] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _record(self) -> None:
                outer.asked.append(Asked(self.command, self.path, time.monotonic()))
                body = b'{"secret": "the controller should never read this"}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = _record

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/internal/secret"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class HonestRunner:
    """Answers ``GET /scale`` and ``PUT /scale`` as a runner does, with no guest behind
    it: a PUT with a fence newer than the last applied takes its size at once (an older
    one is refused, 409). With ``stuck_put`` set, every PUT that changes the size waits
    that many seconds and answers 504 (the guest neither finished nor refused an
    unplug: what the runner answers after its own wait), applying nothing."""

    def __init__(self, port: int = 0, stuck_put: float | None = None,
                 put_redirect: str = "", lying_put: float | None = None) -> None:
        self.lying_put = lying_put
        """Set: every PUT waits that many seconds and answers 200 with the size asked
        for, applying nothing (``GET /scale`` goes on reporting the older fence): a
        hostile runner that holds the caller as long as it likes with a "success"."""
        self.put_redirect = put_redirect
        """Non-empty: every PUT is answered 307 to this URL (a hostile runner that
        answers GET /scale as a runner does)."""
        self.fence: dict[str, int] | None = None
        self.size: dict[str, Any] = {"vcpus": 1, "memorySlots": 1, "memoryBytes": GIB}
        self.stuck_put = stuck_put
        self.puts = 0
        self.gets = 0
        self._lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, code: int, doc: dict[str, Any]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                with outer._lock:
                    outer.gets += 1
                    doc = {"mode": "QmpScaling", "qemu": dict(outer.size),
                           "lastApplied": {"fence": outer.fence} if outer.fence else None,
                           "pendingRemovals": []}
                self._answer(200, doc)

            def do_PUT(self) -> None:
                doc = json.loads(self.rfile.read(int(self.headers.get("Content-Length")
                                                     or 0)))
                f = doc["fence"]
                fence = (f["epoch"], f["token"], f["seq"])
                with outer._lock:
                    outer.puts += 1
                    last = outer.fence
                    older = last is not None and fence < (last["epoch"], last["token"],
                                                          last["seq"])
                if older:
                    self._answer(409, {"error": "stale fence"})
                    return
                if outer.put_redirect:
                    self.send_response(307)
                    self.send_header("Location", outer.put_redirect)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if outer.lying_put is not None:
                    time.sleep(outer.lying_put)
                    self._answer(200, {"qemu": {"vcpus": doc["cpus"],
                                                "memorySlots": doc["memorySlots"],
                                                "memoryBytes": doc["memorySlots"] * GIB}})
                    return
                if outer.stuck_put is not None:
                    time.sleep(outer.stuck_put)
                    self._answer(504, {"error": "timed out waiting for the guest to eject "
                                                "dimm-slot1"})
                    return
                with outer._lock:
                    outer.fence = dict(f)
                    outer.size = {"vcpus": doc["cpus"], "memorySlots": doc["memorySlots"],
                                  "memoryBytes": doc["memorySlots"] * GIB}
                    size = dict(outer.size)
                self._answer(200, {"qemu": size})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
