"""A hostile guest in a real runner pod on the real kubelet node (issue 28).

:class:`HostileGuest` runs in the default suite beside the VM of
``tests/test_real_node.py``'s default test (same node, images and controller; no rights
port there). The test here is opt-in (``NEONVM_TEST_REAL_NODE=1 pytest
tests/test_hostile_guest_node.py -s``): it starts its own real node, with the controller
serving rights, so that the guest also tries the leader's rights port. The same attack
from a guest under QEMU on the host is ``tests/test_guest_isolation.py``.

The controller (one replica, serving rights on the node's address) creates the runner
pod of a VM with ``qmp:`` set whose command runs busybox ``nc`` (the static busybox's
``wget`` crashes on https in the guest, so no TLS client is tried). From inside, the
guest tries QMP and the runner's API (10.0.2.2 and ``fec0::2``), the leader's rights
port, the locks' etcd where pods reach it (the node's address), and the API server at
its ClusterIP and at the host's address, and reports each on its console. QMP, the
runner's and the rights ports must time out (the guest filter drops them); etcd must
accept the connection and close it with nothing said to a client without TLS and a
certificate; the API server's ClusterIP answers only TLS (Go's "Client sent an HTTP
request to an HTTPS server"), and its host address refuses connections. Each reason is
asserted, so a wrong address or port fails the test. The runner pod stays Ready,
and the guest's egress to the node's address still works. docs/security.md, "The guest".
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client

from neonvm.dev import realnode
from neonvm.dev.cluster import LocalCluster
from neonvm.dev.pki import KUBERNETES_SERVICE_IP
from tests.support import FAST, wait_for
from tests.support.real_node import _images_skip_reason, _started_node_with_images
from tests.test_guest_isolation import HTTP_TO, NC_TO, Listener, listen

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


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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


SEEN = [  # a real node run's console (the opt-in test's, with the rights port)
    "attack qmp: nc: timed out [exit 1]", "attack qmp-v6: nc: timed out [exit 1]",
    "attack runner-api: nc: timed out [exit 1]", "attack runner-api-v6: nc: timed out [exit 1]",
    "attack rights: nc: timed out [exit 1]", "attack etcd: [exit 0]",
    "attack apiserver-clusterip: HTTP/1.0 400 Bad Request    Client sent an HTTP request "
    "to an HTTPS server. [exit 0]",
    "attack apiserver-host-address: nc: can't connect to remote host (10.251.29.1): "
    "Connection refused [exit 1]",
]


@pytest.mark.unit
@pytest.mark.parametrize(("target", "wrong"), [
    ("etcd", "nc: can't connect to remote host (10.0.0.9): Connection refused [exit 1]"),
    ("etcd", "nc: timed out [exit 1]"),
    ("apiserver-clusterip", "nc: timed out [exit 1]"),
    ("apiserver-host-address", "nc: timed out [exit 1]"),
    ("apiserver-host-address", "nc: bad address '10.0.0.999' [exit 1]"),
])
def test_an_attempt_that_failed_for_another_reason_fails_the_check(
        target: str, wrong: str) -> None:
    """A wrong address or port (refused, timed out) must not pass for the intended
    reason: each attempt's reason is what the console shows."""
    check_report(SEEN, rights=True)
    report = [f"attack {target}: {wrong}" if line.startswith(f"attack {target}:") else line
              for line in SEEN]
    with pytest.raises(AssertionError):
        check_report(report, rights=True)


@pytest.mark.cluster
@pytest.mark.realnode
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(_images_skip_reason() is not None, reason=_images_skip_reason() or "")
def test_a_hostile_guest_on_the_real_node_reaches_no_control_channel_and_keeps_egress(
    cluster: LocalCluster, api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    """With the controller serving rights on the node's address, so that the guest also
    tries the leader's rights port."""
    from neonvm.dev import guestdisk
    from tests.support.harness import Replicas

    absent = guestdisk.missing()
    if absent:
        pytest.skip(f"cannot build the test root disk, missing: {', '.join(absent)}")
    _raw, qcow2 = guestdisk.build_rootfs(tmp_path / "disk")
    archive = guestdisk.disk_image_archive(qcow2, tmp_path / "rootdisk.oci.tar")
    node, [image] = _started_node_with_images(cluster, ("runner",))
    rights_port = _free_port(node.node_ip)
    group = Replicas(
        api=api, kubeconfig=cluster.kubeconfig_for("controller"),
        etcd_endpoints=cluster.locks_etcd_config(f"/t-{uuid.uuid4().hex[:8]}"),
        lease_namespace=namespace, log_dir=tmp_path / "replicas",
        extra_args=[*FAST, "--watch-namespace", namespace, "--runner-image", image,
                    "--rights-bind", f"{node.node_ip}:{rights_port}",
                    "--rights-url", f"http://{node.node_ip}:{rights_port}"])
    guest = HostileGuest(api, namespace, node, rights_port=rights_port)
    try:
        node.ctr("images", "import", "--platform", "linux/amd64", str(archive), timeout=300)
        group.start("c0")
        guest.create(cluster)
        guest.check()
    finally:
        guest.close()
        group.stop_all()
        for r in group:
            print(f"---- {r.name} (exit {r.exit_code()}) ----\n{r.log()[-3000:]}")
        node.stop()
        with contextlib.suppress(client.ApiException):
            client.CoreV1Api(api).delete_node(node.name)
