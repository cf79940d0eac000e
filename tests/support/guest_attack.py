"""A hostile guest's tools: crafted frames for the guest filter's rule, listeners that
greet with a secret, and a real runner whose guest runs a shell script (TCG, the runner's
own kernel, a busybox root disk). Used by ``tests/test_guest_isolation.py``,
``tests/test_guestnet_rights.py`` and (the listeners, ``nc`` commands)
``tests/support/hostile_guest.py``. docs/security.md, "The guest".
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import wait_for

REPO = Path(__file__).resolve().parent.parent.parent


# ---- crafted frames -------------------------------------------------------------------------

SYN, ACK = 0x02, 0x10


def ethernet(ethertype: int, payload: bytes) -> bytes:
    return b"\x52\x55\x0a\x00\x02\x02" + b"\x52\x54\x00\x12\x34\x56" + \
        struct.pack("!H", ethertype) + payload


def ipv4(dst: str, proto: int, payload: bytes, frag: int = 0x4000) -> bytes:
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(payload), 1, frag, 64, proto, 0,
                         ipaddress.IPv4Address("10.0.2.15").packed,
                         ipaddress.IPv4Address(dst).packed)
    return ethernet(0x0800, header + payload)


def ipv6(dst: str, next_header: int, payload: bytes) -> bytes:
    header = struct.pack("!IHBB16s16s", 6 << 28, len(payload), next_header, 64,
                         ipaddress.IPv6Address("fec0::5054:ff:fe12:3456").packed,
                         ipaddress.IPv6Address(dst).packed)
    return ethernet(0x86DD, header + payload)


def tcp(dport: int, flags: int) -> bytes:
    return struct.pack("!HHIIBBHHH", 40000, dport, 1, 0, 5 << 4, flags, 65535, 0, 0)


def udp(dport: int) -> bytes:
    return struct.pack("!HHHH", 40000, dport, 8, 0)


ECHO = b"\x08\x00\x00\x00\x00\x01\x00\x01"


# ---- listeners, and a real guest running a script -------------------------------------


@dataclass
class Listener:
    """A TCP listener that greets each client with a secret, and counts them."""

    sock: socket.socket
    secret: str
    accepted: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])


def listen(host: str, name: str) -> Listener:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(16)
    listener = Listener(sock, f"{name}-{secrets.token_hex(8)}")

    def serve() -> None:
        while True:
            try:
                conn, peer = sock.accept()
            except OSError:
                return
            listener.accepted.append(str(peer[0]))
            with contextlib.suppress(OSError):
                conn.sendall(f"{listener.secret}\n".encode())
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener


def non_loopback_address() -> str | None:
    """This host's address on its default route (no packet is sent), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.123", 9))
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if ipaddress.IPv4Address(address).is_loopback else address


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


NC_TO = "sh -c 'nc -w 4 \"$0\" \"$1\" </dev/null'"
"""Connect and print what the other end says first (QMP greets; so do the listeners)."""
HTTP_TO = "sh -c 'printf \"GET /status HTTP/1.0\\r\\n\\r\\n\" | nc -w 4 \"$0\" \"$1\"'"
"""Ask for the runner's /status."""


def runner_kernel_and_root_disk(tmp_path: Path) -> tuple[Path, Path]:
    """The runner's own kernel directory and a busybox root disk, built under
    ``tmp_path`` (the test is skipped where they cannot be built or QEMU is missing)."""
    from neonvm.dev import guestdisk
    from neonvm.runner import initramfs

    absent = initramfs.missing() + guestdisk.missing()
    if shutil.which("qemu-system-x86_64") is None:
        absent.append("qemu-system-x86_64 (scripts/setup-qemu.sh)")
    if absent:
        pytest.skip("cannot boot a guest here, missing: " + ", ".join(absent))
    kernel = initramfs.build_initramfs(tmp_path / "runner-kernel")
    _raw, root_disk = guestdisk.build_rootfs(tmp_path / "root-disk")
    return kernel.kernel.parent, root_disk


@dataclass
class CommandGuest:
    """A real runner whose guest runs a shell script, then powers off."""

    proc: subprocess.Popen[bytes]
    console_path: Path
    log_path: Path

    def console(self) -> str:
        return self.console_path.read_text(errors="replace")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def finished(self, what: str) -> str:
        """The console once the script echoed ``attack: done`` (or the runner ended)."""
        wait_for(lambda: "attack: done" in self.console() or self.proc.poll() is not None,
                 timeout=600, interval=0.5, what=what)
        text = self.console()
        assert "attack: done" in text, text[-3000:] + self.log()
        return text


@contextmanager
def command_guest(tmp_path: Path, script: str, args: list[str],
                  spec: dict[str, Any] | None = None,
                  env: dict[str, str] | None = None) -> Iterator[CommandGuest]:
    """Start the runner (TCG, its own kernel, a busybox root disk: skipped where they
    cannot be built) with ``args``, its guest running ``script``; ``spec`` is merged into
    the VM spec, ``env`` into the runner's environment (none of the caller's
    ``NEONVM_*``). Stopped (SIGTERM, then SIGKILL) at the end if still running."""
    kernel_dir, root_disk = runner_kernel_and_root_disk(tmp_path)
    vm = {"terminationGracePeriodSeconds": 30, **(spec or {}), "guest": {
        "cpus": {"min": 1, "max": 1}, "memorySlotSize": "256Mi",
        "memorySlots": {"min": 1, "max": 1}, "rootDisk": {"image": str(root_disk)},
        "command": ["/bin/sh", "-c", script]}}
    spec_file = tmp_path / "vm.yaml"
    spec_file.write_text(yaml.safe_dump(vm))
    console_path, log_path = tmp_path / "console.log", tmp_path / "runner.log"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
    with console_path.open("wb") as out, log_path.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "neonvm.runner.main", "--spec-file", str(spec_file),
             "--kernel-dir", str(kernel_dir), "--accel", "tcg",
             "--work-dir", str(tmp_path / "work"), *args],
            stdout=out, stderr=err, env=environ | (env or {}), cwd=REPO)
    guest = CommandGuest(proc, console_path, log_path)
    try:
        yield guest
    finally:
        if guest.proc.poll() is None:
            guest.proc.send_signal(signal.SIGTERM)
            try:
                guest.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                guest.proc.kill()
                guest.proc.wait()
