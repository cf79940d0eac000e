"""The pod's own record of its size follows the spec: the runner pod's
``vm.neon.tech/resources`` and ``usage`` annotations (what NeonVM's scheduler plugin and
the runner's CPU quota read) and its CPU request end at ``cpus.use`` whatever was lost on
the way: a tell written from an older read of the VM, a leader that dies between the
annotation write and the resize. docs/protocol.md, "Live scaling", "The pod's record";
the explorer's findings: docs/verification.md, "The pod's fenced writes".

The decision's rule on pods as the cache and a direct read give them (pure), then the
shipped reconciler on a real API server with a stand-in runner that takes what it is
asked (tests/test_autoscaler_view.py's).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm import kube
from neonvm.api import types
from neonvm.api.millicpu import MilliCPU
from neonvm.controller import actions as act
from neonvm.controller import decide as d
from neonvm.controller import podspec, reasons
from neonvm.controller.events import EventRecorder
from neonvm.controller.informer import project_pod
from neonvm.controller.observe import pod_view
from tests.support import shipped_reconciler
from tests.support.autoscaler_view import ApplyingRunner, agent_patch, vm_of
from tests.support.harness import create_vm, get_vm, runner_pods
from tests.support.reconcile import AUTHORITY, NOWHERE, condition, settle, status_of

GIB = 1 << 30
LEASE = act.Fence(epoch=1, token=1)
FENCE = (1, 1, 3)


# ---- the rule (pure) ----------------------------------------------------------------------


def committed_vm(use: object = "500m", **spec: Any) -> types.VirtualMachine:
    """A VM running at ``use`` (status says it), plan #3 (fence 1,1,3) committed."""
    vm = vm_of({"min": "250m", "max": 2, "use": use}, status={
        "phase": "Running", "podName": "p", "podUID": "pu", "node": "n1",
        "podIP": "10.0.0.1", "cpus": use, "memorySize": "1Gi", "scaleSeq": 3,
        "fence": {"epoch": 1, "token": 1}})
    for k, v in spec.items():
        setattr(vm.spec, k, v)
    return vm


def raw_pod(cpus: str = "500m", slots: int = 1, request: str = "500m",
            qos: str | None = "Burstable",
            annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """The committed pod as the API server returns it: its resources annotation at
    (``cpus``, ``slots``), its runner container's CPU request, its QoS class."""
    resources = {"cpus": {"min": "250m", "max": 2, "use": cpus},
                 "memorySlots": {"min": 1, "max": 2, "use": slots}, "memorySlotSize": "1Gi"}
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "pu", "annotations": {
        podspec.ANNOTATION_RESOURCES: json.dumps(resources),
        types.ANNOTATION_SCALE_FENCE: ",".join(map(str, FENCE)), **(annotations or {})}},
        "spec": {"nodeName": "n1", "containers": [{
            "name": podspec.RUNNER_CONTAINER, "ports": [{"name": "runner",
                                                         "containerPort": 25183}],
            "resources": {"requests": {"cpu": request, "memory": "3Gi"},
                          "limits": {"cpu": "2", "memory": "3Gi"}}}]},
        "status": {"phase": "Running", "podIP": "10.0.0.1",
                   **({"qosClass": qos} if qos else {})}}


def decided(vm: types.VirtualMachine, pod: dict[str, Any], direct: bool = True) -> act.Action:
    """The decision on ``pod`` as read directly, which the cache's copy must agree with."""
    assert pod_view(project_pod(json.loads(json.dumps(pod)))) == pod_view(pod)
    return d.decide(act.Observation(vm=vm, pods=(pod_view(pod),), lease=LEASE,
                                    direct=direct))


@pytest.mark.unit
def test_a_pod_whose_record_is_the_specs_costs_no_plan() -> None:
    assert isinstance(decided(committed_vm(), raw_pod()), act.Done)
    assert isinstance(decided(committed_vm(1), raw_pod("1", request="1")), act.Done)


@pytest.mark.unit
@pytest.mark.parametrize(("pod", "why"), [
    (raw_pod(cpus="1000m", request="1"), "resources annotation says cpus.use 1"),
    (raw_pod(slots=2), "memorySlots.use 2"),
    (raw_pod(request="1"), "CPU request is 1"),
])
def test_a_pod_whose_annotations_or_request_are_behind_the_spec_is_planned_again(
        pod: dict[str, Any], why: str) -> None:
    # Status says the spec's size (500m, 1 slot), the pod's own record does not: a tell
    # written from an older read, or lost, or a resize lost. A plan of the same size,
    # whose fenced write rewrites the record (the explorer's bugs 1 to 3).
    vm = committed_vm()
    plan = decided(vm, pod)
    assert isinstance(plan, act.PlanScale) and why in plan.reason, plan
    assert (plan.plan.cpus, plan.plan.memory_slots, plan.plan.seq) == (1, 1, 4)
    # From the cache (the pod and the VM from two watches: the pod's may lag the commit
    # the VM shows): confirmed by a direct read first, never planned from it.
    assert isinstance(decided(vm, pod, direct=False), act.ObserveDirect)


@pytest.mark.unit
@pytest.mark.parametrize(("vm", "pod", "what"), [
    (committed_vm(), raw_pod(request="1", qos="Guaranteed"), "Guaranteed: never resized"),
    (committed_vm(), raw_pod(request="1", qos=None), "QoS class not recorded"),
    (committed_vm(pod_resources={"requests": {"cpu": "1"}}), raw_pod(request="1"),
     "podResources: the user's request"),
    (committed_vm(), raw_pod(request="1", annotations={
        types.ANNOTATION_RESIZE_REFUSED: ",".join(map(str, FENCE))}),
     "this plan's resize was refused for good"),
    (committed_vm(), {**raw_pod(request="1"), "metadata": {
        "name": "p", "namespace": "ns", "uid": "pu", "annotations": {}}},
     "built by an earlier version: no resources annotation, no scale-fence"),
    (committed_vm(), raw_pod(request="2.5e3m"), "a request not read here"),
])
def test_a_pod_whose_record_cannot_follow_is_not_planned_again(
        vm: types.VirtualMachine, pod: dict[str, Any], what: str) -> None:
    # Each would be a plan after every plan, for good: a loop of status writes and
    # runner calls.
    assert isinstance(decided(vm, pod), act.Done), what


@pytest.mark.unit
def test_a_pod_whose_scale_fence_no_plan_wrote_is_not_planned_again_but_said() -> None:
    # A tenant who may patch the runner pod sets its scale-fence above every plan: no
    # plan's tell writes over it, so each plan would leave the record behind and be made
    # again at once, for good (a plan loop). Read directly (the VM no older than the
    # pod), such a fence is no plan's: the decision waits and says so (Degraded).
    vm = committed_vm()
    planted = raw_pod(cpus="1000m", annotations={types.ANNOTATION_SCALE_FENCE: "9,9,9"})
    wait = decided(vm, planted)
    assert isinstance(wait, act.Wait) and wait.condition == reasons.POD_SCALE_FENCE_AHEAD
    assert "remove the vm.neon.tech/scale-fence annotation" in wait.reason
    assert isinstance(decided(vm, planted, direct=False), act.ObserveDirect)
    # Nor is a fraction of cpus.use planned for such a pod (its tell would write nothing).
    fraction = committed_vm("500m")
    fraction.status.cpus = MilliCPU(1000)
    wait = decided(fraction, raw_pod(cpus="1000m", request="1", annotations={
        types.ANNOTATION_SCALE_FENCE: "9,9,9"}))
    assert isinstance(wait, act.Wait) and wait.condition == reasons.POD_SCALE_FENCE_AHEAD
    # The newest plan's own fence (status.fence, scaleSeq) is not above it: planned.
    for newest in ("1,1,3", "1,1,2", "0,7,9"):
        pod = raw_pod(cpus="1000m", annotations={types.ANNOTATION_SCALE_FENCE: newest})
        assert isinstance(decided(vm, pod), act.PlanScale), newest
    # A pod at the spec costs nothing, whatever its fence says.
    assert isinstance(decided(vm, raw_pod(annotations={
        types.ANNOTATION_SCALE_FENCE: "9,9,9"})), act.Done)


@pytest.mark.unit
def test_a_spec_refused_for_its_generation_is_not_planned_for_its_pod() -> None:
    vm = committed_vm()
    vm.status.conditions = [types.Condition(
        type="Scaling", status="False", reason="ScalingNeedsRestart", message="",
        last_transition_time="2026-01-01T00:00:00Z", observed_generation=vm.generation)]
    assert isinstance(decided(vm, raw_pod(cpus="1000m")), act.Done)


# ---- the shipped reconciler on a real API server ------------------------------------------


class Crash(Exception):
    """The controller process dies here (nothing after it is sent)."""


def crash_on(monkeypatch: pytest.MonkeyPatch,
             hit: Callable[[str, str, Any], bool]) -> list[str]:
    """Make the first request ``hit`` picks (method, path, body) raise :class:`Crash`
    before it is sent; the list the crash is recorded in."""
    real = kube.request
    crashed: list[str] = []

    def request(api: Any, method: str, path: str, body: Any = None, *args: Any,
                **kw: Any) -> Any:
        if not crashed and hit(method, path, body):
            crashed.append(f"{method} {path}")
            raise Crash(f"{method} {path}")
        return real(api, method, path, body, *args, **kw)

    monkeypatch.setattr(kube, "request", request)
    return crashed


def running_vm(api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
               name: str, runner: ApplyingRunner, use: object = 1) -> tuple[Any, str]:
    """A VM (cpus 250m..2, max 2 slots) settled on a pod marked Running at the stand-in
    runner's address: (its pod, its key)."""
    create_vm(api, namespace, name, spec={
        "nodeSelector": NOWHERE,
        "guest": {"cpus": {"min": "250m", "max": 2, "use": use},
                  "memorySlots": {"min": 1, "max": 2, "use": 1},
                  "memorySlotSize": "1Gi", "rootDisk": {"image": "/nonexistent.raw"}}})
    key = f"{namespace}/{name}"
    settle(reconciler_for(controller_api, runner), key)
    (pod,) = runner_pods(api, namespace, name)
    runner.pod_uid = pod.metadata.uid
    client.CoreV1Api(api).patch_namespaced_pod_status(pod.metadata.name, namespace, {
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "podIPs": [{"ip": "127.0.0.1"}]}})
    assert isinstance(settle(reconciler_for(controller_api, runner), key).action, act.Done)
    return pod, key


def reconciler_for(controller_api: client.ApiClient, runner: ApplyingRunner,
                   **kw: Any) -> Any:
    from neonvm.controller.scaling import RunnerScaling

    return shipped_reconciler(controller_api, scaling=RunnerScaling(
        controller_api, address=lambda vm, pod: f"http://127.0.0.1:{runner.port}"), **kw)


def pod_record(api: client.ApiClient, namespace: str, pod: Any) -> tuple[Any, ...]:
    """(resources annotation's cpus.use, usage's cpu, the runner's CPU request, the
    resize-refused record) of the pod as stored."""
    read = client.CoreV1Api(api).read_namespaced_pod(pod.metadata.name, namespace)
    annotations = read.metadata.annotations or {}
    return (json.loads(annotations[podspec.ANNOTATION_RESOURCES])["cpus"]["use"],
            json.loads(annotations[podspec.ANNOTATION_USAGE])["cpu"],
            read.spec.containers[0].resources.requests["cpu"],
            annotations.get(types.ANNOTATION_RESIZE_REFUSED))


@pytest.mark.cluster
def test_a_fraction_that_returns_to_whole_vcpus_while_its_plan_is_applied_leaves_no_older_fraction(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    # Bug 1: the agent asks for 500m; while the controller's PUT /scale of that plan is
    # at the runner, it asks for 1000m again. The tell that follows writes the 500m of the
    # read the plan was applied from; the commit records whole vCPUs, which equal the
    # spec. Before the fix the pod said 500m (scheduler plugin, quota, request) for good.
    runner = ApplyingRunner()
    try:
        pod, key = running_vm(api, controller_api, namespace, "back", runner)

        def first_put(taken: int) -> None:
            if not taken:  # the agent moves on while the first PUT is at the runner
                agent_patch(api, namespace, "back", "1", 1, revision=3)

        runner.puts = _OnPut(first_put)
        agent_patch(api, namespace, "back", "500m", 1, revision=2)
        assert isinstance(settle(reconciler_for(controller_api, runner), key).action,
                          act.Done)
        assert pod_record(api, namespace, pod) == (1, "1", "1", None)
        raw = get_vm(api, namespace, "back")
        assert raw is not None and raw["status"]["cpus"] == 1
        assert len(runner.puts) == 2  # the plan of 500m, and the one that rewrote 1000m
    finally:
        runner.close()


class _OnPut(list[dict[str, Any]]):
    """The stand-in runner's record of the PUTs it took, with a hook called with the
    number taken before, as each arrives (before it is answered)."""

    def __init__(self, hook: Callable[[int], object]) -> None:
        super().__init__()
        self._hook = hook

    def append(self, asked: dict[str, Any]) -> None:
        self._hook(len(self))
        super().append(asked)


@pytest.mark.cluster
def test_a_resize_lost_to_a_crash_after_the_annotation_write_is_done_again(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Bug 3: the leader writes the pod's annotations (with the plan's scale-fence) and
    # dies before the in-place resize. The next leader sees the runner and the pod at the
    # plan: it commits the fraction. Before the fix the CPU request and limit stayed at
    # 1000m's for good (the kubelet's cgroup enforces them, not the annotations).
    runner = ApplyingRunner()
    try:
        pod, key = running_vm(api, controller_api, namespace, "lost", runner)
        crashed = crash_on(monkeypatch, lambda method, path, body: path.endswith("/resize"))
        agent_patch(api, namespace, "lost", "500m", 1, revision=2)
        with pytest.raises(Crash):
            settle(reconciler_for(controller_api, runner), key)
        assert crashed and pod_record(api, namespace, pod) == ("500m", "500m", "1", None)
        assert isinstance(settle(reconciler_for(controller_api, runner), key).action,
                          act.Done)
        assert pod_record(api, namespace, pod) == ("500m", "500m", "500m", None)
        raw = get_vm(api, namespace, "lost")
        assert raw is not None and raw["status"]["cpus"] == "500m"
    finally:
        runner.close()


@pytest.mark.cluster
def test_a_resize_refused_for_good_is_recorded_on_the_pod_and_not_asked_again(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A cluster without in-place resize (before Kubernetes 1.33) refuses every resize:
    # the pod's request stays as built. Recorded on the pod, so that its request, not
    # the spec's, is no reason to plan again (else a plan after every plan, for good).
    runner = ApplyingRunner()
    try:
        pod, key = running_vm(api, controller_api, namespace, "norsz", runner)
        real = kube.request
        resizes: list[str] = []

        def request(api_: Any, method: str, path: str, *args: Any, **kw: Any) -> Any:
            if path.endswith("/resize"):
                resizes.append(path)
                raise ApiException(status=404, reason="Not Found")
            return real(api_, method, path, *args, **kw)

        monkeypatch.setattr(kube, "request", request)
        agent_patch(api, namespace, "norsz", "500m", 1, revision=2)
        assert isinstance(settle(reconciler_for(controller_api, runner), key).action,
                          act.Done)
        assert pod_record(api, namespace, pod) == ("500m", "500m", "1", "1,10,1")
        assert len(resizes) == 1 and len(runner.puts) == 1
        # Looked at again (a resync): nothing more is asked.
        assert isinstance(settle(reconciler_for(controller_api, runner), key).action,
                          act.Done)
        assert len(resizes) == 1 and len(runner.puts) == 1
    finally:
        runner.close()


@pytest.mark.cluster
def test_a_scale_fence_planted_on_the_pod_costs_no_plan_loop_and_is_said(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    # A tenant with pod patch rights sets the pod's scale-fence above every plan; then
    # cpus.use changes. No plan's tell writes over that fence, so a plan would leave the
    # pod's record behind the spec. Before the fix: a plan per reconcile (its PUT sent,
    # its tell writing nothing, the fraction committed), requeued at once, for good
    # (~5 plans and 60 API requests a second for one VM). Now: no plan (a fraction
    # changes nothing of the guest's vCPUs), a Wait, and Degraded says why.
    runner = ApplyingRunner()
    try:
        pod, key = running_vm(api, controller_api, namespace, "plant", runner)
        core = client.CoreV1Api(api)
        core.patch_namespaced_pod(pod.metadata.name, namespace, {"metadata": {
            "annotations": {types.ANNOTATION_SCALE_FENCE: "999,999,999"}}})
        agent_patch(api, namespace, "plant", "500m", 1, revision=2)
        rec = reconciler_for(controller_api, runner)
        ends = [rec.reconcile(key, AUTHORITY, direct_first=True) for _ in range(4)]
        assert [type(r.action) for r in ends] == [act.Wait] * 4, ends
        assert ends[-1].action.condition == reasons.POD_SCALE_FENCE_AHEAD
        assert ends[-1].requeue_after == d.POD_FENCE_RECHECK_SECONDS
        assert not runner.puts
        degraded = condition(status_of(api, namespace, "plant"), "Degraded")
        assert degraded is not None and (degraded["status"], degraded["reason"]) == (
            "True", reasons.POD_SCALE_FENCE_AHEAD)
        # The annotation removed: the next plan rewrites the record, Degraded clears.
        core.patch_namespaced_pod(pod.metadata.name, namespace, {"metadata": {
            "annotations": {types.ANNOTATION_SCALE_FENCE: None}}})
        assert isinstance(settle(rec, key).action, act.Done)
        assert pod_record(api, namespace, pod)[:3] == ("500m", "500m", "500m")
        degraded = condition(status_of(api, namespace, "plant"), "Degraded")
        assert degraded is not None and degraded["status"] == "False"
    finally:
        runner.close()


@pytest.mark.cluster
def test_a_resize_refused_by_a_quota_is_recorded_and_said_by_a_warning_event(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A namespace ResourceQuota refuses the resize (403, exceeded quota); it may take it
    # later, but asking again at once would be a plan per reconcile: recorded like any
    # refusal, and said to people by a Warning event on the VM (review-podwrites F2:
    # before, a log line only).
    runner = ApplyingRunner()
    try:
        pod, key = running_vm(api, controller_api, namespace, "quota", runner)
        real = kube.request

        def request(api_: Any, method: str, path: str, *args: Any, **kw: Any) -> Any:
            if path.endswith("/resize"):
                refused = ApiException(status=403, reason="Forbidden")
                refused.body = json.dumps({
                    "kind": "Status", "status": "Failure", "code": 403,
                    "reason": "Forbidden", "message": 'pods "x" is forbidden: exceeded '
                    "quota: cpu, requested: requests.cpu=500m, used: requests.cpu=2, "
                    "limited: requests.cpu=2"})
                raise refused
            return real(api_, method, path, *args, **kw)

        monkeypatch.setattr(kube, "request", request)
        agent_patch(api, namespace, "quota", "500m", 1, revision=2)
        rec = reconciler_for(controller_api, runner,
                             events=EventRecorder(controller_api, "test"))
        assert isinstance(settle(rec, key).action, act.Done)
        assert pod_record(api, namespace, pod) == ("500m", "500m", "1", "1,10,1")
        events = [e for e in client.CoreV1Api(api).list_namespaced_event(namespace).items
                  if e.reason == reasons.RESIZE_REFUSED]
        assert [(e.type, e.involved_object.name) for e in events] == [("Warning", "quota")]
        assert "exceeded quota" in events[0].message, events[0].message
    finally:
        runner.close()

