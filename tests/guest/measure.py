"""Measure boot and shutdown of the test guest under the real runner (figures for docs).

``python -m tests.guest.measure [ROUNDS]`` builds the guest, then per round starts
``neonvm-runner`` (1 vCPU, 128 MiB, no disks), waits for ``/ready``, sends SIGTERM and
waits for the exit. It prints, per round and as min/median/max:

* boot: the runner's ``bootSeconds`` (QEMU start → ready marker on the console);
* shutdown: SIGTERM → runner exit (power button, guest power-off, QEMU exit).

Wall-clock figures: on a shared machine they vary with its load; say so when quoting them.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from neonvm.dev.cluster import free_port
from tests.guest.build import build_guest


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, ""
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


def measure_once(kernel: Path, initrd: Path, work: Path) -> tuple[float, float, str, int]:
    spec = {"terminationGracePeriodSeconds": 60, "guest": {
        "cpus": {"min": 1, "max": 1}, "memorySlotSize": "128Mi",
        "memorySlots": {"min": 1, "max": 1}, "rootDisk": {"image": ""},
        "kernelImage": str(kernel), "initrdImage": str(initrd),
        "appendKernelCmdline": "quiet"}}
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
    env["NEONVM_VM_SPEC"] = json.dumps(spec)
    args = [sys.executable, "-m", "neonvm.runner.main", "--port", str(port),
            "--listen-address", "127.0.0.1", "--work-dir", str(work)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while _get(port, "/ready")[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"runner ended or never got ready (exit {proc.poll()})")
            time.sleep(0.1)
        status = json.loads(_get(port, "/status")[1])
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        return float(status["bootSeconds"]), time.monotonic() - start, status["accel"], code
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with tempfile.TemporaryDirectory(prefix="neonvm-measure-") as tmp:
        guest = build_guest(Path(tmp))
        boots, stops = [], []
        for i in range(rounds):
            boot, stop, accel, code = measure_once(guest.kernel, guest.initrd,
                                                   Path(tmp) / f"w{i}")
            boots.append(boot)
            stops.append(stop)
            print(f"round {i + 1}: accel={accel} boot={boot:.2f}s shutdown={stop:.2f}s "
                  f"exit={code}", flush=True)
    for name, values in (("boot", boots), ("shutdown", stops)):
        print(f"{name}: min {min(values):.2f}s median {statistics.median(values):.2f}s "
              f"max {max(values):.2f}s over {len(values)} rounds")


if __name__ == "__main__":
    main()
