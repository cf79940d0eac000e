"""The QEMU command line for a VM spec: a pure function, so every mapping is unit-tested.

:func:`build_launch_plan` turns a :class:`VirtualMachineSpec` plus a :class:`LaunchContext`
(what the host decided: binary, accelerator, directories) into a :class:`LaunchPlan`: the
argv, the disk files to create before launch, the files that must exist, and the JSON
handed to the guest. It reads no file and starts nothing; :mod:`neonvm.runner.disks`
performs the plan's side effects.

Guaranteed for every plan: a QMP unix socket in the work dir (and, with ``spec.qmp``, a
second QMP monitor on another unix socket: never a TCP port, see ``QMP_SPEC_SOCKET_NAME``),
the guest's frames to its user-mode network pass the runner's filter first
(:mod:`neonvm.runner.guestnet`: the runner's loopback is closed to the guest), the serial console on
QEMU's stdout, ``-nodefaults -display none -no-reboot`` (so a guest reboot ends QEMU,
and the restart policy decides what happens next), and a :class:`SpecError` with the
offending field for any spec that cannot be run (min > max, nothing to boot, a disk with
no or two sources, a port clash). Not guaranteed: that the guest kernel has the drivers
for the devices (virtio-blk, virtio-net, ACPI button); that is the image's business.

The mapping (docs/runner.md has the full table):

* CPUs: ``-smp cpus=ceil(use),maxcpus=ceil(max)``; fractions of a core are the pod's
  cgroup limit, not QEMU's.
* Memory: ``min`` slots are boot memory and ``maxmem=max * slotSize``. With ``max > min``
  (``memoryProvider`` unset or ``VirtioMem``, NeonVM's only mechanism) one virtio-mem device
  (``vm0``, backend ``vmem0``, NeonVM's ids) of ``(max - min) * slotSize`` with
  ``requested-size=(use - min) * slotSize``; :mod:`neonvm.runner.scaling` moves
  ``requested-size`` live. The kernel is told NeonVM's ``memhp_default_state=online
  memory_hotplug.online_policy=auto-movable memory_hotplug.auto_movable_ratio=<ratio>``.
  ``memoryProvider: DIMMSlots``: ``slots=max-min`` ACPI DIMM slots, ``use - min`` DIMMs
  plugged at start (ids ``dimm-slot<i>``/``mem-slot<i>``), for a guest kernel without
  virtio_mem; ``memhp_default_state=online_movable`` (``online`` with less than 512 MiB
  of boot memory, see :func:`memory_online_state`). docs/runner.md, "Mechanism".
* Root disk: a qcow2 overlay in the work dir backed by the image (the image stays
  untouched; ``rootDisk.size`` grows the overlay).
* Extra disks: ``emptyDisk`` → a fresh ext4 raw image; ``configMap``/``secret`` → a
  read-only ext4 image of the files the pod mounts at ``<disks dir>/<name>``; ``tmpfs``
  → no device, the guest mounts a tmpfs (described in the guest config).
* Guest config (command, args, env, ports, disks, ready marker) → fw_cfg
  ``opt/vm.neon.tech/config`` as JSON.
* Ports → user-mode networking with one ``hostfwd`` per port, behind the runner's filter
  (``filter-redirector`` on the guest's outgoing frames, two unix sockets in the work dir).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from neonvm.api.quantity import QuantityError, format_bytes, parse_bytes
from neonvm.api.types import CPURange, Disk, IntRange, VirtualMachineSpec
from neonvm.runner.errors import SpecError
from neonvm.runner.guestboot import (
    BOOT_FW_CFG_NAME,
    BOOT_SCRIPT_NAME,
    SWAP_SERIAL,
    boot_script,
    swap_bytes,
)
from neonvm.runner.guestnet import DEFAULT_GUEST_NETWORK
from neonvm.runner.host import Accel
from neonvm.runner.initramfs import RunnerKernel
from neonvm.runner.runtimedisk import (
    GUEST_INIT,
    RUNTIME_DISK_NAME,
    RUNTIME_SERIAL,
    SSH_DISK_NAME,
    SSH_LABEL,
    iso9660_image,
    runtime_files,
)

MIB = 1 << 20
QMP_SOCKET_NAME = "qmp.sock"
AGENT_SOCKET_NAME = "agent.sock"
AGENT_PORT_NAME = "vm.neon.tech.agent"
"""The virtio-serial port the guest agent reads commands from (SysfsScaling)."""
CpuScalingMode = Literal["QmpScaling", "SysfsScaling"]
MemoryProvider = Literal["VirtioMem", "DIMMSlots"]
VIRTIO_MEM_ID = "vm0"
"""The virtio-mem device's id (NeonVM's, so a tool on ``spec.qmp`` finds it as there)."""
VIRTIO_MEM_BACKEND_ID = "vmem0"
VIRTIO_MEM_BLOCK_BYTES = 8 * (1 << 20)
"""virtio-mem's block size, NeonVM's: the slot size must be a multiple of it."""
DEFAULT_AUTO_MOVABLE_RATIO = "301"
"""``memory_hotplug.auto_movable_ratio`` when ``memhpAutoMovableRatio`` is unset: NeonVM's
controller default (``--memhp-auto-movable-ratio``)."""
ACPI_MAX_DIMM_SLOTS = 256
"""QEMU refuses more DIMM slots than this (``unsupported amount of memory slots``)."""
GUEST_CONFIG_NAME = "guest-config.json"
FW_CFG_NAME = "opt/vm.neon.tech/config"
ROOT_OVERLAY_NAME = "rootdisk.qcow2"
MAX_UNIX_SOCKET_PATH = 107
"""sun_path holds 108 bytes including the terminating NUL."""
VIRTIO_SERIAL_MAX = 20
"""virtio-blk serial numbers are at most 20 bytes."""
QMP_SPEC_SOCKET_NAME = "qmp-spec.sock"
"""The second QMP monitor that ``spec.qmp`` asks for: a unix socket in the work dir, not the
TCP port NeonVM opens. QMP is unauthenticated and can make QEMU read, write and execute
in the runner's container. A TCP port on 127.0.0.1 was reachable from the guest itself
(QEMU's user networking maps the guest's 10.0.2.2 to the container's loopback), so
``spec.qmp`` is accepted for NeonVM manifests and opens no TCP port (docs/runner.md)."""
GUEST_FRAMES_SOCKET_NAME = "net-from-guest.sock"
"""QEMU's ``filter-redirector`` writes each frame the guest sends here (the runner reads)."""
PASSED_FRAMES_SOCKET_NAME = "net-to-slirp.sock"
"""The runner writes the frames it lets through here; QEMU hands them to slirp."""


@dataclass(frozen=True)
class LaunchContext:
    """What the host decided; everything :func:`build_launch_plan` needs besides the spec."""

    qemu_binary: str
    accel: Accel
    work_dir: Path
    runner_port: int
    disks_dir: Path = Path("/vm/disks")
    writable_disk_dirs: frozenset[str] = frozenset()
    """Names of disks whose ``<disks dir>/<name>`` exists and is writable: an emptyDisk
    image goes there (the pod's emptyDir, sized for it), else into the work dir."""
    listen_address: str = "0.0.0.0"
    """Host address for guest port forwards."""
    root_disk_override: Path | None = None
    vm_name: str = "vm"
    vm_namespace: str = ""
    ready_marker: str = ""
    cpu_scaling_mode: CpuScalingMode = "QmpScaling"
    """QmpScaling: vCPUs are hot-plugged; SysfsScaling: all ``max`` vCPUs at boot, ``use``
    online (kernel ``maxcpus=``), the guest agent onlines/offlines them on request."""
    runner_kernel: RunnerKernel | None = None
    """The runner's own kernel and initramfs, used when the spec names no kernel. The
    runner sets it only for a root disk that is a bare filesystem
    (:mod:`neonvm.runner.guestboot`); otherwise firmware boots the root disk."""
    guest_init: bool = False
    """With the runner's kernel: the root disk carries vm-builder's ``/neonvm/bin/init``.
    The guest then boots that init (``init=/neonvm/bin/init``) with a runtime disk
    (:mod:`neonvm.runner.runtimedisk`), and the console is ``ttyS1`` as in NeonVM."""
    ssh_authorized_keys: bytes | None = None
    """The VM's SSH public key (``enableSSH``), given to a vm-builder guest on a disk of
    its own (:data:`~neonvm.runner.runtimedisk.SSH_LABEL`); None: no key."""


@dataclass(frozen=True)
class CpuLayout:
    vcpus: int
    max_vcpus: int


@dataclass(frozen=True)
class MemoryLayout:
    slot_bytes: int
    min_slots: int
    max_slots: int
    use_slots: int

    @property
    def boot_bytes(self) -> int:
        return self.slot_bytes * self.min_slots

    @property
    def current_bytes(self) -> int:
        return self.slot_bytes * self.use_slots

    @property
    def max_bytes(self) -> int:
        return self.slot_bytes * self.max_slots

    @property
    def hotplug_slots(self) -> int:
        return self.max_slots - self.min_slots

    @property
    def hotplug_bytes(self) -> int:
        """The virtio-mem device's size: everything above boot memory."""
        return self.slot_bytes * self.hotplug_slots

    @property
    def requested_bytes(self) -> int:
        """The virtio-mem device's ``requested-size`` at boot (``use`` above ``min``)."""
        return self.slot_bytes * (self.use_slots - self.min_slots)


DiskKind = Literal["root-overlay", "empty", "content", "blank", "file"]
"""blank: a sparse raw file holding only a swap signature (the swap disk; label
``swapdisk``, the guest runs mkswap); file: the bytes in ``contents`` (the runtime disk)."""


@dataclass(frozen=True)
class DiskImage:
    """A disk file the runner creates before QEMU starts."""

    name: str
    kind: DiskKind
    path: Path
    size_bytes: int | None = None
    """Virtual size; None for an overlay of the backing image's size, or for a content
    image sized from its files at preparation."""
    backing_file: Path | None = None
    """root-overlay: the image it is layered on (format detected at preparation)."""
    source_dir: Path | None = None
    """content: the directory whose files the image holds."""
    label: str | None = None
    """ext4 volume label (at most 16 bytes)."""
    contents: bytes | None = None
    """file: the image's bytes, made by the plan (the vm-builder runtime disk)."""


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to start QEMU for one spec."""

    argv: tuple[str, ...]
    qmp_socket: Path
    disk_images: tuple[DiskImage, ...]
    required_files: tuple[tuple[str, Path], ...]
    """(what, path) pairs that must exist before launch: kernel, initrd, root image."""
    required_dirs: tuple[tuple[str, Path], ...]
    """(what, path) pairs: the configMap/secret contents the pod mounts."""
    guest_config: Mapping[str, Any]
    guest_config_path: Path
    cpus: CpuLayout
    memory: MemoryLayout
    kernel_cmdline: str | None = None
    forwarded_ports: tuple[int, ...] = field(default_factory=tuple)
    cpu_scaling_mode: CpuScalingMode = "QmpScaling"
    agent_socket: Path | None = None
    """SysfsScaling: the host end of the guest agent's virtio-serial port."""
    guest_frames_socket: Path | None = None
    """Where QEMU sends the guest's frames for the runner's filter (``guestnet``)."""
    passed_frames_socket: Path | None = None
    """Where the runner sends back the frames it lets through to slirp."""
    qmp_spec_socket: Path | None = None
    """``spec.qmp``: the second QMP monitor's unix socket."""
    boot: Literal["spec kernel", "runner kernel", "firmware"] = "spec kernel"
    """What boots the guest: ``guest.kernelImage``, the runner's kernel, or the firmware."""
    boot_script: str | None = None
    """Runner kernel only: the shell its init sources (fw_cfg ``opt/vm.neon.tech/boot.sh``)."""
    boot_script_path: Path | None = None
    guest_init: str | None = None
    """Runner kernel only: the root disk's own init the guest hands over to
    (vm-builder's ``/neonvm/bin/init``); None: the runner's init runs the command."""
    memory_provider: MemoryProvider = "VirtioMem"
    """How memory above ``min`` is plugged (``spec.guest.memoryProvider``)."""


def cpu_layout(cpus: CPURange) -> CpuLayout:
    """vCPUs at boot and at most; ``SpecError`` unless 0 < min <= use <= max."""
    for name in ("min", "max", "use"):
        value = getattr(cpus, name)
        # The shared decoder does not type-check float fields: "two" would get this far.
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise SpecError(f"guest.cpus.{name}: expected a number, got {value!r}")
    if cpus.min <= 0 or cpus.max <= 0:
        raise SpecError("guest.cpus: min and max must be positive")
    if cpus.min > cpus.max:
        raise SpecError(f"guest.cpus: min {cpus.min:g} exceeds max {cpus.max:g}")
    use = cpus.current
    if not cpus.min <= use <= cpus.max:
        raise SpecError(f"guest.cpus: use {use:g} is outside [{cpus.min:g}, {cpus.max:g}]")
    return CpuLayout(vcpus=use.rounded_up(), max_vcpus=cpus.max.rounded_up())


def memory_layout(slots: IntRange, slot_size: object) -> MemoryLayout:
    """Memory slots; ``SpecError`` unless 0 < min <= use <= max and the slot size is whole MiB."""
    try:
        slot_bytes = parse_bytes(slot_size)
    except QuantityError as exc:
        raise SpecError(f"guest.memorySlotSize: {exc}") from None
    if slot_bytes <= 0 or slot_bytes % MIB:
        raise SpecError(f"guest.memorySlotSize: {slot_size!r} must be a positive whole "
                        "number of MiB")
    if slots.min <= 0:
        raise SpecError("guest.memorySlots: min must be positive")
    if slots.min > slots.max:
        raise SpecError(f"guest.memorySlots: min {slots.min} exceeds max {slots.max}")
    use = slots.current
    if not slots.min <= use <= slots.max:
        raise SpecError(f"guest.memorySlots: use {use} is outside [{slots.min}, {slots.max}]")
    return MemoryLayout(slot_bytes=slot_bytes, min_slots=slots.min, max_slots=slots.max,
                        use_slots=use)


def qemu_value(value: str | Path) -> str:
    """``value`` safe inside a QEMU ``key=value,...`` option: commas are doubled."""
    return str(value).replace(",", ",,")


def _mib(n: int) -> str:
    return f"{n // MIB}M"


def _disk_source(disk: Disk) -> str:
    sources = [name for name, value in (("emptyDisk", disk.empty_disk),
                                        ("configMap", disk.config_map),
                                        ("secret", disk.secret),
                                        ("tmpfs", disk.tmpfs)) if value is not None]
    if len(sources) != 1:
        got = ", ".join(sources) if sources else "none"
        raise SpecError(f"disks[{disk.name}]: exactly one of emptyDisk, configMap, secret, "
                        f"tmpfs is expected, got {got}")
    return sources[0]


def _optional_size(disk: Disk, source: Mapping[str, Any], required: bool) -> int | None:
    raw = source.get("size")
    if raw is None:
        if required:
            raise SpecError(f"disks[{disk.name}]: emptyDisk.size is required")
        return None
    try:
        size = parse_bytes(raw)
    except QuantityError as exc:
        raise SpecError(f"disks[{disk.name}]: size: {exc}") from None
    if size < MIB:
        raise SpecError(f"disks[{disk.name}]: size {raw!r} is below 1Mi")
    return size


MOVABLE_MIN_BOOT_BYTES = 512 * MIB
"""Boot memory from which plugged DIMMs go to ZONE_MOVABLE (see memory_online_state)."""


def memory_provider(provider: object) -> MemoryProvider:
    """``spec.guest.memoryProvider``: unset is ``VirtioMem`` (NeonVM's only mechanism)."""
    if provider is None or provider == "VirtioMem":
        return "VirtioMem"
    if provider == "DIMMSlots":
        return "DIMMSlots"
    raise SpecError(f"guest.memoryProvider: {provider!r} is neither VirtioMem nor DIMMSlots")


def check_memory_provider(memory: MemoryLayout, provider: MemoryProvider) -> None:
    """``SpecError`` for a layout the provider cannot plug: a slot size that is no whole
    number of virtio-mem blocks (NeonVM's rule), or more DIMM slots than QEMU takes."""
    if not memory.hotplug_slots:
        return
    if provider == "VirtioMem" and memory.slot_bytes % VIRTIO_MEM_BLOCK_BYTES:
        raise SpecError(f"guest.memorySlotSize: {format_bytes(memory.slot_bytes)} is no "
                        f"multiple of virtio-mem's block size "
                        f"({format_bytes(VIRTIO_MEM_BLOCK_BYTES)})")
    if provider == "DIMMSlots" and memory.hotplug_slots > ACPI_MAX_DIMM_SLOTS:
        raise SpecError(f"guest.memorySlots: max - min = {memory.hotplug_slots} DIMM slots; "
                        f"QEMU takes at most {ACPI_MAX_DIMM_SLOTS} (memoryProvider: "
                        "VirtioMem has no such limit)")


def movable_ratio(ratio: str | None) -> str:
    """``memhpAutoMovableRatio`` (a whole number of percent), else NeonVM's default."""
    if ratio is None or ratio == "":
        return DEFAULT_AUTO_MOVABLE_RATIO
    if not ratio.isascii() or not ratio.isdigit():
        raise SpecError(f"guest.memhpAutoMovableRatio: {ratio!r} is not a whole number")
    return ratio


def memory_online_state(memory: MemoryLayout) -> str:
    """How the guest kernel onlines plugged DIMMs: ``online_movable`` or ``online``.

    In ZONE_MOVABLE only movable pages go, so the guest can always offline the DIMM again
    and QEMU can unplug it. But the kernel's own allocations must then fit in the boot
    memory: with 128 MiB of boot memory and a movable DIMM plugged at start, the test
    guest's kernel ran out of memory during boot. Below ``MOVABLE_MIN_BOOT_BYTES`` of boot
    memory, DIMMs are onlined in the kernel zone (``online``), where an unplug can fail
    because of unmovable pages. ``appendKernelCmdline`` can override either.
    """
    return "online_movable" if memory.boot_bytes >= MOVABLE_MIN_BOOT_BYTES else "online"


def kernel_cmdline(has_root_disk: bool, memory: MemoryLayout, append: str | None,
                   online_cpus: int | None = None, guest_init: str | None = None,
                   provider: MemoryProvider = "VirtioMem",
                   auto_movable_ratio: str = DEFAULT_AUTO_MOVABLE_RATIO) -> str:
    """The kernel command line: console on the serial port, then the user's additions.

    ``panic=-1`` turns a guest panic into a reboot, which ``-no-reboot`` turns into QEMU
    exiting, so a crash ends the runner with a non-zero code instead of a hung guest.
    The user's ``appendKernelCmdline`` comes last, so it can override any of these.
    """
    parts = ["console=ttyS0", "panic=-1"]
    if guest_init is not None:
        # NeonVM's line for vm-builder images: the console is the second serial port (the
        # image's agetty owns ttyS0); the runner's initramfs honours init= and root=.
        parts = ["console=ttyS1", "panic=-1", f"init={guest_init}", "loglevel=6"]
    if has_root_disk or guest_init is not None:
        parts += ["root=/dev/vda", "rw"]
    if memory.max_slots > memory.min_slots:
        # The hotplug region lies above 4 GiB, so the kernel reserves swiotlb's 64 MiB
        # bounce buffer at boot, for devices that cannot reach that high. Every device
        # here is virtio (no DMA limit): with 128 MiB of boot memory that buffer left the
        # test guest's kernel out of memory during boot ("System is deadlocked on memory").
        parts.append("swiotlb=noforce")
    if memory.max_slots > memory.min_slots and provider == "VirtioMem":
        # NeonVM's line: the kernel onlines what virtio-mem plugs, each block in
        # ZONE_MOVABLE while movable memory stays within the ratio of the kernel zones.
        parts += ["memhp_default_state=online", "memory_hotplug.online_policy=auto-movable",
                  f"memory_hotplug.auto_movable_ratio={auto_movable_ratio}"]
    elif memory.max_slots > memory.min_slots:
        parts.append(f"memhp_default_state={memory_online_state(memory)}")
    if online_cpus is not None:
        # SysfsScaling: every vCPU is present, only ``use`` are brought up at boot; the
        # rest are onlined later through sysfs. The guest agent sees the mode here.
        parts += [f"maxcpus={online_cpus}", "neonvm.cpu_scaling=sysfs"]
    if append:
        parts.append(append.strip())
    return " ".join(p for p in parts if p)


def build_launch_plan(spec: VirtualMachineSpec, ctx: LaunchContext) -> LaunchPlan:
    """The QEMU invocation for ``spec``; raises :class:`SpecError` if it cannot be run."""
    guest = spec.guest
    cpus = cpu_layout(guest.cpus)
    memory = memory_layout(guest.memory_slots, guest.memory_slot_size)
    provider = memory_provider(guest.memory_provider)
    check_memory_provider(memory, provider)
    ratio = movable_ratio(guest.memhp_auto_movable_ratio)

    root_image: Path | None = ctx.root_disk_override
    if root_image is None and guest.root_disk.image:
        root_image = Path(guest.root_disk.image)
    kernel = Path(guest.kernel_image) if guest.kernel_image else None
    if root_image is None and kernel is None:
        raise SpecError("nothing to boot: guest.rootDisk.image is empty and "
                        "guest.kernelImage is not set")
    if kernel is None and guest.initrd_image:
        raise SpecError("guest.initrdImage needs guest.kernelImage")
    runner_kernel = ctx.runner_kernel if kernel is None and root_image is not None else None
    guest_init = GUEST_INIT if runner_kernel is not None and ctx.guest_init else None
    if kernel is None and runner_kernel is None and guest.append_kernel_cmdline:
        raise SpecError("guest.appendKernelCmdline needs a kernel: guest.kernelImage, or the "
                        "runner's kernel for a root disk that is a bare filesystem")

    qmp_socket = ctx.work_dir / QMP_SOCKET_NAME
    longest = max(QMP_SOCKET_NAME, QMP_SPEC_SOCKET_NAME, GUEST_FRAMES_SOCKET_NAME,
                  PASSED_FRAMES_SOCKET_NAME, AGENT_SOCKET_NAME, key=len)
    if len(str(ctx.work_dir / longest).encode()) > MAX_UNIX_SOCKET_PATH:
        raise SpecError(f"work dir {ctx.work_dir} is too long for a unix socket path "
                        f"(at most {MAX_UNIX_SOCKET_PATH - len(longest) - 1} bytes)")

    argv: list[str] = [
        ctx.qemu_binary,
        "-name", f"guest={qemu_value(ctx.vm_name)}",
        "-nodefaults", "-display", "none", "-no-reboot",
        "-machine", "q35",
        "-accel", ctx.accel,
        "-cpu", "host" if ctx.accel == "kvm" else "max",
    ]
    sysfs = ctx.cpu_scaling_mode == "SysfsScaling"
    booted = cpus.max_vcpus if sysfs else cpus.vcpus
    argv += ["-smp", f"cpus={booted},maxcpus={cpus.max_vcpus}"]
    if not memory.hotplug_slots:
        argv += ["-m", f"size={_mib(memory.boot_bytes)}"]
    elif provider == "VirtioMem":
        # No DIMM slots: virtio-mem needs only maxmem. reserve=off: the backend of
        # max - min is mapped without reserving it (MAP_NORESERVE); only what the guest
        # has plugged is ever touched, and a backend larger than the host's memory plus
        # swap is refused by Linux's overcommit heuristic otherwise.
        argv += ["-m", f"size={_mib(memory.boot_bytes)},maxmem={_mib(memory.max_bytes)}",
                 "-object", f"memory-backend-ram,id={VIRTIO_MEM_BACKEND_ID},"
                            f"size={_mib(memory.hotplug_bytes)},reserve=off",
                 "-device", f"virtio-mem-pci,id={VIRTIO_MEM_ID},memdev={VIRTIO_MEM_BACKEND_ID},"
                            f"block-size={_mib(VIRTIO_MEM_BLOCK_BYTES)},"
                            f"requested-size={_mib(memory.requested_bytes)}"]
    else:
        argv += ["-m", f"size={_mib(memory.boot_bytes)},slots={memory.hotplug_slots},"
                       f"maxmem={_mib(memory.max_bytes)}"]
        for slot in range(memory.min_slots, memory.use_slots):
            argv += ["-object", f"memory-backend-ram,id=mem-slot{slot},"
                                f"size={_mib(memory.slot_bytes)}",
                     "-device", f"pc-dimm,id=dimm-slot{slot},memdev=mem-slot{slot}"]

    # Serial console → QEMU's stdout, which the runner forwards to its own stdout. A
    # vm-builder guest gets NeonVM's layout: ttyS0 (its agetty's) goes nowhere, ttyS1 is
    # the console.
    if guest_init is not None:
        argv += ["-serial", "null"]
    argv += ["-chardev", "stdio,id=console,signal=off", "-serial", "chardev:console"]
    # The runner's private QMP channel.
    argv += ["-chardev", f"socket,id=qmp,path={qemu_value(qmp_socket)},server=on,wait=off",
             "-mon", "chardev=qmp,mode=control"]
    qmp_spec_socket: Path | None = None
    if spec.qmp is not None:
        if spec.qmp == ctx.runner_port:
            raise SpecError(f"qmp port {spec.qmp} is the runner's own port")
        # A unix socket, never a TCP port: QMP has no authentication and can run commands
        # in the runner's container. See QMP_SPEC_SOCKET_NAME.
        qmp_spec_socket = ctx.work_dir / QMP_SPEC_SOCKET_NAME
        argv += ["-chardev", f"socket,id=qmp-spec,path={qemu_value(qmp_spec_socket)},"
                             "server=on,wait=off",
                 "-mon", "chardev=qmp-spec,mode=control"]
    agent_socket: Path | None = None
    if sysfs:
        agent_socket = ctx.work_dir / AGENT_SOCKET_NAME
        argv += ["-device", "virtio-serial-pci,id=agent-bus",
                 "-chardev", f"socket,id=agent,path={qemu_value(agent_socket)},server=on,"
                             "wait=off",
                 "-device", f"virtserialport,bus=agent-bus.0,chardev=agent,"
                            f"name={AGENT_PORT_NAME}"]
    argv += ["-object", "rng-random,id=rng0,filename=/dev/urandom",
             "-device", "virtio-rng-pci,rng=rng0"]

    required_files: list[tuple[str, Path]] = []
    disk_images: list[DiskImage] = []
    if root_image is not None:
        required_files.append(("root disk image", root_image))
        root_size = None
        if guest.root_disk.size is not None:
            try:
                root_size = parse_bytes(guest.root_disk.size)
            except QuantityError as exc:
                raise SpecError(f"guest.rootDisk.size: {exc}") from None
        overlay = ctx.work_dir / ROOT_OVERLAY_NAME
        disk_images.append(DiskImage(name="rootdisk", kind="root-overlay", path=overlay,
                                     size_bytes=root_size, backing_file=root_image))
        # Firmware boots it only without -kernel (the kernel loader claims bootindex 0).
        boot = "" if kernel is not None or runner_kernel is not None else ",bootindex=0"
        argv += ["-drive", f"if=none,id=rootdisk,file={qemu_value(overlay)},format=qcow2",
                 "-device", f"virtio-blk-pci,drive=rootdisk,serial=rootdisk{boot}"]
    runtime_path: Path | None = None
    if guest_init is not None:
        # Right after the root disk, so the guest sees it as /dev/vdb (vminit mounts that).
        runtime_path = ctx.work_dir / RUNTIME_DISK_NAME
        argv += ["-drive", f"if=none,id=runtime,file={qemu_value(runtime_path)},format=raw,"
                           "readonly=on",
                 "-device", f"virtio-blk-pci,drive=runtime,serial={RUNTIME_SERIAL}"]
    ssh_disk = _ssh_disk(spec, ctx) if runtime_path is not None else None
    if ssh_disk is not None:
        disk_images.append(ssh_disk)
        argv += ["-drive", f"if=none,id={SSH_LABEL},file={qemu_value(ssh_disk.path)},"
                           "format=raw,readonly=on",
                 "-device", f"virtio-blk-pci,drive={SSH_LABEL},serial=ssh"]

    cmdline: str | None = None
    if kernel is not None:
        required_files.append(("kernel", kernel))
        cmdline = kernel_cmdline(root_image is not None, memory, guest.append_kernel_cmdline,
                                 online_cpus=cpus.vcpus if sysfs else None,
                                 provider=provider, auto_movable_ratio=ratio)
        argv += ["-kernel", str(kernel), "-append", cmdline]
        if guest.initrd_image:
            initrd = Path(guest.initrd_image)
            required_files.append(("initrd", initrd))
            argv += ["-initrd", str(initrd)]
    elif runner_kernel is not None:
        # The runner's init mounts the root disk itself (no root= for the kernel).
        required_files += [("runner kernel", runner_kernel.kernel),
                           ("runner initramfs", runner_kernel.initrd)]
        cmdline = kernel_cmdline(False, memory, guest.append_kernel_cmdline,
                                 online_cpus=cpus.vcpus if sysfs else None,
                                 guest_init=guest_init, provider=provider,
                                 auto_movable_ratio=ratio)
        argv += ["-kernel", str(runner_kernel.kernel), "-initrd", str(runner_kernel.initrd),
                 "-append", cmdline]

    required_dirs: list[tuple[str, Path]] = []
    guest_disks: list[dict[str, Any]] = []
    seen: set[str] = set()
    for disk in spec.disks or []:
        if disk.name in seen:
            raise SpecError(f"disks: name {disk.name!r} appears twice")
        seen.add(disk.name)
        source = _disk_source(disk)
        entry: dict[str, Any] = {"name": disk.name, "source": source,
                                 "mountPath": disk.mount_path,
                                 "readOnly": bool(disk.read_only)}
        drive_id = f"disk-{disk.name}"
        serial = disk.name[:VIRTIO_SERIAL_MAX]
        read_only = bool(disk.read_only)
        if source == "tmpfs":
            assert disk.tmpfs is not None
            size = _optional_size(disk, disk.tmpfs, required=False)
            entry.update(filesystem="tmpfs", size=size)
            guest_disks.append(entry)
            continue
        if source == "emptyDisk":
            assert disk.empty_disk is not None
            size = _optional_size(disk, disk.empty_disk, required=True)
            if disk.name in ctx.writable_disk_dirs:
                path = ctx.disks_dir / disk.name / "disk.raw"
            else:
                path = ctx.work_dir / "disks" / f"{disk.name}.raw"
            disk_images.append(DiskImage(name=disk.name, kind="empty", path=path,
                                         size_bytes=size, label=disk.name[:16]))
        else:  # configMap or secret: the pod mounts the files, the guest gets an image
            source_dir = ctx.disks_dir / disk.name
            required_dirs.append((f"{source} of disk {disk.name}", source_dir))
            path = ctx.work_dir / "disks" / f"{disk.name}.raw"
            disk_images.append(DiskImage(name=disk.name, kind="content", path=path,
                                         source_dir=source_dir, label=disk.name[:16]))
            read_only = True
            entry["readOnly"] = True
        entry.update(filesystem="ext4", serial=serial, label=disk.name[:16])
        guest_disks.append(entry)
        readonly = ",readonly=on" if read_only else ""
        argv += ["-drive", f"if=none,id={drive_id},file={qemu_value(path)},format=raw{readonly}",
                 "-device", f"virtio-blk-pci,drive={drive_id},serial={qemu_value(serial)}"]

    swap = swap_bytes(guest.settings)
    if swap is not None:
        if SWAP_SERIAL in seen:
            raise SpecError(f"disks: the name {SWAP_SERIAL!r} is the swap disk's")
        swap_path = ctx.work_dir / "disks" / f"{SWAP_SERIAL}.raw"
        disk_images.append(DiskImage(name=SWAP_SERIAL, kind="blank", path=swap_path,
                                     size_bytes=swap, label=SWAP_SERIAL))
        guest_disks.append({"name": SWAP_SERIAL, "source": "swap", "serial": SWAP_SERIAL,
                            "size": swap, "readOnly": False})
        argv += ["-drive", f"if=none,id=disk-{SWAP_SERIAL},file={qemu_value(swap_path)},"
                           "format=raw",
                 "-device", f"virtio-blk-pci,drive=disk-{SWAP_SERIAL},serial={SWAP_SERIAL}"]

    forwards: list[str] = []
    ports: list[tuple[int, str]] = []
    for port in guest.ports or []:
        if port.port == ctx.runner_port:
            raise SpecError(f"guest.ports: {port.port} is the runner's own port")
        if port.port == spec.qmp:
            raise SpecError(f"guest.ports: {port.port} is the QMP port")
        proto = (port.protocol or "TCP").lower()
        if (port.port, proto) in ports:
            continue  # NeonVM's sample names 5432 twice (postgres, pooler): forwarded once
        ports.append((port.port, proto))
        forwards.append(f"hostfwd={proto}:{ctx.listen_address}:{port.port}-:{port.port}")
    # The guest's network: slirp at pinned addresses, and every frame the guest sends
    # goes through the runner's filter first (neonvm.runner.guestnet), which keeps the
    # guest off the container's loopback. QEMU connects to both sockets at start.
    frames_out = ctx.work_dir / GUEST_FRAMES_SOCKET_NAME
    frames_in = ctx.work_dir / PASSED_FRAMES_SOCKET_NAME
    argv += ["-netdev", ",".join(["user,id=net0", DEFAULT_GUEST_NETWORK.netdev_options(),
                                  *forwards]),
             "-device", "virtio-net-pci,netdev=net0,romfile=",  # no PXE option ROM
             "-chardev", f"socket,id=net-from-guest,path={qemu_value(frames_out)},server=off",
             "-chardev", f"socket,id=net-to-slirp,path={qemu_value(frames_in)},server=off",
             "-object", "filter-redirector,id=guest-net-filter,netdev=net0,queue=rx,"
                        "outdev=net-from-guest,indev=net-to-slirp"]

    config_path = ctx.work_dir / GUEST_CONFIG_NAME
    guest_config: dict[str, Any] = {
        "name": ctx.vm_name,
        "namespace": ctx.vm_namespace,
        "command": guest.command,
        "args": guest.args,
        "env": [{"name": e.name, "value": e.value or ""} for e in guest.env or []],
        "ports": [{"port": p.port, "protocol": p.protocol or "TCP", "name": p.name}
                  for p in guest.ports or []],
        "disks": guest_disks,
        "settings": guest.settings,
        "cpus": {"use": cpus.vcpus, "max": cpus.max_vcpus,
                 "scalingMode": ctx.cpu_scaling_mode},
        "memory": {"slotSize": format_bytes(memory.slot_bytes), "use": memory.use_slots,
                   "min": memory.min_slots, "max": memory.max_slots, "provider": provider},
        "readyMarker": ctx.ready_marker,
    }
    argv += ["-fw_cfg", f"name={FW_CFG_NAME},file={qemu_value(config_path)}"]
    script: str | None = None
    script_path: Path | None = None
    if runner_kernel is not None:
        script = boot_script(
            marker=ctx.ready_marker, command=guest.command, args=guest.args,
            env=[(e.name, e.value or "") for e in guest.env or []], settings=guest.settings,
            disks=[d for d in guest_disks if d["source"] != "swap"], swap=swap is not None)
        script_path = ctx.work_dir / BOOT_SCRIPT_NAME
        argv += ["-fw_cfg", f"name={BOOT_FW_CFG_NAME},file={qemu_value(script_path)}"]
    if runtime_path is not None:
        files = runtime_files(
            command=guest.command, args=guest.args,
            env=[(e.name, e.value or "") for e in guest.env or []], settings=guest.settings,
            disks=[d for d in guest_disks if d["source"] != "swap"], swap_bytes=swap,
            boot_memory_bytes=memory.boot_bytes, ssh=ssh_disk is not None)
        disk_images.append(DiskImage(name=RUNTIME_SERIAL, kind="file", path=runtime_path,
                                     contents=iso9660_image(files)))

    return LaunchPlan(
        argv=tuple(argv),
        qmp_socket=qmp_socket,
        disk_images=tuple(disk_images),
        required_files=tuple(required_files),
        required_dirs=tuple(required_dirs),
        guest_config=guest_config,
        guest_config_path=config_path,
        cpus=cpus,
        memory=memory,
        kernel_cmdline=cmdline,
        forwarded_ports=tuple(dict.fromkeys(number for number, _ in ports)),
        cpu_scaling_mode=ctx.cpu_scaling_mode,
        agent_socket=agent_socket,
        guest_frames_socket=frames_out,
        passed_frames_socket=frames_in,
        qmp_spec_socket=qmp_spec_socket,
        boot=("spec kernel" if kernel is not None else
              "runner kernel" if runner_kernel is not None else "firmware"),
        boot_script=script,
        boot_script_path=script_path,
        guest_init=guest_init,
        memory_provider=provider,
    )


def _ssh_disk(spec: VirtualMachineSpec, ctx: LaunchContext) -> DiskImage | None:
    """The SSH public key disk of a vm-builder guest (NeonVM's ``ssh-authorized-keys``
    ISO, which its ``mounts.sh`` mounts on ``/mnt/ssh``, where vm-builder's sshd reads
    ``authorized_keys``): only with ``enableSSH`` and a key mounted into the pod."""
    if spec.enable_ssh is not True or not ctx.ssh_authorized_keys:
        return None
    return DiskImage(name=SSH_LABEL, kind="file", path=ctx.work_dir / SSH_DISK_NAME,
                     contents=iso9660_image({"authorized_keys": ctx.ssh_authorized_keys},
                                            label=SSH_LABEL))


def guest_config_json(plan: LaunchPlan) -> str:
    """The guest config as the guest reads it from fw_cfg."""
    return json.dumps(plan.guest_config, indent=2, sort_keys=True) + "\n"
