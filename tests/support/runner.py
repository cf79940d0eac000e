"""The runner as a process: its launch context and spec, the tiny test guest
(``test_guest``) and the ``start_runner`` fixture."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from neonvm.api.schema import decode
from neonvm.api.types import VirtualMachineSpec
from neonvm.runner.qemu import LaunchContext
from tests.guest.build import GuestImage, build_guest, missing
from tests.support import wait_for

REPO = Path(__file__).resolve().parents[2]


def spec_of(data: dict[str, Any]) -> VirtualMachineSpec:
    return decode(VirtualMachineSpec, data, ".spec")


def kernel_spec(**guest: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"kernelImage": "/boot/vmlinuz", "rootDisk": {"image": ""}}
    base.update(guest)
    return {"guest": base}


def context(tmp: Path, **kw: Any) -> LaunchContext:
    defaults: dict[str, Any] = {"qemu_binary": "/usr/bin/qemu-system-x86_64", "accel": "tcg",
                                "work_dir": tmp / "work", "runner_port": 25183,
                                "disks_dir": tmp / "disks", "vm_name": "demo",
                                "vm_namespace": "ns", "ready_marker": "READY"}
    defaults.update(kw)
    return LaunchContext(**defaults)


def option_values(argv: tuple[str, ...], option: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == option]


@pytest.fixture(scope="session")
def test_guest(tmp_path_factory: pytest.TempPathFactory) -> GuestImage:
    """The tiny guest; installs QEMU & co. via scripts/setup-qemu.sh when they are missing."""
    from neonvm.runner.host import optional_binary

    said = ""
    if optional_binary("qemu-system-x86_64") is None or missing():
        setup = subprocess.run(["bash", str(REPO / "scripts" / "setup-qemu.sh")],
                               capture_output=True, text=True, timeout=900, check=False)
        said = (setup.stderr.strip().splitlines() or [""])[-1]
        if setup.returncode != 0:
            pytest.skip(f"QEMU is not installable here: scripts/setup-qemu.sh failed: {said}")
    if optional_binary("qemu-system-x86_64") is None:
        pytest.skip(f"qemu-system-x86_64 is not installed; scripts/setup-qemu.sh: {said}")
    absent = missing()
    if absent:
        pytest.skip(f"cannot build the test guest, missing: {', '.join(absent)}; "
                    f"scripts/setup-qemu.sh: {said}")
    return build_guest(tmp_path_factory.mktemp("guest"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunningRunner:
    """A ``neonvm-runner`` process under test, talking to it as the kubelet would."""

    proc: subprocess.Popen[bytes]
    port: int
    console_path: Path
    log_path: Path
    termination_log: Path
    work_dir: Path
    qemu_pids: set[int] = field(default_factory=set)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, ""

    def status(self) -> dict[str, Any] | None:
        code, body = self.get("/status")
        if code != 200:
            return None
        snap: dict[str, Any] = json.loads(body)
        if snap.get("qemuPid"):
            self.qemu_pids.add(int(snap["qemuPid"]))
        return snap

    def wait_ready(self, timeout: float = 240) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"runner exited {self.proc.returncode}: {self.log()}")
            return self.status() if self.get("/ready")[0] == 200 else None
        return wait_for(ready, timeout=timeout, interval=0.2, what="the guest to be ready")

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def console(self) -> str:
        return self.console_path.read_text(errors="replace")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for pid in self.qemu_pids:  # QEMU has pdeathsig, but never leave one behind
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue  # gone
            if str(self.work_dir).encode() in cmdline:  # ours, not a reused pid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def start_runner(tmp_path: Path, test_guest: GuestImage) -> Iterator[Any]:
    """Start runners for a spec (guest fields merged into a 1-vCPU, 128 MiB tiny guest)."""
    started: list[RunningRunner] = []

    def start(mode: str = "powerdown", grace: int = 60, extra_args: list[str] | None = None,
              spec_overrides: dict[str, Any] | None = None,
              extra_env: dict[str, str] | None = None) -> RunningRunner:
        spec: dict[str, Any] = {
            "terminationGracePeriodSeconds": grace,
            "guest": {
                "cpus": {"min": 1, "max": 1},
                "memorySlotSize": "128Mi",
                "memorySlots": {"min": 1, "max": 1},
                "rootDisk": {"image": ""},
                "kernelImage": str(test_guest.kernel),
                "initrdImage": str(test_guest.initrd),
                "appendKernelCmdline": f"quiet neonvm.test={mode}",
            },
        }
        for key, value in (spec_overrides or {}).items():
            if key == "guest":
                spec["guest"].update(value)
            else:
                spec[key] = value
        n = len(started)
        port = free_port()
        termination_log = tmp_path / f"termination-log-{n}"
        termination_log.write_text("")
        console_path, log_path = tmp_path / f"console-{n}.log", tmp_path / f"runner-{n}.log"
        spec_file = tmp_path / f"spec-{n}.json"  # a file, as the runner pod mounts it
        spec_file.write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
        env.update({"NEONVM_SPEC_FILE": str(spec_file), "NEONVM_VM_NAME": f"guest{n}",
                    "NEONVM_VM_NAMESPACE": "tests", **(extra_env or {})})
        work_dir = tmp_path / f"work{n}"
        args = [sys.executable, "-m", "neonvm.runner.main", "--port", str(port),
                "--listen-address", "127.0.0.1", "--work-dir", str(work_dir),
                "--disks-dir", str(tmp_path / "disks"),
                "--termination-log", str(termination_log), *(extra_args or [])]
        with console_path.open("wb") as out, log_path.open("wb") as err:
            proc = subprocess.Popen(args, env=env, stdout=out, stderr=err, cwd=REPO)
        runner = RunningRunner(proc, port, console_path, log_path, termination_log, work_dir)
        started.append(runner)
        return runner

    yield start
    for runner in started:
        runner.cleanup()
