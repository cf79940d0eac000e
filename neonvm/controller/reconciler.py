"""The driver: observe, decide, perform, until the decision is Done or Wait; then the
conditions.

:meth:`Reconciler.reconcile` runs one VM's reconcile under an :class:`Authority` (the
leader epoch E and the VM lock's fencing token T). Each round it observes, asks the pure
:func:`~neonvm.controller.decide.decide` for the next single action, and performs exactly
that action by its row in :data:`~neonvm.controller.action_table.ACTIONS` (the performers
are :mod:`neonvm.controller.performers`). The first observation may come from the cache;
after a write that took effect the next one is built from the API server's answer
(:meth:`Reconciler._seen_by_write`), acted on only for the decisions of
:data:`~neonvm.controller.action_table.SEEN_BY_WRITE`; otherwise it reads directly.

Authority is checked when the reconcile starts and then once per write, immediately
before it. A reconcile that cannot converge ends *stuck* (Degraded, retried with
backoff); a VM fenced ahead of us is left alone (:meth:`Reconciler._fenced_ahead`).
Queueing, locking and leader election are not here (:mod:`neonvm.controller.manager`).
The loop, step by step: docs/reconciler.md, "The loop"; why it is safe: docs/protocol.md.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from loguru import logger

from neonvm.controller import actions as act
from neonvm.controller import decide as d
from neonvm.controller import podspec, reasons, too_large
from neonvm.controller.acceleration import (
    Acceleration,
    RunnerReports,
    warn_acceleration_unavailable,
)
from neonvm.controller.action_table import ACTIONS, SEEN_BY_WRITE, STEP_NAMES
from neonvm.controller.authority import Authority, AuthorityLost, FencedSnapshot, WrongVM
from neonvm.controller.cluster import Cluster, VMRecord
from neonvm.controller.compat_events import warn_unimplemented
from neonvm.controller.conditions import (
    api_error_text,
    conditions_mutation,
    desired_conditions,
    epoch_ahead,
    fence_ahead,
    fence_ahead_field,
    fence_ahead_message,
    fence_ahead_mutation,
    stuck_condition,
    stuck_mutation,
    too_large_mutation,
)
from neonvm.controller.crd_warning import OldCrdWarning
from neonvm.controller.events import EventRecorder
from neonvm.controller.fencing import SelfFencing
from neonvm.controller.identity import Identity
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.mutations import FencedOut
from neonvm.controller.observe import (
    DirectReader,
    Observer,
    Snapshot,
    create_due,
    labelled_for,
    make_snapshot,
)
from neonvm.controller.progress import ProgressEvents
from neonvm.controller.reasons import (
    DEGRADED,
    FENCE_AHEAD,
    NOT_TAKING_EFFECT,
    RUNNER_MISBEHAVING_REASON,
    STEP_BUDGET_EXHAUSTED,
)
from neonvm.controller.scaling import (
    GUEST_REFUSED,
    RUNNER_MISBEHAVING,
    RunnerScaling,
    asks_again_later,
    runner_trouble,
)
from neonvm.controller.step import (
    Step,
    StepContext,
    StepHook,
    TerminatingNamespaces,
    Writer,
    update_vm,
    write_status,
)
from neonvm.controller.timers import VMTimers
from neonvm.controller.update import RetryPolicy, UpdateFunction, conditional_update

FENCE_AHEAD_RECHECK_SECONDS = 300.0
"""How soon a VM fenced ahead of a valid leader is looked at again (a change to the VM,
such as an operator's fix of status.fence, is seen at once through the watch)."""

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


def miss_message(kind: type[act.Action], outcome: str, detail: str) -> str:
    """The Degraded message of a step that keeps not taking effect: what and why, no pod
    names or counts (they change between attempts; see
    :func:`~neonvm.controller.conditions.stuck_mutation`)."""
    return (f"{kind.__name__} keeps not taking effect ({outcome}"
            f"{': ' + api_error_text(detail) if detail else ''}); the controller "
            f"retries with backoff")


def _forbidden_reason(kind: type[act.Action]) -> str:
    """The Degraded reason of an action refused for good (its row's, else generic)."""
    row = ACTIONS.get(kind)
    return (row.forbidden if row is not None else None) or f"{kind.__name__}{NOT_TAKING_EFFECT}"


def _target(action: act.Action) -> str:
    """What an action acts on, for log lines."""
    if isinstance(action, act.RecordPlan | act.CreatePod):
        return f"runner pod {action.plan.name}"
    name = getattr(action, "name", "")
    return f"runner pod {name}" if name else "the VM"


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

    action: act.Action
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


@dataclass
class _Tally:
    """What one reconcile's steps came to, for how it ends."""

    steps: int = 0
    resumed_counted: bool = False
    misses: Counter[tuple[type[act.Action], str]] = field(default_factory=Counter)
    """Steps that did not take effect: (action, outcome). Not by target: a pod name
    changes from one attempt to the next, and the condition must not."""
    details: dict[tuple[type[act.Action], str], str] = field(default_factory=dict)
    targets: dict[tuple[type[act.Action], str], str] = field(default_factory=dict)
    performed: Counter[type[act.Action]] = field(default_factory=Counter)
    put: tuple[int, str, str] | None = None
    """The reconcile's ``PUT /scale``, once sent: (plan seq, outcome, detail). One per
    reconcile, whatever its answer (:meth:`Reconciler._after_put`)."""

    def add(self, action: act.Action, outcome: str) -> None:
        self.steps += 1
        self.performed[type(action)] += 1
        if isinstance(action, act.ApplyScale):
            self.put = (action.plan.seq, str(outcome), getattr(outcome, "detail", ""))
        if outcome not in EFFECTIVE:
            miss = (type(action), str(outcome))
            self.misses[miss] += 1
            self.targets[miss] = _target(action)
            if getattr(outcome, "detail", ""):
                self.details[miss] = getattr(outcome, "detail", "")


class Reconciler:
    """Performs :func:`decide`'s actions against the API server, one VM at a time.

    Its clients come in built: ``cluster`` (every API server call of a step; the shipped
    one is :class:`~neonvm.controller.cluster.KubeCluster`) and ``scaling`` (the runners'
    ``/scale``); the composition root is :class:`~neonvm.controller.manager.LeaderTerm`."""

    def __init__(
        self,
        cluster: Cluster,
        scaling: RunnerScaling,
        *,
        cache: Observer | None = None,
        writer: Writer | None = None,
        after_step: StepHook | None = None,
        metrics: ControllerMetrics | None = None,
        events: EventRecorder | None = None,
        config: ReconcilerConfig | None = None,
        update: UpdateFunction[VMRecord] = conditional_update,
        on_finalized: Callable[[str], None] | None = None,
        timers: VMTimers | None = None,
        runner_reports: RunnerReports,
        old_crd_warned: threading.Event | None = None,
        fencing: SelfFencing | None = None,
    ) -> None:
        events = events or EventRecorder(None)  # none: the events are dropped
        self._config = config or ReconcilerConfig()
        self.ctx = StepContext(
            cluster=cluster, reader=DirectReader(cluster), writer=writer or cluster,
            events=events, progress=ProgressEvents(events), config=self._config,
            update=update, scaling=scaling, timers=timers or VMTimers(),
            terminating=TerminatingNamespaces(), identity=Identity(cluster),
            old_crd=OldCrdWarning(old_crd_warned), metrics=metrics, fencing=fencing,
            on_finalized=on_finalized)
        """What the performers work with (:mod:`neonvm.controller.step`)."""
        self._cache = cache
        self._after_step = after_step
        self._metrics = metrics
        self.acceleration = Acceleration(self._config.pod_defaults.kvm_resource,
                                         runner_reports,
                                         podspec.RUNNER_PORT)
        """The AccelerationUnavailable condition (its runner GETs never block a step)."""

    @property
    def cluster(self) -> Cluster:
        """Every API server call a step makes."""
        return self.ctx.cluster

    @property
    def reader(self) -> DirectReader:
        """The direct (quorum) reads, through :attr:`cluster`."""
        return self.ctx.reader

    @property
    def writer(self) -> Writer:
        """The VM's conditional writes: :attr:`cluster`, unless wrapped."""
        return self.ctx.writer

    # ---- the loop ----------------------------------------------------------------------

    def observe(self, key: str, authority: Authority, direct: bool) -> Snapshot:
        if direct or self._cache is None:
            snap = self.reader.observe(key, authority.lease)
        else:
            snap = self._cache.observe(key, authority.lease)
        return self.ctx.scaling.observe(snap)  # the runner's view while a scaling plan is due

    def reconcile(self, key: str, authority: Authority, *,
                  direct_first: bool = False) -> ReconcileResult:
        """Reconcile ``key`` (``namespace/name``) until Done or Wait (or ``max_steps``)."""
        log = logger.bind(vm=key, epoch=authority.lease.epoch, token=authority.lease.token)
        started = time.monotonic()
        result = "error"
        self.ctx.progress.begin()
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
            self.ctx.progress.flush()
            if self._metrics:
                self._metrics.reconciles.labels(result=result).inc()
                self._metrics.reconcile_seconds.observe(time.monotonic() - started)

    def _loop(self, key: str, authority: Authority, direct_first: bool,
              log: Any) -> ReconcileResult:
        """Observe, decide, perform, until Done or Wait (docs/reconciler.md, "The loop")."""
        snap = self.observe(key, authority, direct_first)
        tally = _Tally()
        # Once here; then once per write, immediately before it (a VM write checks inside
        # the conditional update, on every attempt; a pod write in _perform).
        authority.check()
        while tally.steps < self._config.max_steps:
            self._check_uid(snap, authority)
            if (oversized := too_large.verdict(snap)) == too_large.READ_DIRECTLY:
                snap = self.observe(key, authority, direct=True)
                continue
            if isinstance(oversized, int):
                return self._too_large(key, snap, authority, log, tally.steps, oversized)
            obs = self._fenced(self._with_namespace(snap.obs, log), snap)
            action = d.decide(obs)
            if self._wants_direct_read(snap, action, log):
                snap = self.observe(key, authority, direct=True)
                continue
            if isinstance(action, act.Fenced):
                raise FencedSnapshot(f"{key}: {action.reason} (epoch {action.seen_epoch} > "
                                     f"{authority.lease.epoch})", snap)
            if (d.replaces_a_pod(action) and obs.vm is not None
                    and self.ctx.terminating.look(obs.vm.namespace,
                                                  self.cluster.namespace_meta, log)):
                action = d.decide(replace(obs, namespace_terminating=True))
            trouble = (runner_trouble(snap.obs.runner_error) if isinstance(action, act.Wait)
                       and action.condition == reasons.SCALING_CONDITION else None)
            if trouble is not None:
                # The plan's runner misbehaves, or has not answered for a while: not
                # asked again at decide's pace, but with the stuck backoff (Degraded).
                if not snap.obs.direct:
                    snap = self.observe(key, authority, direct=True)
                    continue
                return self._stuck(key, snap, authority, log, tally.steps, act.ApplyScale,
                                   *trouble)
            if isinstance(action, act.Done | act.Wait):
                done = self._finish(key, snap, action, authority, log, tally.steps)
                if done is None:  # conditions to write, decided from the cache
                    snap = self.observe(key, authority, direct=True)
                    continue
                return done
            if isinstance(action, act.ApplyScale) and tally.put is not None:
                return self._after_put(key, snap, authority, log, tally.steps, action,
                                       *tally.put)
            outcome = self._act(key, action, snap, authority, log, tally)
            seen = (self._seen_by_write(snap, outcome, log) if outcome in EFFECTIVE
                    else None)
            snap = seen if seen is not None else self.observe(key, authority, direct=True)
            if paused(outcome) or outcome in BLOCKED:
                return self._refused(key, snap, authority, log, tally.steps, action, outcome)
        return self._budget_used(key, snap, authority, log, tally)

    def _wants_direct_read(self, snap: Snapshot, action: act.Action, log: Any) -> bool:
        """Whether ``action`` may be taken only from a direct read that ``snap`` is not:
        a decision outside :data:`SEEN_BY_WRITE` on a write's answer, ObserveDirect, and
        a create from the cache."""
        if snap.from_write and not isinstance(action, SEEN_BY_WRITE):
            log.debug("{action} needs a fresh direct read", action=type(action).__name__)
            return True
        if isinstance(action, act.ObserveDirect) or (
                isinstance(action, act.CreatePod)
                and not (snap.obs.direct or snap.vm_written)):
            if snap.obs.direct:
                raise RuntimeError(f"decide asked for a direct read of a direct "
                                   f"observation: {action}")
            log.debug("observing directly: {why}", why=action.reason or "create")
            return True
        return False

    def _act(self, key: str, action: act.Action, snap: Snapshot, authority: Authority,
             log: Any, tally: _Tally) -> str:
        """Perform one action, count it and tell the step hook."""
        if not tally.resumed_counted:
            tally.resumed_counted = True
            row = ACTIONS.get(type(action))
            if row is not None and row.resumes_plan and self._metrics:
                self._metrics.plans_resumed.inc()
        log.info("{action}: {reason}", action=type(action).__name__, reason=action.reason)
        outcome = self._perform(key, action, snap, authority, log)
        if self._metrics:
            self._metrics.actions.labels(action=type(action).__name__,
                                         outcome=outcome).inc()
        if self._after_step is not None:
            self._after_step(key, STEP_NAMES[type(action)], str(outcome))
        tally.add(action, outcome)
        return outcome

    def _perform(self, key: str, action: act.Action, snap: Snapshot, authority: Authority,
                 log: Any) -> str:
        """Perform one action by its row in :data:`ACTIONS`; "done" when it took effect,
        else why not. A pod write checks the authority first (a VM write checks inside its
        conditional update)."""
        row = ACTIONS.get(type(action))
        if row is None:
            raise RuntimeError(f"no performer for {action!r}")
        if row.writes in ("pod", "runner"):
            authority.check()
        return row.perform(self.ctx, Step(key, action, snap, authority, log, row))

    def _finish(self, key: str, snap: Snapshot, action: act.Done | act.Wait,
                authority: Authority, log: Any, steps: int) -> ReconcileResult | None:
        """Done or Wait: bring the conditions up to date, and say when to look again;
        None when they must be written from a direct read first."""
        updates = desired_conditions(snap, action)
        updates += self.acceleration.updates(snap)
        mutation = conditions_mutation(updates, authority.lease)
        assert snap.record is not None or not updates
        record = snap.record
        final = record
        if updates and record is not None and mutation(record.vm) is not None:
            # From the cache, read directly first; from the answer to our own write,
            # write them at once: the VM is as stored, and the pod facts are the ones the
            # write itself relied on (docs/protocol.md, the table of "Observing from write
            # responses": conditions may be written from an answer; a stale phase is
            # cosmetic and corrected by the pod's next watch event).
            if not snap.obs.direct and not snap.from_write:
                log.debug("conditions to write ({types}): observing directly",
                          types=", ".join(u.type for u in updates))
                return None
            written = write_status(self.ctx, key, snap, mutation, authority, log)
            final = written
            if written is not None:
                self._event_for_wait(action, record.vm, written.vm, log)
                events = self.ctx.events
                warn_unimplemented(events, record.vm, written.vm)
                warn_acceleration_unavailable(events, record.vm, written.vm)
        requeue = (action.seconds if isinstance(action, act.Wait)
                   else self._config.resync_seconds)
        log.debug("reconciled: {action} ({reason})", action=type(action).__name__,
                  reason=action.reason)
        return ReconcileResult(action=action, requeue_after=requeue, steps=steps,
                               seen=seen_of(final, snap.pods))

    def _event_for_wait(self, action: act.Action, before: Any, after: Any, log: Any) -> None:
        """A Warning event when a VM starts waiting for a missing image pull secret."""
        if not (isinstance(action, act.Wait) and action.condition == reasons.PULL_SECRET_NOT_FOUND):
            return
        was = next((c for c in before.status.conditions if c.type == DEGRADED), None)
        if was is not None and was.status == "True" and was.reason == reasons.PULL_SECRET_NOT_FOUND:
            return
        log.warning("{reason}", reason=action.reason)
        self.ctx.events.record(after, reasons.PULL_SECRET_NOT_FOUND, action.reason,
                               warning=True)

    def _refused(self, key: str, snap: Snapshot, authority: Authority, log: Any, steps: int,
                 action: act.Action, outcome: str) -> ReconcileResult:
        """A step refused in a way that asking again at once cannot change: stuck."""
        kind = type(action)
        detail = getattr(outcome, "detail", "")
        if paused(outcome):
            if outcome == RUNNER_MISBEHAVING:
                return self._stuck(key, snap, authority, log, steps, kind,
                                   RUNNER_MISBEHAVING_REASON,
                                   f"the VM's runner answers PUT /scale in a way no "
                                   f"runner does ({detail}); its scaling plan is kept "
                                   f"and asked again with backoff")
            return self._stuck(key, snap, authority, log, steps, kind,
                               f"{kind.__name__}{NOT_TAKING_EFFECT}",
                               miss_message(kind, str(outcome), detail))
        return self._stuck(key, snap, authority, log, steps, kind, _forbidden_reason(kind),
                           detail or f"{kind.__name__} refused")

    def _budget_used(self, key: str, snap: Snapshot, authority: Authority, log: Any,
                     tally: _Tally) -> ReconcileResult:
        """``max_steps`` used without Done or Wait: stuck, naming the step that most often
        did not take effect (or the one performed most, if every step did)."""
        steps = tally.steps
        if tally.misses:
            (kind, outcome), times = tally.misses.most_common(1)[0]
            detail = tally.details.get((kind, outcome), "")
            message = miss_message(kind, outcome, detail)
            log.warning("step budget of {n} used: {kind} did not take effect {times} times "
                        "(last on {target})", n=steps, kind=kind.__name__, times=times,
                        target=tally.targets.get((kind, outcome), "?"))
            return self._stuck(key, snap, authority, log, steps, kind,
                               f"{kind.__name__}{NOT_TAKING_EFFECT}", message)
        kind, times = (tally.performed.most_common(1) or [(act.Wait, 0)])[0]
        message = (f"{steps} steps took effect without the VM converging (most often "
                   f"{kind.__name__}, {times} times); the controller retries with backoff")
        return self._stuck(key, snap, authority, log, steps, kind, STEP_BUDGET_EXHAUSTED,
                           message)

    def _with_namespace(self, obs: act.Observation, log: Any) -> act.Observation:
        """``obs``, saying whether the VM's namespace is known to be being deleted (what
        was learned longer ago than it is trusted is read again first)."""
        if obs.vm is None:
            return obs
        namespace, known = obs.vm.namespace, self.ctx.terminating
        if known.predates(namespace, obs.vm.creation_timestamp):
            known.forget(namespace)  # made after that deletion began: the name's new namespace
        if known.knows(namespace) or (
                known.stale(namespace)
                and known.look(namespace, self.cluster.namespace_meta, log)):
            return replace(obs, namespace_terminating=True)
        return obs

    def _fenced(self, obs: act.Observation, snap: Snapshot) -> act.Observation:
        """``obs`` with its self-fenced pods (:mod:`neonvm.controller.fencing`)."""
        fencing = self.ctx.fencing
        return fencing.observe(obs, dict(snap.pods)) if fencing else obs

    def _after_put(self, key: str, snap: Snapshot, authority: Authority, log: Any,
                   steps: int, action: act.ApplyScale, seq: int, outcome: str,
                   detail: str) -> ReconcileResult:
        """``decide`` asks for a second ``PUT /scale`` in one reconcile: not sent (one per
        reconcile, whatever its answer). A plan made since that PUT is looked at again at
        once; the same plan asked again ends stuck, with the VM's backoff
        (docs/reconciler.md, "Reconciles that cannot converge")."""
        if action.plan.seq != seq:
            log.debug("plan #{seq} made after this reconcile's PUT: looking again at once",
                      seq=action.plan.seq)
            return ReconcileResult(action=act.Wait(seconds=0.0, reason="one PUT /scale per "
                                                 "reconcile"),
                                   requeue_after=0.0, steps=steps)
        return self._stuck(key, snap, authority, log, steps, act.ApplyScale,
                           f"ApplyScale{NOT_TAKING_EFFECT}",
                           miss_message(act.ApplyScale, outcome, detail))

    def _stuck(self, key: str, snap: Snapshot, authority: Authority, log: Any, steps: int,
               kind: type[act.Action], reason: str, message: str) -> ReconcileResult:
        """End a reconcile that cannot converge: count it, say so in Degraded."""
        step = kind.step or kind.__name__.lower()
        if self._metrics:
            self._metrics.stuck.labels(step=step).inc()
        log.warning("not converging ({reason}): {message}", reason=reason, message=message)
        if snap.record is not None and snap.obs.direct:
            mutation = stuck_mutation(stuck_condition(reason, message), authority.lease)
            if mutation(snap.record.vm) is not None:
                write_status(self.ctx, key, snap, mutation, authority, log)
        return ReconcileResult(action=act.Wait(seconds=0.0, reason=message), requeue_after=0.0,
                               steps=steps, stuck=reason)

    def _too_large(self, key: str, snap: Snapshot, authority: Authority, log: Any,
                   steps: int, size: int) -> ReconcileResult:
        """Leave a VM too large to cache alone: Degraded ``ObjectTooLarge`` (written from
        a direct read, on the transition), and Done, so that its next look starts from
        the cache, where its stub carries the mark (neonvm/controller/too_large.py)."""
        message = too_large.message(size)
        if snap.obs.direct and snap.record is not None:
            mutation = too_large_mutation(message, authority.lease)
            if mutation(snap.record.vm) is not None:
                log.warning("left alone: {message}", message=message)
                write_status(self.ctx, key, snap, mutation, authority, log)
        return ReconcileResult(action=act.Done(reason=message),
                               requeue_after=self._config.resync_seconds, steps=steps)

    def _fenced_ahead(self, key: str, authority: Authority, why: str, log: Any,
                      snap: Snapshot | None = None) -> ReconcileResult:
        """The VM's status carries a fence ahead of ours. Authority lost: the term ends
        (:class:`AuthorityLost`). Still held and ahead by its epoch: no newer leader wrote
        it, so this VM alone is marked Degraded (``FenceAhead``) and left alone for
        :data:`FENCE_AHEAD_RECHECK_SECONDS`. Ahead by its token only (the locks' tokens
        went back): :class:`~neonvm.controller.mutations.FencedOut` ends the term.
        docs/reconciler.md, "Fencing"; ``snap``: the fenced observation, reused if direct.
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
            return ReconcileResult(action=act.Wait(seconds=1.0, reason="fence no longer ahead"),
                                   requeue_after=1.0, steps=0)
        if not epoch_ahead(seen, lease):
            raise FencedOut(f"{key}: status.fence (epoch {seen[0]}, token {seen[1]}) is ahead "
                            f"of (epoch {lease.epoch}, token {lease.token}) by its token only: "
                            f"the locks' tokens went back; a new term's epoch clears it")
        message = fence_ahead_message(seen, lease,
                                      fence_ahead_field(record.vm, lease) or "status.fence")
        log.error("VM fenced ahead of this leader, left alone: {msg}", msg=message)
        outcome = update_vm(
            self.ctx, key, snap,
            lambda rec: fence_ahead_mutation(
                lease, quiet_seconds=FENCE_AHEAD_RECHECK_SECONDS)(rec.vm),
            self.writer.put_status, authority)
        if outcome.written:
            self.ctx.events.record(record.vm, FENCE_AHEAD, message, warning=True)
        action = act.Wait(seconds=FENCE_AHEAD_RECHECK_SECONDS, condition=FENCE_AHEAD,
                        reason=message)
        return ReconcileResult(action=action, requeue_after=FENCE_AHEAD_RECHECK_SECONDS,
                               steps=0)

    def _check_uid(self, snap: Snapshot, authority: Authority) -> None:
        vm = snap.obs.vm
        if vm is not None and authority.vm_uid is not None and vm.uid != authority.vm_uid:
            raise WrongVM(f"{vm.key}: lock taken for uid {authority.vm_uid}, VM is {vm.uid}")

    def _seen_by_write(self, snap: Snapshot, outcome: str, log: Any) -> Snapshot | None:
        """The next observation, built from the API server's answer to the write that just
        took effect (the written VM or pod replaces its copy in ``snap``; direct only if
        ``snap`` was), or None: read directly, when there is no answer, the written pod is
        not labelled for the VM, or the VM commits a pod not among those known
        (docs/protocol.md, "Observing from write responses")."""
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
