"""The failover drills: one fault, an independent judge, a verdict.

Every drill has the same shape:

1. **fleet**: create ``vms`` VMs in a fresh drill namespace and wait until each has
   converged (one runner pod, ungated, named ``status.podName``);
2. **fault**, while the :class:`~neonvm.drills.observer.Watchdog` (a polling checker and
   a checker that sees every pod revision) and a Lease poller run. Drills that need the
   leader busy first *disturb* the fleet: they delete the runner pods of a share of the
   VMs (the original bug's trigger), so the fault lands in the middle of re-plans;
3. **convergence**: wait until every VM has converged again; then a final
   :func:`neonvm.drills.check.check` of the namespace (with locks when reachable);
4. **clean-up**: delete the VMs; every pod and every lock must go;
5. **verdict**: failover time (fault to a new leader in the Lease), convergence time
   (fault to all converged), duplicates seen (must be 0), and why it failed, if it did.

A verdict fails on any duplicate (strict or loose), a finding of the final check, no
convergence within ``timeout``, or a clean-up that does not finish. Timings are reported,
never judged: they depend on the machine and on the lease settings.
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm.drills import fleet, infra
from neonvm.drills.check import check
from neonvm.drills.observer import Watchdog
from neonvm.drills.target import DrillError, LeaderLog, LocalTarget, Target, leader_tracker
from neonvm.drills.timeline import Sampler, Timeline, render_svg

Progress = Callable[[str], None]

LOCAL_ONLY = ("stale-read", "etcd-restart", "apiserver-restart", *infra.INFRA)
DRILLS = ("kill-leader", "pause-leader", "pod-storm", "break-lock", *LOCAL_ONLY)


@dataclass(frozen=True)
class DrillOptions:
    vms: int = 10
    signal: str = "KILL"
    """kill-leader: KILL or TERM."""
    disturb: float = 0.2
    """Share of the VMs whose runner pods are deleted to keep the leader busy."""
    storm_seconds: float = 15.0
    rounds: int = 3
    """break-lock: rounds of breaking every lock of the drill namespace."""
    pause_seconds: float | None = None
    """pause-leader: how long to keep it stopped (default: until another leads, + 3 s)."""
    faults: str = "stale_reads=0.5,drop_watch_events=0.3,conflict=0.2"
    """stale-read: what the replicas run with during the drill."""
    seed: int | None = None
    timeout: float = 300.0
    grace_seconds: int = 1
    keep: bool = False
    """Leave the drill namespace and its VMs behind."""
    vm_spec: dict[str, Any] | None = None
    """Merged into every drill VM's spec (e.g. a node selector and a bootable guest, to
    run the runner pods on a real node); None: the small default VM."""
    outage_seconds: float = 60.0
    """etcd-outage: how long the locks' etcd stays stopped."""
    latency: float = 1.5
    """slow-api: seconds added to every request of every replica."""
    slow_seconds: float = 300.0
    """slow-api: how long the API server stays slow."""
    partition_seconds: float = 30.0
    """partition-etcd/-api: how long the victim is cut off."""
    victim: str = "leader"
    """partition-etcd/-api: the leader or a standby."""
    churn_interval: float = 5.0
    """Infrastructure drills: seconds between churn rounds during the fault."""
    churn_share: float = 0.1
    """Infrastructure drills: share of VMs whose pods each churn round deletes."""
    timeline: str | None = None
    """Write the drill's timeline as SVG to this path."""


@dataclass
class Verdict:
    drill: str
    target: str
    vms: int
    ok: bool = False
    failures: list[str] = field(default_factory=list)
    failover_seconds: float | None = None
    convergence_seconds: float | None = None
    setup_seconds: float | None = None
    cleanup_seconds: float | None = None
    duplicates: int = 0
    duplicates_loose: int = 0
    leader_before: str | None = None
    leader_after: str | None = None
    epoch_before: int | None = None
    epoch_after: int | None = None
    leader_changes: int = 0
    fault_seconds: float | None = None
    """How long the fault lasted (drills that record a window)."""
    recovery_seconds: float | None = None
    """From the end of the fault to every VM converged."""
    leader_changes_in_fault: int | None = None
    """Leader changes from the fault's start until every VM converged."""
    timeline_svg: str | None = None
    watch: dict[str, Any] = field(default_factory=dict)
    check: dict[str, Any] = field(default_factory=dict)
    fault: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    namespace: str = ""
    total_seconds: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        """Key/value lines for the table output."""

        def sec(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}s"

        out = [
            ("drill", self.drill), ("verdict", "PASS" if self.ok else "FAIL"),
            ("target", self.target), ("namespace", self.namespace), ("vms", str(self.vms)),
            ("failover", sec(self.failover_seconds)),
            ("convergence", sec(self.convergence_seconds)),
            ("fault lasted", sec(self.fault_seconds)),
            ("recovery", sec(self.recovery_seconds)),
            ("leader changes in fault", "-" if self.leader_changes_in_fault is None
             else str(self.leader_changes_in_fault)),
            ("duplicates (strict)", str(self.duplicates)),
            ("duplicates (loose)", str(self.duplicates_loose)),
            ("leader", f"{self.leader_before} (epoch {self.epoch_before}) -> "
                       f"{self.leader_after} (epoch {self.epoch_after}), "
                       f"{self.leader_changes} change(s)"),
            ("checker", f"{self.watch.get('pod_events', 0)} pod events watched, "
                        f"{self.watch.get('pod_lists', 0)} pod lists polled, "
                        f"{self.watch.get('watch_gaps', 0)} watch gap(s)"),
            ("setup", sec(self.setup_seconds)), ("clean-up", sec(self.cleanup_seconds)),
        ]
        if self.watch.get("replacements"):
            w = self.watch
            out.append(("replacement created", f"p50 {sec(w.get('created_p50_s'))}, "
                                                f"p99 {sec(w.get('created_p99_s'))} "
                                                f"({w['replacements']} replacements)"))
        for k, v in self.fault.items():
            out.append((f"fault: {k}", str(v)))
        out.append(("final check", "ok" if self.check.get("ok") else
                    f"{len(self.check.get('findings', []))} finding(s)"))
        if self.timeline_svg:
            out.append(("timeline", self.timeline_svg))
        for n in self.notes:
            out.append(("note", n))
        for f in self.failures:
            out.append(("FAILURE", f))
        return out


# ---- the drill context ------------------------------------------------------------------


@dataclass
class Drill:
    """One run of one drill: the target, the fleet, the judges and the record."""

    name: str
    target: Target
    options: DrillOptions
    progress: Progress
    namespace: str = ""
    names: list[str] = field(default_factory=list)
    rng: random.Random = field(default_factory=random.Random)
    dog: Watchdog | None = None
    fault: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    timeline: Timeline | None = None
    proxies: infra.Proxies | None = None
    fault_started: float | None = None
    fault_ended: float | None = None

    def begin_fault(self, label: str) -> float:
        """The fault window opens now (recorded on the timeline too)."""
        self.fault_started = time.monotonic()
        if self.timeline is not None:
            self.timeline.fault_begins(label)
        return self.fault_started

    def end_fault(self) -> None:
        self.fault_ended = time.monotonic()
        if self.timeline is not None:
            self.timeline.fault_ends()

    def fault_seconds(self) -> float:
        if self.fault_started is None:
            return 0.0
        return (self.fault_ended or time.monotonic()) - self.fault_started

    @property
    def api(self) -> client.ApiClient:
        return self.target.api

    def say(self, msg: str) -> None:
        self.progress(f"[{time.monotonic() - self.started:6.1f}s] {msg}")

    def wait_leader(self, timeout: float = 120.0) -> tuple[str, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(ApiException, OSError):
                info = self.target.leader()
                if info is not None:
                    return info.identity, info.epoch
            time.sleep(0.2)
        raise DrillError(f"no leader in {self.target.lease_namespace}/"
                         f"{self.target.lease_name} after {timeout:.0f}s: are controller "
                         f"replicas running?")

    def wait_new_leader(self, old: str, since: float, log: LeaderLog,
                        timeout: float = 120.0) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = log.first_other_than(old, since)
            if seen is not None:
                return seen[0] - since
            time.sleep(0.05)
        return None

    def expect(self, pod_name: str) -> None:
        """Tell the checker the drill itself deletes this pod (not lost work)."""
        if self.dog is not None:
            self.dog.watcher.expect_pod_deletion(pod_name)

    def disturb(self, share: float | None = None, quiet: bool = False) -> list[str]:
        """Delete the committed runner pods of a share of the VMs (at least one)."""
        share = self.options.disturb if share is None else share
        if share <= 0:
            return []
        count = max(1, round(len(self.names) * share))
        chosen = set(self.rng.sample(self.names, min(count, len(self.names))))
        pods = [p for p in fleet.list_runner_pods(self.api, self.namespace)
                if (p.metadata.labels or {}).get("vm.neon.tech/name") in chosen
                and p.metadata.deletion_timestamp is None]
        core = client.CoreV1Api(self.api)

        def delete(pod: Any) -> str:
            self.expect(pod.metadata.name)
            with contextlib.suppress(ApiException):
                core.delete_namespaced_pod(pod.metadata.name, self.namespace,
                                           _request_timeout=30)
            return str(pod.metadata.name)

        with ThreadPoolExecutor(max_workers=8) as pool:
            deleted = list(pool.map(delete, pods))
        if quiet:
            return deleted
        self.say(f"disturbed: deleted the runner pods of {len(deleted)} VM(s)")
        self.fault["pods deleted to disturb"] = self.fault.get(
            "pods deleted to disturb", 0) + len(deleted)
        return deleted


# ---- the drills ---------------------------------------------------------------------------


def _kill_leader(d: Drill, log: LeaderLog) -> float:
    sig = signal.SIGKILL if d.options.signal.upper() in ("KILL", "SIGKILL") else signal.SIGTERM
    leader, epoch = d.wait_leader()
    d.disturb()
    t0 = time.monotonic()
    d.say(f"sending {sig.name} to the leader {leader} (epoch {epoch})")
    d.target.signal_leader(leader, sig)
    d.fault["signal"] = sig.name
    failover = d.wait_new_leader(leader, t0, log)
    if failover is None:
        d.notes.append("no other leader was seen within 120s")
    else:
        d.say(f"new leader {log.current[0]} after {failover:.1f}s")
    d.fault["failover_s"] = failover
    healed = d.target.heal()
    if healed:
        d.say(f"restarted {', '.join(healed)} (as a kubelet would)")
    return t0


def _pause_leader(d: Drill, log: LeaderLog) -> float:
    leader, epoch = d.wait_leader()
    d.disturb()
    t0 = time.monotonic()
    d.say(f"SIGSTOP to the leader {leader} (epoch {epoch})")
    d.target.signal_leader(leader, signal.SIGSTOP)
    try:
        failover = d.wait_new_leader(leader, t0, log)
        d.fault["failover_s"] = failover
        if failover is not None:
            d.say(f"new leader {log.current[0]} after {failover:.1f}s; the old one is still "
                  f"stopped")
            d.disturb()  # the new leader works while the old one sleeps
        hold = d.options.pause_seconds
        remaining = (3.0 if hold is None else max(0.0, hold - (time.monotonic() - t0)))
        time.sleep(remaining)
    finally:
        d.target.signal_leader(leader, signal.SIGCONT)
    d.fault["paused_s"] = round(time.monotonic() - t0, 1)
    d.say(f"SIGCONT to {leader} after {d.fault['paused_s']}s: it wakes up believing it "
          f"leads and must do no harm")
    return t0


def _pod_storm(d: Drill, log: LeaderLog) -> float:
    d.wait_leader()
    core = client.CoreV1Api(d.api)
    stop = threading.Event()
    deleted = 0
    lock = threading.Lock()

    def storm(worker: int) -> None:
        nonlocal deleted
        while not stop.is_set():
            try:
                pods = fleet.list_runner_pods(d.api, d.namespace)
            except (ApiException, OSError):
                continue
            pods = [p for p in pods if p.metadata.deletion_timestamp is None]
            d.rng.shuffle(pods)
            for pod in pods[worker::4]:
                if stop.is_set():
                    return
                try:
                    d.expect(pod.metadata.name)
                    core.delete_namespaced_pod(pod.metadata.name, d.namespace,
                                               _request_timeout=30)
                    with lock:
                        deleted += 1
                except ApiException:
                    pass

    t0 = time.monotonic()
    d.say(f"deleting every runner pod of the namespace as fast as possible for "
          f"{d.options.storm_seconds:.0f}s")
    threads = [threading.Thread(target=storm, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    end = t0 + d.options.storm_seconds
    while time.monotonic() < end:
        time.sleep(min(3.0, max(0.0, end - time.monotonic())))
        d.say(f"storm: {deleted} pod deletions so far")
    stop.set()
    for t in threads:
        t.join(timeout=30)
    d.fault["pod deletions"] = deleted
    d.fault["storm_s"] = d.options.storm_seconds
    return t0


def _break_lock(d: Drill, log: LeaderLog) -> float:
    d.wait_leader()
    if d.target.lock_reader() is None:
        raise DrillError("break-lock needs the locks' etcd: set NEONVM_ETCD_ENDPOINTS")
    t0 = time.monotonic()
    broken = 0
    for round_ in range(d.options.rounds):
        d.disturb()
        time.sleep(0.3)
        gone = d.target.break_locks(d.namespace)
        broken += len(gone)
        d.say(f"round {round_ + 1}/{d.options.rounds}: broke {len(gone)} lock(s) "
              f"(as 'neonvm locks break --force')")
        time.sleep(1.0)
    d.fault["locks broken"] = broken
    return t0


def _local(d: Drill) -> LocalTarget:
    if not isinstance(d.target, LocalTarget):
        raise DrillError(f"{d.name} runs only against the local control plane (--state-dir)")
    return d.target


def _stale_read(d: Drill, log: LeaderLog) -> float:
    target = _local(d)
    seed = d.options.seed if d.options.seed is not None else d.rng.randrange(1 << 30)
    spec = f"{d.options.faults},seed={seed}"
    t0 = time.monotonic()
    d.say(f"restarting the {target.replicas} replicas with faults {spec}")
    target.restart_replicas(spec)
    d.fault["faults"] = spec
    leader, _ = d.wait_leader()
    d.say(f"{leader} leads with stale reads; deleting pods twice")
    d.disturb()
    time.sleep(2.0)
    d.disturb()
    ok, seconds, state = fleet.wait_converged(d.api, d.namespace, d.names, d.options.timeout,
                                              d.say)
    d.fault["converged_with_faults_s"] = round(seconds, 1) if ok else None
    if not ok:
        d.notes.append(f"not converged with faults on after {seconds:.0f}s: "
                       f"{dict(list(state.waiting.items())[:5])}")
    d.say("restoring the replicas without faults")
    target.restart_replicas(None)
    return t0


def _etcd_restart(d: Drill, log: LeaderLog) -> float:
    target = _local(d)
    d.wait_leader()
    d.disturb()
    t0 = time.monotonic()
    d.say("restarting the locks' etcd")
    d.fault["locks-etcd down_s"] = round(target.restart_component("locks-etcd"), 1)
    ok, seconds, _ = fleet.wait_converged(d.api, d.namespace, d.names, d.options.timeout, d.say)
    d.fault["converged after locks-etcd_s"] = round(seconds, 1) if ok else None
    d.disturb()
    d.say("restarting the API server's etcd")
    d.fault["etcd down_s"] = round(target.restart_component("etcd"), 1)
    return t0


def _apiserver_restart(d: Drill, log: LeaderLog) -> float:
    target = _local(d)
    d.wait_leader()
    d.disturb()
    d.say("restarting kube-apiserver, under churn")
    t0 = d.begin_fault("kube-apiserver restarted")
    with infra.churn(d):
        d.fault["kube-apiserver down_s"] = round(target.restart_component("kube-apiserver"), 1)
    d.end_fault()
    d.disturb()
    return t0


FAULTS: dict[str, Callable[[Drill, LeaderLog], float]] = {
    "kill-leader": _kill_leader,
    "pause-leader": _pause_leader,
    "pod-storm": _pod_storm,
    "break-lock": _break_lock,
    "stale-read": _stale_read,
    "etcd-restart": _etcd_restart,
    "apiserver-restart": _apiserver_restart,
    **infra.FAULTS,
}


# ---- running one ----------------------------------------------------------------------------


def run_drill(name: str, target: Target, options: DrillOptions, progress: Progress) -> Verdict:
    """Run drill ``name`` against ``target``; see the module docstring."""
    if name not in FAULTS:
        raise DrillError(f"unknown drill {name!r} (known: {', '.join(DRILLS)})")
    if name in LOCAL_ONLY and not target.local:
        raise DrillError(f"{name} runs only against the local control plane")
    rng = random.Random(options.seed)
    namespace = f"neonvm-drill-{name}-{uuid.uuid4().hex[:5]}"
    d = Drill(name, target, options, progress, namespace,
              [f"vm-{i:04d}" for i in range(options.vms)], rng)
    verdict = Verdict(drill=name, target=target.description, vms=options.vms,
                      namespace=namespace)
    api = target.api
    routes = infra.routed(d) if name in infra.ROUTED else contextlib.nullcontext(None)
    with routes as proxies:
        d.proxies = proxies
        d.say(f"creating {options.vms} VM(s) in namespace {namespace}")
        fleet.ensure_namespace(api, namespace)
        try:
            _run(d, verdict)
        finally:
            if not options.keep:
                _clean_up(d, verdict)
            verdict.total_seconds = round(time.monotonic() - d.started, 1)
            verdict.fault = d.fault
            verdict.notes += d.notes
            verdict.ok = not verdict.failures
            if options.timeline and d.timeline is not None:
                from pathlib import Path

                path = Path(options.timeline)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(render_svg(d.timeline))
                verdict.timeline_svg = str(path)
    return verdict


def _run(d: Drill, verdict: Verdict) -> None:
    api, options = d.api, d.options
    setup_started = time.monotonic()
    fleet.create_vms(api, d.namespace, d.names, options.grace_seconds,
                     spec_extra=options.vm_spec)
    ok, seconds, state = fleet.wait_converged(api, d.namespace, d.names, options.timeout,
                                              d.say)
    if not ok:
        verdict.failures.append(f"the fleet did not converge before the fault "
                                f"({len(state.converged)}/{state.total} after {seconds:.0f}s)")
        return
    verdict.setup_seconds = round(time.monotonic() - setup_started, 1)
    d.say(f"{options.vms} VM(s) converged in {verdict.setup_seconds:.1f}s; the checkers are "
          f"watching")
    tl = d.timeline = Timeline(f"neonvm drill {d.name}", options.vms)

    def read_fleet() -> tuple[list[Any], list[Any]]:
        return (fleet.list_runner_pods(api, d.namespace),
                [v for v in fleet.list_vms(api, d.namespace)
                 if v["metadata"]["name"] in set(d.names)])

    reader = _lock_reader(d)

    def read_locks() -> list[Any]:
        assert reader is not None
        return [lk for lk in reader() if lk.namespace == d.namespace]

    with leader_tracker(d.target) as log, \
            Watchdog(api, d.namespace, on_change=tl.on_pod_event) as dog, \
            Sampler(tl, read_fleet, read_locks if reader is not None else None,
                    vms_api=api, namespace=d.namespace):
        d.dog = dog
        before = d.wait_leader()
        verdict.leader_before, verdict.epoch_before = before
        ticker_stop = threading.Event()

        def tick() -> None:
            while not ticker_stop.wait(3.0):
                who, epoch = log.current
                d.say(f"leader {who} (epoch {epoch}); {dog.watcher.report.events} pod "
                      f"events; duplicates so far: {dog.duplicates_so_far()}")

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            t0 = FAULTS[d.name](d, log)
            if d.fault_started is None:  # a drill without a window of its own
                d.fault_started, d.fault_ended = t0, time.monotonic()
                tl.faults.append((t0, d.fault_ended, d.name))
            fault_end = d.fault_ended or time.monotonic()
            d.say("fault over; waiting for every VM to converge")
            ok, _, state = fleet.wait_converged(api, d.namespace, d.names, options.timeout,
                                                d.say)
            if ok:
                now = time.monotonic()
                verdict.convergence_seconds = round(now - t0, 1)
                verdict.recovery_seconds = round(max(0.0, now - fault_end), 1)
                verdict.fault_seconds = round(fault_end - d.fault_started, 1)
                verdict.leader_changes_in_fault = _changes_between(log, d.fault_started, now)
                d.say(f"converged {verdict.convergence_seconds:.1f}s after the fault began, "
                      f"{verdict.recovery_seconds:.1f}s after it ended")
            else:
                verdict.failures.append(
                    f"not converged {options.timeout:.0f}s after the fault: "
                    f"{dict(list(state.waiting.items())[:5])}")
            if verdict.failover_seconds is None and d.fault.get("failover_s") is not None:
                verdict.failover_seconds = round(float(d.fault["failover_s"]), 1)
            time.sleep(2.0)  # a last look: nothing may start after convergence either
        finally:
            ticker_stop.set()
            report = dog.stop()
        verdict.leader_after, verdict.epoch_after = log.current
        verdict.leader_changes = max(0, len([c for c in log.changes if c[1]]) - 1)
        tl.leaders = list(log.changes)
        tl.end = time.monotonic()
    verdict.watch = report.as_dict()
    verdict.duplicates = len(report.strict)
    verdict.duplicates_loose = len(report.loose)
    for v in report.strict + report.loose:
        verdict.failures.append(f"{'strict' if v.strict else 'loose'} duplicate: {v.vm} had "
                                f"{', '.join(v.pods)} live at resourceVersion "
                                f"{v.resource_version}")
    for u in report.watch.unexpected_deletions:
        verdict.failures.append(f"lost work: live runner pod {u.pod} of {u.vm} deleted at "
                                f"resourceVersion {u.resource_version}, though its VM lives "
                                f"and the drill did not delete it")
    if report.watch.gaps:
        d.notes.append(f"the pod watch broke {report.watch.gaps} time(s) (API server "
                       f"restart?): revisions in those gaps were seen only by polling")
    locks = _lock_reader(d)
    result = fleet.retrying(lambda: check(api, namespace=d.namespace, locks=locks, settle=5.0,
                                          max_pending_seconds=options.timeout))
    verdict.check = result.as_dict()
    for f in result.findings:
        verdict.failures.append(f"check: {f.kind} {f.vm}: {f.detail}")


def _changes_between(log: LeaderLog, start: float, end: float) -> int:
    """Leader changes (another holder or epoch) seen in [start, end]."""
    held = [(at, who, epoch) for at, who, epoch in log.changes if who]
    before = [c for c in held if c[0] < start]
    last = before[-1][1:] if before else None
    changes = 0
    for at, who, epoch in held:
        if start <= at <= end:
            if last is not None and (who, epoch) != last:
                changes += 1
            last = (who, epoch)
    return changes


def _lock_reader(d: Drill) -> Any:
    try:
        return d.target.lock_reader()
    except Exception as exc:  # no etcd access is a note, not a failure
        d.notes.append(f"locks not checked: {exc}")
        return None


def _clean_up(d: Drill, verdict: Verdict) -> None:
    api = d.api
    started = time.monotonic()
    d.say("deleting the VMs: every pod and lock must go")
    try:
        fleet.delete_vms(api, d.namespace)
        gone, _, left = fleet.wait_gone(api, d.namespace, d.options.timeout, d.say)
        if not gone:
            verdict.failures.append(f"clean-up unfinished: {left}")
        reader = _lock_reader(d)
        if reader is not None:
            deadline = time.monotonic() + 60
            left_locks = [lk for lk in reader() if lk.namespace == d.namespace]
            while left_locks and time.monotonic() < deadline:
                time.sleep(1.0)
                left_locks = [lk for lk in reader() if lk.namespace == d.namespace]
            if left_locks:
                verdict.failures.append(f"{len(left_locks)} lock(s) of deleted VMs left "
                                        f"after 60s")
        verdict.cleanup_seconds = round(time.monotonic() - started, 1)
    except (ApiException, OSError) as exc:
        verdict.failures.append(f"clean-up failed: {exc}")
    finally:
        fleet.drop_namespace(api, d.namespace)
