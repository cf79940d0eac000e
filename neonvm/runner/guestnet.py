"""The guest's network boundary: a filter in front of QEMU's user-mode network (slirp).

QEMU's slirp (libslirp 4.7, QEMU 7.2) maps the guest's host alias (``10.0.2.2``,
``fec0::2``; newer libslirp: the whole virtual network but the DNS alias) to the runner
container's loopback, and it connects wherever a guest packet points, ``127.0.0.1``
included. QEMU 7.2
offers no option to turn that off (libslirp's ``disable_host_loopback`` is not exposed),
so without this filter a guest reaches every loopback service of the runner's container.

The filter sits on the frames the guest sends to slirp. QEMU's ``filter-redirector``
(no privilege needed) hands each one to the runner over a unix socket; the runner passes
it back over a second socket or drops it. :func:`frame_verdict` is the rule, a pure
function:

* a new TCP connection (SYN without ACK), a UDP datagram, an ICMP message or an IP
  fragment towards a *closed* address is dropped;
* closed: the loopback (``127.0.0.0/8``, ``::1``), the unspecified and "this network"
  addresses (``0.0.0.0/8``, ``::``), IPv4-mapped or -compatible IPv6 addresses, and the
  guest's virtual network itself, apart from DNS (port 53 of the DNS alias; of the IPv6
  one only when the container has an IPv6 nameserver, see :func:`ipv6_nameserver`), DHCP
  (to the host alias or broadcast), and ICMP to the host or DNS alias (slirp answers those
  itself);
* a new TCP connection or a UDP datagram to a *blocked endpoint*'s port (the
  self-fencing runner's rights URL, :mod:`neonvm.runner.right`) on *any* address (the
  leader's pod IP is as reachable as the Service's), any IP fragment to the endpoint's
  address, and a first fragment to its port elsewhere, are dropped too;
* everything else passes: the guest keeps its egress, and TCP segments that open nothing
  (replies on connections forwarded *into* the guest) pass too.

Guaranteed: no frame reaches slirp before the filter has seen it, and if the runner stops
reading, frames stop (the guest's network fails closed). Not guaranteed: what the pod's
own IP serves (the runner's HTTP port, the guest's forwarded ports) stays reachable from
the guest as from any pod; a DNS server that the container's ``resolv.conf`` puts on
loopback is reachable on port 53; UDP replies to loopback clients of a UDP port forward
are dropped. docs/security.md ("The guest") and docs/runner.md have the reasons.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from neonvm.runner.errors import HostError

ETH_HEADER = 14
ETH_IPV4 = 0x0800
ETH_IPV6 = 0x86DD
TCP, UDP, ICMP, ICMPV6 = 6, 17, 1, 58
IPV6_FRAGMENT = 44
DNS_PORT = 53
DHCP_SERVER_PORT = 67
MAX_FRAME = 1 << 17
"""The longest frame accepted from QEMU (slirp's MTU is 1500; 128 KiB leaves room)."""

_LOOPBACK4 = ipaddress.IPv4Network("127.0.0.0/8")
_THIS_NETWORK4 = ipaddress.IPv4Network("0.0.0.0/8")
_BROADCAST4 = ipaddress.IPv4Address("255.255.255.255")
_V4_COMPATIBLE6 = ipaddress.IPv6Network("::/96")
_V4_MAPPED6 = ipaddress.IPv6Network("::ffff:0:0/96")


@dataclass(frozen=True)
class GuestNetwork:
    """The guest's virtual network, as QEMU's ``-netdev user`` is told."""

    net: ipaddress.IPv4Network
    host: ipaddress.IPv4Address
    dns: ipaddress.IPv4Address
    net6: ipaddress.IPv6Network
    host6: ipaddress.IPv6Address
    dns6: ipaddress.IPv6Address

    def netdev_options(self) -> str:
        """The ``-netdev user`` options that pin these addresses."""
        return (f"net={self.net},host={self.host},dns={self.dns},"
                f"ipv6-net={self.net6},ipv6-host={self.host6},ipv6-dns={self.dns6}")


DEFAULT_GUEST_NETWORK = GuestNetwork(
    net=ipaddress.IPv4Network("10.0.2.0/24"), host=ipaddress.IPv4Address("10.0.2.2"),
    dns=ipaddress.IPv4Address("10.0.2.3"), net6=ipaddress.IPv6Network("fec0::/64"),
    host6=ipaddress.IPv6Address("fec0::2"), dns6=ipaddress.IPv6Address("fec0::3"))
"""QEMU's own defaults, which the guest's init assumes (10.0.2.15, gateway 10.0.2.2)."""


def _closed4(dst: ipaddress.IPv4Address, net: GuestNetwork) -> bool:
    return dst in _LOOPBACK4 or dst in _THIS_NETWORK4 or dst in net.net


def _closed6(dst: ipaddress.IPv6Address, net: GuestNetwork) -> bool:
    return (dst.is_loopback or dst.is_unspecified or dst in _V4_MAPPED6
            or dst in _V4_COMPATIBLE6 or dst in net.net6)


def _ports(segment: bytes) -> tuple[int, int] | None:
    if len(segment) < 4:
        return None
    src, dst = struct.unpack_from("!HH", segment)
    return src, dst


def _transport_verdict(proto: int, segment: bytes, dst: str, is_dns: bool,
                       is_host: bool, icmp: int) -> str | None:
    """The verdict for a whole (unfragmented) packet towards a closed address."""
    where = f"{dst}"
    if proto == TCP:
        if len(segment) < 14:
            return f"short TCP header to {where}"
        _src, dport = struct.unpack_from("!HH", segment)
        flags = segment[13]
        if not flags & 0x02 or flags & 0x10:
            return None  # no SYN, or SYN+ACK: opens nothing in slirp
        if is_dns and dport == DNS_PORT:
            return None
        return f"TCP connection to {where}:{dport}"
    if proto == UDP:
        ports = _ports(segment)
        if ports is None:
            return f"short UDP header to {where}"
        dport = ports[1]
        if (is_dns and dport == DNS_PORT) or (is_host and dport == DHCP_SERVER_PORT):
            return None
        return f"UDP datagram to {where}:{dport}"
    if proto == icmp:
        if is_dns or is_host:
            return None  # slirp answers an echo to its aliases itself
        return f"ICMP to {where}"
    return f"protocol {proto} to {where}"


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Endpoint = tuple[IPAddress, int]
"""An address and port the guest may not open flows to (:func:`frame_verdict`)."""


@dataclass(frozen=True)
class Blocked:
    """The endpoints the guest may not open flows to (the rights URL), as the two sets
    :func:`frame_verdict` tests, built once rather than per frame: their ports (closed
    on every address, known without DNS) and their addresses (resolved at start, maybe
    none; any fragment to them dropped)."""

    ports: frozenset[int] = frozenset()
    addresses: frozenset[IPAddress] = frozenset()

    @classmethod
    def of(cls, endpoints: frozenset[Endpoint]) -> Blocked:
        return cls(frozenset(port for _, port in endpoints),
                   frozenset(address for address, _ in endpoints))


NOTHING_BLOCKED = Blocked()


def _blocked_verdict(proto: int, segment: bytes, where: str, ports: frozenset[int],
                     fragment: bool, at_address: bool, first: bool) -> str | None:
    """The verdict for a packet to an open address while ``ports`` are blocked: on every
    address (the guest reaches the leader's pod IP as well as the rights Service,
    docs/security.md, "Rights endpoint"); any fragment to a blocked endpoint's own
    address, and a first fragment to a blocked port elsewhere, are dropped too."""
    if fragment and at_address:
        return f"IP fragment to {where} (a blocked endpoint's address)"
    if fragment and not first:
        return None  # carries no port; without its first fragment it is never whole
    if proto not in (TCP, UDP):
        return None
    if len(segment) < (4 if fragment else 14 if proto == TCP else 4):
        return f"short {'TCP' if proto == TCP else 'UDP'} header to {where}"
    dport = struct.unpack_from("!H", segment, 2)[0]
    if dport not in ports:
        return None
    if fragment:
        return f"IP fragment to {where}:{dport} (a blocked port)"
    if proto == UDP:
        return f"UDP datagram to {where}:{dport} (a blocked endpoint)"
    flags = segment[13]
    if not flags & 0x02 or flags & 0x10:
        return None  # opens nothing
    return f"TCP connection to {where}:{dport} (a blocked endpoint)"


def ipv6_nameserver(resolv_conf: str) -> bool:
    """Whether ``resolv_conf`` (the text of the container's ``/etc/resolv.conf``) lists
    an IPv6 nameserver. slirp sends DNS for the IPv6 alias to the first one; with none
    it sends it to ``[::1]:53``, the container's own loopback (an IPv4-only pod, the
    usual case), so then the filter drops it."""
    for line in resolv_conf.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "nameserver":
            with contextlib.suppress(ValueError):
                if ipaddress.ip_address(words[1].split("%", 1)[0]).version == 6:
                    return True
    return False


def frame_verdict(frame: bytes, net: GuestNetwork = DEFAULT_GUEST_NETWORK,
                  dns6: bool = False, blocked: Blocked = NOTHING_BLOCKED) -> str | None:
    """None if the guest's ``frame`` may go to slirp; otherwise why it is dropped.
    ``dns6``: DNS to the IPv6 alias passes (the container has an IPv6 nameserver, see
    :func:`ipv6_nameserver`); without it, that is a connection to the loopback.
    ``blocked``: endpoints closed although their address is open (the rights URL).

    Only IPv4 and IPv6 frames are judged: slirp acts on nothing else but ARP (answered
    from its own table). Malformed IP headers are dropped.
    """
    if len(frame) < ETH_HEADER:
        return None
    ethertype = struct.unpack_from("!H", frame, 12)[0]
    packet = frame[ETH_HEADER:]
    if ethertype == ETH_IPV4:
        if len(packet) < 20 or packet[0] >> 4 != 4:
            return "malformed IPv4 header"
        ihl = (packet[0] & 0x0F) * 4
        if ihl < 20 or len(packet) < ihl:
            return "malformed IPv4 header"
        dst = ipaddress.IPv4Address(packet[16:20])
        frag = struct.unpack_from("!H", packet, 6)[0]
        if not _closed4(dst, net):
            return _blocked_verdict(packet[9], packet[ihl:], str(dst), blocked.ports,
                                    bool(frag & 0x3FFF), dst in blocked.addresses,
                                    not frag & 0x1FFF) if blocked.ports else None
        if frag & 0x3FFF:  # more fragments, or an offset: judged whole nowhere, so dropped
            return f"IPv4 fragment to {dst}"
        return _transport_verdict(packet[9], packet[ihl:], str(dst), dst == net.dns,
                                  dst == net.host or dst == _BROADCAST4, ICMP)
    if ethertype == ETH_IPV6:
        if len(packet) < 40 or packet[0] >> 4 != 6:
            return "malformed IPv6 header"
        dst6 = ipaddress.IPv6Address(packet[24:40])
        if not _closed6(dst6, net):
            if not blocked.ports:
                return None
            proto, segment, first = packet[6], packet[40:], True
            if proto == IPV6_FRAGMENT and len(packet) >= 48:  # the next header, its offset
                proto, segment = packet[40], packet[48:]
                first = not struct.unpack_from("!H", packet, 42)[0] & 0xFFF8
            return _blocked_verdict(proto, segment, f"[{dst6}]", blocked.ports,
                                    packet[6] == IPV6_FRAGMENT, dst6 in blocked.addresses,
                                    first)
        is_dns6 = dst6 == net.dns6
        if is_dns6 and not dns6 and packet[6] in (TCP, UDP):
            why = _transport_verdict(packet[6], packet[40:], f"[{dst6}]", False, False,
                                     ICMPV6)
            return f"{why} (no IPv6 nameserver: slirp would use [::1]:53)" if why else None
        return _transport_verdict(packet[6], packet[40:], f"[{dst6}]", is_dns6,
                                  dst6 == net.host6, ICMPV6)
    return None


class GuestNetFilter:
    """The runner's end of QEMU's ``filter-redirector``: two unix sockets, one thread.

    :meth:`listen` binds both sockets (before QEMU starts: QEMU connects to them at
    start and refuses to start if it cannot); :meth:`start` runs the pump; :meth:`stop`
    closes everything. ``dropped`` counts the frames dropped, by reason.
    """

    LOG_FIRST = 20
    """Drops logged one by one; after that, every 100th."""

    def __init__(self, from_qemu: Path, to_qemu: Path,
                 net: GuestNetwork = DEFAULT_GUEST_NETWORK, dns6: bool = False,
                 blocked: Blocked = NOTHING_BLOCKED) -> None:
        """``dns6``, ``blocked``: see :func:`frame_verdict` (the runner reads
        ``/etc/resolv.conf`` at start; ``blocked`` is the rights URL's port, and its
        addresses as resolved at start, :func:`neonvm.runner.right.rights_blocked`)."""
        self.blocked = blocked
        self.from_qemu = from_qemu
        self.to_qemu = to_qemu
        self.net = net
        self.dns6 = dns6
        self.dropped = 0
        self.passed = 0
        self._listeners: list[socket.socket] = []
        self._conns: list[socket.socket] = []
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def listen(self) -> None:
        """Bind both sockets; :class:`HostError` if either cannot be bound."""
        for path in (self.from_qemu, self.to_qemu):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(str(path))
                path.chmod(0o600)
                sock.listen(1)
            except OSError as exc:
                sock.close()
                raise HostError(f"cannot listen on {path}: {exc.strerror or exc}") from None
            self._listeners.append(sock)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="guest-net-filter",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        for sock in self._listeners + self._conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for path in (self.from_qemu, self.to_qemu):
            with contextlib.suppress(OSError):
                path.unlink()

    def _run(self) -> None:
        try:
            # One client each, QEMU; the listeners close once it is there.
            source, _ = self._listeners[0].accept()
            self._conns.append(source)
            sink, _ = self._listeners[1].accept()
            self._conns.append(sink)
            for sock in self._listeners:
                sock.close()
            self._pump(source, sink)
        except OSError as exc:
            if not self._stopping.is_set():
                logger.warning("guest network filter stopped: {}; the guest has no "
                               "network", exc)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        reader = source.makefile("rb", buffering=1 << 16)
        while True:
            header = reader.read(4)
            if len(header) < 4:
                return  # QEMU closed its end
            length = struct.unpack("!I", header)[0]
            if length > MAX_FRAME:
                logger.warning("guest network filter: frame of {} bytes from QEMU; "
                               "closing the guest's network", length)
                return
            frame = reader.read(length)
            if len(frame) < length:
                return
            why = frame_verdict(frame, self.net, self.dns6, self.blocked)
            if why is None:
                self.passed += 1
                sink.sendall(header + frame)
                continue
            self.dropped += 1
            if self.dropped <= self.LOG_FIRST or self.dropped % 100 == 0:
                logger.warning("guest network: dropped {} (the runner's loopback and the "
                               "guest's host aliases are closed; {} dropped so far)",
                               why, self.dropped)
