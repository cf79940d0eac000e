"""A change of ``cpus.use`` within the same whole vCPUs (a fraction plan), in the pure
decision and the performer's runner call (no servers).

The rules: docs/protocol.md, "Live scaling" (the fraction bullet). The real-server side
of the pod's annotations and CPU request/limit: ``tests/test_scaling_controller.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from loguru import logger

from neonvm.api.millicpu import MilliCPU
from neonvm.api.types import PendingScale, VirtualMachine
from neonvm.controller import actions as act
from neonvm.controller import decide as d
from neonvm.controller.action_table import status_mutation
from neonvm.controller.observe import Snapshot
from neonvm.controller.reconciler import paused
from neonvm.controller.scaling import POD_NOT_ANNOTATED, Result, RunnerScaling
from tests.support.autoscaler_view import vm_of

pytestmark = pytest.mark.unit

GIB = 1 << 30
LEASE = act.Fence(epoch=1, token=1)


def fraction_vm(**status: Any) -> VirtualMachine:
    """use 750m within the 1 vCPU whose 500m status records."""
    return vm_of({"min": "250m", "max": 2, "use": "750m"}, status={
        "phase": "Running", "podName": "p", "podUID": "pu", "node": "n1",
        "podIP": "10.0.0.1", "cpus": "500m", "memorySize": "1Gi", "scaleSeq": 3, **status})


def running_pod(scale_fence: tuple[int, int, int] | None = None) -> act.PodView:
    return act.PodView(name="p", uid="pu", owner_uid="u", gated=False, terminating=False,
                       phase="Running", node="n1", ip="10.0.0.1", built=(500, 1),
                       scale_fence=scale_fence)


def planned(vm: VirtualMachine) -> PendingScale:
    """Decide and record the fraction plan; the plan recorded."""
    plan = d.decide(act.Observation(vm=vm, pods=(running_pod(),), lease=LEASE, direct=True))
    assert isinstance(plan, act.PlanScale), plan
    vm.status = status_mutation(plan, LEASE)(vm)
    assert vm.status.pending_scale is not None
    return vm.status.pending_scale


def decide(vm: VirtualMachine, pod: act.PodView,
           runner: act.RunnerView | None = None) -> act.Action:
    return d.decide(act.Observation(vm=vm, pods=(pod,), lease=LEASE, direct=True,
                                    runner=runner))


# ---- a fraction plan's annotation write that was lost (review-protocol F5) --------------


def test_a_fraction_plan_whose_pod_annotation_was_lost_commits_whole_vcpus_and_plans_again(
) -> None:
    # The runner recorded the plan's fence (PUT /scale 200, a no-op on the guest), but the
    # pod's annotation write never landed (a leader's death, an error, four conflicts):
    # the fraction is the plan's whole effect, so status records whole vCPUs and the
    # next plan writes the annotations.
    vm = fraction_vm()
    plan = planned(vm)
    runner = act.RunnerView(pod_uid="pu", fence=d.scale_fence(plan), vcpus=1,
                            memory_slots=1, memory_bytes=GIB, answered_uid="pu")
    commit = decide(vm, running_pod(scale_fence=(1, 1, 3)), runner)
    assert isinstance(commit, act.CommitScale) and commit.pod_behind, commit
    vm.status = status_mutation(commit, LEASE)(vm)
    assert vm.status.cpus == MilliCPU(1000) and vm.status.pending_scale is None
    again = decide(vm, running_pod(scale_fence=(1, 1, 3)))
    assert isinstance(again, act.PlanScale) and again.plan.seq == plan.seq + 1, again


def test_a_fraction_plan_whose_pod_carries_it_commits_the_fraction() -> None:
    vm = fraction_vm()
    plan = planned(vm)
    runner = act.RunnerView(pod_uid="pu", fence=d.scale_fence(plan), vcpus=1,
                            memory_slots=1, memory_bytes=GIB, answered_uid="pu")
    commit = decide(vm, running_pod(scale_fence=d.scale_fence(plan)), runner)
    assert isinstance(commit, act.CommitScale) and not commit.pod_behind, commit
    vm.status = status_mutation(commit, LEASE)(vm)
    assert vm.status.cpus == MilliCPU(750)
    assert isinstance(decide(vm, running_pod(scale_fence=d.scale_fence(plan))), act.Done)


# ---- a pod without a scaling token (review-protocol F6) ----------------------------------


class _Told(RunnerScaling):
    """The performer with its runner and Kubernetes calls recorded, not made."""

    def __init__(self) -> None:
        super().__init__(None, secrets=object())  # type: ignore[arg-type]
        self.told: list[tuple[int, PendingScale]] = []
        self.called: list[str] = []

    refused: str | None = None
    """What the annotation write answers: None (written), or why the API server refused it."""

    def _tell_kubernetes(self, vm: VirtualMachine, pod: act.PodView, memory_bytes: int,
                         plan: PendingScale, log: Any) -> Result | None:
        self.told.append((memory_bytes, plan))
        return None if self.refused is None else Result(POD_NOT_ANNOTATED, self.refused)

    def _call(self, method: str, url: str, body: dict[str, Any] | None,
              token: str | None, timeout: float) -> tuple[int, dict[str, Any]]:
        self.called.append(f"{method} {url}")
        return 500, {}


def test_a_fraction_change_on_a_pod_without_a_token_is_told_to_the_pod_and_committed(
) -> None:
    # No token Secret recorded (rbac.liveScaling off, the chart's default): no runner
    # call can land, and a fraction needs none. The plan is the fenced annotation write
    # alone, then the commit, so status and currentRevision follow the spec.
    vm = fraction_vm()
    plan = planned(vm)
    apply = decide(vm, running_pod())
    assert isinstance(apply, act.ApplyScale), apply
    scaling = _Told()
    snap = Snapshot(obs=act.Observation(vm=vm, pods=(running_pod(),), lease=LEASE,
                                        direct=True), record=None, pods={})
    assert scaling.apply(apply, snap, logger) == "done"
    assert scaling.told == [(GIB, plan)] and scaling.called == []
    commit = decide(vm, running_pod(scale_fence=d.scale_fence(plan)))
    assert isinstance(commit, act.CommitScale) and not commit.pod_behind, commit
    vm.status = status_mutation(commit, LEASE)(vm)
    assert (vm.status.cpus, vm.status.memory_size) == (MilliCPU(750), "1Gi")
    assert vm.status.pending_scale is None


def test_a_refused_annotation_write_ends_the_reconcile_stuck_instead_of_planning_again(
) -> None:
    # The API server refuses the pod's annotation write for good (a 422: the tenant filled
    # its pod's annotations). The plan must not commit and be planned again at once (the
    # commit records a fraction only once the pod carries the plan: a hot loop of status
    # writes and runner calls); it is asked again after the VM's stuck backoff.
    vm = fraction_vm()
    planned(vm)
    apply = decide(vm, running_pod())
    assert isinstance(apply, act.ApplyScale), apply
    scaling = _Told()
    scaling.refused = "annotating p with its size was refused: 422 too long"
    snap = Snapshot(obs=act.Observation(vm=vm, pods=(running_pod(),), lease=LEASE,
                                        direct=True), record=None, pods={})
    outcome = scaling.apply(apply, snap, logger)
    assert outcome == POD_NOT_ANNOTATED and "422" in getattr(outcome, "detail", "")
    assert paused(outcome)


def test_a_whole_vcpu_change_on_a_pod_without_a_token_still_needs_a_restart() -> None:
    vm = vm_of({"min": "250m", "max": 2, "use": "1500m"}, status={
        "phase": "Running", "podName": "p", "podUID": "pu", "node": "n1",
        "podIP": "10.0.0.1", "cpus": "500m", "memorySize": "1Gi", "scaleSeq": 3})
    planned(vm)
    apply = decide(vm, running_pod())
    assert isinstance(apply, act.ApplyScale), apply
    scaling = _Told()
    snap = Snapshot(obs=act.Observation(vm=vm, pods=(running_pod(),), lease=LEASE,
                                        direct=True), record=None, pods={})
    assert scaling.apply(apply, snap, logger) == "pod_without_token"
    assert scaling.told == [] and scaling.called == []
    # A pod that carries the plan's fence (it cannot: nothing told it) commits nothing
    # that the runner has not reached.
    behind = decide(vm, running_pod(scale_fence=d.scale_fence(apply.plan)))
    assert isinstance(behind, act.ApplyScale), behind


def test_the_fraction_rule_reads_the_pods_built_size_else_status() -> None:
    vm = fraction_vm()
    plan = dataclasses.replace(planned(vm))
    assert d.fraction_only(vm, plan, running_pod())
    assert not d.fraction_only(vm, plan, dataclasses.replace(running_pod(), built=(2000, 1)))
    assert d.fraction_only(vm, plan, dataclasses.replace(running_pod(), built=None))


def test_the_cache_keeps_the_pods_scale_fence_that_a_commit_reads() -> None:
    # A commit decided from the cache (a new leader's first look) reads the same record
    # as one decided from a direct read: otherwise it would record whole vCPUs each time.
    from neonvm.controller.informer import project_pod
    from neonvm.controller.observe import pod_view

    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "pu", "annotations": {
        "vm.neon.tech/scale-fence": "1,1,4", "vm.neon.tech/spec": "{}"}},
        "spec": {"nodeName": "n1"}, "status": {"phase": "Running", "podIP": "10.0.0.1"}}
    assert pod_view(pod).scale_fence == (1, 1, 4)
    assert pod_view(project_pod(pod)) == pod_view(pod)
