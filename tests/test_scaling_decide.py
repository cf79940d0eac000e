"""Live scaling in the pure decision and its status mutations (no servers).

Plan (CAS of ``status.pendingScale``), apply (the runner, with the plan's fence), commit
(CAS of what the runner reports). The real-server test is
``tests/test_scaling_controller.py``; the interleavings are checked by the explorer
(``tests/test_explore_scaling.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt

import pytest

from neonvm.api import times
from neonvm.api.millicpu import MilliCPU
from neonvm.api.scale_protocol import (
    AppliedFence,
    ScaleError,
    ScaleFence,
    ScaleLimits,
    ScaleTarget,
    parse_fence_floor,
)
from neonvm.api.types import (
    Fence,
    PendingPod,
    PendingScale,
    VirtualMachine,
)
from neonvm.controller import actions as act
from neonvm.controller import decide as d
from neonvm.controller import looks, podspec, reasons
from neonvm.controller.action_table import status_mutation
from neonvm.controller.mutations import FencedOut
from neonvm.runner.scaling import FenceStore, Scaler
from tests.support.scaling_decide import LEASE, POD, UID, obs, scale_plan, vm

pytestmark = pytest.mark.unit

GIB = 1 << 30


def view(fence: tuple[int, int, int] | None, cpus: int, slots: int) -> act.RunnerView:
    return act.RunnerView(pod_uid="uid-1", fence=fence, vcpus=cpus, memory_slots=slots,
                        memory_bytes=slots * GIB)


def test_a_running_vm_at_its_spec_size_needs_nothing() -> None:
    assert isinstance(d.decide(obs(vm())), act.Done)


def test_a_changed_use_is_planned_with_the_next_seq_and_the_callers_fence() -> None:
    action = d.decide(obs(vm(cpus_use=1.5, slots_use=2, scale_seq=4)))
    assert isinstance(action, act.PlanScale)
    assert action.plan == PendingScale(cpus=2, memory_slots=2, seq=5, epoch=3, token=40,
                                       pod_name=POD, pod_uid="uid-1", generation=2)
    assert action.observed_seq == 4


def test_a_recorded_plan_is_applied_then_committed_from_what_the_runner_reports() -> None:
    v = vm(cpus_use=2, pending=scale_plan(), phase="Scaling")
    assert isinstance(d.decide(obs(v)), act.ApplyScale)
    # The runner has not got there yet (older fence, or the same fence mid-change): ask again.
    assert isinstance(d.decide(obs(v, runner=view((3, 40, 0), 1, 1))), act.ApplyScale)
    assert isinstance(d.decide(obs(v, runner=view((3, 40, 1), 1, 1))), act.ApplyScale)
    action = d.decide(obs(v, runner=view((3, 40, 1), 2, 1)))
    # POD carries no scale-fence annotation of the plan: whole vCPUs (they are, here).
    assert action == act.CommitScale(seq=1, vcpus=2, memory_bytes=GIB, pod_behind=True,
                                     reason=action.reason)


def test_no_commit_while_the_runner_still_has_a_removal_pending() -> None:
    # Review S0: QEMU still lists a DIMM the guest has not finished ejecting (an earlier
    # plan's unplug): the count matches the plan, but the guest may drop the DIMM later.
    v = vm(cpus_use=2, slots_use=2, pending=scale_plan(slots=2), phase="Scaling")
    pending = dataclasses.replace(view((3, 40, 1), 2, 2), pending_removals=("dimm-slot1",))
    assert isinstance(d.decide(obs(v, runner=pending)), act.ApplyScale)
    assert isinstance(d.decide(obs(v, runner=view((3, 40, 1), 2, 2))), act.CommitScale)


def test_a_runner_ahead_of_the_plan_drops_it_and_one_that_cannot_be_asked_waits() -> None:
    v = vm(cpus_use=2, pending=scale_plan(), phase="Scaling")
    assert isinstance(d.decide(obs(v, runner=view((4, 1, 0), 1, 1))), act.DropScale)
    action = d.decide(obs(v, error="connection refused"))
    assert isinstance(action, act.Wait) and action.condition == reasons.SCALING_CONDITION


def test_a_plan_for_another_pod_is_dropped_and_a_newer_leaders_plan_fences_us() -> None:
    old = dataclasses.replace(scale_plan(), pod_uid="uid-of-an-earlier-pod")
    v = vm(cpus_use=2, pending=old, phase="Scaling")
    assert isinstance(d.decide(obs(v)), act.DropScale)
    newer = vm(cpus_use=2, pending=scale_plan(epoch=9), phase="Scaling")
    assert isinstance(d.decide(obs(newer)), act.Fenced)


def test_the_scaling_phase_is_kept_while_a_plan_is_recorded() -> None:
    v = vm(cpus_use=2, pending=scale_plan(), phase="Running")
    action = d.decide(obs(v))
    assert isinstance(action, act.SyncStatus) and action.phase == "Scaling"


def test_the_plan_mutation_refuses_a_fresh_spec_that_asks_for_another_size() -> None:
    action = d.decide(obs(vm(cpus_use=2)))
    assert isinstance(action, act.PlanScale)
    mutate = status_mutation(action, LEASE)
    new = mutate(vm(cpus_use=2))
    assert new is not None and new.pending_scale == action.plan and new.scale_seq == 1
    assert new.phase == "Scaling"
    assert [(c.type, c.status) for c in new.conditions] == [("Scaling", "True")]
    assert mutate(vm(cpus_use=1)) is None  # the spec went back meanwhile: plan again
    assert mutate(vm(cpus_use=2, scale_seq=1)) is None  # someone planned meanwhile
    with pytest.raises(FencedOut):
        mutate(vm(cpus_use=2, fence=Fence(epoch=4, token=1)))


def test_commit_records_what_the_runner_reported_and_ends_the_scaling_phase() -> None:
    v = vm(cpus_use=2, slots_use=2, pending=scale_plan(slots=2), phase="Scaling")
    action = act.CommitScale(seq=1, vcpus=2, memory_bytes=2 * GIB)
    new = status_mutation(action, LEASE)(v)
    assert new is not None
    assert (new.cpus, new.memory_size, new.pending_scale, new.phase) == (
        MilliCPU(2000), "2Gi", None, "Running")
    assert [(c.type, c.status) for c in new.conditions] == [("Scaling", "False")]
    later = dataclasses.replace(v, status=dataclasses.replace(v.status,
                                                              pending_scale=scale_plan(seq=2)))
    assert status_mutation(action, LEASE)(later) is None  # another plan by now


def test_a_restart_drops_the_plan_of_the_pod_that_is_gone() -> None:
    v = vm(cpus_use=2, pending=scale_plan(), phase="Scaling")
    new = status_mutation(act.Restart(name=POD, uid="uid-1"), LEASE)(v)
    assert new is not None and new.pending_scale is None and new.cpus is None


@pytest.mark.parametrize("reason", ["ScalingInProgress", "RunnerNotAnswering",
                                    reasons.SCALING_NEEDS_RESTART])
def test_the_scaling_condition_ends_with_the_pod_it_was_about(reason: str) -> None:
    # Review S8: a Restart and a pod Commit clear the plan; the Scaling condition must
    # not go on saying True (tools wait for False), nor a refusal about the old pod.
    from neonvm.api.types import Condition, PendingPod
    from neonvm.controller.mutations import POD_REPLACED

    v = vm(cpus_use=2, pending=scale_plan(), phase="Scaling")
    v.status.conditions.append(Condition(
        type=reasons.SCALING_CONDITION, reason=reason, message="about the old pod",
        status="False" if reason == reasons.SCALING_NEEDS_RESTART else "True"))  # type: ignore[arg-type]
    restarted = status_mutation(act.Restart(name=POD, uid="uid-1"), LEASE)(v)
    assert restarted is not None and restarted.pending_scale is None
    (cond,) = [c for c in restarted.conditions if c.type == reasons.SCALING_CONDITION]
    assert (cond.status, cond.reason) == ("False", POD_REPLACED), cond
    # The next pod's commit, from a status that still carries the old condition.
    v.status.pod_name, v.status.pod_uid = "", ""
    v.status.pending_pod = PendingPod(name="vm-01234567-2", plan_seq=2, token=40, epoch=3)
    committed = status_mutation(act.Commit(name="vm-01234567-2", uid="uid-2"), LEASE)(v)
    assert committed is not None and committed.pending_scale is None
    (cond,) = [c for c in committed.conditions if c.type == reasons.SCALING_CONDITION]
    assert (cond.status, cond.reason) == ("False", POD_REPLACED), cond
    # A VM that never scaled gets no Scaling condition from either.
    plain = vm()
    plain.status.pod_name = ""
    plain.status.pending_pod = v.status.pending_pod
    fresh = status_mutation(act.Commit(name="vm-01234567-2", uid="uid-2"), LEASE)(plain)
    assert fresh is not None and not any(c.type == reasons.SCALING_CONDITION
                                         for c in fresh.conditions)


def test_a_token_the_runner_refuses_is_asked_again_until_a_rotation_would_have_landed(
        ) -> None:
    # Review S6: the kubelet refreshes a rotated token Secret on the pod about a minute
    # later; a 401 meanwhile must not end the generation's scaling. Only NoToken (the
    # pod has no token file at all) is for good at once.
    from kubernetes import client as k8s

    from neonvm.api.scale_protocol import NO_TOKEN
    from neonvm.controller.scaling import TOKEN_SYNC_SECONDS, RunnerScaling

    now = [1000.0]
    scaling = RunnerScaling(k8s.ApiClient(), clock=lambda: now[0])
    wrong = {"error": "wrong bearer token"}
    assert scaling.unauthorized("uid-1", wrong, "401") == "token_refused"
    now[0] += TOKEN_SYNC_SECONDS - 1
    assert scaling.unauthorized("uid-1", wrong, "401") == "token_refused"
    assert scaling.unauthorized("uid-2", wrong, "401") == "token_refused"  # per pod
    now[0] += 1
    assert scaling.unauthorized("uid-1", wrong, "401") == "runner_401"
    assert scaling.unauthorized("uid-1", wrong, "401") == "token_refused"  # a new window
    assert scaling.unauthorized("uid-3", {"reason": NO_TOKEN}, "401") == "runner_401"


def test_the_token_window_starts_again_after_the_refusals_stopped() -> None:
    # Review scalefix2 F4: a plan can end with no later PUT (committed from GET /scale,
    # dropped, no token), leaving one 401 on record. The next rotation's first 401, a
    # day later, is a new refusal: it must not be runner_401 at once.
    from kubernetes import client as k8s

    from neonvm.controller.observe import Snapshot
    from neonvm.controller.scaling import (
        TOKEN_QUIET_SECONDS,
        TOKEN_SYNC_SECONDS,
        RunnerScaling,
    )

    now = [1000.0]
    scaling = RunnerScaling(k8s.ApiClient(), clock=lambda: now[0],
                            address=lambda vm, pod: "http://127.0.0.1:1")  # nobody there
    wrong = {"error": "wrong bearer token"}
    assert scaling.unauthorized("uid-1", wrong, "401") == "token_refused"
    now[0] += TOKEN_QUIET_SECONDS + 1
    assert scaling.unauthorized("uid-1", wrong, "401") == "token_refused"
    # Refusals spaced by less than the quiet time stay one window.
    now[0] += TOKEN_QUIET_SECONDS - 1
    assert scaling.unauthorized("uid-1", wrong, "401") == "runner_401"
    # The plan ends (no plan observed): its pod's refusals are forgotten at once, and
    # so they are when the plan is for another pod; the plan's own pod keeps its window.
    assert scaling.unauthorized("uid-1", wrong, "401", vm_uid=UID) == "token_refused"
    assert scaling.unauthorized("uid-2", wrong, "401", vm_uid=UID) == "token_refused"
    now[0] += TOKEN_SYNC_SECONDS
    scaling.observe(Snapshot(obs=obs(vm(pending=scale_plan())), record=None))
    assert scaling.unauthorized("uid-1", wrong, "401", vm_uid=UID) == "runner_401"
    assert scaling.unauthorized("uid-2", wrong, "401", vm_uid=UID) == "token_refused"
    now[0] += TOKEN_SYNC_SECONDS
    scaling.observe(Snapshot(obs=obs(vm()), record=None))
    assert scaling.unauthorized("uid-2", wrong, "401", vm_uid=UID) == "token_refused"


def test_a_scalable_pod_carries_the_token_mount_and_the_fence_floor() -> None:
    from neonvm.api.types import PendingPod

    v = vm(scale_seq=7, fence=Fence(epoch=5, token=77))
    v.status.scaling_token_secret, v.status.scaling_token_secret_uid = "neonvm-s-x", "u-s"
    pod = podspec.runner_pod(v, PendingPod(name=POD, plan_seq=1, token=77, epoch=5))
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["NEONVM_SCALING_FENCE_FLOOR"] == "5,77,7"
    assert env["NEONVM_SCALING_TOKEN_FILE"] == "/vm/scaling/token"
    assert {"name": "vm-scaling-token", "secret": {
        "secretName": "neonvm-s-x", "optional": True,
        "items": [{"key": "token", "path": "token"}]}} in pod["spec"]["volumes"]


def test_the_runner_refuses_a_plan_older_than_its_pods_floor(tmp_path: object) -> None:
    from pathlib import Path

    work = Path(str(tmp_path))
    token = work / "token"
    token.write_text("t0k3n\n")
    limits = ScaleLimits(min_vcpus=1, max_vcpus=2, min_slots=1, max_slots=2, slot_bytes=GIB)
    scaler = Scaler(work, token, limits, boot=ScaleTarget(1, 1),
                    fence_floor=parse_fence_floor("5,77,7"))
    # Recorded before the pod existed (same authority, lower seq; or an older epoch): 409.
    for fence in ('{"epoch": 5, "token": 77, "seq": 6}', '{"epoch": 4, "token": 99, "seq": 50}'):
        with pytest.raises(ScaleError) as err:
            scaler.scale("Bearer t0k3n", f'{{"cpus": 2, "fence": {fence}}}'.encode())
        assert err.value.status == 409, err.value
    # A newer plan passes the fence (and stops at QMP, not connected here: 503).
    with pytest.raises(ScaleError) as err:
        scaler.scale("Bearer t0k3n", b'{"cpus": 2, "fence": {"epoch": 5, "token": 77, "seq": 8}}')
    assert err.value.status == 503
    # seq orders fences of one authority; a fence file wins over the floor.
    FenceStore(work).save(AppliedFence(ScaleFence(5, 77, 9), ScaleTarget(2, 1), 1.0))
    assert scaler.last_applied() == AppliedFence(ScaleFence(5, 77, 9), ScaleTarget(2, 1), 1.0)
    with pytest.raises(ScaleError) as err:
        scaler.scale("Bearer t0k3n", b'{"cpus": 1, "fence": {"epoch": 5, "token": 77, "seq": 8}}')
    assert err.value.status == 409


def test_the_runner_orders_fences_by_epoch_then_token_then_seq() -> None:
    from neonvm.api.scale_protocol import fence_decision, parse_request

    last = AppliedFence(ScaleFence(3, 10, 2), ScaleTarget(2, 2), 0.0)
    other = ScaleTarget(1, 1)
    assert fence_decision(last, ScaleFence(3, 10, 3), other) == "newer"  # next plan, same term
    assert fence_decision(last, ScaleFence(3, 11, 0), other) == "newer"
    for stale in (ScaleFence(3, 10, 1), ScaleFence(2, 99, 99)):
        with pytest.raises(ScaleError, match="stale fence"):
            fence_decision(last, stale, other)
    fence, _ = parse_request(b'{"cpus": 1, "fence": {"epoch": 3, "token": 10, "seq": 4}}',
                             ScaleTarget(1, 1))
    assert fence == ScaleFence(3, 10, 4)
    fence, _ = parse_request(b'{"cpus": 1, "fence": {"epoch": 3, "token": 10}}',
                             ScaleTarget(1, 1))
    assert fence == ScaleFence(3, 10, 0)


# ---- review findings: a changed spec between create and commit, a plan that cannot finish,
# the pod's own port --------------------------------------------------------------------------


def _created_pod(v: VirtualMachine, uid: str = "uid-2") -> dict[str, object]:
    """The pod podspec builds for ``v``'s next plan, as the API server returns it (uid,
    running: the commit does not look at its phase)."""
    from neonvm.api.types import PendingPod

    plan = PendingPod(name=f"vm-{UID[:8]}-2", plan_seq=2, token=40, epoch=3, generation=2)
    pod = podspec.runner_pod(v, plan)
    pod["metadata"]["uid"] = uid
    return pod


def test_the_pod_commit_records_the_size_the_pod_was_built_with_not_the_spec_at_commit() -> None:
    from neonvm.api.types import PendingPod
    from neonvm.controller.observe import pod_view

    # Pod built while the spec asked for 1 vCPU / 1 slot; the spec says 2 / 2 by the commit.
    built_from = vm(cpus_use=1, slots_use=1)
    raw = _created_pod(built_from)
    later = vm(cpus_use=2, slots_use=2)
    later.status.pod_name, later.status.pod_uid, later.status.cpus = "", "", None
    later.status.memory_size, later.status.phase = None, "Pending"
    later.status.pending_pod = PendingPod(name=raw["metadata"]["name"],  # type: ignore[index]
                                          plan_seq=2, token=40, epoch=3, generation=2)
    later.status.plan_seq = 2
    commit = d.decide(obs(later, pod=pod_view(raw)))  # type: ignore[arg-type]
    assert isinstance(commit, act.Commit)
    new = status_mutation(commit, LEASE)(later)
    assert new is not None and (new.cpus, new.memory_size) == (MilliCPU(1000), "1Gi")
    # ... so once the pod runs, the spec's 2 / 2 is planned: the guest gets there.
    running_vm = dataclasses.replace(later, status=new)
    running_vm.status.phase = "Running"
    running_pod = dataclasses.replace(pod_view(raw), gated=False,  # type: ignore[arg-type]
                                      phase="Running", node="n1", ip="10.0.0.1")
    running_vm.status.node, running_vm.status.pod_ip = "n1", "10.0.0.1"
    plan = d.decide(obs(running_vm, pod=running_pod))
    assert isinstance(plan, act.PlanScale), plan
    assert (plan.plan.cpus, plan.plan.memory_slots) == (2, 2)


def test_a_plan_that_cannot_finish_is_superseded_with_the_next_seq_when_the_spec_moves_on() -> None:
    # Plan #3 (back to 1 slot) is stuck: the runner recorded its fence but the guest keeps
    # its memory (504 on every retry). The user asks for 2 slots again.
    stuck = scale_plan(cpus=1, slots=1, seq=3)
    v = vm(cpus_use=1, slots_use=2, status_slots=2, scale_seq=3, pending=stuck,
           phase="Scaling")
    runner = view((3, 40, 3), 1, 2)
    assert isinstance(d.decide(obs(vm(cpus_use=1, slots_use=1, status_slots=2, scale_seq=3,
                                      pending=stuck, phase="Scaling"), runner=runner)),
                      act.ApplyScale), "the spec still asks for the plan's size: retry it"
    action = d.decide(obs(v, runner=runner))
    assert isinstance(action, act.PlanScale), action
    assert (action.plan.seq, action.plan.cpus, action.plan.memory_slots) == (4, 1, 2)
    assert action.observed_seq == 3
    new = status_mutation(action, LEASE)(v)
    assert new is not None and new.pending_scale == action.plan and new.scale_seq == 4
    assert new.phase == "Scaling"
    # The runner orders the new plan after the stuck one, and refuses the stuck one after.
    last = AppliedFence(ScaleFence(3, 40, 3), ScaleTarget(1, 1), 0.0)
    from neonvm.api.scale_protocol import fence_decision

    assert fence_decision(last, ScaleFence(3, 40, 4), ScaleTarget(1, 2)) == "newer"
    with pytest.raises(ScaleError):
        fence_decision(AppliedFence(ScaleFence(3, 40, 4), ScaleTarget(1, 2), 0.0),
                       ScaleFence(3, 40, 3), ScaleTarget(1, 1))
    # Only the plan observed is superseded, and only for another size.
    assert status_mutation(action, LEASE)(dataclasses.replace(v, status=new)) is None
    same = vm(cpus_use=1, slots_use=1, status_slots=2, scale_seq=3, pending=stuck,
              phase="Scaling")
    assert status_mutation(dataclasses.replace(action, plan=dataclasses.replace(
        action.plan, memory_slots=1)), LEASE)(same) is None


def test_the_runner_is_called_on_the_port_in_the_pods_own_spec() -> None:
    from neonvm.controller.observe import pod_view
    from neonvm.controller.scaling import default_address

    v = vm()
    v.spec.runner_port = 25183
    raw = _created_pod(v)
    raw["status"] = {"phase": "Running", "podIP": "10.0.0.9"}
    v.spec.runner_port = 26000  # changed after the pod was built
    assert default_address(v, pod_view(raw)) == "http://10.0.0.9:25183"  # type: ignore[arg-type]


def test_a_scalable_pod_without_a_token_secret_still_carries_its_fence_floor() -> None:
    # Found by the scaling explorer: a pod built with no Secret recorded (the controller
    # may not create Secrets) must still refuse plans older than itself once a token
    # reaches it; only the token mount is left out.
    from neonvm.api.types import PendingPod

    v = vm(scale_seq=7, fence=Fence(epoch=5, token=77))
    pod = podspec.runner_pod(v, PendingPod(name=POD, plan_seq=1, token=77, epoch=5))
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["NEONVM_SCALING_FENCE_FLOOR"] == "5,77,7"
    assert "NEONVM_SCALING_TOKEN_FILE" not in env
    assert not any(vol["name"] == "vm-scaling-token" for vol in pod["spec"]["volumes"])


def test_a_changed_memory_slot_size_is_not_scaled_live_but_needs_a_restart() -> None:
    # Review S1: the runner counts slots in the size its pod was built with. The pod was
    # built with 1Gi slots (2 of them); the user sets memorySlotSize 2Gi, use 2 (4Gi).
    # Planning "2 slots" would be a no-op at the runner, committed as 2Gi, then planned
    # again forever (or a 3Gi status no slot count fits, blocking every later plan).
    from neonvm.controller.observe import pod_view

    built_from = vm(slots_use=2, status_slots=2)
    raw = _created_pod(built_from, uid="uid-1")
    pod = dataclasses.replace(pod_view(raw), name=POD, gated=False,  # type: ignore[arg-type]
                              phase="Running", node="n1", ip="10.0.0.1")
    v = vm(slots_use=2, status_slots=2)
    v.spec.guest.memory_slot_size = "2Gi"
    action = d.decide(obs(v, pod=pod))
    assert isinstance(action, act.DropScale), action
    assert action.refused == reasons.SCALING_NEEDS_RESTART, action
    assert "memorySlotSize" in action.reason
    new = status_mutation(action, LEASE)(v)
    assert new is not None and new.pending_scale is None and new.scale_seq == 0
    cond = next(c for c in new.conditions if c.type == reasons.SCALING_CONDITION)
    assert (cond.status, cond.reason, cond.observed_generation) == (
        "False", reasons.SCALING_NEEDS_RESTART, v.generation)
    said = dataclasses.replace(v, status=new)
    assert d.decide(obs(said, pod=pod)) == act.Done(reason=d.decide(obs(said, pod=pod)).reason)
    # A plan recorded before the change is dropped the same way.
    v.status.pending_scale, v.status.scale_seq = scale_plan(cpus=1, slots=2), 1
    v.status.phase = "Scaling"
    action = d.decide(obs(v, pod=pod))
    assert isinstance(action, act.DropScale) and action.seq == 1, action
    assert action.refused == reasons.SCALING_NEEDS_RESTART
    # The slot size back to the pod's: planning resumes.
    v.spec.guest.memory_slot_size = "1Gi"
    assert not isinstance(d.decide(obs(v, pod=pod)), act.DropScale)


def test_a_put_that_lands_after_its_plan_was_dropped_is_adopted_into_status() -> None:
    # Review S5: plan #1 (2 vCPUs, 2 slots) was refused and dropped (ScalingDisabled); a
    # PUT of it sent before (a deposed leader's, or our own that timed out) lands later
    # and the guest has 2/2. For LATE_PUT_SECONDS after the drop the runner is looked at
    # and what it reports (settled, from the committed pod itself) goes into status.
    import datetime as dt

    from neonvm.api.types import Condition

    dropped_at = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
    v = vm(cpus_use=2, slots_use=2, scale_seq=1)
    v.status.conditions.append(Condition(
        type=reasons.SCALING_CONDITION, status="False", reason=reasons.SCALING_DISABLED,  # type: ignore[arg-type]
        message="dropped", observed_generation=2,
        last_transition_time=times.format_microtime(dropped_at)))
    landed = dataclasses.replace(view((3, 40, 1), 2, 2), answered_uid="uid-1")

    def at(seconds: float, runner: act.RunnerView | None) -> act.Action:
        return d.decide(dataclasses.replace(
            obs(v, runner=runner), now=dropped_at + dt.timedelta(seconds=seconds)))

    assert looks.looks_after_drop(v, dropped_at + dt.timedelta(seconds=10))
    assert not looks.looks_after_drop(v, dropped_at + dt.timedelta(seconds=looks.LATE_PUT_SECONDS))
    action = at(10, landed)
    assert action == act.CommitScale(seq=1, vcpus=2, memory_bytes=2 * GIB, adopt=True,
                                   pod_uid="uid-1", reason=action.reason)
    # Not from a runner that does not name the committed pod (a reused IP), nor one
    # with a removal pending or no vCPU count yet; refused for this generation: no plan.
    for runner in (dataclasses.replace(landed, answered_uid=None),
                   dataclasses.replace(landed, answered_uid="uid-9"),
                   dataclasses.replace(landed, pending_removals=("dimm-slot1",)),
                   dataclasses.replace(landed, vcpus=0)):  # SysfsScaling, no report yet
        assert isinstance(at(10, runner), act.Done), runner
    # Outside the window the controller does not ask the runner (no view, nothing).
    assert isinstance(at(looks.LATE_PUT_SECONDS + 1, None), act.Done)
    # The write: what the runner reported, the condition (the refusal) kept; refused
    # when a plan was made since the observation, or the pod was replaced.
    new = status_mutation(action, LEASE)(v)
    assert new is not None and (new.cpus, new.memory_size) == (MilliCPU(2000), "2Gi")
    assert new.pending_scale is None and new.phase == "Running"
    (cond,) = [c for c in new.conditions if c.type == reasons.SCALING_CONDITION]
    assert cond.reason == reasons.SCALING_DISABLED
    assert status_mutation(action, LEASE)(vm(scale_seq=2)) is None
    replaced = vm(scale_seq=1)
    replaced.status.pod_uid = "uid-2"
    assert status_mutation(action, LEASE)(replaced) is None
    # A VM whose last plan was committed (or never planned) is not looked at.
    done = vm(scale_seq=1)
    done.status.conditions.append(Condition(
        type=reasons.SCALING_CONDITION, status="False", reason="ScalingDone",  # type: ignore[arg-type]
        message="", last_transition_time=times.format_microtime(dropped_at)))
    assert not looks.looks_after_drop(done, dropped_at) and not looks.looks_after_drop(vm(), None)


def test_a_pod_built_before_the_slot_size_field_is_judged_by_the_spec_it_carries() -> None:
    # Review R6: a pod whose built-size annotation has two fields (built before the slot
    # size was recorded there) still carries the spec its runner was started from; its
    # memorySlotSize is the unit the runner counts in, so a changed slot size is caught.
    from neonvm.controller.observe import pod_view

    built_from = vm(slots_use=2, status_slots=2)
    raw = _created_pod(built_from, uid="uid-1")
    annotations = raw["metadata"]["annotations"]  # type: ignore[index]
    milli, slots, _ = annotations[podspec.ANNOTATION_BUILT_SIZE].split(",")
    annotations[podspec.ANNOTATION_BUILT_SIZE] = f"{milli},{slots}"
    assert podspec.built_slot_bytes(raw["metadata"]) == GIB  # type: ignore[arg-type]
    pod = dataclasses.replace(pod_view(raw), name=POD, gated=False,  # type: ignore[arg-type]
                              phase="Running", node="n1", ip="10.0.0.1")
    assert pod.slot_bytes == GIB
    v = vm(slots_use=2, status_slots=2)
    v.spec.guest.memory_slot_size = "2Gi"
    action = d.decide(obs(v, pod=pod))
    assert isinstance(action, act.DropScale), action
    assert action.refused == reasons.SCALING_NEEDS_RESTART, action
    # Neither the field nor a readable spec: unknown, as before.
    del annotations[podspec.ANNOTATION_SPEC]
    assert podspec.built_slot_bytes(raw["metadata"]) is None  # type: ignore[arg-type]


# ---- the look after a drop, recorded in status (review MEDIUM 1 and 2) -------------------


def dropped_vm(*, status_cpus: int = 1, status_slots: int = 1,
               look: str | None = "uid-1") -> tuple[VirtualMachine, dt.datetime]:
    """A VM whose plan #1 (2 vCPUs, 2 slots) was dropped at the returned time
    (ScalingDisabled: no new plan for this spec), status saying ``status_cpus`` /
    ``status_slots`` and ``scaleLookPodUID`` = ``look`` (``scaleLookSince`` the drop's
    time when ``look`` is set)."""
    from neonvm.api.types import Condition

    dropped_at = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
    v = vm(cpus_use=2, slots_use=2, status_cpus=status_cpus, status_slots=status_slots,
           scale_seq=1)
    v.status.conditions.append(Condition(
        type=reasons.SCALING_CONDITION, status="False", reason=reasons.SCALING_DISABLED,  # type: ignore[arg-type]
        message="dropped", observed_generation=2,
        last_transition_time=times.format_microtime(dropped_at)))
    v.status.scale_look_pod_uid = look
    v.status.scale_look_since = times.format_microtime(dropped_at) if look else None
    return v, dropped_at


def answer(cpus: int, slots: int, *removals: str) -> act.RunnerView:
    """The committed pod's runner, naming its pod, at ``cpus`` / ``slots``."""
    return dataclasses.replace(view((3, 40, 1), cpus, slots), answered_uid="uid-1",
                               pending_removals=removals)


def decide_at(v: VirtualMachine, at: dt.datetime, runner: act.RunnerView | None) -> act.Action:
    return d.decide(dataclasses.replace(obs(v, runner=runner), now=at))


PAST = dt.timedelta(seconds=looks.LATE_PUT_SECONDS + 1)
"""An observation taken after the late-PUT window of the drop has passed."""


def test_a_drop_records_in_status_which_runner_is_still_to_be_looked_at() -> None:
    # The drop and the record of the look are one write: no controller (this one after a
    # failed write, a new leader) can see the drop without it.
    v = vm(cpus_use=2, slots_use=2, scale_seq=1, pending=scale_plan(cpus=2, slots=2))
    dropped = status_mutation(act.DropScale(seq=1, refused=reasons.SCALING_DISABLED), LEASE)(v)
    assert dropped is not None and dropped.pending_scale is None
    assert dropped.scale_look_pod_uid == "uid-1"
    # A plan for a pod that is not the committed one asks for no look at this one.
    other = vm(scale_seq=1, pending=dataclasses.replace(scale_plan(), pod_uid="uid-0"))
    moved = status_mutation(act.DropScale(seq=1), LEASE)(other)
    assert moved is not None and moved.scale_look_pod_uid is None
    # A refusal without a plan (a new spec generation) leaves the record as it is.
    v, _ = dropped_vm()
    v.generation = 3
    again = status_mutation(act.DropScale(seq=1, refused=reasons.SCALING_NEEDS_RESTART,
                                        generation=3), LEASE)(v)
    assert again is not None and again.scale_look_pod_uid == "uid-1"


def test_a_new_plan_or_a_new_pod_ends_the_look() -> None:
    # A new plan: its fence is above the dropped plan's, so the runner refuses that one
    # once it applied this one, and this plan commits what the runner then reports.
    v, _ = dropped_vm()
    v.status.conditions.clear()
    planned = status_mutation(act.PlanScale(plan=scale_plan(seq=2, slots=2), observed_seq=1),
                              LEASE)(v)
    assert planned is not None and planned.scale_look_pod_uid is None
    # The pod gone (Restart) or a new one committed: the old pod's runner is gone.
    v, _ = dropped_vm()
    restarted = status_mutation(act.Restart(name=POD, uid="uid-1"), LEASE)(v)
    assert restarted is not None and restarted.scale_look_pod_uid is None
    v, _ = dropped_vm()
    v.status.pod_name, v.status.pod_uid = "", ""
    v.status.pending_pod = PendingPod(name="vm-2")
    committed = status_mutation(act.Commit(name="vm-2", uid="uid-2"), LEASE)(v)
    assert committed is not None and committed.scale_look_pod_uid is None


def test_past_the_window_a_runner_settled_at_status_size_ends_the_look_by_a_write() -> None:
    v, dropped_at = dropped_vm()
    # Within the window: nothing to write, the look goes on (a late PUT may still land).
    assert isinstance(decide_at(v, dropped_at + dt.timedelta(seconds=10), answer(1, 1)),
                      act.Done)
    # Past it: still looked at (status asks), and a settled answer equal to status is
    # written, only to end the look; the look ends when that write lands.
    assert looks.looks_at_runner(v, dropped_at + PAST)
    action = decide_at(v, dropped_at + PAST, answer(1, 1))
    assert action == act.CommitScale(seq=1, vcpus=1, memory_bytes=GIB, adopt=True,
                                   pod_uid="uid-1", ends_look=True, look_recorded=True,
                                   reason=action.reason)
    new = status_mutation(action, LEASE)(v)
    assert new is not None and new.scale_look_pod_uid is None
    assert (new.cpus, new.memory_size) == (MilliCPU(1000), "1Gi")
    v.status = new
    assert not looks.looks_at_runner(v, dropped_at + PAST)
    assert status_mutation(action, LEASE)(v) is None  # done already: no second write


def test_past_the_window_a_runner_at_another_size_is_adopted_and_the_look_ends() -> None:
    v, dropped_at = dropped_vm()
    action = decide_at(v, dropped_at + PAST, answer(2, 2))
    assert action == act.CommitScale(seq=1, vcpus=2, memory_bytes=2 * GIB, adopt=True,
                                   pod_uid="uid-1", ends_look=True, look_recorded=True,
                                   reason=action.reason)
    new = status_mutation(action, LEASE)(v)
    assert new is not None and new.scale_look_pod_uid is None
    assert (new.cpus, new.memory_size) == (MilliCPU(2000), "2Gi")
    # The adopting write keeps its preconditions: no plan made since the observation,
    # the committed pod still the one asked.
    planned, _ = dropped_vm()
    planned.status.scale_seq = 2
    assert status_mutation(action, LEASE)(planned) is None
    replaced, _ = dropped_vm()
    replaced.status.pod_uid = "uid-2"
    assert status_mutation(action, LEASE)(replaced) is None
    # Within the window the size is adopted but the look goes on: an answer asked
    # before a late PUT landed would otherwise be the last word.
    early = decide_at(v, dropped_at + dt.timedelta(seconds=10), answer(2, 2))
    assert isinstance(early, act.CommitScale) and early.adopt and not early.ends_look
    kept = status_mutation(early, LEASE)(v)
    assert kept is not None and kept.scale_look_pod_uid == "uid-1"
    # Once a write decided past the window has ended the look, an adopt decided from an
    # older answer (its writer paused since) does not land: it would put an older size
    # back with nobody looking any more.
    ended, _ = dropped_vm()
    last_word = decide_at(ended, dropped_at + PAST, answer(1, 1))
    written = status_mutation(last_word, LEASE)(ended)
    assert written is not None and written.scale_look_pod_uid is None
    ended.status = written
    assert status_mutation(early, LEASE)(ended) is None


def test_past_the_window_a_removal_still_pending_keeps_the_look() -> None:
    v, dropped_at = dropped_vm(status_slots=2)
    later = dropped_at + PAST + dt.timedelta(minutes=30)
    assert looks.looks_at_runner(v, later)
    assert isinstance(decide_at(v, later, answer(1, 2, "dimm-slot1")), act.Done)
    # An answer that cannot be adopted (another pod's, at a reused IP) ends nothing.
    other = dataclasses.replace(answer(1, 1), answered_uid="uid-9")
    assert isinstance(decide_at(v, later, other), act.Done)
    # Once ejected: adopted, and the look ends with that write.
    action = decide_at(v, later, answer(1, 1))
    assert isinstance(action, act.CommitScale) and action.adopt and action.ends_look
    assert (action.vcpus, action.memory_bytes) == (1, GIB)


def test_a_vm_dropped_before_the_record_existed_is_looked_at_within_the_window_only() -> None:
    # Stored before scaleLookPodUID: the drop left no record, so the look is today's.
    v, dropped_at = dropped_vm(look=None)
    assert looks.looks_at_runner(v, dropped_at + dt.timedelta(seconds=10))
    assert not looks.looks_at_runner(v, dropped_at + PAST)
    early = decide_at(v, dropped_at + dt.timedelta(seconds=10), answer(2, 2))
    assert isinstance(early, act.CommitScale) and not early.ends_look
    # A record naming another pod than the committed one asks for nothing.
    stale, _ = dropped_vm(look="uid-0")
    assert not looks.looks_at_runner(stale, dropped_at + PAST)


# ---- the look's own time, its bound, and what ends it (review lookfix L1, L3, L8) -------


def test_the_window_counts_from_the_drop_recorded_with_the_look_not_from_the_condition() -> None:
    # Review L1: a new leader's Wait (Scaling=True, RunnerNotAnswering) written over the
    # drop's condition says nothing about when the plan was dropped. 20 s after the drop
    # the window is still open: a settled answer at status's size ends nothing.
    v, dropped_at = dropped_vm()
    v.spec.guest.cpus.use, v.spec.guest.memory_slots.use = MilliCPU(1000), 1  # A->B->A
    cond = next(c for c in v.status.conditions if c.type == reasons.SCALING_CONDITION)
    cond.status, cond.reason = "True", "RunnerNotAnswering"  # type: ignore[assignment]
    soon = dropped_at + dt.timedelta(seconds=20)
    assert looks.looks_at_runner(v, soon)
    assert not looks.look_may_end(v, soon)
    assert isinstance(decide_at(v, soon, answer(1, 1)), act.Done)
    # Past the window counted from scaleLookSince, the same answer ends the look.
    action = decide_at(v, dropped_at + PAST, answer(1, 1))
    assert isinstance(action, act.CommitScale) and action.ends_look
    # The drop writes the time with the look, and every write that ends the look
    # clears both.
    planned = vm(cpus_use=2, slots_use=2, scale_seq=1, pending=scale_plan(cpus=2, slots=2))
    drop = act.DropScale(seq=1, refused=reasons.SCALING_DISABLED)
    dropped = status_mutation(drop, LEASE)(planned)
    assert dropped is not None and dropped.scale_look_pod_uid == "uid-1"
    since = times.parse(dropped.scale_look_since)
    assert since is not None and abs((since - dt.datetime.now(dt.UTC)).total_seconds()) < 60
    ended = status_mutation(action, LEASE)(v)
    assert ended is not None and (ended.scale_look_pod_uid, ended.scale_look_since) == (
        None, None)
    # A look recorded without its time (this branch's previous commit): window passed.
    untimed, _ = dropped_vm()
    untimed.status.scale_look_since = None
    assert looks.look_may_end(untimed, soon)


def test_a_scaling_true_condition_lands_only_while_its_plan_is_still_recorded() -> None:
    # Review L1: the Wait's condition write, decided while plan #1 was recorded, is run
    # again on the fresh copy after a 409; a deposed leader's drop of #1 landed first.
    # It must not turn the condition that says why the plan was dropped into
    # Scaling=True with no plan.
    from neonvm.controller.conditions import conditions_mutation, desired_conditions
    from neonvm.controller.observe import Snapshot

    waiting = vm(cpus_use=2, slots_use=2, scale_seq=1, pending=scale_plan(cpus=2, slots=2),
                 phase="Scaling")
    wait = d.decide(obs(waiting, error="connection refused"))
    assert isinstance(wait, act.Wait) and wait.condition == reasons.SCALING_CONDITION
    snap = Snapshot(obs=obs(waiting, error="connection refused"), record=None)
    mutate = conditions_mutation(desired_conditions(snap, wait), LEASE)
    # Decided for the copy it saw, it lands there.
    first = mutate(copy.deepcopy(waiting))
    assert first is not None
    assert any(c.type == reasons.SCALING_CONDITION and c.status == "True" for c in first.conditions)
    # On the fresh copy where the drop landed, the Scaling condition is left alone.
    fresh, _ = dropped_vm()
    fresh.status.fence = None
    written = mutate(copy.deepcopy(fresh)) or fresh.status
    scaling = next(c for c in written.conditions if c.type == reasons.SCALING_CONDITION)
    assert (scaling.status, scaling.reason) == ("False", reasons.SCALING_DISABLED)
    # Nor where a newer plan is recorded (that plan's own write said what it is).
    newer = vm(cpus_use=2, slots_use=2, scale_seq=2, pending=scale_plan(seq=2, slots=2),
               phase="Scaling")
    assert not any(c.type == reasons.SCALING_CONDITION
                   for c in (mutate(copy.deepcopy(newer)) or newer.status).conditions)


def test_a_look_that_nothing_ends_is_given_up_after_its_bound_by_a_write_adopting_nothing() -> None:
    # Review L3: a runner that never answers (or never settles) would cost a GET per
    # resync forever. Past LOOK_GIVE_UP_SECONDS from the drop the look ends with a
    # write that adopts nothing.
    v, dropped_at = dropped_vm()
    before = dropped_at + dt.timedelta(seconds=looks.LOOK_GIVE_UP_SECONDS - 1)
    after = dropped_at + dt.timedelta(seconds=looks.LOOK_GIVE_UP_SECONDS)
    unreachable = dataclasses.replace(obs(v, error="connection refused"), now=before)
    assert isinstance(d.decide(unreachable), act.Done)
    action = d.decide(dataclasses.replace(unreachable, now=after))
    assert action == act.CommitScale(seq=1, adopt=True, pod_uid="uid-1", ends_look=True,
                                   look_recorded=True, gives_up=True, reason=action.reason)
    assert "connection refused" in action.reason
    new = status_mutation(action, LEASE)(v)
    assert new is not None and (new.scale_look_pod_uid, new.scale_look_since) == (None, None)
    assert (new.cpus, new.memory_size) == (v.status.cpus, v.status.memory_size)
    v.status = new
    assert not looks.looks_at_runner(v, after)
    # A removal that stays pending, or an answer that does not name the pod: the same.
    pending, _ = dropped_vm(status_slots=2)
    given_up = decide_at(pending, after, answer(1, 2, "dimm-slot1"))
    assert isinstance(given_up, act.CommitScale) and given_up.gives_up
    # A settled answer at another size at that time is still adopted (not given up).
    adopted = decide_at(dropped_vm()[0], after, answer(2, 2))
    assert isinstance(adopted, act.CommitScale) and not adopted.gives_up
    assert (adopted.vcpus, adopted.memory_bytes) == (2, 2 * GIB)
    # The give-up lands only while the look is still recorded.
    ended, _ = dropped_vm()
    ended.status.scale_look_pod_uid = ended.status.scale_look_since = None
    assert status_mutation(action, LEASE)(ended) is None


def test_a_drop_for_a_pod_without_a_token_asks_for_no_look() -> None:
    # Review L3: the pod mounts no token, so every PUT to its runner is refused: nothing
    # of the plan can land, and a look could never learn anything.
    v = vm(cpus_use=2, slots_use=2, scale_seq=1, pending=scale_plan(cpus=2, slots=2))
    drop = act.DropScale(seq=1, refused=reasons.SCALING_NEEDS_RESTART, starts_look=False)
    dropped = status_mutation(drop, LEASE)(v)
    assert dropped is not None and dropped.pending_scale is None
    assert (dropped.scale_look_pod_uid, dropped.scale_look_since) == (None, None)


def test_the_write_that_only_ends_the_look_keeps_a_fractional_cpus() -> None:
    # Review L8: status.cpus 500m (cpus.use 0.5 at boot) rounds up to the 1 vCPU the
    # runner reports: the write that ends the look changes nothing NeonVM reads.
    v, dropped_at = dropped_vm()
    v.status.cpus = MilliCPU(500)
    action = decide_at(v, dropped_at + PAST, answer(1, 1))
    assert isinstance(action, act.CommitScale) and action.ends_look
    new = status_mutation(action, LEASE)(v)
    assert new is not None and new.scale_look_pod_uid is None
    assert (new.cpus, new.memory_size) == (MilliCPU(500), "1Gi")
