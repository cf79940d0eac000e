"""Live memory scaling through virtio-mem, the runner's memory mechanism (NeonVM's only one).

QEMU starts with one virtio-mem device of ``(max - min)`` slots and ``requested-size`` at
``use - min``; ``PUT /scale`` moves ``requested-size`` and waits for the guest's driver to
reach it; the size reported is what the guest has plugged. ``memoryProvider: DIMMSlots``
keeps ACPI DIMMs for a guest kernel without virtio_mem. docs/runner.md, "Mechanism".

Unit tests: the command line, the spec checks, the slot count of a size in between, and
the runner's side against a QMP stand-in whose guest plugs only when told. Real QEMU
(TCG here): the tests' busybox guest grows and shrinks in slot steps and reports its own
MemTotal, and a VM with NeonVM's 512 memory slots (QEMU refuses more than 256 DIMM slots)
boots and scales.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from neonvm.api.scale_protocol import ScaleError, ScaleLimits, ScaleTarget
from neonvm.runner.errors import SpecError
from neonvm.runner.qemu import (
    LaunchContext,
    build_launch_plan,
)
from neonvm.runner.scaling import Scaler, VirtioMem, virtio_mem_slots
from tests.support.runner import RunningRunner, spec_of
from tests.support.runner_scaling import guest_sees, put_scale

MIB = 1 << 20
GIB = 1 << 30
TOKEN = "virtio-mem-token"


def plan_for(tmp_path: Path, **guest: Any) -> Any:
    spec = spec_of({"guest": {"cpus": {"min": 1, "max": 1}, "rootDisk": {"image": ""},
                              "kernelImage": "/boot/vmlinuz", **guest}})
    ctx = LaunchContext(qemu_binary="qemu-system-x86_64", accel="tcg", work_dir=tmp_path,
                        runner_port=25183)
    return build_launch_plan(spec, ctx)


def values(argv: tuple[str, ...], option: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == option]


# ---- the command line -----------------------------------------------------------------------


@pytest.mark.unit
def test_memory_above_min_is_one_virtio_mem_device_with_use_requested(tmp_path: Path) -> None:
    plan = plan_for(tmp_path, memorySlotSize="256Mi",
                    memorySlots={"min": 2, "max": 6, "use": 3})
    # Boot memory is min; maxmem leaves room for the device; no DIMM slots at all.
    assert values(plan.argv, "-m") == ["size=512M,maxmem=1536M"]
    assert "memory-backend-ram,id=vmem0,size=1024M,reserve=off" in values(plan.argv, "-object")
    devices = values(plan.argv, "-device")
    assert ("virtio-mem-pci,id=vm0,memdev=vmem0,block-size=8M,requested-size=256M"
            in devices)
    assert not any(d.startswith("pc-dimm") for d in devices)
    # NeonVM's kernel line: the kernel onlines what is plugged, movable within the ratio.
    assert ("memhp_default_state=online memory_hotplug.online_policy=auto-movable "
            "memory_hotplug.auto_movable_ratio=301") in plan.kernel_cmdline
    assert plan.memory_provider == "VirtioMem"
    assert plan.guest_config["memory"]["provider"] == "VirtioMem"


@pytest.mark.unit
def test_memhp_auto_movable_ratio_reaches_the_guest_kernel(tmp_path: Path) -> None:
    plan = plan_for(tmp_path, memorySlots={"min": 1, "max": 2}, memhpAutoMovableRatio="801")
    assert "memory_hotplug.auto_movable_ratio=801" in plan.kernel_cmdline
    with pytest.raises(SpecError, match="memhpAutoMovableRatio"):
        plan_for(tmp_path, memorySlots={"min": 1, "max": 2}, memhpAutoMovableRatio="lots")


@pytest.mark.unit
def test_fixed_memory_has_no_virtio_mem_device(tmp_path: Path) -> None:
    # QEMU refuses a backend of size 0: min == max has no device, any whole-MiB slot.
    plan = plan_for(tmp_path, memorySlotSize="100Mi", memorySlots={"min": 2, "max": 2})
    assert values(plan.argv, "-m") == ["size=200M"]
    assert not any("virtio-mem" in d for d in values(plan.argv, "-device"))
    assert "memhp_default_state" not in plan.kernel_cmdline
    assert "swiotlb" not in plan.kernel_cmdline


@pytest.mark.unit
def test_a_hotplug_region_turns_off_the_swiotlb_bounce_buffer(tmp_path: Path) -> None:
    # The region lies above 4 GiB: the kernel would reserve 64 MiB of bounce buffer at
    # boot, which a 128 MiB guest cannot spare (it panicked out of memory).
    for provider in ("VirtioMem", "DIMMSlots"):
        plan = plan_for(tmp_path, memorySlotSize="128Mi", memoryProvider=provider,
                        memorySlots={"min": 1, "max": 3})
        assert "swiotlb=noforce" in plan.kernel_cmdline.split()


@pytest.mark.unit
def test_a_slot_size_that_is_no_whole_number_of_virtio_mem_blocks_is_refused(
        tmp_path: Path) -> None:
    # virtio-mem plugs 8 MiB blocks (NeonVM's size and rule).
    with pytest.raises(SpecError, match="memorySlotSize: 100Mi is no multiple of "
                                        "virtio-mem's block size"):
        plan_for(tmp_path, memorySlotSize="100Mi", memorySlots={"min": 1, "max": 2})
    dimms = plan_for(tmp_path, memorySlotSize="100Mi", memorySlots={"min": 1, "max": 2},
                     memoryProvider="DIMMSlots")
    assert values(dimms.argv, "-m") == ["size=100M,slots=1,maxmem=200M"]


@pytest.mark.unit
def test_512_slots_fit_virtio_mem_but_not_dimm_slots(tmp_path: Path) -> None:
    # NeonVM's CRD allows 512 slots; QEMU takes at most 256 DIMM slots.
    plan = plan_for(tmp_path, memorySlotSize="128Mi",
                    memorySlots={"min": 1, "max": 512, "use": 1})
    assert values(plan.argv, "-m") == ["size=128M,maxmem=65536M"]
    with pytest.raises(SpecError, match="511 DIMM slots; QEMU takes at most 256"):
        plan_for(tmp_path, memorySlotSize="128Mi", memorySlots={"min": 1, "max": 512},
                 memoryProvider="DIMMSlots")


@pytest.mark.unit
def test_dimm_slots_keep_the_acpi_dimm_line(tmp_path: Path) -> None:
    plan = plan_for(tmp_path, memorySlotSize="256Mi", memoryProvider="DIMMSlots",
                    memorySlots={"min": 2, "max": 4, "use": 3})
    assert values(plan.argv, "-m") == ["size=512M,slots=2,maxmem=1024M"]
    assert "pc-dimm,id=dimm-slot2,memdev=mem-slot2" in values(plan.argv, "-device")
    assert not any("virtio-mem" in d for d in values(plan.argv, "-device"))
    assert "memhp_default_state=online_movable" in plan.kernel_cmdline
    assert "auto-movable" not in plan.kernel_cmdline


# ---- the size in between ----------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(("size", "requested", "slots"), [
    (0, 0, 0), (2 * GIB, 2 * GIB, 2),
    (GIB + 8 * MIB, 2 * GIB, 1),   # growing 1 -> 2: not there yet
    (GIB + 8 * MIB, GIB, 2),       # shrinking 2 -> 1: not there yet
    (GIB + 8 * MIB, 0, 2),         # shrinking to 0 from above 1
])
def test_a_size_under_way_is_never_counted_as_its_target(size: int, requested: int,
                                                         slots: int) -> None:
    assert virtio_mem_slots(VirtioMem("vm0", size, requested), GIB) == slots


# ---- the runner's side against a stand-in -------------------------------------------------------


class VirtioMemQMP:
    """A QMP stand-in: one virtio-mem device whose guest plugs or unplugs up to
    ``requested-size`` only when the test says so (:meth:`reach`), at once (``prompt``),
    or when the runner first reads the size after a request (``reach_on_poll``: the
    guest is seen working on it, deterministically, whatever the loop's timing);
    ``stuck_at``: the guest cannot go below this size (unmovable pages)."""

    def __init__(self, size: int, requested: int, prompt: bool = True) -> None:
        self.size = size
        self.requested = requested
        self.prompt = prompt
        self.reach_on_poll = False
        self._unseen_request = False
        self.stuck_at: int | None = None
        self.calls: list[tuple[str, dict[str, Any] | None]] = []

    def reach(self) -> None:
        floor = self.stuck_at if self.stuck_at is not None else 0
        self.size = max(self.requested, min(floor, self.size))

    async def execute(self, command: str, args: dict[str, Any] | None = None) -> Any:
        self.calls.append((command, args))
        if command == "query-cpus-fast":
            return [{"cpu-index": 0, "qom-path": "/machine/unattached/device[0]"}]
        if command == "query-hotpluggable-cpus":
            return [{"type": "qemu64-x86_64-cpu", "vcpus-count": 1, "props": {
                "socket-id": 0, "core-id": 0, "thread-id": 0},
                "qom-path": "/machine/unattached/device[0]"}]
        if command == "query-memory-devices":
            return [{"type": "virtio-mem", "data": {
                "id": "vm0", "memdev": "/objects/vmem0", "size": self.size,
                "requested-size": self.requested, "max-size": 3 * GIB,
                "block-size": 8 * MIB, "node": 0, "memaddr": 1 << 32}}]
        assert args is not None and args["path"] == "/machine/peripheral/vm0", args
        if command == "qom-set":
            assert args["property"] == "requested-size"
            self.requested = int(args["value"])
            self._unseen_request = True
            if self.prompt:
                self.reach()
            return {}
        if command == "qom-get":
            assert args["property"] in ("size", "requested-size")
            if args["property"] == "size" and self._unseen_request:
                self._unseen_request = False
                if self.reach_on_poll:
                    self.reach()
            return self.size if args["property"] == "size" else self.requested
        raise AssertionError(f"unexpected QMP command {command}")


LIMITS = ScaleLimits(min_vcpus=1, max_vcpus=1, min_slots=1, max_slots=4, slot_bytes=GIB)


def scaler_over(tmp_path: Path, loop: asyncio.AbstractEventLoop, qmp: VirtioMemQMP) -> Scaler:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    scaler = Scaler(tmp_path, token, LIMITS, boot=ScaleTarget(1, 1), request_timeout=0.5)
    scaler.attach(loop, qmp)  # type: ignore[arg-type]
    return scaler


def put(scaler: Scaler, seq: int, slots: int) -> dict[str, Any]:
    body = {"memorySlots": slots, "fence": {"epoch": 1, "token": 1, "seq": seq}}
    return scaler.scale(f"Bearer {TOKEN}", json.dumps(body).encode())


@pytest.mark.unit
def test_a_put_moves_requested_size_and_answers_what_the_guest_plugged(
        tmp_path: Path, qmp_loop: asyncio.AbstractEventLoop) -> None:
    qmp = VirtioMemQMP(size=0, requested=0)
    scaler = scaler_over(tmp_path, qmp_loop, qmp)
    grown = put(scaler, 1, 3)
    assert ("qom-set", {"path": "/machine/peripheral/vm0", "property": "requested-size",
                        "value": 2 * GIB}) in qmp.calls
    assert grown["qemu"] == {"vcpus": 1, "memorySlots": 3, "memoryBytes": 3 * GIB,
                             "virtioMem": {"size": 2 * GIB, "requestedSize": 2 * GIB}}
    shrunk = put(scaler, 2, 2)
    assert shrunk["qemu"]["memorySlots"] == 2 and qmp.size == GIB
    # Nothing is recorded as a pending removal: a newer size just replaces the request.
    assert scaler.pending_removals(scaler.query()) == []


@pytest.mark.unit
def test_a_guest_that_plugs_nothing_is_answered_504_naming_the_driver(
        tmp_path: Path, qmp_loop: asyncio.AbstractEventLoop) -> None:
    qmp = VirtioMemQMP(size=0, requested=0, prompt=False)  # no virtio_mem in the guest
    scaler = scaler_over(tmp_path, qmp_loop, qmp)
    with pytest.raises(ScaleError) as err:
        put(scaler, 1, 2)
    assert err.value.status == 504
    assert "0 bytes plugged, 1073741824 requested" in str(err.value)
    assert "virtio_mem driver" in str(err.value)
    assert scaler.query().memory_slots == 1  # nothing counted that the guest has not got
    # The guest's driver comes up later; the same fence again finishes the change.
    qmp.prompt = True
    qmp.reach()
    assert put(scaler, 1, 2)["applied"] == "retry"


@pytest.mark.unit
def test_a_shrink_the_guest_cannot_finish_is_not_reported_done_and_a_newer_size_replaces_it(
        tmp_path: Path, qmp_loop: asyncio.AbstractEventLoop) -> None:
    qmp = VirtioMemQMP(size=3 * GIB, requested=3 * GIB, prompt=False)
    scaler = scaler_over(tmp_path, qmp_loop, qmp)
    qmp.stuck_at = 2 * GIB + 512 * MIB  # unmovable pages in the last GiB
    qmp.reach_on_poll = True  # the guest unplugs what it can, then is stuck
    with pytest.raises(ScaleError) as err:
        put(scaler, 1, 1)
    assert "2684354560 bytes plugged" in str(err.value)  # 2.5 GiB: it did move
    assert err.value.status == 504 and not err.value.refused
    # 2.5 GiB plugged, 0 requested above boot: counted as 3 slots above boot, not 2 or 1.
    assert scaler.query().memory_slots == 4
    # The autoscaler moves on (back up to 4 slots): the newer plan needs no settling first.
    qmp.prompt = True
    assert put(scaler, 2, 4)["qemu"]["memorySlots"] == 4 and qmp.size == 3 * GIB


# ---- a real guest ------------------------------------------------------------------------------


def qemu_argv(runner: RunningRunner, pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def start_scalable(start_runner: Any, tmp_path: Path, slots: dict[str, int],
                   slot_size: str) -> RunningRunner:
    token_file = tmp_path / "scaling-token"
    token_file.write_text(TOKEN + "\n")
    runner: RunningRunner = start_runner(
        extra_args=["--scaling-token-file", str(token_file)],
        spec_overrides={"guest": {"cpus": {"min": 1, "max": 1, "use": 1},
                                  "memorySlotSize": slot_size, "memorySlots": slots}})
    return runner


def test_virtio_mem_grows_and_shrinks_a_running_guest_in_slot_steps(
        start_runner: Any, tmp_path: Path) -> None:
    slot_kb = 128 * MIB // 1024
    runner = start_scalable(start_runner, tmp_path, {"min": 2, "max": 6, "use": 3}, "128Mi")
    pid = runner.wait_ready()["qemuPid"]
    argv = qemu_argv(runner, pid)
    assert any(a.startswith("virtio-mem-pci,id=vm0,") for a in argv)
    assert not any(a.startswith("pc-dimm") for a in argv)
    # Booted with use = 3: the guest's own MemTotal has the one slot above min in it.
    boot_kb = guest_sees(runner, cpus=1)["guestMemTotalKb"]
    base = boot_kb - slot_kb
    code, scaled = runner.get("/scale")
    assert code == 200 and json.loads(scaled)["qemu"]["memorySlots"] == 3

    for seq, slots in enumerate((6, 2, 4), start=1):
        code, answer = put_scale(runner, {"memorySlots": slots,
                                          "fence": {"epoch": 1, "token": 1, "seq": seq}},
                                 token=TOKEN)
        assert code == 200, answer
        assert answer["qemu"]["memorySlots"] == slots
        assert answer["qemu"]["memoryBytes"] == slots * 128 * MIB
        # The guest's own figure, exactly the slots above min.
        want = base + (slots - 2) * slot_kb
        seen = guest_sees(runner, mem_kb=(want, want))
        assert seen["guestMemTotalKb"] == want
    assert runner.status() is not None and runner.qemu_pids == {pid}


def test_a_vm_with_512_memory_slots_boots_and_scales(start_runner: Any,
                                                     tmp_path: Path) -> None:
    # With DIMMs QEMU refused this VM at start ("unsupported amount of memory slots").
    slot_kb = 128 * MIB // 1024
    runner = start_scalable(start_runner, tmp_path, {"min": 1, "max": 512, "use": 1},
                            "128Mi")
    pid = runner.wait_ready()["qemuPid"]
    boot_kb = guest_sees(runner, cpus=1)["guestMemTotalKb"]
    code, answer = put_scale(runner, {"memorySlots": 3,
                                      "fence": {"epoch": 1, "token": 1, "seq": 1}}, token=TOKEN)
    assert code == 200, answer
    assert guest_sees(runner, mem_kb=(boot_kb + 2 * slot_kb,) * 2)
    code, answer = put_scale(runner, {"memorySlots": 1,
                                      "fence": {"epoch": 1, "token": 1, "seq": 2}}, token=TOKEN)
    assert code == 200, answer
    assert guest_sees(runner, mem_kb=(boot_kb, boot_kb))
    assert runner.qemu_pids == {pid}


def test_a_change_within_one_memory_block_is_reported_by_the_guest(
        start_runner: Any, tmp_path: Path) -> None:
    # 64 MiB slots: half of x86's 128 MiB memory block. virtio-mem plugs and unplugs
    # inside a block that is already online, which raises no memory uevent: the guest
    # side watches MemTotal itself (guest_scaling.sh).
    slot_kb = 64 * MIB // 1024
    runner = start_scalable(start_runner, tmp_path, {"min": 2, "max": 6, "use": 2}, "64Mi")
    runner.wait_ready()
    boot_kb = guest_sees(runner, cpus=1)["guestMemTotalKb"]
    for seq, slots in enumerate((3, 4, 3), start=1):
        code, answer = put_scale(runner, {"memorySlots": slots,
                                          "fence": {"epoch": 1, "token": 1, "seq": seq}},
                                 token=TOKEN)
        assert code == 200, answer
        want = boot_kb + (slots - 2) * slot_kb
        assert guest_sees(runner, mem_kb=(want, want), timeout=60)["guestMemTotalKb"] == want
