"""Two races the driver meets at the API server, over the in-memory cluster
(``tests/support/fake_cluster.py``) and the shipped reconciler:

* the planned pod name is taken by a pod not labelled for the VM: every create answers
  AlreadyExists and the labelled list never shows that pod; the driver must drop the plan,
  not create again and again;
* another actor creates the planned pod and commits it to the VM's status between the
  driver's pod list and its VM read: "pod gone" must not be judged from the list taken
  before the VM read (docs/protocol.md, step 4), or a healthy VM is restarted.

Pure: no servers.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from neonvm.api import types
from neonvm.api.types import FINALIZER, PendingPod, VirtualMachine
from neonvm.controller import podspec
from neonvm.controller.reconciler import Reconciler, ReconcilerConfig
from tests.support import shipped_reconciler
from tests.support.authority import StaticAuthority
from tests.support.fake_cluster import FakeCluster

pytestmark = pytest.mark.unit

UID = "0123456789abcdef"
NS = "ns"
PLANNED = f"vm-{UID[:8]}-1"


def vm_object(status: dict[str, Any], name: str = "vm") -> dict[str, Any]:
    return {
        "apiVersion": types.API_VERSION, "kind": types.KIND,
        "metadata": {"name": name, "namespace": NS, "uid": UID, "resourceVersion": "10",
                     "generation": 1, "finalizers": [FINALIZER]},
        "spec": {"restartPolicy": "Always", "guest": {"rootDisk": {"image": "img"}}},
        "status": status,
    }


def reconciler_on(fake: FakeCluster) -> Reconciler:
    """The shipped reconciler over ``fake``."""
    return shipped_reconciler(client.ApiClient(), cluster=fake,
                              config=ReconcilerConfig(max_steps=30))


def pending_vm() -> dict[str, Any]:
    """A VM whose plan names the pod :data:`PLANNED`, not yet created."""
    return vm_object({"phase": "Pending", "planSeq": 1,
                      "pendingPod": {"name": PLANNED, "planSeq": 1, "token": 1, "epoch": 1,
                                     "generation": 1}})


def runner_pod_object(vm: dict[str, Any], name: str) -> dict[str, Any]:
    """A pod exactly as the controller would have created it for ``vm``."""
    decoded = VirtualMachine.from_object(vm)
    plan = PendingPod(name=name, plan_seq=1, token=1, epoch=1, generation=1)
    pod = podspec.runner_pod(decoded, plan)
    pod["metadata"].update(uid=f"uid-{name}", resourceVersion="50")
    pod["status"] = {"phase": "Pending"}
    return pod


def test_a_planned_name_taken_by_a_pod_not_labelled_for_the_vm_does_not_spin() -> None:
    fake = FakeCluster()
    fake.add_vm(pending_vm())
    fake.add_pod({"metadata": {"name": PLANNED, "namespace": NS, "uid": "intruder",
                               "labels": {"app": "something-else"}},
                  "spec": {"containers": [{"name": "c", "image": "i"}]},
                  "status": {"phase": "Running"}})
    result = reconciler_on(fake).reconcile(f"{NS}/vm", StaticAuthority(), direct_first=True)
    creates = fake.calls.count(("create_pod", PLANNED))
    assert creates <= 2, (
        f"create {PLANNED} answered AlreadyExists {creates} times in one reconcile "
        f"(ended with {type(result.action).__name__}: {result.action.reason}, requeue after "
        f"{result.requeue_after}s): the driver spins instead of dropping the plan")


def test_a_pod_committed_between_the_list_and_the_vm_read_is_not_taken_for_gone() -> None:
    fake = FakeCluster()
    fake.add_vm(pending_vm())

    def another_actor_creates_and_commits(c: FakeCluster) -> None:
        # Between our LIST (no pods yet) and our GET of the VM, another actor (a second
        # controller instance, or one whose pause outlived its term) creates the planned
        # pod and commits it. The pod is healthy and gated.
        vm = c.vm(NS, "vm")
        assert vm is not None
        pod = c.add_pod(runner_pod_object(vm, PLANNED))
        status = {k: v for k, v in vm["status"].items() if k != "pendingPod"}
        vm["status"] = {**status, "podName": PLANNED, "podUID": pod["metadata"]["uid"]}
        vm["metadata"]["resourceVersion"] = c.next_rv()

    fake.race("get_vm_raw", another_actor_creates_and_commits)
    reconciler_on(fake).reconcile(f"{NS}/vm", StaticAuthority(), direct_first=True)
    # The race sat between the two reads: the list first, then the VM read.
    assert fake.calls[:2] == [("list_pods", "vm"), ("get_vm_raw", "vm")], fake.calls
    vm = fake.vm(NS, "vm")
    assert vm is not None
    status = vm["status"]
    deleted = [name for call, name in fake.calls if call == "delete_pod"]
    assert status.get("restartCount", 0) == 0 and PLANNED not in deleted, (
        f"{PLANNED} existed and was healthy, yet it was taken for gone (it was missing from "
        f"the list taken before the VM read): restartCount={status.get('restartCount')}, "
        f"deleted={deleted}, podName={status.get('podName')}")
