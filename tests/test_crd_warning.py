"""An API server whose VirtualMachine CRD is older than the controller prunes the status
fields it does not know; the controller notices, from the answer to its own status
write, and says which and what is lost (neonvm/controller/crd_warning.py; review F3).
The look's field (``scaleLookPodUID``) is also covered end to end in
tests/test_reconcile_outcomes.py. Pure logic over a fake API server (``-m unit``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from kubernetes import client
from loguru import logger

from neonvm.api import types
from neonvm.api.types import Condition, VirtualMachineStatus
from neonvm.controller.crd_warning import pruned_fields
from neonvm.controller.step import write_status
from tests.support import shipped_reconciler
from tests.support.authority import StaticAuthority
from tests.support.fake_cluster import FakeCluster

pytestmark = pytest.mark.unit

NS, NAME = "ns", "vm"
SCALING = Condition(type="Scaling", status="False", reason="ScalingNeedsRestart",
                    message="refused", last_transition_time="2026-01-01T00:00:00Z")


class _PrunedExtraConditionsCluster(FakeCluster):
    """A CRD from before ``status.extraConditions``: the field is pruned from every write."""

    def put_status(self, record: Any, status: VirtualMachineStatus) -> Any:
        written = super().put_status(record, status)
        self.vms[(NS, NAME)]["status"].pop("extraConditions", None)
        return type(written).from_raw(dict(self.vms[(NS, NAME)]))


def test_a_status_write_whose_answer_lacks_a_field_it_sent_names_that_field() -> None:
    sent = VirtualMachineStatus(conditions=[SCALING], scale_look_pod_uid="uid-1")
    answer = {"status": {"extraConditions": [{"type": "Scaling"}],
                         "scaleLookPodUID": "uid-1"}}
    assert pruned_fields(sent, answer) == []
    assert pruned_fields(sent, {"status": {}}) == ["scaleLookPodUID", "extraConditions"]
    # Nothing sent, nothing to miss: NeonVM's own conditions go to status.conditions.
    available = Condition(type="Available", status="True", reason="RunnerRunning")
    assert pruned_fields(VirtualMachineStatus(conditions=[available]), {"status": {}}) == []


def test_a_crd_without_extra_conditions_is_warned_about_once_saying_what_is_lost() -> None:
    fake = _PrunedExtraConditionsCluster()
    fake.add_vm({"apiVersion": types.API_VERSION, "kind": types.KIND,
                 "metadata": {"name": NAME, "namespace": NS, "generation": 1,
                              "finalizers": [types.FINALIZER]},
                 "spec": {"restartPolicy": "Always", "enableAcceleration": False,
                          "guest": {"rootDisk": {"image": "img"}}},
                 "status": {}})
    reconciler = shipped_reconciler(client.ApiClient(), cluster=fake)
    authority = StaticAuthority(epoch=1, token=5)

    def refuses(vm: types.VirtualMachine) -> VirtualMachineStatus:
        return dataclasses.replace(vm.status, conditions=[SCALING],
                                   restart_count=vm.status.restart_count + 1)

    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(str(m)), level="WARNING",
                      filter=lambda r: "CRD is older" in r["message"])
    try:
        for _ in range(2):
            snap = reconciler.observe(f"{NS}/{NAME}", authority, direct=True)
            assert write_status(reconciler.ctx, f"{NS}/{NAME}", snap, refuses, authority,
                                logger)
    finally:
        logger.remove(sink)
    assert "extraConditions" not in fake.vms[(NS, NAME)]["status"]
    assert len(warnings) == 1, warnings
    assert "status.extraConditions" in warnings[0]
    assert "planned and refused again at every turn" in warnings[0]
    assert "scaleLookPodUID" not in warnings[0]
