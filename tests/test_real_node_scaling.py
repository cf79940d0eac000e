"""Live scaling on the real node: the controller scales a runner pod's guest in place.

Opt-in (``NEONVM_TEST_REAL_NODE=1 pytest tests/test_real_node_scaling.py -s``), like the
other real-node tests beyond the default one. One ``neonvm controller run`` replica, one
VirtualMachine whose runner pod (created by that controller, from the built runner image)
runs on the real kubelet node and boots under QEMU (TCG) a NeonVM-style root disk whose
``/sbin/init`` is the test guest's init (``tests/guest/init.sh``, which runs the runner's
own ``neonvm/runner/guest_scaling.sh``: it onlines and offlines vCPUs on the SysfsScaling
agent port, and prints its size on the console after each change; the runner's initramfs
has loaded ``virtio_mem``, whose driver plugs and unplugs the memory).

``spec.guest.cpus.use`` goes 1 -> 2 -> 1 and ``spec.guest.memorySlots.use`` 1 -> 2 -> 1
(1 GiB slots, a virtio-mem device's ``requested-size`` moved over QMP; the QEMU on the
node is checked to have that device and no DIMM) with ``cpuScalingMode:
SysfsScaling``, as the controller-level scaling tests do; with ``QmpScaling`` (vCPUs
hot-added over QMP) the vCPU is only added (see :data:`STEPS`). Each change is a JSON
merge patch, as NeonVM's autoscaler-agent sends one. After each patch the guest itself
must report the new online CPU count or MemTotal (the runner's ``/status``, fed by the
guest's console lines, read at the pod's IP; the same lines in the pod's log), and
``status.cpus`` / ``status.memorySize`` must match with no ``status.pendingScale``. One
runner pod, the same uid, and one QEMU throughout. The times from the patch to the
guest's report are printed (docs/real-node.md, "Live scaling on the real node"), not
asserted.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from neonvm import kube
from neonvm.api import types
from neonvm.api.millicpu import MilliCPU
from neonvm.dev import realnode
from neonvm.dev.cluster import LocalCluster
from tests.support import replica_group, wait_for
from tests.support.harness import create_vm, delete_vm, get_vm, runner_pods
from tests.support.real_node import _images_skip_reason, _PodEvents, _print_pods_and_events

GIB_KB = (1 << 30) // 1024
VM = "live"


SPEC: dict[str, Any] = {
    "nodeSelector": {realnode.REAL_LABEL: "true"},
    "terminationGracePeriodSeconds": 10,
    "guest": {
        "cpus": {"min": 1, "max": 2, "use": 1},
        "memorySlots": {"min": 1, "max": 2, "use": 1}, "memorySlotSize": "1Gi",
        # No command: the runner's init hands over to the disk's /sbin/init (the test
        # guest's init). quiet: no kernel lines in the middle of the guest's reports.
        "appendKernelCmdline": "quiet neonvm.test=powerdown",
    },
}


Step = tuple[str, dict[str, Any], int, int, str]
"""What changes, the merge patch of ``spec.guest``, then what follows: the guest's online
CPUs, its plugged virtio-mem memory (GiB above boot memory), ``status.memorySize``."""

STEPS: dict[str, list[Step]] = {
    "SysfsScaling": [
        ("cpus.use 1 -> 2", {"cpus": {"use": "2"}}, 2, 0, "1Gi"),
        ("cpus.use 2 -> 1", {"cpus": {"use": "1000m"}}, 1, 0, "1Gi"),
        ("memorySlots.use 1 -> 2", {"memorySlots": {"use": 2}}, 1, 1, "2Gi"),
        ("memorySlots.use 2 -> 1", {"memorySlots": {"use": 1}}, 1, 0, "1Gi"),
    ],
    # QMP vCPU removal crashes QEMU 7.2 under TCG (docs/runner.md, "Live scaling"): a
    # vCPU is only added here; SysfsScaling takes one away.
    "QmpScaling": [
        ("cpus.use 1 -> 2", {"cpus": {"use": "2"}}, 2, 0, "1Gi"),
        ("memorySlots.use 1 -> 2", {"memorySlots": {"use": 2}}, 2, 1, "2Gi"),
        ("memorySlots.use 2 -> 1", {"memorySlots": {"use": 1}}, 2, 0, "1Gi"),
    ],
}


@dataclass(frozen=True)
class RunnerPod:
    name: str
    uid: str
    ip: str
    port: int

    def status(self) -> dict[str, Any] | None:
        """The runner's ``GET /status`` at the pod's IP (None while it does not answer)."""
        try:
            with urllib.request.urlopen(f"http://{self.ip}:{self.port}/status",
                                        timeout=5) as resp:
                doc: dict[str, Any] = json.loads(resp.read())
                return doc
        except (OSError, ValueError):
            return None

    def guest_reports(self, cpus: int, mem_kb: int | None = None) -> dict[str, Any]:
        """Wait until the guest has reported ``cpus`` online (and MemTotal ``mem_kb``)."""
        def seen() -> dict[str, Any] | None:
            status = self.status()
            if status is None or status.get("guestCpusOnline") != cpus:
                return None
            if mem_kb is not None and status.get("guestMemTotalKb") != mem_kb:
                return None
            return status
        found: dict[str, Any] = wait_for(
            seen, timeout=300, interval=0.2,
            what=f"the guest to report {cpus} CPUs online, MemTotal {mem_kb} kB")
        return found


def qemu_devices_on_the_node(vm: str) -> list[str]:
    """The ``-device`` values of the QEMU of VM ``vm`` (``-name guest=<vm>``) running on
    this host (the real node's pods are host processes), empty if none is found."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv[0].endswith("qemu-system-x86_64") and f"guest={vm}" in argv:
            return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-device"]
    return []


def ready_runner_pod(api: client.ApiClient, namespace: str) -> RunnerPod | None:
    """The VM's one runner pod once it is Ready (the guest booted), else None."""
    pods = runner_pods(api, namespace, VM)
    if len(pods) != 1:
        return None
    pod = pods[0]
    if pod.status.phase in ("Succeeded", "Failed"):
        raise AssertionError(client.CoreV1Api(api).read_namespaced_pod_log(
            pod.metadata.name, namespace, container="neonvm-runner")[-5000:])
    ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
    if not ready or not pod.status.pod_ip:
        return None
    port = next(p.container_port for p in pod.spec.containers[0].ports if p.name == "runner")
    return RunnerPod(pod.metadata.name, pod.metadata.uid, pod.status.pod_ip, port)


def merge_patch_guest(api: client.ApiClient, namespace: str, guest: dict[str, Any]) -> None:
    """``spec.guest`` changed by a JSON merge patch, as NeonVM's autoscaler-agent does."""
    kube.request(api, "PATCH",
                 f"/apis/{types.GROUP}/{types.VERSION}/namespaces/{namespace}/"
                 f"{types.PLURAL}/{VM}", {"spec": {"guest": guest}},
                 content_type="application/merge-patch+json")


def wait_status(api: client.ApiClient, namespace: str, cpus: int,
                memory: str) -> dict[str, Any]:
    """Wait until ``status`` says ``cpus`` and ``memory`` with no scale pending."""
    def says() -> dict[str, Any] | None:
        status: dict[str, Any] = (get_vm(api, namespace, VM) or {}).get("status") or {}
        if "pendingScale" in status or status.get("cpus") is None:
            return None
        if MilliCPU.parse(status["cpus"]) != MilliCPU.parse(cpus):
            return None
        return status if status.get("memorySize") == memory else None
    found: dict[str, Any] = wait_for(
        says, timeout=300, interval=0.2,
        what=f"status: {cpus} vCPUs, {memory}, no pending scale")
    return found


def guest_size_lines(log: str) -> list[tuple[str, str]]:
    """(``cpus=N``, ``memtotal-kb=K``) of each size report the guest printed."""
    return [(words[1], words[3]) for line in log.splitlines()
            if line.startswith("neonvm-guest-size:") and len(words := line.split()) >= 4]


@pytest.mark.cluster
@pytest.mark.realnode
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(_images_skip_reason() is not None, reason=_images_skip_reason() or "")
@pytest.mark.parametrize("mode", list(STEPS))
def test_the_controller_scales_a_runner_pod_on_the_real_node_live(
    cluster: LocalCluster, api: client.ApiClient, namespace: str, tmp_path: Path, mode: str
) -> None:
    from neonvm.dev import guestdisk, realguest
    from tests.guest.build import INIT_SCRIPT

    problem = realguest.unavailable_reason()
    if problem:
        pytest.skip(f"no real guest here: {problem}")
    node = realguest.prepare(cluster, print).node
    core = client.CoreV1Api(api)
    events: _PodEvents | None = None
    try:
        _raw, qcow2 = guestdisk.build_rootfs(tmp_path / "disk", init=INIT_SCRIPT)
        archive = guestdisk.disk_image_archive(qcow2, tmp_path / "disk.oci.tar",
                                            guestdisk.SCALING_DISK_IMAGE)
        node.ctr("images", "import", "--platform", "linux/amd64", str(archive), timeout=300)
        spec = copy.deepcopy(SPEC)
        spec["cpuScalingMode"] = mode
        spec["guest"]["rootDisk"] = {"image": guestdisk.SCALING_DISK_IMAGE,
                                     "imagePullPolicy": "Never"}
        with replica_group(cluster, api, namespace, tmp_path / "replicas") as group:
            group.start("c0")
            events = _PodEvents(api, namespace, VM)
            created = time.monotonic()
            create_vm(api, namespace, VM, restart_policy="Always", spec=spec)
            try:
                pod = wait_for(lambda: ready_runner_pod(api, namespace), timeout=600,
                               interval=0.5, what="the runner pod Ready on the real node")
                figures = [f"runner pod Ready (guest booted) {time.monotonic() - created:.1f} s "
                           "after the VM was created"]
                assert core.read_namespaced_pod(pod.name, namespace).spec.node_name == \
                    node.name
                boot = pod.guest_reports(cpus=1)
                boot_kb, qemu_pid = boot["guestMemTotalKb"], boot["qemuPid"]
                assert boot_kb < GIB_KB
                figures.append(f"the guest's MemTotal at boot: {boot_kb} kB")
                wait_status(api, namespace, 1, "1Gi")
                devices = qemu_devices_on_the_node(VM)
                assert any(d.startswith("virtio-mem-pci,id=vm0,") for d in devices), devices
                assert not any(d.startswith("pc-dimm") for d in devices), devices

                for what, patch, cpus, dimms, memory in STEPS[mode]:
                    patched = time.monotonic()
                    merge_patch_guest(api, namespace, patch)
                    seen = pod.guest_reports(cpus, boot_kb + dimms * GIB_KB)
                    seen_after = time.monotonic() - patched
                    status = wait_status(api, namespace, cpus, memory)
                    status_after = time.monotonic() - patched
                    # The same QEMU, the same (and only) runner pod.
                    assert seen["qemuPid"] == qemu_pid
                    assert [p.metadata.uid for p in runner_pods(api, namespace, VM)] == \
                        [pod.uid]
                    request = core.read_namespaced_pod(pod.name, namespace).spec.containers[
                        0].resources.requests.get("cpu")
                    figures.append(f"{what}: the guest reports it {seen_after:.2f} s after "
                                   f"the patch (MemTotal {seen['guestMemTotalKb']} kB, "
                                   f"{seen['guestCpusOnline']} CPUs online), status "
                                   f"{status_after:.2f} s (scaleSeq {status['scaleSeq']}, "
                                   f"memorySize {status['memorySize']}; the pod's CPU "
                                   f"request {request})")

                # The guest's own lines, in the pod's log as `kubectl logs` shows it.
                log = core.read_namespaced_pod_log(pod.name, namespace,
                                                   container="neonvm-runner")
                sizes = guest_size_lines(log)
                reports = [(f"cpus={cpus}", f"memtotal-kb={boot_kb + dimms * GIB_KB}")
                           for _what, _patch, cpus, dimms, _memory in STEPS[mode]]
                assert set(reports) <= set(sizes), log[-4000:]
                assert sizes[-1] == reports[-1], log[-4000:]
                # One runner pod in the VM's whole life: no other name in the pod watch.
                assert {e[1] for e in events.events} == {pod.name}, events.events
                resizes = [e.reason for e in core.list_namespaced_event(
                    namespace, field_selector=f"involvedObject.name={pod.name}").items
                    if e.reason.startswith("Resize")]
                figures.append(f"the kubelet's resize events: {', '.join(resizes) or 'none'}")
                print(f"\nlive scaling on the real node ({mode} vCPUs, virtio-mem, 1Gi slots):\n  "
                      + "\n  ".join(figures))
            finally:
                # Deleted while the controller runs: it powers the guest down, the pod goes.
                with contextlib.suppress(Exception):
                    delete_vm(api, namespace, VM)
                    wait_for(lambda: not runner_pods(api, namespace, VM), timeout=180,
                             interval=0.5, what="the runner pod gone")
    finally:
        if events is not None:
            events.stop()
        _print_pods_and_events(cluster, namespace)
        node.stop()
        # The session's other tests must not get pods bound to the stopped node.
        with contextlib.suppress(client.ApiException):
            core.delete_node(node.name)
