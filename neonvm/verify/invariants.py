"""What the explorer checks in every state, across every step, and once faults stop.

State invariants (every explored state):

* ``at-most-one-runnable`` — the promise (docs/protocol.md, strict form): at most one pod of
  the VM is not scheduling-gated and not gone. Terminating and finished pods count: a
  pod that is shutting down may still run its guest.
* ``at-most-one-running`` — the loose form a pod list shows: terminating pods ignored.
* ``runs-only-the-committed-pod`` — no pod outside the recorded plan runs: every ungated
  pod that is neither terminating nor finished is ``status.podName`` with
  ``status.podUID``, of a VM that exists.
* ``status-describes-its-pod`` — ``status.podIP`` is set only to the IP of the pod
  ``status.podUID`` (a status that shows another pod's address sends clients to it).
* ``adopts-only-its-own-pods`` — a pod the user planted (no fence annotations, or an
  older fence than the plan's) is never committed (``status.podUID``) and never ungated.

Step invariants (every explored transition):

* ``creates-only-recorded-plans`` — the controller creates a pod only under a name whose
  plan was recorded first (its sequence number is at most ``status.planSeq``); pods the
  user plants are not the controller's creates.
* ``plan-seq-monotonic``, ``restart-count-monotonic``, ``fence-monotonic`` — the status
  counters and the fence never go back (names are unique forever only if planSeq never
  goes back).
* ``spec-never-reverted`` — no write goes back to an older spec (a blind write would).

Liveness (from every explored state, once faults and adversaries stop; see
:class:`~neonvm.verify.explore.Liveness`):

* ``converges`` — a live VM ends with exactly one pod, ``status.podName`` with
  ``status.podUID``, ungated and Running, no plan pending, and a status that shows it; a
  VM in a terminal phase keeps only its finished pod;
* ``deleted-vm-leaves-nothing`` — a deleted VM ends with no pods and no lock.
"""

from __future__ import annotations

from typing import NamedTuple

from neonvm.verify.model import VM_NAME, VM_UID, World

STATE_INVARIANTS: dict[str, str] = {
    "at-most-one-runnable": "at most one pod is ungated and not gone (strict: terminating "
                            "and finished pods count)",
    "at-most-one-running": "at most one pod is ungated and not terminating (loose form)",
    "runs-only-the-committed-pod": "every ungated, non-terminating, unfinished pod is "
                                   "status.podName with status.podUID",
    "status-describes-its-pod": "status.podIP is the IP of the pod status.podUID",
    "adopts-only-its-own-pods": "a pod without the plan's fence (planted, with no fence or "
                                "an older one) is never committed or ungated",
}
STEP_INVARIANTS: dict[str, str] = {
    "creates-only-recorded-plans": "a pod is created only under a recorded plan name",
    "plan-seq-monotonic": "status.planSeq never decreases",
    "restart-count-monotonic": "status.restartCount never decreases",
    "fence-monotonic": "status.fence never decreases",
    "spec-never-reverted": "the spec never goes back to an older version",
}
LIVENESS_INVARIANTS: dict[str, str] = {
    "converges": "once faults stop, the leader converges on exactly one runner pod, "
                 "status.podName",
    "deleted-vm-leaves-nothing": "once faults stop, a deleted VM leaves no pods and no lock",
}
ALL_INVARIANTS: dict[str, str] = {**STATE_INVARIANTS, **STEP_INVARIANTS, **LIVENESS_INVARIANTS}
SAFETY = frozenset(STATE_INVARIANTS) | frozenset(STEP_INVARIANTS)


class Violation(NamedTuple):
    invariant: str
    message: str


def plan_seq_of(name: str) -> int | None:
    """The plan sequence number in a runner pod name made by ``decide.plan_name``."""
    prefix = f"{VM_NAME}-{VM_UID[:8]}-"
    if not name.startswith(prefix):
        return None
    try:
        return int(name[len(prefix):])
    except ValueError:
        return None


def check_state(w: World, enabled: frozenset[str]) -> Violation | None:
    runnable = [p for p in w.pods if not p.gated]
    if "at-most-one-runnable" in enabled and len(runnable) > 1:
        return Violation("at-most-one-runnable",
                         "runnable pods: " + ", ".join(f"{p.name}/{p.uid}" for p in runnable))
    running = [p for p in runnable if not p.terminating]
    if "at-most-one-running" in enabled and len(running) > 1:
        return Violation("at-most-one-running",
                         "running pods: " + ", ".join(f"{p.name}/{p.uid}" for p in running))
    vm = w.vm
    if "runs-only-the-committed-pod" in enabled:
        for p in running:
            if p.finished:
                continue
            if vm is None:
                return Violation("runs-only-the-committed-pod",
                                 f"{p.name}/{p.uid} runs but its VM is gone")
            s = vm.status
            if p.name != s.pod_name or p.uid != s.pod_uid:
                return Violation("runs-only-the-committed-pod",
                                 f"{p.name}/{p.uid} runs but status names "
                                 f"{s.pod_name or '-'}/{s.pod_uid or '-'}"
                                 + (f" (pending {s.pending.name})" if s.pending else ""))
    if "adopts-only-its-own-pods" in enabled:
        for p in w.pods:
            if not p.planted:
                continue
            if not p.gated:
                return Violation("adopts-only-its-own-pods",
                                 f"planted pod {p.name}/{p.uid} was ungated")
            if vm is not None and vm.status.pod_uid == p.uid:
                return Violation("adopts-only-its-own-pods",
                                 f"planted pod {p.name}/{p.uid} was committed")
    if "status-describes-its-pod" in enabled and vm is not None and vm.status.ip is not None:
        uid = vm.status.pod_uid
        if not uid or vm.status.ip != f"10.0.0.{uid[1:]}":
            return Violation("status-describes-its-pod",
                             f"status.podIP {vm.status.ip} is not the IP of "
                             f"status.podUID {uid or '-'} ({vm.status.pod_name or '-'})")
    return None


def check_step(before: World, after: World, enabled: frozenset[str]) -> Violation | None:
    old, new = before.vm, after.vm
    if "creates-only-recorded-plans" in enabled and old is not None:
        known = {p.uid for p in before.pods}
        for p in after.pods:
            if p.uid in known or p.planted:  # planted by the user
                continue
            seq = plan_seq_of(p.name)
            if seq is None or seq > old.status.plan_seq:
                return Violation("creates-only-recorded-plans",
                                 f"pod {p.name} created while status.planSeq is "
                                 f"{old.status.plan_seq}")
    if old is None or new is None:
        return None
    if "plan-seq-monotonic" in enabled and new.status.plan_seq < old.status.plan_seq:
        return Violation("plan-seq-monotonic",
                         f"status.planSeq went back from {old.status.plan_seq} to "
                         f"{new.status.plan_seq}")
    if "restart-count-monotonic" in enabled and \
            new.status.restart_count < old.status.restart_count:
        return Violation("restart-count-monotonic",
                         f"status.restartCount went back from {old.status.restart_count} to "
                         f"{new.status.restart_count}")
    if "fence-monotonic" in enabled and old.status.fence is not None and (
            new.status.fence is None or tuple(new.status.fence) < tuple(old.status.fence)):
        return Violation("fence-monotonic",
                         f"status.fence went back from {tuple(old.status.fence)} to "
                         f"{tuple(new.status.fence) if new.status.fence else None}")
    if "spec-never-reverted" in enabled and new.spec_v < old.spec_v:
        return Violation("spec-never-reverted",
                         f"spec went back from edit #{old.spec_v} to edit #{new.spec_v}")
    return None


def converged(w: World) -> Violation | None:
    """None if ``w`` is where a calm system must end up; else what is wrong with it."""
    vm = w.vm
    pods = w.pods
    if vm is None:
        if pods or w.lock is not None:
            left = [p.name for p in pods] + (["lock"] if w.lock is not None else [])
            return Violation("deleted-vm-leaves-nothing",
                             "VM deleted but left behind: " + ", ".join(left))
        return None
    s = vm.status
    if vm.deleting:
        return Violation("converges", "VM stuck while being deleted "
                         f"({len(pods)} pod(s), finalizer {'present' if vm.finalizer else 'gone'})")
    if not vm.finalizer:
        return Violation("converges", "VM never got its finalizer")
    if s.pending is not None:
        return Violation("converges", f"plan {s.pending.name} stuck pending")
    if s.phase in ("Succeeded", "Failed"):
        others = [p.name for p in pods if p.name != s.pod_name or not p.finished]
        if others:
            return Violation("converges", f"VM is {s.phase} but pods remain: "
                             + ", ".join(others))
        return None
    if not s.pod_name:
        return Violation("converges", "no runner pod committed")
    pod = pods[0] if len(pods) == 1 else None
    if pod is None or pod.name != s.pod_name or pod.uid != s.pod_uid:
        return Violation("converges", f"status.podName {s.pod_name}/{s.pod_uid} but pods: "
                         + (", ".join(f"{p.name}/{p.uid}" for p in pods) or "none"))
    if pod.gated or pod.terminating or pod.phase != "Running":
        return Violation("converges", f"runner pod {pod.name} is stuck "
                         f"{'gated' if pod.gated else pod.phase}"
                         f"{' terminating' if pod.terminating else ''}")
    if (s.phase, s.node, s.ip) != ("Running", pod.node, pod.ip):
        return Violation("converges", f"status shows {s.phase}/{s.node}/{s.ip}, pod is "
                         f"Running/{pod.node}/{pod.ip}")
    return None
