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

Fractional CPU (the second test): the autoscaler-agent's merge patch (``cpus.use`` and
``targetRevision``) takes a VM 500m -> 1500m -> 250m; the CFS quota the kernel holds for
the runner container's cgroup (the kubelet's, from the in-place resized CPU limit) follows,
with ``status.cpus``, ``currentRevision`` and the pod's ``vm.neon.tech/resources``
(docs/neonvm-compat.md, "Enforced by the kubelet in this controller's runner pods").
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from neonvm import kube
from neonvm.api import types
from neonvm.api.millicpu import MilliCPU
from neonvm.controller.podspec import ANNOTATION_RESOURCES
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


def ready_runner_pod(api: client.ApiClient, namespace: str, vm: str = VM) -> RunnerPod | None:
    """The VM's one runner pod once it is Ready (the guest booted), else None."""
    pods = runner_pods(api, namespace, vm)
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


# ---- fractional CPU: the kubelet's cgroup quota follows the agent's patch ------------------

CPU_VM = "frac"
"""A VM of its own name: its QEMU is told apart from another test's on the host."""

CPU_SPEC: dict[str, Any] = {
    "nodeSelector": {realnode.REAL_LABEL: "true"},
    "terminationGracePeriodSeconds": 10,
    "cpuScalingMode": "SysfsScaling",
    "guest": {
        "cpus": {"min": "250m", "max": 3, "use": "500m"},
        "memorySlots": {"min": 1, "max": 1, "use": 1}, "memorySlotSize": "1Gi",
        "appendKernelCmdline": "quiet neonvm.test=powerdown",
    },
}

CpuStep = tuple[str, int, int, int]
"""``cpus.use`` as the agent sends it, the revision it stamps, then what follows: the
guest's online vCPUs and the runner container's CFS quota (us per 100 ms period) that
the kubelet writes for the limit NeonVM's rule gives (4 x use within [use, max])."""

CPU_STEPS: list[CpuStep] = [
    ("1500m", 7, 2, 300_000),  # limit min(6, max 3) = 3
    ("250m", 8, 1, 100_000),   # limit 4 x 250m = 1
]
BOOT_QUOTA = 200_000  # 500m: limit 2
PERIOD_US = 100_000


def qemu_host_pid(vm: str) -> int | None:
    """The host pid of the QEMU of VM ``vm`` (``-name guest=<vm>``), None if none runs."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv[0].endswith("qemu-system-x86_64") and f"guest={vm}" in argv:
            return int(proc.name)
    return None


def cpu_cgroup_of(pid: int) -> str:
    """The v1 ``cpu`` cgroup of host process ``pid`` (``/proc/<pid>/cgroup``)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _n, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    raise AssertionError(f"no cpu cgroup for pid {pid}")


def container_cgroup(api: client.ApiClient, namespace: str, pod_name: str,
                     root: str) -> str:
    """The runner container's cgroup as the kubelet (cgroupfs driver, cgroup root
    ``root``) and containerd name it: ``<root>/kubepods/<qos>/pod<uid>/<container id>``."""
    pod = client.CoreV1Api(api).read_namespaced_pod(pod_name, namespace)
    (status,) = [s for s in pod.status.container_statuses or [] if s.name == "neonvm-runner"]
    container = status.container_id.split("://", 1)[1]
    qos = {"Guaranteed": "", "Burstable": "burstable/", "BestEffort": "besteffort/"}[
        pod.status.qos_class]
    return f"{root}/kubepods/{qos}pod{pod.metadata.uid}/{container}"


def cfs_quota(cgroup: str) -> tuple[int, int]:
    """(``cpu.cfs_quota_us``, ``cpu.cfs_period_us``) of a v1 cgroup, as the kernel holds them."""
    base = Path("/sys/fs/cgroup/cpu") / cgroup.lstrip("/")
    return (int((base / "cpu.cfs_quota_us").read_text()),
            int((base / "cpu.cfs_period_us").read_text()))


def wait_quota(cgroup: str, quota: int) -> tuple[int, int]:
    """Wait until the kernel holds ``quota`` per 100 ms for ``cgroup``."""
    def held() -> tuple[int, int] | None:
        found = cfs_quota(cgroup)
        return found if found == (quota, PERIOD_US) else None
    return wait_for(held, timeout=180, interval=0.5,
                    what=f"{cgroup}: cfs quota {quota}/{PERIOD_US}") or (0, 0)


def wait_landed(api: client.ApiClient, namespace: str, use: str, revision: int,
                not_before: datetime) -> dict[str, Any]:
    """Wait until ``status`` says ``cpus: use`` with no scale pending and
    ``currentRevision`` is the agent's ``revision``, stamped no earlier than
    ``not_before`` (NeonVM's ``propagateRevision`` stamps the landing, not the agent's
    ``updatedAt``)."""
    def says() -> dict[str, Any] | None:
        status: dict[str, Any] = (get_vm(api, namespace, CPU_VM) or {}).get("status") or {}
        current = status.get("currentRevision") or {}
        if "pendingScale" in status or status.get("cpus") != use or \
                current.get("revision") != {"value": revision, "flags": 1}:
            return None
        stamped = datetime.fromisoformat(current["updatedAt"].replace("Z", "+00:00"))
        return status if stamped >= not_before else None
    found: dict[str, Any] = wait_for(
        says, timeout=300, interval=0.2,
        what=f"status: cpus {use}, currentRevision {revision} stamped after the patch")
    return found


def resources_use(api: client.ApiClient, namespace: str, pod_name: str) -> str | None:
    """``cpus.use`` of the pod's ``vm.neon.tech/resources`` annotation."""
    pod = client.CoreV1Api(api).read_namespaced_pod(pod_name, namespace)
    raw = (pod.metadata.annotations or {}).get(ANNOTATION_RESOURCES)
    return None if raw is None else str(json.loads(raw)["cpus"]["use"])


@pytest.mark.cluster
@pytest.mark.realnode
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(_images_skip_reason() is not None, reason=_images_skip_reason() or "")
def test_the_agents_fractional_scale_moves_the_kubelets_cgroup_quota_on_the_real_node(
    cluster: LocalCluster, api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    """The autoscaler-agent's JSON merge patch (``cpus.use`` and ``targetRevision``) on a
    VM running on the real kubelet node, 500m -> 1500m -> 250m (``max`` 3): the guest's
    vCPUs, the pod's ``vm.neon.tech/resources``, ``status.cpus`` (fractional) and
    ``currentRevision`` (stamped on landing) follow, and so does the CFS quota the kernel
    holds for the runner container's cgroup (the kubelet's, from the in-place resized
    limit: docs/neonvm-compat.md, "Enforced by the kubelet"), the one QEMU in it, with
    the same pod throughout."""
    from neonvm.dev import guestdisk, realguest
    from tests.guest.build import INIT_SCRIPT

    problem = realguest.unavailable_reason()
    if problem:
        pytest.skip(f"no real guest here: {problem}")
    node = realguest.prepare(cluster, print).node
    core = client.CoreV1Api(api)
    try:
        _raw, qcow2 = guestdisk.build_rootfs(tmp_path / "disk", init=INIT_SCRIPT)
        archive = guestdisk.disk_image_archive(qcow2, tmp_path / "disk.oci.tar",
                                            guestdisk.SCALING_DISK_IMAGE)
        node.ctr("images", "import", "--platform", "linux/amd64", str(archive), timeout=300)
        spec = copy.deepcopy(CPU_SPEC)
        spec["guest"]["rootDisk"] = {"image": guestdisk.SCALING_DISK_IMAGE,
                                     "imagePullPolicy": "Never"}
        with replica_group(cluster, api, namespace, tmp_path / "replicas") as group:
            group.start("c0")
            create_vm(api, namespace, CPU_VM, restart_policy="Always", spec=spec)
            try:
                pod = wait_for(lambda: ready_runner_pod(api, namespace, CPU_VM),
                               timeout=600, interval=0.5,
                               what="the runner pod Ready on the real node")
                qemu_pid = pod.guest_reports(cpus=1)["qemuPid"]
                wait_for(lambda: (get_vm(api, namespace, CPU_VM) or {}).get(
                    "status", {}).get("cpus") == "500m", timeout=300, interval=0.2,
                    what="status.cpus 500m at boot")
                cgroup = container_cgroup(api, namespace, pod.name, node.cgroup_root)
                host_pid = wait_for(lambda: qemu_host_pid(CPU_VM), timeout=60,
                                    what="the guest's QEMU on the host")
                # QEMU runs in the runner container's cgroup (or a child of it, had the
                # runner been able to write it).
                assert cpu_cgroup_of(host_pid).startswith(cgroup), cpu_cgroup_of(host_pid)
                figures = [f"container cgroup {cgroup}",
                           f"boot (500m): quota/period {wait_quota(cgroup, BOOT_QUOTA)}, "
                           f"runner /status cpuLimit {(pod.status() or {}).get('cpuLimit')}"]

                for use, revision, vcpus, quota in CPU_STEPS:
                    not_before = datetime.now(UTC).replace(microsecond=0)
                    kube.request(api, "PATCH",
                                 f"/apis/{types.GROUP}/{types.VERSION}/namespaces/"
                                 f"{namespace}/{types.PLURAL}/{CPU_VM}",
                                 {"spec": {"guest": {"cpus": {"use": use}},
                                           "targetRevision": {
                                               "revision": {"value": revision, "flags": 1},
                                               "updatedAt": "2020-01-02T15:04:05Z"}}},
                                 content_type="application/merge-patch+json")
                    seen = pod.guest_reports(vcpus)
                    status = wait_landed(api, namespace, use, revision, not_before)
                    wait_for(lambda u=use: resources_use(api, namespace, pod.name) == u,
                             timeout=120, interval=0.2,
                             what=f"the pod's {ANNOTATION_RESOURCES} at cpus.use {use}")
                    held = wait_quota(cgroup, quota)
                    # The same pod, the same QEMU, still in that cgroup.
                    assert [p.metadata.uid for p in runner_pods(api, namespace, CPU_VM)] \
                        == [pod.uid]
                    assert container_cgroup(api, namespace, pod.name,
                                            node.cgroup_root) == cgroup
                    assert seen["qemuPid"] == qemu_pid
                    assert qemu_host_pid(CPU_VM) == host_pid
                    assert cpu_cgroup_of(host_pid).startswith(cgroup)
                    resources = core.read_namespaced_pod(pod.name, namespace).spec.containers[
                        0].resources
                    figures.append(
                        f"cpus.use {use}: guest {seen['guestCpusOnline']} vCPUs online, "
                        f"status.cpus {status['cpus']}, currentRevision "
                        f"{status['currentRevision']}, pod cpu request "
                        f"{resources.requests.get('cpu')} limit {resources.limits.get('cpu')}, "
                        f"quota/period {held}, runner /status cpuLimit "
                        f"{(pod.status() or {}).get('cpuLimit')}")
                resizes = [e.reason for e in core.list_namespaced_event(
                    namespace, field_selector=f"involvedObject.name={pod.name}").items
                    if e.reason.startswith("Resize")]
                figures.append(f"the kubelet's resize events: {', '.join(resizes) or 'none'}")
                print("\nfractional CPU on the real node (the kubelet's cgroup, v1):\n  "
                      + "\n  ".join(figures))
            finally:
                with contextlib.suppress(Exception):
                    delete_vm(api, namespace, CPU_VM)
                    wait_for(lambda: not runner_pods(api, namespace, CPU_VM), timeout=180,
                             interval=0.5, what="the runner pod gone")
    finally:
        _print_pods_and_events(cluster, namespace)
        node.stop()
        with contextlib.suppress(client.ApiException):
            core.delete_node(node.name)
