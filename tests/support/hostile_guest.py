"""A hostile VM on a started real node (issue 28): its guest tries QMP, the runner's
ports, the leader's rights port, the locks' etcd and the API server from inside its runner
pod, and reports each attempt on its console; :func:`check_report` asserts each failed for
its intended reason. Used by ``tests/test_hostile_guest_node.py`` (opt-in, with a rights
port) and by ``tests/test_real_node.py``'s default test (beside its own VM).
docs/security.md, "The guest".
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from kubernetes import client

from neonvm.dev import realnode
from neonvm.dev.cluster import LocalCluster
from neonvm.dev.pki import KUBERNETES_SERVICE_IP
from tests.support import wait_for
from tests.support.guest_attack import HTTP_TO, NC_TO, Listener, listen

QMP_PORT = 20183  # what VMs exported from NeonVM carry
RUNNER_PORT = 25183

TRY = (
    'try() { name=$1; shift; out=$( { timeout 10 "$@" 2>&1; echo "[exit $?]"; }'
    ' | tail -c 400 | tr "\\n\\r" "  "); echo "attack $name: $out"; }'
)


def attack_script(node_ip: str, rights_port: int | None, etcd_port: int, api_port: int,
                  egress_port: int) -> str:
    """The guest's command: every attempt side by side, one console line each, then
    ``attack: done`` and a sleep (the pod must stay Ready afterwards)."""
    attempts = [
        ("qmp", f"{NC_TO} 10.0.2.2 {QMP_PORT}"),
        ("qmp-v6", f"{NC_TO} fec0::2 {QMP_PORT}"),
        ("runner-api", f"{HTTP_TO} 10.0.2.2 {RUNNER_PORT}"),
        ("runner-api-v6", f"{HTTP_TO} fec0::2 {RUNNER_PORT}"),
        *([("rights", f"{HTTP_TO} {node_ip} {rights_port}")] if rights_port else []),
        ("etcd", f"{HTTP_TO} {node_ip} {etcd_port}"),
        ("apiserver-clusterip", f"{HTTP_TO} {KUBERNETES_SERVICE_IP} 443"),
        ("apiserver-host-address", f"{HTTP_TO} {node_ip} {api_port}"),
    ]
    lines = [
        TRY,
        "for i in $(seq 120); do ip -6 addr show dev eth0 | grep -q 'inet6 fec0' &&"
        " ! ip -6 addr show dev eth0 | grep -q tentative && break; sleep 0.5; done",
        "echo \"attack: IPv6 $(ip -6 addr show dev eth0 | grep -o 'inet6 fec0[^ ]*')\"",
        *(f"try {name} {how} &" for name, how in attempts),
        "wait",
        f"try egress {NC_TO} {node_ip} {egress_port}",
        "echo 'attack: done'",
        "exec sleep 100000",
    ]
    return "\n".join(lines)


def parse_report(report: list[str]) -> dict[str, str]:
    """The guest's console lines ``attack <name>: <what nc said> [exit N]`` by name."""
    return {line.split(":", 1)[0][len("attack "):]: line.split(":", 1)[1].strip()
            for line in report if line.startswith("attack ")}


def check_report(report: list[str], rights: bool) -> None:
    """Every attempt failed for its intended reason (``rights``: the rights port was
    tried too)."""
    said = parse_report(report)
    shown = "\n".join(report)
    # Dropped by the runner's guest filter: the connection attempt times out.
    for target in ("qmp", "qmp-v6", "runner-api", "runner-api-v6",
                   *(["rights"] if rights else [])):
        assert said.get(target, "").startswith("nc: timed out"), shown
    # Each of the others for its own reason, so that a wrong address or port (refused,
    # timed out) fails rather than passes. The locks' etcd is reachable on the node's
    # address (no NetworkPolicy is enforced on the real node), but speaks only TLS
    # with client certificates: nc connects, and etcd closes it with nothing said.
    assert said.get("etcd") == "[exit 0]", shown
    # The API server's ClusterIP answers only TLS (Go's own reply to plain HTTP; the
    # guest has no credentials either, runner pods mount no ServiceAccount token).
    assert "Client sent an HTTP request to an HTTPS server" in said.get(
        "apiserver-clusterip", ""), shown
    assert "200 OK" not in said["apiserver-clusterip"], shown
    # Nothing listens at the host's address (the API server binds loopback there).
    assert "Connection refused" in said.get("apiserver-host-address", ""), shown


@dataclass
class HostileGuest:
    """The hostile VM on a started real node, beside whatever else the test runs there
    (``tests/test_real_node.py``'s default test boots it next to its own VM)."""

    api: client.ApiClient
    namespace: str
    node: realnode.RealNode
    rights_port: int | None = None
    """The leader's rights port on the node's address, if the controller serves one."""
    name: str = "hostile"
    egress: Listener | None = None
    created: float = 0.0

    def create(self, cluster: LocalCluster) -> None:
        """Listen for the guest's egress on the node's address and create the VM (its
        root disk image must be imported on the node already)."""
        from neonvm.dev import guestdisk
        from tests.support.harness import create_vm

        self.egress = listen(self.node.node_ip, "secret-egress")
        ports = cluster.spec.ports
        script = attack_script(self.node.node_ip, self.rights_port, ports["locks-etcd"],
                               ports["kube-apiserver"], self.egress.port)
        self.created = time.monotonic()
        create_vm(self.api, self.namespace, self.name, restart_policy="Always", spec={
            "qmp": QMP_PORT, "runnerPort": RUNNER_PORT,
            "terminationGracePeriodSeconds": 10,
            "nodeSelector": {realnode.REAL_LABEL: "true"},
            "guest": {
                "cpus": {"min": 1, "max": 1}, "memorySlotSize": "256Mi",
                "memorySlots": {"min": 1, "max": 1},
                "rootDisk": {"image": guestdisk.DISK_IMAGE, "imagePullPolicy": "Never"},
                "command": ["/bin/sh", "-c", script],
            },
        })

    def pod_name(self) -> str | None:
        from tests.support.harness import get_vm

        vm = get_vm(self.api, self.namespace, self.name) or {}
        return (vm.get("status") or {}).get("podName")

    def console(self) -> str:
        name = self.pod_name()
        if not name:
            return ""
        try:
            return str(client.CoreV1Api(self.api).read_namespaced_pod_log(
                name, self.namespace, container="neonvm-runner"))
        except client.ApiException:
            return ""

    def check(self) -> None:
        """Wait for the guest's report, print it, and check every attempt failed, egress
        worked, and the pod is Ready and never restarted."""
        assert self.egress is not None
        wait_for(lambda: "attack: done" in self.console(), timeout=900, interval=1,
                 what="the hostile guest's attacks to finish")
        name = str(self.pod_name())
        report = [line for line in self.console().splitlines() if line.startswith("attack")]
        print(f"\nhostile guest in runner pod {name} on {self.node.name} (report read "
              f"{time.monotonic() - self.created:.0f}s after the VM was created):\n"
              + "\n".join(report))
        check_report(report, bool(self.rights_port))
        # The guest keeps its network, and its pod stays Ready, never restarted.
        said = parse_report(report)
        assert said.get("egress", "").startswith(self.egress.secret), "\n".join(report)
        assert self.egress.accepted
        core = client.CoreV1Api(self.api)

        def ready() -> bool:  # the kubelet's probe may see the marker after the report
            pod = core.read_namespaced_pod(name, self.namespace)
            return {c.type: c.status for c in pod.status.conditions or []}.get("Ready") == "True"

        wait_for(ready, timeout=120, interval=0.5, what=f"{name} Ready")
        pod = core.read_namespaced_pod(name, self.namespace)
        assert pod.spec.node_name == self.node.name
        assert [s.restart_count for s in pod.status.container_statuses or []] == [0]
        assert self.pod_name() == name
        assert "self-fenced" not in self.console()

    def close(self) -> None:
        from tests.support.harness import delete_vm

        if self.egress is not None:
            self.egress.sock.close()
        with contextlib.suppress(Exception):
            delete_vm(self.api, self.namespace, self.name)
