"""Read a guest's root disk image without mounting it: raw or qcow2, and a path in its ext4.

The runner decides how to boot a bare-ext4 root disk by what it carries: a root that holds
``/neonvm/bin/init`` is a vm-builder image and boots its own init (docs/runner.md, "The
vm-builder boot contract"). Mounting needs privileges a runner pod does not have, and
converting a multi-GiB qcow2 to raw costs minutes, so this module reads the few blocks a
path lookup needs: :class:`ImageReader` gives the guest's bytes at any offset (raw files
directly; qcow2 through its L1/L2 tables, zlib-compressed clusters included; anything
else, such as a backing file or zstd, through ``qemu-img dd``), and :func:`ext4_lookup`
walks directories from the root inode (extents or block maps; ext2/3/4).

Not guaranteed: inline-data directories are not read (mkfs.ext4 does not make them by
default); a lookup that meets one, or anything malformed, raises :class:`ImageError`.
"""

from __future__ import annotations

import struct
import subprocess
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

QCOW2_MAGIC = b"QFI\xfb"
_OFFSET_MASK = 0x00FFFFFFFFFFFE00
_COMPRESSED = 1 << 62
_ZERO_FLAG = 1
EXT_SUPERBLOCK = 1024
EXT_MAGIC = 0xEF53
_INCOMPAT_64BIT = 0x80
_EXTENTS_FL = 0x80000
_INLINE_DATA_FL = 0x10000000
_EXTENT_MAGIC = 0xF30A
S_IFMT, S_IFDIR, S_IFLNK = 0o170000, 0o040000, 0o120000
ROOT_INODE = 2
MAX_SYMLINKS = 8


class ImageError(Exception):
    """The image cannot be read as expected (not ext, malformed, or an unsupported shape)."""


class ImageReader:
    """The guest's view of a disk image: ``read(offset, count)`` in guest bytes."""

    def __init__(self, path: Path, qemu_img: str | None = None) -> None:
        self.path = path
        self.qemu_img = qemu_img
        self._f: BinaryIO = path.open("rb")
        self._l2_cache: dict[int, bytes] = {}
        head = self._f.read(112)
        self.qcow2 = head[:4] == QCOW2_MAGIC
        self._fallback = False
        if self.qcow2:
            version, = struct.unpack(">I", head[4:8])
            backing, = struct.unpack(">Q", head[8:16])
            self.cluster_bits, = struct.unpack(">I", head[20:24])
            encrypted, = struct.unpack(">I", head[32:36])
            self.l1_size, = struct.unpack(">I", head[36:40])
            self.l1_offset, = struct.unpack(">Q", head[40:48])
            incompatible = struct.unpack(">Q", head[72:80])[0] if version >= 3 else 0
            compression = head[104] if version >= 3 and len(head) > 104 and \
                struct.unpack(">I", head[100:104])[0] >= 112 else 0
            # A backing file, encryption, extended L2 entries (bit 4) or zstd (type 1):
            # ask qemu-img rather than reimplement them.
            self._fallback = bool(backing or encrypted or incompatible & 0x10 or compression
                                  or not 9 <= self.cluster_bits <= 21)
            self.cluster_size = 1 << self.cluster_bits

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> ImageReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def read(self, offset: int, count: int) -> bytes:
        """``count`` guest bytes from ``offset`` (zeros past the data of a sparse image)."""
        if not self.qcow2:
            self._f.seek(offset)
            data = self._f.read(count)
            return data + bytes(count - len(data))
        if self._fallback:
            return self._read_with_qemu_img(offset, count)
        out = bytearray()
        while count > 0:
            within = offset & (self.cluster_size - 1)
            take = min(count, self.cluster_size - within)
            out += self._read_cluster_part(offset >> self.cluster_bits, within, take)
            offset += take
            count -= take
        return bytes(out)

    def _l2_entry(self, cluster: int) -> int:
        per_table = self.cluster_size // 8
        l1_index, l2_index = divmod(cluster, per_table)
        if l1_index >= self.l1_size:
            return 0
        self._f.seek(self.l1_offset + 8 * l1_index)
        l2_offset = struct.unpack(">Q", self._f.read(8))[0] & _OFFSET_MASK
        if l2_offset == 0:
            return 0
        table = self._l2_cache.get(l2_offset)
        if table is None:
            self._f.seek(l2_offset)
            table = self._f.read(self.cluster_size)
            self._l2_cache = {l2_offset: table}  # one table: lookups stay local
        return int(struct.unpack(">Q", table[8 * l2_index:8 * l2_index + 8])[0])

    def _read_cluster_part(self, cluster: int, within: int, count: int) -> bytes:
        entry = self._l2_entry(cluster)
        if entry & _COMPRESSED:
            x = 62 - (self.cluster_bits - 8)
            host = entry & ((1 << x) - 1)
            sectors = ((entry >> x) & ((1 << (self.cluster_bits - 8)) - 1)) + 1
            self._f.seek(host)
            raw = self._f.read(sectors * 512 - (host & 511))
            data = zlib.decompressobj(-12).decompress(raw, self.cluster_size)
            return data[within:within + count].ljust(count, b"\0")
        host = entry & _OFFSET_MASK
        if host == 0 or entry & _ZERO_FLAG:
            return bytes(count)
        self._f.seek(host + within)
        data = self._f.read(count)
        return data + bytes(count - len(data))

    def _read_with_qemu_img(self, offset: int, count: int) -> bytes:
        if self.qemu_img is None:
            raise ImageError("qemu-img not found (package qemu-utils): needed to read "
                             f"{self.path}")
        block = 4096
        first, last = offset // block, -(-(offset + count) // block)
        with tempfile.TemporaryDirectory(prefix="neonvm-image-") as scratch:
            out = Path(scratch) / "part.raw"
            result = subprocess.run(
                [self.qemu_img, "dd", "-f", "qcow2", "-O", "raw", f"bs={block}",
                 # QEMU 7.2 counts count= from the image's start when skip= is given
                 # (and refuses a skip past it); later ones count after the skip. Either
                 # way the output starts at block ``first``.
                 f"skip={first}", f"count={last}", f"if={self.path}", f"of={out}"],
                capture_output=True, text=True, check=False)
            if result.returncode != 0:
                lines = result.stderr.strip().splitlines()
                raise ImageError(f"reading {self.path} failed: "
                                 f"{lines[-1] if lines else result.returncode}")
            data = out.read_bytes()
        start = offset - first * block
        return data[start:start + count].ljust(count, b"\0")


@dataclass(frozen=True)
class Inode:
    number: int
    mode: int
    size: int
    flags: int
    block: bytes
    """``i_block``: 60 bytes (extent tree root, block map, or a fast symlink's target)."""

    @property
    def kind(self) -> int:
        return self.mode & S_IFMT


class Ext4:
    """An ext2/3/4 filesystem on an :class:`ImageReader`, read-only, enough to look up paths."""

    def __init__(self, reader: ImageReader) -> None:
        self.reader = reader
        sb = reader.read(EXT_SUPERBLOCK, 1024)
        if struct.unpack("<H", sb[56:58])[0] != EXT_MAGIC:
            raise ImageError("not an ext2/3/4 filesystem")
        self.block_size = 1024 << struct.unpack("<I", sb[24:28])[0]
        self.inodes_per_group, = struct.unpack("<I", sb[40:44])
        self.first_data_block, = struct.unpack("<I", sb[20:24])
        rev, = struct.unpack("<I", sb[76:80])
        self.inode_size = struct.unpack("<H", sb[88:90])[0] if rev >= 1 else 128
        incompat, = struct.unpack("<I", sb[96:100])
        self.desc_size = (struct.unpack("<H", sb[254:256])[0] or 32) \
            if incompat & _INCOMPAT_64BIT else 32
        if self.block_size > 65536 or self.inodes_per_group == 0:
            raise ImageError("implausible ext superblock")

    def _block(self, number: int) -> bytes:
        return self.reader.read(number * self.block_size, self.block_size)

    def inode(self, number: int) -> Inode:
        group, index = divmod(number - 1, self.inodes_per_group)
        table_block = (self.first_data_block + 1) * self.block_size
        desc = self.reader.read(table_block + group * self.desc_size, self.desc_size)
        table = struct.unpack("<I", desc[8:12])[0]
        if self.desc_size >= 64:
            table |= struct.unpack("<I", desc[40:44])[0] << 32
        raw = self.reader.read(table * self.block_size + index * self.inode_size, 128)
        mode, = struct.unpack("<H", raw[0:2])
        size = struct.unpack("<I", raw[4:8])[0] | struct.unpack("<I", raw[108:112])[0] << 32
        flags, = struct.unpack("<I", raw[32:36])
        return Inode(number, mode, size, flags, raw[40:100])

    def _extent_blocks(self, node: bytes, depth_limit: int = 8) -> list[tuple[int, int, int]]:
        """(logical block, physical block, count) of every initialised extent under ``node``."""
        magic, entries, _max, depth = struct.unpack("<HHHH", node[:8])
        if magic != _EXTENT_MAGIC or depth_limit < 0:
            raise ImageError("corrupt extent tree")
        out: list[tuple[int, int, int]] = []
        for i in range(entries):
            e = node[12 + 12 * i:24 + 12 * i]
            if depth == 0:
                logical, length, hi, lo = struct.unpack("<IHHI", e)
                if length <= 32768:  # above: an uninitialised extent, which reads as zeros
                    out.append((logical, hi << 32 | lo, length))
            else:
                _logical, lo, hi = struct.unpack("<IIH", e[:10])
                out += self._extent_blocks(self._block(hi << 32 | lo), depth_limit - 1)
        return out

    def _mapped_blocks(self, ino: Inode) -> list[int | None]:
        """The physical block of each logical block of ``ino`` (None: a hole)."""
        count = -(-ino.size // self.block_size)
        blocks: list[int | None] = [None] * count
        if ino.flags & _INLINE_DATA_FL:
            raise ImageError(f"inode {ino.number} keeps its data inline (not supported)")
        if ino.flags & _EXTENTS_FL:
            for logical, physical, length in self._extent_blocks(ino.block):
                for k in range(length):
                    if logical + k < count:
                        blocks[logical + k] = physical + k
            return blocks
        pointers = struct.unpack("<15I", ino.block)
        per = self.block_size // 4
        flat: list[int] = list(pointers[:12])

        def expand(block: int, level: int) -> list[int]:
            if block == 0:
                return [0] * per ** level
            entries = struct.unpack(f"<{per}I", self._block(block))
            if level == 1:
                return list(entries)
            return [b for entry in entries for b in expand(entry, level - 1)]

        for level, pointer in ((1, pointers[12]), (2, pointers[13]), (3, pointers[14])):
            if len(flat) >= count:
                break
            flat += expand(pointer, level)
        for i in range(count):
            blocks[i] = flat[i] or None
        return blocks

    def read_file(self, ino: Inode) -> bytes:
        """The contents of a regular file, directory or slow symlink."""
        out = bytearray()
        for block in self._mapped_blocks(ino):
            out += self._block(block) if block is not None else bytes(self.block_size)
        return bytes(out[:ino.size])

    def entries(self, directory: Inode) -> dict[str, int]:
        """A directory's names and inode numbers (htree directories read linearly)."""
        data = self.read_file(directory)
        names: dict[str, int] = {}
        for start in range(0, len(data), self.block_size):
            block = data[start:start + self.block_size]
            pos = 0
            while pos + 8 <= len(block):
                number, rec_len, name_len = struct.unpack("<IHB", block[pos:pos + 7])
                if rec_len < 8:
                    break
                if number:
                    names[block[pos + 8:pos + 8 + name_len].decode(errors="replace")] = number
                pos += rec_len
        return names

    def symlink_target(self, ino: Inode) -> str:
        if ino.size < 60 and not ino.flags & (_EXTENTS_FL | _INLINE_DATA_FL):
            return ino.block[:ino.size].decode(errors="replace")
        return self.read_file(ino).decode(errors="replace")


def ext4_lookup(fs: Ext4, path: str) -> Inode | None:
    """The inode at absolute ``path`` (the last component not followed, like ``lstat``);
    None if a component is missing. Symbolic links on the way are followed."""
    parts = [p for p in path.split("/") if p]
    current = fs.inode(ROOT_INODE)
    stack: list[Inode] = []
    followed = 0
    while parts:
        name = parts.pop(0)
        if name == ".":
            continue
        if name == "..":
            current = stack.pop() if stack else fs.inode(ROOT_INODE)
            continue
        if current.kind != S_IFDIR:
            return None
        number = fs.entries(current).get(name)
        if number is None:
            return None
        found = fs.inode(number)
        if found.kind == S_IFLNK and parts:
            followed += 1
            if followed > MAX_SYMLINKS:
                raise ImageError(f"too many symbolic links in {path}")
            target = fs.symlink_target(found)
            if target.startswith("/"):
                current, stack = fs.inode(ROOT_INODE), []
            parts = [p for p in target.split("/") if p] + parts
            continue
        stack.append(current)
        current = found
    return current


def root_has_path(image: Path, path: str, qemu_img: str | None) -> bool:
    """Whether the bare ext filesystem on ``image`` (raw or qcow2) has an entry at ``path``.

    Raises :class:`ImageError` when the image cannot be read that way."""
    with ImageReader(image, qemu_img) as reader:
        return ext4_lookup(Ext4(reader), path) is not None
