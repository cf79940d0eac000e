"""A small model of the API server, its etcd, the locks' etcd and the controller's caches.

The explorer drives this model instead of real servers so that it can enumerate every
interleaving. Each rule below is stated next to the real behaviour it stands for; where
the model is coarser than the real thing, the rule says so (docs/verification.md lists
what is abstracted away).

VirtualMachine (one object, ``ns/vm``, fixed uid):

* **Versions and compare-and-swap.** Every change of the object is a new version (a new
  ``resourceVersion``). A write carries the version its author read; it succeeds only if
  that is still the current version, else it is refused (409 Conflict). The model does
  not number versions: each worker keeps ``base_fresh``, cleared by every write of the
  object, which is exactly the information a precondition compares. A write that changes
  nothing is a no-op and makes no new version (the API server short-circuits it).
* **Status subresource.** A ``/status`` write changes ``status`` only; a write of the main
  resource changes metadata (finalizers) and spec, never status. Generation moves with
  spec changes only.
* **Finalizers and deletion.** Deleting an object that has finalizers sets its
  ``deletionTimestamp`` (a new version) and keeps it; removing the last finalizer of such
  an object removes it. Deleting an object without finalizers removes it at once. A
  deletion can never be undone and a removed object never comes back (the model has no
  re-creation under the same name).

Pods (labelled for the VM; any number):

* **Identity.** Every create gets a fresh ``uid`` that is never reused. Creating a name
  that exists (even terminating) is refused (409 AlreadyExists).
* **Scheduling gates.** A gated pod is never bound to a node. An ungated pod is bound and
  its containers start (modelled as one step: Pending unscheduled → Running on a node).
* **Preconditions.** Delete carries a ``uid`` precondition (409 if the name now has
  another uid, 404 if gone); the ungate patch carries ``uid`` and ``resourceVersion``.
  Pod contents only ever move forward (gate removed, bound, phase, deletion), so an
  unchanged pod tuple is an unchanged ``resourceVersion``.
* **Graceful deletion.** Deleting a pod that is not bound to a node, or has finished,
  removes it at once (the API server sets grace period 0 for those). Deleting a bound pod marks it
  terminating; it stays (and its guest may run) until the kubelet finishes, at any later
  step. Owner references: the garbage collector deletes pods whose owner VM is gone.
* **Phases.** Pending → Running → Succeeded/Failed (the guest exits by itself).
* **Fence annotations.** A pod the controller creates carries the (epoch, token) of the
  plan it was created for; a pod the user plants carries none, or one older than the
  plan's (the ``plant`` adversary: the admission policy that forbids it is assumed off;
  the older fence is what a left-over pod of an earlier plan, or a copy of one, carries).

Locks' etcd and leader election:

* The VM's lock key holds ``(epoch, token)``; ``token`` is the locks' etcd revision of the
  transaction that wrote it (creation or takeover), so tokens only increase. The key is
  bound to an etcd lease; lease expiry deletes it. A writer with a higher epoch may take
  over a key of a lower epoch at once.
* Leadership is abstracted to ``epoch``: each leader term has a fresh, higher epoch
  (``spec.leaseTransitions``); a deposed leader keeps running with its old epoch until it
  notices, which the model lets it postpone forever.

Reads and caches:

* A **direct** read (GET/LIST without ``resourceVersion``) returns the current state
  (etcd quorum read; linearizable).
* A **cached** read (informer) returns a *past* version: a worker may read any of the
  ``lag`` most recent previous versions (or the current one), where ``lag`` counts the
  versions written since that worker last wrote or read directly or through the cache.
  So a cache never goes backwards and always shows the worker its own writes, as docs/protocol.md
  prescribes; it may lag by at most ``Config.history`` versions (the model keeps that many
  past versions). A pod list read from the cache is a past *consistent* snapshot, unless
  the ``dropped_event`` fault removes one pod from it (a lost watch event: a snapshot that
  never existed).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

from neonvm.api.types import (
    FINALIZER,
    Fence,
    PendingPod,
    VirtualMachine,
    VirtualMachineSpec,
    VirtualMachineStatus,
)
from neonvm.controller import actions as act
from neonvm.controller import decide as d

VM_NAME = "vm"
NAMESPACE = "ns"
VM_UID = "a1b2c3d4-0000-4000-8000-00000000000a"
NODE = "node-1"
DELETION_TIME = "2024-01-01T00:00:00Z"

# Worker roles.
LEADER = "leader"
ZOMBIE = "zombie"
"""A deposed leader that has not noticed: it keeps running with its old epoch."""
STANDBY = "standby"
"""A replica that is not the leader: it does nothing."""


class Plan(NamedTuple):
    """``status.pendingPod``."""

    name: str
    plan_seq: int
    token: int
    epoch: int
    generation: int


class FenceT(NamedTuple):
    """``status.fence``."""

    epoch: int
    token: int


class Status(NamedTuple):
    """``VirtualMachine.status`` as far as the protocol uses it (conditions left out)."""

    phase: str | None = None
    pod_name: str | None = None
    pod_uid: str | None = None
    pending: Plan | None = None
    plan_seq: int = 0
    restart_count: int = 0
    fence: FenceT | None = None
    node: str | None = None
    ip: str | None = None
    observed_generation: int | None = None


class VM(NamedTuple):
    """One version of the VirtualMachine object."""

    uid: str
    generation: int
    spec_v: int
    """Which version of the spec this is (only the user's edits change it)."""
    restart_policy: str
    deleting: bool
    finalizer: bool
    status: Status


class Pod(NamedTuple):
    """One version of a runner pod (labelled for the VM)."""

    name: str
    uid: str
    owner: str
    gated: bool
    node: str | None
    phase: str
    terminating: bool
    fence: tuple[int, int] | None = None
    """(epoch, token) of the fence annotations: the plan's lease for a pod the controller
    created; None, or a wrong (older) one, for a pod the user planted."""
    planted: bool = False
    """Created by the user (the ``plant`` adversary), not by the controller."""

    @property
    def ip(self) -> str | None:
        return f"10.0.0.{self.uid[1:]}" if self.node else None

    @property
    def finished(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


class Lock(NamedTuple):
    """The VM's key in the locks' etcd: holder epoch and fencing token."""

    epoch: int
    token: int


ActKey = tuple[Any, ...]
"""A decided action, frozen: (class name, field values...) without ``reason``."""


class Worker(NamedTuple):
    """One controller replica's reconcile worker for the VM, with its in-memory state."""

    role: str
    epoch: int
    token: int
    """Lock token this worker holds (0: none)."""
    pc: str
    """Where it is: idle, get, act, retry, prelist, prelist_cache, vmread, patch, precreate,
    sweep, halt, stopped."""
    need_direct: bool = False
    lag_vm: int = 0
    lag_pods: int = 0
    listed: tuple[Pod, ...] | None = None
    """The direct pod list taken before the direct VM read (pc ``get``)."""
    action: ActKey | None = None
    lease: tuple[int, int] = (0, 0)
    """(epoch, token) the action was decided under."""
    base_fresh: bool = False
    """The VM version the action was decided from is still the current version."""
    obs_vm: VM | None = None
    """The VM the action was decided from."""
    target: Pod | None = None
    """The pod as the ungate's direct list showed it (uid + version precondition)."""
    blind: bool = False
    """Breakage ``blind_retry``: the retry writes the stale object's result."""
    retook: bool = False
    """A deposed worker that took the lock again after losing it."""
    seen: tuple[Pod, ...] | None = None
    """The pods of the observation the action was decided from: a write's response
    extends that observation (the driver's ``_seen_by_write``)."""
    seen_direct: bool = False
    """That observation was direct."""


class Budget(NamedTuple):
    """How many more of each fault / adversary step may still happen."""

    crash: int = 0
    failover: int = 0
    lock_expiry: int = 0
    conflict: int = 0
    dropped_event: int = 0
    pod_delete: int = 0
    pod_finish: int = 0
    vm_delete: int = 0
    spec_edit: int = 0
    plant: int = 0
    """The user creates a pod under the VM's next plan name (or its recorded plan's name
    before the controller does): gated, labelled, owner-referenced, without the fence or
    with an older one."""


class World(NamedTuple):
    """One explored state: the servers' contents, the caches' history and the workers."""

    vm: VM | None
    pods: tuple[Pod, ...]
    """Sorted by (name, uid)."""
    vm_hist: tuple[VM | None, ...]
    """Previous VM versions, oldest first (at most ``Config.history``)."""
    pod_hist: tuple[tuple[Pod, ...], ...]
    """Previous pod lists, oldest first (at most ``Config.history``)."""
    lock: Lock | None
    lock_rev: int
    epoch: int
    """Epoch of the current leader term."""
    workers: tuple[Worker, ...]
    budget: Budget
    uid_next: int


# ---- the API server's writes -------------------------------------------------------------


_new = tuple.__new__
# The fast paths below build tuples positionally.
assert World._fields.index("workers") == 7 and Worker._fields.index("base_fresh") == 10
assert Worker._fields.index("lag_vm") == 5 and Worker._fields.index("lag_pods") == 6


def _lags_move(x: Worker) -> bool:
    """Whether a worker's cache window matters (it may still read)."""
    return x.role != STANDBY and x.pc not in ("stopped", "halt")


def write_vm(w: World, new: VM | None, history: int, writer: int | None) -> World:
    """Store a new version of the VM (or remove it): every CAS base goes stale."""
    hist = (*w.vm_hist, w.vm)[-history:] if history else ()
    n = len(hist)
    workers = tuple(
        _new(Worker, (*x[:5], 0 if i == writer else min(x[5] + 1, n), *x[6:10], False,
                      *x[11:])) if _lags_move(x) else x
        for i, x in enumerate(w.workers)
    )
    return _new(World, (new, w.pods, hist, *w[3:7], workers, *w[8:]))


def write_pods(w: World, pods: tuple[Pod, ...], history: int, writer: int | None) -> World:
    """Store a new pod list version (one pod created, changed or removed)."""
    hist = (*w.pod_hist, w.pods)[-history:] if history else ()
    n = len(hist)
    workers = tuple(
        _new(Worker, (*x[:6], 0 if i == writer else min(x[6] + 1, n), *x[7:]))
        if _lags_move(x) else x
        for i, x in enumerate(w.workers)
    )
    return _new(World, (w.vm, tuple(sorted(pods)), w.vm_hist, hist, *w[4:7], workers, *w[8:]))


def set_worker(w: World, i: int, x: Worker) -> World:
    """``w`` with worker ``i`` replaced."""
    ws = w.workers
    return _new(World, (*w[:7], (*ws[:i], x, *ws[i + 1:]), *w[8:]))


def replace_pod(pods: tuple[Pod, ...], old: Pod, new: Pod | None) -> tuple[Pod, ...]:
    rest = tuple(p for p in pods if p is not old and p != old)
    return rest if new is None else (*rest, new)


def pod_by_name(pods: tuple[Pod, ...], name: str) -> Pod | None:
    return next((p for p in pods if p.name == name), None)


def pod_by_uid(pods: tuple[Pod, ...], uid: str) -> Pod | None:
    return next((p for p in pods if p.uid == uid), None)


def deleted(pod: Pod) -> Pod | None:
    """A pod after a successful delete: gone if never bound or already finished (the
    API server then sets grace period 0), else terminating."""
    if pod.node is None or pod.finished:
        return None
    return pod._replace(terminating=True)


# ---- conversions to the shipped types ----------------------------------------------------


def to_api_vm(v: VM) -> VirtualMachine:
    """The model VM as the controller's :class:`VirtualMachine`."""
    return VirtualMachine(
        name=VM_NAME,
        namespace=NAMESPACE,
        uid=v.uid,
        resource_version="",
        generation=v.generation,
        spec=VirtualMachineSpec(restart_policy=v.restart_policy),  # type: ignore[arg-type]
        status=to_api_status(v.status),
        deletion_timestamp=DELETION_TIME if v.deleting else None,
        finalizers=[FINALIZER] if v.finalizer else [],
    )


def to_api_status(s: Status) -> VirtualMachineStatus:
    return VirtualMachineStatus(
        phase=s.phase,  # type: ignore[arg-type]
        pod_name=s.pod_name,
        pod_uid=s.pod_uid,
        pending_pod=PendingPod(**s.pending._asdict()) if s.pending else None,
        plan_seq=s.plan_seq,
        pod_ip=s.ip,
        node=s.node,
        restart_count=s.restart_count,
        observed_generation=s.observed_generation,
        fence=Fence(epoch=s.fence.epoch, token=s.fence.token) if s.fence else None,
    )


def from_api_status(s: VirtualMachineStatus) -> Status:
    p = s.pending_pod
    return Status(
        phase=s.phase,
        pod_name=s.pod_name,
        pod_uid=s.pod_uid,
        pending=Plan(p.name, p.plan_seq, p.token, p.epoch, p.generation) if p else None,
        plan_seq=s.plan_seq,
        restart_count=s.restart_count,
        fence=FenceT(s.fence.epoch, s.fence.token) if s.fence else None,
        node=s.node,
        ip=s.pod_ip,
        observed_generation=s.observed_generation,
    )


def to_view(p: Pod) -> act.PodView:
    return act.PodView(name=p.name, uid=p.uid, owner_uid=p.owner, gated=p.gated,
                     terminating=p.terminating, phase=p.phase, node=p.node, ip=p.ip,
                     fence=p.fence)


def _freeze(value: Any) -> Any:
    if isinstance(value, PendingPod):
        return Plan(value.name, value.plan_seq, value.token, value.epoch, value.generation)
    return value


def action_key(action: act.Action) -> ActKey:
    """A hashable copy of ``action`` (field values in declaration order, no reason)."""
    values = (_freeze(getattr(action, f.name)) for f in dataclasses.fields(action)
              if f.name != "reason")
    return (type(action).__name__, *values)


def action_of(key: ActKey) -> act.Action:
    """The :mod:`decide` action a key stands for."""
    cls = getattr(d, key[0])
    names = [f.name for f in dataclasses.fields(cls) if f.name != "reason"]
    kwargs = {n: PendingPod(**v._asdict()) if isinstance(v, Plan) else v
              for n, v in zip(names, key[1:], strict=True)}
    action: act.Action = cls(**kwargs)
    return action


def describe_action(key: ActKey) -> str:
    kind, *args = key
    if kind in ("RecordPlan", "CreatePod"):
        return f"{kind}({args[0].name})"
    shown = [str(a) for a in args if a not in (None, "", 0)]
    return f"{kind}({', '.join(shown)})" if shown else kind


# ---- the shipped code, memoized ----------------------------------------------------------


FENCED_OUT = "FencedOut"


@dataclass
class ShippedCode:
    """``decide`` and the mutations, called on model states and memoized.

    Both are pure functions of their arguments, so caching their answers changes nothing
    but speed; every distinct input is still answered by the shipped code itself.
    """

    decisions: dict[tuple[Any, ...], ActKey] = dataclasses.field(default_factory=dict)
    status_results: dict[tuple[Any, ...], Status | str | None] = dataclasses.field(
        default_factory=dict)
    finalizer_results: dict[tuple[Any, ...], bool | None] = dataclasses.field(
        default_factory=dict)

    def decide(self, vm: VM | None, pods: tuple[Pod, ...], lease: tuple[int, int],
               direct: bool) -> ActKey:
        key = (vm, pods, lease, direct)
        hit = self.decisions.get(key)
        if hit is None:
            obs = act.Observation(
                vm=to_api_vm(vm) if vm is not None else None,
                pods=tuple(to_view(p) for p in pods),
                lease=act.Fence(epoch=lease[0], token=lease[1]),
                direct=direct,
            )
            hit = self.decisions[key] = action_key(d.decide(obs))
        return hit

    def status_write(self, action: ActKey, lease: tuple[int, int], vm: VM) -> Status | str | None:
        """The new status, None (nothing to do) or :data:`FENCED_OUT`."""
        key = (action, lease, vm)
        if key in self.status_results:
            return self.status_results[key]
        from neonvm.controller import action_table, mutations

        mutate = action_table.status_mutation(action_of(action), act.Fence(*lease))
        result: Status | str | None
        try:
            new = mutate(copy.deepcopy(to_api_vm(vm)))
        except mutations.FencedOut:
            result = FENCED_OUT
        else:
            result = None if new is None else from_api_status(new)
        self.status_results[key] = result
        return result

    def finalizer_write(self, action: ActKey, vm: VM) -> bool | None:
        """Whether our finalizer is present after the write, or None (nothing to do)."""
        key = (action, vm)
        if key in self.finalizer_results:
            return self.finalizer_results[key]
        from neonvm.controller import action_table

        new = action_table.finalizers_mutation(action_of(action))(to_api_vm(vm))
        result = None if new is None else FINALIZER in new
        self.finalizer_results[key] = result
        return result
