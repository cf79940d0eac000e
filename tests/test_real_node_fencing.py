"""Self-fencing drills on two real kubelet nodes (issue 32; neonvm/drills/fencing.py,
docs/drills.md "Self-fencing drills on real nodes").

Opt-in (``NEONVM_TEST_REAL_NODE=1 pytest tests/test_real_node_fencing.py -s``): two real
nodes, two self-fencing controller replicas (D = 20 s), one VM whose guest boots under
QEMU; then each drill once, in order, the VM moving between the nodes, the leader
SIGKILLed at a random moment of each. Guests are counted from the host's processes
(neonvm/drills/guests.py), not from the controller. Runs of 20 and 10 are made with
``python -m neonvm.drills.fencing`` and recorded in docs/drills.md.

The rights forwarder (kube-proxy's part for the rights Service) is checked on the
session's API server with a loopback server, without a real node.
"""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator

import pytest
from kubernetes import client

from neonvm.controller.leader_endpoint import LeaderEndpoint
from neonvm.dev.cluster import LocalCluster
from neonvm.drills import fencing, fleet
from tests.support import wait_for
from tests.support.real_node import _skip_reason

RIGHT_SECONDS = 20.0
"""D: with 10 s, a leader killed at a random moment (failover after the 6 s lease, the
new leader's cache sync and slice write, on a loaded machine) left runners without a
grant for D, and a healthy guest killed itself (docs/drills.md)."""


def host_address() -> str | None:
    """An IPv4 address of this host that is not loopback (``ip -o -4 addr``)."""
    out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if len(fields) > 3 and not fields[3].startswith("127."):
            return fields[3].split("/")[0]
    return None


@pytest.mark.cluster
def test_the_rights_forwarder_sends_each_connection_to_the_leader_the_slice_names(
        api: client.ApiClient, namespace: str) -> None:
    """A connection to the forwarder reaches the server the EndpointSlice names; after
    another leader writes the slice, new connections reach that one."""
    address = host_address()
    if address is None:
        pytest.skip("no non-loopback IPv4 address on this host (an EndpointSlice refuses "
                    "loopback addresses)")
    servers = [socket.create_server((address, 0)) for _ in range(2)]

    def answer(sock: socket.socket, word: bytes) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = sock.accept()
                with conn:
                    conn.recv(16)
                    conn.sendall(word)

    for sock, word in zip(servers, (b"A", b"B"), strict=True):
        threading.Thread(target=answer, args=(sock, word), daemon=True).start()

    def ask(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            c.sendall(b"?")
            return c.recv(16)

    with fencing.RightsProxy(api, "127.0.0.1", namespace=namespace,
                             service="rights") as proxy:
        for sock, word in zip(servers, (b"A", b"B"), strict=True):
            LeaderEndpoint(api, namespace, "rights", address,
                           sock.getsockname()[1]).publish()
            def reached(w: bytes = word) -> bool:
                try:  # refused (closed) until the forwarder has read the slice
                    return ask(proxy.port) == w
                except OSError:
                    return False

            wait_for(reached, timeout=30, interval=0.2,
                     what=f"the forwarder to reach leader {word!r}")
    for sock in servers:
        sock.close()


@pytest.fixture
def rig(cluster: LocalCluster, api: client.ApiClient) -> Iterator[fencing.Rig]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from neonvm.dev import realguest

    problem = realguest.unavailable_reason()
    if problem:
        pytest.skip(f"no real guest here: {problem}")
    if cluster.spec.nodes < 1:
        pytest.skip("needs NEONVM_TEST_NODES >= 1 (the controller-manager marks a node "
                    "NotReady)")
    r = fencing.prepare(cluster, client.ApiClient(api.configuration),
                        right_seconds=RIGHT_SECONDS, say=print)
    try:
        yield r
    finally:
        with contextlib.suppress(Exception):
            fleet.delete_vms(api, r.namespace)
            fleet.wait_gone(api, r.namespace, 120, lambda _m: None)
        r.close()
        for node in r.nodes:
            fencing.NodeFault(node).heal()
            node.stop()


@pytest.mark.cluster
@pytest.mark.realnode
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_self_fencing_drills_on_two_real_nodes(rig: fencing.Rig) -> None:
    wait_for(rig.leader, timeout=120, interval=0.5, what="a leader")
    vm = f"fence-{uuid.uuid4().hex[:4]}"
    fencing.create_vm(rig, vm)
    rng = random.Random(32)
    results = {}
    for drill in fencing.DRILLS:
        results[drill] = r = fencing.run_drill(rig, drill, vm, rng=rng)
        print(r.line(), flush=True)

    off = results["power-off"]
    assert off.freeze_to_ready is not None, off.line()  # replaced on the other node
    assert off.running_overlaps == 0 and off.may_run_overlaps == 0, off.line()

    cut = results["partition"]
    assert cut.freeze_to_ready is not None, cut.line()
    assert cut.runner_log, "the runner did not log that it fenced itself"
    assert cut.running_overlaps == 0 and cut.may_run_overlaps == 0, cut.line()

    crash = results["kubelet-crash"]
    assert crash.replacements == 0 and crash.ok, crash.line()

    thaw = results["freeze-thaw"]
    assert thaw.freeze_to_ready is not None, thaw.line()
    assert thaw.old_gone_after_fault is not None, thaw.line()  # the old guest died
    print(f"freeze-thaw: the old guest ran {thaw.after_thaw_running}s after its SIGCONT "
          f"(cpu {thaw.after_thaw_cpu}s); moments with two running guests "
          f"{thaw.running_overlaps}")
