"""The handler's turns brought up by the echoes of our own writes: direct read or cache.

Specifications over fakes (pure: no servers), beside the real-server figure of
``python -m benchmarks.api_calls`` (docs/benchmarks.md, "API calls per VM by verb"):

* after a Wait, the key's delayed turn reads directly, but a watch event that brings it
  back earlier (the echo of the reconcile's own status write, mostly) starts from the
  cache;
* a turn from the cache whose cache is behind what the VM's last reconcile already saw
  (an older resourceVersion of the VM or of one of its pods) reads and writes nothing:
  the events still on their way bring the key back.
"""

from __future__ import annotations

from typing import Any

import pytest

from neonvm.controller import actions as act
from neonvm.controller.handler import cache_behind
from neonvm.controller.reconciler import ReconcileResult, Seen
from neonvm.controller.workqueue import WorkQueue
from tests.support.handler import KEY, World

pytestmark = pytest.mark.unit


def vm_at(rv: str, uid: str = "u1") -> dict[str, Any]:
    return {"metadata": {"name": "vm", "namespace": "ns", "uid": uid, "resourceVersion": rv}}


def pod_at(rv: str) -> dict[str, Any]:
    return {"metadata": {"name": "vm-1", "namespace": "ns", "resourceVersion": rv}}


class Pods:
    def __init__(self, **pods: dict[str, Any]) -> None:
        self.pods = {f"ns/{name.replace('_', '-')}": pod for name, pod in pods.items()}

    def get(self, key: str) -> dict[str, Any] | None:
        return self.pods.get(key)


SEEN = Seen(uid="u1", vm="120", pods=(("ns/vm-1", "118"),))


def waited(seen: Seen | None = SEEN) -> ReconcileResult:
    return ReconcileResult(action=act.Wait(seconds=5.0, reason="pod pending"),
                           requeue_after=5.0, steps=3, seen=seen)


def done() -> ReconcileResult:
    return ReconcileResult(action=act.Done(reason="converged"), requeue_after=300.0, steps=0)


def test_an_echo_after_a_wait_starts_from_the_cache_and_the_timer_turn_reads_directly(
) -> None:
    w = World(waited(None))
    w.turn()
    w.queue.add(KEY)  # the echo of the reconcile's last write, before the Wait is due
    taken = w.queue.take(0)
    assert taken is not None and taken.direct is False, (
        "a watch event after a Wait took the Wait's direct flag")
    w.queue.done(KEY)
    assert w.next_turn_at() == (5.0, True)


def test_direct_when_due_marks_the_flag_only_when_the_time_is_up() -> None:
    clock = [0.0]
    q = WorkQueue(clock=lambda: clock[0])
    q.add_after(KEY, 2.0, direct_when_due=True)
    assert q.take(0) is None
    clock[0] = 2.0
    taken = q.take(0)
    assert taken is not None and taken.direct is True


def test_a_cache_turn_behind_the_last_reconcile_reads_nothing_and_comes_back() -> None:
    w = World(waited(), done())
    w.turn(direct=True)
    w.cache.raw = vm_at("110")  # the cache has not yet seen the reconcile's writes
    w.handler._pods = Pods(vm_1=pod_at("118"))
    out = w.handler.process(KEY, False)
    assert out.kind == "behind", f"reconciled from a cache behind its own writes: {out}"
    assert w.reconciler.direct_first == [True]  # the skipped turn did not reconcile
    w.cache.raw = vm_at("120")  # the echo arrived
    assert w.handler.process(KEY, False).kind == "requeue"
    assert w.reconciler.direct_first == [True, False]


@pytest.mark.parametrize(("vm", "pod", "behind"), [
    (vm_at("119"), pod_at("118"), True),   # the VM's echo is still on its way
    (vm_at("120"), pod_at("117"), True),   # the pod's is
    (vm_at("120"), pod_at("118"), False),  # caught up
    (vm_at("125"), pod_at("130"), False),  # ahead: someone else's news
    # Someone else changed the VM while a pod's event was lost: never held back by it.
    (vm_at("125"), pod_at("117"), False),
    (vm_at("119", uid="u2"), pod_at("118"), False),  # another VM of that name
    (vm_at("120"), None, False),           # the pod gone from the cache is news
    (vm_at("x"), pod_at("118"), False),    # not a number: nothing skipped
    (None, pod_at("118"), False),          # no cached VM: read directly
])
def test_cache_behind(vm: dict[str, Any] | None, pod: dict[str, Any] | None,
                      behind: bool) -> None:
    pods = Pods(vm_1=pod) if pod is not None else Pods()
    assert cache_behind(SEEN, vm, pods) is behind


def test_a_direct_turn_is_never_skipped() -> None:
    w = World(waited(), done())
    w.turn(direct=True)
    w.cache.raw = vm_at("110")
    assert w.handler.process(KEY, True).kind == "requeue"
    assert w.reconciler.direct_first == [True, True]


def test_behind_tells_the_mid_plan_scan_which_vms_their_events_will_bring_up() -> None:
    w = World(waited())
    assert w.handler.in_hand(KEY) is False  # never reconciled: nothing known
    w.turn(direct=True)
    w.handler._pods = Pods(vm_1=pod_at("117"))  # the ungate's echo still on its way
    w.cache.raw = vm_at("120")
    assert w.handler.in_hand(KEY) is True
    w.handler._pods = Pods(vm_1=pod_at("118"))
    assert w.handler.in_hand(KEY) is False
