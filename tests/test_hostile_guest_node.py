"""A hostile guest in a real runner pod on the real kubelet node (issue 28).

:class:`HostileGuest` (``tests/support/hostile_guest.py``) runs in the default suite
beside the VM of ``tests/test_real_node.py``'s default test (same node, images and
controller; no rights port there). The test here is opt-in (``NEONVM_TEST_REAL_NODE=1 pytest
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
import uuid
from pathlib import Path

import pytest
from kubernetes import client

from neonvm.dev.cluster import LocalCluster
from tests.support import FAST
from tests.support.hostile_guest import HostileGuest, check_report
from tests.support.real_node import _images_skip_reason, _started_node_with_images


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
