"""A NeonVM-style guest root disk: one bare ext4 filesystem, no kernel, no init.

The demo's real-node guest (``neonvm.dev.realguest``) and the real-node tests boot it.
``python -m neonvm.dev.guestdisk DEST`` writes ``DEST/rootfs.ext4`` and ``DEST/disk.qcow2``
(the same filesystem as qcow2, the shape vm-builder images carry at ``/disk.qcow2``).
The filesystem holds a static busybox (``/bin/busybox``, ``/bin/sh`` and the applets as
symlinks) and ``/app/report.sh``, which prints what a guest command sees: its argv, the
spec's environment, the sysctls, the swap, and the mounts, then waits for SIGTERM.
``build_rootfs(dest, init=SCRIPT)`` also installs an init script as ``/init`` and
``/sbin/init`` (the tests pass their guest's ``init.sh``), with the guest side of live
scaling that it starts (the runner's ``guest_scaling.sh``) as
``/lib/neonvm/guest-scaling.sh``. A VM with no ``command`` then boots the
runner's kernel, whose init hands over to it (``switch_root``). A VM with a command needs
none of this: the runner's own init runs the same scaling script.

Needs: ``busybox-static``, ``mkfs.ext4`` (e2fsprogs), ``qemu-img`` (qemu-utils).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from neonvm.runner.initramfs import SCALING_SCRIPT, SCALING_SCRIPT_PATH

BUSYBOX = Path("/bin/busybox")
REPORT = r"""#!/bin/sh
echo "app: argv $*"
echo "app: GREETING=$GREETING"
echo "app: hostname-free pid $$ root $(ls / | tr '\n' ' ')"
for key in $(echo "$REPORT_SYSCTLS"); do
    echo "app: sysctl $key=$(sysctl -n "$key")"
done
echo "app: $(grep SwapTotal /proc/meminfo | tr -s ' ')"
grep -E ' (/data|/scratch) ' /proc/mounts | while read -r dev dir fs opts rest; do
    echo "app: mount $dir $fs ${opts%%,*}"
done
[ -f /data/probe ] && echo "app: /data/probe says $(cat /data/probe)"
trap 'echo "app: SIGTERM, exiting"; exit 0' TERM
echo "app: running"
while true; do sleep 1; done
"""


def install_scaling_script(root: Path) -> Path:
    """Copy the runner's guest side of live scaling into the guest tree ``root``
    (``/lib/neonvm/guest-scaling.sh``), where an init script starts it."""
    target = root / SCALING_SCRIPT_PATH
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SCALING_SCRIPT, target)
    target.chmod(0o755)
    return target


def missing() -> list[str]:
    absent = []
    if not BUSYBOX.exists() or b"ld-linux" in BUSYBOX.read_bytes()[:65536]:
        absent.append("a static /bin/busybox (busybox-static)")
    for tool, package in (("mkfs.ext4", "e2fsprogs"), ("qemu-img", "qemu-utils")):
        if shutil.which(tool, path="/usr/sbin:/sbin:/usr/bin:/bin") is None:
            absent.append(f"{tool} ({package})")
    return absent


def build_rootfs(dest: Path, size_mib: int = 16, init: Path | None = None
                 ) -> tuple[Path, Path]:
    """``(rootfs.ext4, disk.qcow2)`` in ``dest``; raises RuntimeError if a tool is missing.
    ``init``: a script installed as ``/init``, with ``/sbin/init`` linking to it."""
    absent = missing()
    if absent:
        raise RuntimeError("cannot build the test root disk, missing: " + ", ".join(absent))
    tree = dest / "rootfs"
    if tree.exists():
        shutil.rmtree(tree)
    for d in ("bin", "sbin", "etc", "app", "proc", "sys", "dev", "tmp", "run", "data"):
        (tree / d).mkdir(parents=True)
    shutil.copy2(BUSYBOX, tree / "bin" / "busybox")
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    for applet in applets:
        if applet != "busybox":
            (tree / "bin" / applet).symlink_to("busybox")
    report = tree / "app" / "report.sh"
    report.write_text(REPORT)
    report.chmod(0o755)
    if init is not None:
        shutil.copyfile(init, tree / "init")
        (tree / "init").chmod(0o755)
        (tree / "sbin" / "init").symlink_to("../init")
        install_scaling_script(tree)
    image = dest / "rootfs.ext4"
    image.unlink(missing_ok=True)
    mkfs = shutil.which("mkfs.ext4", path="/usr/sbin:/sbin:/usr/bin:/bin")
    qemu_img = shutil.which("qemu-img", path="/usr/sbin:/sbin:/usr/bin:/bin")
    assert mkfs is not None and qemu_img is not None
    with image.open("wb") as f:
        f.truncate(size_mib << 20)
    subprocess.run([mkfs, "-q", "-F", "-L", "rootfs", "-d", str(tree), str(image)],
                   check=True, capture_output=True)
    qcow2 = dest / "disk.qcow2"
    qcow2.unlink(missing_ok=True)
    subprocess.run([qemu_img, "convert", "-q", "-f", "raw", "-O", "qcow2", str(image),
                    str(qcow2)], check=True)
    for path in (image, qcow2):
        path.chmod(0o644)
    return image, qcow2


DISK_IMAGE = "neonvm.local/rootdisk:1"
"""The container image carrying the root disk, as NeonVM's vm-builder images do."""
SCALING_DISK_IMAGE = "neonvm.local/rootdisk-testguest:1"
"""The same, with the test guest's init as ``/sbin/init`` (``tests/guest/init.sh``)."""


def disk_image_archive(qcow2: Path, out: Path, reference: str = DISK_IMAGE) -> Path:
    """An OCI archive (for ``ctr images import``) of an image holding ``/disk.qcow2`` and a
    static busybox as ``/bin/cp``: what the runner pod's ``init-rootdisk`` container runs
    (``cp /disk.qcow2 /vm/images/rootdisk.qcow2``) as uid 65532."""
    from neonvm.dev import images

    tree = out.parent / "disk-image"
    if tree.exists():
        shutil.rmtree(tree)
    (tree / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, tree / "bin" / "busybox")
    (tree / "bin" / "cp").symlink_to("busybox")
    shutil.copy2(qcow2, tree / "disk.qcow2")
    (tree / "disk.qcow2").chmod(0o644)
    layer = images.layer_from_dir(tree, out.parent / "disk-image.tar.gz")
    config = images.image_config({"Env": ["PATH=/bin"], "Entrypoint": ["/bin/cp"]}, [layer])
    images.oci_archive(out, reference, config, [layer])
    return out


if __name__ == "__main__":
    raw, qcow = build_rootfs(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("."))
    print(f"ext4: {raw}\nqcow2: {qcow}")
