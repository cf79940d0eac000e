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
