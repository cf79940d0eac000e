"""The guest is hostile: it must not reach the runner's control channels, and it keeps
its network.

A guest's user-mode network (QEMU's slirp) maps the guest's 10.0.2.2 and ``fec0::2``
(newer libslirp: its whole virtual network) to the runner container's loopback, and
connects wherever a guest packet points, 127.0.0.1 included. The runner puts a filter on
the guest's frames (``neonvm/runner/guestnet.py``) and opens no QMP TCP port
(docs/security.md, "The guest"; docs/runner.md).

* The rule (pure): which frames the filter drops, from crafted frames
  (``tests/support/guest_attack.py`` builds them, the listeners and the guest).
* The attack: a real guest under QEMU (the runner's kernel, a NeonVM-style bare-ext4
  root from ``neonvm/dev/guestdisk.py``) whose command uses busybox ``nc`` against QMP,
  the runner's API and a stand-in for a loopback service (etcd, the API server), over
  10.0.2.2, ``fec0::2`` and a route to 127.0.0.1 itself, and reports on its console what
  it reached. Each must be unreachable, and the listeners must have accepted nothing.
  Egress to a non-loopback address of this host must still work.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from neonvm.runner.guestnet import DEFAULT_GUEST_NETWORK, frame_verdict, ipv6_nameserver
from tests.support.guest_attack import (
    ACK,
    ECHO,
    HTTP_TO,
    NC_TO,
    SYN,
    Listener,
    command_guest,
    ethernet,
    free_port,
    ipv4,
    ipv6,
    listen,
    non_loopback_address,
    tcp,
    udp,
)

# ---- the rule, on crafted frames ------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(("frame", "dropped"), [
    # The host alias and the rest of the guest's network are the container's loopback.
    (ipv4("10.0.2.2", 6, tcp(20183, SYN)), "TCP connection to 10.0.2.2:20183"),
    (ipv4("10.0.2.2", 6, tcp(25183, SYN)), "TCP connection to 10.0.2.2:25183"),
    (ipv4("10.0.2.77", 6, tcp(2379, SYN)), "TCP connection to 10.0.2.77:2379"),
    (ipv4("10.0.2.3", 6, tcp(2379, SYN)), "TCP connection to 10.0.2.3:2379"),
    (ipv4("10.0.2.2", 17, udp(53)), "UDP datagram to 10.0.2.2:53"),
    (ipv4("10.0.2.255", 17, udp(9)), "UDP datagram to 10.0.2.255:9"),
    (ipv4("10.0.2.9", 1, ECHO), "ICMP to 10.0.2.9"),
    # A guest that routes 127.0.0.1 out of eth0 (slirp connects there as told).
    (ipv4("127.0.0.1", 6, tcp(2379, SYN)), "TCP connection to 127.0.0.1:2379"),
    (ipv4("127.1.2.3", 17, udp(53)), "UDP datagram to 127.1.2.3:53"),
    (ipv4("127.0.0.1", 1, ECHO), "ICMP to 127.0.0.1"),
    (ipv4("0.0.0.0", 6, tcp(25183, SYN)), "TCP connection to 0.0.0.0:25183"),
    # Fragments are never judged whole here, so towards a closed address they are dropped.
    (ipv4("10.0.2.3", 17, udp(53), frag=0x2000), "IPv4 fragment to 10.0.2.3"),
    (ipv4("127.0.0.1", 6, b"\x00" * 8, frag=0x0001), "IPv4 fragment to 127.0.0.1"),
    (ipv4("10.0.2.2", 47, b"\x00" * 8), "protocol 47 to 10.0.2.2"),
    # IPv6: the host alias, loopback, and IPv4 addresses in IPv6 form.
    (ipv6("fec0::2", 6, tcp(20183, SYN)), "TCP connection to [fec0::2]:20183"),
    (ipv6("::1", 6, tcp(2379, SYN)), "TCP connection to [::1]:2379"),
    (ipv6("::ffff:127.0.0.1", 6, tcp(2379, SYN)), "TCP connection to [::ffff:7f00:1]:2379"),
    (ipv6("::127.0.0.1", 17, udp(53)), "UDP datagram to [::7f00:1]:53"),
    (ipv6("fec0::99", 58, b"\x80\x00\x00\x00"), "ICMP to [fec0::99]"),
    # A header too short to judge.
    (ethernet(0x0800, b"\x45\x00"), "malformed IPv4 header"),
    (ethernet(0x86DD, b"\x60" + b"\x00" * 10), "malformed IPv6 header"),
])
def test_the_filter_drops_new_flows_to_the_runners_loopback(frame: bytes, dropped: str) -> None:
    assert frame_verdict(frame) == dropped


@pytest.mark.unit
@pytest.mark.parametrize("frame", [
    # Egress: anything outside the guest's network and the loopback.
    ipv4("192.0.2.2", 6, tcp(5432, SYN)),
    ipv4("10.96.0.1", 6, tcp(443, SYN)),
    ipv4("10.0.3.2", 17, udp(4000)),
    ipv4("8.8.8.8", 1, ECHO),
    ipv6("2001:db8::1", 6, tcp(443, SYN)),
    ipv4("192.0.2.2", 17, udp(4000), frag=0x2000),
    # DNS through the DNS alias, DHCP, and pings that slirp answers itself.
    ipv4("10.0.2.3", 17, udp(53)),
    ipv4("10.0.2.3", 6, tcp(53, SYN)),
    ipv4("255.255.255.255", 17, udp(67)),
    ipv4("10.0.2.2", 17, udp(67)),
    ipv4("10.0.2.2", 1, ECHO),
    ipv6("fec0::2", 58, b"\x87\x00\x00\x00"),  # neighbour solicitation to the router
    # Segments that open nothing: answers on connections forwarded into the guest, which
    # slirp shows as coming from 10.0.2.2 when their client is on the pod's loopback.
    ipv4("10.0.2.2", 6, tcp(41000, SYN | ACK)),
    ipv4("10.0.2.2", 6, tcp(41000, ACK)),
    ipv6("fec0::2", 6, tcp(41000, ACK)),
    # Not IP: ARP (slirp answers from its own table), and runts.
    ethernet(0x0806, b"\x00" * 28),
    b"\x00" * 10,
])
def test_the_filter_passes_egress_dns_dhcp_and_answers(frame: bytes) -> None:
    assert frame_verdict(frame) is None


@pytest.mark.unit
@pytest.mark.parametrize("frame", [ipv6("fec0::3", 17, udp(53)),
                                   ipv6("fec0::3", 6, tcp(53, SYN))])
def test_dns_to_the_ipv6_alias_passes_only_with_an_ipv6_nameserver(frame: bytes) -> None:
    # Without an IPv6 nameserver in the container's resolv.conf (an IPv4-only pod), slirp
    # sends DNS for fec0::3 to [::1]:53, the runner container's loopback.
    assert frame_verdict(frame, dns6=True) is None
    why = frame_verdict(frame)
    assert why is not None and "[fec0::3]:53" in why and "no IPv6 nameserver" in why, why
    # The rest of the IPv6 alias is as closed either way.
    assert frame_verdict(ipv6("fec0::3", 17, udp(54)), dns6=True) == "UDP datagram to [fec0::3]:54"


@pytest.mark.unit
@pytest.mark.parametrize(("resolv_conf", "found"), [
    ("search default.svc.cluster.local svc.cluster.local\nnameserver 10.96.0.10\n"
     "options ndots:5\n", False),
    ("", False),
    ("# nameserver fd00::10\nnameserver 10.96.0.10\n", False),
    ("nameserver 10.96.0.10\nnameserver fd00:10:96::a\n", True),
    ("nameserver fe80::1%eth0\n", True),
    ("nameserver not-an-address\n", False),
])
def test_the_runner_finds_an_ipv6_nameserver_in_resolv_conf(resolv_conf: str,
                                                             found: bool) -> None:
    assert ipv6_nameserver(resolv_conf) is found


@pytest.mark.unit
def test_the_netdev_is_pinned_to_the_addresses_the_filter_knows() -> None:
    assert DEFAULT_GUEST_NETWORK.netdev_options() == (
        "net=10.0.2.0/24,host=10.0.2.2,dns=10.0.2.3,"
        "ipv6-net=fec0::/64,ipv6-host=fec0::2,ipv6-dns=fec0::3")


# ---- the attack, from a real guest ----------------------------------------------------------


@pytest.fixture
def listeners() -> Iterator[list[Listener]]:
    made: list[Listener] = []
    yield made
    for listener in made:
        listener.sock.close()


def attack_script(targets: list[tuple[str, str]], egress: tuple[str, str] | None,
                  api_by_pod_ip: str | None) -> str:
    """The guest's command: try each (name, "host port") and say what came back."""
    lines = [
        'try() { name=$1; shift; out=$(timeout 8 "$@" 2>&1 | head -c 300 | tr "\\n" " ");',
        '  case "$out" in *QMP*|*HTTP/*|*secret-*) echo "attack $name: REACHED $out";;',
        '  *) echo "attack $name: unreachable ($out)";; esac; }',
        # Another address of the guest's network, sent to the gateway like any other.
        "ip route add 10.0.2.77/32 via 10.0.2.2 dev eth0",
        # IPv6 comes from slirp's router advertisements: wait for the address.
        "for i in $(seq 120); do ip -6 addr show dev eth0 | grep -q 'inet6 fec0' &&"
        " ! ip -6 addr show dev eth0 | grep -q tentative && break; sleep 0.5; done",
        "echo \"attack: IPv6 $(ip -6 addr show dev eth0 | grep -o 'inet6 fec0[^ ]*')\"",
    ]
    # The attempts that must time out run side by side (each waits out its own nc -w 4);
    # tty writes are atomic, so each report stays one line.
    for name, how in targets:
        lines.append(f"try {name} {how} &")
    lines.append("wait")
    if egress is not None:
        lines.append(f"try {egress[0]} {egress[1]}")
    if api_by_pod_ip is not None:
        lines.append("try api-by-pod-ip sh -c \"printf 'PUT /scale HTTP/1.0\\r\\n"
                     f"Content-Length: 2\\r\\n\\r\\n{{}}' | nc -w 4 {api_by_pod_ip}\"")
    # Last, as it takes 127.0.0.1 away from the guest's own loopback: send it out of eth0.
    lines += [
        "ip route del local 127.0.0.0/8 dev lo table local",
        "ip route del local 127.0.0.1 dev lo table local",
        "sysctl -w net.ipv4.conf.all.route_localnet=1 net.ipv4.conf.eth0.route_localnet=1",
        "ip route add 127.0.0.1/32 via 10.0.2.2 dev eth0 src 10.0.2.15",
        "echo \"attack: 127.0.0.1 goes $(ip route get 127.0.0.1)\"",
    ]
    return "\n".join(lines)


def test_a_hostile_guest_reaches_neither_qmp_nor_the_runner_nor_loopback_but_keeps_egress(
        tmp_path: Path, listeners: list[Listener]) -> None:
    qmp, api = free_port(), free_port()
    etcd = listen("127.0.0.1", "secret-loopback")  # stands in for etcd, the API server...
    listeners.append(etcd)
    targets = [("qmp", f"{NC_TO} 10.0.2.2 {qmp}"),
               ("qmp-v6", f"{NC_TO} fec0::2 {qmp}"),
               ("runner-api", f"{HTTP_TO} 10.0.2.2 {api}"),
               ("runner-api-v6", f"{HTTP_TO} fec0::2 {api}"),
               ("loopback-service", f"{NC_TO} 10.0.2.2 {etcd.port}"),
               ("loopback-service-other-alias", f"{NC_TO} 10.0.2.77 {etcd.port}")]
    closed = [etcd]
    if socket.has_ipv6:
        with_v6 = listen("::1", "secret-loopback6")
        listeners.append(with_v6)
        closed.append(with_v6)
        targets.append(("loopback-service-v6", f"{NC_TO} fec0::2 {with_v6.port}"))
    address = non_loopback_address()
    egress: Listener | None = None
    if address is not None:
        egress = listen(address, "secret-egress")
        listeners.append(egress)
    script = attack_script(
        targets, ("egress", f"{NC_TO} {address} {egress.port}") if egress else None,
        f"{address} {api}" if address else None)
    script += f"\ntry loopback-direct {NC_TO} 127.0.0.1 {etcd.port}\necho 'attack: done'\n"

    with command_guest(tmp_path, script, spec={"qmp": qmp}, args=[
            "--listen-address", "0.0.0.0", "--port", str(api)]) as guest:  # as in a pod
        text = guest.finished("the guest's attacks to finish")
        report = [line for line in text.splitlines() if line.startswith("attack")]
        print("\n" + "\n".join(report))
        for name, _how in [*targets, ("loopback-direct", "")]:
            # Dropped: the guest's connection attempt times out.
            assert f"attack {name}: unreachable (nc: timed out" in text, "\n".join(report)
        assert "attack: IPv6 inet6 fec0:" in text, "\n".join(report)  # v6 attempts are real
        assert "attack: 127.0.0.1 goes 127.0.0.1 via 10.0.2.2 dev eth0" in text, \
            "\n".join(report)  # the direct attempt really left through the network
        for listener in closed:
            assert listener.accepted == [], f"{listener.secret} accepted {listener.accepted}"
            assert listener.secret not in text
        if egress is not None:
            # The guest keeps its network: a non-loopback address of this host answers.
            assert f"attack egress: REACHED {egress.secret}" in text, "\n".join(report)
            assert egress.accepted
            # The runner's API on the pod's IP is open to the guest as to any pod, and
            # its one command still needs the token.
            assert "attack api-by-pod-ip: REACHED HTTP/1.1 401" in text, "\n".join(report)
        else:
            print("no non-loopback address on this host: egress not checked")
        assert guest.proc.wait(timeout=120) == 0  # the command ended: the guest powered off
