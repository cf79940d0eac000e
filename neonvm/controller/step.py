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

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

from neonvm.api import types
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
    """Namespaces being deleted, learned from refused creates: their VMs plan no pod."""
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
