"""The ungate's own quorum list, beside the real-server tests in
``tests/test_reconcile_observe.py``.

Ungate is one of the decisions the loop takes from an observation built from a write's
answer (docs/protocol.md, "Observing from write responses"). That is safe only because
the ungate performer lists the VM's pods itself, after the commit was seen, and ungates
only if that list holds exactly the committed pod. These tests pin that list: an
observation that knows only the committed pod must never be enough to remove the gate.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from kubernetes import client
from loguru import logger

from neonvm.api.types import (
    SCHEDULING_GATE,
    PendingPod,
    VirtualMachine,
    VirtualMachineSpec,
    VirtualMachineStatus,
)
from neonvm.controller import actions as act
from neonvm.controller import performers
from neonvm.controller.action_table import ACTIONS
from neonvm.controller.cluster import VMRecord
from neonvm.controller.observe import Snapshot, make_snapshot
from neonvm.controller.reconciler import Reconciler
from neonvm.controller.step import Step
from tests.support import shipped_reconciler

pytestmark = pytest.mark.unit

LEASE = act.Fence(epoch=3, token=40)


class _Events:
    def record(self, vm: VirtualMachine, reason: str, message: str,
               warning: bool = False) -> None:
        pass


def _pod(name: str, uid: str, *, gated: bool) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": uid, "resourceVersion": "7",
                         "namespace": "ns", "labels": {"vm.neon.tech/name": "a"},
                         "ownerReferences": [{"apiVersion": "vm.neon.tech/v1",
                                              "kind": "VirtualMachine", "name": "a",
                                              "uid": "vm-uid", "controller": True}]},
            "spec": {"schedulingGates": [{"name": SCHEDULING_GATE}] if gated else []},
            "status": {"phase": "Pending" if gated else "Running"}}


class _Reader:
    """The direct reader's pod list, as the API server would answer it now."""

    def __init__(self, pods: list[dict[str, Any]], vm: VirtualMachine | None = None) -> None:
        self.pods = pods
        self.vm = vm
        self.lists = 0
        self.vm_reads = 0

    def get_vm(self, namespace: str, name: str) -> VMRecord | None:
        self.vm_reads += 1
        return VMRecord(vm=self.vm, raw={}) if self.vm is not None else None

    def list_pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        self.lists += 1
        return list(self.pods)

    def with_committed(self, namespace: str, listed: list[dict[str, Any]], name: str,
                       uid: str) -> list[dict[str, Any]]:
        return listed


class _Patches:
    def __init__(self) -> None:
        self.patched: list[str] = []
        self.api_client = client.ApiClient()

    def ungate_pod(self, namespace: str, name: str, *, uid: str, resource_version: str,
                   gate_index: int) -> dict[str, Any]:
        self.patched.append(name)
        return _pod(name, "y-uid", gated=False)


def _committed_vm() -> VirtualMachine:
    return VirtualMachine(
        name="a", namespace="ns", uid="vm-uid", resource_version="9", generation=1,
        spec=VirtualMachineSpec(),
        status=VirtualMachineStatus(pod_name="a-y", pod_uid="y-uid", plan_seq=2,
                                    pending_pod=PendingPod(name="a-y", plan_seq=2,
                                                           token=40, epoch=3,
                                                           generation=1)))



def ungate(reconciler: Reconciler, snap: Snapshot) -> str:
    """The shipped Ungate performer on the committed pod ``a-y`` (it checks no authority:
    the driver does, before it)."""
    step = Step("ns/a", act.Ungate(name="a-y", uid="y-uid"), snap, None,  # type: ignore[arg-type]
                logger, ACTIONS[act.Ungate])
    return performers.ungate(reconciler.ctx, step)

@pytest.mark.parametrize(("listed", "patched"), [
    # Only the committed pod exists: the gate comes off.
    ([_pod("a-y", "y-uid", gated=True)], True),
    # A live pod Z appeared after the observation's list (a stale worker ungated it):
    # the answer-built observation cannot know Z; the performer's own list sees it.
    ([_pod("a-y", "y-uid", gated=True), _pod("a-z", "z-uid", gated=False)], False),
    # The committed pod was replaced under its name since (another uid): not ours.
    ([_pod("a-y", "other-uid", gated=True)], False),
])
def test_the_ungate_trusts_only_its_own_list_never_the_observation_it_was_decided_from(
        listed: list[dict[str, Any]], patched: bool) -> None:
    vm = _committed_vm()
    # The observation built from the commit's answer: it knows the committed pod alone.
    snap = make_snapshot(VMRecord(vm=vm, raw={}), [_pod("a-y", "y-uid", gated=True)],
                         LEASE, direct=True, from_write=True)
    reconciler = shipped_reconciler(client.ApiClient(), events=_Events())  # type: ignore[arg-type]
    reader = _Reader(listed)
    core = _Patches()
    reconciler.ctx.reader = reader  # type: ignore[assignment]
    reconciler.cluster.ungate_pod = core.ungate_pod  # type: ignore[method-assign]
    outcome = ungate(reconciler, snap)
    assert reader.lists == 1, "the ungate must list the pods itself, after the commit"
    assert (core.patched == ["a-y"]) is patched, (core.patched, outcome)
    assert (outcome == "done") is patched, outcome


def _now(vm: VirtualMachine, **changes: Any) -> VirtualMachine:
    status = changes.pop("status", vm.status)
    return dataclasses.replace(vm, status=status, **changes)


@pytest.mark.parametrize(("server_vm", "patched"), [
    # The VM as the API server holds it now still commits that pod: the gate comes off.
    (lambda vm: vm, True),
    # Its deletion has not reached the cache yet: no guest is started for it.
    (lambda vm: _now(vm, deletion_timestamp="2026-12-04T04:00:00Z"), False),
    # It is gone, or re-created under its name (its finalizer removed by hand).
    (lambda vm: None, False),
    (lambda vm: _now(vm, uid="new-vm-uid"), False),
    # It has committed another pod since (a restart the cache has not seen).
    (lambda vm: _now(vm, status=dataclasses.replace(vm.status, pod_name="a-w",
                                                     pod_uid="w-uid")), False),
])
def test_an_ungate_decided_from_the_cache_reads_the_vm_after_its_list(
        server_vm: Any, patched: bool) -> None:
    """The cache's VM may be behind the pods just listed: a decision taken from it is
    checked against the VM read after the list (docs/protocol.md, step 8)."""
    vm = _committed_vm()
    snap = make_snapshot(VMRecord(vm=vm, raw={}), [_pod("a-y", "y-uid", gated=True)],
                         LEASE, direct=False)
    reconciler = shipped_reconciler(client.ApiClient(), events=_Events())  # type: ignore[arg-type]
    reader = _Reader([_pod("a-y", "y-uid", gated=True)], server_vm(vm))
    core = _Patches()
    reconciler.ctx.reader = reader  # type: ignore[assignment]
    reconciler.cluster.ungate_pod = core.ungate_pod  # type: ignore[method-assign]
    outcome = ungate(reconciler, snap)
    assert (reader.lists, reader.vm_reads) == (1, 1)
    assert (core.patched == ["a-y"]) is patched, (core.patched, outcome)


@pytest.mark.parametrize("source", ["direct", "our VM write"])
def test_an_ungate_decided_from_a_fresh_vm_does_not_read_it_again(source: str) -> None:
    """A new VM's ungate follows the commit, whose answer is the VM as stored: one list."""
    vm = _committed_vm()
    snap = make_snapshot(VMRecord(vm=vm, raw={}), [_pod("a-y", "y-uid", gated=True)],
                         LEASE, direct=source == "direct", from_write=source != "direct",
                         vm_written=source != "direct")
    reconciler = shipped_reconciler(client.ApiClient(), events=_Events())  # type: ignore[arg-type]
    reader = _Reader([_pod("a-y", "y-uid", gated=True)], None)
    core = _Patches()
    reconciler.ctx.reader = reader  # type: ignore[assignment]
    reconciler.cluster.ungate_pod = core.ungate_pod  # type: ignore[method-assign]
    ungate(reconciler, snap)
    assert (reader.lists, reader.vm_reads, core.patched) == (1, 0, ["a-y"])
