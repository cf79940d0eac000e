"""The controller and runner OCI images, built on this machine without a Docker engine.

Each image is two layers:

1. **base**: a Debian bookworm root filesystem made by ``mmdebstrap --variant=minbase``
   with only the packages the image's Dockerfile installs (no recommends; docs, man
   pages and locales left out as in ``debian:bookworm-slim``), plus the non-root user
   65532 and the image's directories.
2. **app**: ``/opt/neonvm``, a virtualenv holding the neonvm package (a wheel built from
   these sources) and its dependencies (wheels from PyPI), byte-compiled with
   hash-based ``.pyc`` files so that nothing is written at run time.

The layers are packed by :func:`layer_from_dir` (sorted entries, numeric owners, mtimes
clamped to :data:`SOURCE_DATE_EPOCH`, a gzip header without name or time), so the same
root filesystem always gives the same layer digest, and :func:`oci_archive` writes an OCI
image layout as one tar that ``ctr images import`` reads (the image's name is in the
``io.containerd.image.name`` annotation, as ``neonvm.dev.realnode`` does).

Everything is cached under ``~/.cache/neonvm/images`` (``NEONVM_CACHE_DIR``), keyed on the
inputs: the base on the Debian suite, sources, package list, dpkg filters, set-up script
and mmdebstrap's version; the wheels on a hash of the neonvm sources; the app layer on
both. Rebuilding unchanged sources only re-reads the cached layers' metadata.

The Dockerfiles at the repository's root describe the same images for a Docker engine;
docs/images.md tells how the two correspond.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from neonvm.dev import binaries

SOURCE_DATE_EPOCH = 1735689600
"""2025-01-01T00:00:00Z: every file's mtime is clamped to this, and images say they were
created then (a build time would make each build's digest differ)."""
SUITE = "bookworm"
DEBIAN_SOURCES = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
DPKG_FILTERS = (
    # What debian:bookworm-slim leaves out (its /etc/dpkg/dpkg.cfg.d/docker), kept in the
    # image so that later installs leave them out too.
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/groff/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/lintian/*",
    "path-exclude=/usr/share/linda/*",
    "path-exclude=/usr/share/locale/*",
)
USER_ID = 65532
VENV = "/opt/neonvm"
REGISTRY = "ghcr.io/neonvm"
LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
FORMAT = 1
"""Bumped when the way layers or images are made changes (part of every cache key)."""
SKIP_IN_LAYER = ("dev/", "proc/", "sys/", "run/", "tmp/", "var/tmp/")
"""Directories whose contents stay out of a layer (the directories themselves stay)."""


class ImageBuildError(RuntimeError):
    """An image cannot be built; the message says which step failed and why."""


@dataclass(frozen=True)
class ImageSpec:
    """One image: its packages, directories and run-time configuration."""

    name: str
    """Short name: ``controller`` or ``runner``."""
    packages: tuple[str, ...]
    config: dict[str, Any]
    """The OCI image config's ``config`` (User, Env, Entrypoint, Cmd, ...)."""
    owned_dirs: tuple[str, ...] = ()
    """Directories made in the base and owned by the user (writable at run time)."""
    kernel: bool = False
    """Carries the runner's guest kernel and initramfs in ``/vm/kernel`` (a third layer)."""

    @property
    def repository(self) -> str:
        return f"{REGISTRY}/neonvm-{self.name}"

    def reference(self, version: str) -> str:
        return f"{self.repository}:{version}"


_ENV = ("PYTHONUNBUFFERED=1", "PYTHONDONTWRITEBYTECODE=1")
_PATH = f"PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

CONTROLLER = ImageSpec(
    name="controller",
    packages=("python3", "python3-venv", "ca-certificates"),
    config={
        "User": f"{USER_ID}:{USER_ID}",
        "Env": [_PATH, *_ENV],
        "Entrypoint": ["neonvm"],
        "Cmd": ["controller", "run"],
        "WorkingDir": "/",
    },
)
RUNNER = ImageSpec(
    name="runner",
    # qemu-system-x86: the emulator (seabios and option ROMs come as dependencies);
    # qemu-utils: qemu-img; e2fsprogs: mkfs.ext4; util-linux (essential): setpriv.
    packages=("qemu-system-x86", "qemu-utils", "e2fsprogs", "python3", "python3-venv",
              "ca-certificates"),
    config={
        "User": f"{USER_ID}:{USER_ID}",
        "Env": [_PATH, *_ENV, "NEONVM_WORK_DIR=/vm/run", "NEONVM_DISKS_DIR=/vm/disks",
                "NEONVM_KERNEL_DIR=/vm/kernel"],
        "Entrypoint": ["neonvm-runner"],
        "WorkingDir": "/vm",
        "ExposedPorts": {"25183/tcp": {}},
        "StopSignal": "SIGTERM",
    },
    owned_dirs=("/vm/run", "/vm/disks"),
    kernel=True,
)
SPECS = {s.name: s for s in (CONTROLLER, RUNNER)}


# ---- sources and versions -------------------------------------------------------------------


def source_root() -> Path:
    """The repository holding the neonvm sources (pyproject.toml beside the package)."""
    import neonvm

    root = Path(neonvm.__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file():
        raise ImageBuildError(f"no pyproject.toml in {root}: images are built from a "
                              "source checkout (pip install -e .)")
    return root


def package_version(root: Path) -> str:
    """The version in pyproject.toml: the images' tag."""
    return str(tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"])


def source_files(root: Path) -> list[Path]:
    """What goes into the neonvm wheel (and so into its hash), relative to ``root``."""
    files = [Path(p) for p in ("pyproject.toml", "setup.cfg", "README.md")
             if (root / p).is_file()]
    for path in sorted((root / "neonvm").rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and "__pycache__" not in rel.parts and path.suffix != ".pyc":
            files.append(rel)
    return files


def source_hash(root: Path) -> str:
    h = hashlib.sha256()
    for rel in source_files(root):
        data = (root / rel).read_bytes()
        h.update(f"{rel.as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def mmdebstrap_version() -> str:
    if shutil.which("mmdebstrap") is None:
        raise ImageBuildError("mmdebstrap is not installed (apt-get install mmdebstrap)")
    out = subprocess.run(["mmdebstrap", "--version"], capture_output=True, text=True)
    return out.stdout.strip()


def _key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def base_setup_script(spec: ImageSpec) -> str:
    """The commands run in the new root (mmdebstrap customize hook): user and dirs."""
    lines = [
        f"groupadd --system --gid {USER_ID} neonvm",
        f"useradd --system --uid {USER_ID} --gid {USER_ID} --home-dir /nonexistent "
        "--no-create-home --shell /usr/sbin/nologin neonvm",
    ]
    for d in spec.owned_dirs:
        lines += [f"mkdir -p {d}", f"chown {USER_ID}:{USER_ID} {d}"]
    # apt leaves these owned by root or by _apt depending on how it ran: one owner, so
    # that two builds of the same base give the same layer.
    lines.append("chown _apt:root /var/cache/apt/archives/partial /var/lib/apt/lists/partial")
    return "\n".join(lines)


def base_key(spec: ImageSpec, mmdebstrap: str) -> str:
    return _key({"format": FORMAT, "suite": SUITE, "sources": DEBIAN_SOURCES,
                 "packages": sorted(spec.packages), "dpkg": DPKG_FILTERS,
                 "setup": base_setup_script(spec), "mmdebstrap": mmdebstrap,
                 "epoch": SOURCE_DATE_EPOCH})


APP_SCRIPT = f"""set -eu
/usr/bin/python3 -m venv {VENV}
{VENV}/bin/pip install --quiet --no-index --no-cache-dir --disable-pip-version-check \\
    --no-compile --find-links /mnt neonvm
# pip and setuptools are not needed at run time (nothing is installed into a running image).
{VENV}/bin/pip uninstall --quiet --yes --disable-pip-version-check pip setuptools
# kubernetes>=37 ships an asyncio copy of its whole client (kubernetes/aio, about 68 MB
# with its .pyc files) that neonvm never imports.
rm -rf {VENV}/lib/python3.11/site-packages/kubernetes/aio
# Hash-based .pyc files: no mtimes inside, valid whatever the files' mtimes, and the root
# file system is read-only at run time, so Python could not write them then.
{VENV}/bin/python3 -m compileall -q -j 1 --invalidation-mode unchecked-hash {VENV}/lib
"""


# ---- layers -----------------------------------------------------------------------------------


class _Hashing:
    """A write-only file that hashes what passes through to ``inner`` (or nowhere)."""

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        if self.inner is not None:
            self.inner.write(data)
        return len(data)

    def flush(self) -> None:
        if self.inner is not None:
            self.inner.flush()


@dataclass(frozen=True)
class Layer:
    path: Path
    """The gzip-compressed layer tar."""
    digest: str
    """sha256 of the compressed blob."""
    diff_id: str
    """sha256 of the uncompressed tar."""
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "digest": self.digest, "diff_id": self.diff_id,
                "size": self.size}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Layer:
        return Layer(Path(data["path"]), data["digest"], data["diff_id"], data["size"])


def _walk(root: Path, under: tuple[str, ...]) -> Iterator[tuple[str, Path]]:
    """(name in the layer, path) for every entry, parents first, in sorted order."""
    for top in under:
        start = root / top if top else root
        parts = Path(top).parts
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            yield parent, root / parent
        if top:
            yield top, start
        if start.is_dir() and not start.is_symlink():
            yield from _walk_dir(root, start)


def _walk_dir(root: Path, directory: Path) -> Iterator[tuple[str, Path]]:
    for entry in sorted(os.listdir(directory)):
        path = directory / entry
        name = path.relative_to(root).as_posix()
        yield name, path
        if (path.is_dir() and not path.is_symlink()
                and not any(name + "/" == s for s in SKIP_IN_LAYER)):
            yield from _walk_dir(root, path)


def _tarinfo(name: str, path: Path, epoch: int,
             links: dict[tuple[int, int], str]) -> tuple[tarfile.TarInfo, Path | None]:
    st = os.lstat(path)
    info = tarfile.TarInfo(name)
    info.uid, info.gid, info.uname, info.gname = st.st_uid, st.st_gid, "", ""
    info.mode = stat.S_IMODE(st.st_mode)
    info.mtime = min(int(st.st_mtime), epoch)
    if stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
    elif stat.S_ISLNK(st.st_mode):
        info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
    elif stat.S_ISREG(st.st_mode):
        if st.st_nlink > 1:
            first = links.setdefault((st.st_dev, st.st_ino), name)
            if first != name:
                info.type, info.linkname = tarfile.LNKTYPE, first
                return info, None
        info.size = st.st_size
        return info, path
    elif stat.S_ISFIFO(st.st_mode):
        info.type = tarfile.FIFOTYPE
    else:
        raise ImageBuildError(f"{path}: a device or socket cannot go into an image layer")
    return info, None


def layer_from_dir(root: Path, out: Path, under: tuple[str, ...] = ("",),
                   epoch: int = SOURCE_DATE_EPOCH) -> Layer:
    """Pack ``root`` (or only the subtrees ``under``) into a gzip layer tar at ``out``.

    Reproducible: entries sorted, owners numeric without names, mtimes clamped to
    ``epoch``, no gzip name or time. The contents of :data:`SKIP_IN_LAYER` stay out.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    links: dict[tuple[int, int], str] = {}
    seen: set[str] = set()
    with partial.open("wb") as f:
        compressed = _Hashing(f)
        with gzip.GzipFile(filename="", fileobj=compressed, mode="wb", mtime=0,
                           compresslevel=6) as gz:
            uncompressed = _Hashing(gz)
            with tarfile.open(fileobj=uncompressed, mode="w|",  # type: ignore[call-overload]
                              format=tarfile.PAX_FORMAT) as tar:
                for name, path in _walk(root, under):
                    if not name or name in seen:
                        continue
                    seen.add(name)
                    info, content = _tarinfo(name, path, epoch, links)
                    if content is None:
                        tar.addfile(info)
                    else:
                        with content.open("rb") as data:
                            tar.addfile(info, data)
    partial.rename(out)
    return Layer(out, "sha256:" + compressed.sha.hexdigest(),
                 "sha256:" + uncompressed.sha.hexdigest(), compressed.size)


# ---- images -----------------------------------------------------------------------------------


def _blob(data: bytes, media_type: str) -> tuple[dict[str, Any], bytes]:
    return ({"mediaType": media_type, "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
             "size": len(data)}, data)


def image_config(config: dict[str, Any], layers: list[Layer],
                 epoch: int = SOURCE_DATE_EPOCH) -> dict[str, Any]:
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
    return {
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
    }


def oci_archive(out: Path, reference: str, config: dict[str, Any],
                layers: list[Layer]) -> str:
    """Write an OCI image layout holding one image as a tar at ``out``; its manifest digest.

    The image is named ``reference`` (``io.containerd.image.name``, for ``ctr images
    import``) and tagged with its tag (``org.opencontainers.image.ref.name``).
    """
    config_desc, config_bytes = _blob(
        json.dumps(config, sort_keys=True, separators=(",", ":")).encode(), CONFIG_MEDIA_TYPE)
    manifest = {
        "schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE, "config": config_desc,
        "layers": [{"mediaType": LAYER_MEDIA_TYPE, "digest": layer.digest, "size": layer.size}
                   for layer in layers],
    }
    manifest_desc, manifest_bytes = _blob(
        json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode(),
        MANIFEST_MEDIA_TYPE)
    index = {
        "schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE,
        "manifests": [{**manifest_desc,
                       "platform": {"architecture": "amd64", "os": "linux"},
                       "annotations": {"io.containerd.image.name": reference,
                                       "org.opencontainers.image.ref.name":
                                           reference.rsplit(":", 1)[1]}}],
    }
    small = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index, sort_keys=True, separators=(",", ":")).encode(),
        f"blobs/sha256/{config_desc['digest'][7:]}": config_bytes,
        f"blobs/sha256/{manifest_desc['digest'][7:]}": manifest_bytes,
    }
    files: dict[str, bytes | Path] = {**small}
    for layer in layers:
        files[f"blobs/sha256/{layer.digest[7:]}"] = layer.path
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with tarfile.open(partial, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, SOURCE_DATE_EPOCH
            tar.addfile(info)
        for name, content in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.mode, info.mtime = 0o644, SOURCE_DATE_EPOCH
            if isinstance(content, Path):
                info.size = content.stat().st_size
                with content.open("rb") as data:
                    tar.addfile(info, data)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    partial.rename(out)
    return str(manifest_desc["digest"])


def read_archive(archive: Path | BinaryIO) -> dict[str, Any]:
    """Check an OCI archive written by :func:`oci_archive` and describe it.

    Every blob's digest and size must match its descriptor and every layer's uncompressed
    digest its ``diff_id``; returns name, manifest digest, config and layer digests.
    """
    with (tarfile.open(archive) if isinstance(archive, Path)
          else tarfile.open(fileobj=archive)) as tar:
        def read(name: str) -> bytes:
            f = tar.extractfile(name)
            if f is None:
                raise ImageBuildError(f"{name} is not a file in the archive")
            return f.read()

        def blob(desc: dict[str, Any]) -> bytes:
            data = read(f"blobs/sha256/{desc['digest'][7:]}")
            if "sha256:" + hashlib.sha256(data).hexdigest() != desc["digest"]:
                raise ImageBuildError(f"blob {desc['digest']} does not match its digest")
            if len(data) != desc["size"]:
                raise ImageBuildError(f"blob {desc['digest']} has the wrong size")
            return data

        layout = json.loads(read("oci-layout"))
        if layout != {"imageLayoutVersion": "1.0.0"}:
            raise ImageBuildError(f"oci-layout: {layout}")
        index = json.loads(read("index.json"))
        [entry] = index["manifests"]
        manifest = json.loads(blob(entry))
        config = json.loads(blob(manifest["config"]))
        diff_ids = []
        for desc in manifest["layers"]:
            diff_ids.append("sha256:" + hashlib.sha256(gzip.decompress(blob(desc))).hexdigest())
        if diff_ids != config["rootfs"]["diff_ids"]:
            raise ImageBuildError("the layers' uncompressed digests are not the diff_ids")
        return {"name": entry["annotations"]["io.containerd.image.name"],
                "digest": entry["digest"], "config": config,
                "layers": [d["digest"] for d in manifest["layers"]]}


# ---- building -------------------------------------------------------------------------------


def images_dir() -> Path:
    return binaries.cache_root() / "images"


@dataclass
class BuiltImage:
    name: str
    reference: str
    archive: Path
    digest: str
    size: int
    """Bytes of the archive (the compressed layers plus a few KiB of metadata)."""
    unpacked: int
    """Bytes of the uncompressed layers."""
    seconds: float
    cached: list[str] = field(default_factory=list)
    """The steps whose result came from the cache."""

    def row(self) -> dict[str, Any]:
        image, tag = self.reference.rsplit(":", 1)
        return {"image": image, "tag": tag, "archive": str(self.archive),
                "size": _human(self.size), "unpacked": _human(self.unpacked),
                "digest": self.digest[:19], "seconds": round(self.seconds, 1),
                "cached": ",".join(self.cached) or "-"}


def _human(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _remove(d: Path) -> None:
    """Remove a half-built cache entry. A killed mmdebstrap may leave /proc, /sys or
    /dev mounted in its root: unmount whatever is mounted under ``d`` first, so that
    removing files never reaches into a mounted file system."""
    prefix = f"{d.resolve()}/"
    mounts = [line.split()[1].replace("\\040", " ")
              for line in Path("/proc/mounts").read_text().splitlines()]
    for m in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True)
    still = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
             if line.split()[1].startswith(prefix)]
    if still:
        raise ImageBuildError(f"cannot remove {d}: still mounted: {', '.join(still)}")
    shutil.rmtree(d)


def _run(argv: list[str], what: str, **kw: Any) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise ImageBuildError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def build_base(spec: ImageSpec, progress: Callable[[str], None]) -> tuple[Path, Layer, bool]:
    """The Debian root filesystem and its layer (cached); whether it came from the cache."""
    key = base_key(spec, mmdebstrap_version())
    d = images_dir() / f"base-{spec.name}-{key}"
    meta = d / "layer.json"
    if meta.is_file():
        return d / "rootfs", Layer.from_json(json.loads(meta.read_text())), True
    if d.exists():
        _remove(d)
    d.mkdir(parents=True)
    rootfs = d / "rootfs"
    progress(f"{spec.name}: mmdebstrap {SUITE} minbase + {' '.join(spec.packages)}")
    started = time.monotonic()
    hook = base_setup_script(spec).replace("\n", " && ")
    argv = ["mmdebstrap", "--variant=minbase", "--mode=root", "--quiet",
            f"--include={','.join(spec.packages)}",
            *(f"--dpkgopt={f}" for f in DPKG_FILTERS),
            f'--customize-hook=chroot "$1" sh -c "{hook}"',
            SUITE, str(rootfs), *DEBIAN_SOURCES]
    _run(argv, "mmdebstrap", env={**os.environ, "SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH)})
    progress(f"{spec.name}: root filesystem in {time.monotonic() - started:.0f}s; packing")
    packages = subprocess.run(
        ["chroot", str(rootfs), "dpkg-query", "-W", "-f", "${Package} ${Version}\n"],
        capture_output=True, text=True, check=True).stdout
    (d / "packages.txt").write_text(packages)
    layer = layer_from_dir(rootfs, d / "layer.tar.gz")
    meta.write_text(json.dumps(layer.to_json(), indent=2))
    return rootfs, layer, False


def build_wheels(root: Path, progress: Callable[[str], None]) -> tuple[Path, bool]:
    """The neonvm wheel (from a copy of the sources) and every dependency's wheel."""
    digest = source_hash(root)[:16]
    d = images_dir() / f"wheels-{digest}"
    done = d / "wheels.txt"
    if done.is_file():
        return d / "wheels", True
    if d.exists():
        _remove(d)
    src = d / "src"
    for rel in source_files(root):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, src / rel)
    progress(f"wheels: neonvm {package_version(root)} (sources {digest}) and dependencies")
    _run([os.environ.get("NEONVM_IMAGES_PYTHON", _python()), "-m", "pip", "wheel",
          "--quiet", "--disable-pip-version-check", "--no-cache-dir",
          "--wheel-dir", str(d / "wheels"), str(src)], "pip wheel",
         env={**os.environ, "SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH)})
    shutil.rmtree(src)
    done.write_text("\n".join(sorted(p.name for p in (d / "wheels").iterdir())) + "\n")
    return d / "wheels", False


def _python() -> str:
    import sys

    return sys.executable


def python_packages(rootfs: Path) -> list[str]:
    """The base's Python packages and versions (``dpkg-query`` lines): all the venv
    depends on, so images whose bases have the same ones share one app layer."""
    listing = (rootfs.parent / "packages.txt").read_text().splitlines()
    return sorted(line for line in listing
                  if line.split()[0].startswith(("python3", "libpython3")))


def build_app(spec: ImageSpec, rootfs: Path, wheels: Path, wheels_key: str,
              progress: Callable[[str], None]) -> tuple[Layer, bool]:
    """The /opt/neonvm layer: a venv made inside the base (through an overlay mount).

    Keyed on the base's Python packages, not on the whole base: the controller and the
    runner get the same layer (containerd stores it once)."""
    key = _key({"format": FORMAT, "python": python_packages(rootfs), "wheels": wheels_key,
                "script": APP_SCRIPT})
    d = images_dir() / f"app-{key}"
    meta = d / "layer.json"
    if meta.is_file():
        return Layer.from_json(json.loads(meta.read_text())), True
    if d.exists():
        _remove(d)
    for sub in ("upper", "work", "merged"):
        (d / sub).mkdir(parents=True)
    progress(f"{spec.name}: venv {VENV} with neonvm and its dependencies")
    # A private mount namespace: the overlay and bind mounts go away with the process,
    # whatever happens to it.
    script = f"""set -eu
mount -t overlay overlay -o lowerdir={rootfs},upperdir={d / 'upper'},workdir={d / 'work'} \\
    {d / 'merged'}
mount --bind {wheels} {d / 'merged'}/mnt
mount -t proc proc {d / 'merged'}/proc
exec chroot {d / 'merged'} /bin/sh -c {_sh_quote(APP_SCRIPT)}
"""
    _run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
         f"{spec.name}: installing neonvm into {VENV}",
         env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SOURCE_DATE_EPOCH":
              str(SOURCE_DATE_EPOCH), "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/nonexistent"})
    layer = layer_from_dir(d / "upper", d / "layer.tar.gz", under=(VENV.lstrip("/"),))
    shutil.rmtree(d / "work", ignore_errors=True)
    meta.write_text(json.dumps(layer.to_json(), indent=2))
    return layer, False


KERNEL_DIR = "vm/kernel"


def build_kernel(progress: Callable[[str], None]) -> tuple[Layer, bool]:
    """The ``/vm/kernel`` layer: the host's Debian cloud kernel and the runner's initramfs
    (:mod:`neonvm.runner.initramfs`), keyed on the kernel, its modules list, busybox, the
    init and scaling scripts and the builder."""
    from neonvm.runner import initramfs

    kernel = initramfs.find_kernel()
    absent = initramfs.missing()
    if kernel is None or absent:
        raise ImageBuildError("the runner's kernel layer needs " + ", ".join(absent))
    version = kernel.name.removeprefix("vmlinuz-")
    dep = Path("/lib/modules") / version / "modules.dep"
    digest = hashlib.sha256()
    for path in (kernel, dep, initramfs.BUSYBOX, initramfs.INIT_SCRIPT,
                 initramfs.SCALING_SCRIPT, Path(initramfs.__file__)):
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes() if path.is_file() else b"")
    key = _key({"format": FORMAT, "inputs": digest.hexdigest()})
    d = images_dir() / f"kernel-{key}"
    meta = d / "layer.json"
    if meta.is_file():
        return Layer.from_json(json.loads(meta.read_text())), True
    if d.exists():
        _remove(d)
    progress(f"runner: guest kernel {version} and the runner's initramfs")
    target = d / "rootfs" / KERNEL_DIR
    initramfs.build_initramfs(target, kernel)
    for parent in (target, target.parent):
        parent.chmod(0o755)
        os.utime(parent, (SOURCE_DATE_EPOCH, SOURCE_DATE_EPOCH))
    layer = layer_from_dir(d / "rootfs", d / "layer.tar.gz", under=(KERNEL_DIR,))
    meta.write_text(json.dumps(layer.to_json(), indent=2))
    return layer, False


def _sh_quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def _unpacked_size(layer: Layer) -> int:
    meta = layer.path.with_name("unpacked")
    if meta.is_file():
        return int(meta.read_text())
    counter = _Hashing()
    with gzip.open(layer.path) as f:
        while chunk := f.read(1 << 20):
            counter.write(chunk)
    meta.write_text(str(counter.size))
    return counter.size


def build(names: tuple[str, ...] = ("controller", "runner"), out_dir: Path | None = None,
          progress: Callable[[str], None] = lambda _m: None) -> list[BuiltImage]:
    """Build (or find in the cache) the named images and write one OCI archive each."""
    unavailable = unavailable_reason()
    if unavailable:
        raise ImageBuildError(f"images cannot be built here: {unavailable}")
    images_dir().mkdir(parents=True, exist_ok=True)
    with (images_dir() / ".lock").open("w") as lock:
        # Two builds into one cache would remove each other's half-built entries.
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another build using {images_dir()}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_locked(names, out_dir, progress)


def _build_locked(names: tuple[str, ...], out_dir: Path | None,
                  progress: Callable[[str], None]) -> list[BuiltImage]:
    root = source_root()
    version = package_version(root)
    out_dir = out_dir or images_dir() / "archives"
    wheels_started = time.monotonic()
    wheels, wheels_cached = build_wheels(root, progress)
    wheels_seconds = time.monotonic() - wheels_started
    built: list[BuiltImage] = []
    for name in names:
        spec = SPECS[name]
        started = time.monotonic()
        rootfs, base, base_cached = build_base(spec, progress)
        app, app_cached = build_app(spec, rootfs, wheels, wheels.parent.name, progress)
        layers = [base, app]
        kernel_cached = True
        if spec.kernel:
            kernel_layer, kernel_cached = build_kernel(progress)
            layers = [base, kernel_layer, app]
        reference = spec.reference(version)
        archive = out_dir / f"neonvm-{name}-{version}.oci.tar"
        config = image_config(spec.config, layers)
        stamp = archive.with_name(archive.name + ".json")
        want = {"reference": reference, "layers": [x.digest for x in layers],
                "config": config}
        if archive.is_file() and stamp.is_file() and \
                json.loads(stamp.read_text()).get("input") == want:
            digest = json.loads(stamp.read_text())["digest"]
            archive_cached = True
        else:
            digest = oci_archive(archive, reference, config, layers)
            stamp.write_text(json.dumps({"input": want, "digest": digest}, indent=2))
            archive_cached = False
        cached = [step for step, hit in (("wheels", wheels_cached), ("base", base_cached),
                                         ("kernel", spec.kernel and kernel_cached),
                                         ("app", app_cached), ("archive", archive_cached))
                  if hit]
        image = BuiltImage(name, reference, archive, digest, archive.stat().st_size,
                           sum(_unpacked_size(x) for x in layers),
                           time.monotonic() - started + (wheels_seconds if not built else 0),
                           cached)
        progress(f"{name}: {reference} {_human(image.size)} -> {archive}")
        built.append(image)
    return built


def unavailable_reason() -> str | None:
    """Why images cannot be built on this host (one line), or None."""
    if os.geteuid() != 0:
        return "mmdebstrap's root mode, chroot and overlay mounts need root"
    for tool, package in (("mmdebstrap", "mmdebstrap"), ("unshare", "util-linux"),
                          ("chroot", "coreutils")):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (apt-get install {package})"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlay filesystem"
    return None


def as_rows(images: list[BuiltImage]) -> list[dict[str, Any]]:
    return [i.row() for i in images]
