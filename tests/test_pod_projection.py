"""The slim pod cache: what cached decisions read survives :func:`project_pod`, and a
re-list replaces the store key by key (pure logic; the informer against a real API server
is in tests/test_reconcile_informer.py and tests/test_resync.py)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from neonvm.api import types
from neonvm.api.types import (
    FINALIZER,
    PendingPod,
    VirtualMachine,
    VirtualMachineSpec,
    VirtualMachineStatus,
)
from neonvm.controller import actions as act
from neonvm.controller import decide as d
from neonvm.controller import informer, podspec, scan
from neonvm.controller.acceleration import RUNNER_PORT_NAME, runner_port
from neonvm.controller.cluster import VMRecord
from neonvm.controller.informer import Informer, Store, project_pod
from neonvm.controller.observe import make_snapshot, pod_index, pod_view

pytestmark = pytest.mark.unit

UID = "0123456789abcdef"
LEASE = act.Fence(epoch=3, token=40)


def vm(**status: Any) -> VirtualMachine:
    return VirtualMachine(
        name="vm", namespace="ns", uid=UID, resource_version="100", generation=1,
        spec=VirtualMachineSpec(), status=VirtualMachineStatus(**status),
        finalizers=[FINALIZER])


def plan(seq: int) -> PendingPod:
    return PendingPod(name=f"vm-{UID[:8]}-{seq}", plan_seq=seq, token=40, epoch=3,
                      generation=1)


def full_pod(seq: int, *, gated: bool = True, phase: str | None = None,
             node: str | None = None, ip: str | None = None, terminating: bool = False,
             owner: str = UID, qos: str | None = None) -> dict[str, Any]:
    """A runner pod as the API server returns it: the real manifest, plus server fields."""
    pod = podspec.runner_pod(vm(), plan(seq))
    meta = pod["metadata"]
    meta.update(namespace="ns", uid=f"pod-uid-{seq}", resourceVersion=str(200 + seq),
                creationTimestamp="2026-01-01T00:00:00Z",
                managedFields=[{"manager": "neonvm", "fieldsV1": {"f:spec": {}}}])
    meta["ownerReferences"] = [{"apiVersion": types.API_VERSION, "kind": types.KIND,
                                "name": "vm", "uid": owner, "controller": True,
                                "blockOwnerDeletion": True}]
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    if not gated:
        pod["spec"].pop("schedulingGates", None)
    if node:
        pod["spec"]["nodeName"] = node
    pod["status"] = {"conditions": [{"type": "PodScheduled", "status": "True"}],
                     "containerStatuses": [{"name": "runner", "ready": True}]}
    if phase:
        pod["status"]["phase"] = phase
    if ip:
        pod["status"]["podIP"] = ip
    if qos:
        pod["status"]["qosClass"] = qos
    return pod


POD_VARIANTS = [
    full_pod(1),
    full_pod(1, gated=False, phase="Running", node="n1", ip="10.0.0.1"),
    full_pod(1, gated=False, phase="Succeeded", node="n1"),
    full_pod(1, gated=False, phase="Failed", node="n1"),
    full_pod(1, gated=False, phase="Running", node="n1", ip="10.0.0.1", terminating=True),
    full_pod(1, owner="someone-else"),
    full_pod(2, gated=False, phase="Pending", node="n2"),
    full_pod(1, gated=False, phase="Running", node="n1", ip="10.0.0.1", qos="Burstable"),
]

VM_STATES = [
    vm(),
    vm(pending_pod=plan(1), plan_seq=1),
    vm(pod_name=plan(1).name, pod_uid="pod-uid-1", plan_seq=1, phase="Running"),
    vm(pod_name=plan(1).name, pod_uid="pod-uid-1", plan_seq=1, phase="Pending"),
    vm(pod_name=plan(2).name, pod_uid="pod-uid-2", plan_seq=2, phase="Running"),
]


def test_projection_keeps_every_field_a_cached_decision_reads() -> None:
    assert RUNNER_PORT_NAME == informer.RUNNER_PORT_NAME
    for pod in POD_VARIANTS:
        slim = project_pod(copy.deepcopy(pod))
        assert pod_view(slim) == pod_view(pod)
        # What says whether the pod is behind the spec (decide.pod_behind) is kept.
        assert pod_view(slim).annotated == (1000, 1)
        assert pod_view(slim).cpu_request == (
            1000 if pod["status"].get("qosClass") == "Burstable" else None)
        # The slot size the pod was built with (the built-size annotation's third field)
        # is what stops live scaling after a memorySlotSize change: the cache keeps it.
        assert pod_view(slim).slot_bytes == podspec.slot_bytes(
            vm().spec.guest.memory_slot_size) is not None
        assert pod_index(slim) == pod_index(pod)
        assert slim["metadata"]["resourceVersion"] == pod["metadata"]["resourceVersion"]
        assert runner_port(slim, vm(), 1) == runner_port(pod, vm(), 1) != 1
        assert scan.looks_mid_plan({"metadata": {}, "status": {}}, [slim]) == \
            scan.looks_mid_plan({"metadata": {}, "status": {}}, [pod])


def test_decisions_on_projected_pods_are_the_decisions_on_full_pods() -> None:
    checked = 0
    for state in VM_STATES:
        record = VMRecord(vm=state, raw={"metadata": {"name": "vm", "namespace": "ns"}})
        for pods in ([], *([p] for p in POD_VARIANTS), POD_VARIANTS[:2], POD_VARIANTS[1:3]):
            for direct in (False, True):
                full = make_snapshot(record, [copy.deepcopy(p) for p in pods], LEASE, direct)
                slim = make_snapshot(record, [project_pod(copy.deepcopy(p)) for p in pods],
                                     LEASE, direct)
                assert d.decide(slim.obs) == d.decide(full.obs), (state, pods, direct)
                checked += 1
    assert checked > 50


def test_a_projected_pod_is_a_small_share_of_the_full_one() -> None:
    pod = POD_VARIANTS[1]
    slim = project_pod(copy.deepcopy(pod))
    assert types.ANNOTATION_TOKEN in slim["metadata"]["annotations"]
    # The runner container: its named port and CPU request (decide.pod_behind), nothing
    # else of it (no env, mounts, probes, limits).
    assert [set(c) for c in slim["spec"]["containers"]] == [{"name", "ports", "resources"}]
    assert slim["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "1"}}
    assert all(p["name"] == RUNNER_PORT_NAME for c in slim["spec"]["containers"]
               for p in c["ports"])
    # Of the resources annotation, only the two uses read (observe.annotated_size).
    assert json.loads(slim["metadata"]["annotations"][podspec.ANNOTATION_RESOURCES]) == {
        "cpus": {"use": 1}, "memorySlots": {"use": 1}}
    # A tiny VM's pod (its spec annotation is short; a real one's is kilobytes).
    assert len(json.dumps(slim)) * 3.5 < len(json.dumps(pod))


# ---- re-list: streamed, key by key ---------------------------------------------------------


class _Resp:
    def __init__(self, body: dict[str, Any]) -> None:
        self.data = json.dumps(body).encode()

    def release_conn(self) -> None:
        pass


def raw(name: str, rv: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}",
                         "resourceVersion": rv}}


def test_a_relist_is_paginated_and_replaces_key_by_key() -> None:
    """Pages are asked for with limit/continue; each page goes into the store before the
    next is fetched (never two copies of the list), changes reach the handler, and what
    the list no longer shows is deleted at the end."""
    store = Store()
    store.put(raw("gone", "1"))
    store.put(raw("same", "1"))
    pages = {None: ([raw("same", "1"), raw("new", "2")], "t1"),
             "t1": ([raw("other", "3")], None)}
    calls: list[dict[str, Any]] = []
    sizes_seen: list[int] = []

    def lister(**kw: Any) -> _Resp:
        calls.append(kw)
        sizes_seen.append(len(store.all_keys()))
        items, token = pages[kw.get("_continue")]
        return _Resp({"items": items, "metadata": {"resourceVersion": "9",
                                                   **({"continue": token} if token else {})}})

    changes: list[tuple[str, bool]] = []
    informer = Informer("t", lister, store, lambda k, o, n: changes.append((k, n is None)),
                        relist_page=2)
    assert informer._relist() == "9"
    assert [c.get("limit") for c in calls] == [2, 2]
    assert [c.get("_continue") for c in calls] == [None, "t1"]
    assert sizes_seen == [2, 3], "the first page was in the store before the second came"
    assert sorted(changes) == [("ns/gone", True), ("ns/new", False), ("ns/other", False)]
    assert sorted(store.all_keys()) == ["ns/new", "ns/other", "ns/same"]


# ---- the compact store: objects kept serialized ---------------------------------------------


def test_a_compact_store_reads_back_what_was_stored_as_fresh_copies() -> None:
    store = Store(index=pod_index, compact=True)
    pod = project_pod(copy.deepcopy(POD_VARIANTS[1]))
    key = informer.object_key(pod)
    vm_key = pod_index(pod)
    assert vm_key is not None
    store.put(pod)

    assert store.get(key) == pod
    assert store.by_index(vm_key) == [pod]
    assert store.values() == [pod]
    # A reader cannot change the cache through what it was handed.
    store.get(key)["metadata"]["name"] = "changed"  # type: ignore[index]
    assert store.get(key) == pod
    # What it holds is one bytes value per object, a fraction of the decoded dicts.
    [held] = store._items.values()
    assert isinstance(held, bytes) and len(held) < 2 * len(json.dumps(pod))


def test_a_compact_store_reports_changes_and_deletions_like_the_plain_one() -> None:
    plain, compact = Store(index=pod_index), Store(index=pod_index, compact=True)
    first = project_pod(copy.deepcopy(POD_VARIANTS[1]))
    second = copy.deepcopy(first)
    second["metadata"]["resourceVersion"] = "999"
    for store in (plain, compact):
        assert store.put(first) is not None
        assert store.put(copy.deepcopy(first)) is None  # same version: no change
        key, old, new = store.apply("MODIFIED", second)
        assert (old, new) == (first, second)
        key, old, new = store.apply("DELETED", second)
        assert (old, new) == (second, None)
        assert store.get(key) is None and store.by_index(pod_index(first) or "") == []


def test_a_compact_store_decodes_the_stored_object_once_per_relisted_item() -> None:
    store = Store(index=pod_index, compact=True)
    first = project_pod(copy.deepcopy(POD_VARIANTS[1]))
    store.put(first)
    decodes = 0
    unpack = store._unpack

    def counting(stored: Any) -> Any:
        nonlocal decodes
        decodes += 1
        return unpack(stored)

    store._unpack = counting
    newer = copy.deepcopy(first)
    newer["metadata"]["resourceVersion"] = "999"
    assert store.put(newer) is not None
    # One decode: the version check's copy is the one the change reports as old.
    assert decodes == 1
