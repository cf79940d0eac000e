"""VM conditions (Available, Degraded, WaitingForOldPod, ...): what they say, and the write.

``Available`` is True while the VM runs on its runner pod (phase Running or Scaling, the
pod running); otherwise False, its reason saying why (``NoRunner``, ``RunnerStarting``,
``RestartBackoff``, ``VMFailed``, ...). It is NeonVM's condition and the only one a healthy
VM shows in ``status.conditions``: the others go to ``status.extraConditions`` when the
status is written (:meth:`~neonvm.api.types.VirtualMachineStatus.wire_form`; in memory one
list holds them all). Earlier versions wrote the same as ``Ready`` too; a ``Ready`` left by
one is removed at the next conditions write. docs/neonvm-compat.md, "Conditions".

Degraded is True while a create was refused for the current generation (reason
``CreateRefused``, written by the driver when the API server refuses) or while a pull
secret the VM names is missing (reason ``ImagePullSecretNotFound``, derived here from the
decision to wait); it turns False once a runner pod is committed. It is also True
(reason ``FenceAhead``, written by :func:`fence_ahead_mutation`, at most once per
recheck period) while the VM's status carries a fence whose *epoch* is ahead of a leader
whose authority still holds; it turns False (reason ``FenceResolved``) at the first
reconcile that is no longer fenced. A fence ahead by its token only is not marked: the
leader ends its term instead (see :func:`epoch_ahead`). The driver also writes
Degraded when a reconcile cannot get anywhere: a step that keeps not taking effect
(reason ``<Step>NotTakingEffect``, e.g. ``UngateNotTakingEffect``), an ungate refused
with 403 (``UngateForbidden``), a create refused by the admission fence's creator
rule (``CreateForbidden``), pod creates failing again and again with errors
that are retried (``CreateFailing``), or a scaling plan's runner that misbehaves
(``RunnerMisbehaving``) or has not answered for a while (``RunnerUnreachable``). Those
are :func:`recoverable`: the first reconcile that ends normally (Done or Wait) turns
Degraded False again.

Every condition message is bounded (:data:`MESSAGE_LIMIT` characters, the end replaced
by an ellipsis), and API error text copied into one is bounded more tightly
(:func:`api_error_text`): an API server's message can echo a whole object.

:func:`desired_conditions` is pure: from a snapshot and the reconcile's final decision it
derives what the conditions should say. :func:`conditions_mutation` is a status mutation
in the sense of :mod:`neonvm.controller.mutations`: it is applied to the fresh copy on
every conflict retry, keeps ``lastTransitionTime`` when a condition's status does not
change, refuses (:class:`~neonvm.controller.mutations.FencedOut`) when the fresh copy
carries a higher fence, and returns None when nothing would change, so an idle VM is
never written.

``WaitingForOldPod``'s ``lastTransitionTime`` is the "since" the design asks for: when the
replacement pod started waiting for its predecessor to be gone.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
from dataclasses import dataclass

from neonvm.api import compat
from neonvm.api.types import Condition, Fence, VirtualMachine, VirtualMachineStatus
from neonvm.controller import actions as act
from neonvm.controller import autoscaler_view
from neonvm.controller import decide as d
from neonvm.controller.mutations import StatusMutation, check_fence
from neonvm.controller.observe import Snapshot
from neonvm.controller.reasons import (
    AVAILABLE,
    CREATE_FAILING,
    CREATE_FORBIDDEN,
    CREATE_REFUSED,
    DEGRADED,
    FENCE_AHEAD,
    FENCE_RESOLVED,
    NAMESPACE_TERMINATING,
    NOT_TAKING_EFFECT,
    OBJECT_TOO_LARGE,
    POD_SCALE_FENCE_AHEAD,
    PULL_SECRET_NOT_FOUND,
    READY,
    RECOVERED,
    RESTART_BACKOFF_CONDITION,
    RUNNER_MISBEHAVING_REASON,
    RUNNER_NOT_ANSWERING,
    RUNNER_UNREACHABLE_REASON,
    SCALING_CONDITION,
    STEP_BUDGET_EXHAUSTED,
    UNGATE_FORBIDDEN,
    WAITING_FOR_OLD_POD,
)

FENCE_AHEAD_QUIET_SECONDS = 300.0
"""Default quiet period of :func:`fence_ahead_mutation` (the driver passes its recheck
period, the same 300 s)."""


MESSAGE_LIMIT = 1024
"""Longest condition message written (characters)."""
API_ERROR_LIMIT = 512
"""Longest API server error text copied into a condition message (characters)."""
ELLIPSIS = "\u2026"

NODE_FAILURE_HINT = (
    "If the old pod's node has failed, the pod goes away only when Kubernetes deletes it "
    "(for example after the node is confirmed off and tainted "
    "node.kubernetes.io/out-of-service). Do not force-delete a pod whose node may still "
    "be running: that can run two guests."
)


@dataclass(frozen=True)
class ConditionUpdate:
    """The value one condition should have."""

    type: str
    status: str
    reason: str
    message: str
    generation: int | None = None
    """Generation to record; None: the fresh copy's generation."""
    only_if_present: bool = False
    """Do not add the condition just to say False."""
    plan_seq: int | None = None
    """Scaling=True only: the scaling plan it was decided for; applied only while the
    fresh copy still records that plan (:func:`_applies`)."""


def truncate(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` if it fits in ``limit`` characters, else its start and an ellipsis."""
    if len(text) <= limit:
        return text
    return text[:max(0, limit - len(ELLIPSIS))].rstrip() + ELLIPSIS


def api_error_text(text: str) -> str:
    """API server error text as copied into a condition: bounded by API_ERROR_LIMIT."""
    return truncate(" ".join(text.split()), API_ERROR_LIMIT)


def recoverable(reason: str | None) -> bool:
    """A Degraded reason that the next normally-ending reconcile clears."""
    return bool(reason) and (
        str(reason).endswith(NOT_TAKING_EFFECT)
        or reason in (STEP_BUDGET_EXHAUSTED, UNGATE_FORBIDDEN, CREATE_FORBIDDEN,
                      CREATE_FAILING, RUNNER_MISBEHAVING_REASON, RUNNER_UNREACHABLE_REASON,
                      OBJECT_TOO_LARGE, POD_SCALE_FENCE_AHEAD))


def stuck_condition(reason: str, message: str) -> ConditionUpdate:
    """Degraded: the reconcile cannot make progress (a recoverable reason)."""
    assert recoverable(reason), reason
    return ConditionUpdate(DEGRADED, "True", reason, message)


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def desired_conditions(snap: Snapshot, final: act.Action) -> list[ConditionUpdate]:
    """Conditions implied by an observation and the decision that ended the reconcile."""
    vm = snap.obs.vm
    if vm is None or vm.deletion_timestamp is not None:
        return []
    if isinstance(final, act.Wait) and final.condition == NAMESPACE_TERMINATING:
        # The VM goes with its namespace: a write would only slow the deletion down.
        return []
    status = vm.status
    pod = snap.obs.pod(status.pod_name)
    updates: list[ConditionUpdate] = []
    if status.phase in d.TERMINAL_PHASES:
        updates.append(ConditionUpdate(AVAILABLE, "False", f"VM{status.phase}",
                                       f"the VM is {status.phase} and is not restarted "
                                       f"(restartPolicy {vm.spec.restart_policy})"))
    elif (pod is not None and status.phase in ("Running", "Scaling") and pod.phase == "Running"
          and not pod.gated and not pod.terminating):
        updates.append(ConditionUpdate(AVAILABLE, "True", "RunnerRunning",
                                       f"runner pod {pod.name} is running on {pod.node}"))
    elif pod is not None and (pod.gated or pod.phase == "Pending"):
        # One message from the commit until the pod runs, gated or not: the commit's
        # write carries it (:func:`with_ready`), and the ungate needs no write of its own.
        # Why a gated pod waits is WaitingForOldPod's to say.
        updates.append(ConditionUpdate(AVAILABLE, "False", "RunnerStarting",
                                       f"runner pod {pod.name} is committed and starting"))
    elif pod is not None:
        updates.append(ConditionUpdate(AVAILABLE, "False", "RunnerStarting",
                                       f"runner pod {pod.name} is {pod.phase}"))
    elif isinstance(final, act.Wait) and final.condition == RESTART_BACKOFF_CONDITION:
        updates.append(ConditionUpdate(AVAILABLE, "False", RESTART_BACKOFF_CONDITION,
                                       final.reason))
    else:
        updates.append(ConditionUpdate(AVAILABLE, "False", "NoRunner",
                                       "no runner pod is committed yet"))


    if isinstance(final, act.Wait) and final.condition == WAITING_FOR_OLD_POD:
        updates.append(ConditionUpdate(WAITING_FOR_OLD_POD, "True", "OldPodNotGone",
                                       f"{final.reason}. {NODE_FAILURE_HINT}"))
    else:
        updates.append(ConditionUpdate(WAITING_FOR_OLD_POD, "False", "NoOldPod",
                                       "no other pod of this VM is left",
                                       only_if_present=True))

    refused = snap.obs.create_failed_generation
    if isinstance(final, act.Wait) and final.condition in (PULL_SECRET_NOT_FOUND,
                                                           POD_SCALE_FENCE_AHEAD):
        updates.append(ConditionUpdate(DEGRADED, "True", final.condition, final.reason,
                                       generation=vm.generation))
    elif refused is None or refused < vm.generation:
        # Not (or no longer) refused for this generation: once a pod is committed, say so.
        degraded = _find(status.conditions, DEGRADED)
        if degraded is not None and degraded.status == "True" and recoverable(degraded.reason):
            # This reconcile ended normally: the step that was stuck took effect.
            updates.append(ConditionUpdate(DEGRADED, "False", RECOVERED,
                                           f"recovered from {degraded.reason}"))
        elif degraded is not None and degraded.status == "True" and status.pod_name:
            updates.append(ConditionUpdate(DEGRADED, "False", "RunnerCreated",
                                           f"runner pod {status.pod_name} was created"))
        elif (degraded is not None and degraded.status == "True"
              and degraded.reason == FENCE_AHEAD):
            # This reconcile got past the fence check: the fence is no longer ahead.
            updates.append(ConditionUpdate(DEGRADED, "False", FENCE_RESOLVED,
                                           "status.fence is no longer ahead of the leader"))
    plan = status.pending_scale
    if isinstance(final, act.Wait) and final.condition == SCALING_CONDITION and plan:
        updates.append(ConditionUpdate(SCALING_CONDITION, "True", RUNNER_NOT_ANSWERING,
                                       final.reason, plan_seq=plan.seq))
    updates.append(unimplemented_fields_condition(vm))
    return updates


def with_ready(mutation: StatusMutation, snap: Snapshot) -> StatusMutation:
    """``mutation``, with the Available condition the status it writes implies written in the
    same PUT (as :func:`desired_conditions` would say it once the reconcile is done, from
    ``snap``'s pods), so that a reconcile that ends right after a plan, a commit or a
    sync has no condition left to write. On a conflict retry it is derived again from
    the fresh copy. The other conditions (WaitingForOldPod, Degraded, ...) follow the
    reconcile's end as before: they depend on how it ends."""

    def mutate(vm: VirtualMachine) -> VirtualMachineStatus | None:
        new = mutation(vm)
        if new is None:
            return None
        after = dataclasses.replace(vm, status=new)
        view = Snapshot(obs=dataclasses.replace(snap.obs, vm=after), record=snap.record,
                        pods=snap.pods)
        ready = [u for u in desired_conditions(view, act.Done()) if u.type == AVAILABLE]
        new.conditions, _ = _apply(after, ready, now_rfc3339())
        return new

    return mutate


def fence_ahead(vm: VirtualMachine, lease: act.Fence) -> tuple[int, int] | None:
    """The (epoch, token) in ``vm``'s status that is ahead of ``lease``, or None.

    Ahead means what the mutations refuse: ``status.fence`` above (epoch, token), or a
    recorded plan (``pendingPod``, or ``pendingScale`` while the VM is not being
    deleted) of a higher epoch (what :func:`~neonvm.controller.decide.decide` calls
    Fenced).
    """
    where = fence_ahead_field(vm, lease)
    if where is None:
        return None
    s = vm.status
    source = {"status.fence": s.fence, "status.pendingPod": s.pending_pod,
              "status.pendingScale": s.pending_scale}[where]
    assert source is not None
    return (source.epoch, source.token)


def fence_ahead_field(vm: VirtualMachine, lease: act.Fence) -> str | None:
    """Which field of ``vm``'s status is ahead of ``lease`` (see :func:`fence_ahead`):
    ``status.fence``, ``status.pendingPod`` or ``status.pendingScale``; None: none."""
    s = vm.status
    if s.fence is not None and (s.fence.epoch, s.fence.token) > (lease.epoch, lease.token):
        return "status.fence"
    if s.pending_pod is not None and s.pending_pod.epoch > lease.epoch:
        return "status.pendingPod"
    if (s.pending_scale is not None and s.pending_scale.epoch > lease.epoch
            and vm.deletion_timestamp is None):
        return "status.pendingScale"
    return None


def fence_ahead_message(seen: tuple[int, int], lease: act.Fence,
                        where: str = "status.fence") -> str:
    """The Degraded(FenceAhead) message: only for an *epoch* ahead, where ``decide`` says
    Fenced and this leader does nothing for the VM (a token-only lead ends the term).
    ``where``: the field that is ahead (:func:`fence_ahead_field`)."""
    return (f"{where} epoch {seen[0]} (token {seen[1]}) is ahead of this leader's epoch "
            f"{lease.epoch} (token {lease.token}), whose Lease still holds: the VM is left "
            f"alone (no pod is created, started or deleted for it, and it is not scaled) "
            f"until an operator corrects it (for example after a restore from backup): "
            f"remove status.fence, or set it at or below (epoch {lease.epoch}, token "
            f"{lease.token}), and remove a status.pendingPod or status.pendingScale whose "
            f"epoch is above {lease.epoch}")


def epoch_ahead(seen: tuple[int, int] | None, lease: act.Fence) -> bool:
    """``seen`` (from :func:`fence_ahead`) is ahead of ``lease`` by its epoch, not only by
    its token. Only then is the VM marked Degraded while the term goes on: a fence of our
    own epoch with a higher token means the locks' tokens went back (their etcd restored
    or replaced), which every VM would hit; ending the term gives a new epoch that clears
    it for all of them."""
    return seen is not None and seen[0] > lease.epoch


def _recently_changed(condition: Condition | None, now: str, quiet_seconds: float) -> bool:
    """``condition`` changed status less than ``quiet_seconds`` before ``now`` (or its
    transition time is in the future: another writer's clock ahead of ours)."""
    if condition is None or quiet_seconds <= 0 or not condition.last_transition_time:
        return False
    try:
        then = _parse_rfc3339(condition.last_transition_time)
    except ValueError:
        return False
    return (_parse_rfc3339(now) - then).total_seconds() < quiet_seconds


def _parse_rfc3339(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def fence_ahead_mutation(lease: act.Fence, now: str | None = None,
                         quiet_seconds: float = FENCE_AHEAD_QUIET_SECONDS) -> StatusMutation:
    """Degraded/FenceAhead on a VM fenced ahead of ``lease`` by epoch; conditions only.

    Unlike every other status write it does not stamp the writer's fence and changes
    nothing but the Degraded condition: ``status.fence``, the plan fields and
    ``observedGeneration`` stay exactly as they are, so the fence stays ahead and every
    writer with a lower fence keeps being refused. On the fresh copy of a conflict retry
    it re-checks that the fence is still ahead by epoch (None: nothing to say any more;
    a token-only lead is not this write's business, see :func:`epoch_ahead`).

    Rate limit: Degraded is not turned True when it changed status less than
    ``quiet_seconds`` ago. Two installations misconfigured on one namespace would
    otherwise take turns without end: the unfenced one clears FenceAhead at each of its
    reconciles, the fenced one sets it again at each watch event of that write. A
    Degraded that is already True is updated at once (a new generation, a new message):
    that changes no transition time, and the next clearing write starts the quiet period.
    """

    def mutate(vm: VirtualMachine) -> VirtualMachineStatus | None:
        seen = fence_ahead(vm, lease)
        if seen is None or not epoch_ahead(seen, lease):
            return None
        stamp = now or now_rfc3339()
        degraded = _find(vm.status.conditions, DEGRADED)
        if (degraded is not None and degraded.status != "True"
                and _recently_changed(degraded, stamp, quiet_seconds)):
            return None
        update = ConditionUpdate(DEGRADED, "True", FENCE_AHEAD,
                                 fence_ahead_message(seen, lease,
                                                     fence_ahead_field(vm, lease) or ""),
                                 generation=vm.generation)
        conditions, changed = _apply(vm, [update], stamp)
        if not changed:
            return None
        status = copy.deepcopy(vm.status)
        status.conditions = conditions
        return status

    return mutate


def too_large_mutation(message: str, lease: act.Fence) -> StatusMutation:
    """Degraded True, reason ``ObjectTooLarge``, written only on the transition into it,
    and nothing else: not ``observedGeneration`` nor anything :func:`conditions_mutation`
    derives from the spec, which the controller does not act on while the VM is too
    large to cache (neonvm/controller/too_large.py). The fence is checked and stamped
    as by :func:`conditions_mutation`."""
    update = ConditionUpdate(DEGRADED, "True", OBJECT_TOO_LARGE, message)

    def mutate(vm: VirtualMachine) -> VirtualMachineStatus | None:
        degraded = _find(vm.status.conditions, DEGRADED)
        if (degraded is not None and degraded.status == "True"
                and degraded.reason == OBJECT_TOO_LARGE):
            return None
        conditions, changed = _apply(vm, [update], now_rfc3339())
        if not changed:
            return None
        check_fence(vm, lease)
        status = copy.deepcopy(vm.status)
        status.conditions = conditions
        status.fence = Fence(epoch=lease.epoch, token=lease.token)
        return status

    return mutate


def unimplemented_fields_condition(vm: VirtualMachine) -> ConditionUpdate:
    """FieldsNotImplemented: True naming the accepted NeonVM fields the VM uses that this
    controller does not act on (:mod:`neonvm.api.compat`); False once it uses none."""
    message = compat.unimplemented_message(vm.spec)
    if message:
        return ConditionUpdate(compat.CONDITION, "True", compat.REASON_USED, message)
    return ConditionUpdate(compat.CONDITION, "False", compat.REASON_NONE,
                           "every field the VM uses is implemented", only_if_present=True)


def refused_condition(message: str, generation: int) -> ConditionUpdate:
    """Degraded: the API server refused to create the runner pod for ``generation``."""
    return ConditionUpdate(DEGRADED, "True", CREATE_REFUSED,
                           f"{message} (waiting for a spec change)", generation=generation)


def _find(conditions: list[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def _applies(vm: VirtualMachine, update: ConditionUpdate) -> bool:
    """Whether ``update`` may be written on the copy ``vm``: Scaling=True only while a
    scaling plan is recorded (with ``plan_seq``, that plan). Re-checked on the fresh copy
    of every conflict retry: a plan dropped since (a deposed leader's drop landing
    first) must not be followed by a Scaling=True that says a change is in progress,
    with none recorded, over the condition that says why it was dropped."""
    if update.type != SCALING_CONDITION or update.status != "True":
        return True
    plan = vm.status.pending_scale
    return plan is not None and update.plan_seq in (None, plan.seq)


def _apply(vm: VirtualMachine, updates: list[ConditionUpdate],
           stamp: str) -> tuple[list[Condition], bool]:
    """``vm``'s conditions with ``updates`` applied (those that :func:`_applies` to
    it), and whether anything changed."""
    conditions = [c for c in copy.deepcopy(vm.status.conditions) if c.type != READY]
    changed = len(conditions) != len(vm.status.conditions)  # a Ready of an earlier version
    for update in updates:
        if not _applies(vm, update):
            continue
        message = truncate(update.message)
        existing = _find(conditions, update.type)
        generation = update.generation if update.generation is not None else vm.generation
        if existing is None:
            if update.only_if_present:
                continue
            conditions.append(Condition(
                type=update.type, status=update.status,  # type: ignore[arg-type]
                reason=update.reason, message=message,
                last_transition_time=stamp, observed_generation=generation))
            changed = True
            continue
        same = (existing.status, existing.reason, existing.message,
                existing.observed_generation) == (
                    update.status, update.reason, message, generation)
        if same:
            continue
        if existing.status != update.status:
            existing.last_transition_time = stamp
        existing.status = update.status  # type: ignore[assignment]
        existing.reason, existing.message = update.reason, message
        existing.observed_generation = generation
        changed = True
    return conditions, changed


def conditions_mutation(updates: list[ConditionUpdate], lease: act.Fence,
                        now: str | None = None) -> StatusMutation:
    """The status write that makes the conditions say ``updates`` (None: already so)."""

    def mutate(vm: VirtualMachine) -> VirtualMachineStatus | None:
        conditions, changed = _apply(vm, updates, now or now_rfc3339())
        changed = changed or vm.status.observed_generation != vm.generation
        status = copy.deepcopy(vm.status)
        # A fractional cpus.use changed within the guest's whole vCPUs, and a
        # targetRevision the VM runs at (the spec changed nothing else, or the write
        # that set Running could not stamp it): here, from the fresh copy.
        changed = autoscaler_view.settle(status, vm) or changed
        if not changed:
            return None
        check_fence(vm, lease)
        status.conditions = conditions
        status.observed_generation = vm.generation
        status.fence = Fence(epoch=lease.epoch, token=lease.token)
        return status

    return mutate


def stuck_mutation(update: ConditionUpdate, lease: act.Fence) -> StatusMutation:
    """Write a stuck Degraded condition only on the transition into its reason.

    A VM that stays stuck for the same reason keeps the condition as first written: its
    message names what changes from one attempt to the next (a pod name, an error text,
    counts) and rewriting it on every attempt would produce a watch event that requeues
    the VM at once, bypassing the stuck backoff. Logs and events carry the details."""
    write = conditions_mutation([update], lease)

    def mutate(vm: VirtualMachine) -> VirtualMachineStatus | None:
        for cond in vm.status.conditions:
            if (cond.type == update.type and cond.status == update.status
                    and cond.reason == update.reason):
                return None
        return write(vm)

    return mutate
