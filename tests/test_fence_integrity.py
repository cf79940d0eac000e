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
import datetime as dt
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
from neonvm.controller import actions as act
from neonvm.controller import decide as d
from neonvm.controller.action_table import status_mutation
from neonvm.controller.conditions import (
    conditions_mutation,
    desired_conditions,
    epoch_ahead,
    fence_ahead,
    fence_ahead_message,
    fence_ahead_mutation,
)
from neonvm.controller.conditions import now_rfc3339 as conditions_now
from neonvm.controller.events import EventRecorder
from neonvm.controller.mutations import FencedOut
from neonvm.controller.observe import Snapshot
from neonvm.controller.reasons import DEGRADED, FENCE_AHEAD, FENCE_RESOLVED
from neonvm.controller.reconciler import (
    FENCE_AHEAD_RECHECK_SECONDS as RECHECK,
)
from neonvm.controller.reconciler import ReconcilerConfig
from neonvm.dev.cluster import LocalCluster
from neonvm.invariant import InvariantChecker
from tests.support import replica_group, shipped_reconciler, wait_for
from tests.support.authority import StaticAuthority
from tests.support.harness import (
    Replicas,
    converged,
    create_vm,
    get_vm,
    is_gated,
    runner_pods,
)

AUTHORITY = StaticAuthority(epoch=1, token=10)
NOWHERE = {"neonvm.test/unschedulable": "true"}
LEASE = act.Fence(epoch=3, token=7)
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
    (3, 7, False), (2, 99, False), (3, 8, False), (4, 0, True), (BAD_EPOCH, 0, True)])
def test_the_fence_ahead_write_rechecks_the_fresh_copy(epoch: int, token: int,
                                                       ahead: bool) -> None:
    new = fence_ahead_mutation(LEASE)(fenced_vm(epoch, token))
    assert (new is not None) == ahead


# The reviewer's scenario: leader epoch 7, whose lock token went back from 5000 to 12 (the
# locks' etcd restored from a snapshot, or replaced); the VM's committed pod is gone.
TOKEN_BACK = act.Fence(epoch=7, token=12)


def token_ahead_vm() -> VirtualMachine:
    return VirtualMachine(
        name="vm", namespace="ns", uid="0123456789", resource_version="5", generation=1,
        spec=VirtualMachineSpec(), finalizers=[FINALIZER],
        status=VirtualMachineStatus(fence=Fence(epoch=7, token=5000), plan_seq=3,
                                    pod_name="vm-01234567-3", pod_uid="u3", phase="Running",
                                    observed_generation=1))


@pytest.mark.unit
def test_a_fence_ahead_by_its_token_only_is_not_marked_degraded() -> None:
    """decide is not Fenced by it (pods would still be created, started, deleted), every
    status write is refused, and "epoch at most 7" would not fix it: the VM must not be
    marked and left; the term ends instead (the real-server test below)."""
    vm = token_ahead_vm()
    action = d.decide(act.Observation(vm=vm, pods=(), lease=TOKEN_BACK, direct=True))
    assert not isinstance(action, act.Fenced)
    with pytest.raises(FencedOut):
        status_mutation(action, TOKEN_BACK)(copy.deepcopy(vm))
    seen = fence_ahead(vm, TOKEN_BACK)
    assert seen == (7, 5000) and not epoch_ahead(seen, TOKEN_BACK)
    assert fence_ahead_mutation(TOKEN_BACK)(copy.deepcopy(vm)) is None


@pytest.mark.unit
def test_the_fence_ahead_message_names_a_remedy_that_clears_the_fence() -> None:
    lease = act.Fence(epoch=7, token=12)
    message = fence_ahead_message((9, 3), lease)
    assert "remove status.fence" in message
    assert "(epoch 7, token 12)" in message
    # What it tells the operator to write is no longer ahead.
    for epoch, token in ((7, 12), (6, 99999)):
        vm = token_ahead_vm()
        vm.status.fence = Fence(epoch=epoch, token=token)
        assert fence_ahead(vm, lease) is None


def ts(seconds: int) -> str:
    return (dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=seconds)).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.unit
@pytest.mark.parametrize("step", [1, 7, 301])
def test_two_believed_authorities_write_degraded_a_bounded_number_of_times(step: int) -> None:
    """Two installations on one namespace (A epoch 5, B epoch 3, separate locks' etcd):
    A's reconciles clear FenceAhead, B's set it again, each woken by the other's write.
    The writes are bounded by the elapsed time over the recheck period, not by the
    number of reconciles."""
    a_lease, b_lease = act.Fence(5, 100), act.Fence(3, 7)
    vm = VirtualMachine(
        name="vm", namespace="ns", uid="0123456789", resource_version="5", generation=1,
        spec=VirtualMachineSpec(), finalizers=[FINALIZER],
        status=VirtualMachineStatus(fence=Fence(5, 100), plan_seq=1, pod_name="vm-01234567-1",
                                    pod_uid="u1", phase="Running", node="n", pod_ip="10.0.0.1",
                                    observed_generation=1))
    pod = act.PodView(name="vm-01234567-1", uid="u1", owner_uid=vm.uid, gated=False,
                    terminating=False, phase="Running", node="n", ip="10.0.0.1",
                    fence=(5, 100))
    rounds, writes = 600, 0
    for n in range(rounds):
        now = ts(n * step)
        b_obs = act.Observation(vm=vm, pods=(pod,), lease=b_lease, direct=True)
        assert isinstance(d.decide(b_obs), act.Fenced)
        new = fence_ahead_mutation(b_lease, now=now, quiet_seconds=RECHECK)(copy.deepcopy(vm))
        if new is not None:
            vm.status, writes = new, writes + 1
        a_obs = act.Observation(vm=vm, pods=(pod,), lease=a_lease, direct=True)
        action = d.decide(a_obs)
        updates = desired_conditions(Snapshot(obs=a_obs, record=None), action)
        new = conditions_mutation(updates, a_lease, now=now)(copy.deepcopy(vm))
        if new is not None:
            vm.status, writes = new, writes + 1
    elapsed = (rounds - 1) * step
    assert writes <= 2 * (1 + elapsed // int(RECHECK) + 1), writes
    # And the first one is not held back: B marked it at once.
    assert writes >= 2


@pytest.mark.unit
def test_a_vm_already_degraded_is_marked_fence_ahead_at_once() -> None:
    """The quiet period holds back only a False→True turn: a Degraded that is already
    True (another reason, an older generation) gets FenceAhead at the first look."""
    vm = fenced_vm(epoch=9, token=1)
    vm.status.conditions = [Condition(type=DEGRADED, status="True", reason="CreateRefused",
                                      message="m", observed_generation=1,
                                      last_transition_time=ts(0))]
    new = fence_ahead_mutation(LEASE, now=ts(5), quiet_seconds=RECHECK)(vm)
    assert new is not None
    degraded = next(c for c in new.conditions if c.type == DEGRADED)
    assert (degraded.reason, degraded.observed_generation) == (FENCE_AHEAD, 2)


@pytest.mark.unit
def test_a_plan_of_a_higher_epoch_is_ahead_too() -> None:
    plan = PendingPod(name="vm-01234567-5", plan_seq=5, token=1, epoch=9, generation=1)
    vm = fenced_vm(epoch=3, token=7, pending_pod=plan)
    assert isinstance(d.decide(act.Observation(vm=vm, pods=(), lease=LEASE, direct=True)),
                      act.Fenced)
    assert fence_ahead_mutation(LEASE)(vm) is not None


@pytest.mark.unit
def test_the_condition_turns_false_once_a_reconcile_gets_past_the_fence() -> None:
    vm = fenced_vm(epoch=3, token=7)
    vm.status.conditions = [Condition(type=DEGRADED, status="True", reason=FENCE_AHEAD,
                                      message="m", observed_generation=2)]
    snap = Snapshot(obs=act.Observation(vm=vm, pods=(), lease=LEASE, direct=True), record=None)
    updates = {u.type: u for u in desired_conditions(snap, act.Done())}
    assert (updates[DEGRADED].status, updates[DEGRADED].reason) == ("False", FENCE_RESOLVED)


# ---- real server: a planted pod is not adopted -------------------------------------------


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
    step = shipped_reconciler(controller_api, config=ReconcilerConfig(max_steps=1),
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

    reconciler = shipped_reconciler(controller_api, events=EventRecorder(controller_api, "test"))
    for _ in range(10):
        result = reconciler.reconcile(key, AUTHORITY, direct_first=True)
        if isinstance(result.action, act.Done):
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




@pytest.fixture
def replicas(cluster: LocalCluster, api: client.ApiClient, namespace: str,
             tmp_path: Path) -> Iterator[Replicas]:
    with replica_group(cluster, api, namespace, tmp_path / "replicas", workers=4) as group:
        yield group


def lease_transitions(api: client.ApiClient, namespace: str) -> int:
    lease = client.CoordinationV1Api(api).read_namespaced_lease("neonvm-controller", namespace)
    return int(lease.spec.lease_transitions or 0)


def write_fence(api: client.ApiClient, namespace: str, name: str, epoch: int,
                token: int = 1) -> None:
    """What a restore from backup (or a user with status rights) leaves behind."""
    custom = client.CustomObjectsApi(api)

    def attempt() -> bool:
        raw = get_vm(api, namespace, name)
        assert raw is not None
        raw.setdefault("status", {})["fence"] = {"epoch": epoch, "token": token}
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
    # The bad VM is fenced before any controller runs, so no plan can be recorded for it
    # between its creation and the fence write.
    create_vm(api, namespace, "bad")
    write_fence(api, namespace, "bad", BAD_EPOCH)
    leader = replicas.start("r0")
    wait_for(lambda: replicas.leader() is leader, 60, what="r0 to lead")
    create_vm(api, namespace, "first")
    wait_for(lambda: converged(api, namespace, ["first"]), 120, what="first to converge")
    epoch = lease_transitions(api, namespace)

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


@pytest.mark.cluster
def test_a_fence_ahead_by_its_token_only_ends_the_term_and_marks_nothing(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    """The reviewer's scenario against the API server: the leader (epoch 7) took the lock
    at token 12, below the 5000 in status.fence (the locks' etcd went back). The reconcile
    does not mark the VM and go on: FencedOut reaches the manager, which ends the term
    (the next epoch clears the fence of every such VM at once)."""
    create_vm(api, namespace, "tok", spec={"nodeSelector": NOWHERE})
    write_fence(api, namespace, "tok", 7, token=5000)
    reconciler = shipped_reconciler(controller_api, events=EventRecorder(controller_api, "test"))
    with pytest.raises(FencedOut, match="token only"):
        reconciler.reconcile(f"{namespace}/tok", StaticAuthority(epoch=7, token=12),
                             direct_first=True)
    raw = get_vm(api, namespace, "tok") or {}
    assert raw["status"]["fence"] == {"epoch": 7, "token": 5000}
    assert degraded_reason(api, namespace, "tok") is None
    assert not raw["status"].get("pendingPod") and runner_pods(api, namespace, "tok") == []
    events = client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector="involvedObject.name=tok").items
    assert not any(e.reason == FENCE_AHEAD for e in events)


@pytest.mark.cluster
def test_a_vm_fenced_ahead_by_epoch_is_marked_from_one_direct_read_and_not_re_marked_at_once(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """decide says Fenced on a direct observation: _fenced_ahead reuses it (one direct
    observation per look, not two). When another writer then turns Degraded False (as a
    second installation on the namespace would), the next look does not turn it True
    again within the recheck period: no write, no event."""
    create_vm(api, namespace, "epo", spec={"nodeSelector": NOWHERE})
    write_fence(api, namespace, "epo", BAD_EPOCH)
    key = f"{namespace}/epo"
    reconciler = shipped_reconciler(controller_api, events=EventRecorder(controller_api, "test"))
    observed: list[str] = []
    real_observe = reconciler.reader.observe

    def counting(k: str, lease: act.Fence) -> Snapshot:
        observed.append(k)
        return real_observe(k, lease)

    monkeypatch.setattr(reconciler.reader, "observe", counting)
    result = reconciler.reconcile(key, AUTHORITY, direct_first=True)
    assert result.action.condition == FENCE_AHEAD  # type: ignore[attr-defined]
    assert observed == [key], "one direct observation for the whole look"
    cond = degraded_reason(api, namespace, "epo")
    assert cond is not None and cond["reason"] == FENCE_AHEAD, cond

    # Another writer clears it (what an unfenced installation's reconcile writes).
    raw = get_vm(api, namespace, "epo") or {}
    for c in raw["status"]["conditions"]:
        if c["type"] == DEGRADED:
            c.update(status="False", reason=FENCE_RESOLVED, message="cleared elsewhere",
                     lastTransitionTime=conditions_now())
    client.CustomObjectsApi(api).replace_namespaced_custom_object_status(
        types.GROUP, types.VERSION, namespace, types.PLURAL, "epo", raw)
    version = (get_vm(api, namespace, "epo") or {})["metadata"]["resourceVersion"]
    result = reconciler.reconcile(key, AUTHORITY, direct_first=True)
    assert result.requeue_after == RECHECK
    after = get_vm(api, namespace, "epo") or {}
    assert after["metadata"]["resourceVersion"] == version, "not written again at once"
    events = client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector="involvedObject.name=epo").items
    assert sum(e.count or 1 for e in events if e.reason == FENCE_AHEAD) == 1, events
