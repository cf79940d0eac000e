"""The reconcile driver against the real API server (in-process, one fixed authority).

Each test drives :class:`neonvm.controller.reconciler.Reconciler` directly, with the
controller's own identity (the admission fence lets only it ungate), while an independent
checker lists pods continuously and records any instant with two live pods for a VM.
Where a pod must linger in "terminating" without nodes, the test holds it with a
finalizer of its own, which is what a kubelet finishing a graceful shutdown looks like to
the API server.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client

from neonvm import kube
from neonvm.api import types
from neonvm.controller import actions as act
from neonvm.controller.authority import WrongVM
from neonvm.controller.cluster import KubeCluster
from neonvm.controller.events import EventRecorder
from neonvm.controller.fault_wiring import FaultWiring
from neonvm.controller.faults import FaultConfig, Faults
from neonvm.controller.informer import Informer
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.observe import (
    DirectReader,
    pod_index,
)
from neonvm.controller.reconciler import Reconciler, ReconcilerConfig
from neonvm.dev.cluster import LocalCluster
from neonvm.invariant import InvariantChecker
from tests.support import create_pull_secret, shipped_reconciler, wait_for
from tests.support.authority import StaticAuthority
from tests.support.harness import get_vm, is_gated, runner_pods
from tests.support.reconcile import (
    AUTHORITY,
    FrozenCache,
    condition,
    converged_one,
    create_vm,
    finish,
    history_through_two_restarts,
    hold,
    release,
    settle,
    status_of,
)
from tests.support.seed_bug import stale_writeback_update

pytestmark = pytest.mark.cluster


# ---- convergence and the runner pod ------------------------------------------------------------


def test_a_vm_converges_to_exactly_one_ungated_runner_pod_named_in_status(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        checker: InvariantChecker) -> None:
    created = create_vm(api, namespace, "one")
    events = EventRecorder(controller_api, "test")
    result = settle(shipped_reconciler(controller_api, events=events), f"{namespace}/one")

    assert isinstance(result.action, act.Done)
    pod = converged_one(api, namespace, "one")
    assert pod == f"one-{created['metadata']['uid'][:8]}-1"
    status = status_of(api, namespace, "one")
    assert status["planSeq"] == 1 and status["fence"] == {"epoch": 1, "token": 10}
    assert status["observedGeneration"] == 1
    assert condition(status, "Available") is not None
    recorded = client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector="involvedObject.name=one").items
    # The progress of one reconcile is one Event: plan, create, commit and ungate.
    started = [e for e in recorded if e.reason == "Started"]
    assert len(started) == 1 and not {"Planned", "Created", "Committed"} & {
        e.reason for e in recorded}
    assert started[0].message == (
        f"plan #1: runner pod {pod} (epoch 1, token 10); runner pod {pod} created (gated); "
        f"runner pod {pod} committed; runner pod {pod} ungated: it is the VM's only pod")


def test_the_runner_pod_is_fenced_owned_labelled_and_built_from_the_spec(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    created = create_vm(api, namespace, "spec", restart_policy="OnFailure", spec={
        "runnerImage": "example/runner:1", "nodeSelector": {"disk": "ssd"},
        "tolerations": [{"key": "vm", "operator": "Exists", "effect": "NoSchedule"}],
        "terminationGracePeriodSeconds": 7, "schedulerName": "default-scheduler",
    }, labels={"team": "db"})
    reconciler = shipped_reconciler(controller_api, config=ReconcilerConfig(max_steps=3))
    reconciler.reconcile(f"{namespace}/spec", AUTHORITY, direct_first=True)  # plan, create

    (pod,) = runner_pods(api, namespace, "spec")
    assert is_gated(pod), "created with the scheduling gate"
    meta, spec = pod.metadata, pod.spec
    (owner,) = meta.owner_references
    assert (owner.kind, owner.name, owner.uid, owner.controller, owner.block_owner_deletion) \
        == ("VirtualMachine", "spec", created["metadata"]["uid"], True, True)
    assert meta.labels == {types.LABEL_VM_NAME: "spec", "app.kubernetes.io/name": "NeonVM",
                           types.LABEL_VM_UID: created["metadata"]["uid"], "team": "db"}
    assert meta.annotations[types.ANNOTATION_TOKEN] == "10"
    assert meta.annotations[types.ANNOTATION_EPOCH] == "1"
    assert meta.annotations[types.ANNOTATION_PLAN_SEQ] == "1"
    assert spec.restart_policy == "Never"
    assert (spec.node_selector, spec.termination_grace_period_seconds) == ({"disk": "ssd"}, 7)
    assert spec.tolerations[0].key == "vm"
    (container,) = spec.containers
    assert container.image == "example/runner:1" and container.command == ["neonvm-runner"]
    env = {e.name: e.value for e in container.env}
    assert json.loads(meta.annotations["vm.neon.tech/spec"])["restartPolicy"] == "OnFailure"
    assert (env["NEONVM_VM_NAME"], env["NEONVM_VM_NAMESPACE"]) == ("spec", namespace)
    assert container.readiness_probe.http_get.path == "/ready"
    assert container.liveness_probe.http_get.port == 25183
    # 2 slots of 256Mi plus the runner's overhead; CPU requests use, limits max.
    assert container.resources.limits == {"cpu": "2", "memory": "768Mi"}
    assert container.resources.requests == {"cpu": "1", "memory": "768Mi"}


# ---- the seed's scenario ------------------------------------------------------------------------


def test_a_deleted_pod_gets_exactly_one_replacement_that_waits_gated_for_the_old_one(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        checker: InvariantChecker) -> None:
    create_vm(api, namespace, "seed")
    key = f"{namespace}/seed"
    reconciler = shipped_reconciler(controller_api)
    settle(reconciler, key)
    old = converged_one(api, namespace, "seed")
    hold(api, namespace, old)
    client.CoreV1Api(api).delete_namespaced_pod(old, namespace)

    result = settle(reconciler, key, rounds=2)
    assert isinstance(result.action, act.Wait) and result.action.condition == "WaitingForOldPod"
    pods = {p.metadata.name: p for p in runner_pods(api, namespace, "seed")}
    status = status_of(api, namespace, "seed")
    new = status["podName"]
    assert set(pods) == {old, new} and new.endswith("-2")
    assert pods[old].metadata.deletion_timestamp is not None
    assert is_gated(pods[new]), "the replacement must not start beside the old pod"
    assert status["restartCount"] == 1
    waiting = condition(status, "WaitingForOldPod")
    assert waiting is not None and waiting["status"] == "True"
    assert old in waiting["message"] and waiting["lastTransitionTime"]

    # More reconciles change nothing while the old pod is still there.
    settle(reconciler, key, rounds=3)
    assert is_gated(client.CoreV1Api(api).read_namespaced_pod(new, namespace))
    assert len(runner_pods(api, namespace, "seed")) == 2

    release(api, namespace, old)
    wait_for(lambda: len(runner_pods(api, namespace, "seed")) == 1, 30, what="old pod gone")
    assert isinstance(settle(reconciler, key).action, act.Done)
    assert converged_one(api, namespace, "seed") == new
    waiting = condition(status_of(api, namespace, "seed"), "WaitingForOldPod")
    assert waiting is not None and waiting["status"] == "False"


# ---- stale reads and the seed's broken retry ----------------------------------------------------


def _stale_after_first_restart(api: client.ApiClient, controller_api: client.ApiClient,
                               namespace: str, name: str) -> dict[str, Any]:
    """The VM as it was after restart #1: "no pod, no plan, planSeq 1"."""
    history = history_through_two_restarts(api, controller_api, namespace, name)
    after_restart = [v for v in history
                     if (v.get("status") or {}).get("restartCount") == 1
                     and not (v.get("status") or {}).get("podName")
                     and not (v.get("status") or {}).get("pendingPod")]
    assert after_restart, "the informer saw the version right after restart #1"
    return after_restart[0]


def test_a_stale_cache_does_not_start_a_second_plan(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        checker: InvariantChecker) -> None:
    create_vm(api, namespace, "stale")
    stale = _stale_after_first_restart(api, controller_api, namespace, "stale")
    running = converged_one(api, namespace, "stale")
    before = status_of(api, namespace, "stale")

    reconciler = shipped_reconciler(controller_api, cache=FrozenCache(stale, []))
    reconciler.reconcile(f"{namespace}/stale", AUTHORITY)

    assert [p.metadata.name for p in runner_pods(api, namespace, "stale")] == [running]
    after = status_of(api, namespace, "stale")
    assert (after["podName"], after["planSeq"]) == (before["podName"], before["planSeq"])


def test_the_seed_bug_reproduced_with_the_broken_retry_gives_the_vm_two_pods(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        checker: InvariantChecker) -> None:
    """Same stale read as above, but with a retry that writes the stale view back.

    The broken retry overwrites the committed pod with a second plan, and a second pod is
    created beside the running one (the seed's two pods). The scheduling gate still keeps
    the second one from running until the first is deleted: the strict invariant holds
    (the ``checker`` fixture asserts it), though the VM was needlessly restarted.
    """
    create_vm(api, namespace, "broken")
    stale = _stale_after_first_restart(api, controller_api, namespace, "broken")
    running = converged_one(api, namespace, "broken")

    broken = shipped_reconciler(controller_api, cache=FrozenCache(stale, []),
                                update=stale_writeback_update, config=ReconcilerConfig(max_steps=3))
    broken.reconcile(f"{namespace}/broken", AUTHORITY)  # plan, create, commit

    pods = {p.metadata.name: p for p in runner_pods(api, namespace, "broken")}
    assert len(pods) == 2, "the seed's bug: a second pod for the VM"
    second = next(n for n in pods if n != running)
    assert second.endswith("-2"), "a plan number that was already used, planned again"
    assert is_gated(pods[second])
    assert status_of(api, namespace, "broken")["podName"] == second

    # The pod fence still holds: the running pod is deleted before the new one starts.
    result = settle(shipped_reconciler(controller_api), f"{namespace}/broken")
    assert isinstance(result.action, act.Done)
    assert converged_one(api, namespace, "broken") == second


def test_stale_reads_and_injected_conflicts_never_produce_a_second_pod(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        checker: InvariantChecker) -> None:
    wiring = FaultWiring(Faults(FaultConfig(stale_reads=0.5, conflict=0.3, seed=11)))
    vm_store, pod_store = wiring.store(), wiring.store(index=pod_index)
    custom, core = client.CustomObjectsApi(controller_api), client.CoreV1Api(controller_api)

    def list_vms(**kw: Any) -> Any:
        return custom.list_namespaced_custom_object(types.GROUP, types.VERSION, namespace,
                                                    types.PLURAL, **kw)

    def list_pods(**kw: Any) -> Any:
        return core.list_namespaced_pod(namespace, label_selector=types.LABEL_VM_NAME, **kw)

    informers = [Informer("vms", list_vms, vm_store, lambda *_: None,
                          accept=wiring.event_filter("vms")),
                 Informer("pods", list_pods, pod_store, lambda *_: None,
                          accept=wiring.event_filter("pods"))]
    for i in informers:
        i.start()
    names = [f"churn-{i}" for i in range(3)]
    for name in names:
        create_vm(api, namespace, name)
    metrics = ControllerMetrics()
    reconciler = shipped_reconciler(controller_api, metrics=metrics,
                                    cache=wiring.observer(vm_store, pod_store),
                                    writer=wiring.writer(controller_api))
    try:
        wait_for(lambda: all(i.synced.is_set() for i in informers), 30)
        for round_ in range(4):
            for name in names:
                key = f"{namespace}/{name}"
                wait_for(lambda key=key: isinstance(  # type: ignore[misc]
                    reconciler.reconcile(key, AUTHORITY).action, act.Done)
                    and _converged(api, namespace, key.split("/")[1]), 60,
                    what=f"{key} converges (round {round_})")
            for name in names:
                client.CoreV1Api(api).delete_namespaced_pod(
                    converged_one(api, namespace, name), namespace)
    finally:
        for i in informers:
            i.stop()
    for name in names:
        status = status_of(api, namespace, name)
        assert status["restartCount"] == 3
        assert status["planSeq"] == 4, "every restart planned exactly once"
    assert metrics.conflicts._value.get() > 0, "the conflict path was exercised"


def _converged(api: client.ApiClient, namespace: str, name: str) -> bool:
    try:
        converged_one(api, namespace, name)
    except AssertionError:
        return False
    return True


# ---- restart policy, deletion ----------------------------------------------------------------


@pytest.mark.parametrize(("policy", "pod_phase", "vm_phase", "restarts"), [
    ("Always", "Succeeded", "Pending", 1),
    ("OnFailure", "Failed", "Pending", 1),
    ("OnFailure", "Succeeded", "Succeeded", 0),
    ("Never", "Failed", "Failed", 0),
])
def test_the_restart_policy_is_applied_when_the_runner_ends(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        checker: InvariantChecker, policy: str, pod_phase: str, vm_phase: str,
        restarts: int) -> None:
    create_vm(api, namespace, "rp", restart_policy=policy)
    key = f"{namespace}/rp"
    reconciler = shipped_reconciler(controller_api)
    settle(reconciler, key)
    first = converged_one(api, namespace, "rp")
    finish(api, namespace, first, pod_phase)

    settle(reconciler, key)
    status = status_of(api, namespace, "rp")
    assert status["restartCount"] == restarts
    if restarts:
        assert status["podName"] != first and status["planSeq"] == 2
    else:
        assert status["phase"] == vm_phase and status["podName"] == first
        assert status["planSeq"] == 1, "a terminal VM is never planned again"
        settle(reconciler, key)
        assert [p.metadata.name for p in runner_pods(api, namespace, "rp")] == [first]
        ready = condition(status_of(api, namespace, "rp"), "Available")
        assert ready is not None and ready["status"] == "False"


def test_a_deleted_vm_waits_for_its_pods_to_be_gone_then_lets_go(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    create_vm(api, namespace, "bye")
    key = f"{namespace}/bye"
    finalized: list[str] = []
    reconciler = shipped_reconciler(controller_api, on_finalized=finalized.append)
    settle(reconciler, key)
    pod = converged_one(api, namespace, "bye")
    hold(api, namespace, pod)
    client.CustomObjectsApi(api).delete_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, "bye")

    result = settle(reconciler, key, rounds=2)
    assert isinstance(result.action, act.Wait)
    vm = get_vm(api, namespace, "bye")
    assert vm is not None and types.FINALIZER in vm["metadata"]["finalizers"]
    (terminating,) = runner_pods(api, namespace, "bye")
    assert terminating.metadata.deletion_timestamp is not None and finalized == []

    release(api, namespace, pod)
    wait_for(lambda: not runner_pods(api, namespace, "bye"), 30)
    settle(reconciler, key)
    assert get_vm(api, namespace, "bye") is None
    assert finalized == [key], "the lock is released once the finalizer is gone"


# ---- bad specs -----------------------------------------------------------------------------------


def test_a_malformed_spec_is_rejected_by_the_api_server(
        api: client.ApiClient, namespace: str) -> None:
    bad = {"guest": {"cpus": {"min": 4, "max": 2}, "rootDisk": {"image": "x"}}}
    with pytest.raises(client.ApiException) as err:
        create_vm(api, namespace, "bad", spec=bad)
    assert err.value.status == 422
    assert "min must not exceed max" in kube.api_error_message(err.value)


def degraded_without_pod(api: client.ApiClient, reconciler: Reconciler, namespace: str,
                         name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """One reconcile ends waiting as Degraded=True with no pod; (status, condition)."""
    result = reconciler.reconcile(f"{namespace}/{name}", AUTHORITY, direct_first=True)
    assert isinstance(result.action, act.Wait), result.action
    status = status_of(api, namespace, name)
    degraded = condition(status, "Degraded")
    assert degraded is not None and degraded["status"] == "True"
    assert not runner_pods(api, namespace, name)
    return status, degraded


def test_an_unrealisable_spec_is_degraded_without_churn_until_the_spec_changes(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    # A toleration the CRD takes and the pod API refuses (Exists with a value); tolerations
    # may change after creation (podResources, NeonVM's immutable field, may not).
    impossible = [{"key": "k", "operator": "Exists", "value": "v"}]
    create_vm(api, namespace, "nope", spec={"tolerations": impossible})
    key = f"{namespace}/nope"
    reconciler = shipped_reconciler(controller_api)

    _, degraded = degraded_without_pod(api, reconciler, namespace, "nope")
    assert degraded["reason"] == "CreateRefused" and degraded["observedGeneration"] == 1
    assert "must be empty when `operator` is 'Exists'" in degraded["message"]

    # No churn: reconciling again writes nothing and plans nothing.
    version = vm_version(api, namespace, "nope")
    for _ in range(3):
        reconciler.reconcile(key, AUTHORITY, direct_first=True)
    assert vm_version(api, namespace, "nope") == version
    assert status_of(api, namespace, "nope")["planSeq"] == 1

    # A fixed spec (a new generation) is tried again, and the condition clears.
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, "nope",
        {"spec": {"tolerations": [{"key": "k", "operator": "Exists"}]}})
    settle(reconciler, key)
    converged_one(api, namespace, "nope")
    degraded = condition(status_of(api, namespace, "nope"), "Degraded")
    assert degraded is not None and degraded["status"] == "False"


def test_a_missing_image_pull_secret_holds_the_pod_back_as_degraded_until_it_exists(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    create_vm(api, namespace, "private", spec={"imagePullSecrets": [{"name": "regcred"}]})
    key = f"{namespace}/private"
    reconciler = shipped_reconciler(controller_api, events=EventRecorder(controller_api, "test"))

    status, degraded = degraded_without_pod(api, reconciler, namespace, "private")
    assert degraded["reason"] == "ImagePullSecretNotFound"
    assert "regcred" in degraded["message"] and namespace in degraded["message"]
    ready = condition(status, "Available")
    assert ready is not None and (ready["status"], ready["reason"]) == ("False", "NoRunner")
    planned = status["pendingPod"]["name"]

    # No churn while it is missing: nothing is written, no second plan, no pod.
    version = vm_version(api, namespace, "private")
    for _ in range(3):
        again = reconciler.reconcile(key, AUTHORITY, direct_first=True)
        assert isinstance(again.action, act.Wait)
    assert vm_version(api, namespace, "private") == version
    assert not runner_pods(api, namespace, "private")
    warned = [e for e in client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector="involvedObject.name=private").items
        if e.reason == "ImagePullSecretNotFound"]
    assert len(warned) == 1 and warned[0].type == "Warning" and (warned[0].count or 1) == 1

    # The secret appears (no spec change): the recorded plan goes ahead, Degraded clears.
    create_pull_secret(api, namespace, "regcred")
    settle(reconciler, key)
    assert converged_one(api, namespace, "private") == planned
    degraded = condition(status_of(api, namespace, "private"), "Degraded")
    assert degraded is not None and degraded["status"] == "False"


def test_the_pull_secret_check_receives_no_secret_data_and_cannot_tell_without_rbac(
        api: client.ApiClient, controller_api: client.ApiClient, cluster: LocalCluster,
        namespace: str) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_secret(namespace, {
        "metadata": {"name": "regcred"}, "stringData": {"token": "hunter2"}})
    reader = DirectReader(KubeCluster(controller_api))
    assert reader.secret_exists(namespace, "regcred") is True
    assert reader.secret_exists(namespace, "absent") is False

    # What the check reads comes back as metadata alone.
    meta = reader.secret_metadata(namespace, "regcred")
    assert meta is not None and meta["kind"] == "PartialObjectMetadata"
    assert meta["metadata"]["name"] == "regcred"
    assert "data" not in meta and "hunter2" not in json.dumps(meta)

    # An identity without RBAC on secrets cannot tell (None): the reconciler then skips
    # the check and creates the pod as it would without it.
    nobody = kube.api_client(cluster.kubeconfig)
    nobody.set_default_header("Impersonate-User", "neonvm-test-nobody")
    try:
        assert DirectReader(KubeCluster(nobody)).secret_exists(namespace, "regcred") is None
        create_vm(api, namespace, "unchecked", spec={"imagePullSecrets": [{"name": "absent"}]})
        reconciler = shipped_reconciler(controller_api)
        reconciler.reader.secret_exists = DirectReader(KubeCluster(nobody)).secret_exists  # type: ignore[method-assign]
        settle(reconciler, f"{namespace}/unchecked")
        converged_one(api, namespace, "unchecked")
    finally:
        nobody.close()


def vm_version(api: client.ApiClient, namespace: str, name: str) -> str:
    vm = get_vm(api, namespace, name)
    assert vm is not None
    return str(vm["metadata"]["resourceVersion"])


def test_a_change_decided_for_a_vm_never_lands_on_its_re_created_namesake(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    custom = client.CustomObjectsApi(api)
    old = create_vm(api, namespace, "reborn")
    custom.delete_namespaced_custom_object(types.GROUP, types.VERSION, namespace,
                                           types.PLURAL, "reborn")
    wait_for(lambda: get_vm(api, namespace, "reborn") is None, 30)
    new = create_vm(api, namespace, "reborn")
    assert new["metadata"]["uid"] != old["metadata"]["uid"]

    # The cache still shows the old VM: the finalizer write conflicts, and the re-read
    # finds the new one, whose lock this worker does not hold.
    authority = StaticAuthority(epoch=1, token=10, vm_uid=old["metadata"]["uid"])
    reconciler = shipped_reconciler(controller_api, cache=FrozenCache(old, []))
    with pytest.raises(WrongVM):
        reconciler.reconcile(f"{namespace}/reborn", authority)

    now = get_vm(api, namespace, "reborn")
    assert now is not None and now["metadata"]["uid"] == new["metadata"]["uid"]
    assert now["metadata"].get("finalizers") in (None, [])
    assert not (now.get("status") or {}).get("pendingPod")
    assert runner_pods(api, namespace, "reborn") == []
