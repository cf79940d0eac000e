"""A real node ready for VMs: runner pods that boot a guest under QEMU (TCG) on it.

Used by ``neonvm demo`` and the real-node drill test. :func:`prepare` builds (cached)
what is missing — the real node's binaries, the runner image, a tiny guest root disk
packed the NeonVM way (a container image holding ``/disk.qcow2``) — starts one real node
in the local cluster and imports both images into its containerd, the runner image also
under the name the local controller replicas put into runner pods
(:data:`neonvm.dev.replica.DEV_RUNNER_IMAGE`). :func:`vm_spec` is what a VM needs to
run there: a node selector on the real node, that root disk, 1 vCPU (250m requested),
the smallest memory.

The guest root disk is :mod:`neonvm.dev.guestdisk`'s (a static busybox and
``/app/report.sh``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from neonvm.dev import guestdisk, realnode

if TYPE_CHECKING:
    from neonvm.dev.cluster import LocalCluster

DISK_IMAGE = guestdisk.DISK_IMAGE


@dataclass
class RealGuestNode:
    node: realnode.RealNode
    runner_image: str
    disk_image: str
    seconds: dict[str, float]
    """Time per step (build, node, import)."""


def unavailable_reason() -> str | None:
    """Why no real guest can run here (one line), or None."""
    from neonvm.dev import images

    problem = realnode.unavailable_reason()
    if problem:
        return problem
    problem = images.unavailable_reason()
    if problem:
        return f"the runner image cannot be built: {problem}"
    absent = guestdisk.missing()
    if absent:
        return f"the guest disk cannot be built, missing: {', '.join(absent)}"
    return None


def prepare(cluster: LocalCluster, progress: Callable[[str], None] = lambda _m: None
            ) -> RealGuestNode:
    """Build what is missing, start real node 0 and import the runner and disk images."""
    from neonvm.dev import images
    from neonvm.dev.replica import DEV_RUNNER_IMAGE

    problem = unavailable_reason()
    if problem:
        raise realnode.RealNodeError(problem)
    seconds: dict[str, float] = {}
    t = time.monotonic()
    if not realnode.built():
        progress("building the real node's binaries (kubelet, containerd, runc, CNI; "
                 "cached; the first build compiles them: docs/real-node.md gives the times)")
    realnode.build(progress)
    seconds["binaries"] = time.monotonic() - t
    t = time.monotonic()
    progress("runner image (cached; a cold build takes several minutes)")
    [runner] = images.build(("runner",), None, progress)
    disk_dir = cluster.state_dir / "guest-disk"
    disk_dir.mkdir(parents=True, exist_ok=True)
    _raw, qcow2 = guestdisk.build_rootfs(disk_dir)
    disk_archive = guestdisk.disk_image_archive(qcow2, disk_dir / "rootdisk.oci.tar", DISK_IMAGE)
    seconds["images"] = time.monotonic() - t
    t = time.monotonic()
    [node] = realnode.start(cluster, 1, progress)
    seconds["node"] = time.monotonic() - t
    t = time.monotonic()
    for archive in (runner.archive, disk_archive):
        node.ctr("images", "import", "--platform", "linux/amd64", str(archive), timeout=600)
    # containerd spells a short name out in full; the kubelet asks for that.
    node.ctr("images", "tag", "--force", runner.reference,
             f"docker.io/library/{DEV_RUNNER_IMAGE}")
    seconds["import"] = time.monotonic() - t
    progress(f"{node.name}: runner image {runner.reference} (as {DEV_RUNNER_IMAGE}) and "
             f"guest disk {DISK_IMAGE} imported")
    return RealGuestNode(node, runner.reference, DISK_IMAGE, seconds)


def vm_spec(disk_image: str = DISK_IMAGE, args: tuple[str, ...] = ("hello",)
            ) -> dict[str, Any]:
    """Spec fields that put a VM's runner pod on the real node with a bootable guest:
    merged into a VM's spec (``guest`` key by key)."""
    return {
        "nodeSelector": {realnode.REAL_LABEL: "true"},
        "guest": {
            # One vCPU (QEMU's -smp is ceil(use)) but a request of 250m: the real node
            # has only this host's 2 CPUs, and five pods asking 1 CPU each do not fit.
            "cpus": {"min": "250m", "max": 1, "use": "250m"},
            "memorySlots": {"min": 1, "max": 1, "use": 1},
            "memorySlotSize": "128Mi",
            "rootDisk": {"image": disk_image, "imagePullPolicy": "Never"},
            "command": ["/app/report.sh"], "args": list(args),
        },
    }
