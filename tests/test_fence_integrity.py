"""Two gaps around the fence: a pod planted under the next plan's name, and one VM whose
status fence is ahead of the leader.

* A pod under a planned name is adopted only if it carries that plan's fence
  annotations (epoch and token). Against the real API server the planted pod is created
  with the controller's identity: the admission policy lets no other identity create a
  runner pod (``tests/test_admission_fence.py``), so this is what anyone could do with
  the policy off, and it shows the controller's own check.
* A VM fenced ahead of a leader whose Lease still holds is Degraded and left alone; the
  term, and every other VM, goes on (real replicas, real Lease, real locks' etcd).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm.api import types
from neonvm.api.types import (
    FINALIZER,
    Condition,
    Fence,
    PendingPod,
    VirtualMachine,
    VirtualMachineSpec,
    VirtualMachineStatus,
)
from neonvm.controller import decide as d
from neonvm.controller.conditions import (
    DEGRADED,
    FENCE_AHEAD,
    FENCE_RESOLVED,
    desired_conditions,
    fence_ahead_mutation,
)
from neonvm.controller.events import EventRecorder
from neonvm.controller.observe import Snapshot
from neonvm.controller.reconciler import Reconciler, ReconcilerConfig, StaticAuthority
from neonvm.dev.cluster import LocalCluster
from neonvm.invariant import InvariantChecker
from neonvm.testing.harness import (
    Replicas,
    converged,
    create_vm,
    get_vm,
    is_gated,
    runner_pods,
)
from tests.support import wait_for

AUTHORITY = StaticAuthority(epoch=1, token=10)
NOWHERE = {"neonvm.test/unschedulable": "true"}
LEASE = d.Lease(epoch=3, token=7)
BAD_EPOCH = 2**31 + 5


# ---- unit: the Degraded write of a VM fenced ahead ---------------------------------------


def fenced_vm(epoch: int = BAD_EPOCH, token: int = 1, **status: Any) -> VirtualMachine:
    return VirtualMachine(
        name="vm", namespace="ns", uid="0123456789", resource_version="5", generation=2,
        spec=VirtualMachineSpec(), finalizers=[FINALIZER],
        status=VirtualMachineStatus(fence=Fence(epoch=epoch, token=token), plan_seq=4,
                                    observed_generation=1, **status))


@pytest.mark.unit
def test_the_fence_ahead_write_sets_degraded_and_touches_neither_fence_nor_plan() -> None:
    plan = PendingPod(name="vm-01234567-5", plan_seq=5, token=1, epoch=BAD_EPOCH,
                      generation=1)
    vm = fenced_vm(pending_pod=plan, pod_name="", phase="Pending")
    new = fence_ahead_mutation(LEASE, now="2026-01-01T00:00:00Z")(copy.deepcopy(vm))
    assert new is not None
    degraded = next(c for c in new.conditions if c.type == DEGRADED)
    assert (degraded.status, degraded.reason) == ("True", FENCE_AHEAD)
    assert str(BAD_EPOCH) in degraded.message and "epoch 3" in degraded.message
    # Everything but the condition is exactly what it was: the fence stays ahead.
    assert new.fence == vm.status.fence and new.pending_pod == plan
    assert (new.plan_seq, new.observed_generation, new.pod_name, new.phase) == (
        4, 1, "", "Pending")
    # Written once: the same write again changes nothing, so it is not sent.
    vm.status = new
    assert fence_ahead_mutation(LEASE)(vm) is None


@pytest.mark.unit
@pytest.mark.parametrize(("epoch", "token", "ahead"), [
    (3, 7, False), (2, 99, False), (3, 8, True), (4, 0, True), (BAD_EPOCH, 0, True)])
def test_the_fence_ahead_write_rechecks_the_fresh_copy(epoch: int, token: int,
                                                       ahead: bool) -> None:
    new = fence_ahead_mutation(LEASE)(fenced_vm(epoch, token))
    assert (new is not None) == ahead


@pytest.mark.unit
def test_a_plan_of_a_higher_epoch_is_ahead_too() -> None:
    plan = PendingPod(name="vm-01234567-5", plan_seq=5, token=1, epoch=9, generation=1)
    vm = fenced_vm(epoch=3, token=7, pending_pod=plan)
    assert isinstance(d.decide(d.Observation(vm=vm, pods=(), lease=LEASE, direct=True)),
                      d.Fenced)
    assert fence_ahead_mutation(LEASE)(vm) is not None


@pytest.mark.unit
def test_the_condition_turns_false_once_a_reconcile_gets_past_the_fence() -> None:
    vm = fenced_vm(epoch=3, token=7)
    vm.status.conditions = [Condition(type=DEGRADED, status="True", reason=FENCE_AHEAD,
                                      message="m", observed_generation=2)]
    snap = Snapshot(obs=d.Observation(vm=vm, pods=(), lease=LEASE, direct=True), record=None)
    updates = {u.type: u for u in desired_conditions(snap, d.Done())}
    assert (updates[DEGRADED].status, updates[DEGRADED].reason) == ("False", FENCE_RESOLVED)


# ---- real server: a planted pod is not adopted -------------------------------------------


@pytest.fixture
def checker(api: client.ApiClient, namespace: str) -> Iterator[InvariantChecker]:
    with InvariantChecker(api, namespace, interval=0.02) as c:
        yield c
    assert c.report.samples > 0
    assert c.report.strict == [], f"two live runner pods at once: {c.report.strict}"


def plant(controller_api: client.ApiClient, namespace: str, vm: dict[str, Any],
          name: str) -> str:
    """A runner pod under ``name``: gated, labelled and owned by the VM, as a user would
    make it, with no fence annotations. Returns its uid."""
    meta = vm["metadata"]
    body = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {types.LABEL_VM_NAME: meta["name"], types.LABEL_VM_UID: meta["uid"]},
            "ownerReferences": [{"apiVersion": types.API_VERSION, "kind": types.KIND,
                                 "name": meta["name"], "uid": meta["uid"],
                                 "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": {"schedulingGates": [{"name": types.SCHEDULING_GATE}],
                 "nodeSelector": NOWHERE, "terminationGracePeriodSeconds": 0,
                 "containers": [{"name": "runner", "image": "example.com/not-the-runner"}]},
    }
    created = client.CoreV1Api(controller_api).create_namespaced_pod(namespace, body)
    return str(created.metadata.uid)


def pod_or_none(api: client.ApiClient, namespace: str, name: str) -> Any:
    try:
        return client.CoreV1Api(api).read_namespaced_pod(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


@pytest.mark.cluster
@pytest.mark.parametrize("when", ["before-the-plan", "after-the-plan"])
def test_a_pod_planted_under_the_next_name_is_not_adopted_and_the_vm_gets_its_own(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        checker: InvariantChecker, when: str) -> None:
    """before-the-plan: the pod exists when plan #1 is recorded (decide sees it at once).
    after-the-plan: plan #1 is recorded, then the pod is planted, then the controller's
    create runs into AlreadyExists."""
    vm = create_vm(api, namespace, "victim", spec={"nodeSelector": NOWHERE})
    key = f"{namespace}/victim"
    name = f"victim-{vm['metadata']['uid'][:8]}-1"
    step = Reconciler(controller_api, config=ReconcilerConfig(max_steps=1),
                      events=EventRecorder(controller_api, "test"))
    planted_uid = ""
    if when == "before-the-plan":
        planted_uid = plant(controller_api, namespace, vm, name)
    for _ in range(5):  # one action per reconcile: finalizer, then the plan
        step.reconcile(key, AUTHORITY, direct_first=True)
        raw = get_vm(api, namespace, "victim")
        assert raw is not None
        if (raw.get("status") or {}).get("pendingPod"):
            break
    assert raw["status"]["pendingPod"]["name"] == name
    if when == "after-the-plan":
        planted_uid = plant(controller_api, namespace, vm, name)

    reconciler = Reconciler(controller_api, events=EventRecorder(controller_api, "test"))
    for _ in range(10):
        result = reconciler.reconcile(key, AUTHORITY, direct_first=True)
        if isinstance(result.action, d.Done):
            break
    status = (get_vm(api, namespace, "victim") or {}).get("status") or {}
    assert status.get("podUID") != planted_uid, "the planted pod was adopted"
    assert status.get("podName") == f"victim-{vm['metadata']['uid'][:8]}-2"
    (pod,) = runner_pods(api, namespace, "victim")
    assert pod.metadata.name == status["podName"] and not is_gated(pod)
    assert pod.metadata.annotations[types.ANNOTATION_EPOCH] == "1"
    assert pod.metadata.annotations[types.ANNOTATION_TOKEN] == "10"
    left = pod_or_none(api, namespace, name)
    assert left is None or left.metadata.uid != planted_uid or (
        left.metadata.deletion_timestamp is not None and is_gated(left))
    events = client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector="involvedObject.name=victim").items
    assert any(e.reason == "PlanDropped" and "does not carry the fence" in e.message
               for e in events), [(e.reason, e.message) for e in events]


# ---- real replicas: one VM fenced ahead does not stall the others ---------------------------


FAST = ["--lease-duration", "4", "--renew-deadline", "3", "--retry-period", "0.5",
        "--session-ttl", "4", "--plan-requeue", "1", "--resync", "10", "--sweep", "3"]


@pytest.fixture
def replicas(cluster: LocalCluster, api: client.ApiClient, namespace: str,
             tmp_path: Path) -> Iterator[Replicas]:
    group = Replicas(
        api=api, kubeconfig=cluster.kubeconfig_for("controller"),
        etcd_endpoints=cluster.locks_etcd_url, lease_namespace=namespace,
        log_dir=tmp_path / "replicas",
        extra_args=[*FAST, "--watch-namespace", namespace,
                    "--etcd-prefix", f"/t-{uuid.uuid4().hex[:8]}", "--workers", "4"],
    )
    with group:
        yield group
        for r in group:  # shown by pytest only when the test failed
            print(f"---- {r.name} (exit {r.exit_code()}) ----\n{r.log()[-20000:]}")


def lease_transitions(api: client.ApiClient, namespace: str) -> int:
    lease = client.CoordinationV1Api(api).read_namespaced_lease("neonvm-controller", namespace)
    return int(lease.spec.lease_transitions or 0)


def write_fence(api: client.ApiClient, namespace: str, name: str, epoch: int) -> None:
    """What a restore from backup (or a user with status rights) leaves behind."""
    custom = client.CustomObjectsApi(api)

    def attempt() -> bool:
        raw = get_vm(api, namespace, name)
        assert raw is not None
        raw.setdefault("status", {})["fence"] = {"epoch": epoch, "token": 1}
        try:
            custom.replace_namespaced_custom_object_status(
                types.GROUP, types.VERSION, namespace, types.PLURAL, name, raw)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    wait_for(attempt, 30, what=f"status.fence of {name} written")


def degraded_reason(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    raw = get_vm(api, namespace, name) or {}
    return next((c for c in (raw.get("status") or {}).get("conditions") or []
                 if c["type"] == DEGRADED and c["status"] == "True"), None)


@pytest.mark.cluster
@pytest.mark.slow
def test_a_vm_fenced_past_int32_is_degraded_while_every_other_vm_converges(
        api: client.ApiClient, namespace: str, replicas: Replicas,
        checker: InvariantChecker) -> None:
    leader = replicas.start("r0")
    wait_for(lambda: replicas.leader() is leader, 60, what="r0 to lead")
    create_vm(api, namespace, "first")
    wait_for(lambda: converged(api, namespace, ["first"]), 120, what="first to converge")
    epoch = lease_transitions(api, namespace)

    create_vm(api, namespace, "bad")
    write_fence(api, namespace, "bad", BAD_EPOCH)
    others = [f"vm{i}" for i in range(4)]
    for name in others:
        create_vm(api, namespace, name)

    wait_for(lambda: converged(api, namespace, ["first", *others]), 180,
             what="every other VM to converge")
    cond = wait_for(lambda: degraded_reason(api, namespace, "bad"), 60,
                    what="the fenced VM to show Degraded")
    assert cond["reason"] == FENCE_AHEAD, cond
    assert str(BAD_EPOCH) in cond["message"] and f"epoch {epoch}" in cond["message"], cond
    # Left alone: no plan, no pod; its fence still as written.
    bad = get_vm(api, namespace, "bad") or {}
    assert bad["status"]["fence"]["epoch"] == BAD_EPOCH
    assert not bad["status"].get("pendingPod") and not bad["status"].get("podName")
    assert runner_pods(api, namespace, "bad") == []
    # One term throughout: same leader process, same epoch.
    assert replicas.leader() is leader and leader.running()
    assert lease_transitions(api, namespace) == epoch
    assert "ending this term" not in leader.log()
    events = client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector="involvedObject.name=bad").items
    assert any(e.reason == FENCE_AHEAD and e.type == "Warning" for e in events)

    # An operator fixes the status: the VM converges like any other.
    write_fence(api, namespace, "bad", epoch)
    wait_for(lambda: converged(api, namespace, ["bad"]), 120, what="bad to converge once fixed")
    assert lease_transitions(api, namespace) == epoch
