"""What the host offers QEMU: which accelerator, which binaries.

KVM is used when ``/dev/kvm`` opens read-write, answers ``KVM_GET_API_VERSION`` with 12,
*and* the CPU advertises hardware virtualisation (``vmx`` or ``svm`` in /proc/cpuinfo).
The last check matters: some sandboxes expose a paravirtual ``/dev/kvm`` (PVM) on a CPU
without vmx/svm, on which ``-cpu host`` aborts and a stock kernel hangs. Anything less
than all three means TCG (software emulation: correct, about ten times slower).

Not guaranteed: that KVM chosen here accepts every CPU model; ``--accel tcg`` forces
emulation when it does not.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from neonvm.runner.errors import HostError

Accel = Literal["kvm", "tcg"]
AccelChoice = Literal["auto", "kvm", "tcg"]

KVM_GET_API_VERSION = 0xAE00
KVM_API_VERSION = 12
_SBIN_DIRS = ("/usr/local/sbin", "/usr/sbin", "/sbin")


@dataclass(frozen=True)
class KvmProbe:
    """Whether KVM can run a stock guest here, and why not if it cannot."""

    usable: bool
    reason: str


def probe_kvm(device: Path = Path("/dev/kvm"),
              cpuinfo: Path = Path("/proc/cpuinfo")) -> KvmProbe:
    """Check the three conditions in the module docstring."""
    try:
        fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return KvmProbe(False, f"{device}: {exc.strerror or exc}")
    try:
        version = fcntl.ioctl(fd, KVM_GET_API_VERSION)
    except OSError as exc:
        return KvmProbe(False, f"{device}: KVM_GET_API_VERSION failed: {exc.strerror or exc}")
    finally:
        os.close(fd)
    if version != KVM_API_VERSION:
        return KvmProbe(False, f"{device}: KVM API version {version}, expected 12")
    try:
        flags = _cpu_flags(cpuinfo.read_text())
    except OSError as exc:
        return KvmProbe(False, f"{cpuinfo}: {exc.strerror or exc}")
    if not flags & {"vmx", "svm"}:
        return KvmProbe(False, f"{device} exists but the CPU advertises neither vmx nor svm "
                               "(paravirtual KVM cannot boot a stock guest)")
    return KvmProbe(True, "/dev/kvm usable and the CPU has hardware virtualisation")


def _cpu_flags(cpuinfo_text: str) -> set[str]:
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def choose_accel(requested: AccelChoice, probe: KvmProbe) -> Accel:
    """The accelerator for ``requested``; ``kvm`` on a host without it is an error."""
    if requested == "tcg":
        return "tcg"
    if probe.usable:
        return "kvm"
    if requested == "kvm":
        raise HostError(f"--accel kvm, but KVM is not usable: {probe.reason}")
    return "tcg"


ACCELERATION_UNAVAILABLE = "AccelerationUnavailable"
"""The reason word a runner logs (and puts in /status and its termination message) when a
VM asked for acceleration and runs under TCG."""


def acceleration_unavailable(requested: AccelChoice, enable_acceleration: bool,
                             probe: KvmProbe) -> str | None:
    """Why an accelerated VM falls back to TCG, or None (KVM used, or not asked for).

    ``enable_acceleration`` is the spec's ``enableAcceleration`` (NeonVM's default is
    true). ``--accel tcg`` is a deliberate choice and reports nothing."""
    if not enable_acceleration or requested == "tcg" or probe.usable:
        return None
    return f"{ACCELERATION_UNAVAILABLE}: KVM is not usable, the guest runs under TCG: " \
           f"{probe.reason}"


def find_binary(name_or_path: str, what: str) -> str:
    """Absolute path of an executable (searching PATH and the sbin dirs); HostError if none."""
    if os.sep in name_or_path:
        if os.path.isfile(name_or_path) and os.access(name_or_path, os.X_OK):
            return os.path.abspath(name_or_path)
        raise HostError(f"{what} not found: {name_or_path}")
    search = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN_DIRS])
    found = shutil.which(name_or_path, path=search)
    if found is None:
        raise HostError(f"{what} not found: {name_or_path!r} is not on PATH")
    return found


def optional_binary(name: str) -> str | None:
    """Like :func:`find_binary`, but None when absent (checked only if a disk needs it)."""
    try:
        return find_binary(name, name)
    except HostError:
        return None
