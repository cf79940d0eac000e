"""Fractional CPU: the runner caps QEMU's CPU time at NeonVM's quota for ``cpus.use``.

NeonVM's rule: QEMU runs in ``<the runner's cgroup>/neonvm-qemu-<pod>`` with a quota of
``use x 4`` per 100 ms period. The unit tests pin the arithmetic and how the cgroup is
found; by default the same limiter caps a plain process. Opt-in (``NEONVM_TEST_LONG=1``,
about 30 s each): a runner with a real guest on this host's cgroup file system (it needs
a writable one) scaled live, its projected ``vm.neon.tech/resources`` changed as the
kubelet would, and the kernel's quota read with the same QEMU throughout; and, over the
real API server, the autoscaler-agent's merge patch taking a VM from 500m to 1500m.
docs/neonvm-compat.md, "The autoscaler's view", is the specification.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from neonvm import kube
from neonvm.controller.podspec import ANNOTATION_RESOURCES
from neonvm.runner.cpulimit import (
    PERIOD_US,
    CpuLimiter,
    OwnCgroup,
    QemuCgroup,
    cgroup_dir,
    find_qemu_cgroup,
    own_cgroup,
    quota_us,
    wanted_millicpu,
)
from tests.support import shipped_reconciler, wait_for
from tests.support.harness import create_vm, get_vm, runner_pods
from tests.support.runner import free_port
from tests.support.runner_scaling import TOKEN, put_scale
from tests.support.scaling_controller import (
    NOWHERE,
    OLD,
    settle,
    start_runner_for,
    status_of,
    vm_path,
)

HYBRID = """9:name=systemd:/kubepods/pod1/c1
4:memory:/kubepods/pod1/c1
2:cpu,cpuacct:/kubepods/pod1/c1
0::/
"""


@pytest.mark.unit
@pytest.mark.parametrize(("millicpu", "quota"), [
    (250, 100_000), (500, 200_000), (1000, 400_000), (1500, 600_000), (100, 40_000)])
def test_the_quota_is_four_times_use_per_100ms(millicpu: int, quota: int) -> None:
    assert PERIOD_US == 100_000
    assert quota_us(millicpu) == quota


@pytest.mark.unit
def test_the_cgroup_is_the_v1_cpu_entry_else_the_v2_one() -> None:
    assert own_cgroup(HYBRID) == OwnCgroup(1, "/kubepods/pod1/c1")
    assert own_cgroup("0::/system.slice/x\n") == OwnCgroup(2, "/system.slice/x")
    with pytest.raises(ValueError, match="more than one"):
        own_cgroup("2:cpu:/a\n3:cpu,cpuacct:/b\n")
    with pytest.raises(ValueError, match="no cgroup"):
        own_cgroup("4:memory:/a\n")


@pytest.mark.unit
def test_the_cgroup_directory_is_found_through_the_mount_that_holds_it() -> None:
    # a container's view: its own cgroup bind-mounted at /sys/fs/cgroup/cpu
    mountinfo = (
        "30 25 0:26 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "31 25 0:27 /kubepods/pod1/c1 /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup "
        "rw,cpu,cpuacct\n"
        "32 25 0:28 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
    assert cgroup_dir(OwnCgroup(1, "/kubepods/pod1/c1"), mountinfo) == Path(
        "/sys/fs/cgroup/cpu,cpuacct")
    assert cgroup_dir(OwnCgroup(2, "/a/b"), mountinfo) == Path("/sys/fs/cgroup/unified/a/b")
    with pytest.raises(ValueError, match="no mount"):
        cgroup_dir(OwnCgroup(1, "/elsewhere"), mountinfo)


@pytest.mark.unit
def test_use_is_read_from_the_projected_annotation_else_the_spec(tmp_path: Path) -> None:
    resources = tmp_path / "resources.json"
    assert wanted_millicpu(resources, 500) == 500  # not projected (yet)
    resources.write_text(json.dumps({"cpus": {"min": "250m", "max": 2, "use": "1500m"}}))
    assert wanted_millicpu(resources, 500) == 1500
    resources.write_text(json.dumps({"cpus": {"use": 0.25}}))
    assert wanted_millicpu(resources, 500) == 250
    resources.write_text("")  # the annotation removed: the kubelet writes an empty file
    assert wanted_millicpu(resources, 500) == 500


@pytest.mark.unit
@pytest.mark.parametrize("text", [
    '{"cpus": {"use": ' + "[" * 100_000 + "]" * 100_000 + "}}",  # deeper than recursion
    '{"cpus": {"use": 1e308}}',  # a float of more vCPUs than any int of them
    '{"cpus": {"use": ' + "9" * 5000 + "}}",  # an int too long for json.dumps
    '{"cpus": {"use": "3"}}',  # above the spec's cpus.max (2)
], ids=["nested", "overflow", "5000-digits", "over-max"])
def test_a_hostile_annotation_gives_the_boot_use_and_a_status_that_encodes(
        tmp_path: Path, text: str) -> None:
    """Whoever may patch the pod may write its annotation: it must neither end the
    limiter's thread nor put a value in /status that json.dumps refuses."""
    resources = tmp_path / "resources.json"
    resources.write_text(text)
    assert wanted_millicpu(resources, 500, 2000) == 500
    reports: list[dict[str, Any]] = []

    def directory(pod: str) -> QemuCgroup:  # a plain directory stands in for the cgroup
        return QemuCgroup(tmp_path, 1, pod)

    limiter = CpuLimiter("p", 500, resources, lambda: 123, reports.append, find=directory,
                         max_millicpu=2000)
    limiter.start()
    wait_for(lambda: reports, timeout=10, what="the limiter's report")
    limiter.stop()
    assert reports[0]["milliCPU"] == 500
    assert reports[0]["quotaUs"] == 200_000
    json.dumps(reports)


@pytest.mark.unit
def test_a_cgroup_that_cannot_be_written_is_reported_not_fatal(tmp_path: Path) -> None:
    reports: list[dict[str, Any]] = []

    def nowhere(pod: str) -> QemuCgroup:
        raise OSError(30, "Read-only file system", "/sys/fs/cgroup/cpu")

    limiter = CpuLimiter("p", 250, None, lambda: 123, reports.append, find=nowhere)
    limiter.start()
    wait_for(lambda: reports, timeout=10, what="the limiter's report")
    limiter.stop()
    # No size: the limiter stops here, and a size would go stale at the next scale.
    assert reports == [{"unavailable": "QEMU's CPU time is not capped: "
                                       "[Errno 30] Read-only file system: "
                                       "'/sys/fs/cgroup/cpu'"}]


def writable_cgroup() -> str | None:
    """Why the real test cannot run here, or None."""
    try:
        parent = find_qemu_cgroup("probe").path.parent
    except (OSError, ValueError) as exc:
        return f"no cgroup of this process found: {exc}"
    if not os.access(parent, os.W_OK):
        return f"{parent} is not writable (the test needs root on the host)"
    return None


def kernel_quota(pod: str) -> tuple[int, int]:
    return find_qemu_cgroup(pod).quota()


def test_a_process_is_capped_at_use_and_the_cap_follows_the_annotation(
        tmp_path: Path) -> None:
    why = writable_cgroup()
    if why is not None:
        pytest.skip(why)
    pod = f"cpulimit-sleep-{os.getpid()}"
    resources = tmp_path / "resources.json"
    reports: list[dict[str, Any]] = []
    sleeper = subprocess.Popen(["sleep", "300"])
    limiter = CpuLimiter(pod, 250, resources, lambda: sleeper.pid, reports.append)
    try:
        limiter.start()
        wait_for(lambda: reports, timeout=10, what="the first quota")
        assert kernel_quota(pod) == (100_000, PERIOD_US)
        assert Path(f"/proc/{sleeper.pid}/cgroup").read_text().count(f"/neonvm-qemu-{pod}") >= 1
        resources.write_text(json.dumps({"cpus": {"use": "1500m"}}))
        wait_for(lambda: len(reports) == 2, timeout=10, what="the quota after the change")
        assert kernel_quota(pod) == (600_000, PERIOD_US)
        assert reports[-1]["quotaUs"] == 600_000
    finally:
        sleeper.kill()
        sleeper.wait()
        limiter.stop()
    assert not find_qemu_cgroup(pod).path.exists()


@pytest.mark.long
def test_qemu_is_capped_at_use_and_follows_a_live_scale_with_the_same_qemu(
        start_runner: Any, tmp_path: Path) -> None:
    why = writable_cgroup()
    if why is not None:
        pytest.skip(why)
    pod = f"cpulimit-{os.getpid()}"
    token_file = tmp_path / "scaling-token"
    token_file.write_text(TOKEN + "\n")
    resources = tmp_path / "resources.json"  # what the kubelet projects from the annotation
    runner = start_runner(
        extra_args=["--scaling-token-file", str(token_file)],
        extra_env={"NEONVM_POD_NAME": pod, "NEONVM_RESOURCES_FILE": str(resources)},
        spec_overrides={"guest": {"cpus": {"min": "250m", "max": 2, "use": "500m"}}})
    status = runner.wait_ready()
    pid = status["qemuPid"]

    def limit(millicpu: int) -> dict[str, Any] | None:
        s = runner.status()
        cpu_limit = (s or {}).get("cpuLimit") or {}
        return s if cpu_limit.get("milliCPU") == millicpu else None

    # At boot: the spec's 500m, so 2 CPUs' worth per period; QEMU is in the cgroup.
    booted = wait_for(lambda: limit(500), timeout=30, what="the boot quota") or {}
    assert booted["cpuLimit"]["quotaUs"] == 200_000, booted
    assert kernel_quota(pod) == (200_000, PERIOD_US)
    members = (find_qemu_cgroup(pod).path / "cgroup.procs").read_text().split()
    assert str(pid) in members

    # A live scale to 2 vCPUs, then the controller's annotation says use 1500m.
    code, answer = put_scale(runner, {"cpus": 2, "fence": {"epoch": 1, "token": 1}})
    assert code == 200 and answer["qemu"]["vcpus"] == 2, answer
    resources.write_text(json.dumps({"cpus": {"min": "250m", "max": 2, "use": "1500m"}}))
    wait_for(lambda: limit(1500), timeout=30, what="the quota after the scale")
    assert kernel_quota(pod) == (600_000, PERIOD_US)

    # A change within the same whole vCPUs needs no scale: the quota follows all the same.
    resources.write_text(json.dumps({"cpus": {"min": "250m", "max": 2, "use": "1750m"}}))
    final = wait_for(lambda: limit(1750), timeout=30, what="the quota within 2 vCPUs")
    assert kernel_quota(pod) == (700_000, PERIOD_US)
    assert final is not None and final["qemuPid"] == pid and runner.qemu_pids == {pid}

    runner.proc.send_signal(signal.SIGTERM)
    assert runner.wait_exit(timeout=120) == 0, runner.log()[-2000:]
    assert not find_qemu_cgroup(pod).path.exists(), "the runner removes QEMU's cgroup"


@pytest.mark.long
def test_the_agents_merge_patch_moves_status_the_annotation_and_qemus_quota_same_pod(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        test_guest: Any, tmp_path: Path) -> None:
    """The autoscaler-agent's JSON merge patch (``cpus.use`` and ``targetRevision``) on a
    VM whose runner runs a real guest: ``status.cpus`` (fractional), ``currentRevision``
    with a fresh ``updatedAt``, the pod's ``vm.neon.tech/resources`` and QEMU's quota all
    follow, with the same pod and QEMU. The kubelet's part, projecting the annotation into
    the runner's file, is done here by hand."""
    why = writable_cgroup()
    if why is not None:
        pytest.skip(why)
    port = free_port()
    root = tmp_path / "root.raw"
    with root.open("wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(root)], check=True)
    name = f"agent{os.getpid()}"
    create_vm(api, namespace, name, spec={
        "nodeSelector": NOWHERE, "runnerPort": port, "terminationGracePeriodSeconds": 10,
        "cpuScalingMode": "SysfsScaling",
        "guest": {"cpus": {"min": "250m", "max": 3, "use": "500m"},
                  "memorySlots": {"min": 1, "max": 1, "use": 1}, "memorySlotSize": "256Mi",
                  "rootDisk": {"image": str(root)}, "kernelImage": str(test_guest.kernel),
                  "initrdImage": str(test_guest.initrd),
                  "appendKernelCmdline": "quiet neonvm.test=powerdown"}})
    key = f"{namespace}/{name}"
    reconciler = shipped_reconciler(controller_api)
    settle(reconciler, key, OLD)
    (pod,) = runner_pods(api, namespace, name)
    raw = get_vm(api, namespace, name) or {}
    secret = client.CoreV1Api(api).read_namespaced_secret(
        raw["status"]["scalingTokenSecret"], namespace)
    token = base64.b64decode(secret.data["token"]).decode()
    resources = tmp_path / "resources.json"  # where the kubelet would project the annotation
    for e in pod.spec.containers[0].env:
        if e.name == "NEONVM_RESOURCES_FILE":
            e.value = str(resources)
    runner = start_runner_for(pod, token, port, tmp_path)
    try:
        qemu_pid = runner.wait_ready()["qemuPid"]
        client.CoreV1Api(api).patch_namespaced_pod_status(pod.metadata.name, namespace, {
            "status": {"phase": "Running", "podIP": "127.0.0.1",
                       "podIPs": [{"ip": "127.0.0.1"}]}})
        settle(reconciler, key, OLD)
        assert status_of(api, namespace, name)["cpus"] == "500m"
        wait_for(lambda: ((runner.status() or {}).get("cpuLimit") or {}).get("quotaUs")
                 == 200_000, timeout=30, what="the boot quota (500m)")

        # The agent's patch, as pkg/agent sends it (a JSON merge patch of the spec).
        kube.request(api, "PATCH", f"{vm_path(namespace)}/{name}", {"spec": {
            "guest": {"cpus": {"use": "1500m"}},
            "targetRevision": {"revision": {"value": 7, "flags": 1},
                               "updatedAt": "2020-01-02T15:04:05Z"}}},
            content_type="application/merge-patch+json")
        settle(reconciler, key, OLD)
        status = status_of(api, namespace, name)
        assert (status["phase"], status["cpus"]) == ("Running", "1500m"), status
        current = status["currentRevision"]
        assert current["revision"] == {"value": 7, "flags": 1}
        assert current["updatedAt"] != "2020-01-02T15:04:05Z", current  # stamped on landing
        (same,) = runner_pods(api, namespace, name)
        assert same.metadata.uid == pod.metadata.uid
        annotation = same.metadata.annotations[ANNOTATION_RESOURCES]
        assert json.loads(annotation)["cpus"]["use"] == "1500m"

        resources.write_text(annotation)  # the kubelet's projection
        wait_for(lambda: ((runner.status() or {}).get("cpuLimit") or {}).get("quotaUs")
                 == 600_000, timeout=30, what="the quota after the scale (1500m)")
        assert kernel_quota(pod.metadata.name) == (600_000, PERIOD_US)
        assert runner.qemu_pids == {qemu_pid}
    finally:
        runner.cleanup()
