"""The one table of the actions the driver performs: :data:`ACTIONS`.

Each action's row (:class:`~neonvm.controller.step.ActionRow`) carries its performer,
what it writes, its mutation, its event and whether the loop may decide it from a
write's answer. The ``crash_after`` fault steps, the crash campaign's steps, the
explorer's write kinds and :data:`SEEN_BY_WRITE` derive from it. To add an action:
docs/architecture.md, "Places to add an action".
"""

from __future__ import annotations

from collections.abc import Callable

from neonvm.api.types import VirtualMachine
from neonvm.controller import actions as act
from neonvm.controller import mutations as m
from neonvm.controller import performers as p
from neonvm.controller.mutations import StatusMutation
from neonvm.controller.reasons import CREATE_FORBIDDEN, UNGATE_FORBIDDEN
from neonvm.controller.step import ActionRow

ACTIONS: dict[type[act.Action], ActionRow] = {
    act.RecordPlan: ActionRow(p.status_write, "status", m.record_plan,
                            event=p.planned, seen_by_write=True),
    act.CreatePod: ActionRow(p.create_pod, "pod", None, event=None,
                           seen_by_write=True, forbidden=CREATE_FORBIDDEN,
                           resumes_plan=True),
    act.Commit: ActionRow(p.status_write, "status", m.commit,
                        event=p.committed, seen_by_write=True, resumes_plan=True),
    act.Ungate: ActionRow(p.ungate, "pod", None, event=None,
                        # its performer takes its own direct pod list before the patch
                        seen_by_write=True, forbidden=UNGATE_FORBIDDEN),
    act.DeletePod: ActionRow(p.delete_pod, "pod", None, event=None,
                           seen_by_write=False),
    act.Restart: ActionRow(p.status_write, "status", m.restart,
                         event=p.restarted, seen_by_write=False),
    act.AddFinalizer: ActionRow(p.finalizer_write, "main", m.add_finalizer,
                              event=None, seen_by_write=True),
    act.SyncStatus: ActionRow(p.status_write, "status", m.sync_status,
                            event=None, seen_by_write=True),
    act.RemoveFinalizer: ActionRow(p.finalizer_write, "main", m.remove_finalizer,
                                 event=None, seen_by_write=False),
    act.DropPlan: ActionRow(p.status_write, "status", m.drop_plan,
                          event=p.plan_dropped, seen_by_write=True, resumes_plan=True),
    act.PlanScale: ActionRow(p.status_write, "status", m.plan_scale,
                           event=None, seen_by_write=False),
    act.ApplyScale: ActionRow(p.apply_scale, "runner", None, event=None,
                            seen_by_write=False),
    act.CommitScale: ActionRow(p.status_write, "status", m.commit_scale,
                             event=p.look_given_up, seen_by_write=False),
    act.DropScale: ActionRow(p.status_write, "status", m.drop_scale,
                           event=None, seen_by_write=False),
    act.ForceDeleteDeadPod: ActionRow(p.force_delete, "pod", None, event=None,
                                    seen_by_write=False),
    act.SyncPodMetadata: ActionRow(p.sync_pod_metadata, "pod", None, event=None,
                                 seen_by_write=False),
}
"""Every action the driver performs: the one table (its ``step`` is on the class).

A new row goes last: the rows' order is the order the campaign's schedules cycle
through (:data:`neonvm.drills.schedule.CRASH_STEPS`)."""

SEEN_BY_WRITE: tuple[type[act.Action], ...] = (
    act.Done, act.Wait, act.ObserveDirect, act.Fenced,
    *(kind for kind, row in ACTIONS.items() if row.seen_by_write),
)
"""The decisions the loop acts on when they come from an observation built from a write
response: the ones that perform nothing, and the rows marked ``seen_by_write``. Every
other one is taken only from a fresh direct read (docs/protocol.md)."""

STEP_NAMES: dict[type[act.Action], str] = {kind: kind.step for kind in ACTIONS}
"""Step name per performed action type (derived: each class's ``step``)."""


def status_mutation(action: act.Action, lease: act.Fence) -> StatusMutation:
    """The status write of ``action``: its row's mutation. ValueError: not a status write."""
    row = ACTIONS.get(type(action))
    if row is None or row.writes != "status":
        raise ValueError(f"{type(action).__name__} is not a status write")
    mutation: StatusMutation = row.mutation(action, lease)  # type: ignore[misc]
    return mutation


def finalizers_mutation(action: act.Action) -> Callable[[VirtualMachine], list[str] | None]:
    """The main-resource write of ``action`` (AddFinalizer, RemoveFinalizer): its row's
    mutation. ValueError: not a finalizer write."""
    row = ACTIONS.get(type(action))
    if row is None or row.writes != "main":
        raise ValueError(f"{type(action).__name__} is not a finalizer write")
    mutation: Callable[[VirtualMachine], list[str] | None] = row.mutation(action)  # type: ignore[misc]
    return mutation
