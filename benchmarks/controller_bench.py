"""Controller benchmarks, each figure next to a baseline measured in the same run.

* **convergence**: N VMs created at once until every one has converged (one runner pod,
  ungated, named ``status.podName``), as VMs/s; next to the *raw API write rate* of a bare
  client doing the three writes a VM needs at the least (status PUT to record the plan,
  pod create, status PUT to commit) with as many threads as the controller has workers,
  on VMs no controller watches. The controller's own writes per VM are read from its
  ``/metrics`` (``neonvm_controller_actions_total`` that took effect).
* **replacement**: a runner pod deleted -> its replacement created (gated), and the old
  pod gone -> the replacement ungated, p50/p99, over a sequence of single deletions.
* **failover**: SIGKILL and SIGTERM of the leader -> another replica holds the Lease,
  next to the Lease duration.
* **memory**: the leader's RSS with N VMs, next to a standby's RSS in the same run.

Every replica is a real ``neonvm controller run`` process with its own Lease and lock
prefix, watching only the benchmark's namespace.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm import kube
from neonvm.api import types
from neonvm.api.types import Fence, PendingPod
from neonvm.controller import action_table, podspec
from neonvm.controller import actions as act
from neonvm.controller import decide as d
from neonvm.controller.cluster import KubeCluster, VMRecord
from neonvm.controller.config import ControllerConfig, http_pool_size
from neonvm.controller.informer import Informer, Obj, Store
from neonvm.controller.podspec import PodDefaults
from neonvm.dev.replica import ALLOCATOR_ENV
from neonvm.drills import fleet
from neonvm.drills.observer import PodWatchChecker, percentile
from neonvm.leader.election import LeaseClient

Progress = Callable[[str], None]

LEASE = {"duration": 6.0, "renew": 4.0, "retry": 1.0}
WORKERS = ControllerConfig().workers
"""The replicas' workers: the controller's default (``--workers``). The floor runs with as
many threads, on an HTTP pool as large as the controller's (:func:`http_pool_size`)."""


@dataclass
class Replica:
    name: str
    identity: str




@dataclass
class ReplicaSet:
    """Controller replicas on ``cluster`` watching ``namespace`` only (own Lease, prefix)."""

    cluster: Any
    namespace: str
    count: int = 3
    members: list[Replica] = field(default_factory=list)
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    workers: int = WORKERS
    log_level: str | None = None
    """The replicas' log level (default: ``$BENCH_LOG_LEVEL``, else INFO)."""
    env: dict[str, str] = field(default_factory=lambda: dict(ALLOCATOR_ENV))
    """Set in each replica's environment, over this process's (less ``NEONVM_*``)."""

    def _etcd_args(self) -> list[str]:
        etcd = self.cluster.locks_etcd_config(f"/neonvm-bench/{self.tag}")
        return ["--etcd-endpoints", etcd.endpoints[0], "--etcd-ca", str(etcd.ca),
                "--etcd-cert", str(etcd.cert), "--etcd-key", str(etcd.key),
                "--etcd-prefix", etcd.prefix]

    def _argv(self, identity: str) -> list[str]:
        return [sys.executable, "-m", "neonvm", "--log-format", "json", "--log-level",
                self.log_level or os.environ.get("BENCH_LOG_LEVEL", "INFO"), "controller", "run",
                "--kubeconfig", str(self.cluster.kubeconfig_for("controller")),
                *self._etcd_args(),
                "--identity", identity, "--health-port", "0", "--health-host", "127.0.0.1",
                "--lease-namespace", self.namespace, "--watch-namespace", self.namespace,
                "--lease-duration", str(LEASE["duration"]),
                "--renew-deadline", str(LEASE["renew"]),
                "--retry-period", str(LEASE["retry"]), "--workers", str(self.workers),
                "--runner-image", "neonvm-runner:dev"]

    def start(self, index: int) -> Replica:
        name = f"bench-{self.tag}-{index}"
        identity = f"{name}-{uuid.uuid4().hex[:4]}"
        import os

        env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
        env.update(self.env)
        self.cluster.start_process(name, self._argv(identity), env)
        replica = Replica(name, identity)
        self.members = [m for m in self.members if m.name != name] + [replica]
        return replica

    def start_all(self) -> None:
        for i in range(self.count):
            self.start(i)

    def stop_all(self) -> None:
        for m in self.members:
            self.cluster.stop_component(m.name, signal.SIGKILL)

    def pid(self, replica: Replica) -> int:
        return int((self.cluster.state_dir / "run" / f"{replica.name}.pid").read_text())

    def by_identity(self, identity: str) -> Replica | None:
        return next((m for m in self.members if m.identity == identity), None)

    def metrics_port(self, replica: Replica) -> int | None:
        try:
            text = self.cluster.log_file(replica.name).read_text(errors="replace")
        except OSError:
            return None
        ports = re.findall(r"/metrics on 127\.0\.0\.1:(\d+)", text)
        return int(ports[-1]) if ports else None

    def __enter__(self) -> ReplicaSet:
        self.start_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def leader_of(api: client.ApiClient, namespace: str) -> str | None:
    try:
        record = LeaseClient(api, namespace, "neonvm-controller").get(5.0)
    except Exception:
        return None
    return (record.holder if record else None) or None


def wait_for_leader(api: client.ApiClient, namespace: str, timeout: float = 120.0,
                    other_than: str | None = None) -> tuple[str, float]:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        who = leader_of(api, namespace)
        if who and who != other_than:
            return who, time.monotonic() - started
        time.sleep(0.05)
    raise RuntimeError(f"no leader in {namespace} after {timeout:.0f}s")


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """Resident memory (``VmRSS``) or its peak (``VmHWM``) of ``pid``, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def scrape_actions(port: int) -> dict[str, float]:
    """``neonvm_controller_actions_total{outcome="done"}`` by action."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'neonvm_controller_actions_total\{action="(\w+)",outcome="done"\} '
                         r'([0-9.e+]+)', text):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


# ---- convergence, from watch events (nothing polls) --------------------------------------

STAGES = ("created", "finalizer", "plan", "pod", "commit", "ungated", "pod_running",
          "vm_running")
"""A VM's way to a running pod, in order (what :class:`Timeline` records)."""


class Timeline:
    """First time each VM reached each stage, from this script's own informers."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.at: dict[str, dict[str, float]] = defaultdict(dict)
        self._lock = threading.Lock()
        self.ungated = threading.Event()
        self.running = threading.Event()
        self.pods_running = threading.Event()
        self.expected: set[str] = set()
        """The VMs waited for: set before they are created."""
        self._reached: Counter[str] = Counter()
        custom = client.CustomObjectsApi(api)
        core = client.CoreV1Api(api)

        def list_vms(**kw: Any) -> Any:
            return custom.list_namespaced_custom_object(types.GROUP, types.VERSION,
                                                        namespace, types.PLURAL, **kw)

        def list_pods(**kw: Any) -> Any:
            return core.list_namespaced_pod(namespace, label_selector=types.LABEL_VM_NAME,
                                            **kw)

        self.informers = [Informer("vms", list_vms, Store(), self._on_vm),
                          Informer("pods", list_pods, Store(), self._on_pod)]

    def start(self) -> None:
        for informer in self.informers:
            informer.start()
        for informer in self.informers:
            informer.synced.wait(30)

    def stop(self) -> None:
        for informer in self.informers:
            informer.stop(timeout=1.0)

    def mark(self, name: str, stage: str, when: float | None = None) -> None:
        with self._lock:
            stages = self.at[name]
            if stage in stages:
                return
            stages[stage] = time.time() if when is None else when
            if name not in self.expected:
                return
            self._reached[stage] += 1
            if self._reached[stage] == len(self.expected):
                if stage == "ungated":
                    self.ungated.set()
                elif stage == "vm_running":
                    self.running.set()
                elif stage == "pod_running":
                    self.pods_running.set()

    def _on_vm(self, key: str, old: Obj | None, new: Obj | None) -> None:
        if new is None:
            return
        name = new["metadata"]["name"]
        status = new.get("status") or {}
        if types.FINALIZER in (new["metadata"].get("finalizers") or []):
            self.mark(name, "finalizer")
        if status.get("pendingPod"):
            self.mark(name, "plan")
        if status.get("podName"):
            self.mark(name, "commit")
        if status.get("phase") == "Running":
            self.mark(name, "vm_running")

    def _on_pod(self, key: str, old: Obj | None, new: Obj | None) -> None:
        if new is None:
            return
        vm = ((new["metadata"].get("labels") or {}).get(types.LABEL_VM_NAME)) or ""
        if not vm:
            return
        self.mark(vm, "pod")
        gates = (new.get("spec") or {}).get("schedulingGates") or []
        if not any(g.get("name") == types.SCHEDULING_GATE for g in gates):
            self.mark(vm, "ungated")
        if (new.get("status") or {}).get("phase") == "Running":
            self.mark(vm, "pod_running")


# ---- baseline: raw API writes ------------------------------------------------------------


def bench_vm_body(name: str) -> dict[str, Any]:
    """The benchmarks' VM: the drills' small VM with ``enableAcceleration: false``.

    The simulated nodes have no KVM and the benchmark's controller runs without
    ``--kvm-resource``, so a VM asking for acceleration (NeonVM's default) would get an
    ``AccelerationUnavailable`` condition write and a Warning event that a production
    controller (with ``--kvm-resource``) never makes, and that the raw floor does not
    make either. Asking for none keeps the comparison like for like."""
    body = fleet.vm_body(name, 1)
    body["spec"]["enableAcceleration"] = False
    return body


def create_vms(api: client.ApiClient, namespace: str, names: list[str],
               threads: int = WORKERS) -> dict[str, dict[str, Any]]:
    """Create the benchmarks' VMs (:func:`bench_vm_body`), ``threads`` at a time; the
    create answers by name (a VM that already existed is read instead)."""
    custom = client.CustomObjectsApi(api)

    def one(name: str) -> tuple[str, dict[str, Any]]:
        try:
            obj = fleet.retrying(lambda: custom.create_namespaced_custom_object(
                types.GROUP, types.VERSION, namespace, types.PLURAL, bench_vm_body(name),
                _request_timeout=30))
        except ApiException as exc:
            if exc.status != 409:
                raise
            obj = custom.get_namespaced_custom_object(types.GROUP, types.VERSION, namespace,
                                                      types.PLURAL, name)
        return name, obj

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(names)))) as pool:
        return dict(pool.map(one, names))


FLOOR_WRITES = 4
"""The writes of :func:`floor_rate` per VM: plan, pod create, commit, ungate."""

FLOOR_FENCE = Fence(epoch=1, token=1)


def floor_rate(cluster: Any, api: client.ApiClient, namespace: str, vms: int,
               threads: int = WORKERS, progress: Progress = print) -> dict[str, Any]:
    """The like-for-like floor: what a VM's way to an ungated runner pod costs with no
    controller logic at all.

    Per VM, the four writes no protocol can do without, exactly as the controller sends
    them: the plan (the controller's own status mutation, PUT ``/status`` with the
    resourceVersion), the pod (the controller's template, :func:`podspec.runner_pod`, as
    raw JSON), the commit (its mutation again), and the ungate (its JSON patch with the
    same preconditions). The same identity and RBAC (the controller's kubeconfig), as
    many threads as the controller has workers, an HTTP pool as large as its, through
    the same :class:`~neonvm.controller.cluster.KubeCluster`. Left out, and so what the
    controller pays above the floor: the finalizer, the etcd lock, the quorum reads,
    Events and status syncs.

    The VMs are created first (not timed; they are the admin's, as the benchmark's are)
    in a namespace no controller watches, and their create answers are what the plan is
    written over, as a controller writes over its cache. The time is the same poller's as
    the controller's: from the first write to the last pod seen ungated by a
    :class:`Timeline` (watch events). The ungated pods are then scheduled and run by the
    simulated nodes, as the controller's are; this waits (boundedly) until they are
    Running, so that their tail does not land in the next measurement."""
    fleet.ensure_namespace(api, namespace)
    names = [f"raw-{i:04d}" for i in range(vms)]
    created = create_vms(api, namespace, names)
    progress(f"floor: {vms} VMs created in {namespace} (no controller watches it)")
    defaults = PodDefaults(runner_image="neonvm-runner:dev")
    timeline = Timeline(api, namespace)
    timeline.expected = set(names)
    timeline.start()
    mine = kube.api_client(cluster.kubeconfig_for("controller"),
                           pool_size=http_pool_size(threads))
    kube_cluster = KubeCluster(mine)
    latencies: list[float] = []
    lock = threading.Lock()

    def four_writes(name: str) -> None:
        t = time.perf_counter()
        record = VMRecord.from_raw(created[name])
        plan = PendingPod(name=d.plan_name(record.vm, 1), plan_seq=1,
                          token=FLOOR_FENCE.token, epoch=FLOOR_FENCE.epoch,
                          generation=record.vm.generation)
        planned = action_table.status_mutation(act.RecordPlan(plan=plan, observed_seq=0),
                                            FLOOR_FENCE)(record.vm)
        assert planned is not None
        record = kube_cluster.put_status(record, planned)
        pod = kube_cluster.create_pod(namespace, podspec.runner_pod(record.vm, plan, defaults))
        meta = pod["metadata"]
        commit = act.Commit(name=plan.name, uid=meta["uid"], built=podspec.built_size(meta),
                          slot_bytes=podspec.built_slot_bytes(meta))
        committed = action_table.status_mutation(commit, FLOOR_FENCE)(record.vm)
        assert committed is not None
        kube_cluster.put_status(record, committed)
        gates = [g.get("name") for g in pod["spec"].get("schedulingGates") or []]
        kube_cluster.ungate_pod(namespace, plan.name, uid=meta["uid"],
                                resource_version=meta["resourceVersion"],
                                gate_index=gates.index(types.SCHEDULING_GATE))
        with lock:
            latencies.append(time.perf_counter() - t)

    try:
        started = time.time()
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(four_writes, names))
        if not timeline.ungated.wait(60.0):
            raise RuntimeError("the floor's ungates were not all seen by the watch")
        seconds = max(timeline.at[n]["ungated"] for n in names) - started
        if not timeline.pods_running.wait(60 + vms * 0.2):
            progress("floor: not every floor pod is Running yet; measuring on")
    finally:
        timeline.stop()
        mine.close()
    return {"vms": vms, "threads": threads, "seconds": seconds,
            "writes_per_vm": FLOOR_WRITES,
            "writes_per_s": FLOOR_WRITES * vms / seconds, "vms_per_s": vms / seconds,
            "p50_ms": (percentile(latencies, 0.5) or 0) * 1000}


# ---- scenarios ---------------------------------------------------------------------------


def convergence(cluster: Any, vms: int, progress: Progress,
                clean_up: bool = True) -> dict[str, Any]:
    """N VMs at once, 3 replicas; VMs/s, writes per VM, RSS of leader and a standby.

    ``clean_up=False`` leaves the VMs for the cluster's teardown instead of deleting them
    through the controller (minutes at 10,000 VMs, and nothing is measured then)."""
    api = kube.api_client(cluster.kubeconfig, pool_size=http_pool_size(WORKERS))
    namespace = f"bench-converge-{uuid.uuid4().hex[:5]}"
    raw_ns = f"bench-raw-{uuid.uuid4().hex[:5]}"
    fleet.ensure_namespace(api, namespace)
    try:
        raw = floor_rate(cluster, api, raw_ns, vms, progress=progress)
        progress(f"floor: {raw['writes_per_s']:.0f} writes/s with {WORKERS} threads "
                 f"({raw['vms_per_s']:.1f} VMs/s at {FLOOR_WRITES} writes per VM)")
        with ReplicaSet(cluster, namespace) as replicas:
            leader, _ = wait_for_leader(api, namespace)
            standby = next(m for m in replicas.members if m.identity != leader)
            lead = replicas.by_identity(leader)
            assert lead is not None
            wait_metrics(replicas, lead)
            names = [f"vm-{i:04d}" for i in range(vms)]
            seconds, created = converge_watched(api, namespace, names, progress)
            port = replicas.metrics_port(lead)
            actions = scrape_actions(port) if port else {}
            leader_rss = rss_mib(replicas.pid(lead))
            leader_peak = rss_mib(replicas.pid(lead), "VmHWM")
            standby_rss = rss_mib(replicas.pid(standby))
            progress(f"{vms} VMs converged in {seconds:.1f}s ({vms / seconds:.1f} VMs/s); "
                     f"leader RSS {leader_rss:.0f} MiB (peak {leader_peak:.0f} MiB), "
                     f"standby {standby_rss:.0f} MiB")
            if clean_up:
                fleet.delete_vms(api, namespace)
                fleet.wait_gone(api, namespace, 60 + vms * 2.0)
        writes = sum(actions.values())
        return {"vms": vms, "seconds": seconds, "create_seconds": created,
                "vms_per_s": vms / seconds, "writes_per_vm": writes / vms if writes else None,
                "actions": actions, "raw": raw, "leader_rss_mib": leader_rss,
                "leader_peak_mib": leader_peak,
                "standby_rss_mib": standby_rss}
    finally:
        if clean_up:
            fleet.drop_namespace(api, namespace)
            fleet.drop_namespace(api, raw_ns)
        api.close()


def converge_watched(api: client.ApiClient, namespace: str, names: list[str],
                     progress: Progress) -> tuple[float, float]:
    """Create ``names`` and wait until each one's pod is ungated; (seconds from the last
    create's answer to the last ungate, seconds the creates took).

    The moments come from watch events (:class:`Timeline`): polling lists of every VM and
    pod took CPU from the controller it measures (every poll decoded every pod into the
    client's typed models, on the same two cores), and its interval was the figure's
    precision. One
    direct check at the end (:func:`neonvm.drills.fleet.convergence`: one pod, named
    ``status.podName``, ungated, no plan pending) confirms it; if it disagrees, polling
    goes on until it agrees."""
    timeline = Timeline(api, namespace)
    timeline.expected = set(names)
    timeline.start()
    try:
        started = time.monotonic()
        create_vms(api, namespace, names, threads=WORKERS)
        created_at = time.time()
        created = time.monotonic() - started
        timeout = 60 + len(names) * 3.0
        deadline = time.monotonic() + timeout
        while not timeline.ungated.wait(5.0):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(names)} VMs did not converge in {timeout:.0f}s")
            done = sum(1 for n in names if "ungated" in timeline.at.get(n, {}))
            progress(f"converging: {done}/{len(names)} ungated")
        last = max(timeline.at[n]["ungated"] for n in names)
        state = fleet.convergence(api, namespace, names)
        if len(state.converged) != len(names):
            ok, _, state = fleet.wait_converged(api, namespace, names, timeout, progress)
            if not ok:
                raise RuntimeError(f"{len(names)} VMs did not converge: "
                                   f"{len(state.converged)} did")
            last = time.time()
        return max(0.0, last - created_at), created
    finally:
        timeline.stop()


def wait_metrics(replicas: ReplicaSet, replica: Replica, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and replicas.metrics_port(replica) is None:
        time.sleep(0.2)


def replacement(cluster: Any, vms: int, deletions: int, progress: Progress) -> dict[str, Any]:
    """Delete one runner pod at a time, each of a different VM while there are VMs left
    (so no restart backoff is timed); time the replacement's creation and start."""
    api = kube.api_client(cluster.kubeconfig)
    namespace = f"bench-replace-{uuid.uuid4().hex[:5]}"
    fleet.ensure_namespace(api, namespace)
    core = client.CoreV1Api(api)
    try:
        with ReplicaSet(cluster, namespace):
            wait_for_leader(api, namespace)
            names = [f"vm-{i:04d}" for i in range(vms)]
            create_vms(api, namespace, names)
            ok, _, _ = fleet.wait_converged(api, namespace, names, 60 + vms * 3.0, progress)
            if not ok:
                raise RuntimeError("fleet did not converge")
            watcher = PodWatchChecker(api, namespace).start()
            watcher.synced.wait(30)
            running: list[float] = []
            try:
                for i in range(deletions):
                    name = names[i % len(names)]
                    pod = next(p for p in fleet.list_runner_pods(api, namespace)
                               if p.metadata.labels[types.LABEL_VM_NAME] == name
                               and p.metadata.deletion_timestamp is None)
                    t0 = time.monotonic()
                    core.delete_namespaced_pod(pod.metadata.name, namespace)
                    ok, _, _ = fleet.wait_converged(api, namespace, [name], 120,
                                                          interval=0.1)
                    if ok:
                        running.append(time.monotonic() - t0)
                    if (i + 1) % 10 == 0:
                        progress(f"replacement: {i + 1}/{deletions} deletions")
            finally:
                report = watcher.stop()
            created, started = watcher.clock.created, watcher.clock.started
            if report.strict:
                raise RuntimeError(f"duplicates during the benchmark: {report.strict}")
            fleet.delete_vms(api, namespace)
            fleet.wait_gone(api, namespace, 120)
        return {"deletions": deletions, "created": created, "started": started,
                "converged": running}
    finally:
        fleet.drop_namespace(api, namespace)
        api.close()


def failover(cluster: Any, kills: int, progress: Progress) -> dict[str, Any]:
    """Kill (SIGKILL) and stop (SIGTERM) the leader; time until another one holds the Lease."""
    api = kube.api_client(cluster.kubeconfig)
    namespace = f"bench-failover-{uuid.uuid4().hex[:5]}"
    fleet.ensure_namespace(api, namespace)
    results: dict[str, list[float]] = {"SIGKILL": [], "SIGTERM": []}
    try:
        with ReplicaSet(cluster, namespace) as replicas:
            create_vms(api, namespace, [f"vm-{i}" for i in range(5)])
            for sig in (signal.SIGKILL, signal.SIGTERM) * kills:
                leader, _ = wait_for_leader(api, namespace)
                # Let every standby be up and campaigning before the next kill.
                time.sleep(LEASE["duration"])
                member = replicas.by_identity(leader)
                if member is None:
                    raise RuntimeError(f"leader {leader} is not one of the benchmark's")
                t0 = time.monotonic()
                import os

                os.kill(replicas.pid(member), sig)
                _, seconds = wait_for_leader(api, namespace, other_than=leader)
                results[sig.name].append(time.monotonic() - t0)
                progress(f"failover after {sig.name}: {seconds:.2f}s")
                with contextlib.suppress(Exception):
                    replicas.cluster.stop_component(member.name, signal.SIGKILL)
                replicas.start(int(member.name.rsplit("-", 1)[1]))
            fleet.delete_vms(api, namespace)
            fleet.wait_gone(api, namespace, 60)
        return {"lease_duration_s": LEASE["duration"], "renew_deadline_s": LEASE["renew"],
                "retry_period_s": LEASE["retry"], **results}
    finally:
        fleet.drop_namespace(api, namespace)
        api.close()


@contextlib.contextmanager
def quiet_kube_errors() -> Iterator[None]:
    try:
        yield
    except ApiException as exc:
        raise RuntimeError(f"API server said {exc.status}: {exc.reason}") from None


def as_json(data: Any) -> str:
    return json.dumps(data, indent=2, default=str)
