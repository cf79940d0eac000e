"""The vocabulary of the decision: what an observation holds, and the actions.

:class:`Observation` (with :class:`PodView` and :class:`RunnerView`) is what
:func:`~neonvm.controller.decide.decide` reads; each :class:`Action` subclass is one answer
it gives. An action the driver performs declares its ``step`` and has its row in
:data:`neonvm.controller.action_table.ACTIONS`. The state machine they make up:
docs/protocol.md, "The state machine".
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import ClassVar

from neonvm.api.types import Fence as Fence  # exported: the authority an observation carries
from neonvm.api.types import PendingPod, PendingScale, VirtualMachine
from neonvm.controller import autoscaler_view

# ---- observation -------------------------------------------------------------------------


@dataclass(frozen=True)
class PodView:
    """What the decision needs to know of one pod labelled for the VM."""

    name: str
    uid: str
    owner_uid: str | None
    """UID of the controlling owner reference (the VM that created it), if any."""
    gated: bool
    """Still carries the runner scheduling gate."""
    terminating: bool
    """Has a deletionTimestamp (it may still be running until it is gone)."""
    phase: str = "Pending"
    """Pod phase: Pending, Running, Succeeded, Failed, Unknown."""
    node: str | None = None
    ip: str | None = None
    fence: tuple[int, int] | None = None
    """(epoch, token) of the plan the pod was created for, from its fence annotations
    (``vm.neon.tech/fence-epoch`` and ``-token``); None when absent or malformed."""
    built: tuple[int, int] | None = None
    """(millicores, memory slots) the pod's guest was built with (its
    ``vm.neon.tech/built-size`` annotation); None: not recorded."""
    slot_bytes: int | None = None
    """The memory slot size (bytes) the pod was built with, from the same annotation
    (from the spec annotation for a pod built before that field): its runner counts
    slots in it. None: neither says."""
    runner_port: int | None = None
    """The port its runner listens on, from the pod's own spec; None: not found."""
    autoscaling: autoscaler_view.AutoscalingMeta = ()
    """The labels and annotations kept as the VM's, with the record of which were copied
    (:func:`neonvm.controller.autoscaler_view.autoscaling_meta`)."""
    scale_fence: tuple[int, int, int] | None = None
    """(epoch, token, seq) of the scaling plan whose size its usage and resources
    annotations carry (``vm.neon.tech/scale-fence``); None: absent or malformed."""
    annotated: tuple[int, int] | None = None
    """(``cpus.use`` in millicores, ``memorySlots.use``) of its ``vm.neon.tech/resources``
    annotation: the size it tells NeonVM's scheduler plugin and the runner's quota; None:
    absent or malformed (a pod built before it existed)."""
    cpu_request: int | None = None
    """The runner container's CPU request (millicores), only for a pod whose recorded QoS
    class is Burstable (the only pods a plan resizes); None otherwise or unreadable."""
    resize_refused: tuple[int, int, int] | None = None
    """The scale fence of the plan whose in-place resize of this pod was refused for good
    (``vm.neon.tech/resize-refused``); None: none."""

    @property
    def finished(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


@dataclass(frozen=True)
class RunnerView:
    """The committed pod's runner, as its ``GET /scale`` answered."""

    pod_uid: str
    """The pod whose runner answered (its IP was taken from that pod)."""
    fence: tuple[int, int, int] | None
    """(epoch, token, seq) it last applied (or its floor); None: none yet."""
    vcpus: int
    """vCPUs the guest has: plugged in QEMU (QmpScaling) or online in the guest
    (SysfsScaling, as its agent reports)."""
    memory_slots: int
    memory_bytes: int
    pending_removals: tuple[str, ...] = ()
    """Devices the runner sent ``device_del`` for that QEMU still lists: the guest may
    eject them at any time, so the size above is not settled (nothing is committed)."""
    answered_uid: str | None = None
    """The pod uid the runner says it runs in (``GET /scale``'s ``podUid``, from its
    downward API); None: not said (a runner from before it did). A size is adopted
    without a plan only from a runner that names the committed pod (a reused IP's answer
    is another pod's)."""


@dataclass(frozen=True)
class Observation:
    """One snapshot: the VM (None when it does not exist) and the pods labelled for it."""

    vm: VirtualMachine | None
    pods: tuple[PodView, ...]
    lease: Fence
    """The caller's authority: leader epoch and the VM lock's fencing token."""
    direct: bool
    """Pods listed, then the VM read, both from etcd (quorum), in that order."""
    create_failed_generation: int | None = None
    """Generation whose pod create was refused (422, admission); do not retry it."""
    now: dt.datetime | None = None
    """When the observation was taken (timezone-aware). None: no restart backoff."""
    missing_pull_secrets: tuple[str, ...] = ()
    """Image pull secrets the VM names that do not exist. Looked up only by a direct
    observation of a VM whose planned pod is not there yet (a create is due); empty: none
    missing, not looked up, or the controller may not look."""
    runner: RunnerView | None = None
    """What the committed pod's runner answered on ``GET /scale``; asked only when
    :func:`looks_at_runner` says so: while a scaling plan is recorded, for
    :data:`LATE_PUT_SECONDS` after one was dropped, and after that while status still
    names the pod in ``scaleLookPodUID`` (None: not asked, or no answer: see
    ``runner_error``). Asked after ``now`` was taken: an answer is at least as new as
    ``now`` (what :func:`look_may_end` relies on)."""
    runner_error: str | None = None
    """Why the runner could not be asked (unreachable, no token); None: asked, or not."""
    namespace_terminating: bool = False
    """The VM's namespace is being deleted (the driver learned it from a create refused
    for that reason): no new pod can be made there, and the VM goes with its namespace.
    Never looked up; False: not known to be."""
    dead_pods: frozenset[str] = frozenset()
    """Uids of self-fencing pods on unreachable nodes whose right to run is surely over
    (condemned by the leader's ledger: never granted again); see
    :mod:`neonvm.controller.fencing`. Empty: none, or not looked at."""
    fence_recheck: float | None = None
    """Seconds until a self-fencing pod on an unreachable node will be surely dead (a
    Done becomes a Wait that long); None: no such pod."""

    def pod(self, name: str | None) -> PodView | None:
        if not name:
            return None
        return next((p for p in self.pods if p.name == name), None)


# ---- actions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """Base of every decision; ``reason`` is for logs and events.

    An action the driver performs declares its ``step``: the name it goes by in metrics,
    the ``crash_after`` fault and the crash campaign. How it is performed, and the event
    it records, is its row in ``neonvm.controller.action_table.ACTIONS`` (the one table);
    the fault steps and the explorer derive from those two. The others (Done, Wait,
    ObserveDirect, Fenced) end or redirect the loop and have no step.
    """

    step: ClassVar[str] = ""
    reason: str = field(default="", kw_only=True)


@dataclass(frozen=True)
class Done(Action):
    """Nothing to do until something changes."""


@dataclass(frozen=True)
class Wait(Action):
    """Nothing to do now; look again after ``seconds`` (also sets a condition)."""

    seconds: float = 2.0
    condition: str | None = None
    """Condition type to report while waiting (e.g. WaitingForOldPod)."""


@dataclass(frozen=True)
class ObserveDirect(Action):
    """The next step is dangerous; observe again with quorum reads first."""


@dataclass(frozen=True)
class Fenced(Action):
    """A writer with a higher epoch has touched this VM: stop, we are stale."""

    seen_epoch: int = 0


@dataclass(frozen=True)
class AddFinalizer(Action):
    """Conditional update of the main resource adding our finalizer."""

    step: ClassVar[str] = "add_finalizer"


@dataclass(frozen=True)
class RemoveFinalizer(Action):
    """All pods are gone (direct list): let the VM go, then release its lock."""

    step: ClassVar[str] = "finalize"


@dataclass(frozen=True)
class RecordPlan(Action):
    """CAS ``status.pendingPod`` = this plan, if ``planSeq`` is still ``observed_seq``."""

    step: ClassVar[str] = "plan"

    plan: PendingPod = field(default_factory=PendingPod)
    observed_seq: int = 0


@dataclass(frozen=True)
class CreatePod(Action):
    """Create the runner pod with exactly the recorded name, gated."""

    step: ClassVar[str] = "create"

    plan: PendingPod = field(default_factory=PendingPod)


@dataclass(frozen=True)
class Commit(Action):
    """CAS {podName, podUID, pendingPod: none} if pendingPod is still ``name``."""

    step: ClassVar[str] = "commit"

    name: str = ""
    uid: str = ""
    built: tuple[int, int] | None = None
    """(millicores, memory slots) the pod was built with: recorded as status.cpus and
    memorySize (the guest's size), not the spec's size at commit time. None: the spec's."""
    slot_bytes: int | None = None
    """The memory slot size the pod was built with (None: the spec's)."""


@dataclass(frozen=True)
class DropPlan(Action):
    """CAS pendingPod: none if it is still ``name`` (the name is taken or dying)."""

    step: ClassVar[str] = "drop_plan"

    name: str = ""


@dataclass(frozen=True)
class Ungate(Action):
    """Remove our scheduling gate from the committed pod (uid precondition)."""

    step: ClassVar[str] = "ungate"

    name: str = ""
    uid: str = ""


@dataclass(frozen=True)
class DeletePod(Action):
    """Delete a pod with a uid precondition."""

    step: ClassVar[str] = "cleanup"

    name: str = ""
    uid: str = ""


@dataclass(frozen=True)
class ForceDeleteDeadPod(Action):
    """Delete a self-fenced pod at once (``gracePeriodSeconds: 0``; uid and
    resourceVersion preconditions): its node is unreachable and its right to run is
    surely over, so its guest is dead (docs/protocol.md, "Self-fencing"). Only for a uid
    in ``Observation.dead_pods``, from a direct observation: the committed pod, an old
    pod its gated replacement waits for, or a pod of a VM being deleted."""

    step: ClassVar[str] = "force_delete"

    name: str = ""
    uid: str = ""


@dataclass(frozen=True)
class Restart(Action):
    """The committed pod is gone or finished: apply the restart policy by CAS.

    ``terminal_phase`` None: {podName: "", podUID: "", pendingPod: none,
    restartCount+1, phase Pending}. Otherwise set that terminal phase and keep podName.
    The mutation checks podName/podUID are still ``name``/``uid``.
    """

    step: ClassVar[str] = "restart"

    name: str = ""
    uid: str = ""
    terminal_phase: str | None = None
    at: str | None = None
    """``status.lastRestartTime`` to record (RFC 3339; the observation's ``now``). None:
    leave it as it is (a caller without a clock)."""
    self_fenced: bool = False
    """The pod was condemned by this term's ledger (its node was lost, not its guest):
    the restart does not grow ``status.restartStreak`` (restarts.py)."""


@dataclass(frozen=True)
class SyncStatus(Action):
    """Mirror the committed pod into status (phase, IP, node).

    ``name``/``uid`` say which pod was observed: the mutation refuses a status that names
    another pod by then (a late sync must not describe the replacement with the old
    pod's node and IP).
    """

    step: ClassVar[str] = "sync"

    phase: str = "Pending"
    node: str | None = None
    ip: str | None = None
    name: str = ""
    uid: str = ""


@dataclass(frozen=True)
class PlanScale(Action):
    """CAS ``status.pendingScale`` = ``plan`` and ``phase: Scaling``, if ``scaleSeq`` is still
    ``observed_seq``, the committed pod is still the plan's and the fresh spec still asks
    for the plan's size. A plan recorded before (number ``observed_seq``, for another
    size) is superseded: the runner orders the two by their seq."""

    step: ClassVar[str] = "plan_scale"

    plan: PendingScale = field(default_factory=PendingScale)
    observed_seq: int = 0


@dataclass(frozen=True)
class ApplyScale(Action):
    """Ask the committed pod's runner (``PUT /scale``) for the recorded plan's size, with
    the plan's fence (epoch, token, seq). Idempotent: the same fence and target again is
    a retry to the runner."""

    step: ClassVar[str] = "apply_scale"

    plan: PendingScale = field(default_factory=PendingScale)


@dataclass(frozen=True)
class CommitScale(Action):
    """The runner reports the plan's fence applied and the plan's size reached: CAS
    {cpus, memorySize: what it reported, pendingScale: none, phase Running} if the plan
    is still number ``seq``.

    With ``adopt`` (no plan recorded, after one was dropped): the runner of the
    committed pod ``pod_uid`` reports a settled size other than status says (a PUT of
    the dropped plan landed after the drop), or, with ``ends_look``, any settled size:
    CAS {cpus, memorySize: what it reported} if no plan is recorded, ``scaleSeq`` is
    still ``seq`` (no plan was made since the observation), the committed pod is
    still ``pod_uid`` and, with ``look_recorded``, status still asks for the look at
    it; the Scaling condition is left as it is."""

    step: ClassVar[str] = "commit_scale"

    seq: int = 0
    vcpus: int = 0
    memory_bytes: int = 0
    adopt: bool = False
    pod_uid: str = ""
    pod_behind: bool = False
    """Without ``adopt``: the pod's ``vm.neon.tech/scale-fence`` annotation does not carry
    this plan (its tell was lost: a leader's death, an error, conflicts), so status
    records whole vCPUs, not the spec's fraction: status then differs from the spec and
    the next plan writes the annotations (docs/protocol.md, "Live scaling")."""
    ends_look: bool = False
    """With ``adopt``: the answer was asked after the late-PUT window had passed
    (:func:`look_may_end`), so it is the runner's last word on the dropped plan: the
    same write clears ``status.scaleLookPodUID`` (it is decided only while that names
    ``pod_uid``, and lands only while it still does: ``look_recorded``). The look ends
    only with a write that lands; one that fails leaves it set, and the next
    observation asks again."""
    look_recorded: bool = False
    """With ``adopt``: the observation saw status ask for the look
    (``scaleLookPodUID`` naming ``pod_uid``), and the write requires that it still
    does. Once a write decided past the window has ended the look, an adopt decided
    from an older answer (a writer paused since) must not put an older size back with
    nobody looking any more. (Without the record, a VM stored before it existed: no
    such requirement; its record cannot appear without a new plan, which ``seq``
    fences out.)"""
    gives_up: bool = False
    """With ``adopt``, ``ends_look`` and ``look_recorded``: the look has gone on for
    :data:`LOOK_GIVE_UP_SECONDS` since the drop without a settled answer that could end
    it (the runner does not answer, does not name its pod, or a removal stays pending):
    the write ends it and adopts nothing (``vcpus`` and ``memory_bytes`` are not
    written). A bound on the GETs a look costs, not a proof that nothing landed."""


@dataclass(frozen=True)
class DropScale(Action):
    """CAS pendingScale: none if it is still number ``seq`` (it names a pod that is no
    longer the committed one, or the runner has applied a newer fence). With ``refused``
    and no plan recorded: only the Scaling condition, if ``seq`` is still
    ``status.scaleSeq`` (no plan was made since the observation) and the spec is still
    ``generation``."""

    step: ClassVar[str] = "drop_scale"

    seq: int = 0
    generation: int = 0
    """The spec generation a refusal without a plan was decided for (0: not one)."""
    refused: str | None = None
    """The runner or the cluster refused the plan for good: the Scaling condition's
    reason (:data:`SCALING_NEEDS_RESTART`, :data:`SCALING_DISABLED`); no new plan for
    the same spec generation. None: dropped to plan again."""
    starts_look: bool = True
    """Whether a ``PUT /scale`` of the plan may have reached the committed pod's runner,
    so that the drop asks for the look (``status.scaleLookPodUID``). False: none can
    have (the pod was built without a token, so its runner refuses every PUT), and a
    look could learn nothing and never end."""


@dataclass(frozen=True)
class SyncPodMetadata(Action):
    """Make the committed pod ``name`` (``uid``) carry the VM's labels and annotations
    (added, changed, and removed where the pod's record says they were copied), as
    NeonVM keeps them for its
    autoscaler stack: a merge patch with the pod's uid and resourceVersion
    (:mod:`neonvm.controller.autoscaler_view`)."""

    step: ClassVar[str] = "sync_pod_metadata"

    name: str = ""
    uid: str = ""


def performed_actions() -> tuple[type[Action], ...]:
    """Every action the driver performs (those with a ``step``), in definition order."""
    found: list[type[Action]] = []

    def visit(cls: type[Action]) -> None:
        for sub in cls.__subclasses__():
            if sub.step and sub not in found:
                found.append(sub)
            visit(sub)

    visit(Action)
    return tuple(found)
