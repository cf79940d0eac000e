"""The runtime disk a vm-builder guest's init reads: NeonVM's boot contract, runner side.

A root disk made by NeonVM's vm-builder carries its own init (``/neonvm/bin/init``, busybox
init with vm-builder's ``/etc/inittab``). Its ``vminit`` mounts the second virtio disk
(``/dev/vdb``) as ISO 9660 on ``/neonvm/runtime`` and reads these files, which
:func:`runtime_files` makes from the spec (a pure function; docs/runner.md, "The
vm-builder boot contract", has the table):

* ``sysctl.conf``: ``kernel.core_pattern=core``, ``kernel.core_uses_pid=1``, then
  ``settings.sysctl`` (``sysctl -p``);
* ``command.sh`` / ``args.sh``: ``guest.command`` / ``guest.args`` as shell words, present
  only when set. vm-builder's ``vmstart`` runs ``command.sh`` or else the image's
  ENTRYPOINT, followed by ``args.sh`` or else the image's CMD;
* ``env.sh``: ``export NAME='value'`` per ``guest.env`` entry;
* ``mounts.sh``: always; ``set -euo pipefail``, then the swap, the extra disks (by ext4
  label, ``blkid -L``) and tmpfs mounts, a larger ``/dev/shm`` when swap exceeds half
  the boot memory, and last (with ``enableSSH`` and a key) the ``ssh-authorized-keys``
  disk on ``/mnt/ssh``;
* ``resize-swap-internal.sh``: with ``settings.swap``, re-makes and enables the swap disk
  (label ``swapdisk``) at a given size.

:func:`iso9660_image` writes the disk itself (volume label ``vmruntime``) without any
external tool, deterministically. :func:`swap_header` is the swap signature the runner
writes on the swap disk so that ``blkid -L swapdisk`` finds it. Every value from the spec
is single-quoted: a spec cannot inject commands into the guest's root shell.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from neonvm.runner.errors import SpecError
from neonvm.runner.guestboot import SWAP_SERIAL, shell_quote, sysctl_lines, valid_env_name

RUNTIME_LABEL = "vmruntime"
RUNTIME_SERIAL = "runtime"
RUNTIME_DISK_NAME = "runtime.iso"
SSH_LABEL = "ssh-authorized-keys"
"""NeonVM's volume label of the disk holding the guest's ``authorized_keys``."""
SSH_DISK_NAME = "ssh-authorized-keys.iso"
SSH_MOUNT = "/mnt/ssh"
"""Where vm-builder's sshd reads ``authorized_keys`` (its ``AuthorizedKeysFile``)."""
GUEST_INIT = "/neonvm/bin/init"
"""What makes a root disk a vm-builder image: the runner then boots it with
``init=/neonvm/bin/init`` and the runtime disk."""
BASE_SYSCTLS = ("kernel.core_pattern=core", "kernel.core_uses_pid=1")
"""What NeonVM's runner always puts first in ``sysctl.conf``."""
SECTOR = 2048
MTIME = (2025, 1, 1, 0, 0, 0)
"""Every date on the image (the images' SOURCE_DATE_EPOCH), so equal specs give equal bytes."""


def shell_words(words: Sequence[str]) -> str:
    """``words`` as one shell command line, each word quoted."""
    return " ".join(shell_quote(w) for w in words)


def runtime_files(*, command: Sequence[str] | None, args: Sequence[str] | None,
                  env: Sequence[tuple[str, str]], settings: Mapping[str, Any] | None,
                  disks: Sequence[Mapping[str, Any]], swap_bytes: int | None,
                  boot_memory_bytes: int, ssh: bool = False) -> dict[str, bytes]:
    """The runtime disk's files (name → contents) for a vm-builder guest; see the module
    docstring. ``disks`` are the guest config's entries (``source``, ``mountPath``,
    ``label``, ``readOnly``, ``size``); the swap entry is left out. ``ssh``: the guest
    has the :data:`SSH_LABEL` disk, which ``mounts.sh`` mounts first."""
    files: dict[str, bytes] = {}
    sysctls = [*BASE_SYSCTLS, *(f"{k}={v}" for k, v in sysctl_lines(settings))]
    files["sysctl.conf"] = "\n".join(sysctls).encode() + b"\n"
    if command:
        files["command.sh"] = shell_words(command).encode()
    if args:
        files["args.sh"] = shell_words(args).encode()
    if env:
        for name, _value in env:
            if not valid_env_name(name):
                raise SpecError(f"guest.env: {name!r} is not a valid variable name for the guest")
        files["env.sh"] = "".join(f"export {name}={shell_quote(value)}\n"
                                  for name, value in env).encode()
    q = shell_quote
    mounts = ["set -euo pipefail"]
    if swap_bytes is not None:
        mounts.append(f"/neonvm/bin/sh /neonvm/runtime/resize-swap-internal.sh {swap_bytes}")
    for disk in disks:
        path = disk.get("mountPath")
        if not path:
            continue
        mounts.append(f"/neonvm/bin/mkdir -p {q(str(path))}")
        if disk.get("source") == "tmpfs":
            size = disk.get("size")
            options = f"-o size={int(size)} " if size else ""
            mounts += [f"/neonvm/bin/chmod 0777 {q(str(path))}",
                       f"/neonvm/bin/mount -t tmpfs {options}{q(str(disk['name']))} "
                       f"{q(str(path))}"]
            continue
        options = "-o ro " if disk.get("readOnly") else ""
        mounts.append(f"/neonvm/bin/mount {options}\"$(/neonvm/bin/blkid -L "
                      f"{q(str(disk['label']))})\" {q(str(path))}")
        if disk.get("source") == "emptyDisk" and not disk.get("readOnly"):
            mounts.append(f"/neonvm/bin/chmod 0777 {q(str(path))}")  # after mount, as NeonVM
    if swap_bytes is not None and swap_bytes > boot_memory_bytes // 2:
        # Linux sizes /dev/shm at half the memory; with swap the guest may grow (NeonVM #800).
        mounts.append(f"/neonvm/bin/mount -o remount,size={swap_bytes} /dev/shm")
    if ssh:
        # Last (NeonVM has it first): under set -e a key disk the guest cannot find stops
        # only its own mount, not the workload's disks and swap.
        mounts += [f"/neonvm/bin/mkdir -p {SSH_MOUNT}",
                   f"/neonvm/bin/mount -t iso9660 -o ro,mode=0644 "
                   f"\"$(/neonvm/bin/blkid -L {SSH_LABEL})\" {SSH_MOUNT}"]
    files["mounts.sh"] = ("\n".join(mounts) + "\n").encode()
    if swap_bytes is not None:
        files["resize-swap-internal.sh"] = "\n".join([
            "#!/neonvm/bin/sh",
            "set -euo pipefail",
            'export PATH="/neonvm/bin"',
            f'swapdisk="$(/neonvm/bin/blkid -L {SWAP_SERIAL})"',
            'swapoff "$swapdisk" || true',
            'new_size="$1"',
            "if [ \"$new_size\" = '0' ]; then exit 0; fi",
            f'mkswap -L {SWAP_SERIAL} "$swapdisk" $(( new_size / 1024 ))',
            'swapon -d "$swapdisk"',
            ""]).encode()
    return files


def swap_header(size_bytes: int, label: str = SWAP_SERIAL, page: int = 4096) -> bytes:
    """The first page of a Linux swap area (version 1, what ``mkswap -L label`` writes)."""
    header = bytearray(page)
    header[1024:1036] = struct.pack("<III", 1, size_bytes // page - 1, 0)
    header[1052:1068] = label.encode()[:16].ljust(16, b"\0")
    header[page - 10:page] = b"SWAPSPACE2"
    return bytes(header)


# ---- ISO 9660 --------------------------------------------------------------------------


def _both16(n: int) -> bytes:
    return struct.pack("<H", n) + struct.pack(">H", n)


def _both32(n: int) -> bytes:
    return struct.pack("<I", n) + struct.pack(">I", n)


def _record_date() -> bytes:
    y, mo, d, h, mi, s = MTIME
    return bytes([y - 1900, mo, d, h, mi, s, 0])


def _volume_date() -> bytes:
    y, mo, d, h, mi, s = MTIME
    return f"{y:04}{mo:02}{d:02}{h:02}{mi:02}{s:02}00".encode() + b"\0"


def _dir_record(name: bytes, extent: int, size: int, directory: bool) -> bytes:
    length = 33 + len(name) + (1 - len(name) % 2)
    return (bytes([length, 0]) + _both32(extent) + _both32(size) + _record_date()
            + bytes([2 if directory else 0, 0, 0]) + _both16(1) + bytes([len(name)]) + name
            + b"\0" * (length - 33 - len(name)))


def iso_name(name: str) -> bytes:
    """A file name as ISO 9660 stores it (``COMMAND.SH;1``); Linux shows it lower-cased
    without the version (mount's default ``map=normal``). At most 30 characters."""
    if not 0 < len(name) <= 30 or "/" in name or name != name.lower() or not name.isascii():
        raise ValueError(f"{name!r} is not a plain lower-case file name of at most 30 bytes")
    return name.upper().encode() + b";1"


def iso9660_image(files: Mapping[str, bytes], label: str = RUNTIME_LABEL) -> bytes:
    """A single-directory ISO 9660 image of ``files`` (no Rock Ridge, no Joliet)."""
    names = sorted(files, key=iso_name)
    records_size = 34 + 34 + sum(len(_dir_record(iso_name(n), 0, 0, False)) for n in names)
    # Records never cross a sector boundary; one sector holds about 50 of these names.
    dir_sectors = max(1, -(-records_size // (SECTOR - 64)))
    root = 20
    next_free = root + dir_sectors
    extents: dict[str, int] = {}
    for name in names:
        extents[name] = next_free
        next_free += max(1, -(-len(files[name]) // SECTOR))
    total = next_free

    directory = bytearray()
    current = bytearray()

    def add(record: bytes) -> None:
        nonlocal current
        if len(current) + len(record) > SECTOR:
            directory.extend(current.ljust(SECTOR, b"\0"))
            current = bytearray()
        current.extend(record)

    dir_size = dir_sectors * SECTOR
    add(_dir_record(b"\0", root, dir_size, True))
    add(_dir_record(b"\1", root, dir_size, True))
    for name in names:
        add(_dir_record(iso_name(name), extents[name], len(files[name]), False))
    directory.extend(current.ljust(SECTOR, b"\0"))
    directory = directory.ljust(dir_size, b"\0")

    path_l = bytes([1, 0]) + struct.pack("<I", root) + struct.pack("<H", 1) + b"\0\0"
    path_m = bytes([1, 0]) + struct.pack(">I", root) + struct.pack(">H", 1) + b"\0\0"
    pvd = bytearray(SECTOR)
    pvd[0:8] = b"\x01CD001\x01\x00"
    pvd[8:40] = b"LINUX".ljust(32)
    pvd[40:72] = label.encode()[:32].ljust(32)
    pvd[80:88] = _both32(total)
    pvd[120:124] = _both16(1)
    pvd[124:128] = _both16(1)
    pvd[128:132] = _both16(SECTOR)
    pvd[132:140] = _both32(10)
    pvd[140:144] = struct.pack("<I", 18)
    pvd[148:152] = struct.pack(">I", 19)
    pvd[156:190] = _dir_record(b"\0", root, dir_size, True)
    for start, end in ((190, 318), (318, 446), (446, 574), (574, 702), (702, 739),
                       (739, 776), (776, 813)):
        pvd[start:end] = b" " * (end - start)
    pvd[813:830] = _volume_date()
    pvd[830:847] = _volume_date()
    pvd[847:864] = b"0" * 16 + b"\0"
    pvd[864:881] = _volume_date()
    pvd[881] = 1
    terminator = bytearray(SECTOR)
    terminator[0:7] = b"\xffCD001\x01"

    out = bytearray(16 * SECTOR)
    out += pvd + terminator
    out += path_l.ljust(SECTOR, b"\0") + path_m.ljust(SECTOR, b"\0")
    out += directory
    for name in names:
        data = files[name]
        out += data + b"\0" * (max(1, -(-len(data) // SECTOR)) * SECTOR - len(data))
    assert len(out) == total * SECTOR
    return bytes(out)
