"""``helm install`` of the chart with its default values on the real node, its own etcd
included, then a VM and ``helm test``.

What the local cluster provides for it, since it has no registry and no cloud
(docs/real-node.md, "The chart with its default values, its own etcd included"):

1. the images the defaults name, present in the node's containerd so that
   ``IfNotPresent`` never pulls: the controller and runner images built here
   (``ghcr.io/neonvm/neonvm-controller:<appVersion>`` and ``-runner``: the package version
   is the chart's appVersion), and an etcd image built here from the etcd binary the
   control plane already uses, named as the chart's ``etcd.bundled.image``
   (:func:`etcd_image_archive`; its version must be the chart's tag);
2. a default StorageClass and local PersistentVolumes on the real node for the
   members' claims (:func:`ensure_volumes`);
3. cluster DNS and ClusterIP routing on the node (``RealNode(cluster_dns=True)``,
   :mod:`neonvm.dev.nodeservices`): the members find each other by the headless
   Service's names, the controller reaches ``https://neonvm-etcd:2379``;
4. every other Node object deleted while the release is installed (:func:`set_aside_others`),
   so that its pods, without a node selector, all land on the real node;
5. the local cluster's own runner-pod fence binding removed while the chart's is in
   force (as :mod:`neonvm.dev.chartnode` does).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import subprocess
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm import kube, manifests
from neonvm.dev import binaries
from neonvm.dev.chartnode import Helm
from neonvm.dev.realnode import RealNode, RealNodeError, _blob

if TYPE_CHECKING:
    from neonvm.dev.cluster import LocalCluster

RELEASE = "real-neonvm-controller"
"""As :data:`neonvm.dev.chartnode.RELEASE` (the local cluster owns ``neonvm-controller``)."""
NAMESPACE = "neonvm-system"
STORAGE_CLASS = "neonvm-local"
VM_NAMESPACE = "default"

Progress = Callable[[str], None]


def _quiet(_msg: str) -> None:
    return None


def chart_etcd_image() -> str:
    """``repository:tag`` of ``etcd.bundled.image`` in the chart's values.yaml."""
    values = yaml.safe_load((manifests.CHART_DIR / "values.yaml").read_text())
    image = values["etcd"]["bundled"]["image"]
    return f"{image['repository']}:{image['tag']}"


def etcd_image_archive(name: str | None = None) -> Path:
    """An OCI archive of one image named ``name`` (default: the chart's etcd image):
    ``/usr/local/bin/etcd`` (the binary of ``neonvm dev install``, the control plane's)
    and ``PATH`` as etcd's upstream image sets it. Cached under the cache root's
    ``images/`` by the binary's hash and the name; byte-for-byte reproducible."""
    name = name or chart_etcd_image()
    tag = name.rsplit(":", 1)[1]
    if tag != binaries.ETCD_VERSION:
        raise RealNodeError(f"the chart's etcd image is {name} but the etcd built here is "
                            f"{binaries.ETCD_VERSION}: an image of another version would "
                            f"run under that tag")
    binary = binaries.require("etcd").read_bytes()
    key = hashlib.sha256(binary + name.encode()).hexdigest()[:16]
    out = binaries.cache_root() / "images" / f"etcd-{binaries.ETCD_VERSION}-{key}.oci.tar"
    if out.exists():
        return out
    layer_tar = io.BytesIO()
    with tarfile.open(fileobj=layer_tar, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("usr", "usr/local", "usr/local/bin", "var", "var/lib", "var/lib/etcd",
                  "tmp"):
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755, 0
            tar.addfile(info)
        info = tarfile.TarInfo("usr/local/bin/etcd")
        info.size, info.mode, info.mtime = len(binary), 0o755, 0
        tar.addfile(info, io.BytesIO(binary))
    layer = layer_tar.getvalue()
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", mtime=0, compresslevel=6) as f:
        f.write(layer)
    blobs: dict[str, bytes] = {}
    layer_desc = _blob(blobs, "application/vnd.oci.image.layer.v1.tar+gzip", gz.getvalue())
    config = {
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                   "Cmd": ["/usr/local/bin/etcd"], "WorkingDir": "/"},
        "rootfs": {"type": "layers",
                   "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }
    config_desc = _blob(blobs, "application/vnd.oci.image.config.v1+json",
                        json.dumps(config, sort_keys=True).encode())
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": config_desc, "layers": [layer_desc]}
    manifest_desc = _blob(blobs, "application/vnd.oci.image.manifest.v1+json",
                          json.dumps(manifest, sort_keys=True).encode())
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [{**manifest_desc,
                            "platform": {"architecture": "amd64", "os": "linux"},
                            "annotations": {"io.containerd.image.name": name,
                                            "org.opencontainers.image.ref.name": tag}}]}
    files = {"oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
             "index.json": json.dumps(index, sort_keys=True).encode(), **blobs}
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, content in sorted(files.items()):
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(content), 0o644, 0
            tar.addfile(info, io.BytesIO(content))
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    partial.write_bytes(archive.getvalue())
    partial.rename(out)
    return out


def import_images(node: RealNode, progress: Progress = _quiet) -> dict[str, str]:
    """Build (cached) and import the controller, runner, etcd and guest disk images;
    {role: reference}."""
    from neonvm.dev import guestdisk, images

    built = {b.name: b for b in images.build(("controller", "runner"), progress=progress)}
    disk_dir = node.dir / "guest-disk"
    disk_dir.mkdir(parents=True, exist_ok=True)
    _raw, qcow2 = guestdisk.build_rootfs(disk_dir)
    archives = {"controller": (built["controller"].archive, built["controller"].reference),
                "runner": (built["runner"].archive, built["runner"].reference),
                "etcd": (etcd_image_archive(), chart_etcd_image()),
                "disk": (guestdisk.disk_image_archive(qcow2, disk_dir / "rootdisk.oci.tar"),
                         guestdisk.DISK_IMAGE)}
    for archive, _ref in archives.values():
        node.ctr("images", "import", "--platform", "linux/amd64", str(archive), timeout=600)
    listed = node.ctr("images", "ls", "-q").split()
    missing = [ref for _a, ref in archives.values() if ref not in listed]
    if missing:
        raise RealNodeError(f"{missing} missing from {node.name} after the import")
    progress(f"{node.name}: imported {', '.join(ref for _a, ref in archives.values())}")
    return {role: ref for role, (_a, ref) in archives.items()}


def ensure_volumes(api: client.ApiClient, node: RealNode, count: int, size: str = "1Gi"
                   ) -> list[str]:
    """The default StorageClass (no provisioner, bound when a pod is scheduled) and at
    least ``count`` Available local PersistentVolumes on ``node`` (directories under its
    state dir); the names of those made now."""
    storage = client.StorageV1Api(api)
    with contextlib.suppress(ApiException):
        storage.create_storage_class({
            "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
            "metadata": {"name": STORAGE_CLASS, "annotations": {
                "storageclass.kubernetes.io/is-default-class": "true"}},
            "provisioner": "kubernetes.io/no-provisioner",
            "volumeBindingMode": "WaitForFirstConsumer", "reclaimPolicy": "Retain"})
    core = client.CoreV1Api(api)
    existing = core.list_persistent_volume().items
    available = [p for p in existing if p.spec.storage_class_name == STORAGE_CLASS
                 and p.status.phase == "Available"]
    made: list[str] = []
    index = len(existing)
    while len(available) + len(made) < count:
        name = f"{node.name}-pv-{index}"
        index += 1
        path = node.dir / "volumes" / name
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o700)
        core.create_persistent_volume({
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": size}, "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain", "storageClassName": STORAGE_CLASS,
                "local": {"path": str(path)},
                "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In",
                     "values": [node.name]}]}]}},
            }})
        made.append(name)
    return made


def set_aside_others(api: client.ApiClient, node: RealNode) -> list[str]:
    """Delete every Node object but ``node``'s (the kwok nodes; :func:`bring_back`
    makes them again); their names.

    Not a cordon: the chart's default topology spread over ``kubernetes.io/hostname``
    (``DoNotSchedule``, skew 1) counts a cordoned node as a domain with no replica, so a
    second replica on the real node would exceed the skew and stay Pending."""
    core = client.CoreV1Api(api)
    names = [n.metadata.name for n in core.list_node().items if n.metadata.name != node.name]
    for name in names:
        core.delete_node(name)
    return names


def bring_back(cluster: LocalCluster) -> None:
    """The simulated nodes :func:`set_aside_others` deleted, made again and Ready."""
    from neonvm.dev import nodes

    if cluster.spec.nodes > 0:
        nodes.ensure_nodes(cluster)
        nodes.wait_nodes_schedulable(cluster, 120)


def helm(cluster: LocalCluster, binary: str) -> Helm:
    """``binary`` is ``helm`` (Helm 4) or ``helm3``; its homes apart from the other's."""
    return Helm(binaries.require(binary), cluster.state_dir / f"{binary}-home",
                cluster.kubeconfig)


def _ready(obj: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in obj.status.conditions or [])


def pods(api: client.ApiClient, selector: str, namespace: str = NAMESPACE) -> list[Any]:
    return [p for p in client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=selector).items if p.metadata.deletion_timestamp is None]


CONTROLLER = f"app.kubernetes.io/name=neonvm-controller,app.kubernetes.io/instance={RELEASE}"
ETCD = f"app.kubernetes.io/name=neonvm-etcd,app.kubernetes.io/instance={RELEASE}"


def wait(what: str, check: Callable[[], Any], timeout: float, progress: Progress,
         state: Callable[[], str]) -> float:
    """Wait until ``check()`` is truthy; the seconds it took. ``state()`` says where things
    stand every 15 s and in the error."""
    started = time.monotonic()
    said = 0.0
    while True:
        with contextlib.suppress(ApiException, OSError):
            if check():
                return time.monotonic() - started
        elapsed = time.monotonic() - started
        if elapsed > timeout:
            raise RealNodeError(f"not {what} after {timeout:.0f}s: {state()}")
        if elapsed - said >= 15:
            said = elapsed
            progress(f"waiting for {what} ({elapsed:.0f}s): {state()}")
        time.sleep(1.0)


def pod_states(api: client.ApiClient, namespace: str = NAMESPACE) -> str:
    """``name phase ready restarts`` of every pod in ``namespace``."""
    with contextlib.suppress(ApiException, OSError):
        return "; ".join(
            f"{p.metadata.name} {p.status.phase}{' Ready' if _ready(p) else ''}"
            f" restarts={sum(c.restart_count for c in p.status.container_statuses or [])}"
            for p in client.CoreV1Api(api).list_namespaced_pod(namespace).items)
    return "(pods not listed)"


@dataclass
class Result:
    helm: str
    version: str
    install_seconds: float = 0.0
    etcd_ready_seconds: float = 0.0
    controllers_ready_seconds: float = 0.0
    vm_ready_seconds: float = 0.0
    test_seconds: float = 0.0
    get_pods: str = ""
    vm: dict[str, Any] = field(default_factory=dict)
    vm_pod: str = ""
    test_output: str = ""
    guest_log: str = ""


def kubectl(cluster: LocalCluster, *args: str) -> str:
    return subprocess.run(["kubectl", "--kubeconfig", str(cluster.kubeconfig), *args],
                          capture_output=True, text=True, timeout=120).stdout


def install_and_test(cluster: LocalCluster, node: RealNode, helm_binary: str = "helm",
                     timeout: float = 900, progress: Progress = _quiet) -> Result:
    """Steps 1-5 of the module docstring, then ``helm install`` with no values, three
    members and three controllers Ready, a VM whose guest boots on the node, and
    ``helm test``. Leaves the release installed (:func:`uninstall`)."""
    from neonvm.dev import realguest
    from tests.support.harness import converged, create_vm, get_vm

    if not node.cluster_dns:
        raise RealNodeError(f"{node.name} was started without cluster DNS "
                            f"(RealNode(..., cluster_dns=True))")
    h = helm(cluster, helm_binary)
    result = Result(helm_binary, h.run("version", "--short").strip())
    import_images(node, progress)
    api = kube.api_client(cluster.kubeconfig)
    try:
        ensure_volumes(api, node, 3)
        aside = set_aside_others(api, node)
        progress(f"deleted the Nodes {aside} (made again by uninstall): every pod lands on "
                 f"{node.name}")
        with contextlib.suppress(ApiException):
            client.AdmissionregistrationV1Api(api).delete_validating_admission_policy_binding(
                manifests.POLICY_NAME)
        started = time.monotonic()
        h.run("install", RELEASE, str(manifests.CHART_DIR), "--namespace", NAMESPACE,
              "--create-namespace")
        result.install_seconds = time.monotonic() - started
        progress(f"{helm_binary} install (no values) took {result.install_seconds:.1f}s")

        def state() -> str:
            return pod_states(api)

        # Both from the start of `helm install`: the controllers may be Ready first.
        wait("3 etcd members Ready", lambda: sum(map(_ready, pods(api, ETCD))) == 3,
             timeout, progress, state)
        result.etcd_ready_seconds = time.monotonic() - started
        wait("3 controller replicas Ready", lambda: sum(map(_ready, pods(api, CONTROLLER))) == 3,
             timeout, progress, state)
        result.controllers_ready_seconds = time.monotonic() - started
        result.get_pods = kubectl(cluster, "-n", NAMESPACE, "get", "pods,pvc", "-o", "wide")
        progress(result.get_pods)

        vm_name = f"guest-{helm_binary}"
        created = time.monotonic()
        create_vm(api, VM_NAMESPACE, vm_name, spec=realguest.vm_spec(
            args=("hello", "from", "the", "chart", helm_binary)))
        core = client.CoreV1Api(api)

        def guest_ready() -> bool:
            vm = get_vm(api, VM_NAMESPACE, vm_name) or {}
            name = (vm.get("status") or {}).get("podName")
            return bool(name and (vm.get("status") or {}).get("phase") == "Running"
                        and _ready(core.read_namespaced_pod(name, VM_NAMESPACE))
                        and converged(api, VM_NAMESPACE, [vm_name]))

        result.vm_ready_seconds = wait(
            f"VM {vm_name} Running with its runner pod Ready", guest_ready, timeout, progress,
            lambda: pod_states(api, VM_NAMESPACE))
        result.vm = get_vm(api, VM_NAMESPACE, vm_name) or {}
        result.vm_pod = result.vm["status"]["podName"]
        result.guest_log = kubectl(cluster, "-n", VM_NAMESPACE, "logs", result.vm_pod,
                                   "-c", "neonvm-runner")
        progress(f"VM {vm_name} converged, guest booted "
                 f"{time.monotonic() - created:.1f}s after it was created")

        started = time.monotonic()
        result.test_output = h.run("test", RELEASE, "--namespace", NAMESPACE, "--logs",
                                   "--timeout", "10m", timeout=900)
        result.test_seconds = time.monotonic() - started
        progress(result.test_output)
        return result
    finally:
        api.close()


def uninstall(cluster: LocalCluster, node: RealNode, helm_binary: str = "helm",
              timeout: float = 300) -> None:
    """Delete the test VMs, ``helm uninstall``, delete the members' claims (the
    StatefulSet leaves them), the test pod and the Lease, restore the local fence and
    the simulated nodes."""
    from tests.support.harness import delete_vm, get_vm

    api = kube.api_client(cluster.kubeconfig)
    core = client.CoreV1Api(api)
    try:
        vm_name = f"guest-{helm_binary}"
        delete_vm(api, VM_NAMESPACE, vm_name)
        deadline = time.monotonic() + timeout
        while get_vm(api, VM_NAMESPACE, vm_name) is not None and time.monotonic() < deadline:
            time.sleep(1.0)
        with contextlib.suppress(RealNodeError):
            helm(cluster, helm_binary).run("uninstall", RELEASE, "--namespace", NAMESPACE,
                                           "--wait", "--timeout", f"{int(timeout)}s",
                                           timeout=timeout + 30)
        # What the release leaves: the members' claims (the StatefulSet's rule), the
        # helm test pod (kept for --logs) and the Lease (the controller's, not helm's).
        with contextlib.suppress(ApiException):
            core.delete_collection_namespaced_persistent_volume_claim(
                NAMESPACE, label_selector="app.kubernetes.io/name=neonvm-etcd")
        with contextlib.suppress(ApiException):
            core.delete_namespaced_pod(f"{RELEASE}-test", NAMESPACE)
        with contextlib.suppress(ApiException):
            client.CoordinationV1Api(api).delete_namespaced_lease(RELEASE, NAMESPACE)
        while time.monotonic() < deadline and (
                pods(api, CONTROLLER) or pods(api, ETCD)
                or core.list_namespaced_persistent_volume_claim(NAMESPACE).items):
            time.sleep(1.0)
        kube.apply(api, manifests.admission_policy_binding())
        bring_back(cluster)
    finally:
        api.close()
