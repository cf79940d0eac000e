"""The OCI images of ``neonvm dev images`` (neonvm.dev.images): layers and archives are
well-formed and reproducible, cache keys follow the inputs, and the tags everybody names
are the package's version.

The unit tests pack small trees made here. ``test_built_archives_are_well_formed`` checks
the real archives when ``neonvm dev images`` has built them (it skips otherwise); the
real node runs them in tests/test_real_node.py.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest
import yaml

from neonvm.controller import podspec
from neonvm.dev import images

ROOT = Path(__file__).resolve().parent.parent


def _tree(root: Path) -> Path:
    """A small root filesystem: files, a hard link, a symlink, a dir to skip the inside of."""
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "tool").write_bytes(b"#!/bin/sh\necho tool\n")
    (root / "usr" / "bin" / "tool").chmod(0o755)
    os.link(root / "usr" / "bin" / "tool", root / "usr" / "bin" / "tool2")
    (root / "usr" / "bin" / "alias").symlink_to("tool")
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text("neonvm:x:65532:65532::/nonexistent:/bin\n")
    (root / "tmp").mkdir()
    (root / "tmp" / "scratch").write_text("left out")
    (root / "opt" / "neonvm" / "bin").mkdir(parents=True)
    (root / "opt" / "neonvm" / "bin" / "neonvm").write_text("#!/opt/neonvm/bin/python3\n")
    return root


def _members(layer: images.Layer) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(layer.path.read_bytes()))) as tar:
        return {m.name: m for m in tar.getmembers()}


@pytest.mark.unit
def test_layer_is_reproducible_whatever_the_mtimes(tmp_path: Path) -> None:
    root = _tree(tmp_path / "root")
    first = images.layer_from_dir(root, tmp_path / "a.tar.gz")
    # Touching every file later must not change the layer: mtimes are clamped.
    for p in root.rglob("*"):
        os.utime(p, (2_000_000_000, 2_000_000_000), follow_symlinks=False)
    second = images.layer_from_dir(root, tmp_path / "b.tar.gz")
    assert (first.digest, first.diff_id, first.size) == (
        second.digest, second.diff_id, second.size)
    assert first.path.read_bytes() == second.path.read_bytes()
    assert first.digest == "sha256:" + hashlib.sha256(first.path.read_bytes()).hexdigest()
    assert first.diff_id == "sha256:" + hashlib.sha256(
        gzip.decompress(first.path.read_bytes())).hexdigest()
    # A changed file changes the digest.
    (root / "etc" / "passwd").write_text("changed\n")
    assert images.layer_from_dir(root, tmp_path / "c.tar.gz").digest != first.digest


@pytest.mark.unit
def test_layer_entries(tmp_path: Path) -> None:
    root = _tree(tmp_path / "root")
    members = _members(images.layer_from_dir(root, tmp_path / "l.tar.gz"))
    names = list(members)
    assert names == sorted(names, key=lambda n: n.split("/"))  # parents before children
    assert "tmp" in members and "tmp/scratch" not in members
    assert members["usr/bin/alias"].issym() and members["usr/bin/alias"].linkname == "tool"
    assert members["usr/bin/tool"].isfile() and members["usr/bin/tool"].mode == 0o755
    assert members["usr/bin/tool2"].islnk() and members["usr/bin/tool2"].linkname == "usr/bin/tool"
    for m in members.values():
        assert m.mtime <= images.SOURCE_DATE_EPOCH
        assert (m.uname, m.gname) == ("", "")
        assert m.uid == os.getuid()

    # Only a subtree (the app layer): its parent directories come along, nothing else.
    sub = _members(images.layer_from_dir(root, tmp_path / "s.tar.gz", under=("opt/neonvm",)))
    assert list(sub) == ["opt", "opt/neonvm", "opt/neonvm/bin", "opt/neonvm/bin/neonvm"]


@pytest.mark.unit
def test_oci_archive_is_well_formed_and_reproducible(tmp_path: Path) -> None:
    root = _tree(tmp_path / "root")
    base = images.layer_from_dir(root, tmp_path / "base.tar.gz")
    app = images.layer_from_dir(root, tmp_path / "app.tar.gz", under=("opt/neonvm",))
    config = images.image_config(images.RUNNER.config, [base, app])
    ref = images.RUNNER.reference("9.9.9")
    digest = images.oci_archive(tmp_path / "one.tar", ref, config, [base, app])
    again = images.oci_archive(tmp_path / "two.tar", ref, config, [base, app])
    assert digest == again
    assert (tmp_path / "one.tar").read_bytes() == (tmp_path / "two.tar").read_bytes()

    described = images.read_archive(tmp_path / "one.tar")
    assert described["name"] == "ghcr.io/neonvm/neonvm-runner:9.9.9"
    assert described["digest"] == digest
    assert described["layers"] == [base.digest, app.digest]
    cfg = described["config"]
    assert cfg["created"] == "2025-01-01T00:00:00Z"
    assert cfg["config"]["User"] == "65532:65532"
    assert cfg["config"]["Entrypoint"] == ["neonvm-runner"]
    assert "NEONVM_WORK_DIR=/vm/run" in cfg["config"]["Env"]
    with tarfile.open(tmp_path / "one.tar") as tar:
        names = tar.getnames()
        index = json.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
    assert names[:2] == ["blobs", "blobs/sha256"]
    assert {"oci-layout", "index.json"} <= set(names)
    assert index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"] == "9.9.9"

    # A damaged blob is caught.
    data = bytearray((tmp_path / "one.tar").read_bytes())
    at = data.find(b'"User":"65532:65532"')
    data[at + 9] = ord("7")
    with pytest.raises(images.ImageBuildError, match="does not match its digest"):
        images.read_archive(io.BytesIO(bytes(data)))


@pytest.mark.unit
def test_cache_keys_follow_the_inputs(tmp_path: Path) -> None:
    key = images.base_key(images.RUNNER, "mmdebstrap 1.3.5")
    assert key == images.base_key(images.RUNNER, "mmdebstrap 1.3.5")
    assert key != images.base_key(images.RUNNER, "mmdebstrap 1.4.0")
    assert key != images.base_key(images.CONTROLLER, "mmdebstrap 1.3.5")

    src = tmp_path / "src"
    (src / "neonvm" / "__pycache__").mkdir(parents=True)
    (src / "pyproject.toml").write_text('[project]\nname = "neonvm"\nversion = "1.2.3"\n')
    (src / "neonvm" / "__init__.py").write_text("")
    (src / "neonvm" / "x.py").write_text("A = 1\n")
    h = images.source_hash(src)
    (src / "neonvm" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"junk")
    assert images.source_hash(src) == h
    (src / "neonvm" / "x.py").write_text("A = 2\n")
    assert images.source_hash(src) != h
    assert images.package_version(src) == "1.2.3"


@pytest.mark.unit
def test_tags_are_the_package_version() -> None:
    """The chart's image, the runner image the controller puts into pods, and what
    ``neonvm dev images`` builds all carry pyproject.toml's version, never ``latest``."""
    version = images.package_version(ROOT)
    assert images.RUNNER.reference(version) == podspec.DEFAULT_RUNNER_IMAGE
    values = yaml.safe_load((ROOT / "charts/neonvm-controller/values.yaml").read_text())
    assert values["image"]["repository"] == images.CONTROLLER.repository
    assert values["image"]["tag"] == ""  # the chart's appVersion
    chart = yaml.safe_load((ROOT / "charts/neonvm-controller/Chart.yaml").read_text())
    assert chart["appVersion"] == version


@pytest.mark.unit
def test_dockerfiles_describe_the_same_images() -> None:
    """The Dockerfiles document the images: same packages, user, entrypoint, env."""
    for spec in images.SPECS.values():
        text = (ROOT / f"Dockerfile.{spec.name}").read_text()
        assert "FROM debian:bookworm-slim" in text
        for package in spec.packages:
            assert package in text, (spec.name, package)
        assert f"USER {spec.config['User']}" in text
        assert f"ENTRYPOINT {json.dumps(spec.config['Entrypoint'])}" in text
        for env in spec.config["Env"]:
            key, value = env.split("=", 1)
            if key != "PATH":
                assert f"{key}={value}" in text, (spec.name, env)
        assert images.VENV in text


@pytest.mark.unit
def test_built_archives_are_well_formed() -> None:
    """The archives ``neonvm dev images`` wrote, if any: verifiable, named by version."""
    version = images.package_version(ROOT)
    found = 0
    for spec in images.SPECS.values():
        archive = images.images_dir() / "archives" / f"neonvm-{spec.name}-{version}.oci.tar"
        if not archive.is_file():
            continue
        found += 1
        described = images.read_archive(archive)
        assert described["name"] == spec.reference(version)
        assert described["config"]["config"] == spec.config
    if not found:
        pytest.skip("no built archives (run `neonvm dev images`)")


@pytest.mark.unit
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_half_built_entry_is_removed_without_reaching_into_its_mounts(
        tmp_path: Path) -> None:
    """A killed mmdebstrap may leave file systems mounted inside its root: removing the
    cache entry unmounts them first instead of deleting what they show."""
    import subprocess

    entry = tmp_path / "base-x"
    mnt = entry / "rootfs" / "proc"
    mnt.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mnt)], check=True)
    try:
        (mnt / "precious").write_text("not the cache's to delete")
        images._remove(entry)
        assert not entry.exists()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    assert str(mnt) not in Path("/proc/mounts").read_text()


@pytest.mark.unit
def test_two_builds_into_one_cache_take_turns(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A second build waits for the first (they would remove each other's half-built
    cache entries); it says so, and goes on once the first is done."""
    import fcntl
    import threading

    from tests.support import wait_for

    monkeypatch.setenv("NEONVM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(images, "unavailable_reason", lambda: None)
    ran: list[tuple[str, ...]] = []
    monkeypatch.setattr(images, "_build_locked",
                        lambda names, out_dir, progress: ran.append(names) or [])
    said: list[str] = []
    (tmp_path / "images").mkdir()
    with (tmp_path / "images" / ".lock").open("w") as first:
        fcntl.flock(first, fcntl.LOCK_EX)
        second = threading.Thread(target=images.build, args=(("runner",), None, said.append))
        second.start()
        wait_for(lambda: said, timeout=60, interval=0.05, what="the second build to wait")
        assert said == [f"waiting for another build using {tmp_path / 'images'}"]
        assert ran == []
        fcntl.flock(first, fcntl.LOCK_UN)
        second.join(timeout=60)
    assert ran == [("runner",)]
