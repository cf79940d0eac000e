"""The driver: observe, decide, act, until the decision is Done or Wait.

:meth:`Reconciler.reconcile` runs one VM's reconcile under an :class:`Authority` (the
leader epoch E and the VM lock's fencing token T). Each round it observes, asks the pure
:func:`~neonvm.controller.decide.decide` for the next single action, performs exactly that
action with a conditional write, and observes again. The first observation may come
from the cache. After a write that took effect the next observation is built from the
API server's answer to it (the VM as stored, the pod as created or patched) on top of
the previous one (:meth:`Reconciler._seen_by_write`); the loop acts on such an
observation only for the decisions of :data:`SEEN_BY_WRITE` and reads directly for the
others (Restart, DeletePod, RemoveFinalizer), after a write that did not take effect,
and whenever ``decide`` asks (docs/protocol.md, "Observing from write responses").

How each action is performed (the precondition is in brackets):

* status writes (RecordPlan, Commit, DropPlan, Restart, SyncStatus, conditions): PUT to
  ``/status`` [``metadata.resourceVersion`` of the VM the decision saw], through
  :func:`~neonvm.controller.update.conditional_update`, which on 409 re-reads and re-runs
  the mutation on the fresh copy;
* AddFinalizer / RemoveFinalizer: PUT of the main resource [resourceVersion], same helper;
* CreatePod: create with exactly the recorded name, gated [the name itself: AlreadyExists
  means observe again]; a response without our gate is deleted at once and raises an
  alarm. Errors are sorted by :func:`classify_create_error`: a permanent refusal (4xx
  other than 409, 429 and a few transient ones: validation, admission, 413 too large)
  becomes a Degraded condition for that generation (no retry until the spec changes);
  transient ones (429, 5xx, timeouts, ``exceeded quota``) are retried with backoff, and
  Degraded ``CreateFailing`` says so once they have lasted a minute. A missing image
  pull secret never gets here: ``decide`` waits instead (see
  :mod:`neonvm.controller.observe`);
* Ungate: a *new* direct list of the VM's pods, taken after the commit was seen, must hold
  exactly this pod (uid), not terminating; then a JSON patch [``test`` of uid,
  resourceVersion and the gate at that index] removes our gate and nothing else. The
  list is completed as the observation is (the committed pod read by name when the
  labelled list misses it), so the two agree on which pods are the VM's; a committed pod
  found only by name lost its label, which no later list would see, so it is never
  ungated: still gated (it never ran), it is deleted [uid and resourceVersion] and the
  VM restarts with a new, labelled pod. A 403 (the admission fence refusing an identity
  that is not the controller's) is Degraded ``UngateForbidden``, naming the identity (and
  a create refused by the fence's creator rule is ``CreateForbidden``, the same way);
* DeletePod: delete [``preconditions.uid``].

A reconcile that cannot converge ends as *stuck* (``ReconcileResult.stuck``): when its
step budget is used up (Degraded ``<Step>NotTakingEffect`` names the step that kept not
taking effect), or when a step is refused for good (``UngateForbidden``). It is counted
in ``neonvm_controller_stuck_reconciles_total{step}`` and the manager retries it with
exponential backoff, instead of at once.

Authority is checked when the reconcile starts and then once per write, immediately
before it (inside the conditional update for a VM write, so in every conflict retry too;
in :meth:`Reconciler._perform` for a pod write), not before each decision: a lost lease,
a lost lock or a changed epoch raises :class:`AuthorityLost` and the reconcile stops at
once (docs/protocol.md, "Authority checks"). A VM whose status is fenced ahead of us
(``decide`` says Fenced, or a mutation raises
:class:`~neonvm.controller.mutations.FencedOut` on a fresh copy) is checked against our
authority once more: lost, the reconcile stops as above; still held, the
fence came from no newer leader. Ahead by its epoch, that VM alone is marked Degraded
(``FenceAhead``) and left alone while every other VM goes on; ahead by its token only
(our epoch: the locks' tokens went back), ``FencedOut`` goes on to the manager, which
ends the term so that the next epoch clears it (:meth:`Reconciler._fenced_ahead`).

What this module does not do: queueing, locking, leader election (see
:mod:`neonvm.controller.manager`). Safety does not rest on those: it rests on the
conditional writes above and on the ungate rule.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple, Protocol

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from loguru import logger
from urllib3.exceptions import HTTPError

from neonvm.api import types
from neonvm.api.types import VirtualMachineStatus
from neonvm.controller import autoscaler_view, podspec, reasons
from neonvm.controller import decide as d
from neonvm.controller.acceleration import (
    Acceleration,
    RunnerReports,
    warn_acceleration_unavailable,
)
from neonvm.controller.authority import (
    Authority,
    AuthorityLost,
    FencedSnapshot,
    RetryableError,
    WrongVM,
)
from neonvm.controller.cluster import Cluster, KubeCluster
from neonvm.controller.cluster import VMWriter as VMWriter  # re-exported: its old home
from neonvm.controller.compat_events import warn_unimplemented
from neonvm.controller.conditions import (
    ConditionUpdate,
    api_error_text,
    conditions_mutation,
    desired_conditions,
    epoch_ahead,
    fence_ahead,
    fence_ahead_field,
    fence_ahead_message,
    fence_ahead_mutation,
    refused_condition,
    stuck_condition,
    with_ready,
)
from neonvm.controller.crd_warning import OldCrdWarning
from neonvm.controller.create_policy import (
    CREATE_FAILURES_BEFORE_CONDITION,
    FENCE_CREATOR_RULE,
    classify_create_error,
    namespace_terminating,
)
from neonvm.controller.events import EventRecorder
from neonvm.controller.fencing import SelfFencing, force_delete_dead_pod
from neonvm.controller.identity import Identity
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.mutations import (
    FencedOut,
    StatusMutation,
    finalizers_mutation,
    status_mutation,
    token_secret_mutation,
)
from neonvm.controller.observe import (
    DirectReader,
    Observer,
    Snapshot,
    VMRecord,
    create_due,
    labelled_for,
    make_snapshot,
    split_key,
)
from neonvm.controller.progress import ProgressEvents
from neonvm.controller.reasons import (
    CREATE_FAILING,
    CREATE_FORBIDDEN,
    DEGRADED,
    FENCE_AHEAD,
    NOT_TAKING_EFFECT,
    RUNNER_MISBEHAVING_REASON,
    STEP_BUDGET_EXHAUSTED,
    UNGATE_FORBIDDEN,
)
from neonvm.controller.scaling import (
    GUEST_REFUSED,
    POD_WITHOUT_TOKEN,
    RUNNER_MISBEHAVING,
    RunnerScaling,
    asks_again_later,
    runner_trouble,
)
from neonvm.controller.timers import VMTimers
from neonvm.controller.update import (
    RetryPolicy,
    UpdateFunction,
    UpdateOutcome,
    conditional_update,
)
from neonvm.kube import api_error_message

FENCE_AHEAD_RECHECK_SECONDS = 300.0
"""How soon a VM fenced ahead of a valid leader is looked at again (a change to the VM,
such as an operator's fix of status.fence, is seen at once through the watch)."""


class Outcome(str):
    """What performing one action came to ("done": it took effect), with a detail for
    people (an API server's refusal, say) used if the step keeps not taking effect.

    A write that took effect also hands back what the API server answered: ``vm``, the
    VM as stored by a conditional PUT, or ``pod``, the runner pod as created or as
    patched. The loop builds its next observation from them
    (:meth:`Reconciler._seen_by_write`); a performer that returns neither (a plain
    string) is followed by a direct read, as every step was before."""

    detail: str
    vm: VMRecord | None
    pod: dict[str, Any] | None

    def __new__(cls, value: str, detail: str = "", *, vm: VMRecord | None = None,
                pod: dict[str, Any] | None = None) -> Outcome:
        obj = super().__new__(cls, value)
        obj.detail = detail
        obj.vm = vm
        obj.pod = pod
        return obj


REFUSED_SCALING = {"runner_400": reasons.SCALING_NEEDS_RESTART,
                   "runner_401": reasons.SCALING_NEEDS_RESTART,
                   POD_WITHOUT_TOKEN: reasons.SCALING_NEEDS_RESTART,
                   "no_token": reasons.SCALING_DISABLED}
"""ApplyScale outcomes that asking again cannot change, and the Scaling reason they end in."""

NAMESPACE_TERMINATING_OUTCOME = "namespace_terminating"
"""A create refused because the namespace is being deleted: observed again, the VM
waits (:class:`TerminatingNamespaces`)."""
EFFECTIVE = frozenset({"done", "replaced"})
"""Outcomes of a step that changed something."""
BLOCKED = frozenset({"forbidden", "invalid"})
"""Outcomes that end the reconcile at once as stuck: asking again cannot help."""
PAUSED = frozenset({GUEST_REFUSED})
"""Outcomes that end the reconcile at once as stuck, though asking again later may help:
asked again at once, the answer would be the same (the VM's stuck backoff spaces them).
Every runner outcome of :func:`~neonvm.controller.scaling.asks_again_later` does too
(no answer, a misbehaving runner, a 5xx such as an unplug's 504): each such ``PUT
/scale`` may hold a worker for its whole deadline, so one reconcile sends at most one."""


def paused(outcome: str) -> bool:
    """``outcome`` ends the reconcile stuck at once (see :data:`PAUSED`)."""
    return outcome in PAUSED or asks_again_later(outcome)


class TerminatingNamespaces:
    """Namespaces a create was refused in because they are being deleted, remembered for
    ``remember_seconds`` (a namespace may be re-created under its name; after that, one
    more refused create teaches it again). Shared by a reconciler's workers. See
    docs/reconciler.md, "A namespace being deleted"."""

    def __init__(self, remember_seconds: float = d.NAMESPACE_TERMINATING_RECHECK_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._remember = remember_seconds
        self._clock = clock
        self._learned: dict[str, float] = {}
        self._lock = threading.Lock()

    def learn(self, namespace: str) -> None:
        with self._lock:
            self._learned[namespace] = self._clock()

    def knows(self, namespace: str) -> bool:
        """Whether ``namespace`` was seen being deleted within the remembered time."""
        with self._lock:
            at = self._learned.get(namespace)
            if at is None:
                return False
            if self._clock() - at >= self._remember:
                del self._learned[namespace]
                return False
            return True


def stuck_mutation(update: ConditionUpdate, lease: d.Fence) -> StatusMutation:
    """Write a stuck Degraded condition only on the transition into its reason.

    A VM that stays stuck for the same reason keeps the condition as first written: its
    message names what changes from one attempt to the next (a pod name, an error text,
    counts) and rewriting it on every attempt would produce a watch event that requeues
    the VM at once, bypassing the stuck backoff. Logs and events carry the details."""
    write = conditions_mutation([update], lease)

    def mutate(vm: types.VirtualMachine) -> types.VirtualMachineStatus | None:
        for cond in vm.status.conditions:
            if (cond.type == update.type and cond.status == update.status
                    and cond.reason == update.reason):
                return None
        return write(vm)

    return mutate


def miss_message(kind: type[d.Action], outcome: str, detail: str) -> str:
    """The Degraded message of a step that keeps not taking effect: what and why, no pod
    names or counts (they change between attempts; see :func:`stuck_mutation`)."""
    return (f"{kind.__name__} keeps not taking effect ({outcome}"
            f"{': ' + api_error_text(detail) if detail else ''}); the controller "
            f"retries with backoff")


def controlling_owner_uid(pod: dict[str, Any]) -> str | None:
    """The uid of the pod's controlling owner reference (``controller: true``), if any."""
    refs = (pod.get("metadata") or {}).get("ownerReferences") or []
    return next((str(ref.get("uid")) for ref in refs if ref.get("controller")), None)


def _forbidden_reason(kind: type[d.Action]) -> str:
    """The Degraded reason of an action refused for good (its row's, else generic)."""
    row = ACTIONS.get(kind)
    return (row.forbidden if row is not None else None) or f"{kind.__name__}{NOT_TAKING_EFFECT}"


def _mutation(action: d.Action) -> Callable[..., Any]:
    """The mutation of a VM-writing action's row."""
    mutation = ACTIONS[type(action)].mutation
    assert mutation is not None, f"{type(action).__name__} writes no VM"
    return mutation


def _target(action: d.Action) -> str:
    """What an action acts on, for log lines."""
    if isinstance(action, d.RecordPlan | d.CreatePod):
        return f"runner pod {action.plan.name}"
    name = getattr(action, "name", "")
    return f"runner pod {name}" if name else "the VM"


def _not_ungatable(fresh: VMRecord | None, uid: str, action: d.Ungate) -> str:
    """Why the VM as read now forbids starting ``action``'s pod ('' if it does not)."""
    if fresh is None or fresh.vm.uid != uid:
        return "the VM is gone (or re-created under its name) since the cache saw it"
    if fresh.vm.deletion_timestamp is not None:
        return "the VM is being deleted"
    status = fresh.vm.status
    if status.pod_name != action.name or status.pod_uid != action.uid:
        return f"the VM's committed pod is now {status.pod_name or 'none'}"
    return ""


@dataclass(frozen=True)
class ReconcilerConfig:
    max_steps: int = 30
    """Actions per reconcile before yielding the worker (requeued at once)."""
    resync_seconds: float = 30.0
    """Requeue (with a direct read) of a VM with nothing to do."""
    pod_defaults: podspec.PodDefaults = field(default_factory=podspec.PodDefaults)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    create_failing_after: float = 60.0
    """Seconds transient create failures must last (and at least three in a row) before
    Degraded ``CreateFailing`` says so: a quota that frees up as the old pod terminates
    is not worth a condition."""


@dataclass(frozen=True)
class ReconcileResult:
    """How a reconcile ended: its last decision and when to look again."""

    action: d.Action
    requeue_after: float
    steps: int
    """Actions performed."""
    stuck: str | None = None
    """Set when the reconcile could not converge (the Degraded reason written): the
    caller retries with backoff rather than at ``requeue_after``."""
    seen: Seen | None = None
    """Done or Wait: the versions of the VM and its pods that the last decision saw
    (after its condition write, if any)."""


class Seen(NamedTuple):
    """The object versions a reconcile ended on. A cache holding older ones than these
    is behind what the reconcile already knows: the watch events still on their way
    (our own writes' echoes, mostly) will bring the VM up again."""

    uid: str
    vm: str
    """The VM's resourceVersion."""
    pods: tuple[tuple[str, str], ...]
    """(``namespace/name``, resourceVersion) of each pod."""


def seen_of(record: VMRecord | None, pods: Any) -> Seen | None:
    """The :class:`Seen` of an observation (``pods``: raw pods by name)."""
    if record is None:
        return None
    vm = record.vm
    versions = tuple(
        (f"{vm.namespace}/{name}", str((pod.get("metadata") or {}).get("resourceVersion", "")))
        for name, pod in sorted(pods.items()))
    return Seen(uid=vm.uid, vm=record.resource_version, pods=versions)


class Writer(Protocol):
    """The two conditional writes of a VM (what :class:`Reconciler` writes VMs with)."""

    def put_status(self, record: VMRecord, status: VirtualMachineStatus) -> VMRecord: ...

    def put_main(self, record: VMRecord, finalizers: list[str]) -> VMRecord: ...


StepHook = Callable[[str, str, str], None]
"""Called after each performed step with (VM key, step name, outcome)."""


class Reconciler:
    """Performs :func:`decide`'s actions against the API server, one VM at a time."""

    def __init__(
        self,
        api: client.ApiClient,
        *,
        cluster: Cluster | None = None,
        cache: Observer | None = None,
        writer: Writer | None = None,
        after_step: StepHook | None = None,
        metrics: ControllerMetrics | None = None,
        events: EventRecorder | None = None,
        config: ReconcilerConfig | None = None,
        update: UpdateFunction[VMRecord] = conditional_update,
        on_finalized: Callable[[str], None] | None = None,
        scaling: RunnerScaling | None = None,
        timers: VMTimers | None = None,
        runner_reports: RunnerReports | None = None,
        old_crd_warned: threading.Event | None = None,
        fencing: SelfFencing | None = None,
    ) -> None:
        self.cluster: Cluster = cluster or KubeCluster(api)
        """Every API server call a step makes (reads through :attr:`reader`; the VM
        writes through :attr:`writer`, which is the cluster unless wrapped)."""
        self.reader = DirectReader(self.cluster)
        self.writer: Writer = writer or self.cluster
        self._cache = cache
        self._after_step = after_step
        self._metrics = metrics
        self._events = events or EventRecorder(None)
        self._config = config or ReconcilerConfig()
        self._update = update
        self._on_finalized = on_finalized
        self._scaling = scaling or RunnerScaling(api)
        self.fencing = fencing
        """Self-fencing (``dead_pods`` in each decision's observation); None: off."""
        self.identity = Identity(self.cluster)
        """Who this controller is to the API server (for a 403's message)."""
        self._old_crd = OldCrdWarning(old_crd_warned)
        """Warns once per ``old_crd_warned``: the process's."""
        self.timers = timers or VMTimers()
        self.terminating = TerminatingNamespaces()
        """Namespaces being deleted, learned from refused creates: their VMs plan no pod."""
        self._progress = ProgressEvents(self._events)
        """Per worker thread: the progress events of the reconcile it runs, written as
        one Event when the reconcile ends."""
        self.acceleration = Acceleration(self._config.pod_defaults.kvm_resource,
                                         runner_reports or RunnerReports(),
                                         podspec.RUNNER_PORT)
        """The AccelerationUnavailable condition (its runner GETs never block a step)."""
        """Per VM: transient create failures in a row (shared with the term's handler,
        which drops a gone VM's entries)."""

    # ---- the loop ----------------------------------------------------------------------

    def observe(self, key: str, authority: Authority, direct: bool) -> Snapshot:
        if direct or self._cache is None:
            snap = self.reader.observe(key, authority.lease)
        else:
            snap = self._cache.observe(key, authority.lease)
        return self._scaling.observe(snap)  # the runner's view while a scaling plan is due

    def reconcile(self, key: str, authority: Authority, *,
                  direct_first: bool = False) -> ReconcileResult:
        """Reconcile ``key`` (``namespace/name``) until Done or Wait (or ``max_steps``)."""
        log = logger.bind(vm=key, epoch=authority.lease.epoch, token=authority.lease.token)
        started = time.monotonic()
        result = "error"
        self._progress.begin()
        try:
            try:
                out = self._loop(key, authority, direct_first, log)
                result = type(out.action).__name__.lower()
            except FencedOut as exc:
                if self._metrics:
                    self._metrics.fenced.inc()
                result = "fenced_out"  # if _fenced_ahead ends the term (token ahead)
                seen_in = exc.snap if isinstance(exc, FencedSnapshot) else None
                out = self._fenced_ahead(key, authority, str(exc), log, seen_in)
                result = "fence_ahead"
            return out
        except AuthorityLost:
            result = "authority_lost"
            raise
        finally:
            self._progress.flush()
            if self._metrics:
                self._metrics.reconciles.labels(result=result).inc()
                self._metrics.reconcile_seconds.observe(time.monotonic() - started)

    def _loop(self, key: str, authority: Authority, direct_first: bool,
              log: Any) -> ReconcileResult:
        snap = self.observe(key, authority, direct_first)
        steps = 0
        resumed_counted = False
        misses: Counter[tuple[type[d.Action], str]] = Counter()
        """Steps that did not take effect: (action, outcome). Not by target: a pod name
        changes from one attempt to the next, and the condition must not."""
        details: dict[tuple[type[d.Action], str], str] = {}
        targets: dict[tuple[type[d.Action], str], str] = {}
        performed: Counter[type[d.Action]] = Counter()
        put: tuple[int, str, str] | None = None
        """The reconcile's ``PUT /scale``, once sent: (plan seq, outcome, detail). One
        per reconcile, whatever its answer (:meth:`_after_put`)."""
        # Once here; then once per write, immediately before it (a VM write checks inside
        # the conditional update, on every attempt; a pod write in _perform).
        authority.check()
        while steps < self._config.max_steps:
            self._check_uid(snap, authority)
            action = d.decide(self._fenced(self._with_namespace(snap.obs), snap))
            if snap.from_write and not isinstance(action, SEEN_BY_WRITE):
                log.debug("{action} needs a fresh direct read", action=type(action).__name__)
                snap = self.observe(key, authority, direct=True)
                continue
            if isinstance(action, d.ObserveDirect) or (
                    isinstance(action, d.CreatePod)
                    and not (snap.obs.direct or snap.vm_written)):
                if snap.obs.direct:
                    raise RuntimeError(f"decide asked for a direct read of a direct "
                                       f"observation: {action}")
                log.debug("observing directly: {why}", why=action.reason or "create")
                snap = self.observe(key, authority, direct=True)
                continue
            if isinstance(action, d.Fenced):
                raise FencedSnapshot(f"{key}: {action.reason} (epoch {action.seen_epoch} > "
                                     f"{authority.lease.epoch})", snap)
            trouble = (runner_trouble(snap.obs.runner_error) if isinstance(action, d.Wait)
                       and action.condition == reasons.SCALING_CONDITION else None)
            if trouble is not None:
                # The plan's runner misbehaves, or has not answered for a while: not
                # asked again at decide's pace, but with the stuck backoff (Degraded).
                if not snap.obs.direct:
                    snap = self.observe(key, authority, direct=True)
                    continue
                return self._stuck(key, snap, authority, log, steps, d.ApplyScale, *trouble)
            if isinstance(action, d.Done | d.Wait):
                updates = desired_conditions(snap, action)
                updates += self.acceleration.updates(snap)
                mutation = conditions_mutation(updates, authority.lease)
                assert snap.record is not None or not updates
                record = snap.record
                final = record
                if updates and record is not None and mutation(record.vm) is not None:
                    # From the cache, read directly first; from the answer to our own
                    # write, write them at once: the VM is as stored, and the pod facts
                    # are the ones the write itself relied on (docs/protocol.md, the
                    # table of "Observing from write responses": conditions may be
                    # written from an answer; a stale phase is cosmetic and corrected
                    # by the pod's next watch event).
                    if not snap.obs.direct and not snap.from_write:
                        log.debug("conditions to write ({types}): observing directly",
                                  types=", ".join(u.type for u in updates))
                        snap = self.observe(key, authority, direct=True)
                        continue
                    written = self._write_status(key, snap, mutation, authority, log)
                    final = written
                    if written is not None:
                        self._event_for_wait(action, record.vm, written.vm, log)
                        warn_unimplemented(self._events, record.vm, written.vm)
                        warn_acceleration_unavailable(self._events, record.vm, written.vm)
                requeue = (action.seconds if isinstance(action, d.Wait)
                           else self._config.resync_seconds)
                log.debug("reconciled: {action} ({reason})", action=type(action).__name__,
                          reason=action.reason)
                return ReconcileResult(action=action, requeue_after=requeue, steps=steps,
                                       seen=seen_of(final, snap.pods))
            if isinstance(action, d.ApplyScale) and put is not None:
                return self._after_put(key, snap, authority, log, steps, action, *put)
            if not resumed_counted:
                resumed_counted = True
                row = ACTIONS.get(type(action))
                if row is not None and row.resumes_plan and self._metrics:
                    self._metrics.plans_resumed.inc()
            log.info("{action}: {reason}", action=type(action).__name__, reason=action.reason)
            outcome = self._perform(key, action, snap, authority, log)
            steps += 1
            if self._metrics:
                self._metrics.actions.labels(action=type(action).__name__,
                                             outcome=outcome).inc()
            if self._after_step is not None:
                self._after_step(key, STEP_NAMES[type(action)], str(outcome))
            performed[type(action)] += 1
            if isinstance(action, d.ApplyScale):
                put = (action.plan.seq, str(outcome), getattr(outcome, "detail", ""))
            if outcome not in EFFECTIVE:
                miss = (type(action), str(outcome))
                misses[miss] += 1
                targets[miss] = _target(action)
                if getattr(outcome, "detail", ""):
                    details[miss] = getattr(outcome, "detail", "")
            seen = (self._seen_by_write(snap, outcome, log) if outcome in EFFECTIVE
                    else None)
            snap = seen if seen is not None else self.observe(key, authority, direct=True)
            if paused(outcome):
                detail = getattr(outcome, "detail", "")
                if outcome == RUNNER_MISBEHAVING:
                    return self._stuck(key, snap, authority, log, steps, type(action),
                                       RUNNER_MISBEHAVING_REASON,
                                       f"the VM's runner answers PUT /scale in a way no "
                                       f"runner does ({detail}); its scaling plan is kept "
                                       f"and asked again with backoff")
                return self._stuck(key, snap, authority, log, steps, type(action),
                                   f"{type(action).__name__}{NOT_TAKING_EFFECT}",
                                   miss_message(type(action), str(outcome), detail))
            if outcome in BLOCKED:
                detail = getattr(outcome, "detail", "") or f"{type(action).__name__} refused"
                return self._stuck(key, snap, authority, log, steps, type(action),
                                   _forbidden_reason(type(action)), detail)
        if misses:
            (kind, outcome), times = misses.most_common(1)[0]
            detail = details.get((kind, outcome), "")
            message = miss_message(kind, outcome, detail)
            log.warning("step budget of {n} used: {kind} did not take effect {times} times "
                        "(last on {target})", n=steps, kind=kind.__name__, times=times,
                        target=targets.get((kind, outcome), "?"))
            return self._stuck(key, snap, authority, log, steps, kind,
                               f"{kind.__name__}{NOT_TAKING_EFFECT}", message)
        kind, times = (performed.most_common(1) or [(d.Wait, 0)])[0]
        message = (f"{steps} steps took effect without the VM converging (most often "
                   f"{kind.__name__}, {times} times); the controller retries with backoff")
        return self._stuck(key, snap, authority, log, steps, kind, STEP_BUDGET_EXHAUSTED,
                           message)

    def _with_namespace(self, obs: d.Observation) -> d.Observation:
        """``obs``, saying whether the VM's namespace is known to be being deleted."""
        if obs.vm is None or not self.terminating.knows(obs.vm.namespace):
            return obs
        return replace(obs, namespace_terminating=True)

    def _fenced(self, obs: d.Observation, snap: Snapshot) -> d.Observation:
        """``obs`` with its self-fenced pods (:mod:`neonvm.controller.fencing`)."""
        return self.fencing.observe(obs, dict(snap.pods)) if self.fencing else obs

    def _force_delete(self, key: str, action: d.ForceDeleteDeadPod, snap: Snapshot,
                      authority: Authority, log: Any) -> str:
        assert snap.record is not None
        return force_delete_dead_pod(self.fencing, self.cluster, self._events, action,
                                     snap.record.vm, authority.check, log)

    def _sync_pod_metadata(self, key: str, action: d.SyncPodMetadata, snap: Snapshot,
                           authority: Authority, log: Any) -> str:
        assert snap.record is not None
        return autoscaler_view.sync_pod_metadata(self.cluster, snap.record.vm,
                                                 snap.pods.get(action.name), action.uid, log)

    def _after_put(self, key: str, snap: Snapshot, authority: Authority, log: Any,
                   steps: int, action: d.ApplyScale, seq: int, outcome: str,
                   detail: str) -> ReconcileResult:
        """``decide`` asks for a second ``PUT /scale`` in one reconcile: not sent. The
        runner chooses how long each answer takes (up to the deadline, whatever the
        status), so one reconcile sends at most one, and a worker is held for at most one
        deadline per turn. A new plan since that PUT (the runner had a newer fence: the
        plan was dropped and made again) is progress: looked at again at once. The same
        plan asked again (a 200 the next ``GET /scale`` does not bear out, a 409 or
        another 4xx) ends stuck, with the VM's backoff. docs/reconciler.md, "Fencing"."""
        if action.plan.seq != seq:
            log.debug("plan #{seq} made after this reconcile's PUT: looking again at once",
                      seq=action.plan.seq)
            return ReconcileResult(action=d.Wait(seconds=0.0, reason="one PUT /scale per "
                                                 "reconcile"),
                                   requeue_after=0.0, steps=steps)
        return self._stuck(key, snap, authority, log, steps, d.ApplyScale,
                           f"ApplyScale{NOT_TAKING_EFFECT}",
                           miss_message(d.ApplyScale, outcome, detail))

    def _stuck(self, key: str, snap: Snapshot, authority: Authority, log: Any, steps: int,
               kind: type[d.Action], reason: str, message: str) -> ReconcileResult:
        """End a reconcile that cannot converge: count it, say so in Degraded."""
        step = kind.step or kind.__name__.lower()
        if self._metrics:
            self._metrics.stuck.labels(step=step).inc()
        log.warning("not converging ({reason}): {message}", reason=reason, message=message)
        if snap.record is not None and snap.obs.direct:
            mutation = stuck_mutation(stuck_condition(reason, message), authority.lease)
            if mutation(snap.record.vm) is not None:
                self._write_status(key, snap, mutation, authority, log)
        return ReconcileResult(action=d.Wait(seconds=0.0, reason=message), requeue_after=0.0,
                               steps=steps, stuck=reason)

    def _fenced_ahead(self, key: str, authority: Authority, why: str, log: Any,
                      snap: Snapshot | None = None) -> ReconcileResult:
        """The VM's status carries a fence ahead of ours: leave this VM alone.

        A leader with a higher epoch exists only once our Lease is gone, and then
        ``authority.check()`` fails here (:class:`AuthorityLost`: the term ends through
        the lost-leadership path). If our authority still holds, no newer leader wrote
        that fence: it came from a restore, a user or a bug. Ending the term for it would
        stall every VM (and an epoch past int32 would never be reached), so instead this
        VM alone gets no action but a Degraded condition that leaves fence and plan
        untouched (:func:`~neonvm.controller.conditions.fence_ahead_mutation`, written at
        most once per :data:`FENCE_AHEAD_RECHECK_SECONDS`), a Warning event when written,
        and a look again after :data:`FENCE_AHEAD_RECHECK_SECONDS`.

        That holds for a fence ahead by its *epoch* only. A fence of our own epoch with a
        higher token means the locks' tokens went back (their etcd restored from a
        snapshot or replaced): every VM this term writes is refused the same way, and
        ``decide`` (which fences on the epoch) is not stopped by it. Then
        :class:`~neonvm.controller.mutations.FencedOut` goes on to the manager, which
        ends the term; the next term's higher epoch is ahead of every such fence.

        ``snap``: the observation that was fenced, reused when it was direct.
        """
        authority.check()
        if snap is None or not snap.obs.direct or snap.from_write:
            snap = self.observe(key, authority, direct=True)
        self._check_uid(snap, authority)
        record = snap.record
        lease = authority.lease
        seen = fence_ahead(record.vm, lease) if record is not None else None
        if record is None or seen is None:
            log.info("fenced out ({why}), but the fresh copy is not: looking again", why=why)
            return ReconcileResult(action=d.Wait(seconds=1.0, reason="fence no longer ahead"),
                                   requeue_after=1.0, steps=0)
        if not epoch_ahead(seen, lease):
            raise FencedOut(f"{key}: status.fence (epoch {seen[0]}, token {seen[1]}) is ahead "
                            f"of (epoch {lease.epoch}, token {lease.token}) by its token only: "
                            f"the locks' tokens went back; a new term's epoch clears it")
        message = fence_ahead_message(seen, lease,
                                      fence_ahead_field(record.vm, lease) or "status.fence")
        log.error("VM fenced ahead of this leader, left alone: {msg}", msg=message)
        outcome = self._update_vm(
            key, snap,
            lambda rec: fence_ahead_mutation(
                lease, quiet_seconds=FENCE_AHEAD_RECHECK_SECONDS)(rec.vm),
            self.writer.put_status, authority)
        if outcome.written:
            self._events.record(record.vm, FENCE_AHEAD, message, warning=True)
        action = d.Wait(seconds=FENCE_AHEAD_RECHECK_SECONDS, condition=FENCE_AHEAD,
                        reason=message)
        return ReconcileResult(action=action, requeue_after=FENCE_AHEAD_RECHECK_SECONDS,
                               steps=0)

    def _check_uid(self, snap: Snapshot, authority: Authority) -> None:
        vm = snap.obs.vm
        if vm is not None and authority.vm_uid is not None and vm.uid != authority.vm_uid:
            raise WrongVM(f"{vm.key}: lock taken for uid {authority.vm_uid}, VM is {vm.uid}")

    def _seen_by_write(self, snap: Snapshot, outcome: str, log: Any) -> Snapshot | None:
        """The next observation, from the API server's answer to the write that just took
        effect, or None: read directly (docs/protocol.md, "Observing from write
        responses").

        The VM is the written one when the write was the VM's (a conditional PUT answers
        with the object as stored, at a revision after everything the decision read), else
        the one already observed; the pods are the ones already observed, with a written
        pod (created, or ungated) replaced by the API server's answer. The observation
        stays direct only if the one it extends was. None (read again) when there is no
        answer to build from, when the written pod is not labelled for the VM (a list
        would not show it), or when the VM commits a pod not among those pods (only a
        read by name can tell whether it is gone)."""
        written_vm: VMRecord | None = getattr(outcome, "vm", None)
        written_pod: dict[str, Any] | None = getattr(outcome, "pod", None)
        if written_vm is None and written_pod is None:
            return None
        record = written_vm if written_vm is not None else snap.record
        if record is None:
            return None
        vm = record.vm
        pods = dict(snap.pods)
        if written_pod is not None:
            if not labelled_for(written_pod, vm.name):
                return None
            pods[(written_pod.get("metadata") or {}).get("name", "")] = written_pod
        if vm.status.pod_name and vm.status.pod_name not in pods:
            return None
        listed = list(pods.values())
        missing: tuple[str, ...] = ()
        vm_written = written_vm is not None
        if (snap.obs.direct or vm_written) and create_due(vm, listed):
            missing = self.reader.missing_pull_secrets(vm)
        log.debug("observing from the write's response")
        return make_snapshot(record, listed, snap.obs.lease, direct=snap.obs.direct,
                             now=self.reader.now(), missing_pull_secrets=missing,
                             from_write=True, vm_written=vm_written)

    # ---- actions -----------------------------------------------------------------------

    def _perform(self, key: str, action: d.Action, snap: Snapshot, authority: Authority,
                 log: Any) -> str:
        """Perform one action by its row in :data:`ACTIONS`; "done" when it took effect,
        else why not. A pod write checks the authority first (a VM write checks inside its
        conditional update)."""
        row = ACTIONS.get(type(action))
        if row is None:
            raise RuntimeError(f"no performer for {action!r}")
        if row.writes in ("pod", "runner"):
            authority.check()
        return row.perform(self, key, action, snap, authority, log)

    def _status_write(self, key: str, action: d.Action, snap: Snapshot,
                      authority: Authority, log: Any) -> str:
        """The performer of a status write: its mutation
        (:func:`~neonvm.controller.mutations.status_mutation`), PUT conditionally."""
        mutation = with_ready(_mutation(action)(action, authority.lease), snap)
        written = self._write_status(key, snap, mutation, authority, log)
        if written is not None:
            self._event_for(action, written.vm)
            return Outcome("done", vm=written)
        return "declined"

    def _update_vm(self, key: str, snap: Snapshot,
                   mutate: Callable[[VMRecord], Any],
                   write: Callable[[VMRecord, Any], VMRecord],
                   authority: Authority) -> UpdateOutcome[VMRecord]:
        assert snap.record is not None
        namespace, name = split_key(key)

        decided_for = snap.record.vm.uid

        def guarded(record: VMRecord) -> Any:
            authority.check()
            if record.vm.uid != decided_for:
                # A conflict's re-read found the VM re-created under the same name: the
                # change was decided for the old one, and must not land on the new one.
                return None
            return mutate(record)

        def on_conflict(_n: int) -> None:
            if self._metrics:
                self._metrics.conflicts.inc()

        return self._update(
            snap.record, guarded, write, lambda: self.reader.get_vm(namespace, name),
            policy=self._config.retry, on_conflict=on_conflict,
        )

    def _write_status(self, key: str, snap: Snapshot,
                      mutation: Callable[[Any], VirtualMachineStatus | None],
                      authority: Authority, log: Any) -> VMRecord | None:
        sent: list[VirtualMachineStatus] = []

        def keeping_what_is_sent(record: VMRecord) -> VirtualMachineStatus | None:
            new = mutation(record.vm)
            sent[:] = [new] if new is not None else []
            return new

        outcome = self._update_vm(key, snap, keeping_what_is_sent, self.writer.put_status,
                                  authority)
        if outcome.conflicts:
            log.info("status write absorbed {n} conflict(s); written={w}",
                     n=outcome.conflicts, w=outcome.written)
        written = outcome.obj if outcome.written else None
        if (written is not None and sent and sent[0].scale_look_pod_uid
                and not written.vm.status.scale_look_pod_uid):
            self._old_crd.warn(log)  # sent, and not in the answer: pruned
        return written

    def _finalizer_write(self, key: str, action: d.Action, snap: Snapshot,
                         authority: Authority, log: Any) -> str:
        mutation = _mutation(action)(action)
        outcome = self._update_vm(key, snap, lambda rec: mutation(rec.vm), self.writer.put_main,
                                  authority)
        if not outcome.written:
            return "declined"
        if isinstance(action, d.RemoveFinalizer):
            assert snap.record is not None
            self._events.record(snap.record.vm, "Finalized",
                                "all runner pods are gone; finalizer removed")
            if self._on_finalized is not None:
                self._on_finalized(key)
            return "done"
        return Outcome("done", vm=outcome.obj)

    def _event_for(self, action: d.Action, vm: types.VirtualMachine) -> None:
        """The event of an action that took effect (its row's ``event``), on ``vm`` as
        written."""
        row = ACTIONS.get(type(action))
        event = row.event(action, vm) if row is not None and row.event is not None else None
        if event is not None:
            self._progress.record(vm, event.reason, event.message, warning=event.warning)

    def _event_for_wait(self, action: d.Action, before: types.VirtualMachine,
                        after: types.VirtualMachine, log: Any) -> None:
        """A Warning event when a VM starts waiting for a missing image pull secret."""
        if not (isinstance(action, d.Wait) and action.condition == reasons.PULL_SECRET_NOT_FOUND):
            return
        was = next((c for c in before.status.conditions if c.type == DEGRADED), None)
        if was is not None and was.status == "True" and was.reason == reasons.PULL_SECRET_NOT_FOUND:
            return
        log.warning("{reason}", reason=action.reason)
        self._events.record(after, reasons.PULL_SECRET_NOT_FOUND, action.reason, warning=True)

    def _create_pod(self, key: str, action: d.CreatePod, snap: Snapshot,
                    authority: Authority, log: Any) -> str:
        assert snap.record is not None
        vm = snap.record.vm
        # The pod mounts the VM's scaling token (also a self-fencing runner's bearer).
        secret = self._scaling.create_token(
            vm, wanted=podspec.fencing_eligible(vm, self._config.pod_defaults))
        recorded: VMRecord | None = None
        if secret is not None:
            replacing = vm.status.scaling_token_secret_uid or ""
            recorded = self._write_status(key, snap, token_secret_mutation(
                *secret, authority.lease, replacing=replacing), authority, log)
            if recorded is None:
                # Another token was recorded first (or the write was declined): build
                # the pod only from a VM that names the Secret it will mount.
                self._scaling.discard_token(vm.namespace, secret[0])
                return "precondition"
            vm = recorded.vm
        try:
            manifest = podspec.runner_pod(vm, action.plan, self._config.pod_defaults)
        except podspec.PodSpecError as exc:
            self._refuse(key, snap, str(exc), authority, log)
            return "refused"
        name = action.plan.name
        try:
            created = self.cluster.create_pod(vm.namespace, manifest)
        except ApiException as exc:
            message = api_error_message(exc)
            if namespace_terminating(exc.status, message):
                # Not retried: the namespace and its VMs are going. The next decision
                # (from a direct read) waits, and so does every VM of this namespace.
                self.timers.create_answered(key)
                self.terminating.learn(vm.namespace)
                log.info("namespace {ns} is being deleted: no runner pod is created "
                         "there", ns=vm.namespace)
                return NAMESPACE_TERMINATING_OUTCOME
            kind = classify_create_error(exc.status, message)
            if kind == "retry":
                self._create_failed(key, snap, name, f"{exc.status}: {message}", authority, log)
                raise RetryableError(f"create {name}: {exc.status}: {message}") from exc
            self.timers.create_answered(key)
            if kind == "exists":
                return self._name_taken(key, action, snap, authority, log)
            if exc.status == 403 and FENCE_CREATOR_RULE in message:
                return Outcome("forbidden", self.identity.forbidden_detail(
                    f"create runner pod {name}", message))
            self._refuse(key, snap, f"creating runner pod {name} was refused "
                                    f"({exc.status}): {api_error_text(message)}",
                         authority, log)
            return "refused"
        except (HTTPError, OSError) as exc:  # no answer: connection refused, timeout
            message = f"{type(exc).__name__}: {exc}"
            self._create_failed(key, snap, name, message, authority, log)
            raise RetryableError(f"create {name}: {message}") from exc
        self.timers.create_answered(key)
        meta = created.get("metadata") or {}
        if not podspec.has_our_gate(created):
            self._gate_stripped(key, snap, meta, authority, log)
            return "gate_stripped"
        self._progress.record(vm, "Created", f"runner pod {action.plan.name} created (gated)")
        if self._metrics:
            self._metrics.lifecycle.runner_created(snap.record.raw, created)
        # The token's status write (if any) is the newest VM we know: the next step's CAS
        # must start from it, not from the record it replaced.
        return Outcome("done", pod=created, vm=recorded)

    def _create_failed(self, key: str, snap: Snapshot, name: str, error: str,
                       authority: Authority, log: Any) -> None:
        """A transient create failure: after a few in a row, say so in Degraded (the
        create is still retried with backoff; the condition clears once a reconcile ends
        normally)."""
        failures, lasted = self.timers.create_failed(key)
        if (failures < CREATE_FAILURES_BEFORE_CONDITION or snap.record is None
                or lasted < self._config.create_failing_after):
            return
        update = stuck_condition(CREATE_FAILING,
                                 f"creating runner pod {name} keeps failing (retried with "
                                 f"backoff); last error: {api_error_text(error)}")
        try:
            # Written on the transition only: the message keeps its first error.
            self._write_status(key, snap, stuck_mutation(update, authority.lease),
                               authority, log)
        except (ApiException, HTTPError, OSError) as exc:
            log.debug("could not record CreateFailing: {err}", err=exc)

    def _apply_scale(self, key: str, action: d.ApplyScale, snap: Snapshot,
                     authority: Authority, log: Any) -> str:
        """The performer of ApplyScale: the runner's ``PUT /scale`` with the plan's fence.

        A refusal that asking again cannot change (the runner's 400 or 401, no token to
        sign with) drops the plan with the Scaling condition saying why
        (:data:`~neonvm.controller.reasons.SCALING_REFUSED`): the VM runs on at its size,
        and the next spec change tries again. The authority is checked again as soon as
        the PUT returns (it may have taken its whole deadline); a failure at the runner
        ends the reconcile stuck (:func:`paused`)."""
        outcome = self._scaling.apply(action, snap, log)
        # A PUT may have taken the whole deadline: whatever follows (a drop, a Degraded
        # write, another step) is decided under an authority checked after it.
        authority.check()
        refused = REFUSED_SCALING.get(str(outcome))
        if refused is None:
            return outcome
        # A pod built without a token refuses every PUT: nothing of the plan can land,
        # so its drop asks for no look (one that could never end).
        drop = d.DropScale(seq=action.plan.seq, refused=refused,
                           reason=getattr(outcome, "detail", "") or str(outcome),
                           starts_look=str(outcome) != POD_WITHOUT_TOKEN)
        written = self._write_status(key, snap, status_mutation(drop, authority.lease),
                                     authority, log)
        if written is not None:
            self._events.record(written.vm, refused, drop.reason, warning=True)
        return Outcome("refused", drop.reason)

    def _name_taken(self, key: str, action: d.CreatePod, snap: Snapshot,
                    authority: Authority, log: Any) -> str:
        """AlreadyExists. A pod labelled for this VM shows up in the next observation and
        :func:`decide` adopts it only if it carries this plan's fence annotations (epoch
        and token, written by our create alone), else drops the plan: a pod planted under
        the predictable name is never committed. A pod *not* labelled for it never does
        (observations list by label), so the driver drops the plan itself, as decide
        would on seeing a pod that is not ours: a new plan gets a new name."""
        assert snap.record is not None
        vm = snap.record.vm
        name = action.plan.name
        pod = self.reader.get_pod(vm.namespace, name)
        labels = ((pod or {}).get("metadata") or {}).get("labels") or {}
        if pod is None or labels.get(types.LABEL_VM_NAME) == vm.name:
            log.info("pod {pod} already exists: observing again", pod=name)
            return "exists"
        drop = d.DropPlan(name=name, reason=f"the name {name} is taken by a pod that is not "
                                            f"labelled for this VM")
        log.warning("{reason}: dropping plan #{seq}", reason=drop.reason,
                    seq=action.plan.plan_seq)
        written = self._write_status(key, snap, status_mutation(drop, authority.lease),
                                     authority, log)
        if written is not None:
            self._event_for(drop, written.vm)
        return "name_taken"

    def _gate_stripped(self, key: str, snap: Snapshot, meta: dict[str, Any],
                       authority: Authority, log: Any) -> None:
        """ALARM: the create response lacks our gate. Delete the pod before it can run."""
        assert snap.record is not None
        name, uid = meta.get("name", ""), meta.get("uid", "")
        if self._metrics:
            self._metrics.gate_stripped.inc()
        log.error("ALARM: runner pod {pod} was created without the scheduling gate "
                  "{gate}; deleting it", pod=name, gate=types.SCHEDULING_GATE)
        self._events.record(snap.record.vm, "GateStripped",
                            f"runner pod {name} came back without the scheduling gate "
                            f"{types.SCHEDULING_GATE} (a webhook or feature gate removed "
                            f"it); deleted", warning=True)
        self._delete(snap.record.vm.namespace, name, uid, log)
        self._refuse(key, snap, f"runner pod {name} was created without the scheduling gate "
                                f"{types.SCHEDULING_GATE}; something strips it",
                     authority, log, event=False)

    def _refuse(self, key: str, snap: Snapshot, message: str, authority: Authority,
                log: Any, event: bool = True) -> None:
        """Record the refusal as Degraded for this generation: no retry until it changes."""
        assert snap.record is not None
        vm = snap.record.vm
        if self._metrics:
            self._metrics.create_refused.inc()
        if event:
            self._events.record(vm, "CreateRefused", message, warning=True)
        update: ConditionUpdate = refused_condition(message, vm.generation)
        self._write_status(key, snap, conditions_mutation([update], authority.lease),
                           authority, log)

    def _ungate(self, key: str, action: d.Ungate, snap: Snapshot, authority: Authority,
                log: Any) -> str:
        """Remove our gate, guarded by a fresh direct list and a test-and-remove patch."""
        assert snap.record is not None
        vm = snap.record.vm
        listed = self.reader.list_pods(vm.namespace, vm.name)  # after the commit was seen
        # The VM's pods as the observation saw them: the committed pod is read by name
        # when the labelled list misses it.
        pods = self.reader.with_committed(vm.namespace, listed, action.name, action.uid)
        unlabelled = [p for p in pods if not labelled_for(p, vm.name)]
        if unlabelled:
            return self._replace_unlabelled(vm, unlabelled[0], action, log)
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
            why = _not_ungatable(self.reader.get_vm(vm.namespace, vm.name), vm.uid, action)
            if why:
                log.info("not ungating {pod}: {why}", pod=action.name, why=why)
                return Outcome("precondition", why)
        try:
            patched = self.cluster.ungate_pod(
                vm.namespace, action.name, uid=action.uid,
                resource_version=meta.get("resourceVersion") or "", gate_index=index)
        except ApiException as exc:
            if exc.status in (404, 409, 422):
                log.info("ungate of {pod} refused ({status}: {msg}): observing again",
                         pod=action.name, status=exc.status, msg=api_error_message(exc))
                return Outcome("precondition", f"{exc.status}: {api_error_message(exc)}")
            if exc.status == 403:
                return Outcome("forbidden", self.identity.forbidden_detail(
                    f"remove the scheduling gate of runner pod {action.name}",
                    api_error_message(exc)))
            raise
        self._progress.record(vm, "Started", f"runner pod {action.name} ungated: it is the "
                                           f"VM's only pod")
        return Outcome("done", pod=patched if isinstance(patched, dict) else None)

    def _replace_unlabelled(self, vm: types.VirtualMachine, pod: dict[str, Any],
                            action: d.Ungate, log: Any) -> str:
        """The committed pod lost its runner label (possible only with the admission
        policy off). It is still the VM's pod, yet no label-selected list would show it,
        so a later ungate of another pod could not see it: it must never run. Still gated
        it never ran, so delete it [uid, resourceVersion]; the next observation finds it
        gone and the VM restarts with a new, labelled pod."""
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
            self.cluster.delete_pod(vm.namespace, action.name, uid=action.uid,
                                    resource_version=meta.get("resourceVersion"))
        except ApiException as exc:
            if exc.status in (404, 409):
                return Outcome("precondition", f"{exc.status}: {api_error_message(exc)}")
            raise
        self._events.record(vm, "RunnerUnlabelled", message, warning=True)
        return Outcome("replaced")

    def _delete(self, namespace: str, name: str, uid: str, log: Any) -> bool:
        try:
            self.cluster.delete_pod(namespace, name, uid=uid)
        except ApiException as exc:
            if exc.status in (404, 409):
                log.info("pod {pod} ({uid}) already gone or replaced", pod=name, uid=uid)
                return False
            raise
        return True

    def _delete_pod(self, key: str, action: d.DeletePod, snap: Snapshot,
                    authority: Authority, log: Any) -> str:
        assert snap.record is not None
        vm = snap.record.vm
        if not self._delete(vm.namespace, action.name, action.uid, log):
            return "gone"
        self._events.record(vm, "Deleted", f"runner pod {action.name}: {action.reason}")
        return "done"


# ---- the actions: one row each ------------------------------------------------------------


class Event(NamedTuple):
    """A Kubernetes event on the VM: reason, message, and whether it is a Warning."""

    reason: str
    message: str
    warning: bool = False


def _planned(action: d.RecordPlan, vm: types.VirtualMachine) -> Event:
    p = action.plan
    return Event("Planned", f"plan #{p.plan_seq}: runner pod {p.name} "
                            f"(epoch {p.epoch}, token {p.token})")


def _committed(action: d.Commit, vm: types.VirtualMachine) -> Event:
    return Event("Committed", f"runner pod {action.name} committed")


def _plan_dropped(action: d.DropPlan, vm: types.VirtualMachine) -> Event:
    return Event("PlanDropped", action.reason, warning=True)


def _restarted(action: d.Restart, vm: types.VirtualMachine) -> Event:
    if action.terminal_phase is None:
        return Event("Restarting", f"{action.reason}; restart #{vm.status.restart_count} "
                                   f"(restartPolicy {vm.spec.restart_policy})")
    return Event(vm.status.phase or "Stopped", f"{action.reason}; not restarted "
                                               f"(restartPolicy {vm.spec.restart_policy})")


LOOK_GIVEN_UP = "ScaleLookGivenUp"
"""Warning event reason: the look after a dropped scaling plan ended unsettled
(:data:`~neonvm.controller.looks.LOOK_GIVE_UP_SECONDS`)."""


def _look_given_up(action: d.CommitScale, vm: types.VirtualMachine) -> Event | None:
    if not action.gives_up:
        return None
    logger.bind(vm=vm.key).warning("{reason}", reason=action.reason)
    return Event(LOOK_GIVEN_UP, action.reason, warning=True)


@dataclass(frozen=True)
class ActionRow:
    """How the driver performs one action type, and what it says when it took effect.

    Every field but the last two is required: a row that leaves one out does not load."""

    perform: Callable[..., str]
    """A :class:`Reconciler` method ``(self, key, action, snap, authority, log)``: returns
    "done" when the action took effect, else why not (an :class:`Outcome`)."""
    writes: Literal["status", "main", "pod", "runner"]
    """What it writes: the VM's ``/status``, the VM's main resource, a pod, or the
    committed pod's runner (live scaling's ``PUT /scale``, then the pod's usage
    annotation and in-place resize)."""
    mutation: Callable[..., Any] | None
    """What a VM write changes, re-run on the fresh copy on every conflict:
    :func:`~neonvm.controller.mutations.status_mutation` for a status write,
    :func:`~neonvm.controller.mutations.finalizers_mutation` for the main resource;
    None for a pod or a runner call."""
    event: Callable[[Any, types.VirtualMachine], Event | None] | None
    """The event recorded once a status write took effect, from the VM as written (None:
    none, or a pod action that records its own where it happens)."""
    seen_by_write: bool
    """Whether the loop acts on this decision when it comes from an observation built
    from a write response (docs/protocol.md, "Observing from write responses"); False:
    only from a fresh direct read (the dangerous ones: Restart, DeletePod,
    RemoveFinalizer)."""
    forbidden: str | None = None
    """The Degraded reason when the API server refuses the action for good (403)."""
    resumes_plan: bool = False
    """Performed first in a reconcile, it continues a plan recorded earlier (counted in
    ``neonvm_controller_plans_resumed_total``)."""

    def __post_init__(self) -> None:
        if (self.mutation is None) != (self.writes in ("pod", "runner")):
            raise ValueError(f"a {self.writes} row takes a mutation exactly when it "
                             f"writes the VM")


ACTIONS: dict[type[d.Action], ActionRow] = {
    d.RecordPlan: ActionRow(Reconciler._status_write, "status", status_mutation,
                            event=_planned, seen_by_write=True),
    d.CreatePod: ActionRow(Reconciler._create_pod, "pod", None, event=None,
                           seen_by_write=True, forbidden=CREATE_FORBIDDEN,
                           resumes_plan=True),
    d.Commit: ActionRow(Reconciler._status_write, "status", status_mutation,
                        event=_committed, seen_by_write=True, resumes_plan=True),
    d.Ungate: ActionRow(Reconciler._ungate, "pod", None, event=None,
                        # its performer takes its own direct pod list before the patch
                        seen_by_write=True, forbidden=UNGATE_FORBIDDEN),
    d.DeletePod: ActionRow(Reconciler._delete_pod, "pod", None, event=None,
                           seen_by_write=False),
    d.Restart: ActionRow(Reconciler._status_write, "status", status_mutation,
                         event=_restarted, seen_by_write=False),
    d.AddFinalizer: ActionRow(Reconciler._finalizer_write, "main", finalizers_mutation,
                              event=None, seen_by_write=True),
    d.SyncStatus: ActionRow(Reconciler._status_write, "status", status_mutation,
                            event=None, seen_by_write=True),
    d.RemoveFinalizer: ActionRow(Reconciler._finalizer_write, "main", finalizers_mutation,
                                 event=None, seen_by_write=False),
    d.DropPlan: ActionRow(Reconciler._status_write, "status", status_mutation,
                          event=_plan_dropped, seen_by_write=True, resumes_plan=True),
    d.PlanScale: ActionRow(Reconciler._status_write, "status", status_mutation,
                           event=None, seen_by_write=False),
    d.ApplyScale: ActionRow(Reconciler._apply_scale, "runner", None, event=None,
                            seen_by_write=False),
    d.CommitScale: ActionRow(Reconciler._status_write, "status", status_mutation,
                             event=_look_given_up, seen_by_write=False),
    d.DropScale: ActionRow(Reconciler._status_write, "status", status_mutation,
                           event=None, seen_by_write=False),
    d.ForceDeleteDeadPod: ActionRow(Reconciler._force_delete, "pod", None, event=None,
                                    seen_by_write=False),
    d.SyncPodMetadata: ActionRow(Reconciler._sync_pod_metadata, "pod", None, event=None,
                                 seen_by_write=False),
}
"""Every action the driver performs: the one table (its ``step`` is on the class).

Adding an action: its class in :mod:`~neonvm.controller.decide` (with a ``step``), and its
row here: performer, what it writes, mutation, event, whether a write's answer may
decide it. The ``crash_after`` fault steps, the crash campaign's steps, the explorer's
write kinds and :data:`SEEN_BY_WRITE` derive from these. A new row goes last: the rows'
order is the order the campaign's schedules cycle through
(:data:`neonvm.drills.schedule.CRASH_STEPS`)."""

SEEN_BY_WRITE: tuple[type[d.Action], ...] = (
    d.Done, d.Wait, d.ObserveDirect, d.Fenced,
    *(kind for kind, row in ACTIONS.items() if row.seen_by_write),
)
"""The decisions the loop acts on when they come from an observation built from a write
response: the ones that perform nothing, and the rows marked ``seen_by_write``. Every
other one is taken only from a fresh direct read (docs/protocol.md)."""

STEP_NAMES: dict[type[d.Action], str] = {kind: kind.step for kind in ACTIONS}
"""Step name per performed action type (derived: each class's ``step``)."""
