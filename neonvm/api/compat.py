"""NeonVM compatibility: which accepted spec fields this controller does not act on.

The CRD accepts every field of NeonVM's v1 VirtualMachine spec, so NeonVM manifests
apply unchanged. Fields this controller (with its runner) does not implement are still
accepted, but never silently: :func:`unimplemented_fields` names every one a VM *uses*
(set to a value that asks for behaviour NeonVM has and this controller lacks), and the
controller reports them in the ``FieldsNotImplemented`` condition and a Warning event.

A field counts as used only when its value asks for something: ``extraNetwork: {enable:
false}`` asks for nothing NeonVM would do, and is not reported.
docs/neonvm-compat.md has the full table (implemented, accepted and reported).

:func:`configured_size` is what ``status.cpus`` and ``status.memorySize`` report: the
size the runner pod boots with, read from the spec when the pod is committed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from neonvm.api.millicpu import MilliCPU
from neonvm.api.types import VirtualMachineSpec

CONDITION = "FieldsNotImplemented"
"""Condition type naming the unimplemented fields a VM uses (True while there are any)."""
REASON_USED = "NeonVMFieldsNotImplemented"
REASON_NONE = "AllFieldsImplemented"


@dataclass(frozen=True)
class Unimplemented:
    """A NeonVM field the controller accepts but does not act on, and when a VM uses it."""

    path: str
    used: Callable[[VirtualMachineSpec], bool]
    why: str


def _disk_flag(name: str) -> Callable[[VirtualMachineSpec], bool]:
    def used(spec: VirtualMachineSpec) -> bool:
        for disk in spec.disks or []:
            source = disk.empty_disk or {}
            if name == "watch" and disk.watch:
                return True
            if name != "watch" and source.get(name):
                return True
        return False

    return used


def _own_kernel(spec: VirtualMachineSpec) -> bool:
    """The guest boots its own ``kernelImage``, so the runner's init (which applies
    ``settings.sysctl`` and turns the swap disk on) does not run. Without one, a bare ext4
    root disk (NeonVM's vm-builder images) boots the runner's kernel and init."""
    return bool(spec.guest.kernel_image)


def _swap(spec: VirtualMachineSpec) -> bool:
    settings = spec.guest.settings or {}
    info = settings.get("swapInfo")
    return settings.get("swap") is not None or (
        isinstance(info, dict) and info.get("size") is not None)


UNIMPLEMENTED: tuple[Unimplemented, ...] = (
    Unimplemented("spec.qmpManual", lambda s: s.qmp_manual is not None,
                  "the runner opens no second QMP port"),
    Unimplemented("spec.targetArchitecture", lambda s: s.target_architecture is not None,
                  "the runner pod gets no kubernetes.io/arch node affinity"),
    Unimplemented("spec.extraInitContainers", lambda s: bool(s.extra_init_containers),
                  "the runner pod gets no extra init containers"),
    Unimplemented("spec.initScript", lambda s: bool(s.init_script),
                  "the runner runs no init script"),
    Unimplemented("spec.extraNetwork",
                  lambda s: s.extra_network is not None and bool(s.extra_network.enable),
                  "no Multus interface is attached"),
    Unimplemented("spec.tls", lambda s: s.tls is not None,
                  "no certificate is provisioned"),
    Unimplemented("spec.enableNetworkMonitoring", lambda s: bool(s.enable_network_monitoring),
                  "no network monitoring runs"),
    Unimplemented("spec.guest.memhpAutoMovableRatio",
                  lambda s: (s.guest.memhp_auto_movable_ratio is not None
                             and s.guest.memory_provider == "DIMMSlots"),
                  "with memoryProvider: DIMMSlots the guest kernel's movable ratio is not "
                  "set (DIMMs are onlined movable or not by boot memory)"),
    Unimplemented("spec.guest.settings.sysctl",
                  lambda s: _own_kernel(s) and bool((s.guest.settings or {}).get("sysctl")),
                  "with guest.kernelImage the runner's init does not run: the sysctls reach "
                  "the guest only in its fw_cfg config, for its own init to apply"),
    Unimplemented("spec.guest.settings.swap",
                  lambda s: _own_kernel(s) and _swap(s),
                  "with guest.kernelImage the runner's init does not run: the swap disk is "
                  "attached unformatted, for the guest's own init to turn on"),
    Unimplemented("spec.guest.rootDisk.execute", lambda s: bool(s.guest.root_disk.execute),
                  "the runner runs no commands in the guest"),
    Unimplemented("spec.disks[].watch", _disk_flag("watch"),
                  "disk contents are read once, at boot"),
    Unimplemented("spec.disks[].emptyDisk.discard", _disk_flag("discard"),
                  "the guest mounts the disk without discard"),
    Unimplemented("spec.disks[].emptyDisk.enableQuotas", _disk_flag("enableQuotas"),
                  "the guest mounts the disk without prjquota"),
)


def unimplemented_fields(spec: VirtualMachineSpec) -> list[str]:
    """The unimplemented NeonVM fields ``spec`` uses, in a stable order."""
    return [u.path for u in UNIMPLEMENTED if u.used(spec)]


def unimplemented_message(spec: VirtualMachineSpec) -> str:
    """One line for the condition and the event; empty when nothing is used."""
    used = [u for u in UNIMPLEMENTED if u.used(spec)]
    if not used:
        return ""
    return ("accepted but not implemented by this controller: "
            + "; ".join(f"{u.path} ({u.why})" for u in used))


def configured_size(spec: VirtualMachineSpec) -> tuple[MilliCPU, str | None]:
    """(status.cpus, status.memorySize) for a runner pod built from ``spec``.

    The vCPU amount is ``cpus.use`` (or ``min``) as written; memory is
    ``memorySlots.use`` (or ``min``) times ``memorySlotSize``, None if the slot size is
    not a quantity the runner can read.
    """
    from neonvm.api.quantity import QuantityError, format_bytes, parse_bytes

    guest = spec.guest
    try:
        memory: str | None = format_bytes(parse_bytes(guest.memory_slot_size)
                                          * guest.memory_slots.current)
    except QuantityError:
        memory = None
    return guest.cpus.current, memory
