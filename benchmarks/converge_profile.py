"""Where the time of one convergence goes: ``python -m benchmarks.converge_profile``.

    python -m benchmarks.converge_profile --vms 100                  # 4 workers
    python -m benchmarks.converge_profile --vms 100 --workers 4,8,16,32
    python -m benchmarks.converge_profile --vms 1000 --py-spy        # sample the leader
    python -m benchmarks.converge_profile --state-dir D ...          # a running cluster
    python -m benchmarks.converge_profile --workers 4,8,16,32 --write-docs

One run per worker count: the like-for-like floor of ``benchmarks/controller_bench.py``
(:func:`~benchmarks.controller_bench.floor_rate`: a bare client doing the 4 writes a VM
needs as the controller sends them, plan, pod create with the controller's template,
commit and ungate, as the controller's identity, with as many threads as the controller
has workers, and an HTTP pool that large, timed by the same watch), then N VMs created
at once for controller replicas (``--replicas``, default 3, as the benchmark) started
with that many workers, until every VM's pod is ungated (the benchmark's "converged")
and, for the timeline's last columns, the pod and the VM are Running.

What it measures, next to that floor:

* **the per-VM timeline**, from watch events this script receives (a VM informer and a
  pod informer of its own, so nothing polls): created (the create's answer) ->
  finalizer -> plan (``status.pendingPod``) -> pod created -> commit
  (``status.podName``) -> pod ungated -> pod Running -> VM Running; p50/p90/max of each
  step and from the create;
* **the leader's workers**: busy time from ``neonvm_controller_reconcile_duration_seconds``
  (the reconciles alone) and, with ``--py-spy``, from samples of every thread of the
  leader (``py-spy record --idle --nonblocking``): each worker sample is sorted into
  *idle* (waiting in ``WorkQueue.take``) or the call it is in (each API call of the
  cluster interface, the etcd lock check and acquire, the cache, logging, Events,
  the rest), and within a call into waiting on the socket / gRPC, JSON, typed
  decoding, or Python;
* **CPU seconds** of every process on the machine that takes part (the leader, the
  standbys, kube-apiserver, both etcds, kwok, scheduler, controller-manager, this
  script) over the run, with the load average: on a shared 2-core machine the
  question is often who had the cores.

Nothing here is typed in: every figure is measured in the run it is printed with.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kubernetes import client  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402

from benchmarks import controller_bench as cb  # noqa: E402
from benchmarks.api_calls import python_path_first, request_totals, revision_tree  # noqa: E402
from benchmarks.common import replace_section  # noqa: E402
from benchmarks.controller_bench import STAGES, Timeline  # noqa: E402
from neonvm import kube  # noqa: E402
from neonvm.api import types  # noqa: E402
from neonvm.controller.config import http_pool_size  # noqa: E402
from neonvm.dev.replica import ALLOCATOR_ENV  # noqa: E402
from neonvm.drills import fleet  # noqa: E402
from neonvm.drills.observer import percentile  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Where a convergence's time goes"

def say(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


# ---- CPU of the processes taking part ---------------------------------------------------


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of ``pid`` (and its reaped children: none here), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def participants(cluster: Any, replicas: cb.ReplicaSet | None,
                 leader: cb.Replica | None) -> dict[str, int]:
    """Name -> pid of every process of the run (the cluster's components, the replicas)."""
    pids: dict[str, int] = {}
    for pid_file in sorted((cluster.state_dir / "run").glob("*.pid")):
        try:
            pid = int(pid_file.read_text())
        except (OSError, ValueError):
            continue
        name = pid_file.stem
        if name.startswith("bench-"):
            continue
        pids[name] = pid
    if replicas is None:
        return pids
    for member in replicas.members:
        role = "leader" if member is leader else f"standby {member.name.rsplit('-', 1)[1]}"
        pids[f"controller ({role})"] = replicas.pid(member)
    return pids


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    out = {name: cpu_seconds(pid) for name, pid in pids.items()}
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["this script (watches, creates)"] = usage.ru_utime + usage.ru_stime
    return {k: v for k, v in out.items() if v is not None}


# ---- metrics ----------------------------------------------------------------------------


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith("neonvm_controller_"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def delta(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, float]:
    return {k[len(prefix):]: after[k] - before.get(k, 0.0) for k in after
            if k.startswith(prefix) and after[k] - before.get(k, 0.0)}


# ---- py-spy -----------------------------------------------------------------------------


def py_spy_binary() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    if here.exists():
        return str(here)
    from shutil import which

    return which("py-spy")


API_CALLS = {
    "VMWriter.put_status": "API: PUT status", "KubeCluster.put_status": "API: PUT status",
    "VMWriter.put_main": "API: PUT VM (finalizer)",
    "KubeCluster.put_main": "API: PUT VM (finalizer)",
    "KubeCluster.create_pod": "API: POST pod", "KubeCluster.ungate_pod": "API: PATCH pod (ungate)",
    "KubeCluster.list_pods": "API: LIST pods", "KubeCluster.get_vm_raw": "API: GET VM",
    "KubeCluster.get_pod": "API: GET pod", "KubeCluster.delete_pod": "API: DELETE pod",
    "KubeCluster.secret_metadata": "API: GET secret",
    "LockGuard.check": "etcd: lock check", "LockManager.acquire": "etcd: lock acquire",
    "CacheReader.observe": "cache observation",
}
"""Frames that name what a worker sample is in (outermost match wins)."""


def frame_name(frame: str) -> str:
    return frame.split(" (", 1)[0]


def frame_file(frame: str) -> str:
    m = re.search(r"\(([^():]+)(?::\d+)?\)$", frame)
    return m.group(1) if m else ""


def what_of(stack: list[str]) -> str:
    """What a worker's sample is in: idle, one of :data:`API_CALLS`, or a coarser part."""
    names = [frame_name(f) for f in stack]
    if "WorkQueue.take" in names:
        return "idle (waiting for a key)"
    for name in names:
        if name in API_CALLS:
            return API_CALLS[name]
    files = [frame_file(f) for f in stack]
    if any("loguru" in f for f in files):
        return "logging"
    if any(f.endswith("events.py") for f in files):
        return "Events"
    if "Handler.handle" in names or "Handler.process" in names:
        return "handler, decide, mutations (Python)"
    return "other"


def how_of(stack: list[str]) -> str:
    """How the sample spends it: waiting on a socket or gRPC, JSON, typed decoding,
    logging, waiting on a lock, or Python."""
    files = [frame_file(f) for f in stack]
    names = [frame_name(f) for f in stack]
    leaf_file, leaf = files[-1] if files else "", names[-1] if names else ""
    if any("kubernetes/client/api_client.py" in f for f in files) and any(
            "deserialize" in n or "sanitize_for_serialization" in n for n in names):
        return "typed decode (kubernetes models)"
    if any(f.endswith(("json/decoder.py", "json/encoder.py", "json/__init__.py"))
           for f in files):
        return "JSON"
    if leaf_file.endswith(("ssl.py", "socket.py")) or leaf in ("recv_into", "sendall",
                                                                 "readinto", "read"):
        return "waiting on the socket"
    if "grpc" in leaf_file:
        return "waiting on gRPC"
    if leaf_file.endswith("threading.py") and leaf in ("wait", "acquire",
                                                       "_wait_for_tstate_lock"):
        return "waiting (lock/condition)"
    if any("loguru" in f for f in files):
        return "logging"
    if any("neonvm/api/" in f for f in files):
        return "VM decode/encode (neonvm.api)"
    return "Python"


@dataclass
class Samples:
    threads: dict[str, int] = field(default_factory=Counter)
    """Samples per thread group (worker, informer-..., MainThread, ...)."""
    what: dict[str, int] = field(default_factory=Counter)
    how: dict[tuple[str, str], int] = field(default_factory=Counter)
    worker_total: int = 0


def read_samples(path: Path) -> Samples:
    """py-spy's raw (collapsed) output, ``--threads``: first frame ``thread (id): name``."""
    out = Samples()
    for line in path.read_text(errors="replace").splitlines():
        stack_text, _, count_text = line.rpartition(" ")
        try:
            count = int(count_text)
        except ValueError:
            continue
        frames = stack_text.split(";")
        thread = frames[0].split(": ", 1)[-1] if frames else "?"
        group = re.sub(r"-\d+$", "", thread)
        out.threads[group] += count
        if group != "worker":
            continue
        stack = frames[1:]
        out.worker_total += count
        what = what_of(stack)
        out.what[what] += count
        if not what.startswith("idle"):
            out.how[(what, how_of(stack))] += count
    return out


class PySpy:
    """``py-spy record`` of one process, from :meth:`start` until :meth:`stop`."""

    def __init__(self, binary: str, pid: int, out: Path, rate: int) -> None:
        self.out = out
        self._proc = subprocess.Popen(
            [binary, "record", "--pid", str(pid), "--idle", "--threads", "--nonblocking",
             "--rate", str(rate), "--format", "raw", "-o", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def stop(self) -> Samples | None:
        self._proc.send_signal(signal.SIGINT)
        try:
            _, err = self._proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return None
        if not self.out.exists():
            say(f"py-spy wrote nothing: {err.strip()[-300:]}")
            return None
        return read_samples(self.out)


# ---- one run ----------------------------------------------------------------------------


def create_timed(api: client.ApiClient, namespace: str, names: list[str], threads: int,
                 timeline: Timeline) -> None:
    custom = client.CustomObjectsApi(api)

    def one(name: str) -> None:
        try:
            fleet.retrying(lambda: custom.create_namespaced_custom_object(
                types.GROUP, types.VERSION, namespace, types.PLURAL, cb.bench_vm_body(name),
                _request_timeout=30))
        except ApiException as exc:
            if exc.status != 409:
                raise
        timeline.mark(name, "created")

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(names)))) as pool:
        list(pool.map(one, names))


def run_once(cluster: Any, vms: int, workers: int, replicas: int, py_spy: str | None,
             rate: int, out_dir: Path, log_level: str, label: str = "this code",
             tree: str | None = None, clean_up: bool = True,
             env: dict[str, str] | None = None) -> dict[str, Any]:
    """The floor and one convergence at ``workers`` workers; every figure of the run.
    ``tree``: the replicas import neonvm from there (a baseline revision's source).
    ``env``: set in the replicas' environment over :data:`neonvm.dev.replica.ALLOCATOR_ENV`.
    ``clean_up=False``: the VMs are left to the cluster's teardown (a private cluster's
    last run: deleting 10,000 VMs through the controller takes long and measures
    nothing)."""
    api = kube.api_client(cluster.kubeconfig, pool_size=http_pool_size(workers))
    namespace = f"prof-{uuid.uuid4().hex[:5]}"
    raw_ns = f"prof-raw-{uuid.uuid4().hex[:5]}"
    fleet.ensure_namespace(api, namespace)
    load_before = os.getloadavg()
    result: dict[str, Any] = {"vms": vms, "workers": workers, "replicas": replicas,
                              "load_before": load_before, "label": label}
    try:
        components = participants(cluster, None, None)
        cpu_floor_before = cpu_snapshot(components)
        raw = cb.floor_rate(cluster, api, raw_ns, vms, threads=workers, progress=say)
        cpu_floor_after = cpu_snapshot(components)
        result["raw"] = raw
        result["cpu_floor"] = {k: cpu_floor_after[k] - cpu_floor_before.get(k, 0.0)
                               for k in cpu_floor_after}
        say(f"floor: {raw['writes_per_s']:.0f} writes/s with {workers} threads = "
            f"{raw['vms_per_s']:.1f} VMs/s")
        # The floor's namespace stays until the run ends: deleting its pods now would
        # load the API server and the simulated nodes while the controller is measured.
        timeline = Timeline(api, namespace)
        timeline.start()
        rs = cb.ReplicaSet(cluster, namespace, count=replicas, workers=workers,
                           log_level=log_level, env={**ALLOCATOR_ENV, **(env or {})})
        with python_path_first(tree):
            rs.start_all()
        try:
            leader_id, _ = cb.wait_for_leader(api, namespace)
            leader = rs.by_identity(leader_id)
            assert leader is not None
            cb.wait_metrics(rs, leader)
            port = rs.metrics_port(leader)
            assert port is not None
            time.sleep(1.0)  # the term's informers synced, its workers started
            pids = participants(cluster, rs, leader)
            names = [f"vm-{i:04d}" for i in range(vms)]
            timeline.expected = set(names)
            metrics_before = scrape(port)
            requests_before = request_totals(api)
            cpu_before = cpu_snapshot(pids)
            spy = None
            if py_spy:
                spy = PySpy(py_spy, rs.pid(leader), out_dir / f"pyspy-{vms}-{workers}.txt",
                            rate)
                time.sleep(0.5)
            t0 = time.time()
            mono0 = time.monotonic()
            create_timed(api, namespace, names, cb.WORKERS, timeline)
            created = time.monotonic() - mono0
            if not timeline.ungated.wait(60 + vms * 3.0):
                raise RuntimeError("not every VM's pod was ungated in time")
            ungated_at = time.monotonic()
            samples = spy.stop() if spy is not None else None
            leader_rss = (cb.rss_mib(rs.pid(leader)), cb.rss_mib(rs.pid(leader), "VmHWM"))
            cpu_after = cpu_snapshot(pids)
            metrics_after = scrape(port)
            requests_after = request_totals(api)
            load_after = os.getloadavg()
            # Running needs the simulated nodes to have room (3 kwok nodes hold a few
            # hundred of these pods): the last columns are filled only for VMs that get
            # there soon.
            timeline.running.wait(30.0)
            state = fleet.convergence(api, namespace, names)
            if len(state.converged) != vms:
                raise RuntimeError(f"the benchmark's check disagrees: {len(state.converged)}"
                                   f" of {vms} converged")
            if clean_up:
                fleet.delete_vms(api, namespace)
                fleet.wait_gone(api, namespace, 60 + vms * 2.0)
        finally:
            rs.stop_all()
        timeline.stop()
        mine = [timeline.at[n] for n in names]
        last_ungate = max(t["ungated"] for t in mine)
        span = last_ungate - min(t["created"] for t in mine)
        result.update({
            "t0": t0, "create_seconds": created, "span_seconds": span,
            "sampled_seconds": ungated_at - mono0,
            "after_creates_seconds": last_ungate - max(t["created"] for t in mine),
            "timeline": {n: dict(v) for n, v in timeline.at.items() if n in set(names)},
            "metrics": delta(metrics_before, metrics_after, "neonvm_controller_"),
            "requests": {" ".join(part for part in k[:3] if part): v - requests_before[k]
                         for k, v in requests_after.items() if v - requests_before[k] > 0},
            "cpu": {k: cpu_after[k] - cpu_before.get(k, 0.0) for k in cpu_after},
            "load_after": load_after,
            "leader_rss_mib": leader_rss,
            "samples": samples,
        })
        return result
    finally:
        if clean_up:
            fleet.drop_namespace(api, namespace)
            fleet.drop_namespace(api, raw_ns)
            # The next run starts on a quiet cluster, not during this one's deletions.
            for ns in (namespace, raw_ns):
                if not fleet.wait_namespace_gone(api, ns, 60 + vms * 0.2):
                    say(f"namespace {ns} is still being deleted; going on")
        api.close()


# ---- the report -------------------------------------------------------------------------


def fmt(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.2f} {unit}"


def stage_rows(timeline: dict[str, dict[str, float]]) -> list[tuple[str, str, str, str]]:
    """(step, p50, p90, max) of each step of the timeline, then from the create."""
    rows = []
    for a, b in itertools.pairwise(STAGES):
        gaps = [t[b] - t[a] for t in timeline.values() if a in t and b in t]
        rows.append((f"{a} -> {b}", fmt(percentile(gaps, 0.5)), fmt(percentile(gaps, 0.9)),
                     fmt(max(gaps) if gaps else None)))
    for b in ("ungated", "vm_running"):
        gaps = [t[b] - t["created"] for t in timeline.values() if "created" in t and b in t]
        rows.append((f"created -> {b}", fmt(percentile(gaps, 0.5)),
                     fmt(percentile(gaps, 0.9)), fmt(max(gaps) if gaps else None)))
    return rows


def report(r: dict[str, Any]) -> str:
    vms, workers = r["vms"], r["workers"]
    raw = r["raw"]
    m = r["metrics"]
    lines = [f"### {r['label']}: {vms} VMs, {workers} workers ({r['replicas']} replicas)",
             ""]
    rate = vms / r["after_creates_seconds"] if r["after_creates_seconds"] > 0 else 0.0
    lines.append(
        f"Creates took {r['create_seconds']:.1f} s; the last pod was ungated "
        f"{r['span_seconds']:.1f} s after the first create, {r['after_creates_seconds']:.1f} s "
        f"after the last (the benchmark's measure: **{rate:.1f} VMs/s**; "
        f"{vms / r['span_seconds']:.1f} VMs/s from the first create). Floor in the same run: "
        f"{raw['writes_per_s']:.0f} writes/s with {raw['threads']} threads = "
        f"{raw['vms_per_s']:.1f} VMs/s. Load average {r['load_before'][0]:.1f} before, "
        f"{r['load_after'][0]:.1f} after."
        + (" Leader RSS at the last ungate {:.0f} MiB (peak {:.0f} MiB).".format(
            *r["leader_rss_mib"]) if r.get("leader_rss_mib") else ""))
    lines += ["", "| step | p50 | p90 | max |", "|---|---:|---:|---:|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in stage_rows(r["timeline"])]
    busy = m.get("reconcile_duration_seconds_sum", 0.0)
    recs = m.get("reconcile_duration_seconds_count", 0.0)
    wall = workers * r["span_seconds"]
    lines += ["", f"Reconciles: {recs:.0f} ({recs / vms:.1f} per VM), "
                  f"{busy:.1f} worker-seconds = {100 * busy / wall:.0f}% of {workers} "
                  f"workers x {r['span_seconds']:.1f} s; "
                  f"{busy / vms:.3f} worker-s per VM in reconciles."]
    turns = {k.split('outcome="')[1].split('"')[0]: (v, m.get(k.replace("_sum{", "_count{"), 0.0))
             for k, v in m.items() if k.startswith("turn_duration_seconds_sum{")}
    if turns:
        spent = sum(v for v, _ in turns.values())
        lines.append(
            f"Turns (whole turns: lock, reconcile, requeue): {spent:.1f} worker-seconds = "
            f"{100 * spent / wall:.0f}% busy; " + ", ".join(
                f"{k} {n:.0f} ({v:.1f} s)" for k, (v, n) in
                sorted(turns.items(), key=lambda kv: -kv[1][0])) + ".")
    waits = {k.split('line="')[1].split('"')[0]: (v, m.get(k.replace("_sum{", "_count{"), 0.0))
             for k, v in m.items() if k.startswith("queue_wait_seconds_sum{")}
    if waits:
        lines.append("Waiting ready for a worker: " + ", ".join(
            f"{line} line {n:.0f} takes, {v:.1f} s in all (mean {1000 * v / max(n, 1):.0f} ms)"
            for line, (v, n) in sorted(waits.items())) + ".")
    results = {k.split('result="')[1].rstrip('"}'): v for k, v in m.items()
               if k.startswith("reconciles_total{")}
    if results:
        lines.append("Reconciles by result: " + ", ".join(
            f"{k} {v:.0f}" for k, v in sorted(results.items(), key=lambda kv: -kv[1])) + ".")
    actions = {k.split('action="')[1].split('"')[0] + "/" + k.split('outcome="')[1].split('"')[0]:
               v for k, v in m.items() if k.startswith("actions_total{")}
    if actions:
        lines.append("Actions: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(actions.items()))
                     + ".")
    reqs = r.get("requests") or {}
    if reqs:
        lines += ["", "API server requests per VM while converging (every client's: the "
                      "controller's, kwok's, the scheduler's, this script's creates and "
                      "watches): " + ", ".join(
                          f"{k} {v / vms:.2f}" for k, v in
                          sorted(reqs.items(), key=lambda kv: -kv[1]) if v / vms >= 0.05)
                  + "."]
    cpu = r["cpu"]
    total = sum(cpu.values())
    window = r.get("sampled_seconds", r["span_seconds"])
    lines += ["", f"CPU seconds over the {window:.1f} s from the first create to the last "
                  f"ungate seen ({os.cpu_count()} CPUs give {(os.cpu_count() or 1) * window:.0f}): "
                  + ", ".join(
                      f"{k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])
                      if v >= 0.05) + f"; {total:.1f} in all."]
    floor_cpu = r.get("cpu_floor") or {}
    if floor_cpu:
        names = sorted(set(cpu) | set(floor_cpu), key=lambda k: -cpu.get(k, 0.0))
        lines += ["", "CPU ms per VM, the floor's 4 writes vs the convergence:", "",
                  "| process | floor | convergence |", "|---|---:|---:|"]
        for name in names:
            a, b = floor_cpu.get(name, 0.0), cpu.get(name, 0.0)
            if max(a, b) >= 0.05:
                lines.append(f"| {name} | {1000 * a / vms:.1f} | {1000 * b / vms:.1f} |")
        lines.append(f"| all | {1000 * sum(floor_cpu.values()) / vms:.1f} | "
                     f"{1000 * total / vms:.1f} |")
    s: Samples | None = r.get("samples")
    if s is not None and s.worker_total:
        lines += ["", f"py-spy, the leader's {workers} workers ({s.worker_total} samples):", "",
                  "| in | share | of which |", "|---|---:|---|"]
        for what, n in sorted(s.what.items(), key=lambda kv: -kv[1]):
            parts = sorted(((how, c) for (w, how), c in s.how.items() if w == what),
                           key=lambda kv: -kv[1])
            detail = ", ".join(f"{how} {100 * c / n:.0f}%" for how, c in parts[:4])
            lines.append(f"| {what} | {100 * n / s.worker_total:.1f}% | {detail} |")
        others = ", ".join(f"{k} {v}" for k, v in sorted(s.threads.items(), key=lambda kv: -kv[1]))
        lines += ["", f"Samples by thread: {others}."]
    return "\n".join(lines)


def sweep_table(results: list[dict[str, Any]]) -> str:
    lines = ["| controller | VMs | workers | creates took | last ungate after the last create"
             " | VMs/s (benchmark's measure) | VMs/s from the first create | floor (same "
             "threads) | % of floor (benchmark's / from the first create) | worker busy | "
             "load before/after |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        vms, raw = r["vms"], r["raw"]
        rate = vms / r["after_creates_seconds"]
        whole = vms / r["span_seconds"]
        busy = sum(v for k, v in r["metrics"].items()
                   if k.startswith("turn_duration_seconds_sum{")) or \
            r["metrics"].get("reconcile_duration_seconds_sum", 0.0)
        lines.append(
            f"| {r['label']} | {vms} | {r['workers']} | {r['create_seconds']:.1f} s | "
            f"{r['after_creates_seconds']:.1f} s | {rate:.1f} | {whole:.1f} | "
            f"{raw['vms_per_s']:.1f} VMs/s ({raw['writes_per_s']:.0f} writes/s) | "
            f"{100 * rate / raw['vms_per_s']:.0f}% / {100 * whole / raw['vms_per_s']:.0f}% | "
            f"{100 * busy / (r['workers'] * r['span_seconds']):.0f}% | "
            f"{r['load_before'][0]:.1f} / {r['load_after'][0]:.1f} |")
    return "\n".join(lines)


def ints(text: str) -> list[int]:
    return [int(p) for p in text.split(",") if p.strip()]


def env_pairs(text: str) -> dict[str, str]:
    """``K=V,K=V`` as a dict."""
    out: dict[str, str] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"not K=V: {part!r}")
        out[key.strip()] = value
    return out


def pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        vms, _, workers = part.partition(":")
        out.append((int(vms), int(workers)))
    return out


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-dir", type=Path, default=None,
                   help="Use this running local cluster instead of a private one.")
    p.add_argument("--vms", type=ints, default=[100], help="VM counts (comma-separated).")
    p.add_argument("--workers", type=ints, default=[cb.WORKERS],
                   help="Worker counts (comma-separated): one run each.")
    p.add_argument("--runs", type=pairs, default=None, metavar="VMS:WORKERS,...",
                   help="Exactly these runs (replaces --vms and --workers).")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--baseline", default=None, metavar="REV",
                   help="First run the controller as it was at git revision REV (its tree "
                        "first on the replicas' PYTHONPATH), once per VM count.")
    p.add_argument("--baseline-workers", type=int, default=4,
                   help="The baseline's workers (default 4: the default before 16).")
    p.add_argument("--env", type=env_pairs, default={}, metavar="K=V,...",
                   help="Set in this code's replicas' environment, over the chart's "
                        "allocator settings.")
    p.add_argument("--baseline-env", type=env_pairs, default={}, metavar="K=V,...",
                   help="Set in the baseline's replicas' environment, over the chart's "
                        "allocator settings (e.g. PYTHONMALLOC=pymalloc: Python's own "
                        "allocator, as before the heap trimmer).")
    p.add_argument("--baseline-sizes", type=ints, default=None,
                   help="VM counts the baseline runs at (default: every count).")
    p.add_argument("--nodes", type=int, default=3, help="Simulated nodes (private cluster).")
    p.add_argument("--py-spy", action="store_true", help="Sample the leader with py-spy.")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second.")
    p.add_argument("--log-level", default="INFO", help="The replicas' log level.")
    p.add_argument("--out", type=Path, default=Path("/tmp"), help="Where py-spy's file goes.")
    p.add_argument("--json", type=Path, default=None, help="Also write the raw results here.")
    p.add_argument("--write-docs", action="store_true",
                   help=f"Write the sweep and the breakdowns into {DOC.name}.")
    p.add_argument("--doc-section", default=SECTION,
                   help=f"The section --write-docs writes (default {SECTION!r}).")
    args = p.parse_args(list(argv) if argv is not None else None)
    from loguru import logger

    from benchmarks.__main__ import local_cluster

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    spy = py_spy_binary() if args.py_spy else None
    if args.py_spy and spy is None:
        raise SystemExit("py-spy is not installed (pip install py-spy)")
    started = time.monotonic()
    results = []
    runs = args.runs or [(vms, w) for vms in args.vms for w in args.workers]
    # Room for one run's floor pods and its controller's at once (the floor's namespace
    # goes at the end of its run), so no pod waits unschedulable in either.
    with local_cluster(args.state_dir, args.nodes, pods=2 * max(n for n, _ in runs) + 50) \
            as cluster, revision_tree(args.baseline) as tree:
        counts = list(dict.fromkeys(vms for vms, _ in runs))
        for vms in counts:
            if tree is not None and (args.baseline_sizes is None or vms in args.baseline_sizes):
                say(f"== baseline {args.baseline}: {vms} VMs, {args.baseline_workers} workers")
                results.append(run_once(cluster, vms, args.baseline_workers, args.replicas,
                                        spy, args.rate, args.out, args.log_level,
                                        label=f"baseline ({args.baseline})", tree=tree,
                                        env=args.baseline_env))
                print(report(results[-1]), flush=True)
                print(flush=True)
            for workers in [w for n, w in runs if n == vms]:
                say(f"== {vms} VMs, {workers} workers")
                last = (vms, workers) == runs[-1] and args.state_dir is None
                results.append(run_once(cluster, vms, workers, args.replicas, spy, args.rate,
                                        args.out, args.log_level, clean_up=not last,
                                        env=args.env))
                print(report(results[-1]), flush=True)
                print(flush=True)
    table = sweep_table(results)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(
            [{k: v for k, v in r.items() if k != "samples"} for r in results], default=str))
    if args.write_docs:
        given = sys.argv[1:] if argv is None else list(argv)
        cmd = "python -m benchmarks.converge_profile " + " ".join(
            f"'{a}'" if " " in a else a for a in given if a != "--write-docs")
        env = (f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `{cmd.strip()}`, "
               f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs shared with other "
               f"work; {time.monotonic() - started:.0f} s in all.")
        text = "\n\n".join([args.doc_section, _doc_intro(), table, env]
                           + [report(r) for r in results]) + "\n"
        replace_section(DOC, args.doc_section, text)
        print(f"wrote {DOC.relative_to(ROOT)}", file=sys.stderr)
    return 0


def _doc_intro() -> str:
    return ("Generated by `python -m benchmarks.converge_profile` (see its docstring). One "
            "run per row: the raw floor at the same thread count (and HTTP pool), then N VMs "
            "created at once for 3 replicas with that many workers, until every pod is "
            "ungated. *Worker busy* is the leader's workers' turn time "
            "(`neonvm_controller_turn_duration_seconds`) over workers x the run. "
            "The breakdowns below each give the per-VM timeline from watch events, the CPU "
            "seconds of every process taking part, and, when sampled, where the leader's "
            "workers spent their time (py-spy).")


if __name__ == "__main__":
    sys.exit(main())
