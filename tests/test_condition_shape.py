"""The shape of a VM's conditions: NeonVM's in ``status.conditions``, ours beside them.

NeonVM's e2e asserts compare ``status.conditions`` as a whole list (kuttl's rules: the
same length), and NeonVM writes ``Available`` alone on a healthy VM. So the status as
written holds ``Available`` there, and ``Degraded`` while it is True (NeonVM writes it on
failures); every other condition of this controller goes to ``status.extraConditions``.
In memory one list holds them all. ``Ready`` is folded into ``Available``.
docs/neonvm-compat.md, "Conditions". The kuttl run over the real API server is in
tests/test_neonvm_e2e.py.
"""

from __future__ import annotations

import pytest

from neonvm.api import types
from neonvm.api.schema import decode, encode
from neonvm.api.types import Condition, VirtualMachineStatus
from neonvm.controller import actions as act
from neonvm.controller.conditions import conditions_mutation, desired_conditions
from neonvm.controller.observe import Snapshot
from neonvm.controller.reasons import AVAILABLE, DEGRADED, READY

pytestmark = pytest.mark.unit


def cond(type_: str, status: str = "True") -> Condition:
    return Condition(type=type_, status=status, reason="r", message="m")  # type: ignore[arg-type]


def test_the_written_status_keeps_neonvms_conditions_apart_from_ours() -> None:
    status = VirtualMachineStatus(conditions=[
        cond(AVAILABLE), cond("FieldsNotImplemented"), cond("AccelerationUnavailable"),
        cond(DEGRADED, "False"), cond("Scaling", "False")])
    wire = encode(status)
    assert [c["type"] for c in wire["conditions"]] == [AVAILABLE]
    assert [c["type"] for c in wire["extraConditions"]] == [
        "FieldsNotImplemented", "AccelerationUnavailable", DEGRADED, "Scaling"]
    # read back, one list again: code finds a condition by its type alone
    back = decode(VirtualMachineStatus, wire)
    assert back.conditions == status.conditions and back.extra_conditions == []
    assert encode(back) == wire


def test_degraded_is_in_neonvms_list_while_it_is_true() -> None:
    wire = encode(VirtualMachineStatus(conditions=[cond(AVAILABLE, "False"), cond(DEGRADED)]))
    assert [(c["type"], c["status"]) for c in wire["conditions"]] == [
        (AVAILABLE, "False"), (DEGRADED, "True")]
    assert "extraConditions" not in wire


def running_vm() -> types.VirtualMachine:
    return types.VirtualMachine.from_object({
        "metadata": {"name": "vm", "namespace": "ns", "uid": "u", "generation": 1},
        "spec": {"guest": {"cpus": {"min": 1, "max": 1, "use": 1},
                           "memorySlots": {"min": 1, "max": 1, "use": 1},
                           "memorySlotSize": "1Gi", "rootDisk": {"image": "i"}},
                 "enableSSH": True, "qmpManual": 20184},
        "status": {"phase": "Running", "podName": "p", "podUID": "pu",
                   "conditions": [{"type": READY, "status": "True", "reason": "RunnerRunning"}]},
    })


def test_a_healthy_vm_writes_available_alone_where_neonvm_does_and_drops_an_old_ready(
) -> None:
    vm = running_vm()
    pod = act.PodView(name="p", uid="pu", owner_uid="u", gated=False, terminating=False,
                      phase="Running", node="n1", ip="10.0.0.1")
    lease = act.Fence(epoch=1, token=1)
    snap = Snapshot(obs=act.Observation(vm=vm, pods=(pod,), lease=lease, direct=True),
                    record=None)
    updates = desired_conditions(snap, act.Done())
    assert READY not in {u.type for u in updates}
    new = conditions_mutation(updates, lease, now="2026-01-01T00:00:00Z")(vm)
    assert new is not None
    wire = encode(new)
    assert [(c["type"], c["status"], c["reason"]) for c in wire["conditions"]] == [
        (AVAILABLE, "True", "RunnerRunning")]
    # qmpManual is not built: said beside, not in NeonVM's list
    assert [(c["type"], c["status"]) for c in wire["extraConditions"]] == [
        ("FieldsNotImplemented", "True")]
