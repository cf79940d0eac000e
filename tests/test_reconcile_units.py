"""Pure pieces of the controller: work queue, fault knobs, runner pod spec, cache store,
conditions. No servers (``-m unit``)."""

from __future__ import annotations

import json
import threading
import typing

import pytest

from neonvm.api import types
from neonvm.api.schema import decode
from neonvm.api.types import (
    Condition,
    Fence,
    PendingPod,
    VirtualMachine,
    VirtualMachineSpec,
    VirtualMachineStatus,
)
from neonvm.controller import actions as act
from neonvm.controller import mutations, performers, reasons
from neonvm.controller.action_table import (
    ACTIONS,
    SEEN_BY_WRITE,
    finalizers_mutation,
    status_mutation,
)
from neonvm.controller.conditions import ConditionUpdate, conditions_mutation, desired_conditions
from neonvm.controller.fault_wiring import VersionedStore
from neonvm.controller.faults import STEPS, FaultConfig, FaultConfigError, Faults
from neonvm.controller.informer import Store
from neonvm.controller.mutations import FencedOut
from neonvm.controller.observe import Snapshot, pod_index, pod_view
from neonvm.controller.podspec import PodDefaults, PodSpecError, has_our_gate, runner_pod
from neonvm.controller.reasons import AVAILABLE, DEGRADED, WAITING_FOR_OLD_POD
from neonvm.controller.step import ActionRow
from neonvm.controller.workqueue import Backoff, WorkQueue
from neonvm.drills.schedule import CRASH_STEPS
from neonvm.verify.actors import FINALIZER_WRITES, POD_ACTIONS, RUNNER_ACTIONS, STATUS_WRITES
from neonvm.verify.scaling import RUNNER_CALLS as SCALING_MODELLED

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---- work queue ---------------------------------------------------------------------------


def test_a_key_added_twice_is_queued_once() -> None:
    q = WorkQueue()
    q.add("a")
    q.add("a")
    q.add("b")
    assert len(q) == 2
    assert [q.get(0), q.get(0), q.get(0)] == ["a", "b", None]


def test_a_key_being_processed_is_not_handed_to_a_second_worker() -> None:
    q = WorkQueue()
    q.add("a")
    assert q.get(0) == "a"
    q.add("a")  # an event while a worker holds it
    assert q.get(0) is None, "no second worker for the same key"
    q.done("a")
    assert q.get(0) == "a", "re-queued once the first worker is done"


def test_delayed_keys_wait_and_the_earliest_request_wins() -> None:
    clock = FakeClock()
    q = WorkQueue(clock=clock)
    q.add_after("a", 10)
    q.add_after("a", 2)
    assert q.get(0) is None
    clock.now = 2.5
    assert q.get(0) == "a"
    q.done("a")
    clock.now = 11
    assert q.get(0) is None, "the superseded later request does not fire again"


def test_rate_limited_retries_back_off_exponentially_until_forgotten() -> None:
    q = WorkQueue(Backoff(base=1.0, cap=5.0), clock=FakeClock())
    assert [q.add_rate_limited("a") for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    q.forget("a")
    assert q.add_rate_limited("a") == 1.0


def test_shutdown_wakes_waiting_workers() -> None:
    q = WorkQueue()
    got: list[str | None] = []
    t = threading.Thread(target=lambda: got.append(q.get()))
    t.start()
    q.shut_down()
    t.join(5)
    assert got == [None] and not t.is_alive()


def test_a_direct_add_is_handed_out_once_with_its_key() -> None:
    """``direct``: the key's next processing starts with a quorum read; the flag is taken
    with the key, and a plain add does not set it."""
    q = WorkQueue()
    q.add("a", direct=True)
    q.add("b")
    assert q.take(0) == ("a", True)
    assert q.take(0) == ("b", False)
    q.done("a")
    q.add("a")
    assert q.take(0) == ("a", False), "the flag was taken by the first worker"


def test_a_delayed_direct_add_marks_the_key_at_once() -> None:
    """As the old side-set did: a delayed direct requeue marks the key now, so an event
    that brings the key back earlier starts from a quorum read (and takes the flag)."""
    clock = FakeClock()
    q = WorkQueue(clock=clock)
    q.add("a")
    assert q.take(0) == ("a", False)
    q.add_after("a", 10, direct=True)  # the worker's own requeue, while it holds the key
    q.done("a")
    q.add("a")  # a watch event
    assert q.take(0) == ("a", True)
    q.done("a")
    clock.now = 11
    assert q.take(0) == ("a", False)


def test_a_rate_limited_direct_add_carries_the_flag() -> None:
    clock = FakeClock()
    q = WorkQueue(Backoff(base=1.0, cap=5.0), clock=clock)
    assert q.add_rate_limited("a", direct=True) == 1.0
    clock.now = 1.5
    assert q.take(0) == ("a", True)


# ---- faults -------------------------------------------------------------------------------


def test_fault_specs_parse_and_say_what_is_wrong() -> None:
    config = FaultConfig.parse(["crash_after=commit@2", "stale_reads=0.3,conflict=0.2;seed=7"])
    assert config == FaultConfig(crash_after="commit", crash_occurrence=2, stale_reads=0.3,
                                 conflict=0.2, seed=7)
    assert not FaultConfig.parse("").enabled
    for bad, message in (("crash_after=lunch", "step must be one of"),
                         ("stale_reads=2", "probability"), ("nonsense", "key=value"),
                         ("jitter=1", "unknown fault")):
        with pytest.raises(FaultConfigError, match=message):
            FaultConfig.parse(bad)


def test_crash_after_fires_exactly_at_the_chosen_occurrence_of_the_step() -> None:
    exits: list[int] = []
    faults = Faults(FaultConfig(crash_after="commit", crash_occurrence=2), exit=exits.append)
    faults.after("plan")
    faults.after("commit")
    assert exits == []
    faults.after("commit")
    assert exits == [137]


def test_seeded_faults_are_reproducible_and_off_by_default() -> None:
    a = Faults(FaultConfig(conflict=0.5, seed=3))
    b = Faults(FaultConfig(conflict=0.5, seed=3))
    assert [a.inject_conflict() for _ in range(50)] == [b.inject_conflict() for _ in range(50)]
    off = Faults()
    assert not any(off.serve_stale() or off.drop_event() or off.inject_conflict()
                   for _ in range(100))


# ---- runner pod spec ------------------------------------------------------------------------


def a_vm(spec: dict[str, object] | None = None) -> VirtualMachine:
    return VirtualMachine(
        name="db", namespace="ns", uid="abcdef0123", resource_version="1", generation=3,
        spec=decode(VirtualMachineSpec, {"guest": {"rootDisk": {"image": "img"}}, **(spec or {})}),
        status=VirtualMachineStatus(), labels={"team": "x", "vm.neon.tech/name": "evil"})


PLAN = PendingPod(name="db-abcdef01-4", plan_seq=4, token=77, epoch=5, generation=3)


def test_the_runner_pod_is_gated_owned_labelled_and_never_restarts_itself() -> None:
    pod = runner_pod(a_vm(), PLAN)
    meta = pod["metadata"]
    assert meta["name"] == PLAN.name
    assert has_our_gate(pod) and pod["spec"]["restartPolicy"] == "Never"
    assert meta["labels"] == {"team": "x", types.LABEL_VM_NAME: "db",
                              types.LABEL_VM_UID: "abcdef0123", "app.kubernetes.io/name": "NeonVM"}
    assert meta["ownerReferences"][0]["controller"] is True
    assert meta["annotations"][types.ANNOTATION_TOKEN] == "77"
    assert meta["annotations"][types.ANNOTATION_EPOCH] == "5"
    assert meta["annotations"][types.ANNOTATION_PLAN_SEQ] == "4"
    spec = json.loads(meta["annotations"]["vm.neon.tech/spec"])  # the runner's spec file
    assert spec["guest"]["rootDisk"]["image"] == "img"


def test_resources_come_from_pod_resources_or_the_guest_size() -> None:
    derived = runner_pod(a_vm({"guest": {"rootDisk": {"image": "i"}, "cpus": {
        "min": 0.5, "max": 3, "use": 1.5}, "memorySlots": {"min": 1, "max": 4},
        "memorySlotSize": "1Gi"}}), PLAN)["spec"]["containers"][0]["resources"]
    assert derived == {"requests": {"cpu": "1500m", "memory": "4352Mi"},
                       "limits": {"cpu": "3", "memory": "4352Mi"}}
    given = {"requests": {"cpu": "1"}}
    assert runner_pod(a_vm({"podResources": given}), PLAN)["spec"]["containers"][0][
        "resources"] == given


def test_the_default_image_disks_and_scheduling_fields_reach_the_pod() -> None:
    pod = runner_pod(a_vm({
        "disks": [{"name": "cache", "tmpfs": {"size": "1Gi"}},
                  {"name": "cfg", "configMap": {"name": "c"}}],
        "affinity": {"nodeAffinity": {}}, "schedulerName": "s",
        "imagePullSecrets": [{"name": "reg"}]}), PLAN, PodDefaults(runner_image="r:1"))
    spec = pod["spec"]
    assert spec["containers"][0]["image"] == "r:1"
    # (vm-spec and vm-run, the spec file and the work dir: tests/test_podspec.py)
    assert [v for v in spec["volumes"] if v["name"] not in ("vm-spec", "vm-run")] == [
        {"name": "disk-cache", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
        {"name": "disk-cfg", "configMap": {"name": "c"}},
        {"name": "vm-images", "emptyDir": {}}]
    assert (spec["schedulerName"], spec["imagePullSecrets"]) == ("s", [{"name": "reg"}])


def test_a_root_disk_in_a_container_image_is_copied_in_by_an_init_container() -> None:
    pod = runner_pod(a_vm({"guest": {"rootDisk": {"image": "reg/pg14:dev"}}}), PLAN)
    (init,) = pod["spec"]["initContainers"]
    assert init["image"] == "reg/pg14:dev"
    assert init["command"] == ["cp", "/disk.qcow2", "/vm/images/rootdisk.qcow2"]
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["NEONVM_ROOT_DISK"] == "/vm/images/rootdisk.qcow2"


def test_a_root_disk_given_as_a_node_path_is_used_as_it_is() -> None:
    pod = runner_pod(a_vm({"guest": {"rootDisk": {"image": "/srv/disk.qcow2"}}}), PLAN)
    assert "initContainers" not in pod["spec"]
    env = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    assert "NEONVM_ROOT_DISK" not in env


def test_a_spec_no_pod_can_be_built_from_is_an_error_not_a_crash() -> None:
    with pytest.raises(PodSpecError, match="exactly one"):
        runner_pod(a_vm({"disks": [{"name": "d"}]}), PLAN)
    with pytest.raises(PodSpecError, match="not a resource quantity"):
        runner_pod(a_vm({"guest": {"rootDisk": {"image": "i"}, "memorySlotSize": "lots"}}),
                   PLAN)


# ---- cache store ------------------------------------------------------------------------------


def raw_pod(name: str, vm: str, rv: str, gated: bool = True) -> dict[str, object]:
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": rv,
                         "uid": f"u-{name}", "labels": {types.LABEL_VM_NAME: vm},
                         "ownerReferences": [{"kind": "VirtualMachine", "uid": "vmuid",
                                              "controller": True}]},
            "spec": {"schedulingGates": [{"name": types.SCHEDULING_GATE}] if gated else []},
            "status": {"phase": "Pending"}}


def test_the_store_indexes_pods_by_vm_and_keeps_older_lists_for_stale_reads() -> None:
    store = VersionedStore(index=pod_index, depth=5)
    store.apply("ADDED", raw_pod("p1", "a", "1"))
    store.apply("ADDED", raw_pod("p2", "a", "2"))
    store.apply("DELETED", raw_pod("p1", "a", "3"))
    assert [p["metadata"]["name"] for p in store.by_index("ns/a")] == ["p2"]
    assert [[p["metadata"]["name"] for p in older] for older in store.older_index("ns/a")] \
        == [[], ["p1"], ["p1", "p2"]]


def test_a_relist_reports_what_changed_including_missed_deletions() -> None:
    store = Store()
    store.replace([raw_pod("p1", "a", "1"), raw_pod("p2", "a", "1")])
    changes = store.replace([raw_pod("p2", "a", "1"), raw_pod("p3", "a", "5")])
    assert sorted((k, new is None) for k, _old, new in changes) == [
        ("ns/p1", True), ("ns/p3", False)]


def test_a_pod_view_reads_gate_owner_and_termination() -> None:
    view = pod_view(raw_pod("p", "a", "1"))
    assert (view.gated, view.owner_uid, view.terminating) == (True, "vmuid", False)
    assert not pod_view(raw_pod("p", "a", "1", gated=False)).gated


# ---- conditions ---------------------------------------------------------------------------------


def test_waiting_for_the_old_pod_keeps_its_since_and_is_written_only_on_change() -> None:
    vm = a_vm()
    lease = act.Fence(epoch=5, token=1)
    wait = act.Wait(condition=WAITING_FOR_OLD_POD, reason="waiting for old to go")
    snap = Snapshot(obs=act.Observation(vm=vm, pods=(), lease=lease, direct=True), record=None)
    updates = desired_conditions(snap, wait)
    first = conditions_mutation(updates, lease, now="2026-01-01T00:00:00Z")(vm)
    assert first is not None
    (waiting,) = [c for c in first.conditions if c.type == WAITING_FOR_OLD_POD]
    assert waiting.status == "True" and waiting.last_transition_time == "2026-01-01T00:00:00Z"
    assert "out-of-service" in (waiting.message or "")
    vm.status = first
    assert conditions_mutation(updates, lease, now="2026-01-01T00:05:00Z")(vm) is None


def test_waiting_for_a_pull_secret_is_degraded_and_not_available_until_a_pod_is_committed(
) -> None:
    vm = a_vm()
    lease = act.Fence(epoch=5, token=1)
    # The VM ran (Available=True), its pod went, and the replacement's plan is recorded.
    vm.status.conditions = [Condition(type=AVAILABLE, status="True", reason="RunnerRunning",
                                      message="running", observed_generation=3)]
    vm.status.pending_pod = PLAN
    wait = act.Wait(condition=reasons.PULL_SECRET_NOT_FOUND, reason="image pull secret regcred ...")
    snap = Snapshot(obs=act.Observation(vm=vm, pods=(), lease=lease, direct=True), record=None)
    vm.status = conditions_mutation(desired_conditions(snap, wait), lease)(vm) or vm.status
    by_type = {c.type: c for c in vm.status.conditions}
    assert (by_type[DEGRADED].status, by_type[DEGRADED].reason) == (
        "True", reasons.PULL_SECRET_NOT_FOUND)
    assert by_type[DEGRADED].message == wait.reason
    assert (by_type[AVAILABLE].status, by_type[AVAILABLE].reason) == ("False", "NoRunner")

    vm.status.pending_pod, vm.status.pod_name = None, PLAN.name
    gated = act.PodView(name=PLAN.name, uid="u", owner_uid=vm.uid, gated=True,
                      terminating=False, phase="Pending")
    snap = Snapshot(obs=act.Observation(vm=vm, pods=(gated,), lease=lease, direct=True),
                    record=None)
    vm.status = conditions_mutation(
        desired_conditions(snap, act.Done()), lease)(vm) or vm.status
    assert {c.type: c.status for c in vm.status.conditions}[DEGRADED] == "False"


def test_a_condition_write_is_fenced_out_by_a_newer_epoch() -> None:
    vm = a_vm()
    vm.status.fence = Fence(epoch=9, token=1)
    update = ConditionUpdate("Available", "False", "x", "y")
    with pytest.raises(FencedOut):
        conditions_mutation([update], act.Fence(epoch=5, token=1))(vm)


def test_a_false_condition_is_not_added_just_to_say_false() -> None:
    vm = a_vm()
    vm.status.observed_generation = vm.generation
    vm.status.conditions = [Condition(type="Available", status="False", reason="x", message="y",
                                      observed_generation=vm.generation)]
    update = ConditionUpdate(WAITING_FOR_OLD_POD, "False", "NoOldPod", "-",
                             only_if_present=True)
    assert conditions_mutation([update], act.Fence(epoch=5, token=1))(vm) is None


def test_the_store_keeps_no_older_versions_unless_asked_and_no_empty_index_entries() -> None:
    store = Store(index=pod_index)
    store.apply("ADDED", raw_pod("p1", "a", "1"))
    store.apply("MODIFIED", raw_pod("p1", "a", "2"))
    assert not hasattr(store, "older"), "older versions are the fault wrapper's alone"
    store.apply("DELETED", raw_pod("p1", "a", "3"))
    assert store.by_index("ns/a") == [] and store._index == {}


def test_a_deletion_found_by_a_direct_read_drops_only_that_uid_from_the_store() -> None:
    store = Store(index=pod_index)
    store.apply("ADDED", raw_pod("p1", "a", "1"))
    assert not store.discard("ns/p1", "u-someone-else"), "a re-created namesake is kept"
    assert store.get("ns/p1") is not None
    assert store.discard("ns/p1", "u-p1")
    assert store.get("ns/p1") is None and store.by_index("ns/a") == []
    assert not store.discard("ns/p1", "u-p1"), "nothing left to drop"


# ---- the action table ----------------------------------------------------------------------


def test_every_performed_action_has_one_row_and_its_own_step() -> None:
    """Adding an action is its class (with a ``step``) and its row: nothing else lists
    the actions by hand."""
    performed = act.performed_actions()
    assert set(ACTIONS) == set(performed), "a performed action without a row, or a row " \
                                           "for an action that is not performed"
    steps = [kind.step for kind in performed]
    assert len(set(steps)) == len(steps), f"two actions share a step: {steps}"
    assert set(STEPS) == set(steps) and set(CRASH_STEPS) == set(steps)
    assert not any(kind.step for kind in (act.Done, act.Wait, act.ObserveDirect, act.Fenced))


@pytest.mark.parametrize("left_out", ["perform", "writes", "mutation", "event",
                                      "seen_by_write"])
def test_a_row_that_leaves_out_its_performer_mutation_event_or_seen_flag_does_not_load(
        left_out: str) -> None:
    """To add an action: its class, its row, its performer. A row must say each of these;
    one that leaves any out fails when the table is built."""
    fields = {"perform": performers.status_write, "writes": "status",
              "mutation": mutations.record_plan, "event": None, "seen_by_write": False}
    ActionRow(**fields)  # type: ignore[arg-type]
    del fields[left_out]
    with pytest.raises(TypeError, match=left_out):
        ActionRow(**fields)  # type: ignore[arg-type]


def test_a_row_has_a_mutation_exactly_when_it_writes_the_vm() -> None:
    with pytest.raises(ValueError):
        ActionRow(performers.status_write, "status", None, event=None, seen_by_write=False)
    with pytest.raises(ValueError):
        ActionRow(performers.ungate, "pod", mutations.record_plan, event=None,
                  seen_by_write=True)


def test_every_row_carries_its_own_actions_mutation_and_a_performer() -> None:
    """To add an action: its class, its row, its performer. A VM write's row names the
    action's own mutation (the function of ``mutations`` that takes that class: no other
    table maps actions to mutations); a status or finalizer write is performed by the shared
    ``status_write`` or ``finalizer_write``, every other row by a performer of its own."""
    shared = {"status": performers.status_write, "main": performers.finalizer_write}
    own: list[object] = []
    for kind, row in ACTIONS.items():
        assert row.perform.__module__ == performers.__name__, kind
        if row.writes in shared:
            assert row.perform is shared[row.writes], kind
            assert row.mutation is not None and row.mutation.__module__ == mutations.__name__
            takes = typing.get_type_hints(row.mutation)["action"]
            assert takes is kind, f"{kind.__name__}'s row carries the mutation of {takes}"
            own.append(row.mutation)
        else:
            assert row.perform not in shared.values(), kind
            own.append(row.perform)
    assert len(set(own)) == len(own), "two rows share a mutation or a performer"


def test_the_decisions_taken_from_a_write_answer_are_the_rows_marked_so() -> None:
    """docs/protocol.md, "Observing from write responses": the dangerous steps (Restart,
    DeletePod, RemoveFinalizer) and live scaling's are decided from a direct read only."""
    assert set(SEEN_BY_WRITE) == {
        act.Done, act.Wait, act.ObserveDirect, act.Fenced, act.AddFinalizer, act.RecordPlan,
        act.CreatePod, act.Commit, act.DropPlan, act.SyncStatus, act.Ungate}


def test_every_write_row_has_its_shipped_mutation_and_the_explorer_models_every_row() -> None:
    lease = act.Fence(epoch=1, token=1)
    for kind, row in ACTIONS.items():
        if row.writes == "status":
            assert callable(status_mutation(kind(), lease)), kind
        elif row.writes == "main":
            assert callable(finalizers_mutation(kind())), kind
        else:
            with pytest.raises(ValueError):
                status_mutation(kind(), lease)
    names = {kind.__name__ for kind in ACTIONS}
    assert names == STATUS_WRITES | FINALIZER_WRITES | POD_ACTIONS | RUNNER_ACTIONS
    assert RUNNER_ACTIONS <= SCALING_MODELLED, "a runner call the scaling explorer lacks"
    assert not STATUS_WRITES & FINALIZER_WRITES and not POD_ACTIONS & STATUS_WRITES
