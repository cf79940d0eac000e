"""The rights endpoint under hostile asks (docs/security.md, "Rights endpoint"): asks,
however many and whatever their bearer, cost at most one Secret read per VM per
``refresh_after``; a malformed body is a 400 and one short log line. The shipped server
on loopback, with the Secret read counted."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from loguru import logger

from neonvm.api.rights import authorization_header
from neonvm.controller.rights import RightsLedger, RightsServer, RightsService, TokenCache
from tests.support import Clock
from tests.support.rights import ask, caches
from tests.support.rights_ledger import POD_UID, REQUEST, TOKEN, secret

pytestmark = pytest.mark.unit


class Reads:
    """The Secret as the API server would give it, counting each GET."""

    def __init__(self, doc: dict[str, Any] | None) -> None:
        self.doc = doc
        self.count = 0
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def __call__(self, _namespace: str, _name: str) -> dict[str, Any] | None:
        self.count += 1
        self.entered.set()
        self.release.wait(10)
        return self.doc


def serve(reads: Reads, clock: Clock, per_source: int = 32) -> tuple[RightsServer, RightsLedger]:
    ledger = RightsLedger(clock)
    ledger.begin_term(lambda: True)
    service = RightsService(ledger, caches, TokenCache(None, read=reads, clock=clock),
                            lambda _ns, _name, _uid: True)
    return RightsServer(service, "127.0.0.1", 0, per_source=per_source).start(), ledger


@pytest.mark.parametrize("doc", [None, secret(uid="another-uid"), {"metadata": {
    "uid": "sec-uid"}, "data": {}}], ids=["deleted", "recreated", "no-token"])
def test_asks_for_a_vm_without_a_usable_token_read_its_secret_once(doc: Any) -> None:
    reads, clock = Reads(doc), Clock()
    server, _ = serve(reads, clock)
    try:
        statuses = {ask(server.port, REQUEST, authorization_header(b"guess", POD_UID))[0]
                    for _ in range(100)}
        assert statuses == {401}
        assert reads.count == 1
        clock.now += 10.0  # refresh_after: one read more, then cached again
        for _ in range(20):
            ask(server.port, REQUEST, authorization_header(b"guess", POD_UID))
        assert reads.count == 2
    finally:
        server.stop()


def test_wrong_bearers_against_a_cached_token_reread_it_once_per_refresh() -> None:
    reads, clock = Reads(secret()), Clock()
    server, _ = serve(reads, clock)
    try:
        assert ask(server.port, REQUEST, authorization_header(TOKEN, POD_UID))[0] == 200
        clock.now += 11.0
        for _ in range(50):
            assert ask(server.port, REQUEST, authorization_header(b"guess", POD_UID))[0] == 401
        assert reads.count == 2
        assert ask(server.port, REQUEST, authorization_header(TOKEN, POD_UID))[0] == 200
        assert reads.count == 2
    finally:
        server.stop()


def test_concurrent_asks_share_one_read_in_flight() -> None:
    """While one read is in flight (a slow API server), the other workers' asks for the
    same VM wait for it rather than each reading."""
    reads, clock = Reads(None), Clock()
    reads.release.clear()
    server, _ = serve(reads, clock)
    answers: list[int] = []
    threads = [threading.Thread(target=lambda: answers.append(
        ask(server.port, REQUEST, authorization_header(b"guess", POD_UID))[0]))
        for _ in range(8)]
    try:
        for thread in threads:
            thread.start()
        assert reads.entered.wait(10)
        threading.Event().wait(0.3)  # let the other asks reach the server (not asserted on)
        reads.release.set()
        for thread in threads:
            thread.join(10)
        assert answers == [401] * 8
        assert reads.count == 1
    finally:
        reads.release.set()
        server.stop()


@pytest.mark.parametrize("body", [b"[" * 2000 + b"]" * 2000, b"\xff\xfe{", b"{\"a\": NaN",
                                  b"[" * 4000],
                         ids=["nested", "not-utf8", "bad-json", "unclosed-nesting"])
def test_a_malformed_body_is_a_400_and_one_short_log_line(body: bytes) -> None:
    reads, clock = Reads(secret()), Clock()
    server, _ = serve(reads, clock)
    lines: list[str] = []
    sink = logger.add(lines.append, level="DEBUG", format="{level} {message}")
    try:
        status, doc = ask(server.port, None, raw=body)
        assert status == 400 and doc["reason"] == "BadRequest"
        logged = [line for line in lines if "rights" in line]
        assert len(logged) == 1 and len(logged[0]) < 300
        assert "Traceback" not in logged[0] and not logged[0].startswith("ERROR")
        assert server.service.answers.labels(code="400", reason="BadRequest")._value.get() == 1
    finally:
        logger.remove(sink)
        server.stop()


def test_a_refusal_does_not_tell_whether_the_vm_exists_but_the_log_does() -> None:
    """Another namespace's VM names are not learnt by asking: an unknown VM, a VM whose
    current pod is another, and a pod that does not self-fence get the same answer; the
    server's log keeps why."""
    reads, clock = Reads(secret()), Clock()
    server, _ = serve(reads, clock)
    lines: list[str] = []
    sink = logger.add(lines.append, level="DEBUG", format="{message}")
    bearer = authorization_header(TOKEN, POD_UID)
    try:
        unknown = ask(server.port, {**REQUEST, "vm": "no-such-vm"}, bearer)
        other_pod = ask(server.port, {**REQUEST, "podUID": "another-pod"}, bearer)
        assert unknown == other_pod
        assert unknown[0] == 403 and unknown[1]["reason"] == "NotCurrentPod"
        assert "no such VM" in "".join(lines) and "current pod" in "".join(lines)
        assert ask(server.port, REQUEST, bearer)[0] == 200  # the real pod still is granted
    finally:
        logger.remove(sink)
        server.stop()


def test_one_source_holds_at_most_its_share_of_connections() -> None:
    """One pod's connections (or a guest's, through its runner pod's address) beyond the
    per-source cap are closed at once; another source is answered, and a source is
    answered again once its connections are closed."""
    import http.client
    import socket

    from neonvm.api.rights import RIGHTS_PATH

    server, _ = serve(Reads(secret()), Clock(), per_source=4)

    def ask_from(source: str) -> int | None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10,
                                          source_address=(source, 0))
        try:
            conn.request("POST", RIGHTS_PATH, body=b"{}")
            return conn.getresponse().status
        except (ConnectionError, http.client.RemoteDisconnected):
            return None  # closed unanswered
        finally:
            conn.close()

    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    try:
        assert ask_from("127.0.0.1") is None  # the fifth from that address
        assert ask_from("127.0.0.2") == 400  # another source: answered
    finally:
        for sock in held:
            sock.close()
    try:
        from tests.support import wait_for

        wait_for(lambda: ask_from("127.0.0.1") == 400, timeout=10,
                 what="the source's share to be free again")
    finally:
        server.stop()
