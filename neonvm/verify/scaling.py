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

Properties:

* **Order** (safety, every step): the sizes a guest receives come from plans in the order
  they were recorded: a runner never applies a plan whose ``seq`` is lower than one it
  applied, nor one recorded before its pod was created (its guest booted at a newer
  size); the same plan again, with the same size, is a retry and changes nothing.
* **Convergence** (from every reachable state): once the deposed leader and the faults
  stop, the newest leader, observing directly, brings the guest, the runner and status to
  the spec's size within a bounded number of steps; when the spec was refused for its
  generation, to status saying what the guest has (no plan).
* **Growth** (every runner apply, with unplugs refused): what the applied plan grows
  reaches the plan's size, whatever unplug of the other resource is refused.

Coarser than the real thing: the pod's own lifecycle (plan, create, ungate) is one step
here (it has its own explorer); a runner's apply is atomic (a crash inside it is a
runner restart, which loses the guest anyway); of the conditions only whether the
Scaling condition says a plan was dropped (and why, for which generation) is part of the
state: decide reads nothing else of it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
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
from neonvm.controller.scaling import RunnerTrouble, runner_trouble
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
Created = tuple[str, str, Size]
"""A created pod: its name, uid and built size."""
FENCED_OUT = "fenced-out"
"""A write's outcome: a fence ahead of the writer's (the worker stops)."""


CONDITIONS_WRITE = "ConditionsWrite"
"""The held kind of a reconcile's conditions write (:meth:`ScalingModel._conditions_write`):
the Scaling condition of a ``Wait`` on a plan whose runner does not answer."""
STUCK_OUTCOME = "runner_504"
"""The ``ApplyScale`` outcome of a modelled stuck end: the runner's answer to an unplug
the guest neither finished nor refused (any outcome the driver pauses on is written the
same way)."""
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


class WorkerRep(NamedTuple):
    epoch: int
    token: int
    active: bool
    stopped: bool
    held: tuple[Any, ...] | None
    """A decided action not yet performed: (kind, args...)."""


class World(NamedTuple):
    vm: VMRep
    history: tuple[VMRep, ...]
    runner: Runner
    workers: tuple[WorkerRep, ...]
    spec_changes: tuple[Size, ...]
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
        cpus=CPURange(min=MilliCPU(1000), max=MilliCPU(2000), use=MilliCPU(r.use[0] * 1000)),
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
        cpus=MilliCPU(r.size[0] * 1000) if r.size else None,
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
    status.scale_look_pod_uid = r.look or None
    status.scale_look_since = times.format_microtime(DROPPED_AT) if r.look else None
    return VirtualMachine(name="vm", namespace="ns", uid=UID, resource_version="1",
                          generation=r.generation, spec=spec, status=status,
                          finalizers=[FINALIZER])


def from_vm(vm: VirtualMachine, use: Size) -> VMRep:
    s = vm.status
    p = s.pending_scale
    pp = s.pending_pod
    size = d.status_size(vm)
    cond = next((c for c in s.conditions if c.type == reasons.SCALING_CONDITION), None)
    dropped = ((cond.reason, cond.observed_generation or 0) if cond is not None
               and cond.status == "False" and cond.reason in reasons.DROP_REASONS else None)
    return VMRep(
        use=use, generation=vm.generation, phase=s.phase or "Pending", pod=s.pod_name or "",
        pod_uid=s.pod_uid or "", plan_seq=s.plan_seq,
        fence=(s.fence.epoch, s.fence.token) if s.fence else None, size=size,
        pending=(p.cpus, p.memory_slots, p.seq, p.epoch, p.token, p.pod_name, p.pod_uid,
                 p.generation) if p else None,
        scale_seq=s.scale_seq, restarts=s.restart_count,
        pending_pod=(pp.name, pp.plan_seq, pp.token, pp.epoch, pp.generation) if pp else None,
        dropped=dropped, look=s.scale_look_pod_uid or "")


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
                 refuse_unplug: bool = False, refuse_cpu_unplug: bool = False) -> None:
        self.lag = lag
        self.mutants = mutants
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
        pod = act.PodView(name=seen.pod, uid=seen.pod_uid, owner_uid=UID, gated=False,
                        terminating=False, phase="Running", node="n1", ip=IP,
                        fence=(1, 10))
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
            r = w.runner
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
        return _freeze(action)

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
        action = _thaw(x.held)
        if type(action).__name__ in RUNNER_CALLS:
            assert isinstance(action, act.ApplyScale)
            return self._put(done, action.plan)
        if self.mutants.stale_adopt_after_end and isinstance(action, act.CommitScale):
            action = dataclasses.replace(action, look_recorded=False)
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
            try:
                new = mutate(to_vm(w.vm))  # a fresh object: nothing to copy
            except mutations.FencedOut:
                return FENCED_OUT
            if new is None:
                return None
            if self.mutants.no_look_record:
                new.scale_look_pod_uid = None
            vm = to_vm(w.vm)
            vm.status = new
            return from_vm(vm, w.vm.use)

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
            return from_vm(vm, w.vm.use)

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
        """The late request ``k`` reaches the runner."""
        action = _thaw(w.late[k])
        assert isinstance(action, act.ApplyScale)
        return self._put(w._replace(late=(*w.late[:k], *w.late[k + 1:])), action.plan)

    def _put(self, w: World, plan: PendingScale) -> tuple[World, Violation | None]:
        r = w.runner
        fence = ScaleFence(plan.epoch, plan.token, plan.seq)
        target = ScaleTarget(plan.cpus, plan.memory_slots)
        if self.mutants.unfenced_runner:
            decision = "newer"
        else:
            try:
                decision = fence_decision(self._last(r), fence, target)
            except ScaleError:
                return w, None  # 409: nothing applied
        size = (plan.cpus, plan.memory_slots)
        stored = ((plan.epoch, plan.token, plan.seq), size) if decision == "newer" else r.stored
        if (r.removing is not None and r.recorded
                and not self.mutants.removal_counts_as_present):
            # The shipped runner settles the removals it started first: 504, the fence
            # recorded, nothing plugged or unplugged until the guest has ejected.
            return w._replace(runner=r._replace(stored=stored)), None
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
        return w._replace(runner=runner), violation

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
        return _write(w._replace(runner=runner, restarts_left=w.restarts_left - 1,
                                 created=created), rep, self.lag)

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
        runner = Runner(pod_uid=uid, stored=None, floor=floor, boot=boot, guest=boot,
                        received=(vm.status.scale_seq, boot), boot_seq=vm.status.scale_seq)
        return from_vm(vm, r.use), runner, (name, uid, boot)

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
        name, uid, boot = created
        vm = to_vm(r)
        pending = vm.status.pending_pod
        assert pending is not None
        pod = act.PodView(name=name, uid=uid, owner_uid=UID, gated=True, terminating=False,
                        fence=(pending.epoch, pending.token),
                        built=(boot[0] * 1000, boot[1]))
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
        return from_vm(vm, r.use)

    def successors(self, w: World) -> Iterator[tuple[str, World, Violation | None]]:
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
                yield f"w{i} performs {x.held[0]}", new, violation
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
            use, rest = w.spec_changes[0], w.spec_changes[1:]
            vm = w.vm._replace(use=use, generation=w.vm.generation + 1)
            yield f"user sets use {use}", _write(w._replace(spec_changes=rest), vm,
                                                 self.lag), None
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
        workers = tuple(x._replace(held=None) if j == i else x._replace(held=None, stopped=True)
                        for j, x in enumerate(w.workers))
        # The calm run reads only the current VM, so states that differ in what the
        # stopped workers held, the read history or the faults left share one calm run.
        # Late requests that have not landed do not land during it: the states where they
        # landed are explored (and their calm runs checked) in their own right.
        # Time passes in a calm run: with no PUT on its way, the window closes.
        s = w._replace(workers=workers, history=(), spec_changes=(), restarts_left=0,
                       crashes_left=0, refusals_left=0, timeouts_left=0, late=(),
                       unanswered_left=0, stuck_left=0, window_closed=_after_drop(w.vm))
        if s in self._calm:
            return self._calm[s]
        self._calm[s] = verdict = self._calm_run(s, i, max_steps)
        return verdict

    def _calm_run(self, s: World, i: int, max_steps: int) -> Violation | None:
        if s.created is not None:
            s = self.commit_pod(s)
        for _ in range(max_steps):
            held = self.observe(s, i, s.vm)
            if held is None:
                break
            s = s._replace(workers=_set(s.workers, i, s.workers[i]._replace(held=held)))
            s, violation = self.perform(s, i)
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
        if refused:
            # Refused for this spec: no plan until it changes; status must say what the
            # guest has (whatever a late PUT left it at).
            if (s.vm.size, s.vm.pending) != (s.runner.guest, None):
                return Violation("convergence", f"refused for this spec; calm run ends "
                                                f"with guest {s.runner.guest}, status "
                                                f"{s.vm.size}, plan {s.vm.pending}")
            return None
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
        return None


def _set(xs: tuple[WorkerRep, ...], i: int, x: WorkerRep) -> tuple[WorkerRep, ...]:
    return (*xs[:i], x, *xs[i + 1:])


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


def initial_world(spec_changes: tuple[Size, ...] = ((2, 2), (1, 1)), restarts: int = 1,
                  crashes: int = 1, refusals: int = 0, timeouts: int = 0,
                  unanswered: int = 0, stuck: int = 0) -> World:
    """A VM running at 1 vCPU, 1 slot, committed by leader 1; leader 2 not started."""
    vm = VMRep(use=(1, 1), generation=1, phase="Running", pod="vm-01234567-1",
               pod_uid="uid-1", plan_seq=1, fence=(1, 10), size=(1, 1), pending=None,
               scale_seq=0, restarts=0)
    runner = Runner(pod_uid="uid-1", stored=None, floor=(1, 10, 0), boot=(1, 1),
                    guest=(1, 1), received=(0, (1, 1)), boot_seq=0)
    workers = (WorkerRep(1, 10, True, False, None), WorkerRep(2, 11, False, False, None))
    return World(vm=vm, history=(), runner=runner, workers=workers,
                 spec_changes=spec_changes, restarts_left=restarts, crashes_left=crashes,
                 refusals_left=refusals, timeouts_left=timeouts, unanswered_left=unanswered,
                 stuck_left=stuck)


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
                    refuse_cpu_unplug: bool = False) -> ScalingReport:
    """Breadth-first over every interleaving; stops at the first violation."""
    model = ScalingModel(lag=lag, mutants=mutants, refuse_unplug=refuse_unplug,
                         refuse_cpu_unplug=refuse_cpu_unplug)
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
