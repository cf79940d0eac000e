"""The guest cannot reach the rights endpoint (neonvm/runner/guestnet.py; docs/runner.md,
"Self-fencing"): the rule, on crafted frames, with the rights URL's address and port
blocked. The loopback rule and the real-guest attack are in tests/test_guest_isolation.py
(its tools in tests/support/guest_attack.py).
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from neonvm.runner.guestnet import DEFAULT_GUEST_NETWORK, Blocked, frame_verdict
from neonvm.runner.right import rights_blocked
from tests.support.guest_attack import (
    ACK,
    ECHO,
    SYN,
    command_guest,
    free_port,
    ipv4,
    ipv6,
    listen,
    non_loopback_address,
    tcp,
    udp,
)
from tests.support.rights import ShippedLeader
from tests.support.runner_right import NAMESPACE, TOKEN, UID, VM

RIGHTS4 = ipaddress.ip_address("10.96.12.34")  # a Service's cluster IP
RIGHTS6 = ipaddress.ip_address("fd00:10:96::1234")
BLOCKED = Blocked.of(frozenset({(RIGHTS4, 8443), (RIGHTS6, 8443)}))


def verdict(frame: bytes) -> str | None:
    return frame_verdict(frame, DEFAULT_GUEST_NETWORK, False, BLOCKED)


@pytest.mark.unit
@pytest.mark.parametrize(("frame", "dropped"), [
    (ipv4("10.96.12.34", 6, tcp(8443, SYN)),
     "TCP connection to 10.96.12.34:8443 (a blocked endpoint)"),
    (ipv4("10.96.12.34", 17, udp(8443)), "UDP datagram to 10.96.12.34:8443 (a blocked endpoint)"),
    (ipv6("fd00:10:96::1234", 6, tcp(8443, SYN)),
     "TCP connection to [fd00:10:96::1234]:8443 (a blocked endpoint)"),
    # A fragment is never judged whole here: to the endpoint's address it is dropped.
    (ipv4("10.96.12.34", 6, tcp(8443, SYN), frag=0x2000),
     "IP fragment to 10.96.12.34 (a blocked endpoint's address)"),
    (ipv4("10.96.12.34", 6, b"\x00" * 8, frag=0x0001),
     "IP fragment to 10.96.12.34 (a blocked endpoint's address)"),
    (ipv6("fd00:10:96::1234", 44, b"\x00" * 8),
     "IP fragment to [fd00:10:96::1234] (a blocked endpoint's address)"),
    (ipv4("10.96.12.34", 6, b"\x00" * 6), "short TCP header to 10.96.12.34"),
    # The port on any address: the leader's pod IP serves it too (docs/security.md).
    (ipv4("10.244.1.7", 6, tcp(8443, SYN)),
     "TCP connection to 10.244.1.7:8443 (a blocked endpoint)"),
    (ipv4("10.244.1.7", 17, udp(8443)), "UDP datagram to 10.244.1.7:8443 (a blocked endpoint)"),
    (ipv6("fd00:10:244::7", 6, tcp(8443, SYN)),
     "TCP connection to [fd00:10:244::7]:8443 (a blocked endpoint)"),
    (ipv4("10.244.1.7", 6, tcp(8443, SYN), frag=0x2000),  # a first fragment: has the port
     "IP fragment to 10.244.1.7:8443 (a blocked port)"),
    (ipv6("fd00:10:244::7", 44, bytes([6, 0, 0, 1]) + b"\x00" * 4 + tcp(8443, SYN)),
     "IP fragment to [fd00:10:244::7]:8443 (a blocked port)"),
])
def test_new_flows_to_the_rights_endpoint_are_dropped(frame: bytes, dropped: str) -> None:
    assert verdict(frame) == dropped


@pytest.mark.unit
@pytest.mark.parametrize("frame", [
    ipv4("10.96.12.34", 6, tcp(443, SYN)),        # another port of the same address
    ipv4("10.96.12.34", 1, ECHO),
    ipv4("10.96.12.35", 6, tcp(443, SYN)),        # another address, another port
    ipv4("10.244.1.7", 6, tcp(443, SYN), frag=0x2000),  # a first fragment, another port
    ipv4("10.244.1.7", 6, b"\x00" * 8, frag=0x0001),   # a later one (no port in it)
    ipv4("10.96.12.34", 6, tcp(8443, ACK)),       # opens nothing
    ipv4("10.96.12.34", 6, tcp(8443, SYN | ACK)),
    ipv6("fd00:10:96::1234", 6, tcp(443, SYN)),
])
def test_the_rest_of_the_guests_egress_passes(frame: bytes) -> None:
    assert verdict(frame) is None


@pytest.mark.unit
def test_without_a_rights_url_the_rule_is_unchanged() -> None:
    assert frame_verdict(ipv4("10.96.12.34", 6, tcp(8443, SYN))) is None
    # and the loopback stays closed whatever is blocked besides
    assert verdict(ipv4("127.0.0.1", 6, tcp(8443, SYN))) == "TCP connection to 127.0.0.1:8443"


@pytest.mark.unit
def test_a_rights_host_that_does_not_resolve_at_start_still_has_its_port_closed() -> None:
    """A cluster DNS blip at the runner's start must not open the rights port to the
    guest for the pod's life: the port is closed on every address without DNS."""
    blocked = rights_blocked("http://no-such-host.invalid:8443")
    for frame, dropped in (
            (ipv4("10.96.12.34", 6, tcp(8443, SYN)),  # the Service's address
             "TCP connection to 10.96.12.34:8443 (a blocked endpoint)"),
            (ipv4("10.244.1.7", 6, tcp(8443, SYN)),   # the leader's pod IP
             "TCP connection to 10.244.1.7:8443 (a blocked endpoint)"),
            (ipv4("10.244.1.7", 17, udp(8443)),
             "UDP datagram to 10.244.1.7:8443 (a blocked endpoint)"),
            (ipv4("10.244.1.7", 6, tcp(8443, SYN), frag=0x2000),
             "IP fragment to 10.244.1.7:8443 (a blocked port)")):
        assert frame_verdict(frame, DEFAULT_GUEST_NETWORK, False, blocked) == dropped
    assert frame_verdict(ipv4("10.244.1.7", 6, tcp(443, SYN)), DEFAULT_GUEST_NETWORK,
                         False, blocked) is None


# ---- a real guest tries the rights endpoint -------------------------------------------------


def test_a_guest_cannot_reach_the_rights_endpoint_its_runner_renews_through(
        tmp_path: Path) -> None:
    address = non_loopback_address()
    if address is None:
        pytest.skip("no non-loopback address here: the rights endpoint would be loopback, "
                    "closed to the guest anyway")

    # The shipped rights endpoint, leading; a right of the default length: never lost here.
    leader = ShippedLeader(30.0, token=TOKEN, pod_uid=UID, namespace=NAMESPACE, vm=VM,
                           host=address)
    leader.lead()
    egress = listen(address, "secret-egress")  # the same address, another port
    port = leader.server.port
    script = "\n".join([
        'try() { name=$1; shift; out=$(timeout 8 "$@" 2>&1 | head -c 300 | tr "\\n" " ");',
        '  case "$out" in *HTTP/*|*secret-*) echo "attack $name: REACHED $out";;',
        '  *) echo "attack $name: unreachable ($out)";; esac; }',
        "try rights sh -c \"printf 'GET /guest-probe HTTP/1.0\\r\\n\\r\\n' | "
        f"nc -w 4 {address} {port}\"",
        f"try egress nc -w 4 {address} {egress.port}",
        "echo 'attack: done'"])
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN)
    try:
        with command_guest(tmp_path, script, args=[
                "--port", str(free_port()), "--scaling-token-file", str(token_file),
                "--pod-uid", UID, "--rights-url", leader.url],
                env={"NEONVM_VM_NAME": VM, "NEONVM_VM_NAMESPACE": NAMESPACE}) as guest:
            text = guest.finished("the guest's attempts to finish")
            report = [line for line in text.splitlines() if line.startswith("attack")]
            # Dropped by the filter: the guest's connection attempt times out...
            assert "attack rights: unreachable (nc: timed out" in text, "\n".join(report)
            # ...while the runner, beside it, renews through the same address and port;
            # the guest's probe never got there (it would be answered 404).
            assert leader.answered(200) >= 1
            assert leader.answered(404) == 0 and leader.answered() == leader.answered(200)
            assert "(a blocked endpoint)" in guest.log()  # the filter says why
            # The guest keeps the rest of its network, that address included.
            assert f"attack egress: REACHED {egress.secret}" in text, "\n".join(report)
            assert guest.proc.wait(timeout=120) == 0  # the command ended: powered off
    finally:
        leader.close()
        egress.sock.close()
