"""Which asks the rights server answers when they come faster than its workers
(docs/protocol.md, "Stale asks dropped, oldest first"): the oldest complete ask first, so
no flood of later asks from another source can bury it, and an ask that has waited half
of a runner's wait for its answer is closed unanswered, before any work (no pod written,
no grant recorded), and counted. With no backlog nothing changes. An ask of a condemned
pod holds no worker on the API server: it is refused before the term's pod write.

The shipped server on loopback, one worker held inside a term's pod write (the first
grant of a runner that has not started its guest) so that asks queue behind it; the
listener's clock is a fake the test moves, so no wait depends on the machine's speed.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from neonvm.api.rights import RIGHTS_PATH, authorization_header
from neonvm.controller.rights import (
    STALE_AFTER,
    RightsLedger,
    RightsServer,
    RightsService,
    TokenCache,
)
from tests.support import Clock, wait_for
from tests.support.rights import Cache, caches, secret

pytestmark = pytest.mark.unit

TOKEN = b"queue-test-token"
DROPPED = "neonvm_controller_rights_asks_dropped_total"
VMS = ("held", "first", "second", "third")
FLOOD = tuple(f"flood-{i}" for i in range(4))
"""The VMs whose asks come from the flooding source :data:`FLOODER` (well-formed asks,
only so that the pod writes show the order the worker took them in: the listener
orders asks before it reads them)."""
FLOODER = "127.0.0.2"
"""Another loopback address (all of 127/8 is local on Linux): a second source."""


def uid(vm: str) -> str:
    return f"pod-{vm}"


class Leader:
    """A leading term's rights server for the VMs :data:`VMS` and :data:`FLOOD`, with
    ``workers`` threads.
    The pod write of VM ``held`` waits for :attr:`release`; every pod write is recorded in
    :attr:`written`, in the order the workers made them."""

    def __init__(self, workers: int) -> None:
        self.clock = Clock()
        self.release = threading.Event()
        self.written: list[str] = []
        vms, pods = Cache(), Cache()
        for vm in VMS + FLOOD:
            one_vm, one_pod = caches(vm_name=vm, vm_uid=f"vm-{vm}", pod_uid=uid(vm))
            vms.update(one_vm)
            pods.update(one_pod)
        self.ledger = RightsLedger(self.clock)
        self.ledger.begin_term(lambda: True)
        self.registry = CollectorRegistry()
        service = RightsService(
            self.ledger, lambda: (vms, pods),
            TokenCache(None, read=lambda _ns, _name: secret(TOKEN), clock=self.clock),
            self._write, registry=self.registry)
        self.server = RightsServer(service, "127.0.0.1", 0, workers=workers,
                                   clock=self.clock).start()

    def _write(self, _namespace: str, name: str, _uid: str) -> bool:
        vm = name.removesuffix("-p")
        self.written.append(vm)
        if vm == "held":
            self.release.wait(60)
        return True

    def send(self, vm: str, source: str = "127.0.0.1") -> socket.socket:
        """Send VM ``vm``'s ask from address ``source`` on a new connection; the answer
        is read later."""
        body = json.dumps({"namespace": "ns", "vm": vm, "podUID": uid(vm)}).encode()
        sock = socket.create_connection(("127.0.0.1", self.server.port), timeout=30,
                                        source_address=(source, 0))
        sock.sendall(
            f"POST {RIGHTS_PATH} HTTP/1.1\r\nHost: rights\r\n"
            f"Authorization: {authorization_header(TOKEN, uid(vm))}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            .encode() + body)
        return sock

    def queue(self, *vms: str, source: str = "127.0.0.1") -> list[socket.socket]:
        """Send these asks from ``source`` one after the other, each once the one before
        waits complete."""
        sent = []
        for vm in vms:
            expected = self.server.waiting() + 1
            sent.append(self.send(vm, source))
            self._wait_waiting(expected, vm)
        return sent

    def _wait_waiting(self, expected: int, vm: str) -> None:
        wait_for(lambda: self.server.waiting() == expected, 30, 0.01,
                 what=f"{vm}'s ask waiting for a worker")

    def hold_the_worker(self) -> socket.socket:
        """Send ``held``'s ask and wait until a worker is inside its pod write."""
        sock = self.send("held")
        wait_for(lambda: "held" in self.written, 30, 0.01, what="a worker held in a pod write")
        return sock

    def dropped(self) -> float | None:
        """The dropped-asks counter as the registry serves it (None: not served)."""
        return self.registry.get_sample_value(DROPPED)

    def close(self) -> None:
        self.release.set()
        self.server.stop()


def answer(sock: socket.socket) -> bytes:
    """Everything the server sent before it closed the connection."""
    data = b""
    with sock:
        while chunk := sock.recv(4096):
            data += chunk
    return data


def status(data: bytes) -> int | None:
    return int(data.split()[1]) if data.startswith(b"HTTP/1.1 ") else None


@pytest.fixture
def one_worker() -> Iterator[Leader]:
    leader = Leader(workers=1)
    yield leader
    leader.close()


def test_a_flood_of_later_asks_from_another_source_does_not_bury_an_earlier_ask(
        one_worker: Leader) -> None:
    held = one_worker.hold_the_worker()
    [legitimate] = one_worker.queue("first")
    flood = one_worker.queue(*FLOOD, source=FLOODER)
    one_worker.release.set()
    assert status(answer(held)) == 200
    assert status(answer(legitimate)) == 200
    assert one_worker.written[:2] == ["held", "first"]  # taken before any later ask
    assert [status(answer(sock)) for sock in flood] == [200] * len(FLOOD)
    assert one_worker.written == ["held", "first", *FLOOD]  # then in arrival order
    assert one_worker.dropped() == 0


def test_an_ask_that_waited_half_as_long_as_its_runner_waits_is_closed_unanswered(
        one_worker: Leader) -> None:
    held = one_worker.hold_the_worker()
    [late] = one_worker.queue("first")
    one_worker.clock.now += STALE_AFTER  # half its runner's wait is gone
    fresh = one_worker.send("second")  # accepted now: its runner still waits
    one_worker.release.set()
    assert status(answer(held)) == 200
    assert answer(late) == b""  # closed, no answer
    assert status(answer(fresh)) == 200
    assert one_worker.dropped() == 1
    # Dropped before any work: its pod was not written and no grant was recorded.
    assert "first" not in one_worker.written
    assert not one_worker.ledger.granted_this_term(uid("first"))
    assert one_worker.ledger.granted_this_term(uid("second"))


def test_a_condemned_pods_asks_are_refused_before_any_pod_write(one_worker: Leader) -> None:
    """A condemned pod is never granted again in the term, so its asks must not hold a
    worker on the API server either: no term mark is written for them."""
    one_worker.release.set()  # no ask is held
    one_worker.clock.now += 3600.0  # no right of "first" can still run
    assert one_worker.ledger.condemn(uid("first"), 10.0) == 0.0
    for _ in range(2):  # every ask, not only the first
        data = answer(one_worker.send("first"))
        assert status(data) == 403
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["reason"] == "Condemned"
    assert one_worker.written == []
    assert not one_worker.ledger.granted_this_term(uid("first"))


def test_with_no_backlog_every_ask_is_answered_in_turn_and_none_dropped() -> None:
    leader = Leader(workers=4)
    leader.release.set()  # no ask is held
    try:
        for vm in VMS:
            assert status(answer(leader.send(vm))) == 200
            leader.clock.now += 3600.0  # an idle server: each ask's age is its own
        assert leader.written == list(VMS)
        assert leader.dropped() == 0
    finally:
        leader.close()
