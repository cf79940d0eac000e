"""The live-scaling token Secret around a pod's creation: a transient failure to create it
holds the pod back instead of building a pod that can never scale, a token that loses the
race to be recorded is never mounted (both over the in-memory cluster,
``tests/support/fake_cluster.py``: the API server does not fail or race on demand), and a
recorded token that is gone or was replaced is replaced before the next pod (real Secrets
on the session's API server). More real-server tests are in
``tests/test_scaling_controller.py``."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from loguru import logger

from neonvm.api import types
from neonvm.api.schema import encode
from neonvm.api.types import VirtualMachine
from neonvm.controller import actions as act
from neonvm.controller.cluster import VMRecord
from neonvm.controller.mutations import token_secret_mutation
from neonvm.controller.observe import make_snapshot
from neonvm.controller.reconciler import Reconciler
from neonvm.controller.scaling import RunnerScaling, token_secret_prefix
from tests.support import shipped_reconciler
from tests.support.authority import StaticAuthority
from tests.support.fake_cluster import FakeCluster, api_error
from tests.support.scaling_token import PLAN, recorded_vm, scalable_vm

LEASE = act.Fence(epoch=3, token=40)


def _stored(fake: FakeCluster, vm: VirtualMachine) -> VMRecord:
    """``vm`` stored in ``fake`` (with its new resourceVersion), as the driver reads it."""
    raw = fake.add_vm({
        "apiVersion": types.API_VERSION, "kind": types.KIND,
        "metadata": {"name": vm.name, "namespace": vm.namespace, "uid": vm.uid,
                     "generation": vm.generation, "finalizers": list(vm.finalizers)},
        "spec": encode(vm.spec), "status": encode(vm.status)})
    return VMRecord.from_raw(copy.deepcopy(raw))


def _shipped_over(fake: FakeCluster) -> Reconciler:
    """The shipped reconciler whose API calls, the token Secret's included, go to ``fake``."""
    api = client.ApiClient()
    return shipped_reconciler(api, cluster=fake, scaling=RunnerScaling(api, secrets=fake))


@pytest.mark.unit
@pytest.mark.parametrize(("status", "held_back"), [
    (500, True), (503, True), (429, True),  # transient: the pod waits for its token
    (403, False), (422, False),             # refused for good: the pod starts unscalable
])
def test_a_transient_failure_to_create_the_token_holds_the_pod_back(
        status: int, held_back: bool) -> None:
    fake = FakeCluster()
    fake.fail("create_secret", api_error(status))
    scaling = RunnerScaling(client.ApiClient(), secrets=fake)
    vm = scalable_vm()
    if held_back:
        with pytest.raises(ApiException):
            scaling.create_token(vm)
    else:
        assert scaling.create_token(vm) is None
    assert fake.secrets == {}
    # Once the API server answers again, the token is created (the step's retry).
    made = scaling.create_token(vm)
    assert made is not None and made[0].startswith(token_secret_prefix(vm))
    assert fake.secrets[(vm.namespace, made[0])]["metadata"]["uid"] == made[1]


@pytest.mark.unit
def test_a_token_that_loses_the_race_to_be_recorded_is_deleted_and_no_pod_is_built() -> None:
    """Another leader recorded its Secret first: our write is declined. The pod must not
    be built from the VM we read (it names no Secret, so it would mount none); the step
    ends without effect, and the next read sees the recorded Secret."""
    fake = FakeCluster()
    record = _stored(fake, scalable_vm())
    vm = record.vm

    def other_leader_records_first(cluster: FakeCluster) -> None:
        stored = cluster.vms[(vm.namespace, vm.name)]
        stored["status"].update(scalingTokenSecret="vm-scaling-theirs",
                                scalingTokenSecretUID="their-uid")
        stored["metadata"]["resourceVersion"] = cluster.next_rv()

    fake.race("put_status", other_leader_records_first)
    snap = make_snapshot(record, [], LEASE, direct=True)
    outcome = _shipped_over(fake)._perform("ns/vm", act.CreatePod(plan=PLAN), snap,
                                           StaticAuthority(epoch=3, token=40), logger)
    assert outcome == "precondition"
    assert fake.count("create_secret") == fake.count("delete_secret") == 1
    assert fake.secrets == {}  # ours is deleted
    assert fake.count("create_pod") == 0 and fake.pods == {}
    status = fake.vms[(vm.namespace, vm.name)]["status"]
    assert status["scalingTokenSecretUID"] == "their-uid"


@pytest.mark.parametrize(("variant", "replaced"), [
    ("still there", False),  # the next pod mounts it
    ("gone", True),          # a new one, or no pod of this VM could scale again
    ("planted", True),       # replaced under its name by someone else: never used
])
def test_a_recorded_token_that_is_gone_is_replaced_before_the_next_pod(
        api: client.ApiClient, namespace: str, variant: str, replaced: bool) -> None:
    core = client.CoreV1Api(api)
    body = {"metadata": {"name": "vm-scaling-old"}, "stringData": {"token": "tok-123"}}
    recorded = core.create_namespaced_secret(namespace, body).metadata.uid
    if variant in ("gone", "planted"):
        core.delete_namespaced_secret("vm-scaling-old", namespace)
    if variant == "planted":
        core.create_namespaced_secret(namespace, body)
    vm = dataclasses.replace(recorded_vm(), namespace=namespace)
    vm.status.scaling_token_secret_uid = recorded
    made = RunnerScaling(api).create_token(vm)
    if not replaced:
        assert made is None
        return
    assert made is not None
    name, uid = made
    assert name.startswith(token_secret_prefix(vm)) and uid and uid != recorded, made


@pytest.mark.unit
def test_a_replacement_is_recorded_only_over_the_record_it_found_gone() -> None:
    vm = recorded_vm()
    replace = token_secret_mutation("vm-scaling-new", "new-uid", LEASE, replacing="old-uid")
    written = replace(vm)
    assert written is not None and written.scaling_token_secret_uid == "new-uid"
    # Someone else replaced it first: their record stands.
    vm.status.scaling_token_secret_uid = "other-new-uid"
    assert replace(vm) is None
    # A first record never overwrites one made meanwhile.
    assert token_secret_mutation("s", "u", LEASE)(vm) is None
