"""The pure decision: given one observation, the next single action of the state machine.

These are specifications of :func:`neonvm.controller.decide.decide` with hand-built
observations (no servers). The last tests are properties over generated observations:
the three promises in decide's module docstring hold for *every* observation.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neonvm.api import times
from neonvm.api.schema import decode
from neonvm.api.types import (
    FINALIZER,
    Fence,
    PendingPod,
    VirtualMachine,
    VirtualMachineSpec,
    VirtualMachineStatus,
)
from neonvm.controller import actions as act
from neonvm.controller import decide as d
from neonvm.controller import reasons, restarts, scan
from neonvm.controller.action_table import status_mutation

pytestmark = pytest.mark.unit

UID = "0123456789abcdef"
LEASE = act.Fence(epoch=3, token=40)


def vm(*, finalizers: tuple[str, ...] = (FINALIZER,), deleting: bool = False,
       generation: int = 1, restart_policy: str = "Always", **status: object) -> VirtualMachine:
    return VirtualMachine(
        name="vm", namespace="ns", uid=UID, resource_version="100", generation=generation,
        spec=VirtualMachineSpec(restart_policy=restart_policy),  # type: ignore[arg-type]
        status=VirtualMachineStatus(**status),  # type: ignore[arg-type]
        deletion_timestamp="2026-01-01T00:00:00Z" if deleting else None,
        finalizers=list(finalizers),
    )


def pod(name: str, *, uid: str | None = None, owner: str | None = UID, gated: bool = True,
        terminating: bool = False, phase: str = "Pending", node: str | None = None,
        ip: str | None = None, fence: tuple[int, int] | None = (3, 40)) -> act.PodView:
    """A pod; its fence defaults to that of :func:`plan` (epoch 3, token 40)."""
    return act.PodView(name=name, uid=uid or f"uid-{name}", owner_uid=owner, gated=gated,
                     terminating=terminating, phase=phase, node=node, ip=ip, fence=fence)


def obs(v: VirtualMachine | None, *pods: act.PodView, direct: bool = True,
        create_failed_generation: int | None = None) -> act.Observation:
    return act.Observation(vm=v, pods=tuple(pods), lease=LEASE, direct=direct,
                         create_failed_generation=create_failed_generation)


def plan(seq: int = 1, epoch: int = 3, token: int = 40) -> PendingPod:
    return PendingPod(name=f"vm-{UID[:8]}-{seq}", plan_seq=seq, token=token, epoch=epoch,
                      generation=1)


POD1 = f"vm-{UID[:8]}-1"
POD2 = f"vm-{UID[:8]}-2"


# ---- lifecycle of a fresh VM ------------------------------------------------------------


def test_a_vm_without_our_finalizer_gets_it_first() -> None:
    assert isinstance(d.decide(obs(vm(finalizers=()))), act.AddFinalizer)


def test_a_fresh_vm_is_planned_with_a_name_unique_forever_and_the_callers_fence() -> None:
    action = d.decide(obs(vm(plan_seq=4), direct=False))
    assert action == act.RecordPlan(
        plan=PendingPod(name=f"vm-{UID[:8]}-5", plan_seq=5, token=40, epoch=3, generation=1),
        observed_seq=4, reason=action.reason)


def test_a_recorded_plan_is_created_with_exactly_its_name() -> None:
    action = d.decide(obs(vm(pending_pod=plan(), plan_seq=1)))
    assert isinstance(action, act.CreatePod) and action.plan.name == POD1


def test_our_created_pod_is_committed_with_its_uid() -> None:
    action = d.decide(obs(vm(pending_pod=plan(), plan_seq=1), pod(POD1), direct=False))
    assert action == act.Commit(name=POD1, uid=f"uid-{POD1}", reason=action.reason)


@pytest.mark.parametrize("the_pod", [pod(POD1, owner="someone-else"),
                                     pod(POD1, terminating=True)],
                         ids=["not ours", "terminating"])
def test_a_planned_name_that_is_taken_or_dying_drops_the_plan(the_pod: act.PodView) -> None:
    action = d.decide(obs(vm(pending_pod=plan(), plan_seq=1), the_pod))
    assert action == act.DropPlan(name=POD1, reason=action.reason)


def test_an_uncommitted_pod_without_the_gate_is_deleted_but_only_after_a_quorum_read() -> None:
    v = vm(pending_pod=plan(), plan_seq=1)
    assert isinstance(d.decide(obs(v, pod(POD1, gated=False), direct=False)), act.ObserveDirect)
    assert d.decide(obs(v, pod(POD1, gated=False))) == act.DeletePod(
        name=POD1, uid=f"uid-{POD1}", reason=d.decide(obs(v, pod(POD1, gated=False))).reason)


def test_the_committed_pod_is_ungated_when_it_is_the_only_pod_observed() -> None:
    """From any observation: the quorum list the ungate rests on is its performer's own,
    taken after the commit was seen (a direct read before it would be a second one)."""
    v = vm(pod_name=POD1, pod_uid=f"uid-{POD1}", plan_seq=1)
    for direct in (True, False):
        action = d.decide(obs(v, pod(POD1), direct=direct))
        assert action == act.Ungate(name=POD1, uid=f"uid-{POD1}", reason=action.reason)


def test_a_committed_pod_beside_others_is_not_ungated_and_needs_a_quorum_read() -> None:
    v = vm(pod_name=POD2, pod_uid=f"uid-{POD2}", plan_seq=2)
    old = pod(POD1, gated=False, terminating=True)
    assert isinstance(d.decide(obs(v, old, pod(POD2), direct=False)), act.ObserveDirect)
    assert isinstance(d.decide(obs(v, old, pod(POD2))), act.Wait)


def test_the_replacement_waits_gated_while_the_old_pod_terminates() -> None:
    v = vm(pod_name=POD2, pod_uid=f"uid-{POD2}", plan_seq=2)
    action = d.decide(obs(v, pod(POD1, gated=False, terminating=True), pod(POD2)))
    assert isinstance(action, act.Wait) and action.condition == "WaitingForOldPod"


def test_a_live_stray_beside_a_gated_committed_pod_is_deleted_first() -> None:
    v = vm(pod_name=POD2, pod_uid=f"uid-{POD2}", plan_seq=2)
    action = d.decide(obs(v, pod(POD1, gated=False, phase="Running"), pod(POD2)))
    assert action == act.DeletePod(name=POD1, uid=f"uid-{POD1}", reason=action.reason)


def test_a_running_pod_is_mirrored_into_status_then_nothing_is_left_to_do() -> None:
    running = pod(POD1, gated=False, phase="Running", node="n1", ip="10.0.0.1")
    v = vm(pod_name=POD1, pod_uid=f"uid-{POD1}", plan_seq=1, phase="Pending")
    assert d.decide(obs(v, running, direct=False)) == act.SyncStatus(
        phase="Running", node="n1", ip="10.0.0.1", name=POD1, uid=f"uid-{POD1}",
        reason=d.decide(obs(v, running, direct=False)).reason)
    synced = dataclasses.replace(v, status=dataclasses.replace(
        v.status, phase="Running", node="n1", pod_ip="10.0.0.1"))
    assert isinstance(d.decide(obs(synced, running, direct=False)), act.Done)


def test_a_pod_bound_but_not_running_is_not_synced_until_it_runs() -> None:
    """Node and IP are written with the phase they come with: a pod the scheduler has
    bound (node set, still Pending) costs no status write of its own; the write that
    makes the VM Running carries them."""
    bound = pod(POD1, gated=False, phase="Pending", node="n1")
    v = vm(pod_name=POD1, pod_uid=f"uid-{POD1}", plan_seq=1, phase="Pending")
    assert isinstance(d.decide(obs(v, bound, direct=False)), act.Done)
    running = dataclasses.replace(bound, phase="Running", ip="10.0.0.1")
    assert d.decide(obs(v, running, direct=False)) == act.SyncStatus(
        phase="Running", node="n1", ip="10.0.0.1", name=POD1, uid=f"uid-{POD1}",
        reason=d.decide(obs(v, running, direct=False)).reason)


def test_a_vm_phase_behind_its_pending_pod_is_still_synced() -> None:
    """Only the node-only write is folded: a VM whose phase is not Pending while its
    committed pod is (status written by an older controller, say) is written Pending."""
    bound = pod(POD1, gated=False, phase="Pending", node="n1")
    v = vm(pod_name=POD1, pod_uid=f"uid-{POD1}", plan_seq=1, phase=None)
    action = d.decide(obs(v, bound, direct=False))
    assert isinstance(action, act.SyncStatus) and (action.phase, action.node) == ("Pending", "n1")


# ---- the committed pod goes away ----------------------------------------------------------


def test_a_cache_miss_does_not_prove_the_pod_gone() -> None:
    v = vm(pod_name=POD1, pod_uid=f"uid-{POD1}", plan_seq=1, phase="Running")
    assert isinstance(d.decide(obs(v, direct=False)), act.ObserveDirect)


def test_a_pod_gone_in_a_direct_read_is_restarted_naming_what_was_observed() -> None:
    v = vm(pod_name=POD1, pod_uid=f"uid-{POD1}", plan_seq=1, phase="Running")
    action = d.decide(obs(v))
    assert action == act.Restart(name=POD1, uid=f"uid-{POD1}", terminal_phase=None,
                               reason=action.reason)


def test_a_pod_with_the_committed_name_but_another_uid_counts_as_gone() -> None:
    v = vm(pod_name=POD1, pod_uid="the-old-uid", plan_seq=1, phase="Running")
    action = d.decide(obs(v, pod(POD1, uid="a-new-uid", gated=False)))
    assert isinstance(action, act.Restart) and action.uid == "the-old-uid"


@pytest.mark.parametrize(("policy", "pod_phase", "terminal"), [
    ("Always", "Succeeded", None),
    ("Always", "Failed", None),
    ("OnFailure", "Failed", None),
    ("OnFailure", "Succeeded", "Succeeded"),
    ("Never", "Succeeded", "Succeeded"),
    ("Never", "Failed", "Failed"),
])
def test_the_restart_policy_decides_between_a_new_plan_and_a_terminal_phase(
        policy: str, pod_phase: str, terminal: str | None) -> None:
    v = vm(pod_name=POD1, pod_uid=f"uid-{POD1}", plan_seq=1, phase="Running",
           restart_policy=policy)
    action = d.decide(obs(v, pod(POD1, gated=False, phase=pod_phase)))
    assert isinstance(action, act.Restart) and action.terminal_phase == terminal


def test_a_deleted_pod_counts_as_a_failure_for_restart_policy_never() -> None:
    v = vm(pod_name=POD1, pod_uid=f"uid-{POD1}", plan_seq=1, phase="Running",
           restart_policy="Never")
    action = d.decide(obs(v))
    assert isinstance(action, act.Restart) and action.terminal_phase == "Failed"


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_a_terminal_vm_is_never_planned_again(phase: str) -> None:
    assert isinstance(d.decide(obs(vm(phase=phase, plan_seq=1))), act.Done)
    assert isinstance(d.decide(obs(vm(phase=phase, plan_seq=1, pod_name=POD1))), act.Done)


# ---- refusals, fencing, clean-up, deletion --------------------------------------------------


def test_a_refused_create_waits_for_a_spec_change_then_is_tried_again() -> None:
    refused = vm(pending_pod=plan(), plan_seq=1, generation=2)
    waiting = d.decide(obs(refused, create_failed_generation=2))
    assert isinstance(waiting, act.Wait) and waiting.condition == "Degraded"
    assert isinstance(d.decide(obs(refused, create_failed_generation=1)), act.CreatePod)


def test_a_missing_pull_secret_holds_the_recorded_plan_back_and_a_present_one_does_not(
) -> None:
    planned = vm(pending_pod=plan(), plan_seq=1)
    waiting = d.decide(dataclasses.replace(obs(planned), missing_pull_secrets=("regcred",)))
    assert isinstance(waiting, act.Wait) and waiting.condition == reasons.PULL_SECRET_NOT_FOUND
    assert "regcred" in waiting.reason and plan().name in waiting.reason
    assert isinstance(d.decide(obs(planned)), act.CreatePod)
    # Once the pod exists, a missing secret no longer matters: the plan is committed.
    created = d.decide(dataclasses.replace(obs(planned, pod(plan().name)),
                                           missing_pull_secrets=("regcred",)))
    assert isinstance(created, act.Commit)


def test_a_vm_written_by_a_newer_epoch_fences_us_out() -> None:
    action = d.decide(obs(vm(fence=Fence(epoch=4, token=1))))
    assert action == act.Fenced(seen_epoch=4, reason=action.reason)
    assert isinstance(d.decide(obs(vm(pending_pod=plan(epoch=9), plan_seq=1))), act.Fenced)


def test_an_older_fence_does_not_stop_us() -> None:
    assert isinstance(d.decide(obs(vm(fence=Fence(epoch=2, token=99)))), act.RecordPlan)


def test_unreferenced_pods_are_cleaned_up_only_from_a_direct_observation() -> None:
    running = pod(POD2, gated=False, phase="Running", node="n", ip="1.2.3.4")
    v = vm(pod_name=POD2, pod_uid=f"uid-{POD2}", plan_seq=2, phase="Running", node="n",
           pod_ip="1.2.3.4")
    stray = pod(POD1, gated=False)
    assert isinstance(d.decide(obs(v, stray, running, direct=False)), act.ObserveDirect)
    action = d.decide(obs(v, stray, running))
    assert action == act.DeletePod(name=POD1, uid=f"uid-{POD1}", reason=action.reason)


def test_a_deleted_vm_deletes_its_pods_waits_for_them_then_drops_the_finalizer() -> None:
    deleting = vm(deleting=True, pod_name=POD1, pod_uid=f"uid-{POD1}", plan_seq=1)
    assert isinstance(d.decide(obs(deleting, pod(POD1), direct=False)), act.ObserveDirect)
    assert isinstance(d.decide(obs(deleting, pod(POD1))), act.DeletePod)
    assert isinstance(d.decide(obs(deleting, pod(POD1, terminating=True))), act.Wait)
    assert isinstance(d.decide(obs(deleting)), act.RemoveFinalizer)
    assert isinstance(d.decide(obs(vm(deleting=True, finalizers=()))), act.Done)


def test_a_vm_that_does_not_exist_needs_nothing() -> None:
    assert isinstance(d.decide(obs(None, pod(POD1))), act.Done)


# ---- properties over every observation ------------------------------------------------------

NAMES = [POD1, POD2, f"vm-{UID[:8]}-3", "vm-ffffffff-1"]

pods_strategy = st.lists(
    st.builds(
        pod,
        st.sampled_from(NAMES),
        uid=st.sampled_from([None, "other-uid"]),
        owner=st.sampled_from([UID, "another-vm", None]),
        gated=st.booleans(),
        terminating=st.booleans(),
        phase=st.sampled_from(["Pending", "Running", "Succeeded", "Failed"]),
    ),
    max_size=4,
    unique_by=lambda p: p.name,
)


@st.composite
def observations(draw: st.DrawFn) -> act.Observation:
    seq = draw(st.integers(min_value=0, max_value=3))
    pending = draw(st.sampled_from([None, *NAMES]))
    committed = draw(st.sampled_from([None, "", *NAMES]))
    v = vm(
        finalizers=draw(st.sampled_from([(FINALIZER,), ()])),
        deleting=draw(st.booleans()),
        generation=draw(st.integers(min_value=1, max_value=3)),
        restart_policy=draw(st.sampled_from(["Always", "OnFailure", "Never"])),
        plan_seq=seq,
        pending_pod=(PendingPod(name=pending, plan_seq=seq, epoch=draw(st.integers(2, 4)))
                     if pending else None),
        pod_name=committed,
        pod_uid=draw(st.sampled_from([None, f"uid-{committed}", "other-uid"])),
        phase=draw(st.sampled_from([None, "Pending", "Running", "Succeeded", "Failed"])),
        fence=draw(st.sampled_from([None, Fence(2, 1), Fence(3, 40), Fence(4, 1)])),
    )
    return obs(v, *draw(pods_strategy), direct=draw(st.booleans()),
               create_failed_generation=draw(st.sampled_from([None, 1, 2, 3])))


@settings(max_examples=800, deadline=None)
@given(observations())
def test_every_decision_keeps_the_three_promises(o: act.Observation) -> None:
    action = d.decide(o)
    v = o.vm
    assert v is not None
    if isinstance(action, act.Ungate):
        # Only the committed pod, only from an observation in which it is the only pod
        # (the performer's own quorum list must then show the same).
        assert action.name == v.status.pod_name
        assert [p.name for p in o.pods] == [action.name]
        assert not o.pods[0].terminating
    if isinstance(action, act.CreatePod):
        assert v.status.pending_pod is not None
        assert action.plan.name == v.status.pending_pod.name
    if isinstance(action, act.DeletePod | act.Restart | act.RemoveFinalizer):
        assert o.direct, f"{action} from a cached observation"
    if isinstance(action, act.DeletePod) and v.deletion_timestamp is None:
        assert action.name != v.status.pod_name or (
            # The committed name held by a different uid is not the committed pod.
            bool(v.status.pod_uid) and action.uid != v.status.pod_uid)
        pending = v.status.pending_pod
        if pending is not None and action.name == pending.name:
            # Only an uncommitted pod that escaped the gate is ever deleted by its plan.
            p = o.pod(action.name)
            assert p is not None and not p.gated


@settings(max_examples=300, deadline=None)
@given(observations())
def test_a_fenced_or_terminal_vm_is_never_planned(o: act.Observation) -> None:
    action = d.decide(o)
    v = o.vm
    assert v is not None
    if v.status.fence is not None and v.status.fence.epoch > LEASE.epoch:
        assert isinstance(action, act.Fenced)
    if v.status.phase in d.TERMINAL_PHASES:
        assert not isinstance(action, act.RecordPlan)


# ---- restart backoff ------------------------------------------------------------------------

T0 = dt.datetime(2026, 3, 1, 12, 0, 0, tzinfo=dt.UTC)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def restarted(count: int, when: dt.datetime = T0) -> VirtualMachine:
    """A VM right after restart number ``count`` (no pod, no plan), recorded at ``when``."""
    return vm(restart_count=count, restart_streak=count, plan_seq=count,
              last_restart_time=times.format_microtime(when))


def test_the_backoff_is_zero_for_the_first_restart_then_doubles_up_to_a_minute() -> None:
    assert [restarts.restart_backoff(n) for n in range(10)] == [0, 0, 1, 2, 4, 8, 16, 32, 60, 60]
    assert restarts.restart_backoff(10_000) == restarts.RESTART_BACKOFF_MAX


def test_a_restart_decided_with_a_clock_records_when_it_happened() -> None:
    v = vm(pod_name=POD1, pod_uid=f"uid-{POD1}", plan_seq=1, phase="Running", restart_count=4)
    action = d.decide(dataclasses.replace(obs(v), now=at(7.5)))
    assert isinstance(action, act.Restart) and action.at == "2026-03-01T12:00:07.500000Z"
    new = status_mutation(action, LEASE)(v)
    assert new is not None
    assert (new.restart_count, new.last_restart_time) == (5, action.at)
    assert times.parse(new.last_restart_time) == at(7.5)


def test_a_restart_long_after_the_previous_one_starts_a_new_streak_without_backoff() -> None:
    quick = vm(pod_name=POD1, pod_uid=f"uid-{POD1}", plan_seq=9, phase="Running",
               restart_count=8, restart_streak=8, last_restart_time=times.format_microtime(T0))
    soon = d.decide(dataclasses.replace(obs(quick), now=at(60)))
    later = d.decide(dataclasses.replace(obs(quick), now=at(restarts.RESTART_STREAK_WINDOW + 1)))
    after_soon = status_mutation(soon, LEASE)(quick)
    after_later = status_mutation(later, LEASE)(quick)
    assert after_soon is not None and after_later is not None
    assert (after_soon.restart_streak, after_later.restart_streak) == (9, 1)
    assert after_later.restart_count == 9
    replan = dataclasses.replace(quick, status=after_later)
    plan = d.decide(dataclasses.replace(obs(replan), now=at(restarts.RESTART_STREAK_WINDOW + 1)))
    assert isinstance(plan, act.RecordPlan)


def test_a_restart_to_a_terminal_phase_records_no_restart_time() -> None:
    v = vm(pod_name=POD1, pod_uid=f"uid-{POD1}", plan_seq=1, phase="Running",
           restart_policy="Never")
    action = d.decide(dataclasses.replace(obs(v), now=T0))
    new = status_mutation(action, LEASE)(v)
    assert new is not None and new.phase == "Failed"
    assert (new.restart_count, new.last_restart_time) == (0, None)


def test_the_first_replacement_of_a_deleted_pod_is_planned_at_once() -> None:
    action = d.decide(dataclasses.replace(obs(restarted(1)), now=T0))
    assert isinstance(action, act.RecordPlan)


def test_a_runner_that_keeps_exiting_waits_out_the_backoff_before_the_next_plan() -> None:
    v = restarted(4)  # backoff 4 s
    waiting = d.decide(dataclasses.replace(obs(v), now=at(1.5)))
    assert waiting == act.Wait(seconds=2.5, condition="RestartBackoff", reason=waiting.reason)
    assert isinstance(d.decide(dataclasses.replace(obs(v), now=at(4))), act.RecordPlan)
    assert isinstance(d.decide(dataclasses.replace(obs(v), now=at(3600))), act.RecordPlan)


def test_without_a_clock_there_is_no_backoff() -> None:
    """The explorer and other callers that build observations without ``now``."""
    assert isinstance(d.decide(obs(restarted(9))), act.RecordPlan)


def test_a_clock_behind_the_recorders_waits_at_most_the_backoff_per_decision() -> None:
    action = d.decide(dataclasses.replace(obs(restarted(3)), now=at(-600)))
    assert isinstance(action, act.Wait) and action.seconds == restarts.restart_backoff(3)


def test_a_malformed_restart_time_never_holds_a_vm_back() -> None:
    v = dataclasses.replace(restarted(5), status=dataclasses.replace(
        restarted(5).status, last_restart_time="yesterday"))
    assert isinstance(d.decide(dataclasses.replace(obs(v), now=T0)), act.RecordPlan)


def test_unreferenced_pods_are_still_cleaned_up_during_the_backoff() -> None:
    stray = pod(POD1, gated=False, phase="Failed")
    action = d.decide(dataclasses.replace(obs(restarted(5), stray), now=at(1)))
    assert action == act.DeletePod(name=POD1, uid=f"uid-{POD1}", reason=action.reason)


@settings(max_examples=300, deadline=None)
@given(count=st.integers(min_value=0, max_value=40),
       elapsed_ms=st.integers(min_value=-120_000, max_value=120_000))
def test_a_plan_is_recorded_only_once_the_backoff_since_the_last_restart_has_passed(
        count: int, elapsed_ms: int) -> None:
    elapsed = elapsed_ms / 1000
    action = d.decide(dataclasses.replace(obs(restarted(count)), now=at(elapsed)))
    backoff = restarts.restart_backoff(count)
    if backoff == 0 or elapsed >= backoff:
        assert isinstance(action, act.RecordPlan)
    else:
        assert isinstance(action, act.Wait) and action.condition == "RestartBackoff"
        assert 0 < action.seconds <= backoff


# ---- adoption needs the plan's fence (a planted pod is never committed) -------------------


@pytest.mark.unit
@pytest.mark.parametrize("fence", [None, (3, 41), (2, 40), (4, 40)],
                         ids=["no-fence", "other-token", "older-epoch", "newer-epoch"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_a_pod_without_the_plans_fence_is_not_adopted(fence: tuple[int, int] | None,
                                                       gated: bool) -> None:
    """Owned by the VM, labelled, under the planned name: still not ours without the
    (epoch, token) the plan's own create writes. The plan is dropped, never committed."""
    v = vm(pending_pod=plan(), plan_seq=1)
    for direct in (False, True):
        action = d.decide(obs(v, pod(POD1, gated=gated, fence=fence), direct=direct))
        assert action == act.DropPlan(name=POD1, reason=action.reason), action
        assert "does not carry the fence" in action.reason


@pytest.mark.unit
def test_a_planted_pod_left_after_its_plan_is_dropped_is_deleted() -> None:
    # The plan was dropped and plan #2 committed: the planted pod is deleted before the
    # committed pod is ungated.
    v = vm(plan_seq=2, pod_name=POD2, pod_uid=f"uid-{POD2}")
    planted = pod(POD1, fence=None)
    ours = pod(POD2)
    assert isinstance(d.decide(obs(v, planted, ours, direct=False)), act.ObserveDirect)
    action = d.decide(obs(v, planted, ours))
    assert action == act.DeletePod(name=POD1, uid=planted.uid, reason=action.reason)


# ---- the mid-plan scan: which cached VMs are requeued every couple of seconds -------------


def raw_vm(reason: str | None = None, *, name: str = "vm", generation: int = 3,
           observed: int = 3, deleting: bool = False, **status: object) -> dict[str, object]:
    """A VM as the informer caches it (a dict); ``reason``: a Degraded=True condition."""
    meta: dict[str, object] = {"name": name, "namespace": "ns", "generation": generation}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    conditions = [] if reason is None else [
        {"type": "Degraded", "status": "True", "reason": reason,
         "observedGeneration": observed}]
    return {"metadata": meta, "status": {"conditions": conditions, **status}}


GATED_POD = {"metadata": {"name": "vm-1"}, "spec": {"schedulingGates": [{"name": "g"}]}}
RUNNING_POD: dict[str, object] = {"metadata": {"name": "vm-1"}, "spec": {}}


def test_a_create_is_held_back_for_the_generation_that_was_refused_or_lacks_a_secret() -> None:
    assert scan.create_held_back(raw_vm(reasons.PULL_SECRET_NOT_FOUND))
    assert scan.create_held_back(raw_vm(reasons.CREATE_REFUSED))
    assert not scan.create_held_back(raw_vm(reasons.CREATE_REFUSED, generation=4)), "a new spec"
    assert not scan.create_held_back(raw_vm(reasons.PULL_SECRET_NOT_FOUND, generation=4))
    assert not scan.create_held_back(raw_vm(reasons.PULL_SECRET_NOT_FOUND, deleting=True)), (
        "a VM being deleted is never held back")
    assert not scan.create_held_back({"metadata": {}, "status": {}})


def test_a_fence_ahead_mark_counts_for_its_generation_only() -> None:
    assert scan.fence_ahead_marked(raw_vm(reasons.FENCE_AHEAD))
    assert scan.fence_ahead_marked(raw_vm(reasons.FENCE_AHEAD, deleting=True))
    assert not scan.fence_ahead_marked(raw_vm(reasons.FENCE_AHEAD, generation=4))
    assert not scan.fence_ahead_marked(raw_vm(reasons.CREATE_REFUSED))


@pytest.mark.parametrize("reason", [reasons.FENCE_AHEAD, reasons.CREATE_REFUSED])
def test_the_scan_reads_a_mark_in_extra_conditions_as_decide_does(reason: str) -> None:
    """Decide reads status.conditions and status.extraConditions as one list, so the scan
    does too: a mark in either holds the VM back in both (no requeue every scan)."""
    moved = raw_vm(reason, pendingPod={"name": "vm-1"})
    status = moved["status"]
    assert isinstance(status, dict)
    status["extraConditions"], status["conditions"] = status["conditions"], []
    assert decode(VirtualMachineStatus, status).conditions[0].reason == reason
    assert not scan.looks_mid_plan(moved, [])


def test_a_vm_in_the_middle_of_something_looks_mid_plan() -> None:
    plan_ = {"pendingPod": {"name": "vm-1"}}
    assert scan.looks_mid_plan(raw_vm(**plan_), []), "a recorded plan"
    assert scan.looks_mid_plan(raw_vm(), []), "no committed pod"
    assert scan.looks_mid_plan(raw_vm(podName="vm-1"), [GATED_POD]), "a gated pod"
    assert scan.looks_mid_plan(raw_vm(podName="vm-1", deleting=True), [RUNNING_POD])
    assert scan.looks_mid_plan(raw_vm(podName="vm-1"), [RUNNING_POD, RUNNING_POD])


def test_a_calm_or_finished_vm_does_not_look_mid_plan() -> None:
    assert not scan.looks_mid_plan(raw_vm(podName="vm-1"), [RUNNING_POD])
    assert not scan.looks_mid_plan(raw_vm(phase="Succeeded"), []), "terminal, no pod"


def test_a_vm_requeued_by_its_own_wait_is_left_to_it() -> None:
    """A VM marked FenceAhead is left alone by decide and requeued by its own 300 s Wait:
    the scan skips it whatever its plan, pods or deletion say; a new generation is scanned
    once. A held-back create is skipped only while it has no pods."""
    plan_ = {"pendingPod": {"name": "vm-1"}}
    assert not scan.looks_mid_plan(raw_vm(reasons.FENCE_AHEAD, **plan_), [])
    assert not scan.looks_mid_plan(raw_vm(reasons.FENCE_AHEAD), [])
    assert not scan.looks_mid_plan(raw_vm(reasons.FENCE_AHEAD, podName="vm-1"), [GATED_POD])
    assert not scan.looks_mid_plan(raw_vm(reasons.FENCE_AHEAD, deleting=True, **plan_), [GATED_POD])
    assert scan.looks_mid_plan(raw_vm(reasons.FENCE_AHEAD, generation=4, **plan_), []), (
        "new generation")
    assert not scan.looks_mid_plan(raw_vm(reasons.CREATE_REFUSED, **plan_), [])
    assert scan.looks_mid_plan(raw_vm(reasons.CREATE_REFUSED, **plan_), [GATED_POD])


def test_the_scan_names_the_mid_plan_vms_by_key_with_their_own_pods() -> None:
    vms = [raw_vm(name="calm", podName="vm-1"),
           raw_vm(name="planning", podName="vm-1", pendingPod={"name": "vm-2"}),
           raw_vm(name="gated", podName="vm-1")]
    pods = {"ns/calm": [RUNNING_POD], "ns/planning": [RUNNING_POD], "ns/gated": [GATED_POD]}
    assert scan.mid_plan_keys(vms, lambda key: pods.get(key, [])) == ["ns/planning", "ns/gated"]
