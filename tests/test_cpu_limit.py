"""Fractional CPU: the runner caps QEMU's CPU time at NeonVM's quota for ``cpus.use``.

NeonVM's rule (``neonvm-runner/cmd/cgroup.go``): QEMU runs in ``<the runner's
cgroup>/neonvm-qemu-<pod>`` with a quota of ``use x 4`` per 100 ms period. The unit tests
pin the arithmetic and how the cgroup is found; the real test runs a runner process with
a real guest on this host's cgroup file system (it needs a writable one: root on the
host), scales it live and changes the projected ``vm.neon.tech/resources`` annotation as
the kubelet would after the controller's patch, and reads the quota the kernel holds,
with the same QEMU throughout (opt-in, ``NEONVM_TEST_LONG=1``: about 40 s); by default the
same limiter caps a plain process. docs/neonvm-compat.md, "The autoscaler's view".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

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
from tests.support import wait_for
from tests.support.runner_scaling import TOKEN, put_scale

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
def test_a_cgroup_that_cannot_be_written_is_reported_not_fatal(tmp_path: Path) -> None:
    reports: list[dict[str, Any]] = []

    def nowhere(pod: str) -> QemuCgroup:
        raise OSError(30, "Read-only file system", "/sys/fs/cgroup/cpu")

    limiter = CpuLimiter("p", 250, None, lambda: 123, reports.append, find=nowhere)
    limiter.start()
    wait_for(lambda: reports, timeout=10, what="the limiter's report")
    limiter.stop()
    assert reports == [{"milliCPU": 250, "unavailable": "QEMU's CPU time is not capped: "
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
