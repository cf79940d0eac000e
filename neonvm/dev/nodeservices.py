"""Cluster DNS and ClusterIP routing for one real node: what CoreDNS and kube-proxy do,
for that node's pods only.

A process of the dev tooling (``python -m neonvm.dev.nodeservices_main serve``), started with
the node when it is made with ``cluster_dns=True``:

* **DNS** on the node's address, port 53 (UDP and TCP), which the kubelet puts into every
  pod's ``resolv.conf`` (``clusterDNS``, ``clusterDomain: cluster.local``). It answers
  the cluster domain from the API server's Services and EndpointSlices as the
  Kubernetes DNS specification says (CoreDNS's ``kubernetes`` plugin): a ClusterIP
  Service's name gives its ClusterIP, a headless Service's name its ready endpoints,
  ``<hostname>.<service>.<namespace>.svc.<domain>`` a StatefulSet member's address, and
  the reverse (``PTR``) of those addresses their names (etcd checks a peer's wildcard
  certificate name that way). Other names are forwarded to the host's resolver.
* **ClusterIP routing**: a ``DNAT`` per Service port to its ready endpoints (chosen at
  random per connection, as kube-proxy's iptables mode does), in a ``nat`` chain of this
  node's own jumped to only for packets entering through its bridge, and a
  ``MASQUERADE`` of those connections as they leave through the bridge (the endpoint is
  on the same bridge: without it its answer would go straight to the client, around the
  translation).

Why not kube-proxy and CoreDNS themselves: docs/real-node.md, "Cluster DNS and Service
routing".
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from neonvm.dev.realnode import RealNode

CLUSTER_DOMAIN = "cluster.local"
TTL = 5
POLL_SECONDS = 1.0

A, PTR, AAAA = 1, 12, 28
NOERROR, SERVFAIL, NXDOMAIN, NOTIMP = 0, 2, 3, 4


@dataclass(frozen=True)
class Route:
    """One Service port: connections to ``ip:port`` go to one of ``to`` (ip, port)."""

    ip: str
    port: int
    protocol: str
    to: tuple[tuple[str, int], ...]


@dataclass
class Tables:
    """What the DNS answers and the routes, built from one listing of the API."""

    a: dict[str, list[str]] = field(default_factory=dict)
    ptr: dict[str, str] = field(default_factory=dict)
    routes: list[Route] = field(default_factory=list)

    def exists(self, name: str, domain: str) -> bool:
        """A name with records, or an ancestor of one (an empty non-terminal)."""
        return name in self.a or any(n.endswith("." + name) for n in self.a) \
            or name == domain


def _ready(endpoint: dict[str, Any]) -> bool:
    ready = (endpoint.get("conditions") or {}).get("ready")
    return ready is None or bool(ready)


def build_tables(services: list[dict[str, Any]], slices: list[dict[str, Any]],
                 domain: str = CLUSTER_DOMAIN) -> Tables:
    """The DNS records and ClusterIP routes of ``services`` and their EndpointSlices
    (both as the API serves them, camelCase). The ``default/kubernetes`` Service has no
    route here: the real node forwards its ClusterIP to the API server itself."""
    t = Tables()
    by_service: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for s in slices:
        meta = s["metadata"]
        svc = (meta.get("labels") or {}).get("kubernetes.io/service-name")
        if svc and s.get("addressType") == "IPv4":
            by_service.setdefault((meta["namespace"], svc), []).append(s)
    for svc in services:
        ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        spec = svc.get("spec") or {}
        fqdn = f"{name}.{ns}.svc.{domain}"
        cluster_ip = spec.get("clusterIP")
        own = by_service.get((ns, name), [])
        if cluster_ip and cluster_ip != "None":
            t.a[fqdn] = [cluster_ip]
            t.ptr[cluster_ip] = fqdn
            if (ns, name) == ("default", "kubernetes"):
                continue
            for port in spec.get("ports") or []:
                to = sorted({(addr, int(p["port"]))
                             for s in own for ep in s.get("endpoints") or [] if _ready(ep)
                             for addr in ep.get("addresses") or []
                             for p in s.get("ports") or []
                             if (p.get("name") or "") == (port.get("name") or "")
                             and p.get("port") is not None})
                if to:
                    t.routes.append(Route(cluster_ip, int(port["port"]),
                                          (port.get("protocol") or "TCP").lower(), tuple(to)))
        elif spec.get("type") != "ExternalName":
            addrs: list[str] = []
            for s in own:
                for ep in s.get("endpoints") or []:
                    if not _ready(ep):
                        continue
                    addrs += ep.get("addresses") or []
                    if ep.get("hostname"):
                        member = f"{ep['hostname']}.{fqdn}"
                        t.a[member] = list(ep.get("addresses") or [])
                        for addr in ep.get("addresses") or []:
                            t.ptr[addr] = member
            if addrs:
                t.a[fqdn] = sorted(set(addrs))
    return t


# ---- the DNS wire format (RFC 1035), the little of it needed here -------------------------


def _name(data: bytes, at: int) -> tuple[str, int]:
    labels: list[str] = []
    while True:
        length = data[at]
        if length == 0:
            return ".".join(labels), at + 1
        if length & 0xC0:
            raise ValueError("compressed name in a question")
        labels.append(data[at + 1:at + 1 + length].decode("ascii", "replace"))
        at += 1 + length


def _encode(name: str) -> bytes:
    return b"".join(bytes([len(p)]) + p.encode() for p in name.split(".") if p) + b"\0"


def _reverse_ip(name: str) -> str | None:
    """``4.3.2.1.in-addr.arpa`` -> ``1.2.3.4``."""
    if not name.endswith(".in-addr.arpa"):
        return None
    parts = name[:-len(".in-addr.arpa")].split(".")
    if len(parts) != 4:
        return None
    return ".".join(reversed(parts))


def answer(query: bytes, tables: Tables, domain: str = CLUSTER_DOMAIN) -> bytes | None:
    """The reply to ``query`` from ``tables``, or None when the name is not ours (then
    it is forwarded)."""
    if len(query) < 12:
        return None
    ident, flags, qdcount = struct.unpack("!HHH", query[:6])
    if qdcount != 1 or flags & 0x8000:
        return None
    qname, at = _name(query, 12)
    qtype, _qclass = struct.unpack("!HH", query[at:at + 4])
    question = query[12:at + 4]
    name = qname.lower().rstrip(".")
    records: list[bytes] = []
    ip = _reverse_ip(name)
    if ip is not None:
        target = tables.ptr.get(ip)
        if target is None:
            return None
        if qtype == PTR:
            rdata = _encode(target)
            records.append(struct.pack("!HHHIH", 0xC00C, PTR, 1, TTL, len(rdata)) + rdata)
        rcode = NOERROR
    elif name == domain or name.endswith("." + domain):
        if not tables.exists(name, domain):
            rcode = NXDOMAIN
        else:
            rcode = NOERROR
            if qtype == A:
                for addr in tables.a.get(name, []):
                    records.append(struct.pack("!HHHIH", 0xC00C, A, 1, TTL, 4)
                                   + socket.inet_aton(addr))
    else:
        return None
    # QR, AA, RD copied, RA; one question; the answers.
    reply_flags = 0x8000 | 0x0400 | (flags & 0x0100) | 0x0080 | rcode
    return (struct.pack("!HHHHHH", ident, reply_flags, 1, len(records), 0, 0)
            + question + b"".join(records))


def servfail(query: bytes) -> bytes:
    ident, flags = struct.unpack("!HH", query[:4])
    return struct.pack("!HHHHHH", ident, 0x8000 | (flags & 0x0100) | 0x0080 | SERVFAIL,
                       0, 0, 0, 0)


def host_nameserver(resolv_conf: Path = Path("/etc/resolv.conf")) -> str | None:
    with contextlib.suppress(OSError):
        for line in resolv_conf.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                return parts[1]
    return None


class Resolver:
    """Answers from the current tables; forwards other names to the host's resolver."""

    def __init__(self, upstream: str | None, domain: str = CLUSTER_DOMAIN) -> None:
        self.tables = Tables()
        self.upstream = upstream
        self.domain = domain

    def reply(self, query: bytes) -> bytes | None:
        try:
            ours = answer(query, self.tables, self.domain)
        except (ValueError, IndexError, struct.error):
            return None
        if ours is not None:
            return ours
        if self.upstream is None:
            return servfail(query)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(2.0)
            try:
                s.sendto(query, (self.upstream, 53))
                return s.recv(4096)
            except OSError:
                return servfail(query)


# ---- the process ------------------------------------------------------------------------


def _chains(node: RealNode) -> tuple[str, str]:
    """(the DNAT chain, the MASQUERADE chain) of ``node``."""
    return f"NVS-{node.tag}", f"NVSM-{node.tag}"


def restore_text(chain: str, routes: list[Route]) -> str:
    """``iptables-restore --noflush`` input that replaces ``chain`` with ``routes``."""
    lines = ["*nat", f":{chain} - [0:0]"]
    for r in routes:
        for i, (ip, port) in enumerate(r.to):
            left = len(r.to) - i
            pick = ([] if left == 1 else
                    ["-m", "statistic", "--mode", "random", "--probability", f"{1 / left:.5f}"])
            lines.append(" ".join([f"-A {chain} -d {r.ip}/32 -p {r.protocol} --dport {r.port}",
                                   *pick, f"-j DNAT --to-destination {ip}:{port}"]))
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def _list(api: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from kubernetes import client

    services = client.CoreV1Api(api).list_service_for_all_namespaces(
        _request_timeout=20).items
    slices = client.DiscoveryV1Api(api).list_endpoint_slice_for_all_namespaces(
        _request_timeout=20).items
    return ([api.sanitize_for_serialization(s) for s in services],
            [api.sanitize_for_serialization(s) for s in slices])


def serve(node: RealNode) -> None:
    """Run the node's DNS and keep its routes in step with the API until killed."""
    from neonvm import kube

    resolver = Resolver(host_nameserver())

    class Udp(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            data, sock = self.request
            reply = resolver.reply(data)
            if reply is not None:
                sock.sendto(reply, self.client_address)

    class Tcp(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            with contextlib.suppress(OSError, struct.error):
                while True:
                    head = self.rfile.read(2)
                    if len(head) < 2:
                        return
                    reply = resolver.reply(self.rfile.read(struct.unpack("!H", head)[0]))
                    if reply is None:
                        return
                    self.wfile.write(struct.pack("!H", len(reply)) + reply)

    socketserver.ThreadingUDPServer.allow_reuse_address = True
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    udp = socketserver.ThreadingUDPServer((node.node_ip, 53), Udp)
    tcp = socketserver.ThreadingTCPServer((node.node_ip, 53), Tcp)
    udp.daemon_threads = tcp.daemon_threads = True
    for server in (udp, tcp):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"DNS for {CLUSTER_DOMAIN} on {node.node_ip}:53 (udp, tcp); other names to "
          f"{resolver.upstream}", flush=True)
    chain, _ = _chains(node)
    api = kube.api_client(node.cluster.kubeconfig)
    applied: list[Route] | None = None
    while True:
        try:
            services, slices = _list(api)
        except Exception as exc:  # the API server restarting: keep the last tables
            print(f"listing failed: {type(exc).__name__}: {exc}", flush=True)
            time.sleep(POLL_SECONDS)
            continue
        tables = build_tables(services, slices)
        resolver.tables = tables
        if tables.routes != applied:
            proc = subprocess.run(["iptables-restore", "--noflush"],
                                  input=restore_text(chain, tables.routes), text=True,
                                  capture_output=True)
            if proc.returncode == 0:
                applied = tables.routes
                print(f"routes: {json.dumps([[r.ip, r.port, list(r.to)] for r in applied])}",
                      flush=True)
            else:
                print(f"iptables-restore failed: {proc.stderr.strip()}", flush=True)
        time.sleep(POLL_SECONDS)


# ---- start and stop, from the node --------------------------------------------------------


def process_name(node: RealNode) -> str:
    return f"rn{node.index}-services"


def _ipt(*args: str) -> bool:
    return subprocess.run(["iptables", *args], capture_output=True).returncode == 0


def start(node: RealNode, timeout: float = 60.0) -> None:
    """Make the node's chains, start the process, wait until its DNS answers."""
    stop(node)
    dnat, masq = _chains(node)
    for chain in (dnat, masq):
        _ipt("-t", "nat", "-N", chain)
    _ipt("-t", "nat", "-A", masq, "-m", "conntrack", "--ctstate", "DNAT", "-j", "MASQUERADE")
    _ipt("-t", "nat", "-I", "PREROUTING", "-i", node.bridge, "-j", dnat)
    _ipt("-t", "nat", "-I", "POSTROUTING", "-o", node.bridge, "-j", masq)
    name = process_name(node)
    node.cluster.start_process(
        name, [sys.executable, "-m", "neonvm.dev.nodeservices_main", "serve",
               "--state-dir", str(node.cluster.state_dir), "--node", str(node.index)],
        dict(os.environ))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if resolve(node, f"kubernetes.default.svc.{CLUSTER_DOMAIN}"):
            return
        if not node.cluster.process_alive(name, "neonvm.dev.nodeservices"):
            log = node.cluster.log_file(name).read_text(errors="replace")
            raise RuntimeError(f"{name} exited: {log[-2000:]}")
        time.sleep(0.3)
    raise RuntimeError(f"{name}: no DNS answer on {node.node_ip}:53 after {timeout:.0f}s")


def resolve(node: RealNode, name: str, qtype: int = A) -> list[str]:
    """Ask the node's DNS (UDP) for ``name``: the A addresses or PTR names it answers."""
    query = struct.pack("!HHHHHH", 0x4E56, 0x0100, 1, 0, 0, 0) + _encode(name) \
        + struct.pack("!HH", qtype, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(1.0)
        try:
            s.sendto(query, (node.node_ip, 53))
            reply = s.recv(4096)
        except OSError:
            return []
    count = struct.unpack("!H", reply[6:8])[0]
    at = 12 + len(_encode(name)) + 4
    found = []
    for _ in range(count):
        rtype, _cls, _ttl, length = struct.unpack("!HHIH", reply[at + 2:at + 12])
        rdata = reply[at + 12:at + 12 + length]
        found.append(str(ipaddress.IPv4Address(rdata)) if rtype == A else _name(rdata, 0)[0])
        at += 12 + length
    return found


def stop(node: RealNode) -> list[str]:
    """Stop the process and remove the chains; what was cleaned."""
    done = []
    name = process_name(node)
    if node.cluster.process_alive(name, "neonvm.dev.nodeservices"):
        node.cluster.stop_component(name)
        done.append(name)
    else:  # never signal a pid the process left behind: another may have it now
        node.cluster._pid_file(name).unlink(missing_ok=True)
    dnat, masq = _chains(node)
    removed = False
    while _ipt("-t", "nat", "-D", "PREROUTING", "-i", node.bridge, "-j", dnat):
        removed = True
    while _ipt("-t", "nat", "-D", "POSTROUTING", "-o", node.bridge, "-j", masq):
        removed = True
    for chain in (dnat, masq):
        if _ipt("-t", "nat", "-F", chain) and _ipt("-t", "nat", "-X", chain):
            removed = True
    if removed:
        done.append(f"iptables chains {dnat}, {masq}")
    return done
