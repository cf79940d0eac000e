"""Live scaling latency: ``PUT /scale`` sent -> the guest reports the new size.

    python -m benchmarks.bench_scaling            # 20 runs of each measure
    python -m benchmarks.bench_scaling --runs 5   # quicker

Opt-in (not part of ``python -m benchmarks``): it boots the runner tests' guest
(tests/guest/: the installed cloud kernel and a busybox initramfs) under real QEMU, KVM if
usable, else TCG. It needs what those tests need (``scripts/setup-qemu.sh``).

The clock stops when the guest's own report line (``neonvm-guest-size: cpus=N ...
memtotal-kb=K``, written by its hotplug agent to the serial console) shows the target;
each console line is timestamped as the runner forwards it to this process's pipe. So
each figure is: HTTP request, fence check and fsync, QMP or agent command, guest kernel
(ACPI, onlining), guest report. Measures:

* CPU hot-add (QmpScaling): one guest with ``1 + runs`` vCPU slots, one more vCPU per
  run (QMP removal of a vCPU is not measured: it crashes QEMU 7.2 under TCG).
* CPU online / offline (SysfsScaling): 1 -> 2 -> 1 online vCPUs, ``runs`` times.
* Memory plug / unplug (QmpScaling): 1 -> 2 -> 1 GiB (a 1 GiB DIMM), ``runs`` times.

Prints p50/p99 (nearest rank) with min/max. Wall-clock figures on a shared machine
depend on its load; the load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neonvm.dev.cluster import free_port  # noqa: E402
from neonvm.drills.observer import percentile  # noqa: E402
from tests.guest.build import GuestImage, build_guest  # noqa: E402

TOKEN = "benchmark-token"
SIZE_LINE = re.compile(r"^neonvm-guest-size: cpus=(\d+) online=\S* memtotal-kb=(\d+)$")


class Guest:
    """A runner with the test guest; the console is read line by line with timestamps."""

    def __init__(self, image: GuestImage, work: Path, cpus: dict[str, int],
                 slots: dict[str, int], mode: str) -> None:
        work.mkdir(parents=True)
        spec = {"terminationGracePeriodSeconds": 30, "guest": {
            "cpus": cpus, "memorySlotSize": "1Gi", "memorySlots": slots,
            "rootDisk": {"image": ""}, "kernelImage": str(image.kernel),
            "initrdImage": str(image.initrd), "appendKernelCmdline": "quiet"}}
        (work / "spec.json").write_text(json.dumps(spec))
        (work / "token").write_text(TOKEN)
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "neonvm.runner.main", "--spec-file", str(work / "spec.json"),
             "--port", str(self.port), "--listen-address", "127.0.0.1",
             "--work-dir", str(work / "run"), "--scaling-token-file", str(work / "token"),
             "--cpu-scaling-mode", mode, "--log-level", "WARNING"],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.sizes: list[tuple[float, int, int]] = []
        self.accel = "?"
        self._cond = threading.Condition()
        self._fence = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            m = SIZE_LINE.match(raw.decode(errors="replace").strip())
            if m:
                with self._cond:
                    self.sizes.append((time.monotonic(), int(m[1]), int(m[2])))
                    self._cond.notify_all()

    def wait_report(self, since: float, check: Callable[[int, int], bool],
                    timeout: float = 300) -> float:
        """Time of the first report after ``since`` that satisfies ``check``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for at, cpus, mem in self.sizes:
                    if at >= since and check(cpus, mem):
                        return at
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise RuntimeError(f"no matching guest report (runner {self.proc.poll()})")
                self._cond.wait(min(left, 1.0))

    def last(self) -> tuple[int, int]:
        with self._cond:
            return self.sizes[-1][1:] if self.sizes else (0, 0)

    def scale(self, **target: int) -> float:
        """PUT /scale with a newer fence; returns when the request was sent."""
        self._fence += 1
        body = json.dumps({**target, "fence": {"epoch": 1, "token": self._fence}}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/scale", data=body, method="PUT",
            headers={"Authorization": f"Bearer {TOKEN}"})
        sent = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                response.read()
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"PUT /scale {target}: {err.code} {err.read()!r}") from None
        return sent

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"runner exited {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ready",
                                            timeout=5) as r:
                    if r.status == 200 and self.sizes:
                        self.accel = str(self.status()["accel"])
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise RuntimeError("the guest did not get ready")

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/status", timeout=5) as r:
            doc: dict[str, Any] = json.loads(r.read())
        return doc

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def has_cpus(n: int) -> Callable[[int, int], bool]:
    return lambda cpus, _mem: cpus == n


def cpu_hot_add(image: GuestImage, work: Path, runs: int, accels: set[str]) -> list[float]:
    guest = Guest(image, work, {"min": 1, "max": 1 + runs, "use": 1},
                  {"min": 1, "max": 1}, "QmpScaling")
    out = []
    try:
        guest.wait_ready()
        accels.add(guest.accel)
        for n in range(2, runs + 2):
            sent = guest.scale(cpus=n)
            out.append(guest.wait_report(sent, has_cpus(n)) - sent)
    finally:
        guest.stop()
    return out


def cpu_sysfs(image: GuestImage, work: Path, runs: int, accels: set[str]
              ) -> tuple[list[float], list[float]]:
    guest = Guest(image, work, {"min": 1, "max": 2, "use": 1}, {"min": 1, "max": 1},
                  "SysfsScaling")
    up, down = [], []
    try:
        guest.wait_ready()
        accels.add(guest.accel)
        for _ in range(runs):
            sent = guest.scale(cpus=2)
            up.append(guest.wait_report(sent, lambda c, _m: c == 2) - sent)
            sent = guest.scale(cpus=1)
            down.append(guest.wait_report(sent, lambda c, _m: c == 1) - sent)
    finally:
        guest.stop()
    return up, down


def memory(image: GuestImage, work: Path, runs: int, accels: set[str]
           ) -> tuple[list[float], list[float]]:
    guest = Guest(image, work, {"min": 1, "max": 1}, {"min": 1, "max": 2, "use": 1},
                  "QmpScaling")
    plug, unplug = [], []
    gib_kb = 1 << 20
    try:
        guest.wait_ready()
        accels.add(guest.accel)
        boot_kb = guest.last()[1]
        for _ in range(runs):
            sent = guest.scale(memorySlots=2)
            plug.append(guest.wait_report(sent, lambda _c, m: m == boot_kb + gib_kb) - sent)
            sent = guest.scale(memorySlots=1)
            unplug.append(guest.wait_report(sent, lambda _c, m: m == boot_kb) - sent)
    finally:
        guest.stop()
    return plug, unplug


def row(name: str, values: list[float]) -> str:
    p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
    assert p50 is not None and p99 is not None
    return (f"| {name} | {len(values)} | {p50 * 1000:.0f} ms | {p99 * 1000:.0f} ms | "
            f"{min(values) * 1000:.0f} / {max(values) * 1000:.0f} ms |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per measure [20]")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    accels: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="neonvm-bench-scaling-") as tmp:
        image = build_guest(Path(tmp))
        load_before = os.getloadavg()[0]
        results["memory plug 1 -> 2 GiB (DIMM, QMP)"], results[
            "memory unplug 2 -> 1 GiB (DIMM, QMP)"] = memory(image, Path(tmp) / "mem", args.runs,
                                                                 accels)
        results["vCPU hot-add n -> n+1 (QMP)"] = cpu_hot_add(image, Path(tmp) / "add",
                                                              args.runs, accels)
        results["vCPU online 1 -> 2 (SysfsScaling)"], results[
            "vCPU offline 2 -> 1 (SysfsScaling)"] = cpu_sysfs(image, Path(tmp) / "sysfs",
                                                              args.runs, accels)
        load_after = os.getloadavg()[0]
    print(f"accel {', '.join(sorted(accels))}; load average {load_before:.1f} before, "
          f"{load_after:.1f} after")
    print("| PUT /scale -> guest reports | runs | p50 | p99 | min / max |")
    print("|---|---|---|---|---|")
    for name, values in results.items():
        print(row(name, values))


if __name__ == "__main__":
    main()
