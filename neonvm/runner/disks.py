"""The side effects of a :class:`~neonvm.runner.qemu.LaunchPlan` before QEMU starts.

:func:`check_prerequisites` verifies that every file, directory and tool the plan needs is
there, so a missing kernel is one clear line rather than a QEMU error. :func:`prepare`
then creates the disk files and writes the guest config:

* root disk: ``qemu-img create -f qcow2 -b <image> -F <raw|qcow2>``. The image itself is
  never written to; a new pod starts from the pristine image again.
* emptyDisk: a sparse raw file of the given size, formatted ext4 (label = disk name).
* swap (``settings.swap``): a sparse raw file, unformatted (the guest runs mkswap).
* configMap/secret: a read-only ext4 image (no journal) holding a copy of the mounted
  directory, symlinks included, so Kubernetes' ``..data`` layout survives. It is a
  snapshot at pod start: later updates of the ConfigMap do not reach the guest.

Every file is created afresh (an existing one is replaced): a disk of a previous run in
the same work dir must not leak into this one. Not guaranteed: cleanup of the created
files; the work dir belongs to the pod and goes with it.
"""

from __future__ import annotations

import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from neonvm.runner.errors import HostError, SpecError
from neonvm.runner.qemu import MIB, DiskImage, LaunchPlan, guest_config_json
from neonvm.runner.runtimedisk import swap_header

QCOW2_MAGIC = b"QFI\xfb"


@dataclass(frozen=True)
class DiskTools:
    """The external tools disk preparation may need (None: not installed)."""

    qemu_img: str | None
    mkfs_ext4: str | None


def check_prerequisites(plan: LaunchPlan, tools: DiskTools) -> None:
    """Raise a one-line error for the first missing file, directory or tool."""
    for what, path in plan.required_files:
        if not path.is_file():
            raise SpecError(f"{what} not found: {path}")
        if not os.access(path, os.R_OK):
            raise SpecError(f"{what} is not readable: {path}")
    for what, path in plan.required_dirs:
        if not path.is_dir():
            raise SpecError(f"{what} not found: expected its files in {path}")
    kinds = {d.kind for d in plan.disk_images}
    if "root-overlay" in kinds and tools.qemu_img is None:
        raise HostError("qemu-img not found (package qemu-utils): needed for the root disk")
    if kinds & {"empty", "content"} and tools.mkfs_ext4 is None:
        raise HostError("mkfs.ext4 not found (package e2fsprogs): needed for extra disks")


def image_format(path: Path) -> str:
    """``qcow2`` if the file starts with the qcow2 magic, else ``raw``."""
    with path.open("rb") as f:
        return "qcow2" if f.read(4) == QCOW2_MAGIC else "raw"


def content_image_size(source: Path) -> int:
    """Bytes for an ext4 image holding ``source``: contents plus per-entry overhead, in MiB.

    Regular files count with their size rounded up to 1 KiB blocks (mke2fs picks 1 KiB
    blocks for small file systems), every entry with one inode and a directory slot.
    """
    total = 0
    entries = 0
    for root, dirs, files in os.walk(source):
        entries += len(dirs) + len(files)
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if not stat.S_ISLNK(st.st_mode):
                total += -(-st.st_size // 1024) * 1024
    wanted = total + total // 8 + entries * 4096 + 2 * MIB
    return -(-wanted // MIB) * MIB


def _run(argv: list[str], what: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        detail = lines[-1] if lines else f"exit code {result.returncode}"
        raise HostError(f"{what} failed: {detail}")


def _fresh(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)


def prepare_disk(disk: DiskImage, tools: DiskTools) -> None:
    """Create one disk file as described (replacing any previous one)."""
    _fresh(disk.path)
    if disk.kind == "root-overlay":
        assert disk.backing_file is not None and tools.qemu_img is not None
        backing = disk.backing_file.resolve()
        argv = [tools.qemu_img, "create", "-q", "-f", "qcow2",
                "-F", image_format(backing), "-b", str(backing), str(disk.path)]
        if disk.size_bytes is not None:
            argv.append(str(disk.size_bytes))
        _run(argv, f"creating the root disk overlay on {backing}")
        return
    if disk.kind == "blank":
        assert disk.size_bytes is not None
        with disk.path.open("wb") as f:
            if disk.label:  # the swap disk: found by its label (vm-builder's blkid -L)
                f.write(swap_header(disk.size_bytes, disk.label))
            f.truncate(disk.size_bytes)
        return
    if disk.kind == "file":
        assert disk.contents is not None
        disk.path.write_bytes(disk.contents)
        return
    assert tools.mkfs_ext4 is not None
    if disk.kind == "empty":
        assert disk.size_bytes is not None
        with disk.path.open("wb") as f:
            f.truncate(disk.size_bytes)
        _run([tools.mkfs_ext4, "-q", "-F", "-m", "0", "-L", disk.label or disk.name,
              str(disk.path)], f"formatting emptyDisk {disk.name}")
        return
    assert disk.source_dir is not None
    with disk.path.open("wb") as f:
        f.truncate(content_image_size(disk.source_dir))
    _run([tools.mkfs_ext4, "-q", "-F", "-m", "0", "-O", "^has_journal",
          "-L", disk.label or disk.name, "-d", str(disk.source_dir), str(disk.path)],
         f"building the image of disk {disk.name} from {disk.source_dir}")


def prepare(plan: LaunchPlan, tools: DiskTools) -> None:
    """Check prerequisites, create every disk file and write the guest config."""
    check_prerequisites(plan, tools)
    plan.guest_config_path.parent.mkdir(parents=True, exist_ok=True)
    for disk in plan.disk_images:
        prepare_disk(disk, tools)
    plan.guest_config_path.write_text(guest_config_json(plan))
    if plan.boot_script is not None and plan.boot_script_path is not None:
        plan.boot_script_path.write_text(plan.boot_script)
    plan.qmp_socket.unlink(missing_ok=True)
