"""A VM with its recorded scaling plan, for the token tests."""

from __future__ import annotations

from neonvm.api.millicpu import MilliCPU
from neonvm.api.types import (
    FINALIZER,
    CPURange,
    Guest,
    IntRange,
    PendingPod,
    VirtualMachine,
    VirtualMachineSpec,
    VirtualMachineStatus,
)

PLAN = PendingPod(name="vm-1", plan_seq=1, token=40, epoch=3, generation=1)


def scalable_vm() -> VirtualMachine:
    spec = VirtualMachineSpec(guest=Guest(
        cpus=CPURange(min=1, max=2, use=MilliCPU.parse(1)),
        memory_slots=IntRange(min=1, max=2, use=1), memory_slot_size="1Gi"))
    return VirtualMachine(name="vm", namespace="ns", uid="vm-uid", resource_version="5",
                          generation=1, spec=spec, finalizers=[FINALIZER],
                          status=VirtualMachineStatus(pending_pod=PLAN, plan_seq=1))


def recorded_vm() -> VirtualMachine:
    vm = scalable_vm()
    vm.status.scaling_token_secret = "vm-scaling-old"
    vm.status.scaling_token_secret_uid = "old-uid"
    return vm
