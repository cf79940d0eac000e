"""The look at a committed pod's runner after a scaling plan was dropped: when, and for how long.

A ``PUT /scale`` of a dropped plan may still change the guest for
:data:`LATE_PUT_SECONDS`; these rules say when the runner is asked ``GET /scale`` and
when its answer may end the look (docs/protocol.md, "A plan dropped while a PUT of it
is on its way").
"""

from __future__ import annotations

import datetime as dt

from neonvm.api import times
from neonvm.api.types import VirtualMachine
from neonvm.controller.reasons import DROP_REASONS, SCALING_CONDITION

LATE_PUT_SECONDS = 300.0
"""The late-PUT window: how long after a plan was dropped (``status.scaleLookSince``,
written by the drop) a ``PUT /scale`` of it may still change the guest. Only a settled
answer of the runner asked past it ends the look (:func:`look_may_end`); within it a
size the runner reports is adopted but the look goes on. A ``PUT /scale`` the runner
received changes the guest at most about 130 s later (it waits up to 60 s for the
request lock, then applies within 60 s + 10 s): the other 170 s or so are for a request
sent just before the drop and delivered late (docs/protocol.md, "A plan dropped while a
PUT of it is on its way", says what this bound rests on)."""


LOOK_GIVE_UP_SECONDS = 3600.0
"""How long after the drop a look that no settled answer could end (the runner does not
answer, does not name its pod, a removal stays pending) goes on: then a write ends it
and adopts nothing (:func:`look_given_up`, ``CommitScale.gives_up``), so that a look
costs at most this many seconds of ``GET /scale`` per resync."""



def look_pending(vm: VirtualMachine) -> bool:
    """Whether status asks for the committed pod's runner to be looked at after a drop:
    no plan recorded and ``status.scaleLookPodUID`` names the committed pod. The drop
    that sets it is the only record that a PUT of the dropped plan may have changed the
    guest, and it is in status (not in a controller's memory), so a new leader, or a
    controller whose adopting write failed, looks again. A VM stored before the field
    existed has none: it is looked at within the window only
    (:func:`looks_after_drop`)."""
    s = vm.status
    return (s.pending_scale is None and bool(s.pod_uid)
            and s.scale_look_pod_uid == s.pod_uid)



def look_age(vm: VirtualMachine, now: dt.datetime | None) -> float | None:
    """Seconds from the drop that asked for the look (``status.scaleLookSince``) to
    ``now``; None: ``now`` None (the explorer's open window, hand-built observations).
    A look recorded without its time (by a controller of this development branch that
    wrote ``scaleLookPodUID`` alone) counts as older than any bound: its window has
    passed. Only the look's own time counts, never the Scaling condition's: a write
    that changes the condition (a new leader's Wait) says nothing about the drop."""
    if now is None:
        return None
    since = times.parse(vm.status.scale_look_since)
    if since is None:
        return float("inf")
    return (times.utc(now) - since).total_seconds()



def look_may_end(vm: VirtualMachine, now: dt.datetime | None) -> bool:
    """Whether a settled answer of the runner asked at ``now`` may end the look
    (:func:`look_pending`): the late-PUT window of the drop has passed by ``now`` (taken
    before the runner was asked), measured from ``status.scaleLookSince``
    (:func:`look_age`). By the window's assumption every PUT of the dropped plan has
    landed by then, and no later PUT changes the guest without a new plan (which
    ``scaleSeq`` fences out of the write), so that answer says the size the guest
    keeps. ``now`` None: never."""
    age = look_age(vm, now)
    return look_pending(vm) and age is not None and age >= LATE_PUT_SECONDS



def look_given_up(vm: VirtualMachine, now: dt.datetime | None) -> bool:
    """Whether the look (:func:`look_pending`) has gone on for
    :data:`LOOK_GIVE_UP_SECONDS` since the drop: it is ended by a write that adopts
    nothing (``CommitScale.gives_up``) when no settled answer ended it first."""
    age = look_age(vm, now)
    return look_pending(vm) and age is not None and age >= LOOK_GIVE_UP_SECONDS



def looks_at_runner(vm: VirtualMachine, now: dt.datetime | None) -> bool:
    """Whether an observation of ``vm`` at ``now`` asks the committed pod's runner
    ``GET /scale``: a plan is recorded, or one was dropped within the window
    (:func:`looks_after_drop`), or status still asks for the look
    (:func:`look_pending`). A VM at its size with no such record is not looked at."""
    return (vm.status.pending_scale is not None or look_pending(vm)
            or looks_after_drop(vm, now))



def looks_after_drop(vm: VirtualMachine, now: dt.datetime | None) -> bool:
    """Whether the committed pod's runner is to be looked at although no plan is
    recorded: the last plan was dropped (Scaling=False with a :data:`DROP_REASONS`
    reason) less than :data:`LATE_PUT_SECONDS` ago (by the condition's
    lastTransitionTime and this replica's clock; ``now`` None: always). A ``PUT /scale``
    of the dropped plan sent earlier (by a deposed leader, or this controller's own
    request that timed out) may still change the guest; nobody would look otherwise."""
    s = vm.status
    if s.pending_scale is not None or not s.pod_name:
        return False
    cond = next((c for c in s.conditions if c.type == SCALING_CONDITION), None)
    if cond is None or cond.status != "False" or cond.reason not in DROP_REASONS:
        return False
    if now is None:
        return True
    at = times.parse(cond.last_transition_time)
    return at is not None and (times.utc(now) - at).total_seconds() < LATE_PUT_SECONDS
