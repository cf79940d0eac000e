"""The mid-plan scan decides again only for the VMs whose cache changed, and answers what
a scan of the whole cache would (``scan.mid_plan_keys``)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from neonvm.controller.midplan import MidPlanSet
from neonvm.controller.scan import mid_plan_keys

pytestmark = pytest.mark.unit

Obj = dict[str, Any]
GATED = {"metadata": {"name": "p"}, "spec": {"schedulingGates": [{"name": "g"}]}}
RUNNING: Obj = {"metadata": {"name": "p"}, "spec": {}}


def vm(name: str, **status: object) -> Obj:
    return {"metadata": {"name": name, "namespace": "ns"}, "status": status}


class Cache:
    """A cache that counts its reads."""

    def __init__(self) -> None:
        self.vms: dict[str, Obj] = {}
        self.pods: dict[str, list[Obj]] = {}
        self.reads = 0

    def get(self, key: str) -> Obj | None:
        self.reads += 1
        return self.vms.get(key)

    def all_keys(self) -> list[str]:
        return list(self.vms)

    def pods_of(self, key: str) -> list[Obj]:
        return self.pods.get(key, [])

    def whole_scan(self) -> list[str]:
        return sorted(mid_plan_keys(list(self.vms.values()), self.pods_of))


def test_the_first_scan_looks_at_every_vm_and_later_scans_only_at_the_changed_ones() -> None:
    cache = Cache()
    for i in range(100):
        cache.vms[f"ns/vm-{i}"] = vm(f"vm-{i}", podName="p")
        cache.pods[f"ns/vm-{i}"] = [RUNNING]
    cache.vms["ns/vm-7"] = vm("vm-7")  # no committed pod: mid-plan
    mid = MidPlanSet(cache, cache.pods_of, full_every=1000)
    assert mid.scan() == ["ns/vm-7"]
    assert cache.reads == 100

    cache.reads = 0
    cache.vms["ns/vm-7"] = vm("vm-7", podName="p")
    mid.touch("ns/vm-7")
    cache.pods["ns/vm-3"] = [GATED]
    mid.touch("ns/vm-3")
    assert mid.scan() == ["ns/vm-3"]
    assert cache.reads == 2, "only the two that changed were decided again"

    cache.reads = 0
    assert mid.scan() == ["ns/vm-3"], "nothing changed: the answer holds"
    assert cache.reads == 0


def test_a_deleted_vm_leaves_the_set() -> None:
    cache = Cache()
    cache.vms["ns/a"] = vm("a")
    mid = MidPlanSet(cache, cache.pods_of)
    assert mid.scan() == ["ns/a"]
    del cache.vms["ns/a"]
    mid.touch("ns/a")
    assert mid.scan() == []


def test_a_change_nobody_reported_is_caught_by_the_next_full_scan() -> None:
    cache = Cache()
    cache.vms["ns/a"] = vm("a", podName="p")
    cache.pods["ns/a"] = [RUNNING]
    mid = MidPlanSet(cache, cache.pods_of, full_every=3)
    assert mid.scan() == []
    cache.vms["ns/a"] = vm("a", podName="p", pendingPod={"name": "p2"})  # not touched
    assert mid.scan() == []
    assert mid.scan() == []
    assert mid.scan() == ["ns/a"], "the third scan after the first decides for every VM"


def test_over_random_changes_every_scan_answers_what_a_whole_scan_would() -> None:
    rng = random.Random(20261204)
    cache = Cache()
    mid = MidPlanSet(cache, cache.pods_of, full_every=1000)
    shapes: list[tuple[dict[str, object], list[Obj]]] = [
        ({"podName": "p"}, [RUNNING]), ({}, []), ({"podName": "p"}, [GATED]),
        ({"podName": "p", "pendingPod": {"name": "q"}}, [RUNNING]),
        ({"podName": "p"}, [RUNNING, RUNNING]), ({"phase": "Succeeded"}, [])]
    for _ in range(300):
        key = f"ns/vm-{rng.randrange(30)}"
        if rng.random() < 0.1:
            cache.vms.pop(key, None)
            cache.pods.pop(key, None)
        else:
            status, pods = rng.choice(shapes)
            cache.vms[key] = vm(key.split("/")[1], **status)
            cache.pods[key] = list(pods)
        mid.touch(key)
        if rng.random() < 0.3:
            assert mid.scan() == cache.whole_scan()
    assert mid.scan() == cache.whole_scan()


def test_a_vm_evicted_from_the_cache_without_a_report_leaves_the_set_at_the_next_scan() -> None:
    cache = Cache()
    cache.vms["ns/a"] = vm("a", podName="p")
    cache.pods["ns/a"] = [GATED]
    mid = MidPlanSet(cache, cache.pods_of, full_every=1000)
    assert mid.scan() == ["ns/a"]
    del cache.vms["ns/a"]  # Store.discard: no informer event, so no touch
    assert mid.scan() == []
