"""The conditional-update helper re-runs the intent on a conflict, never the stale object.

First as properties against a tiny in-memory compare-and-swap store (unit, generated
interleavings), then against the real API server: a writer that bumps resourceVersion
between our read and our write, with the real helper and with the seed's broken retry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm import kube
from neonvm.api.types import Fence, PendingPod, VirtualMachineStatus
from neonvm.controller import actions as act
from neonvm.controller import decide as d
from neonvm.controller.action_table import status_mutation
from neonvm.controller.cluster import KubeCluster, VMRecord, VMWriter
from neonvm.controller.mutations import FencedOut
from neonvm.controller.observe import DirectReader
from neonvm.controller.update import (
    ConflictRetriesExhausted,
    RetryPolicy,
    UpdateOutcome,
    conditional_update,
)
from neonvm.dev.cluster import LocalCluster
from tests.support.harness import create_vm
from tests.support.seed_bug import stale_writeback_update

# ---- an in-memory CAS store ---------------------------------------------------------------


@dataclass(frozen=True)
class Version:
    rv: int
    items: tuple[str, ...]


def conflict() -> ApiException:
    return ApiException(status=409, reason="Conflict")


@dataclass
class CasStore:
    """One object; a write succeeds only against the current version (like etcd/the API)."""

    current: Version = field(default_factory=lambda: Version(1, ()))
    writes: list[tuple[Version, tuple[str, ...]]] = field(default_factory=list)
    deleted: bool = False

    def read(self) -> Version | None:
        return None if self.deleted else self.current

    def cas(self, base: Version, items: tuple[str, ...]) -> Version:
        if self.deleted:
            raise ApiException(status=404, reason="Not Found")
        if base.rv != self.current.rv:
            raise conflict()
        self.writes.append((base, items))
        self.current = Version(self.current.rv + 1, items)
        return self.current


def add(token: str) -> Callable[[Version], tuple[str, ...] | None]:
    """The intent "token is in the list": nothing to do when it already is."""
    return lambda v: None if token in v.items else (*v.items, token)


def no_sleep(_s: float) -> None:
    return None


def run_with_interference(helper: Callable[..., UpdateOutcome[Version]], store: CasStore,
                          schedule: list[int], attempts: int = 5
                          ) -> tuple[UpdateOutcome[Version] | None, list[str]]:
    """Our update of "mine", with ``schedule[i]`` foreign writers racing attempt ``i``."""
    foreign: list[str] = []
    attempt = 0

    def write(base: Version, items: tuple[str, ...]) -> Version:
        nonlocal attempt
        for _ in range(schedule[attempt] if attempt < len(schedule) else 0):
            token = f"foreign-{len(foreign)}"
            foreign.append(token)
            store.cas(store.current, (*store.current.items, token))
        attempt += 1
        return store.cas(base, items)

    first = store.read()
    assert first is not None
    try:
        outcome = helper(first, add("mine"), write, store.read,
                         policy=RetryPolicy(attempts=attempts), sleep=no_sleep)
    except ConflictRetriesExhausted:
        outcome = None
    return outcome, foreign


schedules = st.lists(st.integers(min_value=0, max_value=2), max_size=7)


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(schedules)
def test_no_update_is_ever_lost_whatever_races_the_write(schedule: list[int]) -> None:
    store = CasStore()
    outcome, foreign = run_with_interference(conditional_update, store, schedule)
    final = store.current.items
    assert set(foreign) <= set(final), "a foreign writer's update was overwritten"
    if outcome is None:
        assert "mine" not in final  # gave up, and said so
    else:
        assert outcome.written and "mine" in final
        assert outcome.obj == store.current
        assert outcome.conflicts == outcome.attempts - 1
        assert outcome.conflicts == sum(1 for n in schedule[:outcome.attempts] if n)


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(schedules)
def test_every_write_is_the_mutation_of_exactly_the_version_it_replaces(
        schedule: list[int]) -> None:
    store = CasStore()
    run_with_interference(conditional_update, store, schedule)
    ours = [(base, items) for base, items in store.writes if "mine" in items
            and "mine" not in base.items]
    assert len(ours) <= 1
    for base, items in ours:
        assert items == add("mine")(base)


@pytest.mark.unit
def test_the_seed_retry_overwrites_a_racing_writer() -> None:
    store = CasStore()
    outcome, foreign = run_with_interference(stale_writeback_update, store, [1])
    assert outcome is not None and outcome.written
    assert foreign == ["foreign-0"]
    assert store.current.items == ("mine",), "the broken retry wrote its stale copy back"


@pytest.mark.unit
def test_an_intent_already_fulfilled_on_the_fresh_copy_writes_nothing() -> None:
    store = CasStore()
    first = store.read()
    assert first is not None

    def write(base: Version, items: tuple[str, ...]) -> Version:
        if "mine" not in store.current.items:  # someone else does our job first
            store.cas(store.current, ("mine",))
        return store.cas(base, items)

    outcome = conditional_update(first, add("mine"), write, store.read, sleep=no_sleep)
    assert not outcome.written and outcome.conflicts == 1
    assert len(store.writes) == 1  # only the other writer's


@pytest.mark.unit
def test_a_deleted_object_ends_the_update_unwritten() -> None:
    store = CasStore()
    first = store.read()
    assert first is not None

    def write(base: Version, items: tuple[str, ...]) -> Version:
        store.current = Version(store.current.rv + 1, store.current.items)
        store.deleted = True
        raise conflict()

    outcome = conditional_update(first, add("mine"), write, store.read, sleep=no_sleep)
    assert outcome == UpdateOutcome(written=False, obj=None, attempts=1, conflicts=1)


@pytest.mark.unit
def test_errors_other_than_conflicts_are_not_retried() -> None:
    store = CasStore()
    first = store.read()
    assert first is not None
    calls = []

    def write(base: Version, items: tuple[str, ...]) -> Version:
        calls.append(base)
        raise ApiException(status=422, reason="Invalid")

    with pytest.raises(ApiException, match="Invalid"):
        conditional_update(first, add("mine"), write, store.read, sleep=no_sleep)
    assert len(calls) == 1


@pytest.mark.unit
def test_backoff_grows_and_is_capped() -> None:
    policy = RetryPolicy(attempts=10, initial_backoff=0.01, max_backoff=0.05)
    assert [policy.backoff(n) for n in (1, 2, 3, 4)] == [0.01, 0.02, 0.04, 0.05]


# ---- against the real API server ------------------------------------------------------------


def _record(api: client.ApiClient, namespace: str, name: str) -> VMRecord:
    record = DirectReader(KubeCluster(api)).get_vm(namespace, name)
    assert record is not None
    return record


def _another_writer_sets_restart_count(writer: VMWriter, record: VMRecord,
                                       count: int) -> VMRecord:
    status = VirtualMachineStatus(**{**record.vm.status.__dict__, "restart_count": count})
    return writer.put_status(record, status)


LEASE = act.Fence(epoch=1, token=7)


def _plan_action(record: VMRecord) -> act.RecordPlan:
    seq = record.vm.status.plan_seq + 1
    return act.RecordPlan(plan=PendingPod(name=d.plan_name(record.vm, seq), plan_seq=seq,
                                        token=LEASE.token, epoch=LEASE.epoch,
                                        generation=record.vm.generation),
                        observed_seq=record.vm.status.plan_seq)


@pytest.mark.cluster
def test_a_write_raced_by_another_writer_is_reapplied_to_the_fresh_copy(
        cluster: LocalCluster, api: client.ApiClient, namespace: str) -> None:
    create_vm(api, namespace, "raced")
    controller = kube.api_client(cluster.kubeconfig_for("controller"))
    writer, reader = VMWriter(controller), DirectReader(KubeCluster(controller))
    stale = _record(api, namespace, "raced")
    bumped = _another_writer_sets_restart_count(writer, stale, 7)
    assert bumped.resource_version != stale.resource_version

    mutation = status_mutation(_plan_action(stale), LEASE)
    outcome = conditional_update(stale, lambda r: mutation(r.vm), writer.put_status,
                                 lambda: reader.get_vm(namespace, "raced"))

    assert outcome.written and outcome.conflicts == 1
    final = _record(api, namespace, "raced").vm.status
    assert final.restart_count == 7, "the other writer's update survived"
    assert final.pending_pod is not None and final.pending_pod.plan_seq == 1


@pytest.mark.cluster
def test_the_seed_retry_against_the_api_server_overwrites_the_racing_write(
        cluster: LocalCluster, api: client.ApiClient, namespace: str) -> None:
    create_vm(api, namespace, "raced")
    controller = kube.api_client(cluster.kubeconfig_for("controller"))
    writer, reader = VMWriter(controller), DirectReader(KubeCluster(controller))
    stale = _record(api, namespace, "raced")
    _another_writer_sets_restart_count(writer, stale, 7)

    mutation = status_mutation(_plan_action(stale), LEASE)
    outcome = stale_writeback_update(stale, lambda r: mutation(r.vm), writer.put_status,
                                     lambda: reader.get_vm(namespace, "raced"))

    assert outcome.written and outcome.conflicts == 1
    assert _record(api, namespace, "raced").vm.status.restart_count == 0, \
        "the broken retry wrote the stale copy's view over the newer status"


@pytest.mark.cluster
def test_a_plan_raced_by_a_commit_is_not_recorded_at_all(
        cluster: LocalCluster, api: client.ApiClient, namespace: str) -> None:
    """The seed's step 3: a stale read without podName must not start a second plan."""
    create_vm(api, namespace, "seed")
    controller = kube.api_client(cluster.kubeconfig_for("controller"))
    writer, reader = VMWriter(controller), DirectReader(KubeCluster(controller))
    stale = _record(api, namespace, "seed")
    committed = VirtualMachineStatus(pod_name="seed-pod-from-job-2", pod_uid="u2",
                                     plan_seq=1, phase="Running")
    after_commit = writer.put_status(stale, committed)

    mutation = status_mutation(_plan_action(stale), LEASE)
    outcome = conditional_update(stale, lambda r: mutation(r.vm), writer.put_status,
                                 lambda: reader.get_vm(namespace, "seed"))

    assert not outcome.written and outcome.conflicts == 1
    now = _record(api, namespace, "seed")
    assert now.resource_version == after_commit.resource_version, "nothing was written"
    assert now.vm.status.pending_pod is None and now.vm.status.pod_name == "seed-pod-from-job-2"


@pytest.mark.cluster
def test_a_write_from_an_older_epoch_is_fenced_out_on_the_fresh_copy(
        cluster: LocalCluster, api: client.ApiClient, namespace: str) -> None:
    create_vm(api, namespace, "fenced")
    controller = kube.api_client(cluster.kubeconfig_for("controller"))
    writer, reader = VMWriter(controller), DirectReader(KubeCluster(controller))
    stale = _record(api, namespace, "fenced")
    # A leader of epoch 5 touched the VM (its fence) without changing anything we rely on.
    writer.put_status(stale, VirtualMachineStatus(fence=Fence(epoch=5, token=1)))

    ours = status_mutation(_plan_action(stale), LEASE)  # epoch 1, decided on the stale copy
    assert ours(stale.vm) is not None
    with pytest.raises(FencedOut):
        conditional_update(stale, lambda r: ours(r.vm), writer.put_status,
                           lambda: reader.get_vm(namespace, "fenced"))
    assert _record(api, namespace, "fenced").vm.status.pending_pod is None
