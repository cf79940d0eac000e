"""Status mutations: what each decided write changes, re-checked on the fresh copy.

The conditional-update helper calls a mutation with the freshest VM it has; on 409 it
re-reads and calls it *again* on the new copy. A mutation returns the new status, or
None when the fresh copy shows there is nothing left to do (someone else already did
it, or the world moved on). It never writes back what it read: it re-derives the change
from its *intent* (the action) and refuses when what it is about to change is no longer
what the decision saw. That is the fix for the seed bug.

Every status write also carries the writer's fence (epoch, lock token); a mutation
raises :class:`FencedOut` when the fresh copy carries a higher fence. Each action's
mutation is named in its row of :data:`neonvm.controller.action_table.ACTIONS`.
"""

from __future__ import annotations

import copy
import datetime as dt
from collections.abc import Callable

from neonvm.api import compat, times
from neonvm.api.millicpu import MilliCPU
from neonvm.api.types import FINALIZER, Condition, Fence, VirtualMachine, VirtualMachineStatus
from neonvm.controller import actions as act
from neonvm.controller import autoscaler_view, reasons, restarts, ssh_keys
from neonvm.controller import decide as d

StatusMutation = Callable[[VirtualMachine], VirtualMachineStatus | None]


class FencedOut(Exception):
    """A writer with a higher (epoch, token) has written this VM: we are stale."""


def check_fence(vm: VirtualMachine, lease: act.Fence) -> None:
    """Raise :class:`FencedOut` when a writer with a higher (epoch, token) wrote ``vm``."""
    fence = vm.status.fence
    if fence is not None and (fence.epoch, fence.token) > (lease.epoch, lease.token):
        raise FencedOut(
            f"{vm.key}: status fenced at epoch {fence.epoch} token {fence.token}, "
            f"we are epoch {lease.epoch} token {lease.token}"
        )


def _fresh_status(vm: VirtualMachine, lease: act.Fence) -> VirtualMachineStatus:
    check_fence(vm, lease)
    status = copy.deepcopy(vm.status)
    status.fence = Fence(epoch=lease.epoch, token=lease.token)
    status.observed_generation = vm.generation
    return status


def _record_boot_size(new: VirtualMachineStatus, vm: VirtualMachine,
                      built: tuple[int, int] | None = None,
                      slot_bytes: int | None = None) -> None:
    """status.cpus/memorySize: the size the committed pod was built with (``built``:
    millicores, memory slots, in slots of ``slot_bytes`` when the pod records it, from
    the pod), else the spec's. ``currentRevision`` follows once the VM runs at the
    spec's size (:func:`autoscaler_view.propagate_revision`)."""
    new.cpus, new.memory_size = compat.configured_size(vm.spec)
    if built is not None:
        from neonvm.api.quantity import QuantityError, format_bytes, parse_bytes

        new.cpus = MilliCPU(built[0])
        try:
            new.memory_size = format_bytes(
                (slot_bytes or parse_bytes(vm.spec.guest.memory_slot_size)) * built[1])
        except QuantityError:
            new.memory_size = None
    autoscaler_view.propagate_revision(new, vm)


def _set_scaling_condition(new: VirtualMachineStatus, vm: VirtualMachine, status: str,
                           reason: str, message: str) -> None:
    existing = next((c for c in new.conditions if c.type == reasons.SCALING_CONDITION), None)
    if existing is None:
        new.conditions.append(Condition(
            type=reasons.SCALING_CONDITION, status=status,  # type: ignore[arg-type]
            reason=reason, message=message,
            last_transition_time=times.format_time(dt.datetime.now(dt.UTC)),
            observed_generation=vm.generation))
        return
    if existing.status != status:
        existing.last_transition_time = times.format_time(dt.datetime.now(dt.UTC))
    existing.status = status  # type: ignore[assignment]
    existing.reason, existing.message = reason, message
    existing.observed_generation = vm.generation


def _end_look(new: VirtualMachineStatus) -> None:
    """No look after a drop any more: ``scaleLookPodUID`` and its time cleared together."""
    new.scale_look_pod_uid, new.scale_look_since = None, None


def _bytes(quantity: str | None) -> int | None:
    """``quantity`` in bytes; None: absent or unreadable."""
    from neonvm.api.quantity import QuantityError, parse_bytes

    if quantity is None:
        return None
    try:
        return parse_bytes(quantity)
    except QuantityError:
        return None


POD_REPLACED = "PodReplaced"
"""Scaling=False reason once the pod a plan or a refusal was about is gone or replaced."""


def _pod_replaced(new: VirtualMachineStatus, vm: VirtualMachine, message: str) -> None:
    """A Restart or a pod Commit: whatever the Scaling condition said (a plan in
    progress, the old pod refusing) was about a pod that is no longer the VM's; it is
    not added where absent."""
    if any(c.type == reasons.SCALING_CONDITION for c in new.conditions):
        _set_scaling_condition(new, vm, "False", POD_REPLACED, message)


def _scale_done(new: VirtualMachineStatus, vm: VirtualMachine, reason: str,
                message: str) -> None:
    new.pending_scale = None
    if new.phase == "Scaling":
        new.phase = "Running"
    _set_scaling_condition(new, vm, "False", reason, message)


def record_plan(action: act.RecordPlan, lease: act.Fence) -> StatusMutation:
    """RecordPlan: the pod plan, unless a pod or plan is recorded since or the VM is ending."""

    def mutate(vm: VirtualMachine) -> VirtualMachineStatus | None:
        s = vm.status
        if s.pod_name or s.pending_pod is not None or s.plan_seq != action.observed_seq:
            return None
        if s.phase in d.TERMINAL_PHASES or vm.deletion_timestamp is not None:
            return None
        new = _fresh_status(vm, lease)
        new.pending_pod = copy.deepcopy(action.plan)
        new.plan_seq = action.plan.plan_seq
        new.phase = "Pending"
        if ssh_keys.wants_ssh(vm) and not new.ssh_secret_name:
            # NeonVM's status.sshSecretName, with the plan's write (no write of its own);
            # the pod's create makes the Secret (neonvm.controller.ssh_keys).
            new.ssh_secret_name = ssh_keys.secret_name(vm)
        return new

    return mutate


def commit(action: act.Commit, lease: act.Fence) -> StatusMutation:
    """Commit: the planned pod becomes the VM's, at the size it was built with."""

    def mutate(vm: VirtualMachine) -> VirtualMachineStatus | None:
        s = vm.status
        if s.pod_name or s.pending_pod is None or s.pending_pod.name != action.name:
            return None
        new = _fresh_status(vm, lease)
        new.pod_name, new.pod_uid, new.pending_pod = action.name, action.uid, None
        new.pending_scale = None
        _end_look(new)  # a look after a drop was about an older pod
        new.phase = "Pending"
        _record_boot_size(new, vm, action.built, action.slot_bytes)
        _pod_replaced(new, vm, f"runner pod {action.name} is committed at the size it was "
                               "built with")
        return new

    return mutate


def drop_plan(action: act.DropPlan, lease: act.Fence) -> StatusMutation:
    """DropPlan: the pod plan is cleared, if it is still the one decided on."""

    def mutate(vm: VirtualMachine) -> VirtualMachineStatus | None:
        s = vm.status
        if s.pending_pod is None or s.pending_pod.name != action.name:
            return None
        new = _fresh_status(vm, lease)
        new.pending_pod = None
        return new

    return mutate


def restart(action: act.Restart, lease: act.Fence) -> StatusMutation:
    """Restart: the pod is gone; the VM starts over (or ends in its terminal phase)."""

    def mutate(vm: VirtualMachine) -> VirtualMachineStatus | None:
        s = vm.status
        if s.pod_name != action.name or (s.pod_uid and action.uid and s.pod_uid != action.uid):
            return None
        if s.phase in d.TERMINAL_PHASES:
            return None
        new = _fresh_status(vm, lease)
        if action.terminal_phase is not None:
            new.phase = action.terminal_phase  # type: ignore[assignment]
            return new
        new.pod_name, new.pod_uid, new.pending_pod = "", "", None
        new.pending_scale = None  # it was for the pod that is gone
        _end_look(new)  # ... and so was a look after a drop: no runner left
        _pod_replaced(new, vm, f"runner pod {action.name} is gone, and its scaling "
                               "with it")
        new.pod_ip, new.node = None, None
        new.cpus, new.memory_size = None, None
        new.restart_count = s.restart_count + 1
        new.restart_streak = restarts.next_restart_streak(s.restart_streak, s.last_restart_time,
                                                   action.at, self_fenced=action.self_fenced)
        if action.at is not None:
            new.last_restart_time = action.at  # the next plan's backoff counts from here
        new.phase = "Pending"
        return new

    return mutate


def sync_status(action: act.SyncStatus, lease: act.Fence) -> StatusMutation:
    """SyncStatus: phase, node and IP from the committed pod, if status still names it."""

    def mutate(vm: VirtualMachine) -> VirtualMachineStatus | None:
        s = vm.status
        if not s.pod_name or s.phase in d.TERMINAL_PHASES:
            return None
        if s.pod_name != action.name or (s.pod_uid and action.uid and s.pod_uid != action.uid):
            return None  # the status names another pod now: this sync describes the old one
        if (s.phase, s.node, s.pod_ip) == (action.phase, action.node, action.ip):
            return None
        new = _fresh_status(vm, lease)
        new.phase = action.phase  # type: ignore[assignment]
        if new.phase == "Running" and new.pending_scale is not None:
            new.phase = "Scaling"  # a plan was recorded since the observation
        elif new.phase == "Scaling" and new.pending_scale is None:
            new.phase = "Running"  # ... or committed
        new.node, new.pod_ip = action.node, action.ip
        if new.cpus is None:  # committed before status.cpus existed
            _record_boot_size(new, vm)
        autoscaler_view.settle(new, vm)  # Running at the spec's size
        return new

    return mutate


def plan_scale(action: act.PlanScale, lease: act.Fence) -> StatusMutation:
    """PlanScale: the scaling plan, superseding only the plan observed."""

    def mutate(vm: VirtualMachine) -> VirtualMachineStatus | None:
        s, plan = vm.status, action.plan
        if s.scale_seq != action.observed_seq:
            return None
        if s.pending_scale is not None and (s.pending_scale.seq != action.observed_seq or (
                s.pending_scale.cpus, s.pending_scale.memory_slots) == (plan.cpus,
                                                                        plan.memory_slots)):
            return None  # supersede only the plan observed, and only for another size
        if s.pod_name != plan.pod_name or (s.pod_uid and s.pod_uid != plan.pod_uid):
            return None
        if s.phase not in ("Running", "Scaling") or vm.deletion_timestamp is not None:
            return None
        # The fresh spec must still ask for this size: a plan never records a size
        # older than the spec it is written over.
        if d.desired_size(vm) != (plan.cpus, plan.memory_slots):
            return None
        new = _fresh_status(vm, lease)
        new.pending_scale = copy.deepcopy(plan)
        new.scale_seq = plan.seq
        # A look after an earlier drop ends here: this plan's fence is above the dropped
        # plan's, so the runner refuses that one once it has applied this one, and this
        # plan commits what the runner then reports (or, dropped in turn, starts a look
        # of its own, whose window covers the older plan's late PUTs too).
        _end_look(new)
        new.phase = "Scaling"
        _set_scaling_condition(new, vm, "True", "ScalingInProgress",
                               f"scaling plan #{plan.seq}: {plan.cpus} vCPUs, "
                               f"{plan.memory_slots} memory slots on {plan.pod_name}")
        return new

    return mutate


def commit_scale(action: act.CommitScale, lease: act.Fence) -> StatusMutation:
    """CommitScale: the size the runner reports (a plan's, or adopted after a drop)."""

    def mutate(vm: VirtualMachine) -> VirtualMachineStatus | None:
        s = vm.status
        from neonvm.api.quantity import format_bytes

        if action.adopt:
            # No plan: what the runner reported after a drop, unless a plan was made
            # since the observation or the pod was replaced.
            if (s.pending_scale is not None or s.scale_seq != action.seq
                    or not s.pod_uid or s.pod_uid != action.pod_uid
                    or s.phase not in ("Running", "Scaling")
                    or vm.deletion_timestamp is not None):
                return None
            if action.look_recorded and s.scale_look_pod_uid != action.pod_uid:
                # The look has ended since the observation, by a write decided from a
                # newer answer (asked past the window): this one must not undo it.
                return None
            if action.gives_up and s.scale_look_pod_uid != action.pod_uid:
                return None  # the look has ended since: nothing to give up
            new = _fresh_status(vm, lease)
            if not action.gives_up:
                # Only what differs from the fresh copy is written: a fractional cpus
                # (500m, rounded up to the 1 vCPU the runner reports) is kept. A size
                # adopted is whole vCPUs: no plan annotated the pod with the spec's
                # fraction, so the next plan does (docs/protocol.md, "Live scaling").
                if s.cpus is None or s.cpus.rounded_up() != action.vcpus:
                    new.cpus = MilliCPU(action.vcpus * 1000)
                if _bytes(s.memory_size) != action.memory_bytes:
                    new.memory_size = format_bytes(action.memory_bytes)
            if action.ends_look:
                _end_look(new)  # asked past the window (or given up): the last word
            if (new.cpus, new.memory_size, new.scale_look_pod_uid) == (
                    s.cpus, s.memory_size, s.scale_look_pod_uid):
                return None  # status says it already, and the look has ended
            return new
        if s.pending_scale is None or s.pending_scale.seq != action.seq:
            return None
        new = _fresh_status(vm, lease)
        new.cpus = (MilliCPU(action.vcpus * 1000) if action.pod_behind
                    else autoscaler_view.landed_cpus(
                        vm, action.vcpus, plan_generation=s.pending_scale.generation))
        new.memory_size = format_bytes(action.memory_bytes)
        _scale_done(new, vm, "ScalingDone",
                    f"scaling plan #{action.seq} applied: the runner reports {action.vcpus} "
                    f"vCPUs, {new.memory_size} of memory")
        autoscaler_view.propagate_revision(new, vm)
        return new

    return mutate


def drop_scale(action: act.DropScale, lease: act.Fence) -> StatusMutation:
    """DropScale: the scaling plan dropped (or refused), starting a look when a PUT may land."""

    def mutate(vm: VirtualMachine) -> VirtualMachineStatus | None:
        s = vm.status
        if s.pending_scale is None and action.refused and s.scale_seq == action.seq and (
                action.generation == vm.generation):
            new = _fresh_status(vm, lease)  # no plan: the condition says why none is made
            _set_scaling_condition(new, vm, "False", action.refused, action.reason)
            return new
        if s.pending_scale is None or s.pending_scale.seq != action.seq:
            return None
        dropped = s.pending_scale
        new = _fresh_status(vm, lease)
        _scale_done(new, vm, action.refused or reasons.SCALING_DROPPED,
                    f"scaling plan #{action.seq} dropped: {action.reason}")
        # A PUT of the dropped plan sent before may still land, and an unplug it started
        # may still finish: status asks for the committed pod's runner to be looked at
        # until it has settled past the window (looks.look_pending). In the same write
        # as the drop, so no controller, this one or the next leader, can miss it. A
        # plan for another pod (not produced by our writes) asks for no look: its PUTs
        # carry that pod's token, which the committed pod's runner refuses.
        # No look either when no PUT of it can have reached the runner (the pod was
        # built without a token): it could learn nothing and would never end.
        same_pod = dropped.pod_name == s.pod_name and (
            not dropped.pod_uid or dropped.pod_uid == s.pod_uid)
        if same_pod and action.starts_look and s.pod_uid:
            # The window and the give-up bound count from here (not from the Scaling
            # condition, which other writes change).
            new.scale_look_pod_uid = s.pod_uid
            new.scale_look_since = times.format_microtime(dt.datetime.now(dt.UTC))
        else:
            _end_look(new)
        if action.refused:  # refused for the spec the plan was made for
            cond = next(c for c in new.conditions if c.type == reasons.SCALING_CONDITION)
            cond.observed_generation = dropped.generation
        return new

    return mutate


def token_secret_mutation(name: str, uid: str, lease: act.Fence,
                          replacing: str = "") -> StatusMutation:
    """Record the live scaling token Secret the controller just created (name and UID)
    in place of ``replacing`` (the uid of a recorded Secret found gone; "" for none):
    only if the record on the fresh copy is still that one (a concurrent create or
    replacement recorded first: its Secret is the one used)."""

    def record(vm: VirtualMachine) -> VirtualMachineStatus | None:
        if (vm.status.scaling_token_secret_uid or "") != replacing:
            return None
        new = _fresh_status(vm, lease)
        new.scaling_token_secret, new.scaling_token_secret_uid = name, uid
        return new

    return record


def add_finalizer(action: act.AddFinalizer) -> Callable[[VirtualMachine], list[str] | None]:
    """AddFinalizer, a main-resource write (``/status`` cannot do it)."""

    def add(vm: VirtualMachine) -> list[str] | None:
        if FINALIZER in vm.finalizers or vm.deletion_timestamp is not None:
            return None
        return [*vm.finalizers, FINALIZER]

    return add


def remove_finalizer(action: act.RemoveFinalizer) -> Callable[[VirtualMachine], list[str] | None]:
    """RemoveFinalizer, a main-resource write (``/status`` cannot do it)."""

    def remove(vm: VirtualMachine) -> list[str] | None:
        if FINALIZER not in vm.finalizers or vm.deletion_timestamp is None:
            return None
        return [f for f in vm.finalizers if f != FINALIZER]

    return remove
