"""Build the runner tests' guest: the installed cloud kernel plus a busybox initramfs.

``python -m tests.guest.build DEST`` writes ``DEST/initrd.cpio`` and prints the kernel and
initrd paths. The initramfs holds a static busybox, ``init.sh`` (beside this file) as
``/init``, the runner's guest side of live scaling (``neonvm/runner/guest_scaling.sh``,
as ``/lib/neonvm/guest-scaling.sh``, which ``init.sh`` starts), and the few kernel
modules the guest needs (virtio disks, the virtio-serial port of the scaling agent,
virtio-mem, fw_cfg, the ACPI power button and evdev to read it) copied from
``/lib/modules/<kernel version>``.

Needs: ``linux-image-cloud-amd64``, ``busybox-static``, ``cpio`` (scripts/setup-qemu.sh).
:func:`missing` says what is absent, so tests can skip with a precise reason.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from neonvm.dev.guestdisk import install_scaling_script
from neonvm.runner.initramfs import find_kernel

INIT_SCRIPT = Path(__file__).with_name("init.sh")
BUSYBOX = Path("/bin/busybox")
MODULES = ("virtio", "virtio_ring", "virtio_pci_legacy_dev", "virtio_pci_modern_dev",
           "virtio_pci", "virtio_blk", "virtio_console", "virtio_mem", "qemu_fw_cfg", "evdev",
           "button")


@dataclass(frozen=True)
class GuestImage:
    kernel: Path
    initrd: Path
    kernel_version: str





def _busybox_is_static(path: Path) -> bool:
    return b"ld-linux" not in path.read_bytes()[:65536]


def missing() -> list[str]:
    """What the guest cannot be built without (empty when everything is there)."""
    absent = []
    if find_kernel() is None:
        absent.append("a readable /boot/vmlinuz-*-cloud-amd64 (linux-image-cloud-amd64)")
    if not BUSYBOX.exists() or not _busybox_is_static(BUSYBOX):
        absent.append("a static /bin/busybox (busybox-static)")
    if shutil.which("cpio") is None:
        absent.append("cpio")
    return absent


def build_guest(dest: Path) -> GuestImage:
    """Build the initramfs into ``dest``; raises RuntimeError if something is missing."""
    absent = missing()
    if absent:
        raise RuntimeError("cannot build the test guest, missing: " + ", ".join(absent))
    kernel = find_kernel()
    assert kernel is not None
    version = kernel.name.removeprefix("vmlinuz-")
    root = dest / "initramfs"
    if root.exists():
        shutil.rmtree(root)
    (root / "bin").mkdir(parents=True)
    (root / "lib" / "modules").mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    init = root / "init"
    shutil.copy2(INIT_SCRIPT, init)
    init.chmod(0o755)
    install_scaling_script(root)
    module_root = Path("/lib/modules") / version
    for name in MODULES:
        found = list(module_root.rglob(f"{name}.ko"))
        if found:
            shutil.copy2(found[0], root / "lib" / "modules" / f"{name}.ko")
    entries = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    initrd = dest / "initrd.cpio"
    with initrd.open("wb") as out:
        subprocess.run(["cpio", "--quiet", "-o", "-H", "newc", "-R", "0:0"], cwd=root,
                       input="\n".join([".", *entries]).encode() + b"\n", stdout=out,
                       check=True)
    return GuestImage(kernel=kernel, initrd=initrd, kernel_version=version)


if __name__ == "__main__":
    guest = build_guest(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("."))
    print(f"kernel: {guest.kernel}\ninitrd: {guest.initrd}")
