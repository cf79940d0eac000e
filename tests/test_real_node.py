"""A real kubelet node (neonvm.dev.realnode) runs a pod to completion, logs readable.

One test runs by default (the controller's runner pod boots a guest on the real node)
wherever a real node can start and its binaries are built (``bash scripts/test.sh``
builds them; so does ``neonvm dev install --real-nodes``); the others are opt-in, with
``NEONVM_TEST_REAL_NODE=1``. ``NEONVM_TEST_REAL_NODE=0`` skips them all. Each skip says
why in one line. ``NEONVM_TEST_REAL_NODE=1 pytest tests/test_real_node.py`` runs all.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
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
from tests.support.real_node import (
    _images_skip_reason,
    _PodEvents,
    _print_pods_and_events,
    _skip_reason,
    _started_node_with_images,
)


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
    # ... nor the NAT chain that lets pods reach the API server and the locks' etcd.
    assert subprocess.run(["iptables", "-t", "nat", "-S", node.nat_chain],
                          capture_output=True).returncode != 0


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


# ---- a VM through the controller, on the real node ----------------------------------------


@pytest.mark.cluster
@pytest.mark.realnode
@pytest.mark.slow
@pytest.mark.timeout(1800)  # a cold image build takes most of the default 600 s
@pytest.mark.skipif(_images_skip_reason(default=True) is not None,
                    reason=_images_skip_reason(default=True) or "")
def test_controller_runner_pod_boots_a_bare_ext4_guest_on_the_real_node(
    cluster: LocalCluster, api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    """A VirtualMachine the NeonVM way (no kernelImage, a container image carrying a bare
    ext4 /disk.qcow2, command/args/env/sysctl/swap in the spec): the controller creates
    the runner pod, it lands on the real node, the runner boots its own kernel (TCG) and
    the pod turns Ready from the guest's marker; `kubectl logs` shows the guest's
    console. Deleting the pod: SIGTERM, ACPI power-down, the command stops, QEMU exits
    0, the pod goes away, and only then is the replacement ungated."""
    from neonvm.dev import guestdisk
    from tests.support import FAST
    from tests.support.harness import Replicas, converged, create_vm, delete_vm, get_vm
    from tests.support.hostile_guest import HostileGuest

    absent = guestdisk.missing()
    if absent:
        pytest.skip(f"cannot build the test root disk, missing: {', '.join(absent)}")
    _raw, qcow2 = guestdisk.build_rootfs(tmp_path / "disk")
    archive = guestdisk.disk_image_archive(qcow2, tmp_path / "rootdisk.oci.tar")
    host_before = _host_sysctls()
    node, [image] = _started_node_with_images(cluster, ("runner",))
    events: _PodEvents | None = None
    hostile: HostileGuest | None = None
    group = Replicas(api=api, kubeconfig=cluster.kubeconfig_for("controller"),
                     etcd_endpoints=cluster.locks_etcd_config(f"/t-{uuid.uuid4().hex[:8]}"),
                     lease_namespace=namespace, log_dir=tmp_path / "replicas",
                     extra_args=[*FAST, "--watch-namespace", namespace, "--runner-image", image])
    try:
        node.ctr("images", "import", "--platform", "linux/amd64", str(archive), timeout=300)
        core = client.CoreV1Api(api)
        group.start("c0")
        events = _PodEvents(api, namespace, "guest")
        created = time.monotonic()
        create_vm(api, namespace, "guest", restart_policy="Always", spec={
            "terminationGracePeriodSeconds": 60,
            "nodeSelector": {realnode.REAL_LABEL: "true"},
            "guest": {
                "cpus": {"min": 1, "max": 1}, "memorySlotSize": "256Mi",
                "memorySlots": {"min": 1, "max": 1},
                "rootDisk": {"image": guestdisk.DISK_IMAGE, "imagePullPolicy": "Never"},
                "command": ["/app/report.sh"], "args": ["from", "the controller"],
                "env": [{"name": "GREETING", "value": "hello from the spec"},
                        {"name": "REPORT_SYSCTLS", "value": "vm.swappiness"}],
                "settings": {"sysctl": ["vm.swappiness=17"], "swap": "32Mi"},
            },
        })
        # Beside it, a hostile guest tries QMP, the runner's ports, etcd and the API
        # server from inside (issue 28; tests/test_hostile_guest_node.py).
        hostile = HostileGuest(api, namespace, node)
        hostile.create(cluster)

        def first_pod_ready() -> str | None:
            vm = get_vm(api, namespace, "guest") or {}
            name = (vm.get("status") or {}).get("podName")
            if not name:
                return None
            try:
                pod = core.read_namespaced_pod(name, namespace)
            except client.ApiException:
                return None
            if pod.status.phase in ("Succeeded", "Failed"):
                raise AssertionError(core.read_namespaced_pod_log(
                    name, namespace, container="neonvm-runner")[-5000:])
            ready = any(c.type == "Ready" and c.status == "True"
                        for c in pod.status.conditions or [])
            return name if ready else None

        pod_name = str(wait_for(first_pod_ready, timeout=600, interval=0.5,
                                what="the controller's runner pod to be Ready"))
        ready_after = time.monotonic() - created
        pod = core.read_namespaced_pod(pod_name, namespace)
        assert pod.spec.node_name == node.name
        assert converged(api, namespace, ["guest"])
        assert (get_vm(api, namespace, "guest") or {})["status"].get("phase") == "Running"
        wanted = ("neonvm-init: root filesystem /dev/vda mounted", "NEONVM_GUEST_READY",
                  "app: argv from the controller", "app: GREETING=hello from the spec",
                  "app: sysctl vm.swappiness=17", "app: SwapTotal: 32764 kB")
        shown = [""]

        def kubectl_logs_show_the_guest() -> bool:
            # The command prints after the ready marker (the pod may be Ready first).
            out = subprocess.run(
                ["kubectl", "--kubeconfig", str(cluster.kubeconfig), "-n", namespace, "logs",
                 pod_name, "-c", "neonvm-runner"],
                capture_output=True, text=True, timeout=60)
            shown[0] = out.stdout[-4000:] + out.stderr
            return all(line in out.stdout for line in wanted)

        try:
            wait_for(kubectl_logs_show_the_guest, timeout=120, interval=1,
                     what="the guest's lines in kubectl logs")
        except AssertionError:
            raise AssertionError(shown[0]) from None
        hostile.check()

        stream = core.read_namespaced_pod_log(pod_name, namespace, container="neonvm-runner",
                                              follow=True, _preload_content=False)
        followed: list[bytes] = []
        reader = threading.Thread(target=lambda: followed.extend(stream.stream()),
                                  daemon=True)
        reader.start()
        deleted = time.monotonic()
        core.delete_namespaced_pod(pod_name, namespace)
        wait_for(lambda: not _exists(core, namespace, pod_name), timeout=180, interval=0.5,
                 what=f"pod {pod_name} gone")
        gone_after = time.monotonic() - deleted

        def replacement_ungated() -> bool:
            return events.first(lambda e: e[1] != pod_name and not e[2]) is not None

        wait_for(replacement_ungated, timeout=180, interval=0.5,
                 what="a replacement pod, ungated")
        reader.join(timeout=60)
        tail = b"".join(followed).decode(errors="replace")
        for line in ("SIGTERM received: powering the guest down",
                     "neonvm-init: power button pressed: stopping the command",
                     "app: SIGTERM, exiting",
                     "neonvm-init: command exited with code 0: powering off",
                     "QEMU exited with code 0"):
            assert line in tail, tail[-4000:]
        gone_at = events.first(lambda e: e[0] == "DELETED" and e[1] == pod_name)
        ungated_at = events.first(lambda e: e[1] != pod_name and not e[2])
        assert gone_at is not None and ungated_at is not None
        assert gone_at < ungated_at, events.events
        print(f"\ncontroller's runner pod: Ready {ready_after:.1f}s after the VM was created; "
              f"gone {gone_after:.1f}s after delete; replacement ungated "
              f"{events.events[ungated_at][3] - events.events[gone_at][3]:.2f}s after the "
              "old pod's DELETED event")
    finally:
        if events is not None:
            events.stop()
        _print_pods_and_events(cluster, namespace)
        with contextlib.suppress(Exception):
            delete_vm(api, namespace, "guest")
        if hostile is not None:
            hostile.close()
        group.stop_all()
        for r in group:
            print(f"---- {r.name} (exit {r.exit_code()}) ----\n{r.log()[-5000:]}")
        node.stop()
        # This test runs in the default suite on the session's control plane: remove the
        # stopped node's Node object, so that no later test's pod is bound to it.
        with contextlib.suppress(client.ApiException):
            client.CoreV1Api(api).delete_node(node.name)
    # The host is as it was: the sysctls the kubelet wrote are back (unless another real
    # node, e.g. another test session's, runs on this host and keeps its kubelet's values).
    if not realnode.other_kubelets():
        assert _host_sysctls() == host_before
        assert not (realnode.KUBELET_HOST_DIR / "device-plugins" / "kubelet.sock").exists()
    assert not Path("/sys/class/net", node.bridge).exists()


def _host_sysctls() -> dict[str, str]:
    return {k: Path("/proc/sys", k).read_text().strip() for k in realnode.KUBELET_SYSCTLS}


@pytest.mark.cluster
@pytest.mark.realnode
@pytest.mark.slow
@pytest.mark.skipif(_images_skip_reason() is not None, reason=_images_skip_reason() or "")
def test_kvm_device_plugin_puts_dev_kvm_into_a_runner_pod_on_the_real_node(
    cluster: LocalCluster, api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    """`neonvm runner kvm-device-plugin` registers devices.kubevirt.io/kvm with the real
    kubelet; a pod requesting one gets /dev/kvm in its (unprivileged, non-root)
    container; the runner there opens it, finds no vmx/svm on this host, runs TCG and
    reports AccelerationUnavailable in its log and termination message."""
    import sys

    from neonvm.runner import kvmplugin

    if not Path("/dev/kvm").exists():
        pytest.skip("no /dev/kvm on this host")
    node, [image] = _started_node_with_images(cluster, ("runner",))
    plugin_log = (tmp_path / "plugin.log").open("wb")
    plugin = subprocess.Popen(
        [sys.executable, "-m", "neonvm", "runner", "kvm-device-plugin", "--plugin-dir",
         str(kvmplugin.DEFAULT_DIR)], stdout=plugin_log, stderr=subprocess.STDOUT)
    try:
        core = client.CoreV1Api(api)

        def advertised() -> str | None:
            # The kubelet checkpoints known resources (kubelet_internal_checkpoint in the
            # plugin directory) and shows them as 0 until their plugin registers.
            capacity = core.read_node(node.name).status.capacity or {}
            value = capacity.get(kvmplugin.DEFAULT_RESOURCE)
            return value if value not in (None, "0") else None

        assert wait_for(advertised, timeout=120, interval=0.5,
                        what="the node to advertise devices.kubevirt.io/kvm") == "100"
        spec = {"enableAcceleration": True, "guest": {
            "cpus": {"min": 1, "max": 1}, "memorySlotSize": "128Mi",
            "memorySlots": {"min": 1, "max": 1}, "rootDisk": {"image": ""},
            "kernelImage": "/vm/kernel/vmlinuz"}}
        script = ("ls -ln /dev/kvm; exec neonvm-runner --qemu /bin/true "
                  "--shutdown-timeout 1")
        core.create_namespaced_pod(namespace, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kvm"},
            "spec": {
                "nodeName": node.name, "restartPolicy": "Never",
                "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                "runAsGroup": 65532},
                "containers": [{
                    "name": "runner", "image": image, "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", script],
                    "env": [{"name": "NEONVM_VM_SPEC", "value": json.dumps(spec)},
                            {"name": "NEONVM_ENABLE_ACCELERATION", "value": "true"}],
                    "resources": {"limits": {kvmplugin.DEFAULT_RESOURCE: "1"}},
                    "securityContext": {"readOnlyRootFilesystem": True,
                                        "allowPrivilegeEscalation": False,
                                        "capabilities": {"drop": ["ALL"]}},
                    "volumeMounts": [{"name": "work", "mountPath": "/vm/run"}],
                }],
                "volumes": [{"name": "work", "emptyDir": {}}],
            },
        })
        _wait_finished(core, namespace, "kvm")
        log = core.read_namespaced_pod_log("kvm", namespace)
        assert "/dev/kvm" in log and log.lstrip().startswith("crw"), log
        assert "AccelerationUnavailable: KVM is not usable, the guest runs under TCG: " \
               "/dev/kvm exists but the CPU advertises neither vmx nor svm" in log, log
        status = core.read_namespaced_pod("kvm", namespace).status
        message = status.container_statuses[0].state.terminated.message or ""
        assert message.startswith("AccelerationUnavailable"), message
        assert "allocate /dev/kvm for 1 container(s)" in (tmp_path / "plugin.log").read_text()
    finally:
        plugin.terminate()
        plugin.wait(30)
        plugin_log.close()
        node.stop()
