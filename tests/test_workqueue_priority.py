"""The work queue's two lines, and the handler's cached re-check of converged VMs (pure
logic; the same against real servers is tests/test_resync.py)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from loguru import logger

from neonvm.controller import actions as act
from neonvm.controller.handler import Handler, Outcome
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.reconciler import ReconcileResult
from neonvm.controller.timers import Jitter, VMTimers
from neonvm.controller.workqueue import WorkQueue

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drain(q: WorkQueue) -> list[str]:
    out = []
    while (taken := q.take(0)) is not None:
        out.append(taken.key)
        q.done(taken.key)
    return out


def test_event_driven_keys_go_ahead_of_periodic_ones() -> None:
    q = WorkQueue()
    for i in range(3):
        q.add(f"p{i}", periodic=True)
    q.add("e0")
    q.add("e1")
    assert len(q) == 5 and q.periodic_waiting() == 3
    assert drain(q) == ["e0", "e1", "p0", "p1", "p2"]


def test_a_periodic_key_added_by_an_event_moves_up_and_is_handed_out_once() -> None:
    q = WorkQueue()
    q.add("a", periodic=True)
    q.add("b", periodic=True)
    q.add("b")  # a watch event for b
    assert drain(q) == ["b", "a"], "b moved up, and its old place is skipped"


def test_an_event_added_while_the_key_is_processed_requeues_it_in_the_first_line() -> None:
    q = WorkQueue()
    q.add("x", periodic=True)
    q.add("a")
    assert q.get(0) == "a"
    q.add("a", periodic=True)
    q.add("a")  # the event wins over the periodic add
    q.done("a")
    assert drain(q) == ["a", "x"]


def test_a_periodic_add_while_processing_stays_periodic() -> None:
    q = WorkQueue()
    assert (q.add("a"), q.get(0)) == (None, "a")
    q.add("a", periodic=True)
    q.add("b")
    q.done("a")
    assert drain(q) == ["b", "a"]


def test_delayed_periodic_keys_come_due_in_the_second_line_unless_an_event_asked() -> None:
    clock = FakeClock()
    q = WorkQueue(clock=clock)
    q.add_after("p", 5, periodic=True)
    q.add_after("e", 5, periodic=True)
    q.add_after("e", 9)  # later, but not periodic: e counts as event-driven
    q.add("now")
    clock.now = 6
    assert drain(q) == ["now", "e", "p"]


def test_jitter_stretches_the_period_by_up_to_its_spread() -> None:
    jitter = Jitter(100.0, 0.25, rng=random.Random(7))
    values = [jitter() for _ in range(200)]
    assert all(100.0 <= v < 125.0 for v in values)
    assert max(values) - min(values) > 10, "spread out, not one lump"


# ---- the handler: converged VMs come back from the cache, periodic -------------------------


class _Cache:
    def get(self, key: str) -> dict[str, Any] | None:
        return {"metadata": {"name": "vm", "namespace": "ns", "uid": "u1"}}

    def discard(self, key: str, uid: str) -> bool:
        return False


class _Reconciler:
    def __init__(self, action: act.Action, after: float) -> None:
        self.result = ReconcileResult(action=action, requeue_after=after, steps=0)

    def reconcile(self, key: str, authority: Any, *,
                  direct_first: bool = False) -> ReconcileResult:
        return self.result


def handler_for(action: act.Action, after: float, clock: FakeClock,
                recheck: float | None) -> Handler:
    return Handler(
        queue=WorkQueue(clock=clock), vms=_Cache(), reconciler=_Reconciler(action, after),
        read_vm=lambda ns, name: None, acquire=lambda ns, name, uid: object(),  # type: ignore[arg-type,return-value]
        authority=lambda guard: object(),  # type: ignore[arg-type,return-value]
        release_lock=lambda key: None, timers=VMTimers(clock=clock),
        term_ending=lambda: False, end_term=lambda: None, metrics=ControllerMetrics(),
        log=logger, recheck=(lambda: recheck) if recheck is not None else None)


def test_a_converged_vm_is_rechecked_from_the_cache_in_the_second_line_after_the_recheck(
        ) -> None:
    clock = FakeClock()
    h = handler_for(act.Done(), 30.0, clock, recheck=300.0)
    assert h.process("ns/vm", direct=False) == Outcome("requeue", after=30.0, converged=True)
    clock.now = 299
    assert h.queue.take(0) is None, "not at the reconcile's 30 s: at the recheck"
    clock.now = 301
    h.queue.add("ns/event")
    assert h.queue.take(0) == ("ns/event", False), "event-driven work first"
    assert h.queue.take(0) == ("ns/vm", False), "then the re-check, read from the cache"


def test_a_wait_still_comes_back_after_its_wait_read_directly_first_line() -> None:
    clock = FakeClock()
    h = handler_for(act.Wait(seconds=2.0), 2.0, clock, recheck=300.0)
    assert h.process("ns/vm", direct=False) == Outcome("requeue", after=2.0)
    clock.now = 2.5
    assert h.queue.take(0) == ("ns/vm", True), "read directly"
    h.queue.done("ns/vm")
    assert h.queue.periodic_waiting() == 0


def test_a_key_is_queued_while_it_waits_for_a_worker_only() -> None:
    """What the mid-plan scan asks before it flags a key direct: a key already waiting
    gets its turn anyway (a new VM's first, from the cache), so the scan leaves it be."""
    clock = FakeClock()
    q = WorkQueue(clock=clock)
    q.add_after("ns/later", 5.0)
    q.add("ns/vm")
    assert q.queued("ns/vm") and not q.queued("ns/later") and not q.queued("ns/other")
    taken = q.take(0)
    assert taken is not None and taken.key == "ns/vm" and not taken.direct
    assert not q.queued("ns/vm")  # being processed: the handler's in_hand says so
    q.add("ns/vm")  # an event while it is processed: it waits again
    assert q.queued("ns/vm")
    q.done("ns/vm")
    assert q.queued("ns/vm")
    clock.now = 6.0
    assert drain(q) == ["ns/vm", "ns/later"] and not q.queued("ns/later")


def test_the_queue_tells_how_long_each_taken_key_waited_ready_in_its_line() -> None:
    """What ``neonvm_controller_queue_wait_seconds`` is fed: the time from ready to taken,
    by line, not a delay before the key was due."""
    clock = FakeClock()
    waits: list[tuple[str, float, bool]] = []
    q = WorkQueue(clock=clock, on_wait=lambda s, periodic: waits.append(("?", s, periodic)))
    q.add("e")
    q.add("p", periodic=True)
    q.add_after("d", 5.0)
    clock.now = 2.0
    assert q.take(0) == ("e", False)
    assert waits[-1][1:] == (2.0, False)
    q.add("e")  # a watch event while "e" is being handled: ready when it is done
    clock.now = 3.0
    assert q.take(0) == ("p", False)
    assert waits[-1][1:] == (3.0, True), "the second line"
    q.done("p")
    clock.now = 4.0
    q.done("e")
    clock.now = 6.0  # "d" is due at 5.0: ready from then, not from its add_after
    assert q.take(0) == ("e", False)
    assert waits[-1][1:] == (2.0, False), "from the end of its previous turn"
    clock.now = 6.5
    assert q.take(0) == ("d", False)
    assert waits[-1][1:] == (1.5, False)
    assert len(waits) == 4
