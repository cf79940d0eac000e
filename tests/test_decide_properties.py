"""Properties of decide() and of the status mutations re-applied on a fresh copy.

A decision is made from one observation; its write is re-applied by the update helper
on whatever version of the VM is current when the write finally goes out (after any
number of conflicts, failovers and other writers). So the mutations must be right not
only for the copy the decision saw but for *every* later copy. These tests generate
both: an observation, the decision, and an arbitrary fresh copy.

The first test is the counterexample the interleaving explorer found (see
docs/verification.md, "Found by the explorer").
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes.client.exceptions import ApiException

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
from neonvm.controller import reasons
from neonvm.controller.action_table import finalizers_mutation, status_mutation
from neonvm.controller.mutations import FencedOut
from neonvm.controller.update import RetryPolicy, conditional_update

pytestmark = pytest.mark.unit

UID = "a1b2c3d4-0000-4000-8000-00000000000a"
LEASE = act.Fence(epoch=3, token=7)
POD1 = f"vm-{UID[:8]}-1"
POD2 = f"vm-{UID[:8]}-2"


def vm(*, deleting: bool = False, restart_policy: str = "Always",
       finalizers: tuple[str, ...] = (FINALIZER,), **status: object) -> VirtualMachine:
    return VirtualMachine(
        name="vm", namespace="ns", uid=UID, resource_version="1", generation=1,
        spec=VirtualMachineSpec(restart_policy=restart_policy),  # type: ignore[arg-type]
        status=VirtualMachineStatus(**status),  # type: ignore[arg-type]
        deletion_timestamp="2026-01-01T00:00:00Z" if deleting else None,
        finalizers=list(finalizers),
    )


def test_a_status_sync_decided_for_the_old_pod_is_refused_on_the_replacements_status() -> None:
    """Explorer counterexample (scenario seed-pod-deleted, 20 steps): a new leader decides
    SyncStatus from a cached observation in which the old pod runs; before its write
    lands, the old pod is deleted, the VM restarted and the replacement committed. The
    conflict retry re-applies the sync on the fresh copy, which names the replacement: it
    must not write the old pod's node and IP into the replacement's status."""
    old = act.PodView(name=POD1, uid="u1", owner_uid=UID, gated=False, terminating=False,
                    phase="Running", node="node-1", ip="10.0.0.1")
    seen = vm(pod_name=POD1, pod_uid="u1", plan_seq=1, phase="Pending",
              fence=Fence(epoch=2, token=1))
    action = d.decide(act.Observation(vm=seen, pods=(old,), lease=LEASE, direct=False))
    assert isinstance(action, act.SyncStatus)

    fresh = vm(pod_name=POD2, pod_uid="u2", plan_seq=2, phase="Pending", restart_count=1,
               fence=Fence(epoch=2, token=1))
    assert status_mutation(action, LEASE)(fresh) is None
    # The same sync on the copy it was decided for still goes through.
    assert status_mutation(action, LEASE)(seen) is not None


def test_sync_is_still_written_for_the_pod_it_was_decided_for() -> None:
    pod = act.PodView(name=POD2, uid="u2", owner_uid=UID, gated=False, terminating=False,
                    phase="Running", node="node-1", ip="10.0.0.2")
    seen = vm(pod_name=POD2, pod_uid="u2", plan_seq=2, phase="Pending")
    action = d.decide(act.Observation(vm=seen, pods=(pod,), lease=LEASE, direct=True))
    assert isinstance(action, act.SyncStatus)
    raced = dataclasses.replace(seen, status=dataclasses.replace(seen.status,
                                                                 restart_count=5))
    new = status_mutation(action, LEASE)(raced)
    assert new is not None
    assert (new.phase, new.node, new.pod_ip, new.restart_count) == (
        "Running", "node-1", "10.0.0.2", 5)



# ---- generated VMs, pods and observations ---------------------------------------------------

NAMES = [f"vm-{UID[:8]}-{k}" for k in (1, 2, 3)]
UIDS = ["u1", "u2", "u3"]
FENCES = [None, Fence(2, 1), Fence(3, 7), Fence(3, 9), Fence(4, 1)]
LEASES = [act.Fence(2, 5), act.Fence(3, 7), act.Fence(4, 2)]


@st.composite
def statuses(draw: st.DrawFn) -> VirtualMachineStatus:
    seq = draw(st.integers(min_value=0, max_value=3))
    committed = draw(st.sampled_from(["", *NAMES[:max(seq, 1)]]))
    pending = None
    if draw(st.booleans()) and seq:
        pending = PendingPod(name=NAMES[seq - 1], plan_seq=seq, token=draw(st.integers(1, 9)),
                             epoch=draw(st.integers(2, 4)), generation=1)
    return VirtualMachineStatus(
        phase=draw(st.sampled_from([None, "Pending", "Running", "Succeeded", "Failed"])),
        pod_name=committed or None,
        pod_uid=draw(st.sampled_from(UIDS)) if committed else None,
        pending_pod=pending,
        plan_seq=seq,
        pod_ip=draw(st.sampled_from([None, "10.0.0.1", "10.0.0.2"])),
        node=draw(st.sampled_from([None, "node-1"])),
        restart_count=draw(st.integers(0, 3)),
        fence=draw(st.sampled_from(FENCES)),
    )


@st.composite
def vms(draw: st.DrawFn) -> VirtualMachine:
    v = vm(deleting=draw(st.booleans()),
           restart_policy=draw(st.sampled_from(["Always", "OnFailure", "Never"])),
           finalizers=draw(st.sampled_from([(FINALIZER,), ()])))
    return dataclasses.replace(v, status=draw(statuses()))


pod_lists = st.lists(
    st.builds(
        act.PodView,
        name=st.sampled_from(NAMES),
        uid=st.sampled_from(UIDS),
        owner_uid=st.sampled_from([UID, UID, "another-vm"]),
        gated=st.booleans(),
        terminating=st.booleans(),
        phase=st.sampled_from(["Pending", "Running", "Succeeded", "Failed"]),
        node=st.sampled_from([None, "node-1"]),
        ip=st.sampled_from([None, "10.0.0.1", "10.0.0.2"]),
    ),
    max_size=3,
    unique_by=lambda p: p.name,
)


@st.composite
def observations(draw: st.DrawFn) -> act.Observation:
    return act.Observation(vm=draw(vms()), pods=tuple(draw(pod_lists)),
                         lease=draw(st.sampled_from(LEASES)), direct=draw(st.booleans()),
                         missing_pull_secrets=draw(st.sampled_from([(), ("regcred",)])))


def higher(fence: Fence | None, lease: act.Fence) -> bool:
    return fence is not None and (fence.epoch, fence.token) > (lease.epoch, lease.token)


# ---- decide ---------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(observations())
def test_a_missing_pull_secret_only_ever_turns_a_create_into_a_wait_or_a_clean_up(
        o: act.Observation) -> None:
    missing = d.decide(dataclasses.replace(o, missing_pull_secrets=("regcred",)))
    present = d.decide(dataclasses.replace(o, missing_pull_secrets=()))
    if not isinstance(present, act.CreatePod):
        assert missing == present
        return
    assert o.vm is not None and o.vm.status.pending_pod is not None
    if isinstance(missing, act.DeletePod):  # the wait lets the clean-up of a stray run
        assert missing.name != o.vm.status.pending_pod.name
    elif isinstance(missing, act.ObserveDirect):  # ... which starts with a quorum read
        assert not o.direct and any(p.name != o.vm.status.pending_pod.name for p in o.pods)
    else:
        assert isinstance(missing, act.Wait)
        assert missing.condition == reasons.PULL_SECRET_NOT_FOUND


@settings(max_examples=400, deadline=None)
@given(observations())
def test_ungate_targets_the_committed_uid_observed_alone(o: act.Observation) -> None:
    """From any observation (the performer's own quorum list, taken after the commit was
    seen, is the check the proof rests on; it must show the same)."""
    action = d.decide(o)
    if not isinstance(action, act.Ungate):
        return
    v = o.vm
    assert v is not None and v.deletion_timestamp is None
    assert [p.name for p in o.pods] == [action.name] == [v.status.pod_name]
    only = o.pods[0]
    assert action.uid == only.uid and only.gated and not only.terminating
    assert not v.status.pod_uid or v.status.pod_uid == action.uid


@settings(max_examples=400, deadline=None)
@given(observations())
def test_create_is_the_recorded_plan_exactly_and_only_when_its_name_is_free(
        o: act.Observation) -> None:
    action = d.decide(o)
    if not isinstance(action, act.CreatePod):
        return
    v = o.vm
    assert v is not None and v.status.pending_pod == action.plan
    assert o.pod(action.plan.name) is None
    assert not v.status.pod_name and v.deletion_timestamp is None


@settings(max_examples=400, deadline=None)
@given(observations())
def test_delete_spares_the_committed_and_the_planned_pod_of_a_live_vm(o: act.Observation) -> None:
    action = d.decide(o)
    if not isinstance(action, act.DeletePod):
        return
    v = o.vm
    assert v is not None and o.direct
    listed = o.pod(action.name)
    assert listed is not None and listed.uid == action.uid  # the precondition is what was seen
    if v.deletion_timestamp is not None:
        return
    committed = action.name == v.status.pod_name and (
        not v.status.pod_uid or action.uid == v.status.pod_uid)
    assert not committed
    pending = v.status.pending_pod
    if pending is not None and action.name == pending.name:
        assert not listed.gated  # only an uncommitted pod that escaped the gate


@settings(max_examples=400, deadline=None)
@given(observations())
def test_restart_names_the_committed_pod_and_needs_a_quorum_read(o: act.Observation) -> None:
    action = d.decide(o)
    if not isinstance(action, act.Restart):
        return
    v = o.vm
    assert v is not None and o.direct
    assert action.name == v.status.pod_name
    assert action.uid in (v.status.pod_uid, getattr(o.pod(action.name), "uid", ""))


@settings(max_examples=400, deadline=None)
@given(observations())
def test_a_plan_is_recorded_only_on_a_clean_slate_with_the_next_sequence_number(
        o: act.Observation) -> None:
    action = d.decide(o)
    if not isinstance(action, act.RecordPlan):
        return
    v = o.vm
    assert v is not None
    s = v.status
    assert not s.pod_name and s.pending_pod is None and v.deletion_timestamp is None
    assert s.phase not in d.TERMINAL_PHASES
    assert action.observed_seq == s.plan_seq
    assert action.plan.plan_seq == s.plan_seq + 1
    assert action.plan.name == d.plan_name(v, s.plan_seq + 1)
    assert (action.plan.epoch, action.plan.token) == (o.lease.epoch, o.lease.token)


@settings(max_examples=300, deadline=None)
@given(observations())
def test_a_newer_epoch_in_the_vm_always_stops_the_decision(o: act.Observation) -> None:
    v = o.vm
    assert v is not None
    newer = (v.status.fence is not None and v.status.fence.epoch > o.lease.epoch) or (
        v.status.pending_pod is not None and v.status.pending_pod.epoch > o.lease.epoch)
    assert isinstance(d.decide(o), act.Fenced) == newer


# ---- status mutations re-applied on any later copy ------------------------------------------

STATUS_ACTIONS = (act.RecordPlan, act.Commit, act.DropPlan, act.Restart, act.SyncStatus)


def apply(mutate: Callable[[VirtualMachine], VirtualMachineStatus | None],
          fresh: VirtualMachine) -> VirtualMachineStatus | str | None:
    try:
        return mutate(copy.deepcopy(fresh))
    except FencedOut:
        return "fenced"


@settings(max_examples=600, deadline=None)
@given(observations(), vms())
def test_a_status_write_re_applied_on_any_later_copy_keeps_the_plan_invariants(
        o: act.Observation, fresh: VirtualMachine) -> None:
    action = d.decide(o)
    if not isinstance(action, STATUS_ACTIONS):
        return
    new = apply(status_mutation(action, o.lease), fresh)
    f = fresh.status
    if new is None:
        return
    if new == "fenced":
        assert higher(f.fence, o.lease)
        return
    assert isinstance(new, VirtualMachineStatus)
    assert not higher(f.fence, o.lease), "wrote over a newer writer's fence"
    assert (new.fence.epoch, new.fence.token) == (o.lease.epoch, o.lease.token)
    # Counters only move forward.
    assert new.plan_seq >= f.plan_seq and new.restart_count >= f.restart_count
    # A name is committed only if the fresh copy had planned it.
    if new.pod_name and new.pod_name != f.pod_name:
        assert not f.pod_name and f.pending_pod is not None
        assert new.pod_name == f.pending_pod.name
    # A plan is recorded only on a clean slate, with the next sequence number.
    if new.pending_pod is not None and new.pending_pod != f.pending_pod:
        assert not f.pod_name and f.pending_pod is None
        assert new.pending_pod.plan_seq == f.plan_seq + 1 == new.plan_seq
    # The committed pod is forgotten only by a restart of exactly that pod.
    if f.pod_name and new.pod_name != f.pod_name:
        assert isinstance(action, act.Restart) and action.name == f.pod_name
        assert not f.pod_uid or not action.uid or action.uid == f.pod_uid
    # Node and IP only ever describe the pod the fresh copy names.
    if (new.node, new.pod_ip) != (f.node, f.pod_ip) and new.pod_name == f.pod_name:
        assert isinstance(action, act.SyncStatus | act.Restart)
        if isinstance(action, act.SyncStatus):
            assert (action.name, action.uid) == (f.pod_name, f.pod_uid or action.uid)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(NAMES), st.sampled_from(UIDS), st.sampled_from(["10.0.0.1", "10.0.0.2"]),
       st.sampled_from(LEASES), statuses())
def test_a_status_sync_only_ever_describes_the_pod_the_fresh_copy_names(
        name: str, uid: str, ip: str, lease: act.Fence, later: VirtualMachineStatus) -> None:
    """The generalisation of the explorer's counterexample above: whatever the VM looks
    like when a sync's write finally lands, it never gets another pod's node and IP."""
    running = act.PodView(name=name, uid=uid, owner_uid=UID, gated=False, terminating=False,
                        phase="Running", node="node-1", ip=ip)
    seen = vm(pod_name=name, pod_uid=uid, plan_seq=NAMES.index(name) + 1, phase="Pending")
    action = d.decide(act.Observation(vm=seen, pods=(running,), lease=lease, direct=False))
    assert isinstance(action, act.SyncStatus)
    new = apply(status_mutation(action, lease), dataclasses.replace(seen, status=later))
    if isinstance(new, VirtualMachineStatus) and (new.node, new.pod_ip) != (
            later.node, later.pod_ip):
        assert later.pod_name == name and later.pod_uid in (None, uid)


@settings(max_examples=400, deadline=None)
@given(observations(), vms())
def test_a_status_write_that_went_through_has_nothing_left_to_do(
        o: act.Observation, fresh: VirtualMachine) -> None:
    """Idempotence: a retry of an intent already fulfilled writes nothing."""
    action = d.decide(o)
    if not isinstance(action, STATUS_ACTIONS):
        return
    mutate = status_mutation(action, o.lease)
    new = apply(mutate, fresh)
    if not isinstance(new, VirtualMachineStatus):
        return
    again = apply(mutate, dataclasses.replace(fresh, status=new))
    assert again is None or again == new


@settings(max_examples=200, deadline=None)
@given(vms(), st.sampled_from([act.AddFinalizer(), act.RemoveFinalizer()]))
def test_finalizers_are_added_to_live_vms_and_removed_from_deleted_ones_only(
        fresh: VirtualMachine, action: act.Action) -> None:
    new = finalizers_mutation(action)(fresh)
    if new is None:
        return
    if isinstance(action, act.AddFinalizer):
        assert fresh.deletion_timestamp is None and new.count(FINALIZER) == 1
    else:
        assert fresh.deletion_timestamp is not None and FINALIZER not in new


# ---- decisions racing through the shipped update helper --------------------------------------


class Store:
    """One VM behind compare-and-swap on resourceVersion, as the API server keeps it."""

    def __init__(self, v: VirtualMachine) -> None:
        self.versions = [dataclasses.replace(v, resource_version="1")]

    @property
    def current(self) -> VirtualMachine:
        return self.versions[-1]

    def read(self) -> VirtualMachine:
        return copy.deepcopy(self.current)

    def write(self, base: VirtualMachine, status: VirtualMachineStatus) -> VirtualMachine:
        if base.resource_version != self.current.resource_version:
            raise ApiException(status=409, reason="Conflict")
        nxt = dataclasses.replace(self.current, status=status,
                                  resource_version=str(len(self.versions) + 1))
        self.versions.append(nxt)
        return copy.deepcopy(nxt)


@settings(max_examples=250, deadline=None)
@given(vms(), st.lists(st.tuples(pod_lists, st.sampled_from(LEASES), st.integers(0, 3)),
                       min_size=2, max_size=3))
def test_decisions_racing_through_the_update_helper_never_take_the_plan_back(
        start: VirtualMachine,
        racers: list[tuple[list[act.PodView], act.Fence, int]]) -> None:
    """Each racer decides from some version it saw (maybe stale) and writes through
    conditional_update; the next racer's whole update lands between its read and its
    write. Whatever wins, the stored history keeps the plan's invariants."""
    store = Store(dataclasses.replace(start, deletion_timestamp=None,
                                      finalizers=[FINALIZER]))

    def run(k: int) -> None:
        if k >= len(racers):
            return
        pods, lease, back = racers[k]
        seen = store.versions[max(0, len(store.versions) - 1 - back)]
        action = d.decide(act.Observation(vm=copy.deepcopy(seen), pods=tuple(pods),
                                        lease=lease, direct=True))
        if not isinstance(action, STATUS_ACTIONS):
            run(k + 1)
            return
        raced = False

        def write(base: VirtualMachine, status: VirtualMachineStatus) -> VirtualMachine:
            nonlocal raced
            if not raced:
                raced = True
                run(k + 1)
            return store.write(base, status)

        with contextlib.suppress(FencedOut):
            conditional_update(copy.deepcopy(seen), status_mutation(action, lease), write,
                               store.read, policy=RetryPolicy(attempts=4),
                               sleep=lambda _s: None)
        if not raced:
            run(k + 1)

    run(0)
    for old, new in zip(store.versions, store.versions[1:], strict=False):
        o, n = old.status, new.status
        assert n.plan_seq >= o.plan_seq and n.restart_count >= o.restart_count
        if o.fence is not None:
            assert n.fence is not None and (n.fence.epoch, n.fence.token) >= (
                o.fence.epoch, o.fence.token)
        if n.pod_name and n.pod_name != o.pod_name:
            assert o.pending_pod is not None and n.pod_name == o.pending_pod.name
