"""The guest cannot reach the rights endpoint (neonvm/runner/guestnet.py; docs/runner.md,
"Self-fencing"): the rule, on crafted frames, with the rights URL's address and port
blocked. The loopback rule and the real-guest attack are in tests/test_guest_isolation.py.
"""

from __future__ import annotations

import ipaddress

import pytest

from neonvm.runner.guestnet import DEFAULT_GUEST_NETWORK, frame_verdict
from tests.test_guest_isolation import ACK, ECHO, SYN, ipv4, ipv6, tcp, udp

pytestmark = pytest.mark.unit

RIGHTS4 = ipaddress.ip_address("10.96.12.34")  # a Service's cluster IP
RIGHTS6 = ipaddress.ip_address("fd00:10:96::1234")
BLOCKED = frozenset({(RIGHTS4, 8443), (RIGHTS6, 8443)})


def verdict(frame: bytes) -> str | None:
    return frame_verdict(frame, DEFAULT_GUEST_NETWORK, False, BLOCKED)


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
])
def test_new_flows_to_the_rights_endpoint_are_dropped(frame: bytes, dropped: str) -> None:
    assert verdict(frame) == dropped


@pytest.mark.parametrize("frame", [
    ipv4("10.96.12.34", 6, tcp(443, SYN)),        # another port of the same address
    ipv4("10.96.12.34", 1, ECHO),
    ipv4("10.96.12.35", 6, tcp(8443, SYN)),       # another address, same port
    ipv4("10.96.12.34", 6, tcp(8443, ACK)),       # opens nothing
    ipv4("10.96.12.34", 6, tcp(8443, SYN | ACK)),
    ipv6("fd00:10:96::1234", 6, tcp(443, SYN)),
])
def test_the_rest_of_the_guests_egress_passes(frame: bytes) -> None:
    assert verdict(frame) is None


def test_without_a_rights_url_the_rule_is_unchanged() -> None:
    assert frame_verdict(ipv4("10.96.12.34", 6, tcp(8443, SYN))) is None
    # and the loopback stays closed whatever is blocked besides
    assert verdict(ipv4("127.0.0.1", 6, tcp(8443, SYN))) == "TCP connection to 127.0.0.1:8443"
