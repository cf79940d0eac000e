"""What a performer works with: its context, the step it performs, and what it answers.

A performer (:mod:`neonvm.controller.performers`) is a function ``(ctx, step) -> str``.
:class:`StepContext` holds what lives as long as the reconciler (the API server's
interface, the writer, events, metrics, timers); :class:`Step` is one action to perform
(the VM key, the action, the observation it was decided on, the authority, the log and
the action's :class:`ActionRow`). The two VM writes every performer and the driver share
are here too: :func:`update_vm` and :func:`write_status` (docs/reconciler.md, "The
conditional-update helper").
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from neonvm.api import times, types
from neonvm.api.types import VirtualMachineStatus
from neonvm.controller import decide as d
from neonvm.controller.authority import Authority
from neonvm.controller.cluster import Cluster, VMRecord
from neonvm.controller.crd_warning import OldCrdWarning, pruned_fields
from neonvm.controller.events import EventRecorder
from neonvm.controller.fencing import SelfFencing
from neonvm.controller.identity import Identity
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.observe import DirectReader, Snapshot, split_key
from neonvm.controller.progress import ProgressEvents
from neonvm.controller.scaling import RunnerScaling
from neonvm.controller.timers import VMTimers
from neonvm.controller.update import UpdateFunction, UpdateOutcome

if TYPE_CHECKING:  # its home is the driver's; only named here
    from neonvm.controller.reconciler import ReconcilerConfig


class Writer(Protocol):
    """The two conditional writes of a VM (what the reconciler writes VMs with)."""

    def put_status(self, record: VMRecord, status: VirtualMachineStatus) -> VMRecord: ...

    def put_main(self, record: VMRecord, finalizers: list[str]) -> VMRecord: ...


StepHook = Callable[[str, str, str], None]
"""Called after each performed step with (VM key, step name, outcome)."""


class Outcome(str):
    """What performing one action came to ("done": it took effect), with a detail for
    people (an API server's refusal, say) used if the step keeps not taking effect.

    A write that took effect also hands back what the API server answered: ``vm``, the
    VM as stored by a conditional PUT, or ``pod``, the runner pod as created or as
    patched. The loop builds its next observation from them
    (:meth:`~neonvm.controller.reconciler.Reconciler._seen_by_write`); a performer that
    returns neither (a plain string) is followed by a direct read."""

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


class Event(NamedTuple):
    """A Kubernetes event on the VM: reason, message, and whether it is a Warning."""

    reason: str
    message: str
    warning: bool = False


NAMESPACE_SEEN_LIVE_SECONDS = 2.0
"""How long a read showing a namespace not being deleted is trusted. Shorter than the 5 s
kube-controller-manager's namespace controller waits after a namespace is marked before
it deletes anything in it, so no pod that controller deletes is replaced on the word of a
read taken before the namespace was marked (docs/reconciler.md, "A namespace being
deleted")."""
FORGET_AFTER_WINDOWS = 10
"""A namespace learned as being deleted and not looked at again for this many
``remember_seconds`` is dropped: it is gone by then, or its VMs are not being reconciled."""

NamespaceRead = Callable[[str], dict[str, Any] | None]
"""A quorum read of a Namespace's metadata (None: 404); its errors are the cluster's."""


class TerminatingNamespaces:
    """Which namespaces are being deleted, so that none of their VMs gets a new runner
    pod there. Shared by a reconciler's workers; see docs/reconciler.md, "A namespace
    being deleted".

    Learned from a read of the Namespace (:meth:`look`: a ``deletionTimestamp``, or 404)
    or from a create refused for that reason (:meth:`learn`). What is learned is trusted
    for ``remember_seconds``; after that it is read again before it is used (a namespace
    may be re-created under its name), never learned again from another refused create.
    A read showing the namespace not being deleted is trusted for ``live_seconds``.
    A read that fails (403: this identity may not read Namespaces; no answer) tells
    nothing: the decision goes on as if the namespace were not being deleted, and a
    create there is refused and learned from as before; after a 403 no Namespace is read
    again by this reconciler."""

    def __init__(self, remember_seconds: float = d.NAMESPACE_TERMINATING_RECHECK_SECONDS,
                 clock: Callable[[], float] = time.monotonic, *,
                 live_seconds: float = NAMESPACE_SEEN_LIVE_SECONDS) -> None:
        self._remember = remember_seconds
        self._live_for = live_seconds
        self._clock = clock
        self._learned: dict[str, float] = {}
        self._began: dict[str, dt.datetime] = {}  # the deletionTimestamp a read showed
        self._live: dict[str, float] = {}
        self._forbidden = False
        self._lock = threading.Lock()

    def learn(self, namespace: str, began: dt.datetime | None = None) -> None:
        """``namespace`` is being deleted (a create there was refused, or a read said so,
        with its ``deletionTimestamp`` ``began``)."""
        with self._lock:
            now = self._clock()
            self._learned[namespace] = now
            if began is not None:
                self._began[namespace] = began
            self._live.pop(namespace, None)
            old = now - FORGET_AFTER_WINDOWS * self._remember
            for name in [n for n, at in self._learned.items() if at < old]:
                del self._learned[name]
                self._began.pop(name, None)

    def predates(self, namespace: str, created: str | None) -> bool:
        """Whether an object created at ``created`` (its ``creationTimestamp``) was made
        after ``namespace`` was seen being deleted: then that deletion is of an earlier
        namespace of the name (the API server creates nothing in a namespace being
        deleted), and the namespace is to be read again. Unknown either way: False."""
        with self._lock:
            began = self._began.get(namespace)
        made = times.parse(created)
        return began is not None and made is not None and made >= began

    def knows(self, namespace: str) -> bool:
        """Whether ``namespace`` was learned as being deleted within ``remember_seconds``."""
        with self._lock:
            at = self._learned.get(namespace)
            return at is not None and self._clock() - at < self._remember

    def stale(self, namespace: str) -> bool:
        """Whether ``namespace`` was learned as being deleted longer ago than
        ``remember_seconds``: to be read again before a decision trusts it."""
        with self._lock:
            at = self._learned.get(namespace)
            return at is not None and self._clock() - at >= self._remember

    def look(self, namespace: str, read: NamespaceRead, log: Any) -> bool:
        """Whether ``namespace`` is being deleted: known, or seen live lately, or else
        read with ``read`` (one GET) and remembered."""
        with self._lock:
            now = self._clock()
            at = self._learned.get(namespace)
            if at is not None and now - at < self._remember:
                return True
            seen = self._live.get(namespace)
            if self._forbidden or (seen is not None and now - seen < self._live_for):
                return False
        try:
            meta = read(namespace)
        except ApiException as exc:
            if exc.status == 403:
                with self._lock:
                    self._forbidden = True
                log.warning("this identity may not read Namespaces ({status}): a namespace "
                            "being deleted is learned only from a refused create",
                            status=exc.status)
            else:
                log.debug("reading namespace {ns} failed: {status}", ns=namespace,
                          status=exc.status)
            return False
        except (HTTPError, OSError) as exc:  # no answer
            log.debug("reading namespace {ns} failed: {error}", ns=namespace, error=exc)
            return False
        if meta is None or (meta.get("metadata") or {}).get("deletionTimestamp"):
            if meta is None:  # gone: so are its VMs; nothing to remember
                self.forget(namespace)
            else:
                with self._lock:
                    first = namespace not in self._learned
                if first:
                    log.info("namespace {ns} is being deleted: its VMs get no new runner "
                             "pod", ns=namespace)
                self.learn(namespace, times.parse(meta["metadata"]["deletionTimestamp"]))
            return True
        with self._lock:
            self._learned.pop(namespace, None)
            self._began.pop(namespace, None)
            now = self._clock()
            self._live[namespace] = now
            for name in [n for n, t in self._live.items() if now - t >= self._live_for]:
                del self._live[name]
        return False

    def forget(self, namespace: str) -> None:
        with self._lock:
            self._learned.pop(namespace, None)
            self._began.pop(namespace, None)
            self._live.pop(namespace, None)



@dataclass
class StepContext:
    """What every performer may use; built once per reconciler (the composition is
    :class:`~neonvm.controller.reconciler.Reconciler`'s)."""

    cluster: Cluster
    """Every API server call a step makes (reads through :attr:`reader`; the VM writes
    through :attr:`writer`, which is the cluster unless wrapped)."""
    reader: DirectReader
    writer: Writer
    events: EventRecorder
    progress: ProgressEvents
    """Records events; a reconcile's progress events become one Event at its end."""
    config: ReconcilerConfig
    update: UpdateFunction[VMRecord]
    scaling: RunnerScaling
    timers: VMTimers
    """Per VM: transient create failures in a row (shared with the term's handler, which
    drops a gone VM's entries)."""
    terminating: TerminatingNamespaces
    """Namespaces being deleted (read, or learned from refused creates): their VMs plan
    no pod."""
    identity: Identity
    old_crd: OldCrdWarning
    metrics: ControllerMetrics | None = None
    fencing: SelfFencing | None = None
    """Self-fencing (``dead_pods`` in each decision's observation); None: off."""
    on_finalized: Callable[[str], None] | None = None


class Step(NamedTuple):
    """One action to perform, and what it was decided on."""

    key: str
    action: Any
    """The :class:`~neonvm.controller.actions.Action`."""
    snap: Snapshot
    authority: Authority
    log: Any
    row: ActionRow


Performer = Callable[[StepContext, Step], str]
"""Performs a step: "done" when it took effect, else why not (an :class:`Outcome`)."""


@dataclass(frozen=True)
class ActionRow:
    """How the driver performs one action type, and what it says when it took effect.

    Every field but the last two is required: a row that leaves one out does not load."""

    perform: Performer
    """A :data:`Performer`: returns "done" when the action took effect, else why not."""
    writes: Literal["status", "main", "pod", "runner"]
    """What it writes: the VM's ``/status``, the VM's main resource, a pod, or the
    committed pod's runner (live scaling's ``PUT /scale``, then the pod's usage
    annotation and in-place resize)."""
    mutation: Callable[..., Any] | None
    """What a VM write changes, re-run on the fresh copy on every conflict:
    the action's own function in :mod:`~neonvm.controller.mutations`, ``(action, lease)``
    for a status write, ``(action)`` for the main resource; None for a pod or a runner
    call."""
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


def update_vm(ctx: StepContext, key: str, snap: Snapshot,
              mutate: Callable[[VMRecord], Any],
              write: Callable[[VMRecord, Any], VMRecord],
              authority: Authority) -> UpdateOutcome[VMRecord]:
    """A conditional write of the VM decided on in ``snap``: the authority checked on
    every attempt, the mutation re-run on the fresh copy after a conflict, and nothing
    written to a VM re-created under the same name."""
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
        if ctx.metrics:
            ctx.metrics.conflicts.inc()

    return ctx.update(
        snap.record, guarded, write, lambda: ctx.reader.get_vm(namespace, name),
        policy=ctx.config.retry, on_conflict=on_conflict,
    )


def write_status(ctx: StepContext, key: str, snap: Snapshot,
                 mutation: Callable[[Any], VirtualMachineStatus | None],
                 authority: Authority, log: Any) -> VMRecord | None:
    """PUT the status ``mutation`` makes of the VM (:func:`update_vm`); the VM as written,
    or None when the mutation declined."""
    sent: list[VirtualMachineStatus] = []

    def keeping_what_is_sent(record: VMRecord) -> VirtualMachineStatus | None:
        new = mutation(record.vm)
        sent[:] = [new] if new is not None else []
        return new

    outcome = update_vm(ctx, key, snap, keeping_what_is_sent, ctx.writer.put_status,
                        authority)
    if outcome.conflicts:
        log.info("status write absorbed {n} conflict(s); written={w}",
                 n=outcome.conflicts, w=outcome.written)
    written = outcome.obj if outcome.written else None
    if written is not None and sent and (pruned := pruned_fields(sent[0], written.raw)):
        ctx.old_crd.warn(log, pruned)  # sent, and not in the answer: an older CRD
    return written
