"""What every part of the local cluster shares: the default ports, the identities, the
state directory, the cluster's spec, free ports and its error type.

The orchestration (:mod:`neonvm.dev.cluster`) sits above the modules that set up parts
of the cluster (:mod:`neonvm.dev.nodes`, :mod:`neonvm.dev.bootstrap`,
:mod:`neonvm.dev.realnode`); all of them import this module, and it imports none of them.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PORTS = {
    "etcd": 2379,
    "etcd-peer": 2380,
    "locks-etcd": 2479,
    "locks-etcd-peer": 2480,
    "kube-apiserver": 6443,
    "kube-scheduler": 10259,
    "kube-controller-manager": 10257,
    "kwok": 10247,
}

CONTROLLER_USER = "neonvm-controller"
"""The identity controller replicas use locally (the admission fence names it)."""

CONTROLLER_KUBECONFIG_ENV = "NEONVM_CONTROLLER_RUN_KUBECONFIG"
"""``neonvm controller run``'s own kubeconfig variable; ``neonvm dev env`` points it at the
controller identity's kubeconfig, so a replica started from that shell is not the admin."""

KWOK_USER = "neonvm-dev-kwok"
"""kwok's identity: the kubelets of every simulated node (RBAC in neonvm.dev.nodes)."""


class ClusterError(RuntimeError):
    """Something the user can act on; the CLI prints it as one line."""


def default_state_dir() -> Path:
    base = os.environ.get("NEONVM_STATE_DIR")
    if base:
        return Path(base)
    state_home = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state"))
    return state_home / "neonvm" / "dev"


@dataclass
class ClusterSpec:
    """What ``up`` was asked for; persisted so that ``status`` and ``down`` agree with it."""

    nodes: int = 0
    ports: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_PORTS))
    service_account_tokens: bool = False
    """Keep the API server's ServiceAccount admission plugin on, so pods get a token (a
    controller in a pod on a real node needs one). Off by default: with it, a pod in a
    namespace whose ``default`` ServiceAccount the controller manager has not made yet
    is refused, and a cluster without nodes has no controller manager at all."""
    pods_per_node: int = 110
    """Pods each simulated node takes (Kubernetes' default kubelet limit), with a CPU and
    a GiB for each beyond 64 CPUs and 256 GiB. The benchmarks raise it, so that
    thousands of runner pods are scheduled and run on a few nodes instead of waiting
    unschedulable (which makes the scheduler retry them)."""
    priority_and_fairness: bool = False
    """Run kube-apiserver with API Priority and Fairness on (kube-apiserver's own default).
    Off by default here, as the local control plane has always run (every test and
    benchmark figure so far was taken so); the soak turns it on and installs the chart's
    Lease FlowSchema (docs/benchmarks.md, "Soak")."""

    @classmethod
    def with_free_ports(cls, nodes: int = 0) -> ClusterSpec:
        ports: dict[str, int] = {}
        for name in DEFAULT_PORTS:
            ports[name] = free_port(taken=set(ports.values()))
        return cls(nodes=nodes, ports=ports)


def free_port(taken: Collection[int] = ()) -> int:
    """A loopback TCP port nobody listens on, below the kernel's ephemeral port range.

    A port from ``bind(0)`` comes from the ephemeral range, which outgoing connections
    draw their source ports from too: between picking it and the server binding it, a
    client connection may take it (CI saw etcd fail with "bind: address already in use").
    Below that range only other listeners compete, and the bind check sees them.
    """
    low = _ephemeral_port_low()
    chooser = random.SystemRandom()
    for _ in range(200):
        port = chooser.randrange(max(1024, low - 16384), low)
        if port not in taken and not _port_in_use(port):
            return port
    with socket.socket() as s:  # everything below the range is busy: take any port
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_port_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False
