"""The chart's controller as real pods: ``helm install`` onto a real node of the local cluster.

What it takes, in order (each step is also a shell command, see docs/real-node.md):

1. the controller image, built by :mod:`neonvm.dev.images` (cached), imported into the
   real node's containerd (``ctr images import``), as the runner image is;
2. the real node *reserved* for the controller: a ``NoSchedule`` taint that only the
   chart's pods tolerate (their ``nodeSelector`` keeps them there), so the drill's
   runner pods go to the kwok nodes instead of trying to run QEMU here;
3. the local cluster's own runner-pod fence (for the local ``neonvm-controller`` user)
   suspended: the chart brings its own, for its ServiceAccount, and two fences that name
   different users would refuse every ungate;
4. ``helm install`` with :func:`values`: the image (``pullPolicy: Never``), the locks'
   etcd at the node's address (the real node forwards it to the etcd on 127.0.0.1, see
   :meth:`neonvm.dev.realnode.RealNode._forward_control_plane`), node selector and
   toleration. The pods reach the API server through the ``kubernetes`` Service's
   ClusterIP, which the node forwards too; their token comes from the ServiceAccount
   admission plugin, which the local cluster keeps on only when it was started with
   ``ClusterSpec.service_account_tokens`` (``neonvm dev up --real-nodes N`` does).

Pod networking, not ``hostNetwork``: three replicas on one node with host networking
would all bind the same health port (the chart has one ``controller.healthPort``, and the
scheduler refuses a second pod with the same host port on a node).
"""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm import kube, manifests
from neonvm.dev import binaries
from neonvm.dev.realnode import REAL_LABEL, RealNode, RealNodeError

if TYPE_CHECKING:
    from neonvm.dev.cluster import LocalCluster

RELEASE = "real-neonvm-controller"
"""Not ``neonvm-controller``: the local cluster made a ClusterRole of that name for its own
controller user, and helm refuses to adopt it. The release name is also the fullname,
hence the Lease's name (``neonvm-system/real-neonvm-controller``)."""
NAMESPACE = "neonvm-system"
SELECTOR = f"app.kubernetes.io/name=neonvm-controller,app.kubernetes.io/instance={RELEASE}"
TAINT = client.V1Taint(key=REAL_LABEL, value="true", effect="NoSchedule")

Progress = Callable[[str], None]


def _quiet(_msg: str) -> None:
    return None


def values(node: RealNode, image: str, replicas: int = 3) -> dict[str, Any]:
    """The chart values that run the controller on ``node`` (``image``: ``repo:tag``)."""
    repository, tag = image.rsplit(":", 1)
    return {
        "replicaCount": replicas,
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        # TLS with the controller's client certificate (the chart's default Secret,
        # written by etcd_client_secret). No NetworkPolicy: the locks' etcd is a process
        # on this host, not a pod a policy could select.
        # Not the chart's bundled etcd: the drill reads the locks from the local
        # cluster's locks etcd. The bundled etcd on the real node: chartdefaults.
        "etcd": {"endpoints": [node.locks_etcd_url_for_pods],
                 "networkPolicy": {"enabled": False}, "bundled": {"enabled": False}},
        "nodeSelector": {REAL_LABEL: "true"},
        "tolerations": [{"key": TAINT.key, "operator": "Equal", "value": TAINT.value,
                         "effect": TAINT.effect}],
        # The chart's liveness probe gives a replica 35 s to serve /healthz. On this
        # shared 2-core host (load average 17 to 28 during the first runs) the node's
        # whole cgroup got a sliver of CPU and a replica's Python start took over a
        # minute of wall time (2 s of CPU), so every replica was killed before it
        # served and the leader changed on every restart: the drill measured restarts,
        # not failover. Slower probes here; the chart's defaults are unchanged.
        "probes": {
            "liveness": {"initialDelaySeconds": 180, "periodSeconds": 10,
                         "timeoutSeconds": 10, "failureThreshold": 6},
            "readiness": {"initialDelaySeconds": 2, "periodSeconds": 2,
                          "timeoutSeconds": 10, "failureThreshold": 3},
        },
    }


def etcd_client_secret(cluster: LocalCluster) -> dict[str, Any]:
    """The chart's default etcd Secret: the locks' etcd CA and the controller's client
    certificate (its etcd user may touch the default prefix only)."""
    config = cluster.locks_etcd_config()
    assert config.ca and config.cert and config.key
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": "neonvm-etcd-client", "namespace": NAMESPACE},
            "data": {name: base64.b64encode(path.read_bytes()).decode()
                     for name, path in (("ca.crt", config.ca), ("tls.crt", config.cert),
                                        ("tls.key", config.key))}}


def _put_secret(api: client.ApiClient, secret: dict[str, Any]) -> None:
    core = client.CoreV1Api(api)
    name, namespace = secret["metadata"]["name"], secret["metadata"]["namespace"]
    try:
        core.create_namespaced_secret(namespace, secret)
    except ApiException as exc:
        if exc.status != 409:
            raise
        core.replace_namespaced_secret(name, namespace, secret)


def import_controller_image(node: RealNode, progress: Progress = _quiet) -> str:
    """Build the controller image (cached) and import it into the node; its reference."""
    from neonvm.dev import images

    [built] = images.build(("controller",), progress=progress)
    node.ctr("images", "import", "--platform", "linux/amd64", str(built.archive), timeout=600)
    if built.reference not in node.ctr("images", "ls", "-q").split():
        raise RealNodeError(f"{built.reference} missing from {node.name} after the import")
    progress(f"{node.name}: {built.reference} imported")
    return built.reference


def reserve(api: client.ApiClient, node: RealNode) -> None:
    """Taint the node so that only pods tolerating :data:`TAINT` (the chart's) land there."""
    core = client.CoreV1Api(api)
    taints = core.read_node(node.name).spec.taints or []
    if not any(t.key == TAINT.key and t.effect == TAINT.effect for t in taints):
        core.patch_node(node.name, {"spec": {"taints": [
            api.sanitize_for_serialization(t) for t in [*taints, TAINT]]}})


def unreserve(api: client.ApiClient, node: RealNode) -> None:
    core = client.CoreV1Api(api)
    with contextlib.suppress(ApiException):
        taints = core.read_node(node.name).spec.taints or []
        kept = [api.sanitize_for_serialization(t) for t in taints
                if not (t.key == TAINT.key and t.effect == TAINT.effect)]
        core.patch_node(node.name, {"spec": {"taints": kept or None}})


@dataclass(frozen=True)
class Helm:
    """The helm binary with its config, cache and data kept in the cluster's state dir."""

    binary: Path
    home: Path
    kubeconfig: Path

    def run(self, *args: str, timeout: float = 600) -> str:
        env = {**os.environ, "HELM_CACHE_HOME": str(self.home / "cache"),
               "HELM_CONFIG_HOME": str(self.home / "config"),
               "HELM_DATA_HOME": str(self.home / "data"), "KUBECONFIG": str(self.kubeconfig)}
        proc = subprocess.run([str(self.binary), *args], env=env, capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RealNodeError(f"helm {' '.join(args)} exited {proc.returncode}: "
                                f"{(proc.stderr or proc.stdout).strip()}")
        return proc.stdout


def helm_for(cluster: LocalCluster) -> Helm:
    return Helm(binaries.require("helm"), cluster.state_dir / "helm", cluster.kubeconfig)


def controller_pods(api: client.ApiClient, namespace: str = NAMESPACE) -> list[Any]:
    """The chart's controller pods that are not being deleted."""
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=SELECTOR).items
    return [p for p in pods if p.metadata.deletion_timestamp is None]


def ready_pods(api: client.ApiClient, namespace: str = NAMESPACE) -> list[Any]:
    return [p for p in controller_pods(api, namespace)
            if any(c.type == "Ready" and c.status == "True"
                   for c in (p.status.conditions or []))]


def wait_ready(api: client.ApiClient, count: int, timeout: float,
               progress: Progress = _quiet, namespace: str = NAMESPACE) -> float:
    """Wait until ``count`` controller pods are Ready; the seconds it took."""
    started = time.monotonic()
    said = 0.0
    while True:
        try:
            ready = ready_pods(api, namespace)
        except (ApiException, OSError):
            ready = []
        elapsed = time.monotonic() - started
        if len(ready) >= count:
            return elapsed
        if elapsed > timeout:
            pods = controller_pods(api, namespace)
            states = {p.metadata.name: p.status.phase for p in pods}
            raise RealNodeError(f"{len(ready)}/{count} controller pods Ready after "
                                f"{timeout:.0f}s: {states}")
        if elapsed - said >= 10:
            said = elapsed
            progress(f"{len(ready)}/{count} controller pods Ready ({elapsed:.0f}s)")
        time.sleep(0.5)


@dataclass(frozen=True)
class Installed:
    image: str
    values: dict[str, Any]
    helm_seconds: float
    """``helm install`` alone (it does not wait for the pods)."""
    ready_seconds: float
    """From the start of ``helm install`` to every replica Ready."""


def install(cluster: LocalCluster, node: RealNode, replicas: int = 3, timeout: float = 600,
            progress: Progress = _quiet) -> Installed:
    """Steps 1-4 of the module docstring; waits until ``replicas`` pods are Ready."""
    if not cluster.spec.service_account_tokens:
        raise RealNodeError("the cluster was started without service_account_tokens: its "
                            "pods get no ServiceAccount token (start it with "
                            "`neonvm dev up --real-nodes 1`)")
    image = import_controller_image(node, progress)
    api = kube.api_client(cluster.kubeconfig)
    try:
        reserve(api, node)
        with contextlib.suppress(ApiException):
            client.AdmissionregistrationV1Api(api).delete_validating_admission_policy_binding(
                manifests.POLICY_NAME)
        _put_secret(api, etcd_client_secret(cluster))
        chosen = values(node, image, replicas)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=cluster.state_dir,
                                         delete=False) as f:
            yaml.safe_dump(chosen, f)
        started = time.monotonic()
        helm_for(cluster).run("install", RELEASE, str(manifests.CHART_DIR), "--namespace",
                              NAMESPACE, "--create-namespace", "--values", f.name)
        helm_seconds = time.monotonic() - started
        progress(f"helm install done in {helm_seconds:.1f}s; waiting for {replicas} pods")
        wait_ready(api, replicas, timeout, progress)
        ready_seconds = time.monotonic() - started
        progress(f"{replicas} controller pods Ready {ready_seconds:.1f}s after helm install")
        return Installed(image, chosen, helm_seconds, ready_seconds)
    finally:
        api.close()


def uninstall(cluster: LocalCluster, node: RealNode, timeout: float = 120) -> None:
    """``helm uninstall``, wait for the pods to go, restore the local fence and the node."""
    api = kube.api_client(cluster.kubeconfig)
    try:
        with contextlib.suppress(RealNodeError):
            helm_for(cluster).run("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait",
                                  "--timeout", f"{int(timeout)}s", timeout=timeout + 30)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(ApiException, OSError):
                if not client.CoreV1Api(api).list_namespaced_pod(
                        NAMESPACE, label_selector=SELECTOR).items:
                    break
            time.sleep(0.5)
        kube.apply(api, manifests.admission_policy_binding())
        unreserve(api, node)
    finally:
        api.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m neonvm.dev.chartnode {install,uninstall,values} --state-dir DIR``."""
    import argparse

    from neonvm.dev.cluster import LocalCluster

    parser = argparse.ArgumentParser(prog="python -m neonvm.dev.chartnode",
                                     description="The chart's controller on the real node "
                                                 "of a local cluster (docs/real-node.md).")
    parser.add_argument("action", choices=("install", "uninstall", "values"))
    parser.add_argument("--state-dir", type=Path, default=None)
    parser.add_argument("--replicas", type=int, default=3)
    args = parser.parse_args(argv)
    cluster = LocalCluster(args.state_dir)
    node = RealNode(cluster, 0)
    if args.action == "values":
        from neonvm.dev.images import REGISTRY

        print(yaml.safe_dump(values(node, f"{REGISTRY}/neonvm-controller:<built tag>",
                                    args.replicas), sort_keys=False), end="")
    elif args.action == "install":
        done = install(cluster, node, args.replicas, progress=print)
        print(f"helm install took {done.helm_seconds:.1f}s; {args.replicas} pods Ready "
              f"{done.ready_seconds:.1f}s after it began; the Lease is "
              f"{NAMESPACE}/{RELEASE}")
    else:
        uninstall(cluster, node)
        print(f"uninstalled {RELEASE}; the local fence and the node are as before")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
