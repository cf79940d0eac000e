"""The fault-injection campaign: seeded schedules of faults against one control plane.

Sieve (OSDI '22) sorts the bugs of cluster controllers into three classes; every schedule
exercises at least one, and most all three:

* **intermediate states**: the leader crashes right after one reconcile step
  (``crash_after=<step>@<n>``; the step cycles with the schedule index, so any run of
  ``len(CRASH_STEPS)`` consecutive schedules crashes after every step), is SIGKILLed /
  SIGTERMed at a random moment, or is paused (SIGSTOP) the moment it is seen writing a
  VM's status after runner pods were deleted (its workers are then between a read and
  their next write) until another replica leads, then woken with its stale snapshots
  and pending writes;
* **unobserved states**: watch events dropped (``drop_watch_events``), VMs deleted and
  re-created under the same name;
* **stale states**: the cache answers with older versions (``stale_reads``), another
  writer bumps the VM between read and write (``conflict``), locks are broken, and etcd,
  the locks' etcd or the API server restart.

A :class:`~neonvm.drills.schedule.Schedule` is a pure function of ``(seed, index)``
(:func:`~neonvm.drills.schedule.generate`, in :mod:`neonvm.drills.schedule`, re-exported
here), so a failure is replayed with ``neonvm drill campaign --seed S --schedule N``.

Running one schedule (:func:`run_schedule`) on a shared control plane:

1. its own namespace, Lease (in that namespace) and etcd lock prefix, and two controller
   replicas that watch only that namespace: schedules never see each other's VMs;
2. replica 0 starts with the crash and the schedule's leader faults and takes the Lease;
   replica 1 stands by with its own faults. A supervisor restarts any replica that dies,
   without the crash fault (as a kubelet restarts a container). It learns that the
   crash fault fired (rather than a kill) from a file, not the log: the leader runs with
   ``crash_record=<state>/run/<replica>.crash.json``, a JSON record the fault writes just
   before it exits;
3. the :class:`~neonvm.drills.observer.Watchdog` watches every pod revision from before
   the first VM exists; the VMs are created, the disruptions fire at their offsets;
4. the VMs must converge, first with the faults still on; if they do not within
   ``converge_timeout``, faults stop (replicas restarted clean) and they must converge
   then (the invariant's "once faults stop"); the first case is only a note;
5. the VMs are deleted: every pod and every lock of the schedule must go, and a final
   :func:`~neonvm.drills.check.check` must find nothing.

A schedule fails on any duplicate (strict or loose) at any revision, on no convergence
once faults stopped, and on anything left behind. Nothing is judged by elapsed time
except those generous bounds.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from neonvm import kube
from neonvm.controller.faults import read_crash_record
from neonvm.dev.replica import DEV_RUNNER_IMAGE, controller_argv
from neonvm.drills import fleet
from neonvm.drills.check import LockView, check
from neonvm.drills.observer import Watchdog
from neonvm.drills.schedule import (
    CLUSTER_WIDE,
    CRASH_STEPS,
    DISRUPTIONS,
    SCHEDULES_ENV,
    SEED_ENV,
    Disruption,
    Schedule,
    campaign_seed,
    generate,
)
from neonvm.drills.target import restart_component
from neonvm.leader.election import LeaseClient

__all__ = [
    "CLUSTER_WIDE", "CRASH_STEPS", "DISRUPTIONS", "LEASE_ARGS", "RESYNC_SECONDS",
    "SCHEDULES_ENV", "SEED_ENV", "CampaignResult", "Disruption", "Schedule", "ScheduleResult",
    "ScheduleRun", "campaign_seed", "generate", "run_campaign", "run_schedule",
]

Progress = Callable[[str], None]

RESYNC_SECONDS = 10
LEASE_ARGS = ["--lease-duration", "4", "--renew-deadline", "3", "--retry-period", "0.5",
              "--session-ttl", "4", "--plan-requeue", "1", "--resync", str(RESYNC_SECONDS),
              "--sweep", "3"]


# ---- running ------------------------------------------------------------------------------


@dataclass
class ScheduleResult:
    schedule: Schedule
    ok: bool = False
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    crashes: int = 0
    """Replica exits the supervisor saw (the crash fault, kills)."""
    crash_fired: bool = False
    """The scheduled crash_after fault actually fired."""
    leader_changes: int = 0
    pod_events: int = 0
    duplicates: int = 0
    converged_under_faults: bool = True

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["schedule"] = {**asdict(self.schedule), "classes": list(self.schedule.classes),
                           "replay": self.schedule.replay()}
        return out

    def failure_report(self) -> str:
        s = self.schedule
        lines = [f"FAILED {s.describe()}"]
        lines += [f"  - {f}" for f in self.failures]
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(f"  replay: {s.replay()}")
        lines.append(f"     or: {s.replay_pytest()}")
        return "\n".join(lines)


@dataclass
class CampaignResult:
    results: list[ScheduleResult] = field(default_factory=list)
    skipped: int = 0
    """Schedules not started because the budget ran out."""

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failed(self) -> list[ScheduleResult]:
        return [r for r in self.results if not r.ok]

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "ran": len(self.results), "skipped": self.skipped,
                "failed": len(self.failed), "results": [r.as_dict() for r in self.results]}

    def summary(self, seconds: float) -> str:
        ran = len(self.results)
        fired: dict[str, int] = {}
        for r in self.results:
            if r.crash_fired:
                fired[r.schedule.crash_step] = fired.get(r.schedule.crash_step, 0) + 1
        classes: dict[str, int] = {}
        for r in self.results:
            for c in r.schedule.classes:
                classes[c] = classes.get(c, 0) + 1
        kinds: dict[str, int] = {}
        for r in self.results:
            for d in r.schedule.disruptions:
                kinds[d.kind] = kinds.get(d.kind, 0) + 1
        lines = [
            f"campaign: {ran} schedule(s) in {seconds:.0f}s "
            f"({seconds / ran if ran else 0:.1f}s each), {len(self.failed)} failed, "
            f"{self.skipped} not started (budget)",
            f"  pod events watched: {sum(r.pod_events for r in self.results)}; "
            f"duplicates: {sum(r.duplicates for r in self.results)}; replica exits: "
            f"{sum(r.crashes for r in self.results)}; leader changes: "
            f"{sum(r.leader_changes for r in self.results)}",
            "  crash fired after: " + (", ".join(f"{k} x{v}" for k, v in sorted(fired.items()))
                                       or "-"),
            "  classes: " + ", ".join(f"{k} x{v}" for k, v in sorted(classes.items())),
            "  disruptions: " + ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())),
            f"  converged only after faults stopped: "
            f"{sum(1 for r in self.results if not r.converged_under_faults)}",
        ]
        for r in self.failed:
            lines.append(r.failure_report())
        return "\n".join(lines)


@dataclass
class _Slot:
    """One replica position; the supervisor keeps a process in it."""

    name: str
    faults: str
    identity: str = ""
    starts: int = 0
    stopped: bool = False
    """Stopped on purpose: not restarted."""


class ScheduleRun:
    """The live state of one schedule (see the module docstring)."""

    def __init__(self, cluster: Any, schedule: Schedule, progress: Progress,
                 restart_lock: threading.Lock, converge_timeout: float = 60.0) -> None:
        self.cluster = cluster
        self.schedule = schedule
        self.progress = progress
        self.restart_lock = restart_lock
        self.converge_timeout = converge_timeout
        tag = f"{schedule.seed % 100000}-{schedule.index}-{uuid.uuid4().hex[:4]}"
        self.namespace = f"campaign-{tag}"
        self.prefix = f"/neonvm-campaign/{tag}"
        self.api = kube.api_client(cluster.kubeconfig)
        self.result = ScheduleResult(schedule)
        self.rng = random.Random(f"run:{schedule.seed}:{schedule.index}")
        self.slots = [_Slot(f"campaign-{tag}-r0", schedule.leader_faults),
                      _Slot(f"campaign-{tag}-r1", schedule.standby_faults)]
        self.names = [f"vm-{i}" for i in range(schedule.vms)]
        self._stop = threading.Event()
        self._slots_lock = threading.Lock()
        self._started = time.monotonic()
        self._leaders: list[str] = []
        self._dog: Watchdog | None = None

    def say(self, msg: str) -> None:
        self.progress(f"[{self.schedule.index}:{time.monotonic() - self._started:5.1f}s] {msg}")

    # ---- replicas ----------------------------------------------------------------------

    def _argv(self, slot: _Slot) -> list[str]:
        return controller_argv(
            kubeconfig=str(self.cluster.kubeconfig_for("controller")),
            etcd_endpoints=self.cluster.locks_etcd_config(self.prefix), etcd_prefix=self.prefix,
            identity=slot.identity, health_host="127.0.0.1", lease_namespace=self.namespace,
            watch_namespace=self.namespace, runner_image=DEV_RUNNER_IMAGE, extra=LEASE_ARGS,
            faults=self._with_crash_record(slot))

    def _crash_record(self, slot: _Slot) -> Path:
        """Where the crash fault of ``slot`` writes its record when it fires."""
        return Path(self.cluster.state_dir) / "run" / f"{slot.name}.crash.json"

    def _with_crash_record(self, slot: _Slot) -> str:
        """The slot's faults, plus ``crash_record`` while they hold the crash."""
        if "crash_after" not in slot.faults:
            return slot.faults
        return f"{slot.faults},crash_record={self._crash_record(slot)}"

    def _start(self, slot: _Slot) -> None:
        slot.starts += 1
        slot.identity = f"{slot.name}-{slot.starts}-{uuid.uuid4().hex[:4]}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
        self.cluster.start_process(slot.name, self._argv(slot), env)

    def _alive(self, slot: _Slot) -> bool:
        alive: bool = self.cluster.process_alive(slot.name, Path(sys.executable).name)
        return alive

    def _supervise(self) -> None:
        while not self._stop.wait(0.2):
            self._track_leader()
            with self._slots_lock:
                for slot in self.slots:
                    if slot.stopped or self._alive(slot):
                        continue
                    self.result.crashes += 1
                    if "crash_after" in slot.faults:
                        if self._crash_fired(slot):
                            self.result.crash_fired = True
                        slot.faults = _without_crash(slot.faults)
                    self.say(f"{slot.identity} exited; restarting it")
                    self._start(slot)

    def _crash_fired(self, slot: _Slot) -> bool:
        """Did the replica that just exited die of its crash fault? Its record says so
        (written just before ``os._exit``); a kill or any other exit leaves none."""
        record = read_crash_record(self._crash_record(slot))
        return record is not None and record.get("fault") == "crash_after" \
            and record.get("step") == self.schedule.crash_step

    def _slot_of(self, identity: str) -> _Slot | None:
        return next((s for s in self.slots if s.identity == identity), None)

    def _leader(self) -> str | None:
        """The Lease holder now (None: none, or the API server is away)."""
        try:
            record = LeaseClient(self.api, self.namespace, "neonvm-controller").get(5.0)
        except Exception:  # the API server may be restarting: no answer, no leader
            return None
        return (record.holder if record is not None else None) or None

    def _track_leader(self) -> None:
        who = self._leader()
        if who and (not self._leaders or self._leaders[-1] != who):
            self._leaders.append(who)

    def _signal_leader(self, sig: signal.Signals) -> str:
        who = self._leader()
        slot = self._slot_of(who) if who else None
        if slot is None:
            return "no leader to signal"
        pid_file = self.cluster.state_dir / "run" / f"{slot.name}.pid"
        try:
            os.kill(int(pid_file.read_text()), sig)
        except (OSError, ValueError) as exc:
            return f"could not signal {who}: {exc}"
        return f"{sig.name} {who}"

    def _pause_leader(self, d: Disruption) -> str:
        """Stop the leader in the middle of re-plans, let another lead, then wake it.

        The woken process still holds the snapshots it read and the writes it was about
        to make: every one of them must be refused or harmless.
        """
        deadline = time.monotonic() + 20
        while (self._slot_of(self._leader() or "") is None
               and time.monotonic() < deadline):
            time.sleep(0.1)  # a crash or kill just before: wait for the next leader
        listed = fleet.retrying(lambda: client.CustomObjectsApi(
            self.api).list_namespaced_custom_object(
                "vm.neon.tech", "v1", self.namespace, "virtualmachines", _request_timeout=30))
        busy = self._disrupt(Disruption(d.at, "delete-pods", d.count))
        # Stop the leader the moment it is seen writing a VM's status in reaction: its
        # workers are then between a read and their next write.
        self._await_status_write(listed, timeout=5.0)
        who = self._leader()
        slot = self._slot_of(who) if who else None
        if slot is None:
            return f"{busy}; no leader to pause"
        pid = int((self.cluster.state_dir / "run" / f"{slot.name}.pid").read_text())
        os.kill(pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                now = self._leader()
                if now and now != who:
                    break
                time.sleep(0.1)
            again = self._disrupt(Disruption(d.at, "delete-pods", d.count))
            time.sleep(self.rng.uniform(0.5, 3.0))
        finally:
            os.kill(pid, signal.SIGCONT)
        return f"{busy}; paused {who} until {self._leader()} led; {again}; resumed it"

    def _await_status_write(self, listed: dict[str, Any], timeout: float) -> bool:
        """Until a VM's status differs from ``listed`` (a VM list); False on timeout."""
        before = {(i["metadata"]["name"]): i.get("status") for i in listed.get("items") or []}
        rv = (listed.get("metadata") or {}).get("resourceVersion")
        try:
            resp = client.CustomObjectsApi(self.api).list_namespaced_custom_object(
                "vm.neon.tech", "v1", self.namespace, "virtualmachines", watch=True,
                resource_version=rv, timeout_seconds=max(1, int(timeout)),
                _preload_content=False, _request_timeout=(5, timeout + 5))
        except Exception:
            return False
        try:
            for line in iter_resp_lines(resp):
                if not line:
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                name = (obj.get("metadata") or {}).get("name")
                if event.get("type") == "MODIFIED" and obj.get("status") != before.get(name):
                    return True
        except Exception:  # the API server restarting: pause now anyway
            return False
        finally:
            resp.release_conn()
        return False

    def _stop_replicas(self) -> None:
        with self._slots_lock:
            for slot in self.slots:
                slot.stopped = True
        for slot in self.slots:
            self.cluster.stop_component(slot.name, signal.SIGKILL)

    def _restart_clean(self) -> None:
        with self._slots_lock:
            for slot in self.slots:
                slot.stopped = True
            for slot in self.slots:
                self.cluster.stop_component(slot.name, signal.SIGKILL)
                slot.faults = ""
                slot.stopped = False
                self._start(slot)

    # ---- disruptions -------------------------------------------------------------------

    def _disrupt(self, d: Disruption) -> str:
        core = client.CoreV1Api(self.api)
        if d.kind == "delete-pods":
            chosen = set(self.rng.sample(self.names, min(d.count, len(self.names))))
            pods = [p for p in fleet.list_runner_pods(self.api, self.namespace)
                    if (p.metadata.labels or {}).get("vm.neon.tech/name") in chosen
                    and p.metadata.deletion_timestamp is None]
            for p in pods:
                self._expect_pod(p.metadata.name)
                with contextlib.suppress(ApiException):
                    core.delete_namespaced_pod(p.metadata.name, self.namespace)
            return f"deleted {len(pods)} pod(s)"
        if d.kind == "pause-leader":
            return self._pause_leader(d)
        if d.kind == "kill-leader":
            return self._signal_leader(signal.SIGKILL)
        if d.kind == "term-leader":
            return self._signal_leader(signal.SIGTERM)
        if d.kind == "break-locks":
            return f"broke {len(self._break_locks())} lock(s)"
        if d.kind == "recreate-vm":
            name = self.rng.choice(self.names)
            self._expect_vms([name])
            fleet.delete_vms(self.api, self.namespace, [name])
            custom = client.CustomObjectsApi(self.api)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    fleet.retrying(lambda: custom.create_namespaced_custom_object(
                        "vm.neon.tech", "v1", self.namespace, "virtualmachines",
                        fleet.vm_body(name, 1), _request_timeout=30))
                    return f"re-created {name}"
                except ApiException as exc:
                    if exc.status != 409:  # the old one is still being finalized
                        raise
                time.sleep(0.2)
            return f"could not re-create {name} within 60s (the old VM is still there)"
        if d.kind in CLUSTER_WIDE:
            component = {"restart-locks-etcd": "locks-etcd", "restart-etcd": "etcd",
                         "restart-apiserver": "kube-apiserver"}[d.kind]
            with self.restart_lock:
                down = restart_component(self.cluster, component, signal.SIGKILL)
            return f"crashed and restarted {component} ({down:.1f}s down)"
        raise ValueError(f"unknown disruption {d.kind}")

    def _expect_pod(self, name: str) -> None:
        if self._dog is not None:
            self._dog.watcher.expect_pod_deletion(name)

    def _expect_vms(self, names: Sequence[str]) -> None:
        """Announce to the checker that these VMs (by uid) are about to be deleted."""
        if self._dog is None:
            return
        for vm in fleet.list_vms(self.api, self.namespace):
            if vm["metadata"]["name"] in names:
                self._dog.watcher.expect_vm_deletion(str(vm["metadata"].get("uid")))

    def _etcd(self) -> Any:
        from neonvm.leader.etcd import Etcd

        config = self.cluster.locks_etcd_config(self.prefix)
        return Etcd(config), config

    def _locks(self) -> list[LockView]:
        from neonvm.leader.lock import LockTable

        def read() -> list[LockView]:
            etcd, config = self._etcd()
            with etcd:
                return [LockView(i.namespace, i.name, i.record.vm_uid if i.record else None,
                                 i.record.holder if i.record else None, i.token)
                        for i in LockTable(etcd, config.prefix).list()]

        return fleet.retrying(read)

    def _break_locks(self) -> list[str]:
        from neonvm.leader.lock import LockTable

        etcd, config = self._etcd()
        with etcd:
            table = LockTable(etcd, config.prefix)
            return [f"{i.namespace}/{i.name}" for i in table.list()
                    if table.break_lock(i.namespace, i.name) is not None]

    # ---- the run -----------------------------------------------------------------------

    def run(self) -> ScheduleResult:
        self.say(self.schedule.describe())
        supervisor = threading.Thread(target=self._supervise, daemon=True)
        try:
            fleet.ensure_namespace(self.api, self.namespace)
            with Watchdog(self.api, self.namespace, poll_interval=0.3) as dog:
                self._dog = dog
                self._start(self.slots[0])
                deadline = time.monotonic() + 60
                while self._leader() != self.slots[0].identity and time.monotonic() < deadline:
                    time.sleep(0.1)
                self._start(self.slots[1])
                supervisor.start()
                self._phases()
                report = dog.stop()
            self.result.pod_events = report.watch.events
            self.result.duplicates = len(report.strict)
            for v in report.strict + report.loose:
                self.result.failures.append(
                    f"{'strict' if v.strict else 'loose'} duplicate: {v.vm} had "
                    f"{', '.join(v.pods)} live at resourceVersion {v.resource_version}")
            for u in report.watch.unexpected_deletions:
                self.result.failures.append(
                    f"lost work: live runner pod {u.pod} of {u.vm} was deleted at "
                    f"resourceVersion {u.resource_version}, though its VM lives and the "
                    f"schedule did not delete it")
            if report.watch.gaps:
                self.result.notes.append(f"pod watch re-listed {report.watch.gaps} time(s)")
        except Exception as exc:
            self.result.failures.append(f"the schedule could not run: {kube.short_error(exc)}")
        finally:
            self._stop.set()
            if supervisor.is_alive():
                supervisor.join(timeout=5)
            self._stop_replicas()
            self._teardown()
        self.result.leader_changes = max(0, len(self._leaders) - 1)
        self.result.seconds = round(time.monotonic() - self._started, 1)
        self.result.ok = not self.result.failures
        return self.result

    def _phases(self) -> None:
        fleet.create_vms(self.api, self.namespace, self.names, 1)
        t0 = time.monotonic()
        for d in self.schedule.disruptions:
            delay = t0 + d.at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                self.say(f"{d.kind}: {self._disrupt(d)}")
            except Exception as exc:
                if not fleet.transient(exc):
                    raise
                self.result.notes.append(f"{d.kind} skipped: {kube.short_error(exc)}")
        ok, seconds, state = fleet.wait_converged(self.api, self.namespace, self.names,
                                                  self.converge_timeout)
        if not ok:
            self.result.converged_under_faults = False
            self.result.notes.append(
                f"not converged {seconds:.0f}s after the disruptions with faults on "
                f"({dict(list(state.waiting.items())[:3])}); stopping the faults")
            self._restart_clean()
            ok, seconds, state = fleet.wait_converged(self.api, self.namespace, self.names,
                                                      self.converge_timeout * 2)
            if not ok:
                self.result.failures.append(
                    f"not converged {seconds:.0f}s after the faults stopped: "
                    f"{dict(list(state.waiting.items())[:5])}")
                return
        self._expect_vms(self.names)
        fleet.delete_vms(self.api, self.namespace)
        gone, seconds, left = fleet.wait_gone(self.api, self.namespace, 90)
        if not gone:
            self.result.failures.append(f"VMs deleted, but after {seconds:.0f}s: {left}")
            return
        deadline = time.monotonic() + 30
        locks = self._locks()
        while locks and time.monotonic() < deadline:
            time.sleep(0.5)
            locks = self._locks()
        if locks:
            self.result.failures.append(
                f"locks left 30s after their VMs were deleted: "
                f"{[f'{lk.namespace}/{lk.name} ({lk.holder})' for lk in locks]}")
        # A lock can be re-taken for a VM that is already gone, by a reconcile that
        # started from a cache still holding it (its DELETED event dropped); the leader
        # gives it up at its next direct re-read (--resync) or sweep. So findings must
        # persist across a resync to count.
        report = fleet.retrying(lambda: check(self.api, namespace=self.namespace,
                                              locks=self._locks, settle=RESYNC_SECONDS + 5))
        for note in report.notes:
            self.result.notes.append(f"final check: {note}")
        for f in report.findings:
            self.result.failures.append(f"check: {f.kind} {f.vm}: {f.detail}")

    def _teardown(self) -> None:
        with contextlib.suppress(Exception):
            fleet.drop_namespace(self.api, self.namespace)
        with contextlib.suppress(Exception):
            etcd, _config = self._etcd()
            with etcd:
                for kv in etcd.get_prefix(self.prefix + "/").kvs:
                    etcd.delete(kv.key)
        self.api.close()


def _without_crash(spec: str) -> str:
    return ",".join(p for p in spec.split(",") if not p.strip().startswith("crash_after"))


def run_schedule(cluster: Any, schedule: Schedule, progress: Progress,
                 restart_lock: threading.Lock | None = None) -> ScheduleResult:
    return ScheduleRun(cluster, schedule, progress, restart_lock or threading.Lock()).run()


def run_campaign(cluster: Any, schedules: Sequence[Schedule], progress: Progress,
                 budget: float | None = None, stop_at_first_failure: bool = False,
                 workers: int = 1, minimum: int = 0) -> CampaignResult:
    """Run ``schedules`` on one control plane, ``workers`` at a time (module docstring).

    Schedules are isolated by namespace, Lease and lock prefix, so several can share the
    control plane; only the restarts of etcd, the locks' etcd and the API server are
    serialised, and a concurrent schedule lives through them as an extra fault. No new
    schedule starts once ``budget`` seconds have passed, except while fewer than
    ``minimum`` have started (the first ``len(CRASH_STEPS)`` crash after every step).
    """
    result = CampaignResult()
    started = time.monotonic()
    restart_lock = threading.Lock()
    pending = list(schedules)
    stop = threading.Event()
    lock = threading.Lock()

    def worker() -> None:
        while not stop.is_set():
            with lock:
                if not pending:
                    return
                begun = len(schedules) - len(pending)
                if (budget is not None and time.monotonic() - started > budget
                        and begun >= minimum):
                    return
                schedule = pending.pop(0)
            try:
                outcome = run_schedule(cluster, schedule, progress, restart_lock)
            except Exception as exc:  # a driver bug must fail the campaign, not vanish
                outcome = ScheduleResult(schedule, failures=[
                    f"the driver failed: {kube.short_error(exc)}"])
            with lock:
                result.results.append(outcome)
                done = len(result.results)
            progress(f"schedule {schedule.index}: {'ok' if outcome.ok else 'FAILED'} in "
                     f"{outcome.seconds:.0f}s ({done}/{len(schedules)} done, "
                     f"{time.monotonic() - started:.0f}s total)")
            if not outcome.ok:
                progress(outcome.failure_report())
                if stop_at_first_failure:
                    stop.set()

    threads = [threading.Thread(target=worker, name=f"campaign-{i}", daemon=True)
               for i in range(max(1, workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.skipped = len(pending)
    if result.skipped:
        progress(f"{result.skipped} schedule(s) not started (budget {budget}s or a failure)")
    result.results.sort(key=lambda r: r.schedule.index)
    return result
