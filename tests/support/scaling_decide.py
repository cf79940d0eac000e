"""VMs and observations for the scaling decision's unit tests."""

from __future__ import annotations

from neonvm.api.millicpu import MilliCPU
from neonvm.api.types import (
    FINALIZER,
    CPURange,
    Fence,
    Guest,
    IntRange,
    PendingScale,
    VirtualMachine,
    VirtualMachineSpec,
    VirtualMachineStatus,
)
from neonvm.controller import actions as act

UID = "0123456789abcdef"


POD = f"vm-{UID[:8]}-1"


LEASE = act.Fence(epoch=3, token=40)


def vm(cpus_use: float = 1, slots_use: int = 1, *, status_cpus: float = 1,
       status_slots: int = 1, phase: str = "Running", scale_seq: int = 0,
       pending: PendingScale | None = None, fence: Fence | None = None) -> VirtualMachine:
    spec = VirtualMachineSpec(guest=Guest(
        cpus=CPURange(min=1, max=2, use=MilliCPU.parse(cpus_use)),
        memory_slots=IntRange(min=1, max=2, use=slots_use), memory_slot_size="1Gi"))
    status = VirtualMachineStatus(
        phase=phase, pod_name=POD, pod_uid="uid-1", pod_ip="10.0.0.1",  # type: ignore[arg-type]
        node="n1", cpus=MilliCPU.parse(status_cpus), memory_size=f"{status_slots}Gi",
        scale_seq=scale_seq, pending_scale=pending, fence=fence)
    return VirtualMachine(name="vm", namespace="ns", uid=UID, resource_version="100",
                          generation=2, spec=spec, status=status, finalizers=[FINALIZER])


def running(uid: str = "uid-1") -> act.PodView:
    return act.PodView(name=POD, uid=uid, owner_uid=UID, gated=False, terminating=False,
                     phase="Running", node="n1", ip="10.0.0.1", fence=(3, 40))


def obs(v: VirtualMachine, *, runner: act.RunnerView | None = None, error: str | None = None,
        lease: act.Fence = LEASE, pod: act.PodView | None = None) -> act.Observation:
    return act.Observation(vm=v, pods=(pod or running(),), lease=lease, direct=False,
                         runner=runner, runner_error=error)


def scale_plan(cpus: int = 2, slots: int = 1, seq: int = 1, epoch: int = 3,
               token: int = 40) -> PendingScale:
    return PendingScale(cpus=cpus, memory_slots=slots, seq=seq, epoch=epoch, token=token,
                        pod_name=POD, pod_uid="uid-1", generation=2)
