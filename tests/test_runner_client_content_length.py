"""A runner's ``Content-Length`` is parsed strictly (docs/security.md, "The runner as seen
by the controller"): anything but 1 to
:data:`~neonvm.controller.runner_client.MAX_LENGTH_DIGITS` ASCII digits is a misbehaving
runner (:class:`~neonvm.controller.runner_client.ScalingError`), the error every caller handles,
never a ``ValueError`` (``int()`` refuses more than 4,300 digits) that escapes them.

A one-shot answering server on loopback (the tenant's runner may answer anything).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from neonvm.controller.runner_client import ScalingError, runner_exchange

pytestmark = pytest.mark.unit


class Answering:
    """Accepts one connection at a time, reads the request head and answers :attr:`answer`."""

    def __init__(self) -> None:
        self.answer = b""
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}/status"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head and (chunk := conn.recv(4096)):
                    head += chunk
                conn.sendall(self.answer)

    def close(self) -> None:
        self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept (Linux)
        self._server.close()
        self._thread.join(5)


@pytest.fixture
def runner() -> Iterator[Answering]:
    answering = Answering()
    try:
        yield answering
    finally:
        answering.close()


def answer(length: str, body: bytes = b"{}") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {length}\r\n\r\n".encode("latin-1") + body


@pytest.mark.parametrize("length", ["9" * 5000, "0" * 19, "\xb2", "+2", "2 2"])
def test_a_malformed_content_length_is_a_misbehaving_runner(runner: Answering,
                                                            length: str) -> None:
    runner.answer = answer(length)
    with pytest.raises(ScalingError, match="malformed Content-Length") as raised:
        runner_exchange("GET", runner.url, None, {}, 10)
    assert raised.value.misbehaving


def test_a_well_formed_content_length_frames_the_answer(runner: Answering) -> None:
    runner.answer = answer("0" * 17 + "2", b"{}ignored")
    assert runner_exchange("GET", runner.url, None, {}, 10) == (200, b"{}")
