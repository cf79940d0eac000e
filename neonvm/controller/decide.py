"""The reconcile decision: what was observed in, the next single action out.

The whole state machine of docs/protocol.md in one pure function, :func:`decide`; the
driver performs what it returns and asks again until :class:`Done` or :class:`Wait`, and
the interleaving explorer calls the very same function. The dangerous actions (restart,
delete a pod, drop the finalizer) are returned only from a direct observation, else
:class:`ObserveDirect`. How observations are read and the restart backoff:
docs/reconciler.md ("The loop", "Restart backoff").

What it guarantees, given observations that are truthful snapshots:

* it never asks to ungate a pod unless that pod is ``status.podName`` and the
  observation shows it as the VM's only pod, gated, not terminating (the driver then
  requires its own quorum list, taken after the commit was seen, to show the same);
* it never asks to create a pod whose name is not the recorded ``status.pendingPod``;
* it commits (adopts) a pod only if the pod is owned by the VM and carries the fence
  (epoch, token) of the recorded plan, which only that plan's create writes;
* it never asks to delete the committed or the planned pod of a live VM.

It performs no write and checks no precondition: the driver's conditional writes do, and
safety rests on them plus the ungate rule, not on leadership.
"""

from __future__ import annotations

from neonvm.api import times
from neonvm.api.millicpu import MilliCPU
from neonvm.api.types import (
    ANNOTATION_SCALE_FENCE,
    FINALIZER,
    PendingPod,
    PendingScale,
    VirtualMachine,
)
from neonvm.controller import autoscaler_view
from neonvm.controller.actions import (
    Action,
    AddFinalizer,
    ApplyScale,
    Commit,
    CommitScale,
    CreatePod,
    DeletePod,
    Done,
    DropPlan,
    DropScale,
    Fenced,
    ForceDeleteDeadPod,
    Observation,
    ObserveDirect,
    PlanScale,
    PodView,
    RecordPlan,
    RemoveFinalizer,
    Restart,
    SyncPodMetadata,
    SyncStatus,
    Ungate,
    Wait,
)
from neonvm.controller.looks import (
    LATE_PUT_SECONDS,
    LOOK_GIVE_UP_SECONDS,
    look_given_up,
    look_may_end,
    look_pending,
)
from neonvm.controller.reasons import (
    DEGRADED,
    NAMESPACE_TERMINATING,
    POD_SCALE_FENCE_AHEAD,
    PULL_SECRET_NOT_FOUND,
    RESTART_BACKOFF_CONDITION,
    SCALING_CONDITION,
    SCALING_NEEDS_RESTART,
    SCALING_REFUSED,
    WAITING_FOR_OLD_POD,
)
from neonvm.controller.restarts import backoff_remaining, restart_backoff

RUNNER_RECHECK_SECONDS = 2.0
"""How soon a scaling change whose runner could not be asked is looked at again."""
POD_FENCE_RECHECK_SECONDS = 60.0
"""How soon a pod whose scale-fence no plan of the VM wrote is looked at again (the
pod's watch brings its repair sooner)."""


def scale_fence(plan: PendingScale) -> tuple[int, int, int]:
    """What the runner is sent and compares: (epoch, token, seq)."""
    return (plan.epoch, plan.token, plan.seq)


def desired_size(vm: VirtualMachine) -> tuple[int, int]:
    """(vCPUs, memory slots) the spec asks for: ceil(cpus.use), memorySlots.use."""
    guest = vm.spec.guest
    return guest.cpus.current.rounded_up(), guest.memory_slots.current


def fraction_only(vm: VirtualMachine, plan: PendingScale, pod: PodView) -> bool:
    """Whether ``plan`` asks for the whole vCPUs and memory slots ``pod`` was built with
    (status's size when the pod does not record it): for a pod without a scaling token,
    whose runner no ``PUT /scale`` ever reaches, a change of ``cpus.use`` within them,
    which only the pod's annotations carry (docs/protocol.md, "Live scaling")."""
    if pod.built is not None:
        millicores, slots = pod.built
        built: tuple[int, int] | None = (-(-millicores // 1000), slots)
    else:
        built = status_size(vm)
    return built == (plan.cpus, plan.memory_slots)


def resize_request(vm: VirtualMachine) -> int:
    """The runner container's CPU request (millicores) a plan's in-place resize sets for
    ``vm``'s spec: ``cpus.use`` (at least 1m, as a pod's quantity)."""
    return max(1, int(vm.spec.guest.cpus.current))


def pod_behind(vm: VirtualMachine, pod: PodView) -> str | None:
    """Why the committed pod's own record of its size is not the spec's while status is
    (docs/protocol.md, "Live scaling", "The pod's record"), or None: its
    ``vm.neon.tech/resources`` annotation says another ``cpus.use`` or
    ``memorySlots.use`` (a tell lost, or written from an older read of the VM), or a
    pod a plan has resized (Burstable, carrying a ``scale-fence``, no ``podResources``)
    has a CPU request other than ``cpus.use`` and no record that this plan's resize was
    refused (a resize lost). A pod without the annotation, or not resized by plans, is
    never behind."""
    guest = vm.spec.guest
    use = guest.cpus.current
    if pod.annotated is not None and pod.annotated != (int(use), guest.memory_slots.current):
        return (f"resources annotation says cpus.use {MilliCPU(pod.annotated[0])}, "
                f"memorySlots.use {pod.annotated[1]}")
    if (pod.scale_fence is not None and vm.spec.pod_resources is None
            and pod.cpu_request is not None and pod.cpu_request != resize_request(vm)
            and pod.resize_refused != pod.scale_fence):
        return f"CPU request is {MilliCPU(pod.cpu_request)}, not its plan's resize to {use}"
    return None


def pod_fence_ahead(vm: VirtualMachine, pod: PodView) -> bool:
    """Whether ``pod``'s ``scale-fence`` is above every plan ``vm`` records: (epoch,
    token) of ``status.fence``, ``status.scaleSeq``. Each plan is recorded in the VM
    (its CAS stamps both) before its tell writes the pod, so read from a VM no older
    than the pod, such a fence was written by no plan: a tenant's patch of the pod
    (docs/protocol.md, "The pod's record")."""
    if pod.scale_fence is None:
        return False
    fence = vm.status.fence
    newest = ((fence.epoch, fence.token) if fence is not None else (0, 0)) + (
        vm.status.scale_seq,)
    return pod.scale_fence > newest


def status_memory_bytes(vm: VirtualMachine) -> int | None:
    """``status.memorySize`` in bytes; None: not recorded or not a quantity."""
    from neonvm.api.quantity import QuantityError, parse_bytes

    if vm.status.memory_size is None:
        return None
    try:
        return parse_bytes(vm.status.memory_size)
    except QuantityError:
        return None


def status_size(vm: VirtualMachine) -> tuple[int, int] | None:
    """(vCPUs, memory slots) status says the committed pod has; None: not recorded, or
    not in whole slots of the spec's slot size."""
    from neonvm.api.quantity import QuantityError, parse_bytes

    s = vm.status
    memory = status_memory_bytes(vm)
    if s.cpus is None or memory is None:
        return None
    try:
        slot = parse_bytes(vm.spec.guest.memory_slot_size)
    except QuantityError:
        return None
    if slot <= 0 or memory % slot:
        return None
    return s.cpus.rounded_up(), memory // slot


# ---- restart backoff ---------------------------------------------------------------------

NAMESPACE_TERMINATING_RECHECK_SECONDS = 30.0
"""How soon a VM waiting in a terminating namespace is looked at again without an event."""
PULL_SECRET_RECHECK_SECONDS = 15.0
"""How soon a VM waiting for a missing image pull secret is looked at again."""


# ---- the decision ------------------------------------------------------------------------

TERMINAL_PHASES = ("Succeeded", "Failed")


def plan_name(vm: VirtualMachine, seq: int) -> str:
    """Pod name for plan ``seq``: unique forever (VM uid prefix + ever-increasing seq)."""
    return f"{vm.name}-{vm.uid[:8]}-{seq}"


def decide(obs: Observation) -> Action:
    """The next action for one VM, given one observation. Pure: no I/O, and no clock but
    ``obs.now``.

    In a namespace being deleted (``obs.namespace_terminating``) nothing that leads to a
    new pod is asked for (a Restart into a new plan, RecordPlan, CreatePod): the answer
    is ``Wait(condition=NamespaceTerminating)`` instead. Deletion, clean-up and terminal
    phases go on as everywhere (docs/reconciler.md, "A namespace being deleted")."""
    action = _decide(obs)
    if obs.namespace_terminating and _makes_a_pod(action):
        return Wait(seconds=NAMESPACE_TERMINATING_RECHECK_SECONDS,
                    condition=NAMESPACE_TERMINATING,
                    reason=f"namespace is being deleted: not {type(action).__name__} "
                           f"({action.reason}); the VM goes with it")
    return action


def _makes_a_pod(action: Action) -> bool:
    """``action`` leads to a new runner pod (a Restart that is not into a terminal phase
    is followed by a new plan)."""
    if isinstance(action, Restart):
        return action.terminal_phase is None
    return isinstance(action, RecordPlan | CreatePod)


def replaces_a_pod(action: Action) -> bool:
    """``action`` begins a VM's next runner pod after an earlier one: a Restart into a new
    plan, or the plan of any pod but the VM's first. Before one, unless the VM's
    namespace is known to be being deleted, the driver reads the Namespace; a pod of a
    namespace being deleted goes because the namespace goes, and is not replaced
    (docs/reconciler.md, "A namespace being deleted"). A VM's first plan is not read
    for: the VM was created, so the namespace was not being deleted moments ago."""
    if isinstance(action, Restart):
        return action.terminal_phase is None
    return isinstance(action, RecordPlan) and action.plan.plan_seq > 1


def _decide(obs: Observation) -> Action:
    vm = obs.vm
    if vm is None:
        return Done(reason="VM does not exist")
    if vm.status.fence is not None and vm.status.fence.epoch > obs.lease.epoch:
        return Fenced(seen_epoch=vm.status.fence.epoch, reason="VM fenced by a newer leader")
    pending = vm.status.pending_pod
    if pending is not None and pending.epoch > obs.lease.epoch:
        return Fenced(seen_epoch=pending.epoch, reason="plan recorded by a newer leader")
    scaling = vm.status.pending_scale
    if (scaling is not None and scaling.epoch > obs.lease.epoch
            and vm.deletion_timestamp is None):
        # A VM being deleted needs nothing of its scaling plan: its pods go and its
        # finalizer with them (docs/reconciler.md, "Fencing").
        return Fenced(seen_epoch=scaling.epoch,
                      reason="scaling plan recorded by a newer leader")

    if vm.deletion_timestamp is not None:
        return _decide_deletion(obs, vm)
    if FINALIZER not in vm.finalizers:
        return AddFinalizer(reason="VM has no finalizer yet")

    if vm.status.pod_name:
        action = _decide_committed(obs, vm)
    elif pending is not None:
        action = _decide_pending(obs, vm, pending)
    elif vm.status.phase in TERMINAL_PHASES:
        action = Done(reason=f"VM is {vm.status.phase}; never planned again")
    elif (remaining := backoff_remaining(vm, obs.now)) > 0:
        action = Wait(seconds=remaining, condition=RESTART_BACKOFF_CONDITION,
                      # No countdown here: the reason becomes the Ready message, and a
                      # message that changes every look would be a status write each time.
                      reason=f"restart #{vm.status.restart_streak} in a row: waiting out a "
                             f"{restart_backoff(vm.status.restart_streak):.0f}s backoff from "
                             f"{vm.status.last_restart_time}")
    else:
        seq = vm.status.plan_seq + 1
        return RecordPlan(
            plan=PendingPod(
                name=plan_name(vm, seq),
                plan_seq=seq,
                token=obs.lease.token,
                epoch=obs.lease.epoch,
                generation=vm.generation,
            ),
            observed_seq=vm.status.plan_seq,
            reason=f"no runner pod and no plan: plan #{seq}",
        )
    if isinstance(action, Done | Wait):
        # Nothing to do for the plan itself: clean up pods nobody references.
        action = _cleanup(obs, vm) or action
    if isinstance(action, Done) and obs.fence_recheck is not None:
        action = Wait(seconds=max(0.5, obs.fence_recheck),
                      reason=f"{action.reason}; a self-fencing pod's node is unreachable")
    return action


def _self_fenced(obs: Observation, pods: list[PodView]) -> Action | None:
    """A pod of ``pods`` that self-fenced for sure: force-delete it (from a direct read)."""
    dead = next((p for p in pods if p.uid in obs.dead_pods), None)
    if dead is None:
        return None
    if not obs.direct:
        return ObserveDirect(reason=f"pod {dead.name} self-fenced: confirm")
    return ForceDeleteDeadPod(name=dead.name, uid=dead.uid,
                              reason=f"pod {dead.name}'s node is unreachable and its right "
                                     f"to run is surely over")


def _decide_deletion(obs: Observation, vm: VirtualMachine) -> Action:
    if FINALIZER not in vm.finalizers:
        return Done(reason="VM is being deleted and is no longer ours")
    if not obs.direct:
        return ObserveDirect(reason="VM deleted: confirm its pods from a quorum read")
    for pod in obs.pods:
        if not pod.terminating:
            return DeletePod(name=pod.name, uid=pod.uid, reason="VM is being deleted")
    if (fenced := _self_fenced(obs, list(obs.pods))) is not None:
        return fenced  # a pod on a lost node would hold the finalizer until out-of-service
    if obs.pods:
        return Wait(seconds=1.0, reason=f"VM is being deleted: {len(obs.pods)} pod(s) terminating")
    return RemoveFinalizer(reason="VM is being deleted and all its pods are gone")


def _decide_committed(obs: Observation, vm: VirtualMachine) -> Action:
    name = vm.status.pod_name
    pod = obs.pod(name)
    if vm.status.phase in TERMINAL_PHASES:
        return Done(reason=f"VM is {vm.status.phase}; never planned again")
    if vm.status.pending_pod is not None:
        # Not produced by our writes (Commit and Restart clear the plan), but if a status
        # ever carries both, the committed pod wins and the stray plan is dropped first,
        # so that its pod becomes an unreferenced pod for the clean-up.
        return DropPlan(name=vm.status.pending_pod.name,
                        reason="a committed pod and a plan at once: drop the plan")
    gone = pod is None or (bool(vm.status.pod_uid) and pod.uid != vm.status.pod_uid)
    if not gone and pod is not None and (fenced := _self_fenced(obs, [pod])) is not None:
        return fenced
    if gone or (pod is not None and (pod.finished or pod.terminating)):
        terminal = _terminal_phase(vm, pod if not gone else None)
        if obs.namespace_terminating and terminal is None:
            # Whatever a direct read showed, no Restart into a new plan is made in a
            # namespace being deleted: no read for it either (one per VM and look).
            return Wait(seconds=NAMESPACE_TERMINATING_RECHECK_SECONDS,
                        condition=NAMESPACE_TERMINATING,
                        reason=f"namespace is being deleted: runner pod {name} is not "
                               f"replaced; the VM goes with it")
        if not obs.direct:
            return ObserveDirect(reason=f"pod {name} looks gone or finished: confirm")
        assert name is not None
        uid = vm.status.pod_uid or (pod.uid if pod else "")
        if gone or pod is None:
            what = "gone"
        else:
            what = "terminating" if pod.terminating else pod.phase
        return Restart(name=name, uid=uid, terminal_phase=terminal,
                       at=times.format_microtime(obs.now) if obs.now is not None else None,
                       self_fenced=bool(uid) and uid in obs.dead_pods,
                       reason=f"runner pod {name} is {what}")
    assert pod is not None
    if pod.gated:
        others = [p for p in obs.pods if p.name != pod.name]
        if others:
            if not obs.direct:
                return ObserveDirect(reason="other pods exist: confirm before cleaning up")
            live = [p for p in others if not p.terminating]
            if live:
                stray = live[0]
                return DeletePod(name=stray.name, uid=stray.uid,
                                 reason=f"pod {stray.name} is not the committed pod")
            if (fenced := _self_fenced(obs, others)) is not None:
                return fenced
            return Wait(seconds=1.0, condition=WAITING_FOR_OLD_POD,
                        reason=f"waiting for {', '.join(p.name for p in others)} to go "
                               f"before starting {pod.name}")
        # From any observation that shows the committed pod alone: the quorum list the
        # proof rests on is the performer's own, taken after the commit was seen, and it
        # ungates only if that list shows this pod alone (docs/protocol.md, step 8). A
        # direct read before it would be a second list that proves nothing more.
        return Ungate(name=pod.name, uid=pod.uid,
                      reason=f"{pod.name} is the VM's only pod: let it start")
    phase = "Running" if pod.phase == "Running" else "Pending"
    if phase == "Running" and vm.status.pending_scale is not None:
        phase = "Scaling"
    if phase == "Pending":
        # A pod that is bound but not started yet is not worth a write of its own: its
        # node and IP are mirrored with the phase they come with (docs/protocol.md,
        # step 4), in the one write that makes the VM Running.
        stale = vm.status.phase != phase
    else:
        stale = (vm.status.phase, vm.status.node, vm.status.pod_ip) != (phase, pod.node, pod.ip)
    if stale:
        return SyncStatus(phase=phase, node=pod.node, ip=pod.ip, name=pod.name, uid=pod.uid,
                          reason=f"runner pod {pod.name} is {pod.phase}")
    if (scaling := _decide_scaling(obs, vm, pod)) is not None:
        return scaling
    if pod.autoscaling != autoscaler_view.vm_autoscaling_meta(vm):
        return SyncPodMetadata(name=pod.name, uid=pod.uid, reason=f"{pod.name}'s labels or "
                               "annotations copied from the VM are not the VM's")
    return Done(reason=f"runner pod {pod.name} is {pod.phase}")


def _decide_scaling(obs: Observation, vm: VirtualMachine, pod: PodView) -> Action | None:
    """Live scaling of the committed, running pod: plan (CAS), apply (runner), commit (CAS).

    The plan is recorded before the runner is asked and names the pod it is for; the
    runner is sent the plan's fence and applies only a fence newer than its last, so a
    stale leader, a stale read or a retry can resend a plan but never make the guest go
    back to an older size. None: nothing to scale.
    """
    plan = vm.status.pending_scale
    resized = _slot_size_changed(vm, pod)
    if resized is not None:
        return resized
    if plan is not None:
        if plan.pod_name != pod.name or (plan.pod_uid and plan.pod_uid != pod.uid):
            return DropScale(seq=plan.seq, reason=f"scaling plan #{plan.seq} is for pod "
                                                  f"{plan.pod_name}, not {pod.name}")
        if pod.phase != "Running" or not pod.ip:
            return None
        runner = obs.runner
        if runner is not None and runner.pod_uid == pod.uid:
            fence = scale_fence(plan)
            if runner.fence is not None and runner.fence > fence:
                return DropScale(seq=plan.seq,
                                 reason=f"runner of {pod.name} has applied fence "
                                        f"{runner.fence}, newer than plan #{plan.seq}'s "
                                        f"{fence}: plan again")
            if runner.fence == fence and not runner.pending_removals and (
                    runner.vcpus, runner.memory_slots) == (plan.cpus, plan.memory_slots):
                # The fraction is recorded only if the pod's annotations carry this plan
                # (its tell may have been lost); else whole vCPUs, and the next plan
                # writes them.
                # A fence above the plan's was written by no plan the VM records (a
                # tenant's, :func:`pod_fence_ahead`; a newer plan's would be recorded,
                # and this commit's CAS refused): behind too.
                behind = pod.scale_fence != fence
                return CommitScale(seq=plan.seq, vcpus=runner.vcpus,
                                   memory_bytes=runner.memory_bytes, pod_behind=behind,
                                   reason=f"runner of {pod.name} reached {plan.cpus} vCPUs, "
                                          f"{plan.memory_slots} memory slots"
                                          + (f"; {pod.name}'s annotations do not carry plan "
                                             f"#{plan.seq}: whole vCPUs recorded"
                                             if behind else ""))
        memory = status_memory_bytes(vm)
        if (not vm.status.scaling_token_secret and memory is not None
                and pod.scale_fence is not None and pod.scale_fence >= scale_fence(plan)
                and fraction_only(vm, plan, pod)):
            # No token, so no runner call: a cpus.use change within the pod's vCPUs is
            # done once its fenced annotation write has landed.
            return CommitScale(seq=plan.seq, vcpus=plan.cpus, memory_bytes=memory,
                               pod_behind=pod.scale_fence != scale_fence(plan),
                               reason=f"{pod.name}'s annotations carry plan #{plan.seq} "
                                      f"(cpus.use within its {plan.cpus} vCPUs; no scaling "
                                      "token, so no runner call)")
        want = desired_size(vm)
        if want != (plan.cpus, plan.memory_slots):
            # The spec moved on: a plan that cannot finish (an unplug the guest refuses)
            # must not hold the VM. The next plan's seq orders it after this one at the
            # runner, which applies it once (or refuses this one from then on).
            return _plan_scale(obs, vm, pod, want,
                               f"spec asks for {want[0]} vCPUs, {want[1]} memory slots; "
                               f"supersedes scaling plan #{plan.seq}")
        if obs.runner_error is not None:
            return Wait(seconds=RUNNER_RECHECK_SECONDS, condition=SCALING_CONDITION,
                        reason=f"scaling plan #{plan.seq}: cannot ask the runner of "
                               f"{pod.name}: {obs.runner_error}")
        return ApplyScale(plan=plan, reason=f"scaling plan #{plan.seq}: ask the runner of "
                                            f"{pod.name} for {plan.cpus} vCPUs, "
                                            f"{plan.memory_slots} memory slots")
    if pod.phase != "Running" or not pod.ip:
        return None
    adopt = _adopt_runner_size(obs, vm, pod)
    if adopt is not None:
        return adopt
    if look_given_up(vm, obs.now):
        s = vm.status
        why = (obs.runner_error if obs.runner_error is not None
               else "no settled answer naming the pod" if obs.runner is not None
               else "not asked")
        return CommitScale(seq=s.scale_seq, adopt=True, pod_uid=pod.uid, ends_look=True,
                           look_recorded=True, gives_up=True,
                           reason=f"plan #{s.scale_seq} was dropped more than "
                                  f"{LOOK_GIVE_UP_SECONDS:.0f} s ago and the runner of "
                                  f"{pod.name} never settled in a way that ends the look "
                                  f"({why}): no longer looked at, status keeps {s.cpus}, "
                                  f"{s.memory_size} (a PUT of the dropped plan that landed "
                                  "meanwhile would not be seen)")
    have, want = status_size(vm), desired_size(vm)
    # A cpus.use changed within the whole vCPUs the guest has (500m -> 750m) is a plan
    # too: the runner keeps its vCPUs, and the plan's fenced annotation write is what
    # tells the scheduler plugin and the runner's quota (docs/protocol.md, "Live scaling").
    fraction = have == want and vm.status.cpus != vm.spec.guest.cpus.current
    # Status at the spec's size, the pod's own record not (a tell or resize lost, or
    # written from an older read): a plan too, whose fenced write rewrites it.
    stale = pod_behind(vm, pod) if have == want and not fraction else None
    if have is None or (have == want and not fraction and stale is None):
        return None
    refused = next((c for c in vm.status.conditions if c.type == SCALING_CONDITION
                    and c.status == "False" and c.reason in SCALING_REFUSED), None)
    if refused is not None and refused.observed_generation == vm.generation:
        return None  # refused for this spec: the condition says why; a new spec tries again
    gap = stale or (f"status says cpus {vm.status.cpus}, the spec "
                    f"{vm.spec.guest.cpus.current}")
    if (stale is not None or fraction) and pod_fence_ahead(vm, pod):
        # No plan's tell writes over that fence (it is above theirs), so a plan would
        # change nothing of the pod, its commit would record whole vCPUs, and it would
        # be made again at once, for good: said instead (docs/protocol.md, "The pod's
        # record"). Only the VM read no older than the pod tells a planted fence from a
        # newer plan's.
        if not obs.direct:
            return ObserveDirect(reason=f"{pod.name}'s scale-fence {pod.scale_fence} is "
                                        "above every scaling plan of the VM: confirm")
        return Wait(seconds=POD_FENCE_RECHECK_SECONDS, condition=POD_SCALE_FENCE_AHEAD,
                    reason=f"{pod.name}: {gap}, and its scale-fence {pod.scale_fence} "
                           f"is above every scaling plan of the VM (status.fence, scaleSeq "
                           f"{vm.status.scale_seq}): not written by this controller, so no "
                           f"plan can rewrite its record; remove the {ANNOTATION_SCALE_FENCE} "
                           f"annotation from {pod.name} (or restart the VM)")
    if stale is not None:
        if not obs.direct:
            # The cached pod and the cached VM come from two watches: the pod's may
            # not show yet the tell whose plan the VM shows committed.
            return ObserveDirect(reason=f"{pod.name} looks behind the spec ({stale}): "
                                        "confirm")
        return _plan_scale(obs, vm, pod, want, f"{pod.name}'s {stale} (status says "
                                               f"{vm.status.cpus}, as the spec)")
    if fraction:
        return _plan_scale(obs, vm, pod, want, f"spec asks for cpus.use "
                                               f"{vm.spec.guest.cpus.current} within the "
                                               f"{want[0]} vCPUs {pod.name} has (status says "
                                               f"{vm.status.cpus})")
    return _plan_scale(obs, vm, pod, want, f"spec asks for {want[0]} vCPUs, {want[1]} "
                                           f"memory slots; {pod.name} has {have[0]}, {have[1]}")


def _adopt_runner_size(obs: Observation, vm: VirtualMachine,
                       pod: PodView) -> CommitScale | None:
    """No plan recorded, and the observation carries the committed pod's runner (asked
    only after a plan was dropped, :func:`looks_at_runner`): the runner, naming that
    pod, reports a settled size (no removal pending) other than status says. Status
    adopts it: it is what the guest has, and a ``PUT /scale`` of the dropped plan that
    landed after the drop (or its unplug that finished later) is the only way it got
    there. Once the window has passed (:func:`look_may_end`), the same write ends the
    look, and a settled size equal to status's is written too, only to end it: a look
    ended by a write that lands, never by an answer alone. None: nothing to write (a
    removal still pending, an answer from another pod: the look goes on if status
    asks for it)."""
    runner = obs.runner
    if (runner is None or runner.pod_uid != pod.uid or runner.answered_uid != pod.uid
            or runner.pending_removals):
        return None
    if runner.vcpus < 1 or runner.memory_bytes < 1:
        return None  # SysfsScaling before the guest agent's first report: 0 vCPUs known
    s = vm.status
    memory = status_memory_bytes(vm)
    cpus = s.cpus.rounded_up() if s.cpus is not None else None
    ends, recorded = look_may_end(vm, obs.now), look_pending(vm)
    at_status_size = (cpus, memory) == (runner.vcpus, runner.memory_bytes)
    if at_status_size and not ends:
        return None
    if at_status_size:
        reason = (f"plan #{s.scale_seq} was dropped more than {LATE_PUT_SECONDS:.0f} s ago "
                  f"and the runner of {pod.name} has settled at the size status says "
                  f"({runner.vcpus} vCPUs, {runner.memory_bytes} bytes): no longer looked at")
    else:
        reason = (f"no plan recorded, plan #{s.scale_seq} dropped; the runner of {pod.name} "
                  f"reports {runner.vcpus} vCPUs, {runner.memory_bytes} bytes (status says "
                  f"{s.cpus}, {s.memory_size}): adopted"
                  + ("; no longer looked at" if ends else ""))
    return CommitScale(seq=s.scale_seq, vcpus=runner.vcpus,
                       memory_bytes=runner.memory_bytes, adopt=True, pod_uid=pod.uid,
                       ends_look=ends, look_recorded=recorded or at_status_size,
                       reason=reason)


def _slot_size_changed(vm: VirtualMachine, pod: PodView) -> Action | None:
    """The spec's ``memorySlotSize`` is not the one the pod was built with: its runner
    counts slots in the old size, so no live plan can say what the spec means. A recorded
    plan is dropped and, once per spec generation, Scaling=False ScalingNeedsRestart says
    so; the next pod is built with the new slot size. None: the same size (or unknown)."""
    from neonvm.controller.podspec import slot_bytes

    spec_slot = slot_bytes(vm.spec.guest.memory_slot_size)
    if pod.slot_bytes is None or spec_slot is None or spec_slot == pod.slot_bytes:
        return None
    why = (f"memorySlotSize is {vm.spec.guest.memory_slot_size} ({spec_slot} bytes) but "
           f"{pod.name} was built with {pod.slot_bytes}-byte slots: live scaling cannot "
           "change the slot size; the next pod is built with the new one")
    plan = vm.status.pending_scale
    if plan is not None:
        return DropScale(seq=plan.seq, refused=SCALING_NEEDS_RESTART, reason=why)
    if pod.phase != "Running" or not pod.ip:
        return None
    if any(c.type == SCALING_CONDITION and c.status == "False"
           and c.reason == SCALING_NEEDS_RESTART and c.observed_generation == vm.generation
           for c in vm.status.conditions):
        return None  # already said for this spec
    return DropScale(seq=vm.status.scale_seq, refused=SCALING_NEEDS_RESTART, reason=why,
                     generation=vm.generation)


def _plan_scale(obs: Observation, vm: VirtualMachine, pod: PodView, want: tuple[int, int],
                why: str) -> PlanScale:
    seq = vm.status.scale_seq + 1
    return PlanScale(
        plan=PendingScale(cpus=want[0], memory_slots=want[1], seq=seq,
                          epoch=obs.lease.epoch, token=obs.lease.token, pod_name=pod.name,
                          pod_uid=pod.uid, generation=vm.generation),
        observed_seq=vm.status.scale_seq, reason=f"{why}: scaling plan #{seq}")


def _terminal_phase(vm: VirtualMachine, pod: PodView | None) -> str | None:
    """Restart policy: None means restart; otherwise the terminal phase to record.

    A pod that vanished or is being deleted did not finish by itself: it counts as a
    failure (so ``Never`` ends Failed, ``OnFailure`` and ``Always`` restart).
    """
    finished = pod is not None and pod.finished and not pod.terminating
    outcome = pod.phase if finished and pod is not None else "Failed"
    policy = vm.spec.restart_policy
    if policy == "Always":
        return None
    if policy == "OnFailure":
        return "Succeeded" if outcome == "Succeeded" else None
    return outcome  # Never


def _decide_pending(obs: Observation, vm: VirtualMachine, pending: PendingPod) -> Action:
    pod = obs.pod(pending.name)
    if pod is None:
        if obs.create_failed_generation is not None and (
            obs.create_failed_generation >= vm.generation
        ):
            return Wait(seconds=30.0, condition=DEGRADED,
                        reason=f"creating {pending.name} was refused; waiting for a spec change")
        if obs.missing_pull_secrets:
            # The API server would take the pod and the kubelet would pull without the
            # secret: hold the (still recorded) plan back until the secret exists.
            return Wait(seconds=PULL_SECRET_RECHECK_SECONDS, condition=PULL_SECRET_NOT_FOUND,
                        reason=f"image pull secret {', '.join(obs.missing_pull_secrets)} "
                               f"not found in namespace {vm.namespace}; runner pod "
                               f"{pending.name} is created once it exists")
        return CreatePod(plan=pending, reason=f"plan #{pending.plan_seq} recorded: create it")
    # Adoption rule: a pod is the plan's only if it is owned by this VM *and* carries
    # the plan's fence (epoch, token), which only the create of this plan writes. A pod
    # planted under the predictable name (or left by anything else) is not adopted: the
    # plan is dropped, the next plan gets a new name, and the clean-up deletes the pod.
    ours = pod.owner_uid == vm.uid and pod.fence == (pending.epoch, pending.token)
    if ours and not pod.terminating and not pod.gated:
        # Created without our gate (stripped by a webhook?): it must not run uncommitted.
        if not obs.direct:
            return ObserveDirect(reason=f"pod {pod.name} has no gate: confirm")
        return DeletePod(name=pod.name, uid=pod.uid,
                         reason=f"pod {pod.name} was created without the scheduling gate")
    if not ours or pod.terminating:
        if pod.terminating:
            why = "terminating"
        elif pod.owner_uid != vm.uid:
            why = "not ours"
        else:
            why = (f"not ours (it does not carry the fence epoch {pending.epoch} token "
                   f"{pending.token} of plan #{pending.plan_seq})")
        return DropPlan(name=pending.name, reason=f"pod {pending.name} exists but is {why}")
    return Commit(name=pod.name, uid=pod.uid, built=pod.built, slot_bytes=pod.slot_bytes,
                  reason=f"pod {pod.name} created: commit it")


def _cleanup(obs: Observation, vm: VirtualMachine) -> Action | None:
    """Delete every pod that is neither the committed nor the planned pod."""
    keep = {vm.status.pod_name, vm.status.pending_pod.name if vm.status.pending_pod else None}
    strays = [p for p in obs.pods if p.name not in keep and not p.terminating]
    if not strays:
        return None
    if not obs.direct:
        return ObserveDirect(reason=f"{len(strays)} unreferenced pod(s): confirm")
    return DeletePod(name=strays[0].name, uid=strays[0].uid,
                     reason=f"pod {strays[0].name} is not referenced by the VM")
