"""Live scaling latency: ``PUT /scale`` sent -> the guest reports the new size.

    python -m benchmarks.bench_scaling            # 20 runs of each measure
    python -m benchmarks.bench_scaling --runs 5   # quicker
    python -m benchmarks.bench_scaling --controller --runs 10 [--write-docs]
                                                  # VM patch -> guest, via a controller

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
* Memory plug / unplug (QmpScaling): 1 -> 2 -> 1 GiB (1 GiB of virtio-mem), ``runs`` times.

``--controller`` starts a private control plane (etcd, kube-apiserver), one controller
replica and one VM whose runner the benchmark starts as a kubelet would (the pod's spec
and environment, the VM's token Secret; the pod reported Running on 127.0.0.1). It
measures from the VM patch (``cpus.use`` 1 -> 2 -> 1, ``memorySlots.use`` 1 -> 2 -> 1) to
the guest's report, then the same changes on the same guest by ``PUT /scale`` straight to
the runner, the like-for-like baseline. ``--write-docs`` puts that table into
docs/benchmarks.md.

Prints p50/p99 (nearest rank) with min/max. Wall-clock figures on a shared machine
depend on its load; the load average is printed with them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
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

from benchmarks.common import replace_section  # noqa: E402
from neonvm.dev.cluster import free_port  # noqa: E402
from neonvm.drills.observer import percentile  # noqa: E402
from tests.guest.build import GuestImage, build_guest  # noqa: E402

TOKEN = "benchmark-token"
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Live scaling: VM patch -> the guest sees it"
SIZE_LINE = re.compile(r"^neonvm-guest-size: cpus=(\d+) online=\S* memtotal-kb=(\d+)$")


class Guest:
    """A runner with the test guest; the console is read line by line with timestamps."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, token: str = TOKEN) -> None:
        """``proc``: a runner whose stdout (the guest's console) is a pipe."""
        self.proc, self.port, self.token = proc, port, token
        self.sizes: list[tuple[float, int, int]] = []
        self.accel = "?"
        self.epoch = 1
        self._cond = threading.Condition()
        self._fence = 0
        threading.Thread(target=self._read, daemon=True).start()

    @classmethod
    def boot(cls, image: GuestImage, work: Path, cpus: dict[str, int],
             slots: dict[str, int], mode: str) -> Guest:
        """A runner outside any pod, with a spec of its own and a plain token file."""
        work.mkdir(parents=True)
        spec = {"terminationGracePeriodSeconds": 30, "guest": {
            "cpus": cpus, "memorySlotSize": "1Gi", "memorySlots": slots,
            "rootDisk": {"image": ""}, "kernelImage": str(image.kernel),
            "initrdImage": str(image.initrd), "appendKernelCmdline": "quiet"}}
        (work / "spec.json").write_text(json.dumps(spec))
        (work / "token").write_text(TOKEN)
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "neonvm.runner.main", "--spec-file", str(work / "spec.json"),
             "--port", str(port), "--listen-address", "127.0.0.1",
             "--work-dir", str(work / "run"), "--scaling-token-file", str(work / "token"),
             "--cpu-scaling-mode", mode, "--log-level", "WARNING"],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return cls(proc, port)

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
        body = json.dumps({**target, "fence": {"epoch": self.epoch,
                                                "token": self._fence}}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/scale", data=body, method="PUT",
            headers={"Authorization": f"Bearer {self.token}"})
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
    guest = Guest.boot(image, work, {"min": 1, "max": 1 + runs, "use": 1},
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
    guest = Guest.boot(image, work, {"min": 1, "max": 2, "use": 1}, {"min": 1, "max": 1},
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
    guest = Guest.boot(image, work, {"min": 1, "max": 1}, {"min": 1, "max": 2, "use": 1},
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


# ---- through the controller: VM patch -> guest reports, next to PUT /scale on the same guest ----

GIB_KB = 1 << 20


def pod_runner(pod: Any, token: str, port: int, work: Path) -> subprocess.Popen[bytes]:
    """The runner for ``pod`` as a kubelet would start it (its spec annotation, its env,
    the VM's token Secret), on loopback, its console on a pipe."""
    from neonvm.controller.podspec import ANNOTATION_SPEC

    work.mkdir(parents=True)
    (work / "spec.json").write_text(pod.metadata.annotations[ANNOTATION_SPEC])
    (work / "token").write_text(token)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
    for e in pod.spec.containers[0].env or []:
        ref = e.value_from.field_ref if e.value_from is not None else None
        if ref is not None and ref.field_path == "metadata.uid":
            env[e.name] = pod.metadata.uid
        elif e.value is not None:
            env[e.name] = e.value
    env.update({"NEONVM_SPEC_FILE": str(work / "spec.json"),
                "NEONVM_SCALING_TOKEN_FILE": str(work / "token")})
    (work / "termination-log").write_text("")
    args = [sys.executable, "-m", "neonvm.runner.main", "--port", str(port),
            "--listen-address", "127.0.0.1", "--work-dir", str(work / "run"),
            "--disks-dir", str(work / "disks"), "--termination-log",
            str(work / "termination-log"), "--log-level", "WARNING"]
    return subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)


def through_controller(image: GuestImage, work: Path, runs: int, accels: set[str]
                       ) -> dict[str, list[float]]:
    """One controller replica, one VM, its runner: ``cpus.use`` 1 -> 2 -> 1 (SysfsScaling)
    and ``memorySlots.use`` 1 -> 2 -> 1 (1 GiB of virtio-mem), ``runs`` times each, from the VM
    patch to the guest's report; then the same changes on the same guest by ``PUT /scale``
    straight to its runner (fences above the controller's)."""
    import base64
    import uuid

    from kubernetes import client

    from benchmarks.bench_failover import local_cluster
    from neonvm import kube
    from neonvm.api import types
    from neonvm.api.scale_protocol import pod_token
    from tests.support.harness import Replicas, create_vm, get_vm, runner_pods

    def vm_url(namespace: str) -> str:
        return (f"/apis/{types.GROUP}/{types.VERSION}/namespaces/{namespace}/"
                f"{types.PLURAL}/live")

    out: dict[str, list[float]] = {}
    root = work / "root.raw"
    work.mkdir(parents=True)
    with root.open("wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(root)], check=True)
    with local_cluster(None) as cluster:
        api = kube.api_client(cluster.kubeconfig)
        core = client.CoreV1Api(api)
        namespace = f"bench-{uuid.uuid4().hex[:8]}"
        core.create_namespace({"metadata": {"name": namespace}})

        def status() -> dict[str, Any]:
            raw: dict[str, Any] = (get_vm(api, namespace, "live") or {}).get("status") or {}
            return raw

        def wait(what: str, check: Callable[[], Any], timeout: float = 300) -> Any:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                value = check()
                if value:
                    return value
                time.sleep(0.1)
            raise RuntimeError(f"timed out waiting for {what}")

        with Replicas(api=api, kubeconfig=cluster.kubeconfig_for("controller"),
                      etcd_endpoints=cluster.locks_etcd_config(f"/bench-{uuid.uuid4().hex[:8]}"),
                      lease_namespace=namespace, log_dir=work / "replicas",
                      extra_args=["--watch-namespace", namespace]
                      ) as replicas:
            replicas.start("r0")
            wait("a leader", replicas.leader, 120)
            port = free_port()
            create_vm(api, namespace, "live", spec={
                "nodeSelector": {"neonvm.bench/unschedulable": "true"}, "runnerPort": port,
                "terminationGracePeriodSeconds": 10, "cpuScalingMode": "SysfsScaling",
                "guest": {"cpus": {"min": 1, "max": 2, "use": 1},
                          "memorySlots": {"min": 1, "max": 2, "use": 1},
                          "memorySlotSize": "1Gi", "rootDisk": {"image": str(root)},
                          "kernelImage": str(image.kernel), "initrdImage": str(image.initrd),
                          "appendKernelCmdline": "quiet"}})
            wait("the pod and its token Secret", lambda: len(runner_pods(
                api, namespace, "live")) == 1 and status().get("scalingTokenSecret"))
            (pod,) = runner_pods(api, namespace, "live")
            secret = core.read_namespaced_secret(status()["scalingTokenSecret"], namespace)
            token = base64.b64decode(secret.data["token"]).decode()
            guest = Guest(pod_runner(pod, token, port, work / "pod"), port,
                          token=pod_token(token.encode(), pod.metadata.uid))
            try:
                guest.wait_ready()
                accels.add(guest.accel)
                boot_kb = guest.last()[1]
                core.patch_namespaced_pod_status(pod.metadata.name, namespace, {
                    "status": {"phase": "Running", "podIP": "127.0.0.1",
                               "podIPs": [{"ip": "127.0.0.1"}]}})
                wait("the VM Running", lambda: status().get("phase") == "Running")

                def patch(cpus: int, slots: int) -> float:
                    sent = time.monotonic()
                    kube.request(api, "PATCH", vm_url(namespace), [
                        {"op": "replace", "path": "/spec/guest/cpus/use", "value": cpus},
                        {"op": "replace", "path": "/spec/guest/memorySlots/use",
                         "value": slots}], content_type="application/json-patch+json")
                    return sent

                def committed(cpus: int, memory: str) -> bool:
                    st = status()
                    return ("pendingScale" not in st and st.get("cpus") == cpus
                            and st.get("memorySize") == memory)

                changes = [("vCPU online 1 -> 2", (2, 1), "1Gi", lambda c, _m: c == 2),
                           ("vCPU offline 2 -> 1", (1, 1), "1Gi", lambda c, _m: c == 1),
                           ("memory plug 1 -> 2 GiB", (1, 2), "2Gi",
                            lambda _c, m: m == boot_kb + GIB_KB),
                           ("memory unplug 2 -> 1 GiB", (1, 1), "1Gi",
                            lambda _c, m: m == boot_kb)]
                for _ in range(runs):
                    for label, (cpus, slots), memory, check in changes:
                        sent = patch(cpus, slots)
                        seen = guest.wait_report(sent, check)
                        out.setdefault(f"{label}: VM patch (controller)", []).append(
                            seen - sent)
                        wait(f"{label} committed", functools.partial(committed, cpus, memory))
                # The baseline, same guest: fences of an epoch no controller reaches.
                guest.epoch = 1 << 40
                for _ in range(runs):
                    for label, (cpus, slots), _memory, check in changes:
                        sent = guest.scale(cpus=cpus, memorySlots=slots)
                        seen = guest.wait_report(sent, check)
                        out.setdefault(f"{label}: PUT /scale (direct)", []).append(
                            seen - sent)
            finally:
                guest.stop()
        api.close()
    return dict(sorted(out.items(), key=lambda kv: (kv[0].split(":")[0], kv[0])))


def row(name: str, values: list[float]) -> str:
    p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
    assert p50 is not None and p99 is not None
    return (f"| {name} | {len(values)} | {p50 * 1000:.0f} ms | {p99 * 1000:.0f} ms | "
            f"{min(values) * 1000:.0f} / {max(values) * 1000:.0f} ms |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per measure [20]")
    parser.add_argument("--controller", action="store_true",
                        help="through a controller replica: VM patch -> guest reports, next "
                             "to PUT /scale on the same guest (starts a private control "
                             "plane)")
    parser.add_argument("--write-docs", action="store_true",
                        help=f"with --controller: write the table into {DOC.name}")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    accels: set[str] = set()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="neonvm-bench-scaling-") as tmp:
        image = build_guest(Path(tmp))
        load_before = os.getloadavg()
        if args.controller:
            results = through_controller(image, Path(tmp) / "controller", args.runs, accels)
        else:
            results["memory plug 1 -> 2 GiB (virtio-mem, QMP)"], results[
                "memory unplug 2 -> 1 GiB (virtio-mem, QMP)"] = memory(image, Path(tmp) / "mem",
                                                                 args.runs, accels)
            results["vCPU hot-add n -> n+1 (QMP)"] = cpu_hot_add(image, Path(tmp) / "add",
                                                                  args.runs, accels)
            results["vCPU online 1 -> 2 (SysfsScaling)"], results[
                "vCPU offline 2 -> 1 (SysfsScaling)"] = cpu_sysfs(image, Path(tmp) / "sysfs",
                                                                  args.runs, accels)
        load_after = os.getloadavg()
    loads = (f"load average (1/5/15 min) {'/'.join(f'{x:.1f}' for x in load_before)} before, "
             f"{'/'.join(f'{x:.1f}' for x in load_after)} after")
    head = ("| change: from -> until the guest reports it | runs | p50 | p99 | min / max |"
            if args.controller else "| PUT /scale -> guest reports | runs | p50 | p99 | "
                                    "min / max |")
    table = "\n".join([head, "|---|---:|---:|---:|---:|",
                       *(row(name, values) for name, values in results.items())])
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    env = (f"Run {when} UTC on {platform.node() or 'a machine'}: "
           f"{os.cpu_count()} CPUs shared with other work, {loads}; guest accel "
           f"{', '.join(sorted(accels))}; {time.monotonic() - started:.0f} s in all.")
    print(env)
    print(table)
    if args.controller and args.write_docs:
        replace_section(DOC, SECTION, f"{SECTION}\n\nGenerated by "
                   "`python -m benchmarks.bench_scaling --controller "
                   f"--runs {args.runs} --write-docs` (opt-in; see its docstring). One "
                   "controller replica (default flags), one VM whose runner runs the test "
                   "guest (tests/guest/) under QEMU, on a private control plane. *VM patch "
                   "(controller)*: from the JSON patch of `spec.guest.cpus.use` / "
                   "`memorySlots.use` being sent to the guest's own report line showing the "
                   "new size (watch event, plan recorded in status, `PUT /scale`, guest). "
                   "Each change is committed (`status.pendingScale` gone) before the next. "
                   "*PUT /scale (direct)*: the same changes on the same guest, sent straight "
                   "to the runner (the baseline: no controller, no API server).\n\n"
                   f"{table}\n\n{env}\n")
        print(f"wrote {DOC.relative_to(ROOT)}")

if __name__ == "__main__":
    main()
