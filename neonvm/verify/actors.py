"""The actors of the model: controller workers (a model driver around the shipped code),
the pod lifecycle, the user, and the faults. :meth:`Actors.successors` is every step any
of them can take from a state; the explorer takes all of them.

The **model driver** is what docs/protocol.md prescribes for the real driver, one server call
per step so that anything may happen between two calls:

* observe: from the cache (any version the cache may hold, see :mod:`.model`), or
  directly: a quorum LIST of the VM's pods, then (next step) a quorum GET of the VM,
  then (next step, only if ``status.podName`` is missing from the list) a GET of that
  pod; then ask the shipped :func:`~neonvm.controller.decide.decide` for the next
  action (with ``now=None``: no restart backoff, time is not modelled);
* after a write that took effect (VM PUT, pod create, ungate patch), the next
  observation is the write's answer laid over the observation the write was decided
  from (direct if that one was), decided in the same step; a decision outside the
  shipped driver's ``SEEN_BY_WRITE`` is taken again from a direct read, and so is one
  whose VM commits a pod not among the known pods (``Reconciler._seen_by_write``);
* a pod create is performed only when decided from a direct observation, or from the
  answer to the worker's own VM write (the VM as stored: a quorum state; the pods are
  those the write was decided from);
* status writes: PUT ``/status`` with the ``resourceVersion`` the decision was made from;
  on 409 re-read directly and call the shipped mutation again on the fresh copy;
* finalizer writes: the same on the main resource;
* create: exactly the recorded name, gated, owner-referenced; AlreadyExists means
  observe again, directly;
* ungate: first a direct LIST that must show exactly this pod (same uid, not
  terminating); then a patch with uid + resourceVersion preconditions;
* delete: with a uid precondition;
* force-delete (``ForceDeleteDeadPod``): a direct GET of the pod, then (next step) a
  DELETE with ``gracePeriodSeconds: 0`` and the uid and that read's version as
  preconditions; the pod is gone at once. Never decided here: these observations have
  no rights ledger, so ``dead_pods`` is empty. When it is decided (and that the guest is
  dead by then) is the timed explorer's (:mod:`neonvm.verify.fencing`,
  ``tests/test_explore_fencing.py``);
* the lock: before observing, a worker that does not hold the VM's lock takes it (or
  takes it over from a lower epoch) and stops if a higher epoch holds it; a worker that
  sees the VM gone (directly) deletes the lock and halts; the leader sweeps a lock left
  behind for the gone VM.

A worker checks its lock only between actions: a write already decided is performed
whenever the worker is scheduled again, which is how a paused leader that wakes up after
losing its lease behaves. Deposed leaders (zombies) run the full loop with their old
epoch and lock token until a higher epoch stops them, which they may postpone forever.

**Breakages** (:data:`BREAKAGES`) are deliberate bugs in the model driver, switchable by
name, to prove that the checker catches them. They live here only; nothing shipped has a
switch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from neonvm.controller.action_table import ACTIONS, SEEN_BY_WRITE
from neonvm.controller.decide import plan_name
from neonvm.verify.model import (
    FENCED_OUT,
    LEADER,
    NODE,
    STANDBY,
    VM,
    ZOMBIE,
    Budget,
    Lock,
    Plan,
    Pod,
    ShippedCode,
    Status,
    Worker,
    World,
    deleted,
    describe_action,
    pod_by_name,
    pod_by_uid,
    replace_pod,
    set_worker,
    to_api_vm,
    write_pods,
    write_vm,
)

BREAKAGES: dict[str, str] = {
    "blind_retry": "on 409 the retry re-reads only to get the fresh resourceVersion and "
                   "writes the result computed from the object it first read (the seed's "
                   "retry: writes back what it read, over someone else's write)",
    "noop_retry": "on 409 the retry re-reads and writes back exactly what it read, "
                  "reporting success (the seed's retry taken literally: the intent is lost)",
    "create_before_record": "on RecordPlan, create the pod first and record the plan after",
    "cached_ungate": "ungate from a cached pod list, without the direct list check",
    "ungate_without_precondition": "the ungate patch names the pod but carries no uid or "
                                   "resourceVersion precondition",
    "delete_without_uid": "delete pods by name, without the uid precondition",
    "no_lock_sweep": "never delete the lock of a VM found gone (no release, no sweep)",
    "adopt_without_fence": "observe ignores the pods' fence annotations: a pod under the "
                           "planned name counts as the plan's own (adoption on the name "
                           "alone)",
    "create_from_cache": "create the planned pod from any observation, a stale cached VM "
                         "included (the shipped driver creates only from a direct one or "
                         "from the answer to its own VM write)",
    "adopt_any_fence": "a pod under the planned name that is owned by the VM and carries "
                       "some fence annotations counts as the plan's own, whatever their "
                       "(epoch, token)",
}

STATUS_WRITES = frozenset(kind.__name__ for kind, row in ACTIONS.items()
                          if row.writes == "status")
"""Actions the model performs as a PUT of ``/status`` with the shipped mutation (from the
shipped driver's action table: a new status write needs nothing here)."""
FINALIZER_WRITES = frozenset(kind.__name__ for kind, row in ACTIONS.items()
                             if row.writes == "main")
"""Actions the model performs as a PUT of the main resource with the shipped mutation."""
SEEN_BY_WRITE_NAMES = frozenset(kind.__name__ for kind in SEEN_BY_WRITE)
"""Decisions the driver acts on from an observation built from a write's response (the
shipped driver's tuple); any other one is taken again from a direct read."""
RUNNER_ACTIONS = frozenset(kind.__name__ for kind, row in ACTIONS.items()
                           if row.writes == "runner")
"""Calls to the committed pod's runner (live scaling's ApplyScale): modelled by the
scaling explorer (:mod:`neonvm.verify.scaling`), not here (this world's VMs never change
size)."""
POD_ACTIONS = frozenset({"CreatePod", "Ungate", "DeletePod", "SyncPodMetadata",
                         "ForceDeleteDeadPod"})
"""Pod actions, each modelled by hand below (create, prelist + patch, delete, GET + force
delete): a new pod action needs its model here (``test_explore`` checks that every row
has one)."""


@dataclass(frozen=True)
class Config:
    """What the model does (not how far the search goes: see :class:`~.explore.Bounds`)."""

    history: int = 2
    """Past versions a cache may lag behind (per object kind)."""
    locks: bool = True
    """Lease and per-VM lock on. Off: every worker acts as leader with the same epoch and
    no lock (safety must hold even then)."""
    read_committed_pod: bool = True
    """A direct observation whose pod list lacks ``status.podName`` GETs that pod by name
    after the VM read and adds it if it has ``status.podUID`` (docs/protocol.md step 4: only a
    direct GET proves a pod gone), as ``DirectReader.observe`` does since eabc9e7.
    False models the driver before that: the list, taken before the VM read, was all,
    and a pod created and committed between the two reads looked gone (found by this
    explorer; docs/verification.md)."""
    breakages: frozenset[str] = frozenset()

    def broken(self, name: str) -> bool:
        return name in self.breakages


class Step(NamedTuple):
    """One atomic step: who did what (``args`` for replay), and what came of it."""

    actor: str
    kind: str
    args: tuple[Any, ...]
    text: str


def _idle(x: Worker, need_direct: bool = False) -> Worker:
    return x._replace(pc="idle", need_direct=need_direct, listed=None, action=None,
                      base_fresh=False, obs_vm=None, target=None, blind=False, seen=None,
                      seen_direct=False)


_set = set_worker


def _parked(x: Worker, pc: str) -> Worker:
    """A worker that will not read again (stopped, halted): only who it was remains."""
    return Worker(role=x.role, epoch=x.epoch, token=x.token, pc=pc)


def _spend(w: World, **kw: int) -> World:
    b = w.budget._asdict()
    for k, v in kw.items():
        b[k] -= v
    return w._replace(budget=Budget(**b))


def _fresh_worker(role: str, epoch: int, lag_vm: int, lag_pods: int) -> Worker:
    return Worker(role=role, epoch=epoch, token=0, pc="idle", lag_vm=lag_vm, lag_pods=lag_pods)


def calm(w: World) -> World:
    """The state with every fault and adversary switched off, for the liveness check.

    Deposed leaders never run again (their in-flight writes are dropped), no more faults
    or user actions, caches are caught up. In lock-off mode the first worker is the
    leader and the others stop.
    """
    leader_seen = False
    workers = []
    for x in w.workers:
        if x.role == LEADER and not leader_seen:
            leader_seen = True
            workers.append(x._replace(lag_vm=0, lag_pods=0))
        else:
            workers.append(Worker(role=STANDBY, epoch=0, token=0, pc="idle"))
    return w._replace(vm_hist=(), pod_hist=(), workers=tuple(workers), budget=Budget())


class Actors:
    """Every step from a state: workers, pod lifecycle, user, faults."""

    def __init__(self, cfg: Config, code: ShippedCode | None = None) -> None:
        self.cfg = cfg
        self.code = code or ShippedCode()
        for name in cfg.breakages:
            if name not in BREAKAGES:
                raise ValueError(f"unknown breakage {name!r}; known: {', '.join(BREAKAGES)}")

    # ---- all steps ---------------------------------------------------------------------

    def successors(self, w: World) -> list[tuple[Step, World]]:
        out: list[tuple[Step, World]] = []
        for i, x in enumerate(w.workers):
            if x.role != STANDBY:
                out.extend(self.worker_steps(w, i, latest_only=False))
        out.extend(self.environment_steps(w))
        out.extend(self.adversary_steps(w))
        return out

    def calm_leader_step(self, w: World) -> tuple[Step, World] | None:
        """The fair leader's next step in a calm state (caches current: deterministic)."""
        for i, x in enumerate(w.workers):
            if x.role == LEADER:
                steps = list(self.worker_steps(w, i, latest_only=True))
                return steps[0] if steps else None
        return None

    # ---- the controller worker (model driver) -------------------------------------------

    def worker_steps(self, w: World, i: int, latest_only: bool) -> Iterator[tuple[Step, World]]:
        x = w.workers[i]
        me = f"c{i}({x.role} e{x.epoch})"
        pc = x.pc
        if pc == "stopped":
            return
        if pc == "halt":
            if x.role == LEADER and w.lock is not None and not self.cfg.broken("no_lock_sweep"):
                yield (Step(me, "sweep", (), f"{me}: sweep the lock of the deleted VM"),
                       w._replace(lock=None))
            return
        if pc == "idle":
            if self.cfg.locks and not (x.token and w.lock == Lock(x.epoch, x.token)):
                yield self._acquire(w, i, me)
                return
            if latest_only:
                if x.need_direct:
                    yield self._list(w, i, me)
                else:
                    yield self._observe_cached(w, i, me, 0, 0, None)
                return
            yield self._list(w, i, me)
            if not x.need_direct:
                yield from self._observe_cached_all(w, i, me)
            return
        if pc == "get":
            yield self._get(w, i, me)
        elif pc == "getpod":
            yield self._get_pod(w, i, me)
        elif pc == "act":
            yield self._act(w, i, me)
        elif pc == "retry":
            yield self._retry(w, i, me)
        elif pc == "precreate":
            yield self._precreate(w, i, me)
        elif pc in ("prelist", "prelist_cache"):
            yield self._prelist(w, i, me)
        elif pc == "vmread":
            yield self._vmread(w, i, me)
        elif pc == "patch":
            yield self._patch(w, i, me)
        elif pc == "forcedelete":
            yield self._force_delete(w, i, me)
        elif pc == "sweep":
            yield (Step(me, "sweep", (), f"{me}: VM gone: delete its lock"),
                   _set(w._replace(lock=None), i, _parked(x, "halt")))
        else:  # pragma: no cover - a model bug
            raise AssertionError(f"unknown pc {pc}")

    def _acquire(self, w: World, i: int, me: str) -> tuple[Step, World]:
        x = w.workers[i]
        lock = w.lock
        if x.role == ZOMBIE and x.token and (lock is not None or x.retook):
            # Lost lock means stop at once. A deposed leader that finds the key gone
            # (expired) may take it once more with its old epoch: it still believes it
            # leads. Twice would only repeat the same states with a higher token.
            return (Step(me, "lock", (), f"{me}: lost the lock: stop"),
                    _set(w, i, _parked(x, "stopped")))
        if lock is None or lock.epoch < x.epoch:
            rev = w.lock_rev + 1
            what = "take over" if lock else "take"
            retook = x.retook or (x.role == ZOMBIE and x.token != 0)
            return (Step(me, "lock", (rev,), f"{me}: {what} the VM lock, token {rev}"),
                    _set(w._replace(lock=Lock(x.epoch, rev), lock_rev=rev), i,
                         x._replace(token=rev, retook=retook)))
        if lock.epoch == x.epoch:
            return (Step(me, "lock", (lock.token,), f"{me}: the lock is ours (token {lock.token})"),
                    _set(w, i, x._replace(token=lock.token)))
        return (Step(me, "lock", (), f"{me}: lock held by epoch {lock.epoch}: stop"),
                _set(w, i, _parked(x, "stopped")))

    def _list(self, w: World, i: int, me: str) -> tuple[Step, World]:
        x = w.workers[i]
        return (Step(me, "list", (), f"{me}: LIST pods directly ({len(w.pods)})"),
                _set(w, i, x._replace(pc="get", listed=w.pods, lag_pods=0)))

    def _get(self, w: World, i: int, me: str) -> tuple[Step, World]:
        x = w.workers[i]
        assert x.listed is not None
        vm = w.vm
        if (self.cfg.read_committed_pod and vm is not None and vm.status.pod_name
                and pod_by_name(x.listed, vm.status.pod_name) is None):
            return (Step(me, "get", ("getpod",), f"{me}: GET VM directly: "
                         f"{vm.status.pod_name} not in the list: read it"),
                    _set(w, i, x._replace(pc="getpod", obs_vm=vm, lag_vm=0, base_fresh=True)))
        return self._decided(w, i, me, x._replace(lag_vm=0), vm, x.listed, True, True,
                             "GET VM directly")

    def _get_pod(self, w: World, i: int, me: str) -> tuple[Step, World]:
        """GET the committed pod directly (after the VM read): present means not gone."""
        x = w.workers[i]
        assert x.listed is not None and x.obs_vm is not None
        name = x.obs_vm.status.pod_name
        assert name is not None
        pod = pod_by_name(w.pods, name)
        uid = x.obs_vm.status.pod_uid
        ours = pod is not None and bool(uid) and pod.uid == uid
        listed = tuple(sorted((*x.listed, pod))) if ours and pod is not None else x.listed
        what = f"GET pod {name} directly: " + (f"uid {pod.uid}" if pod else "404")
        return self._decided(w, i, me, x._replace(listed=None), x.obs_vm, listed, True,
                             x.base_fresh, what)

    def _observe_cached_all(self, w: World, i: int, me: str) -> Iterator[tuple[Step, World]]:
        x = w.workers[i]
        for j in range(x.lag_vm + 1):
            for k in range(x.lag_pods + 1):
                yield self._observe_cached(w, i, me, j, k, None)
                if w.budget.dropped_event > 0:
                    pods = w.pods if k == 0 else w.pod_hist[-k]
                    for p in pods:
                        yield self._observe_cached(w, i, me, j, k, p)

    def _observe_cached(self, w: World, i: int, me: str, j: int, k: int,
                        dropped: Pod | None) -> tuple[Step, World]:
        x = w.workers[i]
        vm = w.vm if j == 0 else w.vm_hist[-j]
        pods = w.pods if k == 0 else w.pod_hist[-k]
        what = "read the cache" + (f" (VM {j} versions old)" if j else "") + (
            f" (pods {k} versions old)" if k else "")
        if dropped is not None:
            pods = tuple(p for p in pods if p is not dropped)
            what += f" (missing {dropped.name}: lost event)"
            w = _spend(w, dropped_event=1)
        return self._decided(w, i, me, x._replace(lag_vm=j, lag_pods=k), vm, pods, False,
                             j == 0, what, (j, k, dropped.uid if dropped else None))

    def _decided(self, w: World, i: int, me: str, x: Worker, vm: Any, pods: tuple[Pod, ...],
                 direct: bool, base_fresh: bool, what: str,
                 read: tuple[Any, ...] = (), from_write: bool = False,
                 vm_written: bool = False) -> tuple[Step, World]:
        """Observation made: ask the shipped decide() and set up the action.

        ``from_write``: the observation is a write's response (the written VM, or the
        observed VM with the written pod, and the pods of the observation the write was
        decided from); a decision outside :data:`SEEN_BY_WRITE_NAMES` is not acted on but
        taken again from a direct read, as the driver does. ``vm_written``: that VM is
        the answer to this worker's own VM write (``Snapshot.vm_written``)."""
        kind = "get" if direct else "observe"
        if vm is None:
            if direct:
                sweep = w.lock is not None and not self.cfg.broken("no_lock_sweep")
                pc = "sweep" if sweep else "halt"
                return (Step(me, kind, (None, *read), f"{me}: {what}: VM gone"),
                        _set(w, i, _parked(x, pc) if pc == "halt" else _idle(x)._replace(pc=pc)))
            return (Step(me, kind, (None, *read), f"{me}: {what}: VM not in cache"),
                    _set(w, i, _idle(x, need_direct=True)))
        lease = (x.epoch, x.token)
        if self.cfg.broken("adopt_without_fence") and vm.status.pending is not None:
            plan = vm.status.pending
            pods = tuple(p._replace(fence=(plan.epoch, plan.token)) if p.name == plan.name
                         else p for p in pods)
        if self.cfg.broken("adopt_any_fence") and vm.status.pending is not None:
            plan = vm.status.pending
            pods = tuple(p._replace(fence=(plan.epoch, plan.token))
                         if p.name == plan.name and p.owner == vm.uid and p.fence is not None
                         else p for p in pods)
        a = self.code.decide(vm, pods, lease, direct)
        name = a[0]
        text = f"{me}: {what} → decide: {describe_action(a)}"
        step = Step(me, kind, (a, *read), text)
        if from_write and name not in SEEN_BY_WRITE_NAMES:
            return (step._replace(text=f"{text}: needs a direct read"),
                    _set(w, i, _idle(x, need_direct=True)))
        if name in ("Done", "Wait"):
            return step, _set(w, i, _idle(x))
        creatable = direct or vm_written or self.cfg.broken("create_from_cache")
        if name == "ObserveDirect" or (name == "CreatePod" and not creatable):
            # The driver creates only from a direct observation or from the answer to
            # its own VM write (reconciler._loop).
            return step, _set(w, i, _idle(x, need_direct=True))
        if name == "Fenced":
            # The driver leaves this VM alone (no pod action, no plan write) and looks
            # again later; whether it may go on at all is the lock check before that look
            # (reconciler: fenced-ahead VMs are Degraded, the term goes on).
            return step, _set(w, i, _idle(x, need_direct=True))
        x = x._replace(action=a, lease=lease, base_fresh=base_fresh, obs_vm=vm, listed=None,
                       need_direct=False, seen=pods, seen_direct=direct)
        if name == "Ungate":
            if not direct and self.cfg.broken("cached_ungate"):
                target = pod_by_uid(pods, a[2])
                return (step._replace(text=f"{text}; BROKEN: ungate {a[1]} from the cached "
                                           f"list"),
                        _set(w, i, x._replace(pc="patch", target=target)))
            # Decided from the cache, the driver also reads the VM after its list
            # (performers.ungate): "prelist_cache" goes through "vmread".
            fresh_vm = direct or vm_written
            return step, _set(w, i, x._replace(pc="prelist" if fresh_vm else "prelist_cache"))
        if name == "RecordPlan" and self.cfg.broken("create_before_record"):
            return step, _set(w, i, x._replace(pc="precreate"))
        return step, _set(w, i, x._replace(pc="act"))

    # ---- writes ------------------------------------------------------------------------

    def _act(self, w: World, i: int, me: str) -> tuple[Step, World]:
        x = w.workers[i]
        assert x.action is not None
        name = x.action[0]
        desc = describe_action(x.action)
        if name in STATUS_WRITES or name in FINALIZER_WRITES:
            return self._vm_write(w, i, me, desc)
        if name == "ForceDeleteDeadPod":
            return self._force_read(w, i, me, desc)
        if name == "CreatePod":
            return self._create(w, i, me, x.action[1], desc, then=_idle(x))
        if name == "DeletePod":
            return self._delete(w, i, me, x.action[1], x.action[2], desc)
        if name == "SyncPodMetadata":
            # Only the VM's copied labels and annotations (never the controller's own
            # vm.neon.tech/ keys): nothing this world models (pods, gates, phases, the
            # VM) changes.
            return (Step(me, "write", (x.action, "ok"), f"{me}: PATCH pod metadata {desc}"),
                    _set(w, i, _idle(x)))
        raise AssertionError(f"no write for {name}")  # pragma: no cover

    def _vm_write(self, w: World, i: int, me: str, desc: str) -> tuple[Step, World]:
        x = w.workers[i]
        assert x.action is not None
        vm = w.vm
        target = "/status" if x.action[0] in STATUS_WRITES else "VM"
        if vm is None:
            return (Step(me, "write", (x.action, "404"), f"{me}: PUT {target} {desc} → 404"),
                    _set(w, i, _idle(x)))
        if not x.base_fresh:
            # The helper computes the change from the copy the decision saw before it
            # writes; a change that is already moot is never sent.
            assert x.obs_vm is not None
            early = self._change(x, x.obs_vm)
            if early is None or early == FENCED_OUT:
                return self._declined(w, i, me, target, desc, early)
            return (Step(me, "write", (x.action, "409"),
                         f"{me}: PUT {target} {desc} → 409 Conflict"),
                    _set(w, i, x._replace(pc="retry")))
        source = x.obs_vm if x.blind and x.obs_vm is not None else vm
        change = self._change(x, source)
        if change is None or change == FENCED_OUT:
            return self._declined(w, i, me, target, desc, change)
        if isinstance(change, Status):
            new = vm._replace(status=change)
        else:
            fin = bool(change)
            new = vm._replace(finalizer=fin)
            if not fin and new.deleting:
                w2 = write_vm(_set(w, i, _idle(x)), None, self.cfg.history, i)
                return (Step(me, "write", (x.action, "ok", None),
                             f"{me}: PUT VM {desc} → ok: last finalizer gone, VM removed"), w2)
        blind = " (BROKEN: blind retry)" if x.blind else ""
        if new == vm:
            return self._seen_by_write(
                w, i, Step(me, "write", (x.action, "ok", new), f"{me}: PUT {target} {desc} "
                           f"→ ok, unchanged{blind}"), x, new)
        w2 = write_vm(w, new, self.cfg.history, i)
        return self._seen_by_write(w2, i, Step(me, "write", (x.action, "ok", new),
                                               f"{me}: PUT {target} {desc} → ok{blind}"),
                                   x, new)

    def _seen_by_write(self, w: World, i: int, step: Step, x: Worker, vm: VM | None,
                       written: Pod | None = None) -> tuple[Step, World]:
        """After a write that took effect (its result already in ``w``): the next
        observation is its response, as ``Reconciler._seen_by_write`` builds it, decided
        in the same step (the response arrives with the write). Without a VM or the
        pods it extends, or when the VM commits a pod not among them: a direct read."""
        me = step.actor
        pods = x.seen
        if vm is None or pods is None:
            return step, _set(w, i, _idle(x, need_direct=True))
        if written is not None:
            pods = tuple(sorted((*(p for p in pods if p.name != written.name), written)))
        if vm.status.pod_name and pod_by_name(pods, vm.status.pod_name) is None:
            return (step._replace(text=f"{step.text}; {vm.status.pod_name} not among the "
                                       f"pods seen: read directly"),
                    _set(w, i, _idle(x, need_direct=True)))
        nxt, w2 = self._decided(w, i, me, _idle(x)._replace(lag_vm=x.lag_vm, lag_pods=x.lag_pods),
                                vm, pods, x.seen_direct, True, "the response", from_write=True,
                                vm_written=written is None)
        return step._replace(text=f"{step.text}; {nxt.text.removeprefix(me + ': ')}"), w2

    def _change(self, x: Worker, source: VM) -> Status | bool | str | None:
        """The shipped mutation's answer for ``x``'s action on ``source``."""
        assert x.action is not None
        if x.action[0] in STATUS_WRITES:
            return self.code.status_write(x.action, x.lease, source)
        return self.code.finalizer_write(x.action, source)

    def _declined(self, w: World, i: int, me: str, target: str, desc: str,
                  change: object) -> tuple[Step, World]:
        x = w.workers[i]
        assert x.action is not None
        if change == FENCED_OUT:
            return (Step(me, "write", (x.action, "fenced"),
                         f"{me}: PUT {target} {desc}: mutation says FencedOut: leave the "
                         f"VM alone"),
                    _set(w, i, _idle(x, need_direct=True)))
        return (Step(me, "write", (x.action, "noop"),
                     f"{me}: PUT {target} {desc}: mutation: nothing to do"),
                _set(w, i, _idle(x)))

    def _retry(self, w: World, i: int, me: str) -> tuple[Step, World]:
        x = w.workers[i]
        assert x.action is not None
        if w.vm is None:
            return (Step(me, "reread", (None,), f"{me}: conflict retry: GET VM → 404"),
                    _set(w, i, _idle(x)))
        if self.cfg.broken("noop_retry"):
            return (Step(me, "reread", ("noop",), f"{me}: conflict retry: GET VM and write it "
                         f"back unchanged (BROKEN: intent lost)"), _set(w, i, _idle(x)))
        blind = self.cfg.broken("blind_retry")
        return (Step(me, "reread", (w.vm,), f"{me}: conflict retry: GET VM directly"),
                _set(w, i, x._replace(pc="act", base_fresh=True, lag_vm=0, blind=blind,
                                      obs_vm=x.obs_vm if blind else w.vm)))

    def _create(self, w: World, i: int, me: str, plan: Plan, desc: str,
                then: Worker) -> tuple[Step, World]:
        x = w.workers[i]
        name = plan.name
        if pod_by_name(w.pods, name) is not None:
            nxt = then if then.pc != "idle" else _idle(x, need_direct=True)
            return (Step(me, "create", (name, "exists"), f"{me}: POST pod {name} → AlreadyExists"),
                    _set(w, i, nxt))
        assert x.obs_vm is not None
        uid = f"u{w.uid_next}"
        pod = Pod(name=name, uid=uid, owner=x.obs_vm.uid, gated=True, node=None,
                  phase="Pending", terminating=False, fence=(plan.epoch, plan.token))
        w2 = write_pods(_set(w, i, then), (*w.pods, pod), self.cfg.history, i)
        step = Step(me, "create", (name, "ok", uid),
                    f"{me}: POST pod {name} (gated) → ok, uid {uid} [{desc}]")
        w2 = w2._replace(uid_next=w.uid_next + 1)
        if then.pc != "idle":
            return step, w2
        return self._seen_by_write(w2, i, step, x, x.obs_vm, pod)

    def _precreate(self, w: World, i: int, me: str) -> tuple[Step, World]:
        x = w.workers[i]
        assert x.action is not None
        return self._create(w, i, me, x.action[1],
                            "BROKEN: created before the plan is recorded",
                            then=x._replace(pc="act"))

    def _delete(self, w: World, i: int, me: str, name: str, uid: str,
                desc: str) -> tuple[Step, World]:
        x = w.workers[i]
        pod = pod_by_name(w.pods, name)
        if pod is None:
            return (Step(me, "delete", (name, uid, "404"), f"{me}: DELETE pod {name} → 404"),
                    _set(w, i, _idle(x, need_direct=True)))
        if pod.uid != uid and not self.cfg.broken("delete_without_uid"):
            return (Step(me, "delete", (name, uid, "409"),
                         f"{me}: DELETE pod {name} (uid {uid}) → 409: uid is {pod.uid}"),
                    _set(w, i, _idle(x, need_direct=True)))
        if pod.terminating:
            return (Step(me, "delete", (name, uid, "ok"), f"{me}: DELETE pod {name} → already "
                         "terminating"), _set(w, i, _idle(x)))
        w2 = write_pods(_set(w, i, _idle(x)), replace_pod(w.pods, pod, deleted(pod)),
                        self.cfg.history, i)
        return (Step(me, "delete", (name, pod.uid, "ok"),
                     f"{me}: DELETE pod {name} uid {pod.uid} → ok [{desc}]"), w2)

    def _force_read(self, w: World, i: int, me: str, desc: str) -> tuple[Step, World]:
        """``ForceDeleteDeadPod``, first call (``fencing.force_delete_dead_pod``): GET the
        pod directly; another uid or none is "gone" (observe again, directly). The
        performer's ledger check passes (only a condemned uid is decided), and its
        authority check between the GET and the DELETE is, as everywhere here, the lock
        check before the worker's next action (a deposed worker sends it anyway)."""
        x = w.workers[i]
        assert x.action is not None
        _, name, uid = x.action
        pod = pod_by_name(w.pods, name)
        if pod is None or pod.uid != uid:
            return (Step(me, "forceget", (name, uid, "gone"),
                         f"{me}: GET pod {name} → " + (f"uid {pod.uid}" if pod else "404")
                         + ": not force-deleted"),
                    _set(w, i, _idle(x, need_direct=True)))
        return (Step(me, "forceget", (name, uid, "ok"), f"{me}: GET pod {name} → uid "
                     f"{uid} [{desc}]"),
                _set(w, i, x._replace(pc="forcedelete", target=pod)))

    def _force_delete(self, w: World, i: int, me: str) -> tuple[Step, World]:
        """``ForceDeleteDeadPod``, second call: DELETE with ``gracePeriodSeconds: 0``, the
        uid and the GET's version as preconditions (the whole pod as read: any change is
        a new version); it lands by removing the pod at once, terminating or not. 404
        "gone", 409 "conflict": observe again, directly."""
        x = w.workers[i]
        assert x.action is not None and x.target is not None
        _, name, uid = x.action
        pod = pod_by_name(w.pods, name)
        if pod is None or pod != x.target:
            code = "404" if pod is None else "409"
            return (Step(me, "forcedelete", (name, uid, code),
                         f"{me}: DELETE pod {name} grace 0 (uid {uid}, version as read) "
                         f"→ {code}"),
                    _set(w, i, _idle(x, need_direct=True)))
        w2 = write_pods(_set(w, i, _idle(x)), replace_pod(w.pods, pod, None),
                        self.cfg.history, i)
        return (Step(me, "forcedelete", (name, uid, "ok"),
                     f"{me}: DELETE pod {name} grace 0 (uid {uid}, version as read) → ok: "
                     f"gone"), w2)

    def _prelist(self, w: World, i: int, me: str) -> tuple[Step, World]:
        x = w.workers[i]
        assert x.action is not None
        _, name, uid = x.action
        pods = w.pods
        only = pods[0] if len(pods) == 1 else None
        if (only is not None and only.uid == uid and only.name == name
                and not only.terminating and only.gated):
            then = "vmread" if x.pc == "prelist_cache" else "patch"
            return (Step(me, "prelist", ("ok",), f"{me}: LIST pods directly: only {name}"),
                    _set(w, i, x._replace(pc=then, target=only, lag_pods=0)))
        return (Step(me, "prelist", ("refused",),
                     f"{me}: LIST pods directly: {len(pods)} pod(s): do not ungate {name}"),
                _set(w, i, _idle(x, need_direct=True)._replace(lag_pods=0)))

    def _vmread(self, w: World, i: int, me: str) -> tuple[Step, World]:
        """An ungate decided from the cache: the VM, read after the list, must still be
        the observed one, not deleting, with that pod committed."""
        x = w.workers[i]
        assert x.action is not None
        _, name, uid = x.action
        vm = w.vm
        if (vm is not None and x.obs_vm is not None and vm.uid == x.obs_vm.uid
                and not vm.deleting and vm.status.pod_name == name
                and vm.status.pod_uid == uid):
            return (Step(me, "vmread", ("ok",), f"{me}: GET VM directly: {name} committed"),
                    _set(w, i, x._replace(pc="patch")))
        return (Step(me, "vmread", ("refused",),
                     f"{me}: GET VM directly: gone, deleting or another pod: do not ungate "
                     f"{name}"),
                _set(w, i, _idle(x, need_direct=True)))

    def _patch(self, w: World, i: int, me: str) -> tuple[Step, World]:
        x = w.workers[i]
        assert x.action is not None and x.target is not None
        _, name, uid = x.action
        if self.cfg.broken("ungate_without_precondition"):
            pod = pod_by_name(w.pods, name)
            ok = pod is not None and pod.gated
        else:
            pod = pod_by_uid(w.pods, x.target.uid)
            ok = pod is not None and pod == x.target
        if not ok or pod is None:
            return (Step(me, "ungate", (name, uid, "409"),
                         f"{me}: PATCH pod {name} remove gate (uid {uid}) → 409/404"),
                    _set(w, i, _idle(x, need_direct=True)))
        ungated = pod._replace(gated=False)
        w2 = write_pods(w, replace_pod(w.pods, pod, ungated), self.cfg.history, i)
        return self._seen_by_write(w2, i, Step(me, "ungate", (name, pod.uid, "ok"),
                                               f"{me}: PATCH pod {name} remove gate "
                                               f"(uid {pod.uid}) → ok"), x, x.obs_vm, ungated)

    # ---- environment: scheduler + kubelet, garbage collector ------------------------------

    def environment_steps(self, w: World) -> list[tuple[Step, World]]:
        """What the cluster does by itself; these keep happening when faults stop."""
        out: list[tuple[Step, World]] = []
        h = self.cfg.history
        owner = w.vm.uid if w.vm is not None else None
        for p in w.pods:
            if not p.gated and p.node is None and not p.terminating:
                out.append((Step("kubelet", "run", (p.name, p.uid),
                                 f"scheduler+kubelet: {p.name} bound to {NODE}, Running"),
                            write_pods(w, replace_pod(w.pods, p, p._replace(
                                node=NODE, phase="Running")), h, None)))
            if p.terminating:
                out.append((Step("kubelet", "gone", (p.name, p.uid),
                                 f"kubelet: {p.name} finished terminating: gone"),
                            write_pods(w, replace_pod(w.pods, p, None), h, None)))
            elif p.owner != owner:
                out.append((Step("gc", "delete", (p.name, p.uid),
                                 f"garbage collector: delete {p.name} (owner VM gone)"),
                            write_pods(w, replace_pod(w.pods, p, deleted(p)), h, None)))
        return out

    # ---- adversaries: the user, the guest, faults -----------------------------------------

    def adversary_steps(self, w: World) -> list[tuple[Step, World]]:
        out: list[tuple[Step, World]] = []
        b = w.budget
        h = self.cfg.history
        vm = w.vm
        if b.pod_delete:
            for p in w.pods:
                if not p.terminating:
                    out.append((Step("user", "delete-pod", (p.name, p.uid),
                                     f"user: kubectl delete pod {p.name}"),
                                write_pods(_spend(w, pod_delete=1),
                                           replace_pod(w.pods, p, deleted(p)), h, None)))
        if b.pod_finish:
            for p in w.pods:
                if p.phase == "Running" and not p.terminating:
                    for phase in ("Succeeded", "Failed"):
                        if phase == "Succeeded" and vm is not None and \
                                vm.restart_policy == "Always":
                            continue
                        out.append((Step("guest", "finish", (p.name, phase),
                                         f"guest in {p.name} exits: pod {phase}"),
                                    write_pods(_spend(w, pod_finish=1), replace_pod(
                                        w.pods, p, p._replace(phase=phase)), h, None)))
        if vm is not None and b.vm_delete and not vm.deleting:
            new = vm._replace(deleting=True) if vm.finalizer else None
            out.append((Step("user", "delete-vm", (),
                             "user: kubectl delete vm" + ("" if vm.finalizer else
                                                          " (no finalizer: removed)")),
                        write_vm(_spend(w, vm_delete=1), new, h, None)))
        if vm is not None and b.spec_edit and not vm.deleting:
            out.append((Step("user", "edit-spec", (), "user: edit the VM spec"),
                        write_vm(_spend(w, spec_edit=1), vm._replace(
                            spec_v=vm.spec_v + 1, generation=vm.generation + 1), h, None)))
        if vm is not None and b.plant and not vm.deleting:
            out.extend(self._plants(w))
        if vm is not None and b.conflict:
            out.append((Step("fault", "conflict", (),
                             "fault: another writer updates the VM (new resourceVersion)"),
                        write_vm(_spend(w, conflict=1), vm, h, None)))
        if b.lock_expiry and w.lock is not None:
            out.append((Step("fault", "lock-expiry", (),
                             "fault: the lock's etcd lease expires: key deleted"),
                        _spend(w, lock_expiry=1)._replace(lock=None)))
        if b.crash:
            for i, x in enumerate(w.workers):
                if x.role != STANDBY and x.pc != "stopped":
                    out.append(self._crash(w, i))
        if b.failover and self.cfg.locks:
            out.extend(self._failovers(w))
        return out

    def _plants(self, w: World) -> Iterator[tuple[Step, World]]:
        """The user pre-creates a pod under a name the controller will create: the next
        plan's name, or the recorded plan's before its create. Gated, labelled and owned
        by the VM (all the admission policy would check when it is off), with no fence
        annotations, or with a fence older than the plan's (one token less: the plan's for
        the recorded name; status.fence's for the next name, which every later plan's
        fence is at least)."""
        vm = w.vm
        assert vm is not None
        s = vm.status
        names = [(plan_name(to_api_vm(vm), s.plan_seq + 1),
                  _older((s.fence.epoch, s.fence.token) if s.fence is not None else None))]
        if s.pending is not None:
            names.append((s.pending.name, _older((s.pending.epoch, s.pending.token))))
        for name, older in names:
            if pod_by_name(w.pods, name) is not None:
                continue
            uid = f"u{w.uid_next}"
            for fence in (None, older) if older is not None else (None,):
                pod = Pod(name=name, uid=uid, owner=vm.uid, gated=True, node=None,
                          phase="Pending", terminating=False, fence=fence, planted=True)
                w2 = write_pods(_spend(w, plant=1), (*w.pods, pod), self.cfg.history, None)
                what = ("no fence" if fence is None
                        else f"older fence epoch {fence[0]} token {fence[1]}")
                yield (Step("user", "plant", (name, uid, fence),
                            f"user: create pod {name} (gated, owned by the VM, {what})"),
                       w2._replace(uid_next=w.uid_next + 1))

    def _crash(self, w: World, i: int) -> tuple[Step, World]:
        """Crash (SIGKILL) a worker: its in-memory state is lost."""
        x = w.workers[i]
        w = _spend(w, crash=1)
        lags = (len(w.vm_hist), len(w.pod_hist))
        if not self.cfg.locks:
            return (Step("fault", "crash", (i,), f"fault: c{i} crashes and restarts"),
                    _set(w, i, _fresh_worker(LEADER, x.epoch, *lags)))
        if x.role == LEADER:
            epoch = w.epoch + 1
            return (Step("fault", "crash", (i,), f"fault: leader c{i} crashes; its new process "
                         f"is elected, epoch {epoch}"),
                    _set(w._replace(epoch=epoch), i, _fresh_worker(LEADER, epoch, *lags)))
        return (Step("fault", "crash", (i,), f"fault: deposed c{i} crashes (a standby now)"),
                _set(w, i, Worker(role=STANDBY, epoch=0, token=0, pc="idle")))

    def _failovers(self, w: World) -> Iterator[tuple[Step, World]]:
        """Lease loss: the leader is deposed (and does not notice); another replica leads."""
        lead = next((i for i, x in enumerate(w.workers) if x.role == LEADER), None)
        if lead is None:
            return
        epoch = w.epoch + 1
        lags = (len(w.vm_hist), len(w.pod_hist))
        for j in range(len(w.workers)):
            if j == lead:
                continue
            w2 = _spend(w, failover=1)._replace(epoch=epoch)
            w2 = _set(w2, lead, w2.workers[lead]._replace(role=ZOMBIE))
            w2 = _set(w2, j, _fresh_worker(LEADER, epoch, *lags))
            yield (Step("fault", "failover", (lead, j), f"fault: c{lead} loses its lease; "
                        f"c{j} is elected, epoch {epoch}"), w2)


def _older(fence: tuple[int, int] | None) -> tuple[int, int] | None:
    """A fence just below ``fence`` (None when there is none below (0, 0))."""
    if fence is None:
        return None
    epoch, token = fence
    if token > 0:
        return (epoch, token - 1)
    return (epoch - 1, 0) if epoch > 0 else None
