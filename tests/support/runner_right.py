"""The VM, namespace and token a runner's right tests use, the tiny guest's spec they
boot, and the QEMU processes a runner of theirs started."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from tests.guest.build import GuestImage

UID = "5d0c1f7e-2b1a-4c3d-8e9f-0a1b2c3d4e5f"


TOKEN = b"the-vms-scaling-token"


NAMESPACE, VM = "tests", "fenced"


def tiny_guest_spec(guest: GuestImage) -> dict[str, Any]:
    """The runner's spec file of the tests' tiny guest (1 vCPU, 128Mi), which powers
    down when asked."""
    return {"terminationGracePeriodSeconds": 30, "guest": {
        "cpus": {"min": 1, "max": 1}, "memorySlotSize": "128Mi",
        "memorySlots": {"min": 1, "max": 1}, "rootDisk": {"image": ""},
        "kernelImage": str(guest.kernel), "initrdImage": str(guest.initrd),
        "appendKernelCmdline": "quiet neonvm.test=powerdown"}}


def qemu_of(work_dir: Path) -> list[int]:
    """The pids of QEMU processes started for this work dir."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes()
            if b"qemu-system" in cmdline and str(work_dir).encode() in cmdline:
                found.append(int(entry.name))
    return found
