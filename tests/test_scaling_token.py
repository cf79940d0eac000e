"""The live-scaling token Secret around a pod's creation: a transient failure to create it
holds the pod back instead of building a pod that can never scale, a token that loses the
race to be recorded is never mounted, and a recorded token that is gone or was replaced
is replaced before the next pod (real Secrets on the session's API server). The first two
answer the Secret calls with a stand-in for :func:`neonvm.kube.request` (the API server
does not fail on demand, and ``RunnerScaling`` calls it directly, not through the
``Cluster`` seam that ``tests/support/fake_cluster.py`` stands in for). More real-server
tests are in ``tests/test_scaling_controller.py``."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from loguru import logger

from neonvm import kube
from neonvm.controller import actions as act
from neonvm.controller import performers
from neonvm.controller.cluster import VMRecord
from neonvm.controller.mutations import token_secret_mutation
from neonvm.controller.observe import make_snapshot
from neonvm.controller.scaling import RunnerScaling, token_secret_prefix
from tests.support import shipped_reconciler
from tests.support.authority import StaticAuthority
from tests.support.scaling_token import PLAN, recorded_vm, scalable_vm

LEASE = act.Fence(epoch=3, token=40)


class _Secrets:
    """The API server's Secrets (and pods) of one namespace, as raw REST requests: stands
    in for :func:`neonvm.kube.request`."""

    def __init__(self, status: int | None = None) -> None:
        self.status = status
        self.deleted: list[str] = []
        self.created: list[str] = []
        self.pods: list[str] = []

    def __call__(self, api: Any, method: str, path: str, body: Any = None,
                 **_: Any) -> dict[str, Any]:
        name = path.rsplit("/", 1)[-1]
        if (method, name) == ("POST", "secrets"):
            if self.status is not None:
                raise ApiException(status=self.status, reason="test")
            self.created.append("vm-scaling-abcde")
            return {"metadata": {"name": "vm-scaling-abcde", "uid": "secret-uid"}}
        if method == "DELETE" and "/secrets/" in path:
            self.deleted.append(name)
            return {}
        if method == "GET" and "/secrets/" in path:
            return self.read_secret(name)
        if (method, name) == ("POST", "pods"):
            self.pods.append(body["metadata"]["name"])
            raise AssertionError("no pod may be created here")
        raise AssertionError(f"unexpected request {method} {path}")

    def read_secret(self, name: str) -> dict[str, Any]:
        raise ApiException(status=404, reason="Not Found")


@pytest.mark.unit
@pytest.mark.parametrize(("status", "held_back"), [
    (500, True), (503, True), (429, True),  # transient: the pod waits for its token
    (403, False), (422, False),             # refused for good: the pod starts unscalable
])
def test_a_transient_failure_to_create_the_token_holds_the_pod_back(
        status: int, held_back: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    scaling = RunnerScaling(client.ApiClient())
    monkeypatch.setattr(kube, "request", _Secrets(status))
    if held_back:
        with pytest.raises(ApiException):
            scaling.create_token(scalable_vm())
    else:
        assert scaling.create_token(scalable_vm()) is None


@pytest.mark.unit
def test_a_token_that_loses_the_race_to_be_recorded_is_deleted_and_no_pod_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another leader recorded its Secret first: our write is declined. The pod must not
    be built from the VM we read (it names no Secret, so it would mount none); the step
    ends without effect, and the next read sees the recorded Secret."""
    core = _Secrets()
    monkeypatch.setattr(kube, "request", core)  # the scaling's and the cluster's calls
    reconciler = shipped_reconciler(client.ApiClient())
    scaling = RunnerScaling(client.ApiClient())
    reconciler.ctx.scaling = scaling
    monkeypatch.setattr(performers, "write_status", lambda *a, **k: None)
    vm = scalable_vm()
    snap = make_snapshot(VMRecord(vm=vm, raw={}), [], LEASE, direct=True)
    outcome = reconciler._perform("ns/vm", act.CreatePod(plan=PLAN), snap,
                                  StaticAuthority(epoch=3, token=40), logger)
    assert outcome == "precondition"
    assert core.pods == []
    assert core.deleted == core.created == ["vm-scaling-abcde"]


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
