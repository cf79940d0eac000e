"""The scaling explorer: every interleaving of live scaling in a small world.

The pod explorer (``model``/``actors``/``explore``) checks "at most one runner pod". This
one checks live scaling with the shipped code: :func:`neonvm.controller.decide.decide`
and :func:`neonvm.controller.action_table.status_mutation` decide and write status, and the
runner's :func:`neonvm.api.scale_protocol.fence_decision` decides what a runner applies.

The world: one VM, one committed runner pod at a time (always running), its runner
(fence file, fence floor, the size its guest has), and the actors:

* **Leaders.** Two workers, the first with epoch 1, the second with epoch 2 once a
  failover step starts it. Neither ever stops by itself: the deposed one keeps acting on
  what it last saw (a paused leader). A worker *observes* (a direct read, or a stale one:
  any of the ``lag`` previous versions of the VM), decides, and holds the action; it
  *performs* it at any later step, so any two workers' steps interleave.
* **Status writes** are the conflict helper's: the mutation is applied to the *current*
  VM (a 409 re-reads and re-applies it), and a fence ahead stops the worker for good.
* **The runner call.** ``PUT /scale`` with the plan's size and fence reaches the
  *current* runner, whatever pod the plan was for (the worst case: the old pod's IP now
  belongs to the new pod). ``GET /scale`` is read at observation time and attributed to
  the observed pod (the same worst case).
* **Faults.** A crash drops a worker's held action (crash mid-scale). A runner restart
  replaces the pod (restartPolicy Never: a runner that exits ends its pod), through the
  shipped Restart, RecordPlan and Commit mutations applied at once: a new pod uid, an
  empty work dir, a fence floor computed by :func:`neonvm.controller.podspec.runner_pod`
  from the VM read at its creation, and the guest booted at that spec's size. The user
  changes ``use`` a bounded number of times. Optionally (review S5): an ``ApplyScale``
  refused for good (no token: the plan dropped, ``ScalingDisabled``), and a ``PUT``
  that times out at its sender while still on its way, landing at any later step.
* **The late-PUT window.** After a drop, observations are taken within the window
  (:data:`~neonvm.controller.looks.LATE_PUT_SECONDS` from the drop) until a step
  closes it, at any point once no ``PUT`` at all is on its way (none timed out and
  still travelling, none held by a live worker, whatever plan it is of). Modelling
  assumption: the window is long enough for every late ``PUT`` to land, and for every
  read older than the drop to be replaced (closing it forgets the read history from
  before the drop). Past it the look goes on only as status asks (``scaleLookPodUID``,
  its time :data:`DROPPED_AT`); a calm run takes place past it. The window is the
  drop's: a write that changes only the Scaling condition does not reopen or close it.
  Time is binary: the give-up bound
  (:data:`~neonvm.controller.looks.LOOK_GIVE_UP_SECONDS`) is never reached here.
* **A runner not answering** (optional, ``unanswered``): an observation of a recorded
  plan finds ``GET /scale`` failing; decide's ``Wait`` comes with the reconcile's
  Scaling=True ``RunnerNotAnswering`` condition write
  (:func:`neonvm.controller.conditions.desired_conditions`), which the worker holds and
  performs, through the shipped conditions mutation, on the VM as it is then.
* **A reconcile that ends stuck over the runner** (optional, ``stuck``): the driver
  ends a reconcile stuck, writing only its Degraded condition (the shipped
  :func:`~neonvm.controller.conditions.stuck_condition` through the conditions
  mutation), when ``GET /scale`` of a recorded plan finds the runner misbehaving (or
  silent past its grace: :func:`neonvm.controller.scaling.runner_trouble`), and after
  an ``ApplyScale`` whose answer is not the plan reached (a 504, none, a misbehaving
  one: :func:`neonvm.controller.reconciler.paused`; or any answer at all, when the next
  decision is the same plan's ``ApplyScale`` again: ``Reconciler._after_put``, one ``PUT``
  per reconcile); the worker holds that write and performs it at any later step, on the
  VM as it is then. The modelled stuck end may follow any runner call, whatever it did
  to the guest, so it covers every such answer. Such a reconcile sends at most one
  ``PUT`` and checks its authority after it: both only remove interleavings (a worker
  here may act at any step, on any read, with no authority check at all).

* **The pod's writes** (optional, ``pod_writes``; docs/verification.md, "The pod's fenced
  writes"): the spec's ``cpus.use`` and ``status.cpus`` carry a fraction (millicores),
  the pod its ``scale-fence``, ``usage``/``resources`` annotations and CPU request; an
  ``ApplyScale`` answered 200 (with no token recorded, a fraction-only plan, instead of
  any ``PUT``) goes on with ``RunnerScaling._tell_kubernetes``'s requests as held steps
  (:meth:`ScalingModel._tell`): the pod's GET, the annotation PATCH, the resize PATCH
  (on a pod already carrying the plan, only when its annotations carry the read's
  size), each by the resourceVersion of its read (a 409 reads again, up to
  ``TELL_ATTEMPTS``). The observation's pod carries what ``observe.pod_view`` reads of
  it (``scale-fence``, built size, the annotations' size, a Burstable pod's request),
  so ``decide`` plans again when the pod's record is behind the spec (``pod_behind``).
  A tenant's write is modelled as a world that starts with the pod's ``scale-fence``
  planted above every plan (tests/test_explore_scaling.py), not as a fault at any step.

Properties:

* **Order** (safety, every step): the sizes a guest receives come from plans in the order
  they were recorded: a runner never applies a plan whose ``seq`` is lower than one it
  applied, nor one recorded before its pod was created (its guest booted at a newer
  size); the same plan again, with the same size, is a retry and changes nothing.
* **Convergence** (from every reachable state): once the deposed leader and the faults
  stop, the newest leader, observing directly, brings the guest, the runner and status to
  the spec's size within a bounded number of steps; when the spec was refused for its
  generation, to status saying what the guest has (no plan). **Quiescence**: it then
  decides nothing more within those steps (a plan loop can pass through states that
  look converged); not asked where retrying is by design (a guest refusing an unplug,
  a removal still pending).
* **Growth** (every runner apply, with unplugs refused): what the applied plan grows
  reaches the plan's size, whatever unplug of the other resource is refused.
* With the pod's writes: **order** for the pod too (no annotation or CPU request computed
  from an older spec replaces another value), **claims** (``status.cpus`` never newly
  says a fraction the committed pod's annotations do not carry) and, unless
  ``pod_convergence`` is off, **pod-convergence** (the calm run also brings
  ``status.cpus``, the annotations and the CPU request to ``cpus.use``).

Coarser than the real thing: the pod's own lifecycle (plan, create, ungate) is one step
here (it has its own explorer); a runner's apply is atomic (a crash inside it is a
runner restart, which loses the guest anyway); of the conditions only whether the
Scaling condition says a plan was dropped (and why, for which generation) is part of the
state: decide reads nothing else of it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from neonvm.api import times
from neonvm.api.millicpu import MilliCPU
from neonvm.api.scale_protocol import (
    AppliedFence,
    ScaleError,
    ScaleFence,
    ScaleTarget,
    fence_decision,
)
from neonvm.api.types import (
    FINALIZER,
    Condition,
    CPURange,
    Fence,
    Guest,
    IntRange,
    PendingPod,
    PendingScale,
    VirtualMachine,
    VirtualMachineSpec,
    VirtualMachineStatus,
)
from neonvm.controller import (
    action_table,
    autoscaler_view,
    conditions,
    looks,
    mutations,
    podspec,
    reasons,
    reconciler,
)
from neonvm.controller import actions as act
from neonvm.controller import decide as d
from neonvm.controller.observe import Snapshot
from neonvm.controller.scaling import (
    TELL_ATTEMPTS,
    RunnerTrouble,
    _qos_class,
    runner_trouble,
)
from neonvm.runner.scaling import OST_EJECT_IN_PROGRESS, ost_refuses_eject

UID = "0123456789abcdef"
DROPPED_AT = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
"""When every modelled drop happened (the Scaling condition's lastTransitionTime)."""
WITHIN_THE_WINDOW = DROPPED_AT
"""An observation's ``now`` while the late-PUT window is open."""
PAST_THE_WINDOW = DROPPED_AT + dt.timedelta(seconds=looks.LATE_PUT_SECONDS)
"""An observation's ``now`` once it has closed."""
SLOT = "1Gi"
IP = "10.0.0.1"
Size = tuple[int, int]
FenceTriple = tuple[int, int, int]
Created = tuple[str, str, Size, int]
"""A created pod: its name, uid, built size (whole vCPUs, slots) and built millicores."""
SpecChange = tuple[int, ...]
"""A spec ``use``: (vCPUs, slots), or (vCPUs, slots, millicores) for a fractional
``cpus.use`` (:func:`frac`)."""
FENCED_OUT = "fenced-out"
"""A write's outcome: a fence ahead of the writer's (the worker stops)."""


CONDITIONS_WRITE = "ConditionsWrite"
"""The held kind of a reconcile's conditions write (:meth:`ScalingModel._conditions_write`):
the Scaling condition of a ``Wait`` on a plan whose runner does not answer."""
STUCK_OUTCOME = "runner_504"
"""The ``ApplyScale`` outcome of a modelled stuck end: the runner's answer to an unplug
the guest neither finished nor refused (any outcome the driver pauses on is written the
same way)."""
TELL = "TellKubernetes"
"""The held kind of the pod's fenced annotation and resize write after an ``ApplyScale``
(:meth:`ScalingModel._tell`): ``RunnerScaling._tell_kubernetes``, one step per request."""
READ = "read"
"""The marker of what an ``ApplyScale`` read of the VM (appended to the held action)."""
FOLLOW = "FollowFraction"
"""The held kind of :attr:`Mutants.fraction_outside_plan`'s status write."""
CPU_MAX = 2000
"""The spec's ``cpus.max`` (millicores); ``min`` is 1000."""
RUNNER_CALLS = frozenset({"ApplyScale"})
"""The runner calls this model performs (:meth:`ScalingModel._put`); every other scaling
action is a status write through the shipped mutation."""


class VMRep(NamedTuple):
    """The VM's spec ``use`` and the status fields scaling reads or writes."""

    use: Size
    generation: int
    phase: str
    pod: str
    pod_uid: str
    plan_seq: int
    fence: tuple[int, int] | None
    size: Size | None
    pending: tuple[Any, ...] | None
    """(cpus, slots, seq, epoch, token, pod name, pod uid, generation)"""
    scale_seq: int
    restarts: int
    pending_pod: tuple[str, int, int, int, int] | None = None
    """(name, planSeq, token, epoch, generation) of a created pod not yet committed."""
    dropped: tuple[str, int] | None = None
    """The Scaling condition when it says the last plan was dropped (False, a
    :data:`~neonvm.controller.reasons.DROP_REASONS` reason): (reason, observedGeneration).
    Which other Scaling condition it is (True while a plan is in progress or its runner
    does not answer, False once committed) is not kept: decide reads only whether it
    says dropped (the refusal gate, the window of a drop recorded without a look)."""
    look: str = ""
    """``status.scaleLookPodUID``: the pod whose runner is still to be looked at after a
    drop ("": none). Its ``scaleLookSince`` is :data:`DROPPED_AT` (time is binary here:
    :attr:`World.window_closed`)."""
    use_milli: int = 0
    """The spec's ``cpus.use`` in millicores when it is not ``use[0]`` whole vCPUs (a
    fraction: ``use[0]`` is then its rounding up); 0: whole."""
    cpus_milli: int = 0
    """``status.cpus`` in millicores when it is not ``size[0]`` whole vCPUs; 0: whole."""
    token: bool = False
    """Status records a scaling token Secret. The worlds without pod writes keep the
    original model's VM, which records none (and whose ``ApplyScale`` always calls the
    runner)."""


class Runner(NamedTuple):
    pod_uid: str
    stored: tuple[FenceTriple, Size] | None
    """The fence file: the last applied fence and its size."""
    floor: FenceTriple | None
    boot: Size
    guest: Size
    received: tuple[int, Size]
    """(seq, size) of the last plan the guest received; the boot size counts as a plan
    numbered ``status.scaleSeq`` at the pod's creation."""
    boot_seq: int
    removing: tuple[int, Size, int, int] | None = None
    """An unplug the guest has not finished: (seq, size of the plan that started it,
    vCPUs leaving, slots leaving). QEMU still lists the devices and cannot cancel their
    removal; the guest may eject them at any later step, refuse (they stay), or do
    neither (all of them together: coarser than the runner, which settles each)."""
    ejecting: bool = True
    """The guest may still eject ``removing`` (it has not refused it)."""
    recorded: bool = True
    """The runner's record still lists ``removing`` (it holds every plan until the
    removal settles). Only a misread refusal clears it while the eject is in flight."""
    scale_fence: FenceTriple | None = None
    """The runner pod's ``vm.neon.tech/scale-fence`` annotation (None: absent, as built)."""
    ann: tuple[int, int, int] = (0, 0, 0)
    """The pod's ``usage``/``resources`` annotations: (cpu millicores, memory slots, the
    VM generation whose spec they were computed from)."""
    req: tuple[int, int] = (0, 0)
    """The runner container's CPU request (millicores; its limit is a function of it and
    ``max``), and the VM generation it was computed from."""
    guaranteed: bool = False
    """The pod's QoS class is Guaranteed (never resized)."""


class WorkerRep(NamedTuple):
    epoch: int
    token: int
    active: bool
    stopped: bool
    held: tuple[Any, ...] | None
    """A decided action not yet performed: (kind, args...). A held ``ApplyScale`` of a
    model with pod writes ends with what its read of the VM gives the pod writes
    (:meth:`ScalingModel._read_for_tell`)."""


class World(NamedTuple):
    vm: VMRep
    history: tuple[VMRep, ...]
    runner: Runner
    workers: tuple[WorkerRep, ...]
    spec_changes: tuple[SpecChange, ...]
    restarts_left: int
    crashes_left: int
    created: Created | None = None
    """A replacement pod created (its runner up, its guest booted at the size it was built
    with) and not yet committed: (name, uid, built size)."""
    refusals_left: int = 0
    """``ApplyScale`` may be refused for good this many more times (the controller cannot
    get the token: the shipped driver's DropScale with ``ScalingDisabled``)."""
    timeouts_left: int = 0
    """A ``PUT /scale`` may time out at its sender this many more times: the sender gives
    up (and may retry, or drop the plan), the request is still on its way."""
    late: tuple[tuple[Any, ...], ...] = ()
    """``PUT /scale`` requests whose sender gave up on them, still on their way: each
    lands at any later step (or never)."""
    window_closed: bool = False
    """The late-PUT window of the last drop has passed: observations are taken past it
    (:data:`PAST_THE_WINDOW`). Open again with the next drop; kept False while status
    shows no drop (:func:`_after_drop`)."""
    unanswered_left: int = 0
    """An observation may find the runner not answering ``GET /scale`` this many more
    times: decide's ``Wait`` on a recorded plan, whose Scaling=True
    ``RunnerNotAnswering`` condition write the worker holds and performs at any later
    step, on the VM as it is then (the conflict helper's retry), like any status write."""
    stuck_left: int = 0
    """A reconcile may end stuck over the runner this many more times (the module doc,
    "A reconcile that ends stuck over the runner"): its Degraded write held."""
    bumps_left: int = 0
    """The pod may change this many more times under a pending pod write (the kubelet's
    status updates): every read of it held becomes stale (a 409 for its patch)."""


@dataclass(frozen=True)
class Mutants:
    """Deliberate breakages the explorer must catch."""

    unfenced_runner: bool = False
    """The runner applies every fence (no comparison with the last applied)."""
    no_floor: bool = False
    """A new pod's runner gets no fence floor."""
    commit_spec_size: bool = False
    """The pod commit records the fresh spec's size instead of the size the pod was built
    with (the size its guest booted at)."""
    no_supersede: bool = False
    """A recorded plan is never superseded: a new plan waits until it is committed or
    dropped."""
    no_adoption: bool = False
    """After a plan is dropped, the controller never adopts a size the runner reports
    other than status's (review S5's code; the write that only ends the look is kept):
    a PUT of the dropped plan landing later leaves status behind."""
    removal_counts_as_present: bool = False
    """The runner keeps no record of the unplugs it started: a DIMM whose removal is
    still pending counts as plugged (a newer plan asking for it back is answered at
    once, and ``GET /scale`` reports no pending removal)."""
    refusal_skips_rest: bool = False
    """The runner's order before review scalefix2 F2: vCPUs, then memory, whatever
    grows, and a refused (pending) unplug ends the request there: a growth after it is
    not carried out."""
    forget_before_write: bool = False
    """The look after a drop ends with the settled answer asked past the window, before
    the write that adopts it is known to have landed (review MEDIUM 1's code, with its
    memory in status): the record is cleared as the decision is taken; the adopting
    write, held, may be lost (a crash) or refused."""
    end_in_window: bool = False
    """A settled answer ends the look whenever it was asked: decide judges every
    observation as past the window (a clock ahead of the dropper's by the whole
    window), so an answer asked before a late PUT landed may be the last word."""
    stale_adopt_after_end: bool = False
    """An adopting write lands whether or not the look it was decided in has ended
    since (no ``look_recorded`` precondition): a writer paused since an answer asked
    within the window puts an older size back after a write past the window ended the
    look."""
    no_look_record: bool = False
    """The drop leaves no record of the look in status: the runner is looked at within
    the window only (main's code before the record, for a new leader; and the stale
    answer adopted just before a late PUT landed)."""
    window_from_condition: bool = False
    """The code before review lookfix L1: the window counts as passed once the Scaling
    condition no longer says the plan was dropped (an observation of a VM with the look
    recorded and another Scaling condition is taken past the window), and the Wait's
    Scaling=True condition write lands with no plan recorded on the fresh copy."""
    end_with_removal_pending: bool = False
    """With no plan recorded, the runner's pending removals are not looked at (review
    lookfix L6): a settled-looking answer with a DIMM still leaving adopts the size
    QEMU lists and, past the window, ends the look; the guest may eject it later."""
    ost_misread: bool = False
    """The runner reads the guest's ``_OST`` answers the wrong way round (0x80-0x82 "in
    progress", anything else a refusal: review R1's rule), so the "eject in progress"
    (0x84) that Linux sends before every eject settles a removal still in flight as
    refused, and counts the DIMMs as plugged."""
    unfenced_annotation: bool = False
    """The pod's annotation write ignores ``vm.neon.tech/scale-fence``: every tell
    writes the usage and resources annotations (by resourceVersion still)."""
    no_resource_version: bool = False
    """The pod's annotation write and resize carry no resourceVersion: a patch decided
    from a read lands whatever was written since."""
    commit_any_generation: bool = False
    """A plan's commit records the spec's fraction whatever the VM's generation (the
    commit without ``pendingScale.generation``'s check)."""
    commit_pod_behind: bool = False
    """A plan's commit records the spec's fraction whether or not the pod's
    ``scale-fence`` carries the plan (``pod_behind`` ignored)."""
    fraction_outside_plan: bool = False
    """The code before 67ae728: a ``cpus.use`` changed within the whole vCPUs status
    says is no plan; status copies the fraction (``follow_fraction``) and nothing
    writes the pod."""
    pod_record_ignored: bool = False
    """The code before ``decide.pod_behind``: a pod whose annotations or CPU request are
    not the spec's while status is is no plan (the explorer's bugs 1 to 3: a tell lost,
    or written from an older read, or a resize lost, stays for good)."""
    resize_any_read: bool = False
    """The code before the tell's check of the pod's annotations: a pod that already
    carries the plan's ``scale-fence`` is resized to this read's ``cpus.use`` whatever
    its annotations say (bug 4: two leaders, a resize from an older spec after a
    newer one)."""


def _misread_ost_refuses_eject(info: dict[str, Any]) -> bool:
    """The rule of :attr:`Mutants.ost_misread`."""
    status = info.get("status")
    return (info.get("source") == 3 and isinstance(status, int)
            and status not in (0, 0x80, 0x81, 0x82))


OST_DEVICE_BUSY = 0x82
"""The _OST status of a Linux guest that cannot offline the memory it is asked to eject."""


# ---- between the model and the shipped types --------------------------------------------


def to_vm(r: VMRep) -> VirtualMachine:
    spec = VirtualMachineSpec(guest=Guest(
        cpus=CPURange(min=MilliCPU(1000), max=MilliCPU(CPU_MAX),
                      use=MilliCPU(r.use_milli or r.use[0] * 1000)),
        memory_slots=IntRange(min=1, max=2, use=r.use[1]), memory_slot_size=SLOT))
    pending = None
    if r.pending is not None:
        c, s, seq, e, t, name, uid, gen = r.pending
        pending = PendingScale(cpus=c, memory_slots=s, seq=seq, epoch=e, token=t,
                               pod_name=name, pod_uid=uid, generation=gen)
    status = VirtualMachineStatus(
        phase=r.phase, pod_name=r.pod, pod_uid=r.pod_uid,  # type: ignore[arg-type]
        pod_ip=IP, node="n1", plan_seq=r.plan_seq, restart_count=r.restarts,
        fence=Fence(epoch=r.fence[0], token=r.fence[1]) if r.fence else None,
        cpus=MilliCPU(r.cpus_milli or r.size[0] * 1000) if r.size else None,
        memory_size=f"{r.size[1]}Gi" if r.size else None,
        pending_scale=pending, scale_seq=r.scale_seq,
        pending_pod=PendingPod(name=r.pending_pod[0], plan_seq=r.pending_pod[1],
                               token=r.pending_pod[2], epoch=r.pending_pod[3],
                               generation=r.pending_pod[4]) if r.pending_pod else None)
    if r.dropped is not None:
        status.conditions.append(Condition(
            type=reasons.SCALING_CONDITION, status="False",
            reason=r.dropped[0], message="", observed_generation=r.dropped[1],
            last_transition_time=times.format_microtime(DROPPED_AT)))
    if r.token:
        status.scaling_token_secret, status.scaling_token_secret_uid = "token", "token-uid"
    status.scale_look_pod_uid = r.look or None
    status.scale_look_since = times.format_microtime(DROPPED_AT) if r.look else None
    return VirtualMachine(name="vm", namespace="ns", uid=UID, resource_version="1",
                          generation=r.generation, spec=spec, status=status,
                          finalizers=[FINALIZER])


def from_vm(vm: VirtualMachine) -> VMRep:
    """The model's VM from a shipped one (its spec's ``use`` and the status fields)."""
    s = vm.status
    p = s.pending_scale
    pp = s.pending_pod
    size = d.status_size(vm)
    spec_use = vm.spec.guest.cpus.current
    whole = spec_use.rounded_up()
    cpus_milli = int(s.cpus) if s.cpus is not None and size is not None else 0
    cond = next((c for c in s.conditions if c.type == reasons.SCALING_CONDITION), None)
    dropped = ((cond.reason, cond.observed_generation or 0) if cond is not None
               and cond.status == "False" and cond.reason in reasons.DROP_REASONS else None)
    return VMRep(
        use=(whole, vm.spec.guest.memory_slots.current), generation=vm.generation,
        phase=s.phase or "Pending", pod=s.pod_name or "",
        pod_uid=s.pod_uid or "", plan_seq=s.plan_seq,
        fence=(s.fence.epoch, s.fence.token) if s.fence else None, size=size,
        pending=(p.cpus, p.memory_slots, p.seq, p.epoch, p.token, p.pod_name, p.pod_uid,
                 p.generation) if p else None,
        scale_seq=s.scale_seq, restarts=s.restart_count,
        pending_pod=(pp.name, pp.plan_seq, pp.token, pp.epoch, pp.generation) if pp else None,
        dropped=dropped, look=s.scale_look_pod_uid or "",
        use_milli=0 if int(spec_use) == whole * 1000 else int(spec_use),
        cpus_milli=0 if size is None or cpus_milli == size[0] * 1000 else cpus_milli,
        token=bool(s.scaling_token_secret))


def frac(millicores: int, slots: int) -> SpecChange:
    """A spec change to ``cpus.use`` = ``millicores`` (a fraction, or whole vCPUs) and
    ``slots`` memory slots."""
    whole = -(-millicores // 1000)
    return (whole, slots) if millicores == whole * 1000 else (whole, slots, millicores)


def _freeze(action: act.Action) -> tuple[Any, ...]:
    values: list[Any] = []
    for f in dataclasses.fields(action):
        if f.name == "reason":
            continue
        v = getattr(action, f.name)
        if isinstance(v, PendingScale):
            v = ("PendingScale", tuple(dataclasses.astuple(v)))
        values.append(v)
    return (type(action).__name__, *values)


def _thaw(key: tuple[Any, ...]) -> act.Action:
    cls = getattr(d, key[0])
    names = [f.name for f in dataclasses.fields(cls) if f.name != "reason"]
    if key and isinstance(key[-1], tuple) and key[-1][:1] == (READ,):
        key = key[:-1]  # what the ApplyScale's read gives the pod writes
    kwargs = {}
    for n, v in zip(names, key[1:], strict=True):
        if isinstance(v, tuple) and v and v[0] == "PendingScale":
            v = PendingScale(*v[1])
        kwargs[n] = v
    action: act.Action = cls(**kwargs)
    return action


# ---- the world's steps ------------------------------------------------------------------


class Violation(NamedTuple):
    property: str
    message: str


class ScalingModel:
    def __init__(self, lag: int = 2, mutants: Mutants = Mutants(),
                 refuse_unplug: bool = False, refuse_cpu_unplug: bool = False,
                 pod_writes: bool = False, pod_convergence: bool = True) -> None:
        self.lag = lag
        self.mutants = mutants
        self.pod_writes = pod_writes
        """Model the runner pod's fenced writes (the module doc, "The pod's writes"):
        the pod's ``scale-fence`` is in the observation, and an ``ApplyScale`` the
        runner answered 200 (or, with no token recorded, a fraction-only plan's)
        continues with the tell's steps. Off: the original model (no pod writes)."""
        self.pod_convergence = pod_convergence
        """With ``pod_writes``, the calm run must also bring the pod's annotations and
        CPU request to the spec's ``use`` (:meth:`_pod_converged`)."""
        self.refuse_cpu_unplug = refuse_cpu_unplug
        """As ``refuse_unplug``, for vCPUs: a PUT that lowers the vCPUs starts their
        unplug and answers 504 with them still plugged (after the rest of the change,
        growth first)."""
        self.refuse_unplug = refuse_unplug
        """The guest is slow to let memory go: a PUT that lowers the memory slots records
        its fence, plugs the vCPUs, starts the unplug and answers 504 with the memory
        unchanged, every time. The unplug stays pending; the guest may finish it at any
        later step (:meth:`eject`), refuse it (:meth:`ost`: the DIMMs stay and count as
        plugged again), or do neither."""
        self._calm: dict[World, Violation | None] = {}
        """Calm runs already done, by their starting state."""
        self._restarts: dict[tuple[Any, ...], tuple[VMRep, Runner, Created]] = {}
        self._commits: dict[tuple[Any, ...], VMRep] = {}
        self._writes: dict[tuple[Any, ...], VMRep | str | None] = {}
        self._observed: dict[tuple[Any, ...], tuple[Any, ...] | None] = {}
        """Pod replacements and commits already computed, by what they read (a pure
        function of it; many states share the VM and the leader)."""

    # observation and decision (the shipped decide)
    def observe(self, w: World, i: int, seen: VMRep, unanswered: bool = False,
                misbehaving: bool = False) -> tuple[Any, ...] | None:
        """Worker ``i``'s decision from the VM ``seen``, frozen; None: nothing to hold.
        ``unanswered``: the runner does not answer ``GET /scale`` (only a ``Wait`` on a
        recorded plan is held then: its Scaling condition write); with ``misbehaving``
        it answers as no runner does, and the reconcile ends stuck (its Degraded
        write is held instead). Computed once per what it reads (the key)."""
        x = w.workers[i]
        key = (seen, x.epoch, x.token, w.window_closed, seen == w.vm, w.runner, unanswered,
               misbehaving)
        if key not in self._observed:
            self._observed[key] = self._observe(w, i, seen, unanswered, misbehaving)
        return self._observed[key]

    def _observe(self, w: World, i: int, seen: VMRep, unanswered: bool,
                 misbehaving: bool) -> tuple[Any, ...] | None:
        """:meth:`observe`, computed; it reads of ``w`` only what ``observe``'s key holds."""
        x = w.workers[i]
        if not seen.pod:
            return None  # a pod being replaced: the pod explorer's business
        vm = to_vm(seen)
        r = w.runner
        pod = act.PodView(name=seen.pod, uid=seen.pod_uid, owner_uid=UID, gated=False,
                        terminating=False, phase="Running", node="n1", ip=IP,
                        fence=(1, 10))
        if self.pod_writes and r.pod_uid == seen.pod_uid:
            # The pod as the cache has it (observe.pod_view): its scale-fence, the size
            # it was built with (read by a fraction-only plan on a pod without a token),
            # the size its resources annotation carries and, Burstable, its CPU request
            # (decide.pod_behind). No resize is refused here (not modelled).
            pod = dataclasses.replace(pod, scale_fence=r.scale_fence,
                                      built=(r.boot[0] * 1000, r.boot[1]))
            if not self.mutants.pod_record_ignored:
                pod = dataclasses.replace(pod, annotated=r.ann[:2], cpu_request=None
                                          if r.guaranteed else r.req[0])
        runner = None
        now = (PAST_THE_WINDOW if w.window_closed or self.mutants.end_in_window
               or (self.mutants.window_from_condition and seen.look
                   and seen.dropped is None)
               else WITHIN_THE_WINDOW)
        if unanswered:
            if seen.pending is None:
                return None
            error = RunnerTrouble("unreachable", misbehaving=misbehaving)
            obs = act.Observation(vm=vm, pods=(pod,), lease=act.Fence(x.epoch, x.token),
                                direct=seen == w.vm, runner_error=error, now=now)
            action = d.decide(obs)
            if not (isinstance(action, act.Wait) and action.condition == reasons.SCALING_CONDITION):
                return None
            trouble = runner_trouble(error)
            if misbehaving:
                assert trouble is not None
                return (CONDITIONS_WRITE, (conditions.stuck_condition(*trouble),))
            updates = tuple(u for u in conditions.desired_conditions(
                Snapshot(obs=obs, record=None), action) if u.type == reasons.SCALING_CONDITION)
            return (CONDITIONS_WRITE, updates) if updates else None
        if looks.looks_at_runner(vm, now):
            last = self._last(r)
            runner = act.RunnerView(
                pod_uid=seen.pod_uid,  # what answered on the observed pod's IP
                fence=(last.fence.epoch, last.fence.token, last.fence.seq) if last else None,
                vcpus=r.guest[0], memory_slots=r.guest[1], memory_bytes=r.guest[1] << 30,
                pending_removals=("dimm",) if r.removing is not None and r.recorded
                and not self.mutants.removal_counts_as_present
                and not (self.mutants.end_with_removal_pending and seen.pending is None)
                else (),
                answered_uid=r.pod_uid)  # the runner that answers names its own pod
        obs = act.Observation(vm=vm, pods=(pod,), lease=act.Fence(x.epoch, x.token),
                            direct=seen == w.vm, runner=runner, now=now)
        action = d.decide(obs)
        if isinstance(action, act.Done | act.Wait | act.ObserveDirect | act.Fenced):
            return None
        if self.mutants.no_adoption and isinstance(action, act.CommitScale) and action.adopt \
                and (action.vcpus, action.memory_bytes >> 30) != seen.size:
            return None  # (a write that only ends the look, at status's size, is kept)
        if self.mutants.no_supersede and isinstance(action, act.PlanScale) and seen.pending:
            return _freeze(act.ApplyScale(plan=to_vm(seen).status.pending_scale or PendingScale()))
        if (self.mutants.fraction_outside_plan and isinstance(action, act.PlanScale)
                and seen.pending is None
                and (action.plan.cpus, action.plan.memory_slots) == seen.size):
            return (FOLLOW,)  # no plan: status copies the fraction (before 67ae728)
        if self.pod_writes and isinstance(action, act.ApplyScale):
            return (*_freeze(action), self._read_for_tell(vm, action.plan, pod))
        return _freeze(action)

    def _read_for_tell(self, vm: VirtualMachine, plan: PendingScale,
                       pod: act.PodView) -> tuple[Any, ...]:
        """What the VM read an ``ApplyScale`` was decided from gives its pod writes
        (``RunnerScaling.apply`` and ``_tell_once``, which take the spec from it):
        (READ, generation, the annotations' cpu millicores, the resize's request or
        None when it is not resized, whether status records a token, whether the plan
        is fraction-only)."""
        cpus = autoscaler_view.landed_cpus(vm, plan.cpus)
        use = vm.spec.guest.cpus.current
        resize = (int(use) if vm.spec.pod_resources is None and use.rounded_up() == plan.cpus
                  else None)
        return (READ, vm.generation, int(cpus), resize, bool(vm.status.scaling_token_secret),
                d.fraction_only(vm, plan, pod))

    def _last(self, r: Runner) -> AppliedFence | None:
        if r.stored is not None:
            (e, t, s), size = r.stored
            return AppliedFence(ScaleFence(e, t, s), ScaleTarget(*size), 0.0)
        if r.floor is not None:
            return AppliedFence(ScaleFence(*r.floor), ScaleTarget(*r.boot), 0.0)
        return None

    def perform(self, w: World, i: int) -> tuple[World, Violation | None]:
        x = w.workers[i]
        assert x.held is not None
        done = w._replace(workers=_set(w.workers, i, x._replace(held=None)))
        if x.held[0] == CONDITIONS_WRITE:
            return self._conditions_write(done, i, x.held[1],
                                          key=(w.vm, x.held, x.epoch, x.token)), None
        if x.held[0] == TELL:
            return self._tell(w, i)
        if x.held[0] == FOLLOW:
            return self._follow_fraction(done, i), None
        action = _thaw(x.held)
        if type(action).__name__ in RUNNER_CALLS:
            assert isinstance(action, act.ApplyScale)
            last = x.held[-1]
            read = last if isinstance(last, tuple) and last[:1] == (READ,) else None
            if read is not None and not read[4]:
                return self._without_token(done, i, action.plan, read), None
            new, violation, answered = self._put(done, action.plan)
            if read is not None and answered:
                # Answered 200: the fenced annotation and resize writes follow
                # (RunnerScaling._tell_kubernetes), each a step of its own.
                new = new._replace(workers=_set(new.workers, i, new.workers[i]._replace(
                    held=_tell_held(action.plan, read))))
            return new, violation
        if self.mutants.stale_adopt_after_end and isinstance(action, act.CommitScale):
            action = dataclasses.replace(action, look_recorded=False)
        if self.mutants.commit_pod_behind and isinstance(action, act.CommitScale):
            action = dataclasses.replace(action, pod_behind=False)
        return self._status_write(done, i, action, key=(w.vm, x.held, x.epoch, x.token)), None

    def _written(self, w: World, i: int, key: tuple[Any, ...] | None,
                 compute: Callable[[], VMRep | str | None]) -> World:
        """The world after worker ``i``'s write, whose outcome ``compute`` gives (the VM
        written, nothing to do, or fenced out); by ``key`` (what it reads: the VM, the
        held write, the worker's fence), computed once."""
        if key is None:
            out = compute()
        elif key in self._writes:
            out = self._writes[key]
        else:
            out = self._writes[key] = compute()
        if out == FENCED_OUT:
            x = w.workers[i]
            return w._replace(workers=_set(w.workers, i, x._replace(held=None, stopped=True)))
        if out is None:
            return w
        assert isinstance(out, VMRep)
        return _write(w, out, self.lag)

    def _status_write(self, w: World, i: int, action: act.Action,
                      key: tuple[Any, ...] | None = None) -> World:
        """The worker ``i``'s status write for ``action`` (the conflict helper's: the
        shipped mutation on the current VM); a fence ahead stops the worker."""
        x = w.workers[i]

        def compute() -> VMRep | str | None:
            mutate = action_table.status_mutation(action, act.Fence(x.epoch, x.token))
            fresh = to_vm(w.vm)  # a fresh object: nothing to copy
            if (self.mutants.commit_any_generation and isinstance(action, act.CommitScale)
                    and fresh.status.pending_scale is not None):
                fresh.status.pending_scale.generation = fresh.generation  # no check
            try:
                new = mutate(fresh)
            except mutations.FencedOut:
                return FENCED_OUT
            if new is None:
                return None
            if self.mutants.no_look_record:
                new.scale_look_pod_uid = None
            vm = to_vm(w.vm)
            vm.status = new
            return from_vm(vm)

        return self._written(w, i, key, compute)

    def _conditions_write(self, w: World, i: int,
                          updates: tuple[conditions.ConditionUpdate, ...],
                          key: tuple[Any, ...] | None = None) -> World:
        """The worker ``i``'s conditions write (the shipped
        :func:`~neonvm.controller.conditions.conditions_mutation`) on the current VM."""
        x = w.workers[i]

        def compute() -> VMRep | str | None:
            mutate = conditions.conditions_mutation(
                list(updates), act.Fence(x.epoch, x.token),
                now=times.format_microtime(DROPPED_AT))
            vm = to_vm(w.vm)
            target = to_vm(w.vm)  # an equal, distinct object (cheaper than a deep copy)
            if self.mutants.window_from_condition and target.status.pending_scale is None:
                # No precondition: the update lands as if its plan were still recorded.
                target.status.pending_scale = PendingScale(seq=updates[0].plan_seq or 0)
            try:
                new = mutate(target)
            except mutations.FencedOut:
                return FENCED_OUT
            if new is None:
                return None
            new.pending_scale = vm.status.pending_scale
            vm.status = new
            return from_vm(vm)

        return self._written(w, i, key, compute)

    def refused(self, w: World, i: int) -> World:
        """The worker's ``ApplyScale`` is refused for good before any PUT (it cannot get
        the token: the shipped driver drops the plan, ``ScalingDisabled``)."""
        x = w.workers[i]
        assert x.held is not None
        action = _thaw(x.held)
        assert isinstance(action, act.ApplyScale)
        done = w._replace(workers=_set(w.workers, i, x._replace(held=None)),
                          refusals_left=w.refusals_left - 1)
        return self._status_write(done, i, act.DropScale(seq=action.plan.seq,
                                                       refused=reasons.SCALING_DISABLED))

    def timed_out(self, w: World, i: int) -> World:
        """The worker's ``PUT /scale`` times out at the worker (it will decide again),
        while the request is still on its way to the runner (:attr:`World.late`)."""
        x = w.workers[i]
        assert x.held is not None
        return w._replace(workers=_set(w.workers, i, x._replace(held=None)),
                          timeouts_left=w.timeouts_left - 1, late=(*w.late, x.held))

    def land(self, w: World, k: int) -> tuple[World, Violation | None]:
        """The late request ``k`` reaches the runner (its sender gave up on it: no pod
        write follows)."""
        action = _thaw(w.late[k])
        assert isinstance(action, act.ApplyScale)
        new, violation, _ = self._put(w._replace(late=(*w.late[:k], *w.late[k + 1:])),
                                      action.plan)
        return new, violation

    def _put(self, w: World, plan: PendingScale) -> tuple[World, Violation | None, bool]:
        """``PUT /scale`` of ``plan`` at the current runner: the world after it, an order
        or growth violation, and whether the runner answered 200."""
        r = w.runner
        fence = ScaleFence(plan.epoch, plan.token, plan.seq)
        target = ScaleTarget(plan.cpus, plan.memory_slots)
        if self.mutants.unfenced_runner:
            decision = "newer"
        else:
            try:
                decision = fence_decision(self._last(r), fence, target)
            except ScaleError:
                return w, None, False  # 409: nothing applied
        size = (plan.cpus, plan.memory_slots)
        stored = ((plan.epoch, plan.token, plan.seq), size) if decision == "newer" else r.stored
        if (r.removing is not None and r.recorded
                and not self.mutants.removal_counts_as_present):
            # The shipped runner settles the removals it started first: 504, the fence
            # recorded, nothing plugged or unplugged until the guest has ejected.
            return w._replace(runner=r._replace(stored=stored)), None, False
        guest = size
        removing, ejecting, recorded = r.removing, r.ejecting, r.recorded
        leaving = (max(0, r.guest[0] - size[0]) if self.refuse_cpu_unplug else 0,
                   max(0, r.guest[1] - size[1]) if self.refuse_unplug else 0)
        if self.mutants.refusal_skips_rest and leaving[0]:
            leaving = (leaving[0], 0)  # vCPUs first; their refusal ends the request
            guest = (size[0] + leaving[0], r.guest[1])
        elif any(leaving):
            # 504: the fence stays recorded, the leaving devices stay listed, the rest of
            # the change (what grows first) carried out.
            guest = (size[0] + leaving[0], size[1] + leaving[1])
        if any(leaving):
            removing, ejecting, recorded = (plan.seq, size, *leaving), True, True
        violation = None
        for i, what in enumerate(("vCPUs", "memory slots")):
            if size[i] > r.guest[i] and guest[i] != size[i]:
                violation = Violation("growth", f"plan #{plan.seq} {size} grows the {what} "
                                                f"of a guest at {r.guest}, which is left at "
                                                f"{guest}: a refused unplug held it")
        seq0, size0 = r.received
        # The same plan again (a retry), or a plan as old as the pod that asks for the
        # size it booted with, changes nothing: only a different size counts.
        if plan.seq < seq0 or (plan.seq == seq0 and size != size0):
            violation = Violation("order", f"the guest of pod {r.pod_uid} received plan "
                                           f"#{plan.seq} {size} after plan #{seq0} {size0}"
                                           f"{' (its boot size)' if seq0 == r.boot_seq else ''}")
        runner = r._replace(stored=stored, guest=guest, received=(plan.seq, size),
                            removing=removing, ejecting=ejecting, recorded=recorded)
        return w._replace(runner=runner), violation, not any(leaving)

    # the pod's writes (RunnerScaling._tell_kubernetes)
    def _without_token(self, w: World, i: int, plan: PendingScale,
                       read: tuple[Any, ...]) -> World:
        """``RunnerScaling.apply`` for a VM whose status records no token: a
        fraction-only plan is the tell alone (no runner call); any other is dropped
        (``pod_without_token``: ``ScalingNeedsRestart``, no look)."""
        if read[5]:
            return w._replace(workers=_set(w.workers, i, w.workers[i]._replace(
                held=_tell_held(plan, read))))
        return self._status_write(w, i, act.DropScale(
            seq=plan.seq, refused=reasons.SCALING_NEEDS_RESTART, starts_look=False))

    def _tell(self, w: World, i: int) -> tuple[World, Violation | None]:
        """One request of worker ``i``'s tell: the pod's GET, its annotation PATCH, or its
        resize PATCH (``_tell_once``), the patches with the resourceVersion of the read
        (or of the worker's own write): a 409 when the pod was written since, and the
        tell reads again, up to :data:`TELL_ATTEMPTS` in all."""
        x = w.workers[i]
        assert x.held is not None
        _, phase, fence, uid, cpus, slots, gen, resize, fresh, attempts = x.held
        r = w.runner

        def hold(held: tuple[Any, ...] | None) -> World:
            return w._replace(workers=_set(w.workers, i, x._replace(held=held)))

        def then_resize(at: World) -> World:
            # The annotations carry this plan: the resize, unless the pod is Guaranteed
            # or the read's spec does not resize (its use is of other whole vCPUs).
            held = None if resize is None or at.runner.guaranteed else (
                TELL, "resize", fence, uid, cpus, slots, gen, resize, True, attempts)
            return at._replace(workers=_set(at.workers, i, at.workers[i]._replace(
                held=held)))

        if phase == "read":
            if r.pod_uid != uid:
                return hold(None), None  # no such pod: nothing to annotate
            recorded = r.scale_fence
            if self.mutants.unfenced_annotation:
                return hold((TELL, "patch", fence, uid, cpus, slots, gen, resize, True,
                             attempts)), None
            if recorded is not None and recorded > fence:
                return hold(None), None  # a newer plan's size is on the pod
            if recorded != fence:
                return hold((TELL, "patch", fence, uid, cpus, slots, gen, resize, True,
                             attempts)), None
            if r.ann[:2] != (cpus, slots) and not self.mutants.resize_any_read:
                # The pod carries this plan from another read of the VM: that read's
                # tell resizes (``_tell_once``: not resized to this read's use).
                return hold(None), None
            return then_resize(w), None
        if r.pod_uid != uid:
            return hold(None), None  # the pod is gone (its name and uid preconditions)
        if not fresh and not self.mutants.no_resource_version:
            # 409: read again, up to TELL_ATTEMPTS in all; then the tell is left.
            attempts += 1
            return hold(None if attempts >= TELL_ATTEMPTS else (
                TELL, "read", fence, uid, cpus, slots, gen, resize, True, attempts)), None
        violation = None
        if phase == "patch":
            value = (cpus, slots)
            if gen < r.ann[2] and value != r.ann[:2]:
                violation = Violation("order", f"pod {uid}'s annotations got {value} (plan "
                                               f"#{fence[2]}, spec of generation {gen}) "
                                               f"after {r.ann[:2]} (generation {r.ann[2]})")
            ann = (cpus, slots, max(gen, r.ann[2]) if value == r.ann[:2] else gen)
            written = _pod_written(w._replace(runner=r._replace(scale_fence=fence, ann=ann)), i)
            return then_resize(written), violation
        assert phase == "resize" and resize is not None
        if gen < r.req[1] and resize != r.req[0]:
            violation = Violation("order", f"pod {uid}'s CPU request got {resize}m (plan "
                                           f"#{fence[2]}, spec of generation {gen}) after "
                                           f"{r.req[0]}m (generation {r.req[1]})")
        req = (resize, max(gen, r.req[1]) if resize == r.req[0] else gen)
        written = _pod_written(w._replace(runner=r._replace(req=req)), i)
        return written._replace(workers=_set(written.workers, i, x._replace(held=None))), \
            violation

    def bump(self, w: World) -> World:
        """The pod changes under every pending pod write (the kubelet's status update)."""
        return _pod_written(w._replace(bumps_left=w.bumps_left - 1), None)

    def _follow_fraction(self, w: World, i: int) -> World:
        """:attr:`Mutants.fraction_outside_plan`'s write, the code before 67ae728
        (``autoscaler_view.follow_fraction``): on the fresh copy, a running VM with no
        plan whose ``cpus.use`` rounds up to the whole vCPUs status says gets it as
        ``status.cpus``."""
        x = w.workers[i]

        def compute() -> VMRep | str | None:
            vm = to_vm(w.vm)
            try:
                mutations.check_fence(vm, act.Fence(x.epoch, x.token))
            except mutations.FencedOut:
                return FENCED_OUT
            s, use = vm.status, vm.spec.guest.cpus.current
            if (s.phase != "Running" or s.pending_scale is not None or s.cpus is None
                    or s.cpus == use or s.cpus.rounded_up() != use.rounded_up()):
                return None
            s.cpus = use
            return from_vm(vm)

        return self._written(w, i, None, compute)

    def ost(self, w: World, status: int) -> World | None:
        """The guest answers the pending eject request with ``_OST(3, status)``, and the
        runner reads it with the shipped rule (:func:`ost_refuses_eject`). 0x84: the
        eject goes on (it may still complete); 0x82: refused, the DIMMs stay. A refusal
        read as one settles the runner's record: the DIMMs count as plugged again.
        None: nothing changes."""
        r = w.runner
        assert r.removing is not None and r.ejecting
        rule = _misread_ost_refuses_eject if self.mutants.ost_misread else ost_refuses_eject
        ejecting = status == OST_EJECT_IN_PROGRESS
        recorded = r.recorded and not rule({"source": 3, "status": status})
        if (ejecting, recorded) == (r.ejecting, r.recorded):
            return None
        if not ejecting and not recorded:
            return w._replace(runner=r._replace(removing=None, ejecting=True, recorded=True))
        return w._replace(runner=r._replace(ejecting=ejecting, recorded=recorded))

    def close_window(self, w: World) -> World:
        """The late-PUT window of the last drop passes (no PUT of any plan is on its
        way). Reads from before the drop (a plan recorded) are replaced by then:
        the read history keeps only the versions since the drop (no plan, the same
        ``scaleSeq``)."""
        since = tuple(v for v in w.history
                      if v.pending is None and v.scale_seq == w.vm.scale_seq)
        return w._replace(window_closed=True, history=since)

    def eject(self, w: World) -> tuple[World, Violation | None]:
        """The guest finishes the pending unplug: the DIMMs leave QEMU."""
        r = w.runner
        assert r.removing is not None
        seq, size, leaving_cpus, leaving_slots = r.removing
        violation = None
        seq0, size0 = r.received
        if seq < seq0:
            violation = Violation("order", f"the guest of pod {r.pod_uid} finished plan "
                                           f"#{seq}'s unplug {size} after receiving plan "
                                           f"#{seq0} {size0}")
        runner = r._replace(guest=(r.guest[0] - leaving_cpus, r.guest[1] - leaving_slots),
                            removing=None,
                            ejecting=True, recorded=True)
        return w._replace(runner=runner), violation

    def restart_runner(self, w: World) -> World:
        """The pod is replaced: Restart and RecordPlan (shipped mutations), a new pod built
        by the shipped pod spec (its fence floor, its built size), its runner booted at
        that size; the commit is a later step (:meth:`commit_pod`)."""
        leader = max((x for x in w.workers if x.active and not x.stopped),
                     key=lambda x: x.epoch)
        key = (w.vm, leader.epoch, leader.token)
        if key not in self._restarts:
            self._restarts[key] = self._replaced(w.vm, act.Fence(leader.epoch, leader.token))
        rep, runner, created = self._restarts[key]
        return _write(_pod_written(w._replace(runner=runner, restarts_left=w.restarts_left - 1,
                                              created=created), None), rep, self.lag)

    def _replaced(self, r: VMRep, lease: act.Fence) -> tuple[VMRep, Runner, Created]:
        """:meth:`restart_runner`'s VM, new runner and created pod, from the VM and the
        leader's fence alone."""
        vm = to_vm(r)
        for action in (act.Restart(name=vm.status.pod_name or "", uid=vm.status.pod_uid or ""),
                       act.RecordPlan(plan=PendingPod(
                           name=d.plan_name(vm, vm.status.plan_seq + 1),
                           plan_seq=vm.status.plan_seq + 1, token=lease.token,
                           epoch=lease.epoch, generation=vm.generation),
                           observed_seq=vm.status.plan_seq)):
            # A status mutation reads the VM and returns a new status (a copy it made).
            new = action_table.status_mutation(action, lease)(vm)
            assert new is not None, action
            vm.status = new
        created = podspec.runner_pod(vm, vm.status.pending_pod)  # type: ignore[arg-type]
        env = {e["name"]: e.get("value") for e in created["spec"]["containers"][0]["env"]}
        floor_text = env.get("NEONVM_SCALING_FENCE_FLOOR")
        floor: FenceTriple | None = None
        if floor_text and not self.mutants.no_floor:
            e, t, s = (int(v) for v in floor_text.split(","))
            floor = (e, t, s)
        name = vm.status.pending_pod.name  # type: ignore[union-attr]
        uid = f"uid-{vm.status.plan_seq}"
        milli, slots = podspec.built_size(created["metadata"]) or (0, 0)
        boot = ((milli + 999) // 1000, slots)
        runner = _built_pod(created, vm.generation)._replace(
            pod_uid=uid, floor=floor, received=(vm.status.scale_seq, boot),
            boot_seq=vm.status.scale_seq)
        return from_vm(vm), runner, (name, uid, boot, milli)

    def commit_pod(self, w: World) -> World:
        """The created pod is committed and seen running (shipped decide's Commit, its
        mutation, then SyncStatus), by the newest live leader."""
        assert w.created is not None
        leader = max((x for x in w.workers if x.active and not x.stopped),
                     key=lambda x: x.epoch)
        key = (w.vm, w.created, leader.epoch, leader.token)
        if key not in self._commits:
            self._commits[key] = self._committed(w.vm, w.created,
                                                 act.Fence(leader.epoch, leader.token))
        return _write(w._replace(created=None), self._commits[key], self.lag)

    def _committed(self, r: VMRep, created: Created, lease: act.Fence) -> VMRep:
        """:meth:`commit_pod`'s VM, from the VM, the created pod and the leader's fence
        alone."""
        name, uid, boot, milli = created
        vm = to_vm(r)
        pending = vm.status.pending_pod
        assert pending is not None
        pod = act.PodView(name=name, uid=uid, owner_uid=UID, gated=True, terminating=False,
                        fence=(pending.epoch, pending.token), built=(milli, boot[1]))
        commit = d.decide(act.Observation(vm=vm, pods=(pod,), lease=lease, direct=True))
        assert isinstance(commit, act.Commit), commit
        if self.mutants.commit_spec_size:
            commit = dataclasses.replace(commit, built=None)
        for action in (commit, act.SyncStatus(phase="Running", node="n1", ip=IP, name=name,
                                            uid=uid)):
            # A status mutation reads the VM and returns a new status (a copy it made).
            new = action_table.status_mutation(action, lease)(vm)
            assert new is not None, action
            vm.status = new
        return from_vm(vm)

    def successors(self, w: World) -> Iterator[tuple[str, World, Violation | None]]:
        """Every step from ``w``: its name, the world after it, and a violation of a
        step property (order, growth, or status claiming a fraction not applied)."""
        for step, new, violation in self._steps(w):
            yield step, new, violation or self.claims(w, new)

    def claims(self, before: World, after: World) -> Violation | None:
        """``status.cpus`` newly says a fraction (a commit, a pod commit, any write) that
        the committed pod's annotations do not carry: a fraction never applied."""
        vm = after.vm
        if not self.pod_writes or not vm.cpus_milli or (
                (vm.cpus_milli, vm.pod_uid) == (before.vm.cpus_milli, before.vm.pod_uid)):
            return None
        r = after.runner
        if r.pod_uid == vm.pod_uid and r.ann[0] == vm.cpus_milli:
            return None
        return Violation("claims", f"status.cpus says {vm.cpus_milli}m for pod {vm.pod_uid}, "
                                   f"whose annotations carry {r.ann[0]}m (pod {r.pod_uid})")

    def _steps(self, w: World) -> Iterator[tuple[str, World, Violation | None]]:
        for i, x in enumerate(w.workers):
            if not x.active or x.stopped:
                continue
            if x.held is None:
                for seen in dict.fromkeys((w.vm, *w.history)):
                    held = self.observe(w, i, seen)
                    stale = "" if seen == w.vm else " (stale read)"
                    if held is not None:
                        decided = w._replace(workers=_set(w.workers, i,
                                                          x._replace(held=held)))
                        if self.mutants.forget_before_write and _ends_look(held):
                            decided = _write(decided, decided.vm._replace(look=""),
                                             self.lag)
                        yield f"w{i} decides {held[0]}{stale}", decided, None
                    stuck = (self.observe(w, i, seen, unanswered=True, misbehaving=True)
                             if w.stuck_left else None)
                    if stuck is not None:
                        yield (f"w{i} finds the runner misbehaving{stale}: the reconcile "
                               f"ends stuck (its Degraded write held)", w._replace(
                                   workers=_set(w.workers, i, x._replace(held=stuck)),
                                   stuck_left=w.stuck_left - 1), None)
                    waits = (self.observe(w, i, seen, unanswered=True)
                             if w.unanswered_left else None)
                    if waits is not None:
                        yield (f"w{i} finds the runner not answering{stale}: decides its "
                               f"Scaling condition write", w._replace(
                                   workers=_set(w.workers, i, x._replace(held=waits)),
                                   unanswered_left=w.unanswered_left - 1), None)
            else:
                new, violation = self.perform(w, i)
                what = x.held[0] if x.held[0] != TELL else (
                    f"{TELL} ({x.held[1]} of plan #{x.held[2][2]})")
                yield f"w{i} performs {what}", new, violation
                if x.held[0] in RUNNER_CALLS and w.refusals_left:
                    yield (f"w{i} performs {x.held[0]}: refused for good (no token)",
                           self.refused(w, i), None)
                if x.held[0] in RUNNER_CALLS and w.stuck_left:
                    assert reconciler.paused(STUCK_OUTCOME)
                    held = (CONDITIONS_WRITE, (conditions.stuck_condition(
                        f"ApplyScale{reasons.NOT_TAKING_EFFECT}",
                        reconciler.miss_message(act.ApplyScale, STUCK_OUTCOME, "")),))
                    new = new._replace(workers=_set(new.workers, i, new.workers[i]._replace(
                        held=held)), stuck_left=w.stuck_left - 1)
                    yield (f"w{i} performs {x.held[0]}: answered {STUCK_OUTCOME}, the "
                           f"reconcile ends stuck (its Degraded write held)", new, violation)
                if x.held[0] in RUNNER_CALLS and w.timeouts_left:
                    yield (f"w{i} performs {x.held[0]}: times out, the PUT still on its way",
                           self.timed_out(w, i), None)
                if w.crashes_left:
                    yield (f"w{i} crashes", w._replace(
                        workers=_set(w.workers, i, x._replace(held=None)),
                        crashes_left=w.crashes_left - 1), None)
        for i, x in enumerate(w.workers):
            if not x.active:
                yield (f"failover: w{i} leads (epoch {x.epoch})",
                       w._replace(workers=_set(w.workers, i, x._replace(active=True))), None)
                break
        for k, late in enumerate(w.late):
            new, violation = self.land(w, k)
            yield f"a late PUT of plan #{late[1][1][2]} lands", new, violation
        if _after_drop(w.vm) and not w.window_closed and not w.late and not any(
                x.held is not None and x.held[0] in RUNNER_CALLS
                for x in w.workers if x.active and not x.stopped):
            yield "the late-PUT window closes", self.close_window(w), None
        if w.spec_changes:
            change, rest = w.spec_changes[0], w.spec_changes[1:]
            vm = w.vm._replace(use=(change[0], change[1]), generation=w.vm.generation + 1,
                               use_milli=change[2] if len(change) > 2 else 0)
            said = change if len(change) < 3 else f"({change[2]}m, {change[1]})"
            yield f"user sets use {said}", _write(w._replace(spec_changes=rest), vm,
                                                  self.lag), None
        if w.bumps_left and any(x.held is not None and x.held[0] == TELL and x.held[8]
                                for x in w.workers):
            yield "the kubelet updates the pod (a pending pod write's read is stale)", \
                self.bump(w), None
        if w.runner.removing is not None and w.runner.ejecting:
            new, violation = self.eject(w)
            yield "the guest finishes the pending unplug", new, violation
            for status, what in ((OST_EJECT_IN_PROGRESS, "reports the eject in progress"),
                                 (OST_DEVICE_BUSY, "refuses the pending unplug")):
                answered = self.ost(w, status)
                if answered is not None:
                    yield f"the guest {what} (_OST {status:#x})", answered, None
        leading = any(x.active and not x.stopped for x in w.workers)
        if w.created is not None and leading:
            yield "the new pod is committed", self.commit_pod(w), None
        elif w.restarts_left and leading:
            yield "runner restarts (pod replaced)", self.restart_runner(w), None

    def converges(self, w: World, max_steps: int = 40) -> Violation | None:
        """Faults stop, the newest live leader alone, observing directly, must converge."""
        live = [i for i, x in enumerate(w.workers) if x.active and not x.stopped]
        if not live:
            return None  # every leader stopped; a new term would start: not modelled
        i = max(live, key=lambda j: w.workers[j].epoch)
        # The newest leader finishes the pod writes it has begun (a tell is the rest of
        # its ApplyScale, not a decision from a read it may drop; a crash loses it).
        workers = tuple((x if x.held is not None and x.held[0] == TELL
                         else x._replace(held=None)) if j == i
                        else x._replace(held=None, stopped=True)
                        for j, x in enumerate(w.workers))
        # The calm run reads only the current VM, so states that differ in what the
        # stopped workers held, the read history or the faults left share one calm run.
        # Late requests that have not landed do not land during it: the states where they
        # landed are explored (and their calm runs checked) in their own right.
        # Time passes in a calm run: with no PUT on its way, the window closes.
        s = w._replace(workers=workers, history=(), spec_changes=(), restarts_left=0,
                       crashes_left=0, refusals_left=0, timeouts_left=0, late=(),
                       unanswered_left=0, stuck_left=0, bumps_left=0,
                       window_closed=_after_drop(w.vm))
        if s in self._calm:
            return self._calm[s]
        self._calm[s] = verdict = self._calm_run(s, i, max_steps)
        return verdict

    def _calm_run(self, s: World, i: int, max_steps: int) -> Violation | None:
        if s.created is not None:
            s = self.commit_pod(s)
        quiet = False  # the run ended with nothing left to decide (observe gave None)
        for _ in range(max_steps):
            if s.workers[i].held is None:  # else: the tell of its last ApplyScale goes on
                held = self.observe(s, i, s.vm)
                if held is None:
                    quiet = True
                    break
                s = s._replace(workers=_set(s.workers, i, s.workers[i]._replace(held=held)))
            before = s
            s, violation = self.perform(s, i)
            violation = violation or self.claims(before, s)
            if violation is not None:
                return violation
            # Nothing is on its way in a calm run: a drop's window passes as well.
            s = s._replace(window_closed=_after_drop(s.vm))
            if s.workers[i].stopped:
                return Violation("convergence", "the newest leader was fenced out")
        if s.vm.look and s.vm.look == s.vm.pod_uid and s.runner.removing is None:
            return Violation("convergence", f"past the window, with no removal pending, the "
                                            f"calm run ends still looking at the runner of "
                                            f"{s.vm.look} (status {s.vm.size}, guest "
                                            f"{s.runner.guest})")
        want = s.vm.use
        refused = s.vm.dropped is not None and s.vm.dropped[0] in reasons.SCALING_REFUSED and (
            s.vm.dropped[1] == s.vm.generation)
        if refused and s.runner.removing is not None:
            # Refused for this spec, and the guest may still finish an unplug: no plan
            # until the spec changes, and the look goes on, so that status follows the
            # guest when it ejects.
            if s.vm.pending is not None or s.vm.look != s.vm.pod_uid:
                return Violation("convergence", f"refused for this spec with an unplug "
                                                f"still pending; calm run ends with plan "
                                                f"{s.vm.pending}, looking at "
                                                f"{s.vm.look or 'nothing'} (status "
                                                f"{s.vm.size}, guest {s.runner.guest})")
            return None
        # Converged, the run must also have gone quiet: a plan loop (each plan leaving a
        # reason for the next) can pass through states that look converged.
        loud = None if quiet else Violation(
            "quiescence", f"the calm run still decides after {max_steps} steps (plan "
                          f"{s.vm.pending}, scaleSeq {s.vm.scale_seq}, status {s.vm.size}, guest "
                          f"{s.runner.guest}): a plan loop")
        if refused:
            # Refused for this spec: no plan until it changes; status must say what the
            # guest has (whatever a late PUT left it at).
            if (s.vm.size, s.vm.pending) != (s.runner.guest, None):
                return Violation("convergence", f"refused for this spec; calm run ends "
                                                f"with guest {s.runner.guest}, status "
                                                f"{s.vm.size}, plan {s.vm.pending}")
            return loud
        if (self.refuse_cpu_unplug and want[0] < s.runner.guest[0]) or (
                self.refuse_unplug and want[1] < s.runner.guest[1]) or s.runner.removing:
            # Cannot be reached (or not until the guest finishes an unplug it may never
            # finish): the newest plan must be the one still being tried.
            p = s.vm.pending
            if p is None or (p[0], p[1]) != want:
                return Violation("convergence", f"the guest refuses unplugs; calm run ends "
                                                f"with plan {p}, not one for {want}")
            return None
        if (s.runner.guest, s.vm.size, s.vm.pending) != (want, want, None):
            return Violation("convergence", f"calm run ends with guest {s.runner.guest}, "
                                            f"status {s.vm.size}, plan {s.vm.pending}; "
                                            f"spec asks {want}")
        if self.pod_writes and self.pod_convergence:
            return self._pod_converged(s) or loud
        return loud

    def _pod_converged(self, s: World) -> Violation | None:
        """At the spec's size: ``status.cpus`` is the spec's ``cpus.use`` exactly, the
        pod's annotations carry it and the spec's slots, and its CPU request is it
        (unless the pod is Guaranteed, never resized)."""
        use = s.vm.use_milli or s.vm.use[0] * 1000
        cpus = s.vm.cpus_milli or s.vm.use[0] * 1000
        r = s.runner
        if cpus != use:
            return Violation("pod-convergence", f"calm run ends with status.cpus {cpus}m; "
                                                f"spec asks {use}m")
        if r.ann[:2] != (use, s.vm.use[1]):
            return Violation("pod-convergence", f"calm run ends with the pod's annotations "
                                                f"at {r.ann[:2]} (generation {r.ann[2]}); "
                                                f"spec and status say {(use, s.vm.use[1])}")
        if not r.guaranteed and r.req[0] != use:
            return Violation("pod-convergence", f"calm run ends with the pod's CPU request "
                                                f"at {r.req[0]}m (generation {r.req[1]}); "
                                                f"spec and status say {use}m")
        return None


def _set(xs: tuple[WorkerRep, ...], i: int, x: WorkerRep) -> tuple[WorkerRep, ...]:
    return (*xs[:i], x, *xs[i + 1:])


def _built_pod(created: dict[str, Any], generation: int) -> Runner:
    """The runner of a pod built by :func:`neonvm.controller.podspec.runner_pod` from the
    VM of ``generation``: booted at its built size, its annotations and CPU request as
    built, its QoS class (the uid, floor and received plan are the caller's)."""
    meta = created["metadata"]
    milli, slots = podspec.built_size(meta) or (0, 0)
    boot = ((milli + 999) // 1000, slots)
    resources = json.loads(meta["annotations"][podspec.ANNOTATION_RESOURCES])
    requests = created["spec"]["containers"][0]["resources"]["requests"]
    return Runner(pod_uid="", stored=None, floor=None, boot=boot, guest=boot,
                  received=(0, boot), boot_seq=0,
                  ann=(int(MilliCPU.parse(resources["cpus"]["use"])),
                       int(resources["memorySlots"]["use"]), generation),
                  req=(int(MilliCPU.parse(requests["cpu"])), generation),
                  guaranteed=_qos_class(created) == "Guaranteed")


def _tell_held(plan: PendingScale, read: tuple[Any, ...]) -> tuple[Any, ...]:
    """The held tell of ``plan``, from what its ``ApplyScale``'s read gives it, at its
    first request (the pod's GET): (TELL, request, fence, pod uid, annotations' cpu
    millicores, slots, generation, resize request or None, the read still current,
    attempts used)."""
    _, generation, cpus, resize, _token, _fraction = read
    return (TELL, "read", d.scale_fence(plan), plan.pod_uid, cpus, plan.memory_slots,
            generation, resize, True, 0)


def _pod_written(w: World, writer: int | None) -> World:
    """The pod was written (by worker ``writer``, or None: not by a worker): every other
    worker's held read of it is stale now (its patch would get a 409)."""
    workers = tuple(
        x._replace(held=(*x.held[:8], False, x.held[9]))
        if j != writer and x.held is not None and x.held[0] == TELL and x.held[8] else x
        for j, x in enumerate(w.workers))
    return w._replace(workers=workers)


def _after_drop(vm: VMRep) -> bool:
    """Status shows a drop whose window may still be open: the Scaling condition says
    the last plan was dropped, or the look it asked for is recorded (its own time, which
    no other write changes)."""
    return vm.dropped is not None or bool(vm.look)


def _write(w: World, vm: VMRep, lag: int) -> World:
    if vm == w.vm:
        return w
    # A new drop opens a new window; no drop, no window (kept False so that states
    # differ only in what matters). A write that changes only the condition (a Wait's
    # Scaling=True over a drop's) does not move the window of the recorded look.
    closed = w.window_closed and _after_drop(w.vm) and _after_drop(vm)
    return w._replace(vm=vm, history=(w.vm, *w.history)[:lag], window_closed=closed)


def _ends_look(held: tuple[Any, ...]) -> bool:
    """A held action is a write that ends the look after a drop."""
    if held[0] != "CommitScale":
        return False
    action = _thaw(held)
    return isinstance(action, act.CommitScale) and action.adopt and action.ends_look


def initial_world(spec_changes: tuple[SpecChange, ...] = ((2, 2), (1, 1)), restarts: int = 1,
                  crashes: int = 1, refusals: int = 0, timeouts: int = 0,
                  unanswered: int = 0, stuck: int = 0, cpus: int = 1000,
                  token: bool = False, bumps: int = 0) -> World:
    """A VM running at ``cpus`` millicores (1 vCPU), 1 slot, committed by leader 1 (its
    pod as :func:`neonvm.controller.podspec.runner_pod` builds it); leader 2 not
    started. ``token``: status records a scaling token Secret (a world with pod writes;
    without one a fraction-only plan is the tell alone); ``bumps``: the kubelet may
    change the pod under a pending pod write this many times."""
    assert 0 < cpus <= 1000
    vm = VMRep(use=(1, 1), generation=1, phase="Running", pod="vm-01234567-1",
               pod_uid="uid-1", plan_seq=1, fence=(1, 10), size=(1, 1), pending=None,
               scale_seq=0, restarts=0, use_milli=cpus % 1000, cpus_milli=cpus % 1000,
               token=token)
    building = to_vm(vm._replace(pending_pod=(vm.pod, 1, 10, 1, 1)))
    built = podspec.runner_pod(building, building.status.pending_pod)  # type: ignore[arg-type]
    runner = _built_pod(built, vm.generation)._replace(pod_uid="uid-1", floor=(1, 10, 0))
    workers = (WorkerRep(1, 10, True, False, None), WorkerRep(2, 11, False, False, None))
    return World(vm=vm, history=(), runner=runner, workers=workers,
                 spec_changes=spec_changes, restarts_left=restarts, crashes_left=crashes,
                 refusals_left=refusals, timeouts_left=timeouts, unanswered_left=unanswered,
                 stuck_left=stuck, bumps_left=bumps)


@dataclass
class ScalingReport:
    states: int = 0
    transitions: int = 0
    complete: bool = False
    violation: Violation | None = None
    trace: list[str] = dataclasses.field(default_factory=list)


def explore_scaling(world: World | None = None, *, lag: int = 2, mutants: Mutants = Mutants(),
                    max_states: int = 200_000, liveness: bool = True,
                    refuse_unplug: bool = False,
                    refuse_cpu_unplug: bool = False,
                    pod_writes: bool = False, pod_convergence: bool = True) -> ScalingReport:
    """Breadth-first over every interleaving; stops at the first violation."""
    model = ScalingModel(lag=lag, mutants=mutants, refuse_unplug=refuse_unplug,
                         refuse_cpu_unplug=refuse_cpu_unplug, pod_writes=pod_writes,
                         pod_convergence=pod_convergence)
    start = world or initial_world()
    parents: dict[World, tuple[World, str] | None] = {start: None}
    queue: deque[World] = deque([start])
    report = ScalingReport()

    def trace(s: World, last: str) -> list[str]:
        steps = [last]
        at: tuple[World, str] | None = parents[s]
        while at is not None:
            s, step = at
            steps.append(step)
            at = parents[s]
        return steps[::-1]

    while queue:
        s = queue.popleft()
        report.states += 1
        if liveness:
            violation = model.converges(s)
            if violation is not None:
                report.violation, report.trace = violation, trace(s, "(calm run)")
                return report
        for step, nxt, violation in model.successors(s):
            report.transitions += 1
            if violation is not None:
                parents.setdefault(nxt, (s, step))
                report.violation = violation
                report.trace = trace(s, step)
                return report
            if nxt not in parents:
                if len(parents) >= max_states:
                    return report
                parents[nxt] = (s, step)
                queue.append(nxt)
    report.complete = True
    return report
