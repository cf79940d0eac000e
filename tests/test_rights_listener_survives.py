"""No request stops the rights listener (docs/security.md, "Rights endpoint").

Every runner of the fleet asks one listener per replica; if its selector thread died, no
ask would be answered again and every guest would self-fence within a right's duration.
So a malformed ``Content-Length`` is answered 400 (parsed as at most
:data:`~neonvm.controller.rights.MAX_LENGTH_DIGITS` ASCII digits), a bug one request hits
costs that request's connection only (counted), and if a listener thread ends anyway the
replica's liveness check fails, so the kubelet restarts it.

The shipped server on loopback, with a leading term's fake caches (no API server).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from neonvm.controller import rights as rights_module
from neonvm.controller.rights import RightsLedger, RightsServer, RightsService, TokenCache
from neonvm.leader.health import HealthServer
from tests.support import closed_by_server, wait_for
from tests.support.rights import Cache, secret

pytestmark = pytest.mark.unit

ERRORS = "neonvm_controller_rights_request_errors_total"


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def server(registry: CollectorRegistry) -> Iterator[RightsServer]:
    """A leading term's rights server with one worker."""
    ledger = RightsLedger()
    ledger.begin_term(lambda: True)
    service = RightsService(ledger, lambda: (Cache(), Cache()),
                            TokenCache(None, read=lambda _ns, _name: secret(b"t")),
                            lambda *_: True, registry=registry)
    with RightsServer(service, "127.0.0.1", 0, workers=1) as started:
        yield started


def exchange(server: RightsServer, request: bytes) -> bytes:
    """Send ``request`` on a new connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
        return answer


def still_answers(server: RightsServer) -> None:
    """A well-formed request on a new connection is answered as ever."""
    assert exchange(server, b"POST /x HTTP/1.1\r\nHost: a\r\n\r\n").startswith(
        b"HTTP/1.1 404 ")
    server.health_check()  # raises if a listener thread has ended


def errors(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value(ERRORS)


# ---- a malformed Content-Length -------------------------------------------------------------


@pytest.mark.parametrize("length", [
    "\xb2", "\xb3", "\xb9",  # latin-1 superscripts: str.isdigit() takes them, int() not
    "9" * 5000,              # over int()'s 4,300 digits
    "0" * 10,                # over MAX_LENGTH_DIGITS, however small its value
    "5\xb2", "+5", "5 5",    # a digit then a superscript, a sign, an inner space
])
def test_a_malformed_content_length_is_answered_400_and_the_next_ask_is_answered(
        server: RightsServer, registry: CollectorRegistry, length: str) -> None:
    head = f"POST /v1/rights HTTP/1.1\r\nContent-Length: {length}\r\n\r\n"
    assert exchange(server, head.encode("latin-1")).startswith(b"HTTP/1.1 400 ")
    still_answers(server)
    assert errors(registry) == 0


def test_nine_digits_are_a_length_and_an_over_large_one_is_refused_413(
        server: RightsServer) -> None:
    answer = exchange(server, b"POST /v1/rights HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413 ")


# ---- a bug one request hits -----------------------------------------------------------------


def test_a_request_that_raises_while_its_head_is_read_costs_its_connection_only(
        server: RightsServer, registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    parse = rights_module._headers

    def buggy(head: bytes) -> tuple[list[str], dict[str, str]]:
        if b"X-Bug" in head:
            raise RuntimeError("a parser bug")
        return parse(head)

    monkeypatch.setattr(rights_module, "_headers", buggy)  # read on the selector thread
    assert exchange(server, b"POST /v1/rights HTTP/1.1\r\nX-Bug: 1\r\n\r\n") == b""
    assert errors(registry) == 1
    still_answers(server)


def test_a_request_that_raises_while_it_is_answered_costs_its_connection_only(
        server: RightsServer, registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    def buggy(head: bytes) -> bool:
        if b"X-Bug" in head:
            raise RuntimeError("a bug outside the service's own guard")
        return False

    monkeypatch.setattr(rights_module, "_bare_line_break", buggy)  # read by the worker
    assert exchange(server, b"POST /v1/rights HTTP/1.1\r\nX-Bug: 1\r\n\r\n") == b""
    assert errors(registry) == 1
    still_answers(server)  # by the one worker, which went on


# ---- a thread that ended anyway -------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_listener_thread_that_ended_fails_the_liveness_check(
        server: RightsServer) -> None:
    health = HealthServer(0, CollectorRegistry(), host="127.0.0.1")
    health.add_check("rights-listener", server.health_check, readiness=False)
    assert [r.ok for r in health.run_checks("healthz")] == [True]

    listener = server._listener
    assert listener is not None

    def ends() -> None:
        raise SystemExit  # what no Exception guard catches: the thread ends

    listener._select_turn = ends  # type: ignore[method-assign]
    with socket.create_connection(("127.0.0.1", server.port), timeout=10):
        pass  # wakes the selector, which then runs ends()
    failed = wait_for(lambda: [r for r in health.run_checks("healthz") if not r.ok], 10,
                      what="the liveness check to fail")
    assert failed[0].reason == "rights listener thread(s) ended or stuck: rights-server"


def test_a_selector_whose_every_turn_fails_fails_the_liveness_check(
        server: RightsServer) -> None:
    listener = server._listener
    assert listener is not None
    listener._stuck_after = 0.5  # the shipped STUCK_AFTER is 30 s

    def fails() -> None:
        raise RuntimeError("a turn that fails every time")

    listener._select_turn = fails  # type: ignore[method-assign]
    reason = wait_for(lambda: _failure(server), 10, what="the liveness check to fail")
    assert "rights-server (no whole turn for" in reason


def _failure(server: RightsServer) -> str:
    try:
        server.health_check()
    except RuntimeError as exc:
        return str(exc)
    return ""


def test_a_connection_that_raises_once_accepted_is_closed_and_its_source_count_freed(
        server: RightsServer, registry: CollectorRegistry, held: list[socket.socket],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Closed at once, not at its read timeout (long here), and not left open forever."""
    with RightsServer(server.service, "127.0.0.1", 0, workers=1,
                      read_timeout=600.0) as patient:
        listener = patient._listener
        assert listener is not None

        def broken(*_args: object, **_kwargs: object) -> None:
            raise RuntimeError("a bug while a connection is taken in")

        monkeypatch.setattr(listener._selector, "register", broken)
        held.append(socket.create_connection(("127.0.0.1", patient.port), timeout=10))
        wait_for(lambda: closed_by_server(held[-1]), 30, what="the connection closed")
        assert listener._sources == {} and listener._reading == {}
        assert errors(registry) == 1
        monkeypatch.undo()
        still_answers(patient)


# ---- a head that costs parsing --------------------------------------------------------------


def test_a_head_of_two_thousand_header_lines_is_refused_400(server: RightsServer) -> None:
    head = b"POST /x HTTP/1.1\r\n" + b"a:\r\n" * 2000 + b"Content-Length: 2\r\n\r\n{}"
    assert exchange(server, head).startswith(b"HTTP/1.1 400 ")  # not the path's 404
    still_answers(server)


def test_a_body_trickled_in_byte_by_byte_is_parsed_once_on_the_selector_thread(
        server: RightsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    parse = rights_module._headers
    on_selector: list[bytes] = []

    def counted(head: bytes) -> tuple[list[str], dict[str, str]]:
        if threading.current_thread().name == "rights-server":
            on_selector.append(head)
        return parse(head)

    monkeypatch.setattr(rights_module, "_headers", counted)
    body = b"x" * 20
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(b"POST /x HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body))
        wait_for(lambda: on_selector, 10, what="the head parsed")  # before any body byte
        for byte in body:  # each after the head: at least one more recv
            sock.sendall(bytes([byte]))
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 404 ")  # the whole request was read and answered
    assert len(on_selector) == 1

