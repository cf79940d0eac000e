"""The runner's own guest kernel and initramfs (``/vm/kernel`` in the runner image).

A VM whose spec names no ``kernelImage`` and whose root disk is a bare filesystem (no
partition table, no kernel: the shape of NeonVM's vm-builder disks) boots this kernel
with this initramfs. The initramfs holds a static busybox, the runner's init
(``guest_init.sh`` beside this file, as ``/init``), the guest side of live scaling
(``guest_scaling.sh``, as ``/lib/neonvm/guest-scaling.sh``), ``resize2fs`` with the
shared libraries it loads (to grow the root filesystem to ``rootDisk.size``) and the
kernel modules it needs, in dependency order. The init mounts the root filesystem and runs
the guest's command, or hands over to a vm-builder image's own init; see docs/runner.md,
"The runner's kernel" and "The vm-builder boot contract".

:func:`build_initramfs` writes a ``newc`` cpio archive itself, with sorted entries,
numeric owner 0 and fixed mtimes, so the same inputs give the same bytes (the runner
image's layer digest stays stable across builds).

Needs on the build host: a kernel (``/boot/vmlinuz-*-cloud-amd64`` by default, from
``linux-image-cloud-amd64``), its ``/lib/modules/<version>`` and a static busybox
(``busybox-static``). :func:`missing` names what is absent. ``resize2fs`` (e2fsprogs)
is taken when the host has it; without it the guest's root keeps the image's size.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

INIT_SCRIPT = Path(__file__).with_name("guest_init.sh")
SCALING_SCRIPT = Path(__file__).with_name("guest_scaling.sh")
"""The guest side of live scaling, shared with the tests' guest (tests/guest)."""
SCALING_SCRIPT_PATH = "lib/neonvm/guest-scaling.sh"
"""Where a guest carries :data:`SCALING_SCRIPT` (relative to its root)."""
BUSYBOX = Path("/bin/busybox")
KERNEL_NAME = "vmlinuz"
INITRD_NAME = "initrd.cpio"
MTIME = 1735689600
"""2025-01-01T00:00:00Z, the images' SOURCE_DATE_EPOCH."""
MODULES = ("virtio_pci", "virtio_blk", "virtio_net", "virtio_console", "virtio_mem",
           "qemu_fw_cfg", "button", "evdev", "isofs")
"""What the init loads (with their dependencies): disks, network, the scaling agent's
port, virtio-mem (live memory scaling; loaded before a vm-builder init takes over, whose
disk has no modules for this kernel), the config in fw_cfg, the ACPI power button read
through evdev, and ISO 9660 (a vm-builder guest mounts its runtime disk with it). ext4,
tmpfs, swap and devtmpfs are built into Debian's cloud kernel."""
RESIZE2FS = ("/usr/sbin/resize2fs", "/sbin/resize2fs")
LOAD_ORDER = "lib/modules/load-order"


@dataclass(frozen=True)
class RunnerKernel:
    """A kernel and the runner's initramfs for it."""

    kernel: Path
    initrd: Path


def find_kernel(boot: Path = Path("/boot")) -> Path | None:
    """The newest readable Debian cloud kernel (``vmlinuz-*-cloud-amd64``), else None."""
    kernels = sorted(boot.glob("vmlinuz-*-cloud-amd64"))
    readable = [k for k in kernels if os.access(k, os.R_OK)]
    return readable[-1] if readable else None


def find_runner_kernel(directory: Path) -> RunnerKernel | None:
    """``<dir>/vmlinuz`` and ``<dir>/initrd.cpio`` if both are there, else None."""
    kernel, initrd = directory / KERNEL_NAME, directory / INITRD_NAME
    if kernel.is_file() and initrd.is_file():
        return RunnerKernel(kernel=kernel, initrd=initrd)
    return None


def find_resize2fs() -> Path | None:
    """The host's ``resize2fs`` (e2fsprogs), else None."""
    for candidate in RESIZE2FS:
        if os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def program_files(binary: Path, target: str) -> list[tuple[str, Path]]:
    """(path in the initramfs, host file) for ``binary`` at ``target`` and every shared
    library ``ldd`` names for it (the dynamic loader included), at their host paths."""
    pairs = [(target, binary)]
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True,
                         check=True).stdout
    for line in out.splitlines():
        words = line.split()
        path = words[2] if "=>" in words and len(words) > 2 else words[0] if words else ""
        if path.startswith("/"):
            pairs.append((path.lstrip("/"), Path(path)))
    return pairs


def _busybox_is_static(path: Path) -> bool:
    return b"ld-linux" not in path.read_bytes()[:65536]


def missing(boot: Path = Path("/boot"), busybox: Path = BUSYBOX) -> list[str]:
    """What :func:`build_initramfs` cannot do without (empty when everything is there)."""
    absent = []
    if find_kernel(boot) is None:
        absent.append("a readable /boot/vmlinuz-*-cloud-amd64 (linux-image-cloud-amd64)")
    if not busybox.exists() or not _busybox_is_static(busybox):
        absent.append(f"a static {busybox} (busybox-static)")
    return absent


def module_closure(modules_dep: str, wanted: Iterable[str]) -> list[str]:
    """Relative paths of ``wanted`` modules and their dependencies, dependencies first.

    ``modules_dep`` is the text of ``modules.dep`` (``path: dep dep ...``, each line's
    dependencies already transitive). A wanted module the kernel does not have as a
    module (built in, or absent) is skipped.
    """
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in modules_dep.splitlines():
        path, sep, rest = line.partition(":")
        if not sep:
            continue
        deps[path] = rest.split()
        name = Path(path).name.split(".ko")[0]
        by_name[name] = path
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        for dep in reversed(deps.get(path, [])):
            visit(dep)
        order.append(path)

    for name in wanted:
        if name in by_name:
            visit(by_name[name])
    return order


def _cpio_entry(out: io.BufferedIOBase, name: str, mode: int, data: bytes = b"",
                ino: int = 0) -> None:
    encoded = name.encode() + b"\0"
    fields = [ino, mode, 0, 0, 1, MTIME, len(data), 0, 0, 0, 0, len(encoded), 0]
    header = b"070701" + b"".join(f"{v:08X}".encode() for v in fields)
    out.write(header + encoded)
    out.write(b"\0" * (-(len(header) + len(encoded)) % 4))
    out.write(data)
    out.write(b"\0" * (-len(data) % 4))


def write_cpio(files: dict[str, tuple[int, bytes]], out: io.BufferedIOBase) -> None:
    """A newc archive of ``files`` (path → (mode, contents); a directory has S_IFDIR and
    no contents, a symlink S_IFLNK and its target), sorted, owned by 0:0."""
    for ino, name in enumerate(sorted(files), start=1):
        mode, data = files[name]
        _cpio_entry(out, name, mode, data, ino)
    _cpio_entry(out, "TRAILER!!!", 0)


def initramfs_files(kernel_version: str, modules_root: Path = Path("/lib/modules"),
                    busybox: Path = BUSYBOX,
                    init: Path = INIT_SCRIPT, scaling: Path = SCALING_SCRIPT,
                    programs: Sequence[tuple[str, Path]] = ()
                    ) -> dict[str, tuple[int, bytes]]:
    """The initramfs's contents: busybox, /init, the scaling script, the modules and
    their load order, and ``programs`` ((path inside, host file) pairs, see
    :func:`program_files`)."""
    directory = stat.S_IFDIR | 0o755
    files: dict[str, tuple[int, bytes]] = {
        d: (directory, b"") for d in ("bin", "dev", "etc", "lib", "lib/modules",
                                      "lib/neonvm", "mnt", "newroot", "proc", "run", "sys",
                                      "tmp")}
    files["bin/busybox"] = (stat.S_IFREG | 0o755, busybox.read_bytes())
    files["bin/sh"] = (stat.S_IFLNK | 0o777, b"busybox")
    files["init"] = (stat.S_IFREG | 0o755, init.read_bytes())
    files[SCALING_SCRIPT_PATH] = (stat.S_IFREG | 0o755, scaling.read_bytes())
    for inside, host in programs:
        parts = inside.split("/")
        for depth in range(1, len(parts)):
            files.setdefault("/".join(parts[:depth]), (directory, b""))
        files[inside] = (stat.S_IFREG | 0o755, host.read_bytes())
    root = modules_root / kernel_version
    loaded = []
    dep = root / "modules.dep"
    if dep.is_file():
        for rel in module_closure(dep.read_text(), MODULES):
            name = Path(rel).name
            files[f"lib/modules/{name}"] = (stat.S_IFREG | 0o644, (root / rel).read_bytes())
            loaded.append(name)
    files[LOAD_ORDER] = (stat.S_IFREG | 0o644, "".join(f"{m}\n" for m in loaded).encode())
    return files


def build_initramfs(dest: Path, kernel: Path | None = None,
                    busybox: Path = BUSYBOX) -> RunnerKernel:
    """Write ``dest/vmlinuz`` (a copy of ``kernel``) and ``dest/initrd.cpio``.

    Raises RuntimeError naming what is missing.
    """
    kernel = kernel or find_kernel()
    absent = missing(busybox=busybox) if kernel is None else (
        [] if busybox.exists() and _busybox_is_static(busybox)
        else [f"a static {busybox} (busybox-static)"])
    if kernel is None or absent:
        raise RuntimeError("cannot build the runner's initramfs, missing: " + ", ".join(absent))
    version = kernel.name.removeprefix("vmlinuz-")
    dest.mkdir(parents=True, exist_ok=True)
    resize2fs = find_resize2fs()
    programs = program_files(resize2fs, "bin/resize2fs") if resize2fs else []
    files = initramfs_files(version, busybox=busybox, programs=programs)
    buf = io.BytesIO()
    write_cpio(files, buf)
    initrd = dest / INITRD_NAME
    initrd.write_bytes(buf.getvalue())
    target = dest / KERNEL_NAME
    shutil.copyfile(kernel, target)
    for path in (initrd, target):
        path.chmod(0o644)
        os.utime(path, (MTIME, MTIME))
    return RunnerKernel(kernel=target, initrd=initrd)


if __name__ == "__main__":
    import sys

    built = build_initramfs(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/vm/kernel"))
    print(f"kernel: {built.kernel}\ninitrd: {built.initrd}")
