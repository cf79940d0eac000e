"""The vm-builder test disk and guest boots under TCG, shared by the boot tests
(tests/test_vmbuilder_boot.py, tests/test_ssh_keys.py). Opt-in: NEONVM_TEST_BOOT=1."""

from __future__ import annotations

import os
import shutil
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from neonvm.dev import guestdisk, vmbuilderdisk
from neonvm.runner import initramfs

REPO = Path(__file__).resolve().parent.parent.parent


def boot_skip_reason() -> str | None:
    if "1" not in (os.environ.get("NEONVM_TEST_BOOT"), os.environ.get("NEONVM_TEST_REAL_NODE")):
        return "real guest boots are opt-in (NEONVM_TEST_BOOT=1; about a minute under TCG)"
    absent = initramfs.missing() + guestdisk.missing()
    if shutil.which("qemu-system-x86_64") is None:
        absent.append("qemu-system-x86_64 (qemu-system-x86)")
    return "missing: " + ", ".join(absent) if absent else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture(scope="module")
def boot_kit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the vm-builder test disk as qcow2, the runner's kernel dir)."""
    root = tmp_path_factory.mktemp("vmbuilder-boot")
    _raw, qcow2 = vmbuilderdisk.build_disk(root / "disk")
    kernel = initramfs.build_initramfs(root / "kernel")
    return qcow2, kernel.kernel.parent
