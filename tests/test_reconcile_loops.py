"""Reconciles that cannot converge, against the real API server: they back off, say why
in a Degraded condition, and are counted; and the pod-create errors they map.

* A committed gated pod that lost its runner label (the admission fence switched off):
  observe and the ungate agree that it is the VM's pod, and it is replaced, so the VM
  converges (it used to loop on an ungate that never took effect).
* A step that keeps not taking effect (another admission policy refuses every ungate
  with 422): Degraded ``UngateNotTakingEffect``, ``neonvm_controller_stuck_reconciles_total``
  counts it, and the requeue delays double; removing the policy lets the VM converge and
  Degraded clear.
* The controller run as the admin identity: the fence refuses its ungate (403), and the
  VM says so (``UngateForbidden``), naming the identity and the remedy.
* A pod create the API server refuses as too large (413) or invalid with a long message
  (422): Degraded ``CreateRefused`` with the API text bounded.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm import kube, manifests
from neonvm.api import types
from neonvm.controller import actions as act
from neonvm.controller.authority import RetryableError
from neonvm.controller.conditions import API_ERROR_LIMIT, ELLIPSIS, MESSAGE_LIMIT
from neonvm.controller.create_policy import classify_create_error
from neonvm.controller.events import EventRecorder
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.podspec import PodDefaults
from neonvm.controller.reconciler import Reconciler, ReconcilerConfig, ReconcileResult
from neonvm.dev.cluster import LocalCluster
from neonvm.invariant import InvariantChecker
from neonvm.kube import api_error_message
from tests.support import FAST, health_port, metrics_of, replica_group, shipped_reconciler, wait_for
from tests.support.authority import StaticAuthority
from tests.support.harness import (
    Replica,
    Replicas,
    converged,
    create_vm,
    get_vm,
    is_gated,
    runner_pods,
)

pytestmark = pytest.mark.cluster

AUTHORITY = StaticAuthority(epoch=1, token=10)
HOLD = "test.neon.tech/hold"
NOWHERE = {"neonvm.test/unschedulable": "true"}
"""Runner pods here are never bound to a node: the test plays their lifecycle."""


def vm_status(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    status: dict[str, Any] = (get_vm(api, namespace, name) or {}).get("status") or {}
    return status


def degraded(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    status = vm_status(api, namespace, name)
    return next((c for c in [*(status.get("conditions") or []),
                             *(status.get("extraConditions") or [])]
                 if c["type"] == "Degraded"), None)


def settle(reconciler: Reconciler, key: str, rounds: int = 3) -> ReconcileResult:
    result = reconciler.reconcile(key, AUTHORITY, direct_first=True)
    for _ in range(rounds):
        if isinstance(result.action, act.Done):
            return result
        result = reconciler.reconcile(key, AUTHORITY, direct_first=True)
    return result


# ---- switching admission policies ----------------------------------------------------------


def _refusal(call: Any) -> ApiException | None:
    try:
        call()
    except ApiException as exc:
        return exc
    return None


@contextlib.contextmanager
def fence_off(api: client.ApiClient) -> Iterator[None]:
    """The local cluster's runner-pod fence suspended (its binding deleted), then back."""
    admission = client.AdmissionregistrationV1Api(api)
    core = client.CoreV1Api(api)
    probe = {"metadata": {"name": "fence-probe", "labels": {types.LABEL_VM_NAME: "x"}},
             "spec": {"containers": [{"name": "c", "image": "i"}]}}  # labelled, not gated

    def refused() -> bool:
        return _refusal(lambda: core.create_namespaced_pod("default", probe,
                                                           dry_run="All")) is not None

    admission.delete_validating_admission_policy_binding(manifests.POLICY_NAME)
    try:
        wait_for(lambda: not refused(), 60, what="the fence lifted")
        yield
    finally:
        kube.apply(api, manifests.admission_policy_binding())
        wait_for(refused, 60, what="the fence in force again")


@contextlib.contextmanager
def ungates_refused(api: client.ApiClient, controller_api: client.ApiClient,
                    namespace: str) -> Iterator[None]:
    """Another admission policy, for ``namespace`` only, that refuses to remove the runner
    gate from any pod, as Invalid (422): an ungate that can never take effect."""
    admission = client.AdmissionregistrationV1Api(api)
    core = client.CoreV1Api(api)
    as_controller = client.CoreV1Api(controller_api)  # the fence lets it ungate
    name = f"test-refuse-ungate-{namespace}"
    gate = f"'{types.SCHEDULING_GATE}'"
    had = f"oldObject.spec.schedulingGates.exists(g, g.name == {gate})"
    has = f"object.spec.schedulingGates.exists(g, g.name == {gate})"
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"],
                "resources": ["pods"]}]},
            "validations": [{
                "expression": f"!(has(oldObject.spec.schedulingGates) && {had}) || "
                              f"(has(object.spec.schedulingGates) && {has})",
                "message": "test policy: runner pods may not start in this namespace",
                "reason": "Invalid"}],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": {"matchLabels": {
                     "kubernetes.io/metadata.name": namespace}}}},
    }
    admission.create_validating_admission_policy(policy)
    admission.create_validating_admission_policy_binding(binding)
    # A gated pod of no VM: removing its gate (dry run) is refused once the policy loaded.
    core.create_namespaced_pod(namespace, {
        "metadata": {"name": "policy-probe"},
        "spec": {"schedulingGates": [{"name": types.SCHEDULING_GATE}],
                 "containers": [{"name": "c", "image": "i"}]}})

    def in_force() -> bool:
        exc = _refusal(lambda: as_controller.patch_namespaced_pod(
            "policy-probe", namespace, [{"op": "remove", "path": "/spec/schedulingGates"}],
            dry_run="All"))
        return exc is not None and exc.status == 422

    try:
        wait_for(in_force, 60, what="the refusing policy in force")
        core.delete_namespaced_pod("policy-probe", namespace, grace_period_seconds=0)
        yield
    finally:
        with contextlib.suppress(ApiException):
            admission.delete_validating_admission_policy_binding(name)
        with contextlib.suppress(ApiException):
            admission.delete_validating_admission_policy(name)


# ---- observe and ungate agree ------------------------------------------------------------


def test_a_committed_gated_pod_that_lost_its_label_is_replaced_and_the_vm_converges(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        checker: InvariantChecker) -> None:
    core = client.CoreV1Api(api)
    create_vm(api, namespace, "vm", spec={"nodeSelector": NOWHERE})
    metrics = ControllerMetrics()
    reconciler = shipped_reconciler(controller_api, events=EventRecorder(controller_api, "test"),
                                    metrics=metrics)
    key = f"{namespace}/vm"
    assert isinstance(settle(reconciler, key).action, act.Done)
    first = vm_status(api, namespace, "vm")["podName"]

    # The first pod lingers while it shuts down; its replacement is committed and waits.
    core.patch_namespaced_pod(first, namespace, {"metadata": {"finalizers": [HOLD]}})
    core.delete_namespaced_pod(first, namespace)
    result = reconciler.reconcile(key, AUTHORITY, direct_first=True)
    assert isinstance(result.action, act.Wait) and result.action.condition == "WaitingForOldPod"
    second = vm_status(api, namespace, "vm")["podName"]
    assert second != first and is_gated(core.read_namespaced_pod(second, namespace))

    with fence_off(api):
        core.patch_namespaced_pod(second, namespace,
                                  {"metadata": {"labels": {types.LABEL_VM_NAME: None}}})
    core.patch_namespaced_pod(first, namespace, {"metadata": {"finalizers": None}})
    wait_for(lambda: not runner_pods(api, namespace, "vm"), 30, what="the first pod gone")

    # Observe finds the committed pod by name; the ungate's list must agree, and a pod no
    # labelled list shows is never started: it is replaced (after a second restart's
    # one-second backoff).
    results: list[ReconcileResult] = []

    def done() -> bool:
        results.append(reconciler.reconcile(key, AUTHORITY, direct_first=True))
        return isinstance(results[-1].action, act.Done)

    wait_for(done, 60, interval=0.5, what="the VM to converge")
    assert all(r.stuck is None for r in results), results
    status = vm_status(api, namespace, "vm")
    third = status["podName"]
    assert third not in (first, second)
    assert converged(api, namespace, ["vm"])
    assert _refusal(lambda: core.read_namespaced_pod(second, namespace)) is not None, (
        "the unlabelled pod is deleted")
    assert status["restartCount"] == 2
    events = core.list_namespaced_event(namespace,
                                        field_selector="involvedObject.name=vm").items
    assert "RunnerUnlabelled" in [e.reason for e in events]
    assert metrics.actions.labels(action="Ungate", outcome="replaced")._value.get() == 1


# ---- a step that never takes effect ---------------------------------------------------------


@pytest.fixture
def replicas(cluster: LocalCluster, api: client.ApiClient, namespace: str,
             tmp_path: Path) -> Iterator[Replicas]:
    with replica_group(cluster, api, namespace, tmp_path / "replicas") as group:
        yield group



def backoffs(replica: Replica, key: str) -> list[float]:
    """The requeue delays the replica chose for ``key``'s stuck reconciles, in order."""
    delays = []
    for line in replica.log().splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if entry.get("vm") == key and "backoff" in entry:
                delays.append(float(entry["backoff"]))
    return delays


def assert_backs_off(replica: Replica, key: str) -> None:
    def three() -> list[float] | None:
        found = backoffs(replica, key)
        return found if len(found) >= 3 else None

    delays = wait_for(three, 120, what="three stuck reconciles")
    assert delays[0] >= 1.0, delays
    assert all(later == 2 * earlier for earlier, later in itertools.pairwise(delays)), delays


STUCK_UNGATES = 'neonvm_controller_stuck_reconciles_total{step="ungate"}'
STUCK_CREATES = 'neonvm_controller_stuck_reconciles_total{step="create"}'


def test_an_ungate_that_never_takes_effect_backs_off_with_a_condition_and_a_metric(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        replicas: Replicas, checker: InvariantChecker) -> None:
    with ungates_refused(api, controller_api, namespace):
        leader = replicas.start("leader")
        create_vm(api, namespace, "vm", spec={"nodeSelector": NOWHERE})
        cond = wait_for(lambda: (c := degraded(api, namespace, "vm")) and c["status"] == "True"
                        and c, 120, what="Degraded on the VM")
        assert cond["reason"] == "UngateNotTakingEffect", cond
        pod = vm_status(api, namespace, "vm")["podName"]
        assert "Ungate keeps not taking effect" in cond["message"]
        assert "runner pods may not start in this namespace" in cond["message"]
        port = wait_for(lambda: health_port(leader), 30)
        assert wait_for(lambda: metrics_of(port).get(STUCK_UNGATES, 0) >= 1, 30)
        assert_backs_off(leader, f"{namespace}/vm")
        assert is_gated(client.CoreV1Api(api).read_namespaced_pod(pod, namespace))

    # The policy is gone: the next look (at the latest after the current backoff) starts it.
    wait_for(lambda: converged(api, namespace, ["vm"]), 120, what="convergence")
    assert vm_status(api, namespace, "vm")["podName"] == pod
    cond = wait_for(lambda: (c := degraded(api, namespace, "vm")) and c["status"] == "False"
                    and c, 60, what="Degraded cleared")
    assert cond["reason"] == "Recovered"


def test_a_runner_pod_refused_by_the_fence_names_the_identity_and_the_remedy(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, tmp_path: Path,
        checker: InvariantChecker) -> None:
    # The controller run with the admin kubeconfig, as `neonvm dev env` used to export.
    group = Replicas(api=api, kubeconfig=cluster.kubeconfig,
                     etcd_endpoints=cluster.locks_etcd_config(f"/t-{uuid.uuid4().hex[:8]}"),
                     lease_namespace=namespace, log_dir=tmp_path / "replicas",
                     extra_args=[*FAST, "--watch-namespace", namespace])
    with group:
        admin = group.start("admin")
        try:
            create_vm(api, namespace, "vm", spec={"nodeSelector": NOWHERE})
            cond = wait_for(lambda: (c := degraded(api, namespace, "vm"))
                            and c["status"] == "True" and c, 120, what="Degraded on the VM")
            review = client.AuthenticationV1Api(api).create_self_subject_review(
                {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
            user = review.status.user_info.username
            # The fence's creator rule refuses the admin's create before any ungate.
            assert cond["reason"] == "CreateForbidden", cond
            assert f'"{user}"' in cond["message"]
            assert "only the neonvm controller may create a runner pod" in cond["message"]
            assert "run the controller with its own credentials" in cond["message"]
            port = wait_for(lambda: health_port(admin), 30)
            assert wait_for(lambda: metrics_of(port).get(STUCK_CREATES, 0) >= 1, 30)
            assert_backs_off(admin, f"{namespace}/vm")
            assert not client.CoreV1Api(api).list_namespaced_pod(namespace).items
        finally:
            print(f"---- admin ----\n{admin.log()[-20000:]}")


# ---- pod creates the API server refuses -------------------------------------------------


@pytest.mark.parametrize(("mib", "status", "text"), [
    (4.0, 413, "Request entity too large"),  # over the API server's 3 MiB request limit
    (2.5, 500, "larger than max"),  # over its 2 MiB gRPC limit towards etcd
    (1.7, 500, "etcdserver: request is too large"),  # over etcd's 1.5 MiB request limit
])
def test_a_runner_pod_too_large_to_store_is_create_refused_not_retried(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        mib: float, status: int, text: str) -> None:
    create_vm(api, namespace, "big", spec={"nodeSelector": NOWHERE})
    metrics = ControllerMetrics()
    big = shipped_reconciler(controller_api, metrics=metrics, config=ReconcilerConfig(
        pod_defaults=PodDefaults(runner_image="r" * int(mib * (1 << 20)))))
    result = settle(big, f"{namespace}/big")
    assert isinstance(result.action, act.Wait), result
    cond = degraded(api, namespace, "big")
    assert cond is not None and cond["reason"] == "CreateRefused", cond
    assert f"({status}): " in cond["message"] and text in cond["message"], cond
    assert metrics.create_refused._value.get() == 1, "refused once, then left alone"
    assert not runner_pods(api, namespace, "big")


def test_an_invalid_runner_pod_is_create_refused_with_bounded_text(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    key_bad = f"{namespace}/bad"
    create_vm(api, namespace, "bad", spec={"nodeSelector": NOWHERE})

    # An invalid value the API server echoes back in full (422): the text is bounded.
    bad = shipped_reconciler(controller_api, config=ReconcilerConfig(
        pod_defaults=PodDefaults(image_pull_policy="Sometimes" * 400)))
    result = settle(bad, key_bad)
    assert isinstance(result.action, act.Wait), result
    cond = degraded(api, namespace, "bad")
    assert cond is not None and cond["reason"] == "CreateRefused", cond
    assert "(422)" in cond["message"] and ELLIPSIS in cond["message"], cond
    assert len(cond["message"]) <= MESSAGE_LIMIT
    assert len(cond["message"]) < API_ERROR_LIMIT + 200
    # What the mapping saw is what the API server really says.
    pod = {"metadata": {"name": "direct"}, "spec": {"containers": [
        {"name": "c", "image": "i", "imagePullPolicy": "Sometimes" * 400}]}}
    exc = _refusal(lambda: client.CoreV1Api(api).create_namespaced_pod(namespace, pod))
    assert exc is not None and exc.status == 422 and len(api_error_message(exc)) > 3000
    assert classify_create_error(exc.status, api_error_message(exc)) == "refuse"


@pytest.mark.nodes
def test_creates_failing_for_a_while_say_so_and_recover_when_they_pass(
        cluster: LocalCluster, api: client.ApiClient, controller_api: client.ApiClient,
        namespace: str) -> None:
    if not cluster.spec.nodes:
        pytest.skip("needs kube-controller-manager (with the simulated nodes): without it "
                    "a quota has no status and the API server refuses every pod")
    # No pod fits the namespace's quota: "exceeded quota" is retried, never refused.
    core = client.CoreV1Api(api)
    core.create_namespaced_resource_quota(namespace, {
        "metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}})
    wait_for(lambda: (core.read_namespaced_resource_quota("no-pods", namespace).status.hard
                      or {}).get("pods") == "0", 30, what="the quota in force")
    create_vm(api, namespace, "vm", spec={"nodeSelector": NOWHERE})
    reconciler = shipped_reconciler(controller_api,
                                    config=ReconcilerConfig(create_failing_after=0.0))
    key = f"{namespace}/vm"
    for attempt in range(3):
        with pytest.raises(RetryableError, match="exceeded quota"):
            reconciler.reconcile(key, AUTHORITY, direct_first=True)
        cond = degraded(api, namespace, "vm")
        assert (cond is None) == (attempt < 2), (attempt, cond)
    assert cond is not None and (cond["status"], cond["reason"]) == ("True", "CreateFailing")
    assert "keeps failing (retried with backoff)" in cond["message"]
    assert "exceeded quota" in cond["message"]

    core.delete_namespaced_resource_quota("no-pods", namespace)
    wait_for(lambda: isinstance(_settled(reconciler, key), act.Done), 60, interval=0.5,
             what="the VM to converge once the quota is gone")
    assert converged(api, namespace, ["vm"])
    cond = degraded(api, namespace, "vm")
    assert cond is not None and (cond["status"], cond["reason"]) == ("False", "Recovered")


def _settled(reconciler: Reconciler, key: str) -> act.Action:
    try:
        return reconciler.reconcile(key, AUTHORITY, direct_first=True).action
    except RetryableError:  # the quota controller has not caught up yet
        return act.Wait()
