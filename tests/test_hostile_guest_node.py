"""A hostile guest in a real runner pod on the real kubelet node (issue 28).

Opt-in (``NEONVM_TEST_REAL_NODE=1 pytest tests/test_hostile_guest_node.py -s``): it
starts its own real node and boots a guest under TCG, minutes on a loaded host. The same
attack from a guest under QEMU on the host runs in the default suite
(``tests/test_guest_isolation.py``).

The controller (one replica, serving rights on the node's address) creates the runner
pod of a VM with ``qmp:`` set whose command runs busybox ``nc`` (the static busybox's
``wget`` crashes on https in the guest, so no TLS client is tried). From inside, the
guest tries QMP and the runner's API (10.0.2.2 and ``fec0::2``), the leader's rights
port, the locks' etcd where pods reach it (the node's address), and the API server at
its ClusterIP and at the host's address, and reports each on its console. QMP, the
runner's and the rights ports must time out (the guest filter drops them); etcd must
answer nothing to a client without TLS and a certificate; the API server's ClusterIP
answers only TLS, and its host address refuses connections. The runner pod stays Ready,
and the guest's egress to the node's address still works. docs/security.md, "The guest".
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
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


def attack_script(node_ip: str, rights_port: int, etcd_port: int, api_port: int,
                  egress_port: int) -> str:
    """The guest's command: every attempt side by side, one console line each, then
    ``attack: done`` and a sleep (the pod must stay Ready afterwards)."""
    attempts = [
        ("qmp", f"{NC_TO} 10.0.2.2 {QMP_PORT}"),
        ("qmp-v6", f"{NC_TO} fec0::2 {QMP_PORT}"),
        ("runner-api", f"{HTTP_TO} 10.0.2.2 {RUNNER_PORT}"),
        ("runner-api-v6", f"{HTTP_TO} fec0::2 {RUNNER_PORT}"),
        ("rights", f"{HTTP_TO} {node_ip} {rights_port}"),
        ("etcd", f"{HTTP_TO} {node_ip} {etcd_port}"),
        ("etcd-via-runner-loopback", f"{NC_TO} 10.0.2.2 {etcd_port}"),
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


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@pytest.mark.cluster
@pytest.mark.realnode
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(_images_skip_reason() is not None, reason=_images_skip_reason() or "")
def test_a_hostile_guest_on_the_real_node_reaches_no_control_channel_and_keeps_egress(
    cluster: LocalCluster, api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    from neonvm.dev import guestdisk
    from tests.support.harness import Replicas, create_vm, delete_vm, get_vm

    absent = guestdisk.missing()
    if absent:
        pytest.skip(f"cannot build the test root disk, missing: {', '.join(absent)}")
    _raw, qcow2 = guestdisk.build_rootfs(tmp_path / "disk")
    archive = guestdisk.disk_image_archive(qcow2, tmp_path / "rootdisk.oci.tar")
    node, [image] = _started_node_with_images(cluster, ("runner",))
    egress: Listener | None = None
    rights_port = _free_port(node.node_ip)
    group = Replicas(
        api=api, kubeconfig=cluster.kubeconfig_for("controller"),
        etcd_endpoints=cluster.locks_etcd_config(f"/t-{uuid.uuid4().hex[:8]}"),
        lease_namespace=namespace, log_dir=tmp_path / "replicas",
        extra_args=[*FAST, "--watch-namespace", namespace, "--runner-image", image,
                    "--rights-bind", f"{node.node_ip}:{rights_port}",
                    "--rights-url", f"http://{node.node_ip}:{rights_port}"])
    core = client.CoreV1Api(api)
    try:
        node.ctr("images", "import", "--platform", "linux/amd64", str(archive), timeout=300)
        egress = listen(node.node_ip, "secret-egress")
        ports = cluster.spec.ports
        script = attack_script(node.node_ip, rights_port, ports["locks-etcd"],
                               ports["kube-apiserver"], egress.port)
        group.start("c0")
        create_vm(api, namespace, "hostile", restart_policy="Always", spec={
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

        def pod_name() -> str | None:
            return ((get_vm(api, namespace, "hostile") or {}).get("status") or {}).get("podName")

        def console() -> str:
            name = pod_name()
            if not name:
                return ""
            try:
                return str(core.read_namespaced_pod_log(name, namespace,
                                                        container="neonvm-runner"))
            except client.ApiException:
                return ""

        started = time.monotonic()
        wait_for(lambda: "attack: done" in console(), timeout=900, interval=1,
                 what="the hostile guest's attacks to finish")
        name = str(pod_name())
        text = console()
        report = [line for line in text.splitlines() if line.startswith("attack")]
        print(f"\nhostile guest in runner pod {name} on {node.name} "
              f"(done {time.monotonic() - started:.0f}s after the VM was created):\n"
              + "\n".join(report))
        said = {line.split(":", 1)[0][len("attack "):]: line.split(":", 1)[1].strip()
                for line in report if line.startswith("attack ")}
        shown = "\n".join(report)
        # Dropped by the runner's guest filter: the connection attempt times out.
        for target in ("qmp", "qmp-v6", "runner-api", "runner-api-v6", "rights",
                       "etcd-via-runner-loopback"):
            assert said.get(target, "").startswith("nc: timed out"), shown
        # The locks' etcd is reachable on the node's address (no NetworkPolicy is enforced
        # on the real node), but speaks only TLS with client certificates: a request
        # without them gets no answer at all.
        assert said["etcd"] == "[exit 0]", shown
        # The API server: its ClusterIP answers only TLS (the guest has no credentials:
        # runner pods mount no ServiceAccount token); nothing at the host's address.
        assert "Client sent an HTTP request to an HTTPS server" in \
            said["apiserver-clusterip"], shown
        assert "refused" in said["apiserver-host-address"].lower(), shown
        # The guest keeps its network, and its pod stays Ready, never restarted.
        assert said.get("egress", "").startswith(egress.secret), shown
        assert egress.accepted
        pod = core.read_namespaced_pod(name, namespace)
        assert pod.spec.node_name == node.name
        assert {c.type: c.status for c in pod.status.conditions or []}.get("Ready") == "True"
        assert [s.restart_count for s in pod.status.container_statuses or []] == [0]
        assert pod_name() == name
        # The controller's leader answered the runner's rights asks all along.
        assert "self-fenced" not in core.read_namespaced_pod_log(
            name, namespace, container="neonvm-runner")
    finally:
        if egress is not None:
            egress.sock.close()
        with contextlib.suppress(Exception):
            delete_vm(api, namespace, "hostile")
        group.stop_all()
        for r in group:
            print(f"---- {r.name} (exit {r.exit_code()}) ----\n{r.log()[-3000:]}")
        node.stop()
        with contextlib.suppress(client.ApiException):
            core.delete_node(node.name)
