"""Pure logic beside the real-server tests in ``tests/test_reconcile_loops.py``: how pod
create errors are sorted, how condition messages are bounded, and which Degraded reasons
clear by themselves."""

from __future__ import annotations

import copy
import datetime as dt

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from loguru import logger

from neonvm.api.schema import encode
from neonvm.api.types import (
    API_VERSION,
    FINALIZER,
    KIND,
    SCHEDULING_GATE,
    Condition,
    PendingPod,
    VirtualMachine,
    VirtualMachineSpec,
    VirtualMachineStatus,
)
from neonvm.controller import actions as act
from neonvm.controller import conditions as c
from neonvm.controller import reasons
from neonvm.controller.cluster import VMRecord
from neonvm.controller.conditions import stuck_mutation
from neonvm.controller.create_policy import classify_create_error
from neonvm.controller.observe import Snapshot, make_snapshot
from neonvm.controller.performers import replace_unlabelled
from neonvm.controller.reconciler import miss_message
from tests.support import shipped_reconciler
from tests.support.authority import StaticAuthority
from tests.support.fake_cluster import FakeCluster

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("status", "message", "kind"), [
    (409, 'pods "vm-1" already exists', "exists"),
    # Permanent: the same pod asked again gets the same answer.
    (400, "the body of the request was in an unknown format", "refuse"),
    (403, 'pods "vm-1" is forbidden: ValidatingAdmissionPolicy denied request', "refuse"),
    (405, "method not allowed", "refuse"),
    (413, "Request entity too large: limit is 3145728", "refuse"),
    (415, "unsupported media type", "refuse"),
    (422, 'Pod "vm-1" is invalid: spec.containers[0].image: Required value', "refuse"),
    # What kube-apiserver 1.36 answers for a pod over etcd's limits (seen for real).
    (500, "etcdserver: request is too large", "refuse"),
    (500, "rpc error: code = ResourceExhausted desc = trying to send message larger than "
          "max (2097654 vs. 2097152)", "refuse"),
    # Transient: retried with backoff.
    (403, 'pods "vm-1" is forbidden: exceeded quota: q, requested: pods=1', "retry"),
    (403, 'pods is forbidden: User "x" cannot create resource "pods"', "retry"),
    (403, "unable to create new content in namespace t because it is being terminated",
     "retry"),
    # Admission not ready yet: the ServiceAccount comes after the VM or the namespace
    # was just created, admission caches unsynced after an API-server restart, quota
    # status not computed yet. These pass without any change to the VM.
    (403, 'pods "vm-1" is forbidden: error looking up service account t/default: '
          'serviceaccount "default" not found', "retry"),
    (403, 'pods "vm-1" is forbidden: not yet ready to handle request', "retry"),
    (403, 'pods "vm-1" is forbidden: status unknown for quota: q, resources: pods',
     "retry"),
    (401, "Unauthorized", "retry"),
    (404, 'namespaces "t" not found', "retry"),
    (408, "request timeout", "retry"),
    (410, "gone", "retry"),
    (429, "storage is (re)initializing", "retry"),
    (500, "Internal error occurred: etcdserver: leader changed", "retry"),
    (503, "service unavailable", "retry"),
    (504, "the server was unable to return a response in the time allotted", "retry"),
    (0, "connection refused", "retry"),
    (None, "read timed out", "retry"),
])
def test_create_errors_are_sorted_into_exists_retry_and_refuse(
        status: int | None, message: str, kind: str) -> None:
    assert classify_create_error(status, message) == kind


def test_condition_messages_and_api_error_text_are_bounded_with_an_ellipsis() -> None:
    assert c.truncate("short") == "short"
    long = "x" * 5000
    cut = c.truncate(long)
    assert len(cut) == c.MESSAGE_LIMIT and cut.endswith(c.ELLIPSIS)
    api = c.api_error_text("Pod \"p\" is invalid:\n" + "y" * 5000)
    assert len(api) == c.API_ERROR_LIMIT and api.endswith(c.ELLIPSIS) and "\n" not in api

    vm = VirtualMachine(name="vm", namespace="ns", uid="u", resource_version="1", generation=1,
                        spec=VirtualMachineSpec(), status=VirtualMachineStatus())
    mutate = c.conditions_mutation([c.stuck_condition(reasons.CREATE_FAILING, long)],
                                   act.Fence(epoch=1, token=1), now="2026-01-01T00:00:00Z")
    status = mutate(vm)
    assert status is not None
    (written,) = status.conditions
    assert written.message == cut
    vm.status = status
    assert mutate(vm) is None, "a bounded message equal to the one written: no rewrite"


@pytest.mark.parametrize(("reason", "clears"), [
    ("UngateNotTakingEffect", True), ("CreatePodNotTakingEffect", True),
    (reasons.STEP_BUDGET_EXHAUSTED, True), (reasons.UNGATE_FORBIDDEN, True),
    (reasons.CREATE_FAILING, True),
    ("CreateRefused", False), (reasons.PULL_SECRET_NOT_FOUND, False),
])
def test_a_stuck_reason_clears_when_a_reconcile_ends_normally(reason: str,
                                                               clears: bool) -> None:
    vm = VirtualMachine(
        name="vm", namespace="ns", uid="u", resource_version="1", generation=1,
        spec=VirtualMachineSpec(),
        status=VirtualMachineStatus(
            pending_pod=PendingPod(name="vm-u-1", plan_seq=1, token=1, epoch=1,
                                   generation=1),
            conditions=[Condition(type="Degraded", status="True", reason=reason,
                                  message="m", observed_generation=0)]))
    snap = Snapshot(obs=act.Observation(vm=vm, pods=(), lease=act.Fence(epoch=1, token=1),
                                      direct=True), record=None)
    updates = {u.type: u for u in c.desired_conditions(snap, act.Wait(seconds=1.0))}
    degraded = updates.get("Degraded")
    if clears:
        assert degraded is not None and (degraded.status, degraded.reason) == (
            "False", reasons.RECOVERED)
    else:
        assert degraded is None


def test_a_stuck_condition_is_written_once_however_its_message_changes() -> None:
    """Two stuck reconciles of the same step on different pods (each new plan has a new
    pod name) give the same condition: the second writes nothing, so its own watch event
    cannot requeue the VM past the stuck backoff."""
    vm = VirtualMachine(name="vm", namespace="ns", uid="u", resource_version="1", generation=1,
                        spec=VirtualMachineSpec(), status=VirtualMachineStatus())
    lease = act.Fence(epoch=1, token=1)
    reason = f"Ungate{reasons.NOT_TAKING_EFFECT}"
    first = miss_message(act.Ungate, "declined", "")
    status = stuck_mutation(c.stuck_condition(reason, first), lease)(vm)
    assert status is not None
    vm.status = status
    (written,) = status.conditions
    assert "vm-u-" not in written.message, written.message
    # Another attempt: another error text (naming another pod) and counts.
    second = miss_message(act.Ungate, "declined", 'pods "vm-u-2" is forbidden: x')
    assert stuck_mutation(c.stuck_condition(reason, second), lease)(vm) is None
    assert stuck_mutation(c.stuck_condition(reasons.CREATE_FAILING, "creating runner pod vm-u-3 "
                                            "keeps failing"), lease)(vm) is not None, \
        "a new reason is a transition: written"
    vm.status.conditions[0].status = "False"
    assert stuck_mutation(c.stuck_condition(reason, second), lease)(vm) is not None, \
        "stuck again after a recovery: written"


class _Events:
    def record(self, vm: VirtualMachine, reason: str, message: str,
               warning: bool = False) -> None:
        pass


@pytest.mark.parametrize(("owner", "deleted"), [
    ("vm-a-uid", True),    # this VM's own pod that lost its label: replaced
    ("vm-b-uid", False),   # another VM's gated pod that VM A's status was pointed at
    (None, False),         # a pod controlled by nothing
])
def test_an_unlabelled_committed_pod_is_deleted_only_if_this_vm_controls_it(
        owner: str | None, deleted: bool) -> None:
    vm = VirtualMachine(name="a", namespace="ns", uid="vm-a-uid", resource_version="1",
                        generation=1, spec=VirtualMachineSpec(),
                        status=VirtualMachineStatus())
    refs = [] if owner is None else [{"apiVersion": "vm.neon.tech/v1", "kind": "VirtualMachine",
                                      "name": "b", "uid": owner, "controller": True}]
    pod = {"metadata": {"name": "b-1", "uid": "pod-uid", "resourceVersion": "7",
                        "labels": {"vm.neon.tech/name": "b"}, "ownerReferences": refs},
           "spec": {"schedulingGates": [{"name": SCHEDULING_GATE}]}}
    fake = FakeCluster()
    pod = fake.add_pod({**pod, "metadata": {**pod["metadata"], "namespace": "ns"}})
    reconciler = shipped_reconciler(client.ApiClient(), cluster=fake,
                                    events=_Events())  # type: ignore[arg-type]
    outcome = replace_unlabelled(reconciler.ctx, vm, pod, act.Ungate(name="b-1", uid="pod-uid"),
                                 logger)
    deletes = [name for call, name in fake.calls if call == "delete_pod"]
    assert (deletes == ["b-1"]) is deleted, fake.calls
    assert (fake.pod("ns", "b-1") is None) is deleted
    assert (outcome == "replaced") is deleted, outcome


class _PlantedNames:
    """A VM whose every planned pod name is already taken by a pod not labelled for it
    (possible with the admission fence off): each reconcile drops and re-plans until the
    step budget is used up, each time under another pod name. Reads and writes of the VM
    are kept in memory; only the Degraded condition's changes are counted."""

    def __init__(self) -> None:
        self.raw: dict[str, object] = {
            "apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": "vm", "namespace": "ns", "uid": "0123456789abcdef",
                         "generation": 1, "resourceVersion": "1", "finalizers": [FINALIZER]},
            "spec": {}, "status": {}}
        self.degraded_writes = 0
        self.api_client = client.ApiClient()

    def _record(self) -> VMRecord:
        return VMRecord.from_raw(copy.deepcopy(self.raw))

    def observe(self, key: str, lease: act.Fence) -> Snapshot:
        return make_snapshot(self._record(), [], lease, direct=True)

    def get_vm(self, namespace: str, name: str) -> VMRecord:
        return self._record()

    def now(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC)

    def missing_pull_secrets(self, vm: object) -> tuple[str, ...]:
        return ()

    def get_pod(self, namespace: str, name: str) -> dict[str, object]:
        return {"metadata": {"name": name, "uid": "planted-" + name, "labels": {}}}

    def put_status(self, record: VMRecord, status: VirtualMachineStatus) -> VMRecord:
        def degraded(raw: dict[str, object]) -> object:
            return next((cond for cond in raw.get("conditions") or []  # type: ignore[attr-defined]
                         if cond["type"] == "Degraded"), None)

        new = encode(status)
        if degraded(new) != degraded(self.raw["status"]):  # type: ignore[arg-type]
            self.degraded_writes += 1
        self.raw["status"] = new
        meta = self.raw["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)  # type: ignore[index]
        return self._record()

    def create_pod(self, namespace: str, manifest: object) -> None:
        raise ApiException(status=409, reason="AlreadyExists")


def test_a_vm_stuck_again_on_other_pod_names_does_not_rewrite_its_degraded_condition() -> None:
    fake = _PlantedNames()
    reconciler = shipped_reconciler(client.ApiClient(), events=_Events())  # type: ignore[arg-type]
    reconciler.ctx.reader = fake  # type: ignore[assignment]
    reconciler.ctx.writer = fake  # type: ignore[assignment]
    reconciler.cluster.create_pod = fake.create_pod  # type: ignore[assignment,method-assign]
    # A live namespace, read here: no GET leaves the test (it went to the default
    # client's host, http://localhost, and failed as no answer).
    reconciler.cluster.namespace_meta = (  # type: ignore[method-assign]
        lambda name: {"metadata": {"name": name}})
    authority = StaticAuthority(epoch=1, token=5)
    first = reconciler.reconcile("ns/vm", authority, direct_first=True)
    assert first.stuck == f"CreatePod{reasons.NOT_TAKING_EFFECT}", first
    assert fake.degraded_writes == 1
    planned = fake.raw["status"]["planSeq"]  # type: ignore[index]
    second = reconciler.reconcile("ns/vm", authority, direct_first=True)
    assert second.stuck == first.stuck, second
    assert fake.raw["status"]["planSeq"] > planned, "the second run planned other pods"  # type: ignore[index]
    assert fake.degraded_writes == 1, "stuck again for the same reason: no rewrite"
