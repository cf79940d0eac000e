"""The performers: how each action is done against the API server, one function each.

A performer is ``(ctx, step) -> str`` (:mod:`neonvm.controller.step`): "done" when the
action took effect, else why not. Each makes exactly one conditional write (the
precondition in brackets; docs/reconciler.md, "States, actions, writes and their
preconditions"):

* status writes (RecordPlan, Commit, DropPlan, Restart, SyncStatus, live scaling's):
  PUT ``/status`` [resourceVersion], the row's mutation re-run on the fresh copy after a
  conflict; AddFinalizer / RemoveFinalizer: PUT of the main resource [resourceVersion];
* CreatePod: create with exactly the recorded name, gated [the name]; errors sorted by
  :func:`~neonvm.controller.create_policy.classify_create_error`;
* Ungate: a *new* direct list must hold exactly this pod; then a JSON patch [``test`` of
  uid, resourceVersion and the gate] removes our gate;
* DeletePod: delete [``preconditions.uid``]; ApplyScale: the runner's ``PUT /scale``.

The events a status write records (:class:`~neonvm.controller.step.Event`) are here too;
the table that binds each action to its performer is
:data:`neonvm.controller.action_table.ACTIONS`.
"""

from __future__ import annotations

from typing import Any

from kubernetes.client.exceptions import ApiException
from loguru import logger
from urllib3.exceptions import HTTPError

from neonvm.api import types
from neonvm.controller import actions as act
from neonvm.controller import autoscaler_view, mutations, podspec, reasons, ssh_keys
from neonvm.controller.authority import Authority, RetryableError
from neonvm.controller.cluster import VMRecord
from neonvm.controller.conditions import (
    ConditionUpdate,
    api_error_text,
    conditions_mutation,
    refused_condition,
    stuck_condition,
    stuck_mutation,
    with_ready,
)
from neonvm.controller.create_policy import (
    CREATE_FAILURES_BEFORE_CONDITION,
    FENCE_CREATOR_RULE,
    classify_create_error,
    namespace_terminating,
)
from neonvm.controller.fencing import force_delete_dead_pod
from neonvm.controller.mutations import token_secret_mutation
from neonvm.controller.observe import Snapshot, labelled_for
from neonvm.controller.reasons import CREATE_FAILING
from neonvm.controller.scaling import POD_WITHOUT_TOKEN
from neonvm.controller.step import Event, Outcome, Step, StepContext, update_vm, write_status
from neonvm.kube import api_error_message

NAMESPACE_TERMINATING_OUTCOME = "namespace_terminating"
"""A create refused because the namespace is being deleted: observed again, the VM
waits (:class:`~neonvm.controller.step.TerminatingNamespaces`)."""

REFUSED_SCALING = {"runner_400": reasons.SCALING_NEEDS_RESTART,
                   "runner_401": reasons.SCALING_NEEDS_RESTART,
                   POD_WITHOUT_TOKEN: reasons.SCALING_NEEDS_RESTART,
                   "no_token": reasons.SCALING_DISABLED}
"""ApplyScale outcomes that asking again cannot change, and the Scaling reason they end in."""



# ---- the events of status writes ----------------------------------------------------------


def planned(action: act.RecordPlan, vm: types.VirtualMachine) -> Event:
    p = action.plan
    return Event(reasons.PLANNED, f"plan #{p.plan_seq}: runner pod {p.name} "
                            f"(epoch {p.epoch}, token {p.token})")


def committed(action: act.Commit, vm: types.VirtualMachine) -> Event:
    return Event(reasons.COMMITTED, f"runner pod {action.name} committed")


def plan_dropped(action: act.DropPlan, vm: types.VirtualMachine) -> Event:
    return Event(reasons.PLAN_DROPPED, action.reason, warning=True)


def restarted(action: act.Restart, vm: types.VirtualMachine) -> Event:
    if action.terminal_phase is None:
        return Event(reasons.RESTARTING, f"{action.reason}; restart #{vm.status.restart_count} "
                                   f"(restartPolicy {vm.spec.restart_policy})")
    return Event(vm.status.phase or "Stopped", f"{action.reason}; not restarted "
                                               f"(restartPolicy {vm.spec.restart_policy})")


def look_given_up(action: act.CommitScale, vm: types.VirtualMachine) -> Event | None:
    if not action.gives_up:
        return None
    logger.bind(vm=vm.key).warning("{reason}", reason=action.reason)
    return Event(reasons.LOOK_GIVEN_UP, action.reason, warning=True)


def record_event(ctx: StepContext, vm: types.VirtualMachine, event: Event | None) -> None:
    """Record ``event`` (if any) on ``vm`` as written."""
    if event is not None:
        ctx.progress.record(vm, event.reason, event.message, warning=event.warning)


# ---- the VM's writes ------------------------------------------------------------------------


def status_write(ctx: StepContext, step: Step) -> str:
    """The performer of a status write: its row's mutation (one of
    :mod:`~neonvm.controller.mutations`), PUT conditionally."""
    mutation = step.row.mutation
    assert mutation is not None, f"{type(step.action).__name__} writes no VM"
    change = with_ready(mutation(step.action, step.authority.lease), step.snap)
    written = write_status(ctx, step.key, step.snap, change, step.authority, step.log)
    if written is not None:
        if step.row.event is not None:
            record_event(ctx, written.vm, step.row.event(step.action, written.vm))
        return Outcome("done", vm=written)
    return "declined"


def finalizer_write(ctx: StepContext, step: Step) -> str:
    """The performer of AddFinalizer and RemoveFinalizer: PUT of the main resource."""
    assert step.row.mutation is not None, f"{type(step.action).__name__} writes no VM"
    mutation = step.row.mutation(step.action)
    outcome = update_vm(ctx, step.key, step.snap, lambda rec: mutation(rec.vm),
                        ctx.writer.put_main, step.authority)
    if not outcome.written:
        return "declined"
    if isinstance(step.action, act.RemoveFinalizer):
        assert step.snap.record is not None
        ctx.events.record(step.snap.record.vm, reasons.FINALIZED,
                          "all runner pods are gone; finalizer removed")
        if ctx.on_finalized is not None:
            ctx.on_finalized(step.key)
        return "done"
    return Outcome("done", vm=outcome.obj)


# ---- the create -----------------------------------------------------------------------------


def create_pod(ctx: StepContext, step: Step) -> str:
    """The performer of CreatePod: the pod of the recorded plan, gated (docs/reconciler.md,
    "Refusals are conditions, not loops")."""
    key, action, snap, authority, log = step.key, step.action, step.snap, step.authority, \
        step.log
    assert snap.record is not None
    vm = snap.record.vm
    # The pod mounts the VM's scaling token (also a self-fencing runner's bearer, unless
    # the runner asks with a projected token of the controller's rights audience).
    defaults = ctx.config.pod_defaults
    secret = ctx.scaling.create_token(
        vm, wanted=podspec.fencing_eligible(vm, defaults) and not defaults.rights_audience)
    recorded: VMRecord | None = None
    if secret is not None:
        replacing = vm.status.scaling_token_secret_uid or ""
        recorded = write_status(ctx, key, snap, token_secret_mutation(
            *secret, authority.lease, replacing=replacing), authority, log)
        if recorded is None:
            # Another token was recorded first (or the write was declined): build
            # the pod only from a VM that names the Secret it will mount.
            ctx.scaling.discard_token(vm.namespace, secret[0])
            return "precondition"
        vm = recorded.vm
    _ensure_ssh_secret(ctx, step, vm)
    try:
        manifest = podspec.runner_pod(vm, action.plan, ctx.config.pod_defaults)
    except podspec.PodSpecError as exc:
        _refuse(ctx, key, snap, str(exc), authority, log)
        return "refused"
    name = action.plan.name
    try:
        created = ctx.cluster.create_pod(vm.namespace, manifest)
    except ApiException as exc:
        message = api_error_message(exc)
        if namespace_terminating(exc.status, message):
            # Not retried: the namespace and its VMs are going. The next decision
            # (from a direct read) waits, and so does every VM of this namespace.
            ctx.timers.create_answered(key)
            ctx.terminating.learn(vm.namespace)
            log.info("namespace {ns} is being deleted: no runner pod is created "
                     "there", ns=vm.namespace)
            return NAMESPACE_TERMINATING_OUTCOME
        kind = classify_create_error(exc.status, message)
        if kind == "retry":
            _create_failed(ctx, key, snap, name, f"{exc.status}: {message}", authority, log)
            raise RetryableError(f"create {name}: {exc.status}: {message}") from exc
        ctx.timers.create_answered(key)
        if kind == "exists":
            return _name_taken(ctx, step)
        if exc.status == 403 and FENCE_CREATOR_RULE in message:
            return Outcome("forbidden", ctx.identity.forbidden_detail(
                f"create runner pod {name}", message))
        _refuse(ctx, key, snap, f"creating runner pod {name} was refused "
                                f"({exc.status}): {api_error_text(message)}",
                authority, log)
        return "refused"
    except (HTTPError, OSError) as exc:  # no answer: connection refused, timeout
        message = f"{type(exc).__name__}: {exc}"
        _create_failed(ctx, key, snap, name, message, authority, log)
        raise RetryableError(f"create {name}: {message}") from exc
    ctx.timers.create_answered(key)
    meta = created.get("metadata") or {}
    if not podspec.has_our_gate(created):
        _gate_stripped(ctx, key, snap, meta, authority, log)
        return "gate_stripped"
    ctx.progress.record(vm, reasons.CREATED, f"runner pod {action.plan.name} created (gated)")
    if ctx.metrics:
        ctx.metrics.lifecycle.runner_created(snap.record.raw, created)
    # The token's status write (if any) is the newest VM we know: the next step's CAS
    # must start from it, not from the record it replaced.
    return Outcome("done", pod=created, vm=recorded)


SSH_KEY_HOLD_FACTOR = 2
"""A runner pod waits for its SSH key Secret while the create fails transiently for up to
this many times ``create_failing_after`` (and more than
:data:`CREATE_FAILURES_BEFORE_CONDITION` failures), then starts without the key."""


def _ensure_ssh_secret(ctx: StepContext, step: Step, vm: types.VirtualMachine) -> None:
    """Before each runner pod of a VM with ``enableSSH``: its SSH key Secret, one create
    (:func:`neonvm.controller.ssh_keys.ensure_secret`). A refusal is a Warning event and
    the pod starts without a key. A transient error (429, 5xx, no answer) counts as a
    failure of the pod's create (:func:`_create_failed`: ``Degraded``, ``CreateFailing``
    after a while) and holds the pod back, retried, but only for
    :data:`SSH_KEY_HOLD_FACTOR` times ``create_failing_after``: the key is optional, so
    then the pod starts without it, with a Warning event; the VM's next pod tries again
    (docs/protocol.md, "The SSH key Secret")."""
    if not ssh_keys.wants_ssh(vm) or not vm.status.ssh_secret_name:
        return
    name = ssh_keys.secret_name(vm)
    try:
        if ssh_keys.ensure_secret(ctx.cluster, vm) == "created":
            step.log.info("created the SSH key Secret {name}", name=name)
        return
    except ssh_keys.Refused as exc:
        ctx.events.record(vm, reasons.SSH_KEY_UNAVAILABLE,
                          f"{exc}: the runner pod starts without an SSH key", warning=True)
        return
    except ApiException as exc:
        error = f"creating its SSH key Secret {name}: {exc.status}: {api_error_message(exc)}"
        cause: Exception = exc
    except (HTTPError, OSError) as exc:  # no answer: connection refused, timeout
        error = f"creating its SSH key Secret {name}: {type(exc).__name__}: {exc}"
        cause = exc
    pod = step.action.plan.name
    failures, lasted = ctx.timers.create_failed(step.key)
    if (failures <= CREATE_FAILURES_BEFORE_CONDITION
            or lasted < SSH_KEY_HOLD_FACTOR * ctx.config.create_failing_after):
        _say_create_failing(ctx, step.key, step.snap, pod, error, step.authority, step.log,
                            failures, lasted)
        raise RetryableError(f"create {pod}: {error}") from cause
    # No status write here: the pod's create follows from this snapshot.
    ctx.events.record(vm, reasons.SSH_KEY_UNAVAILABLE,
                      f"{api_error_text(error)} (failing for {lasted:.0f}s, {failures} "
                      f"tries): the runner pod starts without an SSH key; the VM's next "
                      f"pod tries again", warning=True)
    step.log.warning("{err}: failing for {lasted:.0f}s; runner pod {pod} starts without "
                     "an SSH key", err=error, lasted=lasted, pod=pod)


def _create_failed(ctx: StepContext, key: str, snap: Snapshot, name: str, error: str,
                   authority: Authority, log: Any) -> None:
    """A transient create failure: after a few in a row, say so in Degraded (the create
    is still retried with backoff; the condition clears once a reconcile ends normally)."""
    failures, lasted = ctx.timers.create_failed(key)
    _say_create_failing(ctx, key, snap, name, error, authority, log, failures, lasted)


def _say_create_failing(ctx: StepContext, key: str, snap: Snapshot, name: str, error: str,
                        authority: Authority, log: Any, failures: int, lasted: float) -> None:
    """``Degraded``, reason ``CreateFailing``, once ``failures`` transient failures in a
    row have lasted ``create_failing_after``."""
    if (failures < CREATE_FAILURES_BEFORE_CONDITION or snap.record is None
            or lasted < ctx.config.create_failing_after):
        return
    update = stuck_condition(CREATE_FAILING,
                             f"creating runner pod {name} keeps failing (retried with "
                             f"backoff); last error: {api_error_text(error)}")
    try:
        # Written on the transition only: the message keeps its first error.
        write_status(ctx, key, snap, stuck_mutation(update, authority.lease), authority, log)
    except (ApiException, HTTPError, OSError) as exc:
        log.debug("could not record CreateFailing: {err}", err=exc)


def _name_taken(ctx: StepContext, step: Step) -> str:
    """AlreadyExists. A pod labelled for this VM shows up in the next observation and
    :func:`decide` adopts it only if it carries this plan's fence annotations (epoch and
    token, written by our create alone), else drops the plan: a pod planted under the
    predictable name is never committed. A pod *not* labelled for it never does
    (observations list by label), so the driver drops the plan itself, as decide would
    on seeing a pod that is not ours: a new plan gets a new name."""
    snap, log = step.snap, step.log
    assert snap.record is not None
    vm = snap.record.vm
    name = step.action.plan.name
    pod = ctx.reader.get_pod(vm.namespace, name)
    labels = ((pod or {}).get("metadata") or {}).get("labels") or {}
    if pod is None or labels.get(types.LABEL_VM_NAME) == vm.name:
        log.info("pod {pod} already exists: observing again", pod=name)
        return "exists"
    drop = act.DropPlan(name=name, reason=f"the name {name} is taken by a pod that is not "
                                        f"labelled for this VM")
    log.warning("{reason}: dropping plan #{seq}", reason=drop.reason,
                seq=step.action.plan.plan_seq)
    written = write_status(ctx, step.key, snap, mutations.drop_plan(drop, step.authority.lease),
                           step.authority, log)
    if written is not None:
        record_event(ctx, written.vm, plan_dropped(drop, written.vm))
    return "name_taken"


def _gate_stripped(ctx: StepContext, key: str, snap: Snapshot, meta: dict[str, Any],
                   authority: Authority, log: Any) -> None:
    """ALARM: the create response lacks our gate. Delete the pod before it can run."""
    assert snap.record is not None
    name, uid = meta.get("name", ""), meta.get("uid", "")
    if ctx.metrics:
        ctx.metrics.gate_stripped.inc()
    log.error("ALARM: runner pod {pod} was created without the scheduling gate "
              "{gate}; deleting it", pod=name, gate=types.SCHEDULING_GATE)
    ctx.events.record(snap.record.vm, reasons.GATE_STRIPPED,
                      f"runner pod {name} came back without the scheduling gate "
                      f"{types.SCHEDULING_GATE} (a webhook or feature gate removed "
                      f"it); deleted", warning=True)
    _delete(ctx, snap.record.vm.namespace, name, uid, log)
    _refuse(ctx, key, snap, f"runner pod {name} was created without the scheduling gate "
                            f"{types.SCHEDULING_GATE}; something strips it",
            authority, log, event=False)


def _refuse(ctx: StepContext, key: str, snap: Snapshot, message: str,
            authority: Authority, log: Any, event: bool = True) -> None:
    """Record the refusal as Degraded for this generation: no retry until it changes."""
    assert snap.record is not None
    vm = snap.record.vm
    if ctx.metrics:
        ctx.metrics.create_refused.inc()
    if event:
        ctx.events.record(vm, reasons.CREATE_REFUSED, message, warning=True)
    update: ConditionUpdate = refused_condition(message, vm.generation)
    write_status(ctx, key, snap, conditions_mutation([update], authority.lease),
                 authority, log)


# ---- the pod's writes -----------------------------------------------------------------------


def controlling_owner_uid(pod: dict[str, Any]) -> str | None:
    """The uid of the pod's controlling owner reference (``controller: true``), if any."""
    refs = (pod.get("metadata") or {}).get("ownerReferences") or []
    return next((str(ref.get("uid")) for ref in refs if ref.get("controller")), None)


def _not_ungatable(fresh: VMRecord | None, uid: str, action: act.Ungate) -> str:
    """Why the VM as read now forbids starting ``action``'s pod ('' if it does not)."""
    if fresh is None or fresh.vm.uid != uid:
        return "the VM is gone (or re-created under its name) since the cache saw it"
    if fresh.vm.deletion_timestamp is not None:
        return "the VM is being deleted"
    status = fresh.vm.status
    if status.pod_name != action.name or status.pod_uid != action.uid:
        return f"the VM's committed pod is now {status.pod_name or 'none'}"
    return ""


def ungate(ctx: StepContext, step: Step) -> str:
    """Remove our gate, guarded by a fresh direct list and a test-and-remove patch."""
    action, snap, log = step.action, step.snap, step.log
    assert snap.record is not None
    vm = snap.record.vm
    listed = ctx.reader.list_pods(vm.namespace, vm.name)  # after the commit was seen
    # The VM's pods as the observation saw them: the committed pod is read by name
    # when the labelled list misses it.
    pods = ctx.reader.with_committed(vm.namespace, listed, action.name, action.uid)
    unlabelled = [p for p in pods if not labelled_for(p, vm.name)]
    if unlabelled:
        return replace_unlabelled(ctx, vm, unlabelled[0], action, log)
    if len(pods) != 1:
        log.info("not ungating {pod}: the VM has {n} pods", pod=action.name, n=len(pods))
        return "precondition"
    pod = pods[0]
    meta = pod.get("metadata") or {}
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    index = next((i for i, g in enumerate(gates) if g.get("name") == types.SCHEDULING_GATE),
                 None)
    if (meta.get("name") != action.name or meta.get("uid") != action.uid
            or meta.get("deletionTimestamp") is not None or index is None):
        log.info("not ungating {pod}: it is no longer the VM's only gated pod",
                 pod=action.name)
        return "precondition"
    if not (snap.obs.direct or snap.vm_written):
        # Decided from the cache: the list above is fresh, the VM is not. A VM whose
        # deletion (or re-creation under its name) the cache has not seen yet would
        # start a guest that is deleted again at once: read the VM after the list.
        why = _not_ungatable(ctx.reader.get_vm(vm.namespace, vm.name), vm.uid, action)
        if why:
            log.info("not ungating {pod}: {why}", pod=action.name, why=why)
            return Outcome("precondition", why)
    try:
        patched = ctx.cluster.ungate_pod(
            vm.namespace, action.name, uid=action.uid,
            resource_version=meta.get("resourceVersion") or "", gate_index=index)
    except ApiException as exc:
        if exc.status in (404, 409, 422):
            log.info("ungate of {pod} refused ({status}: {msg}): observing again",
                     pod=action.name, status=exc.status, msg=api_error_message(exc))
            return Outcome("precondition", f"{exc.status}: {api_error_message(exc)}")
        if exc.status == 403:
            return Outcome("forbidden", ctx.identity.forbidden_detail(
                f"remove the scheduling gate of runner pod {action.name}",
                api_error_message(exc)))
        raise
    ctx.progress.record(vm, reasons.STARTED, f"runner pod {action.name} ungated: it is the "
                                       f"VM's only pod")
    return Outcome("done", pod=patched if isinstance(patched, dict) else None)


def replace_unlabelled(ctx: StepContext, vm: types.VirtualMachine, pod: dict[str, Any],
                       action: act.Ungate, log: Any) -> str:
    """The committed pod lost its runner label (possible only with the admission policy
    off). It is still the VM's pod, yet no label-selected list would show it, so a later
    ungate of another pod could not see it: it must never run. Still gated it never ran,
    so delete it [uid, resourceVersion]; the next observation finds it gone and the VM
    restarts with a new, labelled pod."""
    meta = pod.get("metadata") or {}
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    if (meta.get("name") != action.name or meta.get("uid") != action.uid
            or meta.get("deletionTimestamp") is not None
            or not any(g.get("name") == types.SCHEDULING_GATE for g in gates)):
        log.info("not ungating {pod}: a pod of the VM is not labelled for it",
                 pod=meta.get("name"))
        return Outcome("precondition", f"pod {meta.get('name')} is not labelled "
                                       f"{types.LABEL_VM_NAME}={vm.name}")
    owner = controlling_owner_uid(pod)
    if owner != vm.uid:
        # Not this VM's pod (the status names another VM's pod, or a pod planted under
        # that name): never delete it, and never start it. The reconcile ends stuck
        # with backoff and says so; a status naming the VM's own pod fixes it.
        log.warning("not ungating or deleting {pod}: the VM's status names it, but "
                    "its controlling owner is {owner}, not this VM ({uid})",
                    pod=action.name, owner=owner or "nobody", uid=vm.uid)
        return Outcome("precondition", f"the committed pod is not controlled by this "
                                       f"VM (its controlling owner is "
                                       f"{'another object' if owner else 'none'}); "
                                       f"not deleted")
    message = (f"runner pod {action.name} lost its label {types.LABEL_VM_NAME}={vm.name}"
               f"; it never ran (gated) and is replaced by a new pod")
    try:
        ctx.cluster.delete_pod(vm.namespace, action.name, uid=action.uid,
                               resource_version=meta.get("resourceVersion"))
    except ApiException as exc:
        if exc.status in (404, 409):
            return Outcome("precondition", f"{exc.status}: {api_error_message(exc)}")
        raise
    ctx.events.record(vm, reasons.RUNNER_UNLABELLED, message, warning=True)
    return Outcome("replaced")


def _delete(ctx: StepContext, namespace: str, name: str, uid: str, log: Any) -> bool:
    try:
        ctx.cluster.delete_pod(namespace, name, uid=uid)
    except ApiException as exc:
        if exc.status in (404, 409):
            log.info("pod {pod} ({uid}) already gone or replaced", pod=name, uid=uid)
            return False
        raise
    return True


def delete_pod(ctx: StepContext, step: Step) -> str:
    """The performer of DeletePod [``preconditions.uid``]."""
    action = step.action
    assert step.snap.record is not None
    vm = step.snap.record.vm
    if not _delete(ctx, vm.namespace, action.name, action.uid, step.log):
        return "gone"
    ctx.events.record(vm, reasons.DELETED, f"runner pod {action.name}: {action.reason}")
    return "done"


def force_delete(ctx: StepContext, step: Step) -> str:
    """The performer of ForceDeleteDeadPod (:mod:`neonvm.controller.fencing`)."""
    assert step.snap.record is not None
    return force_delete_dead_pod(ctx.fencing, ctx.cluster, ctx.events, step.action,
                                 step.snap.record.vm, step.authority.check, step.log)


def sync_pod_metadata(ctx: StepContext, step: Step) -> str:
    """The performer of SyncPodMetadata (:mod:`neonvm.controller.autoscaler_view`)."""
    assert step.snap.record is not None
    return autoscaler_view.sync_pod_metadata(ctx.cluster, step.snap.record.vm,
                                             step.snap.pods.get(step.action.name),
                                             step.action.uid, step.log)


# ---- the runner's -------------------------------------------------------------------------


def apply_scale(ctx: StepContext, step: Step) -> str:
    """The performer of ApplyScale: the runner's ``PUT /scale`` with the plan's fence.

    A refusal that asking again cannot change (the runner's 400 or 401, no token to sign
    with) drops the plan with the Scaling condition saying why
    (:data:`~neonvm.controller.reasons.SCALING_REFUSED`): the VM runs on at its size, and
    the next spec change tries again. The authority is checked again as soon as the PUT
    returns (it may have taken its whole deadline); a failure at the runner ends the
    reconcile stuck (:func:`~neonvm.controller.reconciler.paused`)."""
    action, authority = step.action, step.authority
    outcome = ctx.scaling.apply(action, step.snap, step.log)
    warning = getattr(outcome, "warning", "")
    if warning and step.snap.record is not None:  # the pod's resize refused
        ctx.events.record(step.snap.record.vm, reasons.RESIZE_REFUSED, warning, warning=True)
    # A PUT may have taken the whole deadline: whatever follows (a drop, a Degraded
    # write, another step) is decided under an authority checked after it.
    authority.check()
    refused = REFUSED_SCALING.get(str(outcome))
    if refused is None:
        return outcome
    # A pod built without a token refuses every PUT: nothing of the plan can land,
    # so its drop asks for no look (one that could never end).
    drop = act.DropScale(seq=action.plan.seq, refused=refused,
                       reason=getattr(outcome, "detail", "") or str(outcome),
                       starts_look=str(outcome) != POD_WITHOUT_TOKEN)
    written = write_status(ctx, step.key, step.snap, mutations.drop_scale(drop, authority.lease),
                           authority, step.log)
    if written is not None:
        ctx.events.record(written.vm, refused, drop.reason, warning=True)
    return Outcome("refused", drop.reason)
