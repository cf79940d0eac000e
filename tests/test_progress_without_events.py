"""Progress without events (docs/reconciler.md): whatever a turn concluded from a stale
view, a VM whose cache shows that it needs work is found by the mid-plan scan.

The case behind a flaky fault test (issue 29, item 0): a VM's runner pod is deleted, the
DELETED event reaches the pod cache, and the turn it brings up reads the cache *older*
than that event (the ``stale_reads`` fault serves a pod list the cache held before, or
the VM as it was before it existed). The turn sees the pod still running, or no VM, and
ends Done: the VM comes back only for its re-check,
300 s later. Nothing else brought it up: the resync's diff compares the caches with the
server, and they agree (the pod is gone from both); the mid-plan scan did not count a
committed pod missing from the cache as work. Pure logic, over
:class:`tests.support.fake_cluster.FakeCluster` and the stores the fault wiring keeps; the same
against the real servers is
``tests/test_reconcile_failover.py::test_stale_reads_dropped_events_and_conflicts_never_produce_a_second_pod``.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from neonvm.api import types
from neonvm.controller import actions as act
from neonvm.controller.fault_wiring import VersionedStore
from neonvm.controller.informer import project_pod
from neonvm.controller.midplan import MidPlanSet
from neonvm.controller.observe import CacheReader, pod_index
from neonvm.controller.reconciler import Reconciler, ReconcilerConfig
from neonvm.controller.scan import looks_mid_plan
from neonvm.controller.update import RetryPolicy
from tests.support import shipped_reconciler
from tests.support.authority import StaticAuthority
from tests.support.fake_cluster import FakeCluster

pytestmark = pytest.mark.unit

NS, NAME = "ns", "vm"
KEY = f"{NS}/{NAME}"
AUTHORITY = StaticAuthority(epoch=1, token=5)


class StaleRead(CacheReader):
    """Cache reads as the ``stale_reads`` fault may answer them, from the versions the
    stores kept: ``pods``, the VM's pod list as the cache held it before its last change;
    ``vm``, the VM as it was before the cache first held it (it did not exist)."""

    def __init__(self, vms: VersionedStore, pods: VersionedStore, what: str) -> None:
        super().__init__(vms, pods)
        self._versioned_vms, self._versioned_pods = vms, pods
        self._what = what

    def vm_raw(self, key: str) -> dict[str, Any] | None:
        if self._what == "vm":
            return self._versioned_vms.older(key)[0]
        return super().vm_raw(key)

    def pods_raw(self, key: str) -> list[dict[str, Any]]:
        if self._what == "pods":
            return self._versioned_pods.older_index(key)[-1]
        return super().pods_raw(key)


def reconciler(fake: FakeCluster, cache: CacheReader | None = None) -> Reconciler:
    return shipped_reconciler(client.ApiClient(), cluster=fake, cache=cache,
                              config=ReconcilerConfig(retry=RetryPolicy(initial_backoff=0.0,
                                                                max_backoff=0.0)))


def converged(fake: FakeCluster) -> dict[str, Any]:
    """A VM brought to a running committed pod by the shipped driver; its pod."""
    fake.add_vm({"apiVersion": types.API_VERSION, "kind": types.KIND,
                 "metadata": {"name": NAME, "namespace": NS, "generation": 1,
                              "finalizers": [types.FINALIZER]},
                 "spec": {"restartPolicy": "Always", "enableAcceleration": False,
                          "guest": {"rootDisk": {"image": "img"}}},
                 "status": {}})
    assert isinstance(reconciler(fake).reconcile(KEY, AUTHORITY, direct_first=True).action,
                      act.Done)
    pod = fake.pod(NS, (fake.vm(NS, NAME) or {})["status"]["podName"])
    assert pod is not None and not pod["spec"].get("schedulingGates")
    pod["spec"]["nodeName"] = "node-1"
    pod["status"] = {"phase": "Running", "podIP": "10.0.0.7"}
    pod["metadata"]["resourceVersion"] = fake.next_rv()
    assert isinstance(reconciler(fake).reconcile(KEY, AUTHORITY, direct_first=True).action,
                      act.Done)
    assert (fake.vm(NS, NAME) or {})["status"]["phase"] == "Running"
    return pod


@pytest.mark.parametrize("stale", ["pods", "vm"])
def test_a_vm_left_done_by_a_stale_turn_after_its_pod_was_deleted_is_found_by_the_scan(
        stale: str) -> None:
    fake = FakeCluster()
    pod = converged(fake)
    # The caches as the informers keep them (with the versions the fault serves from).
    vms, pods = VersionedStore(), VersionedStore(index=pod_index)
    vms.apply("ADDED", fake.vms[(NS, NAME)])
    pods.apply("ADDED", project_pod(pod))
    scan = MidPlanSet(vms, pods.by_index)
    assert scan.scan() == [], "converged: nothing for the scan"

    # A user deletes the pod; its DELETED event reaches the cache.
    del fake.pods[(NS, pod["metadata"]["name"])]
    pods.apply("DELETED", project_pod(pod))
    scan.touch(KEY)

    # The turn that event brings up reads the pod list from before it (the pod still
    # running), or the VM from before it existed: either way, Done.
    result = reconciler(fake, StaleRead(vms, pods, stale)).reconcile(KEY, AUTHORITY)
    assert isinstance(result.action, act.Done) and result.stuck is None
    # The cache (VM and pods) now agrees with the server, so the resync's diff finds
    # nothing; the VM's cached status names a pod the cache does not hold.
    assert pods.by_index(KEY) == []
    assert (vms.get(KEY) or {})["metadata"]["resourceVersion"] == \
        (fake.vm(NS, NAME) or {})["metadata"]["resourceVersion"]

    assert scan.scan() == [KEY], "the committed pod is gone from the cache: work to do"
    # The scan's requeue reads directly: the pod is gone, the VM restarts.
    reconciler(fake).reconcile(KEY, AUTHORITY, direct_first=True)
    status = (fake.vm(NS, NAME) or {})["status"]
    assert status["restartCount"] == 1
    assert status["podName"] != pod["metadata"]["name"]


def vm(**status: object) -> dict[str, Any]:
    return {"metadata": {"name": NAME, "namespace": NS}, "status": status}


def pod_of(name: str = "p", uid: str = "u1", *, terminating: bool = False,
           phase: str = "Running") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": uid}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {}, "status": {"phase": phase}}


@pytest.mark.parametrize(("pods", "why"), [
    ([], "the committed pod is not cached"),
    ([pod_of(name="other")], "only another pod is cached"),
    ([pod_of(uid="u2")], "a pod of that name but another uid"),
    ([pod_of(terminating=True)], "the committed pod is terminating"),
    ([pod_of(phase="Failed")], "the committed pod failed"),
    ([pod_of(phase="Succeeded")], "the committed pod succeeded"),
])
def test_a_committed_pod_not_up_in_the_cache_looks_mid_plan(pods: list[dict[str, Any]],
                                                            why: str) -> None:
    assert looks_mid_plan(vm(podName="p", podUID="u1", phase="Running"), pods), why


def test_a_committed_pod_up_in_the_cache_or_a_finished_vm_does_not() -> None:
    assert not looks_mid_plan(vm(podName="p", podUID="u1", phase="Running"), [pod_of()])
    assert not looks_mid_plan(vm(podName="p", phase="Pending"), [pod_of(phase="Pending")]), (
        "no uid recorded: the name is enough")
    assert not looks_mid_plan(vm(podName="p", podUID="u1", phase="Failed"), []), (
        "a terminal VM is never planned again")
