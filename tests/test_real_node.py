"""A real kubelet node (neonvm.dev.realnode) runs a pod to completion, logs readable.

Opt-in: the real node's binaries take many minutes to build cold, so this runs only with
``NEONVM_TEST_REAL_NODE=1`` and where a real node can start on the host; otherwise it
skips with one reason line. ``NEONVM_TEST_REAL_NODE=1 pytest tests/test_real_node.py``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
import threading
import time
import uuid
from pathlib import Path

import pytest
from kubernetes import client

from neonvm.dev import binaries, realnode
from neonvm.dev.cluster import LocalCluster
from tests.support import wait_for


def _skip_reason() -> str | None:
    if os.environ.get("NEONVM_TEST_REAL_NODE") != "1":
        return "real node not requested (set NEONVM_TEST_REAL_NODE=1; see docs/real-node.md)"
    problem = realnode.unavailable_reason()
    return f"a real node cannot start on this host: {problem}" if problem else None


@pytest.mark.cluster
@pytest.mark.realnode
@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_real_node_runs_a_pod_to_completion(
    cluster: LocalCluster, api: client.ApiClient, namespace: str
) -> None:
    realnode.build()
    node = realnode.RealNode(cluster, 0)
    try:
        node.start()
        core = client.CoreV1Api(api)
        ready = core.read_node(node.name)
        assert {c.type: c.status for c in ready.status.conditions}["Ready"] == "True"
        assert ready.status.node_info.kubelet_version == binaries.KUBERNETES_VERSION
        assert ready.status.node_info.container_runtime_version.startswith("containerd://2.")

        word = uuid.uuid4().hex
        pod = {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hello"},
            "spec": {
                "nodeName": node.name,
                "restartPolicy": "Never",
                "containers": [{"name": "hello", "image": realnode.TINY_IMAGE,
                                "imagePullPolicy": "Never",
                                "command": ["/tiny", "echo", "hello", word]}],
            },
        }
        core.create_namespaced_pod(namespace, pod)
        phase = wait_for(
            lambda: (p := core.read_namespaced_pod("hello", namespace).status.phase)
            in ("Succeeded", "Failed") and p,
            timeout=120, interval=0.5, what="pod hello to finish",
        )
        assert phase == "Succeeded"
        status = core.read_namespaced_pod("hello", namespace).status
        assert status.container_statuses[0].state.terminated.exit_code == 0
        # The API server reads the log from the kubelet (client cert of the cluster CA).
        log = core.read_namespaced_pod_log("hello", namespace)
        assert log == f"hello {word}\n"
        kubectl = subprocess.run(
            ["kubectl", "--kubeconfig", str(cluster.kubeconfig), "-n", namespace,
             "logs", "hello"], capture_output=True, text=True, timeout=60,
        ) if _has_kubectl() else None
        if kubectl is not None:
            assert kubectl.stdout == f"hello {word}\n", kubectl.stderr

        # Deleting a finished pod lets the kubelet clean it up and the pod go away.
        core.delete_namespaced_pod("hello", namespace)
        wait_for(lambda: not _exists(core, namespace, "hello"), timeout=120, interval=0.5,
                 what="pod hello deleted")
    finally:
        node.stop()
    # Stopping leaves nothing behind: no processes, shims, cgroups or bridge.
    assert not any(cluster.process_alive(n, "") for n in node.process_names())
    assert node.shim_pids() == []
    for hierarchy in ("memory", "cpu", "unified"):
        assert not Path("/sys/fs/cgroup", hierarchy, node.cgroup_root.lstrip("/")).exists()
    assert not Path("/sys/class/net", node.bridge).exists()


def _exists(core: client.CoreV1Api, namespace: str, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, namespace)
    except client.ApiException as e:
        if e.status == 404:
            return False
        raise
    return True


def _has_kubectl() -> bool:
    import shutil

    return shutil.which("kubectl") is not None


@pytest.mark.unit
def test_oci_archive_is_reproducible_and_names_both_images(tmp_path: Path) -> None:
    """The image containerd imports: same bytes each time, both names, a valid diff_id."""
    binary = tmp_path / "tiny"
    binary.write_bytes(b"#!/bin/sh\necho not really tiny\n")
    names = (realnode.PAUSE_IMAGE, realnode.TINY_IMAGE)
    archive = realnode.oci_archive(binary, names)
    assert archive == realnode.oci_archive(binary, names)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    index = json.loads(files["index.json"])
    assert [m["annotations"]["io.containerd.image.name"] for m in index["manifests"]] == list(names)
    manifest = json.loads(files["blobs/sha256/" + index["manifests"][0]["digest"][7:]])
    config = json.loads(files["blobs/sha256/" + manifest["config"]["digest"][7:]])
    layer_gz = files["blobs/sha256/" + manifest["layers"][0]["digest"][7:]]
    layer = gzip.decompress(layer_gz)
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer).hexdigest()]
    assert config["config"]["Entrypoint"] == ["/tiny"]
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        member = tar.getmember("tiny")
        assert member.mode == 0o755
        assert tar.extractfile(member).read() == binary.read_bytes()  # type: ignore[union-attr]


# ---- the images of `neonvm dev images` on the real node ----------------------------------


def _images_skip_reason() -> str | None:
    from neonvm.dev import images

    reason = _skip_reason()
    if reason:
        return reason
    problem = images.unavailable_reason()
    return f"images cannot be built here: {problem}" if problem else None


def _started_node_with_images(cluster: LocalCluster,
                              names: tuple[str, ...]) -> tuple[realnode.RealNode, list[str]]:
    """Build the images (cached after the first time), start a real node and import
    their OCI archives into its containerd, as `ctr images import` does."""
    from neonvm.controller import podspec
    from neonvm.dev import images

    realnode.build()
    built = images.build(names)
    if "runner" in names:
        assert podspec.DEFAULT_RUNNER_IMAGE in [b.reference for b in built]
    node = realnode.RealNode(cluster, 0)
    node.start()
    for image in built:
        node.ctr("images", "import", "--platform", "linux/amd64", str(image.archive),
                 timeout=600)
        assert image.reference in node.ctr("images", "ls", "-q").split()
    return node, [b.reference for b in built]


def _wait_finished(core: client.CoreV1Api, namespace: str, name: str) -> str:
    return str(wait_for(
        lambda: (p := core.read_namespaced_pod(name, namespace).status.phase)
        in ("Succeeded", "Failed") and p,
        timeout=300, interval=0.5, what=f"pod {name} to finish",
    ))


@pytest.mark.cluster
@pytest.mark.realnode
@pytest.mark.slow
@pytest.mark.skipif(_images_skip_reason() is not None, reason=_images_skip_reason() or "")
def test_built_images_run_on_the_real_node(
    cluster: LocalCluster, api: client.ApiClient, namespace: str
) -> None:
    """The built controller and runner images, imported into containerd, run their
    entrypoints (`neonvm --help`, `neonvm-runner --help`) in pods as the images' user
    (65532, runAsNonRoot) with a read-only root file system."""
    node, refs = _started_node_with_images(cluster, ("controller", "runner"))
    try:
        core = client.CoreV1Api(api)
        for ref, pod, expected in ((refs[0], "controller-help", "Usage: neonvm "),
                                   (refs[1], "runner-help", "Usage: neonvm-runner")):
            core.create_namespaced_pod(namespace, {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
                "spec": {
                    "nodeName": node.name, "restartPolicy": "Never",
                    "securityContext": {"runAsNonRoot": True},
                    "containers": [{
                        "name": "main", "image": ref, "imagePullPolicy": "Never",
                        "args": ["--help"],
                        "securityContext": {"readOnlyRootFilesystem": True,
                                            "allowPrivilegeEscalation": False},
                    }],
                },
            })
            phase = _wait_finished(core, namespace, pod)
            log = core.read_namespaced_pod_log(pod, namespace)
            assert phase == "Succeeded", log
            assert expected in log, log
            core.delete_namespaced_pod(pod, namespace)
            wait_for(lambda p=pod: not _exists(core, namespace, p),  # type: ignore[misc]
                     timeout=120, interval=0.5, what=f"pod {pod} deleted")
    finally:
        node.stop()


@pytest.mark.cluster
@pytest.mark.realnode
@pytest.mark.slow
@pytest.mark.skipif(_images_skip_reason() is not None, reason=_images_skip_reason() or "")
def test_runner_pod_boots_the_test_guest_on_the_real_node(
    cluster: LocalCluster, api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    """A runner pod from the built image runs QEMU (TCG: no vmx/svm here) on the test
    guest; the pod turns Ready only once the guest printed its marker, `kubectl logs`
    shows the guest's console, and deleting the pod powers the guest off."""
    from tests.guest.build import build_guest, missing

    absent = missing()
    if absent:
        pytest.skip(f"cannot build the test guest, missing: {', '.join(absent)}")
    guest = build_guest(tmp_path / "guest")
    node, [image] = _started_node_with_images(cluster, ("runner",))
    try:
        # The pod reads the kernel and initramfs from the host as the image's user.
        shared = node.dir / "guest"
        shared.mkdir(parents=True, exist_ok=True)
        shared.chmod(0o755)
        for src, dest in ((guest.kernel, "vmlinuz"), (guest.initrd, "initrd.cpio")):
            (shared / dest).write_bytes(src.read_bytes())
            (shared / dest).chmod(0o644)
        spec = {
            "terminationGracePeriodSeconds": 60,
            "guest": {
                "cpus": {"min": 1, "max": 1}, "memorySlotSize": "128Mi",
                "memorySlots": {"min": 1, "max": 1}, "rootDisk": {"image": ""},
                "kernelImage": "/guest/vmlinuz", "initrdImage": "/guest/initrd.cpio",
                "appendKernelCmdline": "neonvm.test=powerdown",
            },
        }
        core = client.CoreV1Api(api)
        created = time.monotonic()
        core.create_namespaced_pod(namespace, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "runner-guest"},
            "spec": {
                "nodeName": node.name, "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 60,
                "securityContext": {"runAsNonRoot": True},
                "containers": [{
                    "name": "runner", "image": image, "imagePullPolicy": "Never",
                    "env": [{"name": "NEONVM_VM_SPEC", "value": json.dumps(spec)},
                            {"name": "NEONVM_VM_NAME", "value": "guest"},
                            {"name": "NEONVM_VM_NAMESPACE", "value": namespace},
                            {"name": "NEONVM_ACCEL", "value": "tcg"}],
                    "readinessProbe": {"httpGet": {"path": "/ready", "port": 25183},
                                       "periodSeconds": 1},
                    "securityContext": {"readOnlyRootFilesystem": True,
                                        "allowPrivilegeEscalation": False,
                                        "capabilities": {"drop": ["ALL"]}},
                    "volumeMounts": [{"name": "guest", "mountPath": "/guest",
                                      "readOnly": True},
                                     {"name": "work", "mountPath": "/vm/run"}],
                }],
                "volumes": [{"name": "guest", "hostPath": {"path": str(shared)}},
                            {"name": "work", "emptyDir": {}}],
            },
        })

        def ready() -> bool:
            pod = core.read_namespaced_pod("runner-guest", namespace)
            if pod.status.phase in ("Succeeded", "Failed"):
                raise AssertionError(core.read_namespaced_pod_log("runner-guest", namespace))
            return any(c.type == "Ready" and c.status == "True"
                       for c in pod.status.conditions or [])

        wait_for(ready, timeout=300, interval=0.5, what="the runner pod to be Ready")
        ready_after = time.monotonic() - created
        log = core.read_namespaced_pod_log("runner-guest", namespace)
        assert "guest: mode=powerdown" in log
        assert "NEONVM_GUEST_READY" in log
        if _has_kubectl():
            kubectl = subprocess.run(
                ["kubectl", "--kubeconfig", str(cluster.kubeconfig), "-n", namespace,
                 "logs", "runner-guest"], capture_output=True, text=True, timeout=60)
            assert "NEONVM_GUEST_READY" in kubectl.stdout, kubectl.stderr

        # Deleting the pod: SIGTERM to the runner, an ACPI power-down, the guest powers
        # off, QEMU and the runner exit and the pod goes away. The log is followed until
        # the container ends (the kubelet removes it with the pod).
        stream = core.read_namespaced_pod_log("runner-guest", namespace, follow=True,
                                              _preload_content=False)
        followed: list[bytes] = []
        reader = threading.Thread(target=lambda: followed.extend(stream.stream()),
                                  daemon=True)
        reader.start()
        deleted = time.monotonic()
        core.delete_namespaced_pod("runner-guest", namespace)
        wait_for(lambda: not _exists(core, namespace, "runner-guest"), timeout=120,
                 interval=0.5, what="pod runner-guest deleted")
        # Figures for docs/images.md (shown with -s), not assertions.
        print(f"\nrunner pod: Ready {ready_after:.1f}s after create, gone "
              f"{time.monotonic() - deleted:.1f}s after delete")
        reader.join(timeout=60)
        tail = b"".join(followed).decode(errors="replace")
        assert "SIGTERM received: powering the guest down" in tail, tail[-3000:]
        assert "guest: power button pressed, powering off" in tail, tail[-3000:]
        assert "QEMU exited with code 0" in tail, tail[-3000:]
        print("\n".join(line for line in (log + tail).splitlines()
                        if "guest:" in line or "NEONVM_GUEST_READY" in line
                        or "received" in line or "QEMU exited" in line))
    finally:
        node.stop()
