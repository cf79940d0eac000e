"""The runner's kernel path: is the root disk a bare filesystem, and the guest's boot script.

A NeonVM-style root disk (vm-builder's output) is one ext4 filesystem, no partition
table, no kernel, no boot loader. Firmware cannot boot it, so the runner boots its own
kernel and initramfs (:mod:`neonvm.runner.initramfs`), whose init mounts that
filesystem and runs the guest's command.

The init learns what to run from a **boot script** that the runner writes and hands to
QEMU as the fw_cfg file ``opt/vm.neon.tech/boot.sh`` (beside the JSON guest config,
``opt/vm.neon.tech/config``). The guest reads it at
``/sys/firmware/qemu_fw_cfg/by_name/opt/vm.neon.tech/boot.sh/raw`` and sources it. It
defines variables and shell functions only; every value from the spec is single-quoted
(:func:`shell_quote`), so a spec cannot inject commands. :func:`boot_script` is a pure
function of the spec.

What it carries: the ready marker; ``settings.sysctl`` lines; ``settings.swap`` (the
runner adds an unformatted disk with serial ``swapdisk``; the init runs ``mkswap`` and
``swapon``); the extra disks to mount (by virtio serial) and tmpfs mounts; the
environment; the command line (``command`` then ``args``). Without a command, the init
hands the machine to the root filesystem's ``/sbin/init`` (``switch_root``).
"""

from __future__ import annotations

import re
import struct
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from neonvm.api.quantity import QuantityError, parse_bytes
from neonvm.runner.errors import HostError, SpecError

BOOT_FW_CFG_NAME = "opt/vm.neon.tech/boot.sh"
BOOT_SCRIPT_NAME = "guest-boot.sh"
SWAP_SERIAL = "swapdisk"
EXT_MAGIC_OFFSET = 1080
EXT_MAGIC = b"\x53\xef"
QCOW2_MAGIC = b"QFI\xfb"
_QCOW2_OFFSET_MASK = 0x00FFFFFFFFFFFE00
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SYSCTL = re.compile(r"^\s*([A-Za-z0-9_.\-/]+)\s*=\s*(.*?)\s*$")


def shell_quote(value: str) -> str:
    """``value`` as one single-quoted POSIX shell word."""
    return "'" + value.replace("'", "'\"'\"'") + "'"


def valid_env_name(name: str) -> bool:
    """Whether ``name`` can be a shell variable in the guest."""
    return _ENV_NAME.match(name) is not None


def swap_bytes(settings: Mapping[str, Any] | None) -> int | None:
    """``settings.swap`` (or NeonVM's ``settings.swapInfo.size``) in bytes; None if unset."""
    if not settings:
        return None
    raw = settings.get("swap")
    info = settings.get("swapInfo")
    if raw is None and isinstance(info, Mapping):
        raw = info.get("size")
    if raw is None:
        return None
    try:
        size = parse_bytes(raw)
    except QuantityError as exc:
        raise SpecError(f"guest.settings.swap: {exc}") from None
    if size < (1 << 20):
        raise SpecError(f"guest.settings.swap: {raw!r} is below 1Mi")
    return size


def sysctl_lines(settings: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """``settings.sysctl`` as (key, value) pairs; ``SpecError`` for a line without ``=``."""
    pairs = []
    for line in (settings or {}).get("sysctl") or []:
        match = _SYSCTL.match(str(line))
        if match is None:
            raise SpecError(f"guest.settings.sysctl: {line!r} is not 'key = value'")
        pairs.append((match.group(1), match.group(2)))
    return pairs


def guest_argv(command: Sequence[str] | None, args: Sequence[str] | None) -> list[str]:
    """The guest's command line: ``command`` then ``args`` (``args`` alone if no command)."""
    return [*(command or []), *(args or [])]


def boot_script(*, marker: str, command: Sequence[str] | None, args: Sequence[str] | None,
                env: Sequence[tuple[str, str]], settings: Mapping[str, Any] | None,
                disks: Sequence[Mapping[str, Any]], swap: bool) -> str:
    """The shell the runner's init sources (see the module docstring)."""
    for name, _value in env:
        if not valid_env_name(name):
            raise SpecError(f"guest.env: {name!r} is not a valid variable name for the guest")
    q = shell_quote
    lines = ["# neonvm-runner boot script: sourced by the runner's init (do not edit)",
             f"NEONVM_MARKER={q(marker)}",
             f"NEONVM_SWAP_SERIAL={q(SWAP_SERIAL if swap else '')}"]
    argv = guest_argv(command, args)
    lines.append(f"NEONVM_HAS_COMMAND={1 if argv else 0}")
    lines.append("neonvm_sysctls() {")
    lines += [f"    neonvm_sysctl {q(k)} {q(v)}" for k, v in sysctl_lines(settings)]
    lines += ["    :", "}", "neonvm_mounts() {"]
    for disk in disks:
        mount_path = disk.get("mountPath")
        if not mount_path:
            continue
        if disk.get("filesystem") == "tmpfs":
            size = disk.get("size")
            lines.append(f"    neonvm_mount_tmpfs {q(str(mount_path))} "
                         f"{q(str(size) if size else '')}")
        else:
            mode = "ro" if disk.get("readOnly") else "rw"
            lines.append(f"    neonvm_mount_disk {q(str(disk.get('serial', '')))} "
                         f"{q(str(mount_path))} {mode}")
    lines += ["    :", "}", "neonvm_env() {"]
    lines += [f"    export {q(f'{k}={v}')}" for k, v in env]
    lines += ["    :", "}", "neonvm_exec() {"]
    if argv:
        lines.append("    exec chroot /newroot " + " ".join(q(a) for a in argv))
    else:
        lines.append("    return 1")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _qcow2_head(f: BinaryIO, count: int) -> bytes | None:
    """The guest's first ``count`` bytes of an open qcow2 image, read through its first
    L2 table; None when that cluster is compressed, encrypted or in a backing file (the
    caller then asks ``qemu-img``)."""
    header = f.read(72)
    backing_offset, = struct.unpack(">Q", header[8:16])
    cluster_bits, = struct.unpack(">I", header[20:24])
    encrypted, = struct.unpack(">I", header[32:36])
    l1_size, = struct.unpack(">I", header[36:40])
    l1_offset, = struct.unpack(">Q", header[40:48])
    if encrypted or not 9 <= cluster_bits <= 21 or count > (1 << cluster_bits):
        return None
    if l1_size == 0:
        return None if backing_offset else bytes(count)
    f.seek(l1_offset)
    l2_offset = struct.unpack(">Q", f.read(8))[0] & _QCOW2_OFFSET_MASK
    if l2_offset == 0:
        return None if backing_offset else bytes(count)
    f.seek(l2_offset)
    entry, = struct.unpack(">Q", f.read(8))
    if entry & (1 << 62):
        return None  # compressed
    data_offset = entry & _QCOW2_OFFSET_MASK
    if data_offset == 0:
        return None if backing_offset or entry & 1 == 0 else bytes(count)
    f.seek(data_offset)
    return f.read(count)


def read_first_bytes(image: Path, count: int, qemu_img: str | None) -> bytes:
    """The first ``count`` bytes the guest would see on ``image`` (raw or qcow2)."""
    with image.open("rb") as f:
        head = f.read(max(count, 4))
        if head[:4] != QCOW2_MAGIC:
            return head[:count]
        f.seek(0)
        direct = _qcow2_head(f, count)
    if direct is not None:
        return direct
    if qemu_img is None:
        raise HostError("qemu-img not found (package qemu-utils): needed for the root disk")
    with tempfile.TemporaryDirectory(prefix="neonvm-rootdisk-") as scratch:
        out = Path(scratch) / "head.raw"
        result = subprocess.run([qemu_img, "dd", "-f", "qcow2", "-O", "raw", "bs=4096",
                                 f"count={-(-count // 4096)}", f"if={image}", f"of={out}"],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            lines = result.stderr.strip().splitlines()
            raise HostError(f"reading the root disk {image} failed: "
                            f"{lines[-1] if lines else result.returncode}")
        return out.read_bytes()[:count]


def is_bare_ext_filesystem(first_bytes: bytes) -> bool:
    """Whether a disk starts with an ext2/3/4 superblock (no partition table before it)."""
    return first_bytes[EXT_MAGIC_OFFSET:EXT_MAGIC_OFFSET + 2] == EXT_MAGIC
