"""Fractional CPU: QEMU's CPU time capped by a cgroup of its own, NeonVM's rule.

The guest gets whole vCPUs (``ceil(cpus.use)``); the fraction is a CPU time quota. As NeonVM's
runner does, QEMU runs in the cgroup
``<the runner's cgroup>/neonvm-qemu-<pod name>`` whose quota is ``cpus.use`` times
:data:`OVERCOMMIT_FACTOR` (4) over a period of :data:`PERIOD_US` (100 ms): a VM at 250m
may use one whole CPU, not more. The cgroup is found as NeonVM finds it: the entry of
``/proc/self/cgroup`` with the v1 ``cpu`` controller first, else the v2 (unified) entry;
v1 is written in ``cpu.cfs_period_us`` and ``cpu.cfs_quota_us``, v2 in ``cpu.max``.

When: once QEMU runs (its pid is moved into the cgroup), and again whenever the wanted
``cpus.use`` changes: the runner reads it from the pod's ``vm.neon.tech/resources``
annotation, projected into a file by the kubelet (a downward-API volume, refreshed when
the controller rewrites the annotation after a live scale), else from the spec it booted
with. NeonVM's current runner sets the quota at start only; before its sysfs scaling
mode (#1111) it set it at every CPU change too, which is what this does.

Where the cgroup cannot be written (a runner pod as this controller builds it is not
privileged and mounts no host cgroup file system, so its ``/sys/fs/cgroup`` is read-only),
nothing is capped and ``/status`` says why under ``cpuLimit``; the guest runs with the
container's own limit. docs/neonvm-compat.md, "The autoscaler's view".
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from neonvm.api.millicpu import MilliCPU, MilliCPUError

PERIOD_US = 100_000
"""NeonVM's ``cgroupPeriod``: the quota's period, in microseconds."""
OVERCOMMIT_FACTOR = 4
"""NeonVM's ``cpuLimitOvercommitFactor``: the quota is this many times ``cpus.use``."""
POLL_SECONDS = 1.0


def quota_us(millicpu: int) -> int:
    """The CPU time QEMU may use per :data:`PERIOD_US` at ``millicpu`` (NeonVM's
    ``setCgroupLimit``: ``use * 4 / 1000 * period``)."""
    return millicpu * OVERCOMMIT_FACTOR * PERIOD_US // 1000


@dataclass(frozen=True)
class OwnCgroup:
    """The runner's cgroup: its hierarchy (1 or 2) and path within it."""

    version: int
    path: str


def own_cgroup(proc_self_cgroup: str) -> OwnCgroup:
    """NeonVM's ``getSelfCgroupPath``: the v1 entry carrying the ``cpu`` controller, else
    the v2 entry (``0::<path>``). Raises ValueError when neither is there exactly once."""
    v1: list[str] = []
    v2: list[str] = []
    for line in proc_self_cgroup.splitlines():
        if not line:
            continue
        fields = line.split(":", 2)
        if len(fields) != 3:
            raise ValueError(f"/proc/self/cgroup: not three fields: {line!r}")
        hierarchy, controllers, path = fields
        if hierarchy == "0":
            v2.append(path)
        elif "cpu" in controllers.split(","):
            v1.append(path)
    if len(v1) == 1:
        return OwnCgroup(1, v1[0])
    if v1:
        raise ValueError("more than one cgroup v1 entry with the cpu controller")
    if len(v2) == 1:
        return OwnCgroup(2, v2[0])
    raise ValueError("no cgroup v1 entry with the cpu controller and no single v2 entry")


def cgroup_dir(own: OwnCgroup, mountinfo: str) -> Path:
    """The directory of ``own`` in this mount namespace, from ``/proc/self/mountinfo``:
    the mount of that hierarchy (v1: a ``cgroup`` mount with the ``cpu`` option; v2:
    ``cgroup2``) whose root contains the path. Raises ValueError when none does."""
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, mount_point, fstype, options = fields[3], fields[4], tail[0], tail[2]
        if own.version == 1 and (fstype != "cgroup" or "cpu" not in options.split(",")):
            continue
        if own.version == 2 and fstype != "cgroup2":
            continue
        if own.path == root or own.path.startswith(root.rstrip("/") + "/"):
            rest = own.path[len(root.rstrip("/")):].lstrip("/")
            return Path(mount_point) / rest
    raise ValueError(f"no mount of the cgroup v{own.version} hierarchy holds {own.path}")


CEILING_MILLICPU = 1_000_000
"""The largest ``cpus.use`` taken from the annotation when the spec's ``cpus.max`` is not
given (1,000 vCPUs)."""


def wanted_millicpu(resources_file: Path | None, boot: int,
                    ceiling: int = CEILING_MILLICPU) -> int:
    """``cpus.use`` from the projected ``vm.neon.tech/resources`` annotation
    (``{"cpus": {"use": ...}}``, NeonVM's shape), else ``boot`` (the spec's).

    Anyone who may patch the pod may write that annotation: whatever it holds (nesting
    deeper than the recursion limit, ``1e308``, a 5,000-digit number) gives ``boot``
    unless it is a ``use`` in ``1..ceiling`` (the spec's ``cpus.max``), so the limiter
    never dies of it and ``/status`` stays encodable (docs/security.md)."""
    if resources_file is None:
        return boot
    try:
        use = json.loads(resources_file.read_text())["cpus"]["use"]
        value = int(MilliCPU.parse(use))
    except (OSError, ValueError, KeyError, TypeError, MilliCPUError,
            RecursionError, OverflowError):  # deep nesting; 1e308 vCPUs
        return boot
    return value if 0 < value <= ceiling else boot


class QemuCgroup:
    """The cgroup ``neonvm-qemu-<pod>`` under the runner's own: created, written, emptied."""

    def __init__(self, parent: Path, version: int, pod_name: str) -> None:
        self.version = version
        self.path = parent / f"neonvm-qemu-{pod_name}"

    def set(self, millicpu: int) -> None:
        quota = quota_us(millicpu)
        self.path.mkdir(exist_ok=True)
        if self.version == 1:
            (self.path / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
            (self.path / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        else:
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}\n")

    def add(self, pid: int) -> None:
        """Move the process (every thread of it) into the cgroup."""
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def quota(self) -> tuple[int, int]:
        """(quota, period) in microseconds as the kernel holds them."""
        if self.version == 1:
            return (int((self.path / "cpu.cfs_quota_us").read_text()),
                    int((self.path / "cpu.cfs_period_us").read_text()))
        quota, period = (self.path / "cpu.max").read_text().split()
        return (-1 if quota == "max" else int(quota), int(period))

    def remove(self) -> None:
        with contextlib.suppress(OSError):  # still populated (QEMU not reaped) or gone
            self.path.rmdir()


def find_qemu_cgroup(pod_name: str, proc: Path = Path("/proc/self")) -> QemuCgroup:
    """The runner's QEMU cgroup per NeonVM's rule (raises ValueError or OSError)."""
    own = own_cgroup((proc / "cgroup").read_text())
    return QemuCgroup(cgroup_dir(own, (proc / "mountinfo").read_text()), own.version,
                      pod_name)


ENV_POD_NAME = "NEONVM_POD_NAME"
ENV_RESOURCES_FILE = "NEONVM_RESOURCES_FILE"
"""The projected ``vm.neon.tech/resources`` annotation (set in the runner pod's env)."""
ENV_CPU_LIMIT = "NEONVM_CPU_LIMIT"
"""``off``: no cgroup of QEMU's own (NeonVM's ``-skip-cgroup-management``)."""


def limiter_for(env: Mapping[str, str], boot_millicpu: int,
                qemu_pid: Callable[[], int | None],
                report: Callable[[dict[str, Any]], None],
                max_millicpu: int = CEILING_MILLICPU) -> CpuLimiter | None:
    """The limiter of a runner started in a pod (its env names the pod), unless
    ``NEONVM_CPU_LIMIT=off``; None otherwise. ``max_millicpu``: the spec's ``cpus.max``."""
    pod = env.get(ENV_POD_NAME)
    if not pod or env.get(ENV_CPU_LIMIT, "").lower() == "off":
        return None
    resources = env.get(ENV_RESOURCES_FILE)
    return CpuLimiter(pod, boot_millicpu, Path(resources) if resources else None,
                      qemu_pid, report, max_millicpu=max_millicpu)


class CpuLimiter:
    """Keeps QEMU's cgroup at NeonVM's quota for the wanted ``cpus.use``.

    A thread that, every :data:`POLL_SECONDS`: once ``qemu_pid()`` names a process, sets
    the quota and moves it in; then re-applies the quota when the wanted ``cpus.use``
    changes. ``report`` receives what ``/status`` shows under ``cpuLimit``. A failure to
    write (no cgroup, read-only, not allowed) is reported once, without a size, and the
    thread ends."""

    def __init__(self, pod_name: str, boot_millicpu: int, resources_file: Path | None,
                 qemu_pid: Callable[[], int | None], report: Callable[[dict[str, Any]], None],
                 find: Callable[[str], QemuCgroup] = find_qemu_cgroup,
                 max_millicpu: int = CEILING_MILLICPU) -> None:
        self._pod_name = pod_name
        self._boot = boot_millicpu
        self._ceiling = max(boot_millicpu, max_millicpu)
        self._resources_file = resources_file
        self._qemu_pid = qemu_pid
        self._report = report
        self._find = find
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-limit", daemon=True)
        self.cgroup: QemuCgroup | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.cgroup is not None:
            self.cgroup.remove()

    def _run(self) -> None:
        pid: int | None = None
        applied: int | None = None
        while not self._stop.is_set():
            pid = pid or self._qemu_pid()
            want = wanted_millicpu(self._resources_file, self._boot, self._ceiling)
            if pid is not None and want != applied:
                if not self._apply(pid, want):
                    return
                applied = want
            self._stop.wait(POLL_SECONDS)

    def _apply(self, pid: int, want: int) -> bool:
        try:
            if self.cgroup is None:
                self.cgroup = self._find(self._pod_name)
                self.cgroup.set(want)
                self.cgroup.add(pid)
            else:
                self.cgroup.set(want)
            quota, period = self.cgroup.quota()
        except (OSError, ValueError) as exc:
            why = f"QEMU's CPU time is not capped: {exc}"
            logger.warning("{}", why)
            # No milliCPU here: the thread ends, so a figure would go stale at the next
            # scale while the kubelet's limit (docs/neonvm-compat.md) keeps moving.
            self._report({"unavailable": why})
            return False
        logger.info("cpu limit: {}m x {} -> quota {} us per {} us ({})", want,
                    OVERCOMMIT_FACTOR, quota, period, self.cgroup.path)
        self._report({"milliCPU": want, "cgroup": str(self.cgroup.path),
                      "quotaUs": quota, "periodUs": period})
        return True
