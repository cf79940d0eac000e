"""A VM that grows past the VM cache's bound (docs/security.md, "Exhaustion"; review
F2): its running guest keeps its right to run, the controller leaves its pod alone and
says so (Degraded ``ObjectTooLarge``), and a VM shrunk below the bound is reconciled as
usual again (neonvm/controller/too_large.py). Pure logic over the shipped informer,
rights check and reconciler, with the API server faked (``-m unit``)."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from neonvm.api import types
from neonvm.api.rights import RIGHT_SECONDS_ANNOTATION
from neonvm.controller import actions as act
from neonvm.controller.informer import MAX_CACHED_VM_BYTES, Informer, Store, too_large
from neonvm.controller.observe import CacheReader, pod_index
from neonvm.controller.reasons import DEGRADED, OBJECT_TOO_LARGE, RECOVERED
from neonvm.controller.rights import CurrentPod, current_pod
from neonvm.controller.scan import looks_mid_plan
from tests.support import shipped_reconciler
from tests.support.authority import StaticAuthority
from tests.support.fake_cluster import FakeCluster
from tests.support.watch_answer import modified

pytestmark = pytest.mark.unit

NS, NAME = "ns", "v"
KEY = f"{NS}/{NAME}"
BLOB = "tenant.example/notes"


def watch_into(store: Store, *objects: dict[str, Any]) -> None:
    """The shipped VM informer's watch delivers ``objects`` into ``store``."""
    Informer("virtualmachines", lambda **kw: modified(*objects), store, lambda *a: None,
             on_undecodable=lambda found: None,
             max_object_bytes=MAX_CACHED_VM_BYTES)._watch("1")


def grown(vm: dict[str, Any], rv: str) -> dict[str, Any]:
    """``vm`` with a tenant's annotation that takes it past the bound."""
    meta = {**vm["metadata"], "resourceVersion": rv,
            "annotations": {BLOB: "x" * MAX_CACHED_VM_BYTES}}
    return {**vm, "metadata": meta}


# ---- the runner's right ------------------------------------------------------------------


def test_a_vm_that_grows_past_the_bound_keeps_its_runners_right() -> None:
    """The old informer dropped it from the cache, and the rights endpoint refused its
    runner ("no such VM in the leader's cache"): a self-fencing guest was killed within
    30 s. Cached as a stub, its uid and status still name the running pod."""
    vm = {"metadata": {"name": NAME, "namespace": NS, "uid": "vm-uid", "resourceVersion": "1"},
          "spec": {}, "status": {"podName": "v-pod", "podUID": "pod-uid", "phase": "Running"}}
    pod = {"metadata": {"name": "v-pod", "namespace": NS, "uid": "pod-uid",
                        "labels": {types.LABEL_VM_NAME: NAME},
                        "annotations": {RIGHT_SECONDS_ANNOTATION: "30"},
                        "ownerReferences": [{"uid": "vm-uid", "controller": True}]}}
    vms, pods = Store(compact=True), Store(index=pod_index)
    vms.put(vm)
    pods.put(pod)
    assert isinstance(current_pod(vms, pods, NS, NAME, "pod-uid"), CurrentPod)
    watch_into(vms, grown(vm, "5"))
    assert too_large(vms.get(KEY)) is not None
    assert isinstance(current_pod(vms, pods, NS, NAME, "pod-uid"), CurrentPod)
    assert current_pod(vms, pods, NS, NAME, "another-pod") == "not the VM's current pod"


# ---- the reconciler ----------------------------------------------------------------------


def vm_object() -> dict[str, Any]:
    """A VM with no pod and no plan: decide's next answer is RecordPlan (a new pod)."""
    return {"apiVersion": types.API_VERSION, "kind": types.KIND,
            "metadata": {"name": NAME, "namespace": NS, "generation": 1,
                         "finalizers": [types.FINALIZER]},
            "spec": {"restartPolicy": "Always", "enableAcceleration": False,
                     "guest": {"rootDisk": {"image": "img"}}},
            "status": {}}


def degraded(fake: FakeCluster) -> dict[str, Any] | None:
    status = (fake.vm(NS, NAME) or {}).get("status") or {}
    return next((c for c in [*(status.get("conditions") or []),
                             *(status.get("extraConditions") or [])]
                 if c.get("type") == DEGRADED), None)


def reconcile_from(fake: FakeCluster, cache: Store) -> Any:
    reconciler = shipped_reconciler(client.ApiClient(), cluster=fake,
                                    cache=CacheReader(cache, Store(index=pod_index)))
    return reconciler.reconcile(KEY, StaticAuthority(epoch=1, token=5))


def test_a_vm_too_large_to_cache_is_left_alone_and_degraded_until_it_shrinks() -> None:
    fake = FakeCluster()
    fake.add_vm(vm_object())
    big = fake.vms[(NS, NAME)]
    big["metadata"]["annotations"] = {BLOB: "x" * MAX_CACHED_VM_BYTES}
    cache = Store(compact=True)
    watch_into(cache, big)

    # From the stub: read directly; nothing planned, Degraded written, Done.
    result = reconcile_from(fake, cache)
    assert isinstance(result.action, act.Done) and result.stuck is None
    cond = degraded(fake)
    assert cond is not None and (cond["status"], cond["reason"]) == ("True", OBJECT_TOO_LARGE)
    assert f"more than the {MAX_CACHED_VM_BYTES:,}" in cond["message"]
    status = fake.vm(NS, NAME)["status"]  # type: ignore[index]
    assert not status.get("pendingPod") and not fake.pods
    assert status.get("observedGeneration") is None  # nothing said of a spec not acted on

    # Its next look (the echo of that write) starts from the stub, now marked: no read
    # of up to 1.5 MiB, and the mid-plan scan leaves it alone.
    watch_into(cache, fake.vms[(NS, NAME)])
    stub = cache.get(KEY)
    assert stub is not None and "spec" not in stub
    assert not looks_mid_plan(stub, [])
    reads, writes = fake.count("get_vm_raw"), fake.count("put_status")
    assert isinstance(reconcile_from(fake, cache).action, act.Done)
    assert (fake.count("get_vm_raw"), fake.count("put_status")) == (reads, writes)

    # Shrunk below the bound: cached whole, reconciled as usual, Degraded cleared.
    del fake.vms[(NS, NAME)]["metadata"]["annotations"]
    fake.vms[(NS, NAME)]["metadata"]["resourceVersion"] = fake.next_rv()
    watch_into(cache, fake.vms[(NS, NAME)])
    assert too_large(cache.get(KEY)) is None
    reconcile_from(fake, cache)
    assert fake.vm(NS, NAME)["status"].get("podName") or \
        fake.vm(NS, NAME)["status"].get("pendingPod")  # type: ignore[index]
    cond = degraded(fake)
    assert cond is not None and (cond["status"], cond["reason"]) == ("False", RECOVERED)


def test_a_vm_too_large_to_cache_is_still_deleted() -> None:
    """Its deletion needs no spec: from a direct read its pods go and its finalizer with
    them, as for any VM."""
    fake = FakeCluster()
    fake.add_vm(vm_object())
    big = fake.vms[(NS, NAME)]
    big["metadata"]["annotations"] = {BLOB: "x" * MAX_CACHED_VM_BYTES}
    big["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    cache = Store(compact=True)
    watch_into(cache, big)
    assert too_large(cache.get(KEY)) is not None
    reconcile_from(fake, cache)
    assert fake.vm(NS, NAME) is None
