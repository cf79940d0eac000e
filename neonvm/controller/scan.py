"""The mid-plan scan's predicates over raw cached objects (dicts, as the informer stores them).

Every couple of seconds the controller requeues each cached VM that is in the middle of
something; these say which (:func:`looks_mid_plan`) and which are held back by a Wait of
their own. docs/reconciler.md, "Progress without events".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from neonvm.controller.decide import TERMINAL_PHASES
from neonvm.controller.reasons import (
    CREATE_REFUSED,
    DEGRADED,
    FENCE_AHEAD,
    OBJECT_TOO_LARGE,
    PULL_SECRET_NOT_FOUND,
    TOO_LARGE_KEY,
)

RawObject = Mapping[str, Any]


def _degraded_for_generation(raw: RawObject, reasons: Iterable[str]) -> bool:
    """Degraded is True, with one of ``reasons``, for the VM's current generation: in
    ``status.conditions`` or ``status.extraConditions``, both read as one list as the
    decision reads them (:class:`~neonvm.api.types.VirtualMachineStatus`)."""
    meta = raw.get("metadata") or {}
    status = raw.get("status") or {}
    wanted = set(reasons)
    return any(
        cond.get("type") == DEGRADED and cond.get("status") == "True"
        and cond.get("reason") in wanted
        and cond.get("observedGeneration") == meta.get("generation")
        for cond in [*(status.get("conditions") or []), *(status.get("extraConditions") or [])])


def create_held_back(raw: RawObject) -> bool:
    """A live VM whose create is held back for its current generation (refused, or a pull
    secret missing): its reconcile ended in a Wait that requeues it, so the mid-plan scan
    skips it. A new generation (the spec was fixed) is scanned again at once."""
    if (raw.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return _degraded_for_generation(raw, (CREATE_REFUSED, PULL_SECRET_NOT_FOUND))


def fence_ahead_marked(raw: RawObject) -> bool:
    """A VM marked Degraded/FenceAhead for its current generation: its reconcile ended in
    a Wait of the fence recheck period that requeues it (and a fix of its status is seen
    through the watch), so the mid-plan scan skips it whatever its plan, pods or deletion
    show (the driver leaves such a VM alone before it looks at any of them). A new
    generation is scanned once: its reconcile marks that generation."""
    return _degraded_for_generation(raw, (FENCE_AHEAD,))


def too_large_left_alone(raw: RawObject) -> bool:
    """A stub of a VM too large to cache (:data:`~neonvm.controller.reasons.
    TOO_LARGE_KEY`), not being deleted, already marked Degraded ``ObjectTooLarge``: the
    reconciler leaves it alone (neonvm/controller/too_large.py), so the scan does not
    requeue it for a direct read of up to 1.5 MiB every few seconds."""
    if TOO_LARGE_KEY not in raw or (raw.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = raw.get("status") or {}
    return any(cond.get("type") == DEGRADED and cond.get("status") == "True"
               and cond.get("reason") == OBJECT_TOO_LARGE
               for cond in [*(status.get("conditions") or []),
                            *(status.get("extraConditions") or [])])


def looks_mid_plan(raw: RawObject, pods: Iterable[RawObject]) -> bool:
    """The mid-plan scan's test of one cached VM and its cached pods: in the middle of
    something (plan, deletion, gated pod, more than one pod, no committed pod, or a
    committed pod that is not there as committed: gone, of another uid, terminating or
    finished), and not held back by a Wait of its own (:func:`create_held_back`,
    :func:`fence_ahead_marked`, :func:`too_large_left_alone`)."""
    pods = list(pods)
    meta = raw.get("metadata") or {}
    status = raw.get("status") or {}
    if (not pods and create_held_back(raw)) or fence_ahead_marked(raw):
        return False  # requeued by its own Wait, not every scan
    if too_large_left_alone(raw):
        return False  # a new version of it (smaller, or deleted) comes through the watch
    terminal = status.get("phase") in TERMINAL_PHASES
    gated = any((p.get("spec") or {}).get("schedulingGates") for p in pods)
    return bool(status.get("pendingPod") or meta.get("deletionTimestamp") or gated
                or len(pods) > 1 or (not terminal and not _committed_pod_up(status, pods)))


def _committed_pod_up(status: RawObject, pods: list[RawObject]) -> bool:
    """The cached pods hold the committed pod (``status.podName``, of ``status.podUID``
    when recorded), neither terminating nor finished: what :func:`decide` needs to see
    to leave the VM alone. A VM whose cache shows otherwise needs a Restart, whatever
    its last reconcile concluded from an older view (docs/reconciler.md, "Progress
    without events")."""
    name, uid = status.get("podName"), status.get("podUID")
    pod = next((p for p in pods if (p.get("metadata") or {}).get("name") == name), None)
    if not name or pod is None:
        return False
    pod_meta = pod.get("metadata") or {}
    return not ((uid and pod_meta.get("uid") != uid) or pod_meta.get("deletionTimestamp")
                or (pod.get("status") or {}).get("phase") in TERMINAL_PHASES)


def object_key(raw: RawObject) -> str:
    """``namespace/name`` of a raw object."""
    meta = raw.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def mid_plan_keys(vms: Iterable[RawObject],
                  pods_of: Callable[[str], Iterable[RawObject]]) -> list[str]:
    """Keys of the VMs in ``vms`` that :func:`looks_mid_plan` with their pods
    (``pods_of(key)``): what the mid-plan scan requeues."""
    keys = []
    for raw in vms:
        key = object_key(raw)
        if looks_mid_plan(raw, pods_of(key)):
            keys.append(key)
    return keys
