"""The VM runner: spec → QEMU mapping, readiness, shutdown and exit codes.

Unit tests (``-m unit``) pin the pure pieces: the command line built from a spec, spec
loading, the outcome → exit-code table, readiness. The rest boot a real guest under real
QEMU (KVM when usable, else TCG): the distribution kernel and a busybox initramfs built
into a temp dir (tests/guest/). Those skip only when QEMU, the kernel or busybox cannot be
installed (``scripts/setup-qemu.sh`` is tried first), and say which.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from neonvm.api.quantity import QuantityError, parse_bytes
from neonvm.api.schema import encode
from neonvm.api.types import CPURange, IntRange
from neonvm.runner.disks import DiskTools, check_prerequisites, content_image_size, prepare
from neonvm.runner.errors import HostError, SpecError
from neonvm.runner.guestnet import DEFAULT_GUEST_NETWORK
from neonvm.runner.host import KvmProbe, choose_accel, probe_kvm
from neonvm.runner.qemu import build_launch_plan, cpu_layout, memory_layout
from neonvm.runner.spec import load_spec, parse_spec_document
from neonvm.runner.state import ExitCode, RunnerState, Sizing, decide_outcome
from neonvm.runner.supervisor import is_marker_line, shutdown_budget, split_console_lines
from tests.support import wait_for
from tests.support.runner import REPO, context, free_port, kernel_spec, option_values, spec_of

MIB = 1 << 20


# ---- helpers -------------------------------------------------------------------------------


# ---- the command line (pure) ---------------------------------------------------------------


@pytest.mark.unit
def test_cpus_boot_with_use_and_can_grow_to_max(tmp_path: Path) -> None:
    spec = spec_of(kernel_spec(cpus={"min": 1, "max": 4, "use": 2}))
    plan = build_launch_plan(spec, context(tmp_path))
    assert option_values(plan.argv, "-smp") == ["cpus=2,maxcpus=4"]


@pytest.mark.unit
def test_fractional_cpus_round_up_to_whole_vcpus() -> None:
    assert cpu_layout(CPURange(min=0.25, max=1.5, use=0.5)) == cpu_layout(
        CPURange(min=1, max=2, use=1))


@pytest.mark.unit
@pytest.mark.parametrize(("cpus", "message"), [
    ({"min": 2, "max": 1}, "guest.cpus: min 2 exceeds max 1"),
    ({"min": 1, "max": 2, "use": 3}, "guest.cpus: use 3 is outside [1, 2]"),
])
def test_impossible_cpu_bounds_are_spec_errors(cpus: dict[str, Any], message: str,
                                               tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=message.replace("[", r"\[")):
        build_launch_plan(spec_of(kernel_spec(cpus=cpus)), context(tmp_path))


@pytest.mark.unit
def test_memory_is_slots_times_slot_size_with_hotplug_room_up_to_max(tmp_path: Path) -> None:
    # DIMMs (memoryProvider: DIMMSlots); virtio-mem, the default: tests/test_virtio_mem.py.
    spec = spec_of(kernel_spec(memorySlotSize="256Mi", memoryProvider="DIMMSlots",
                               memorySlots={"min": 2, "max": 8, "use": 4}))
    plan = build_launch_plan(spec, context(tmp_path))
    assert option_values(plan.argv, "-m") == ["size=512M,slots=6,maxmem=2048M"]
    # use - min = 2 DIMMs plugged at boot, each one slot.
    assert option_values(plan.argv, "-object")[:2] == [
        "memory-backend-ram,id=mem-slot2,size=256M", "memory-backend-ram,id=mem-slot3,size=256M"]
    assert option_values(plan.argv, "-device")[:2] == [
        "pc-dimm,id=dimm-slot2,memdev=mem-slot2", "pc-dimm,id=dimm-slot3,memdev=mem-slot3"]
    assert plan.memory.current_bytes == 4 * 256 * MIB
    assert "memhp_default_state=online" in (plan.kernel_cmdline or "")


@pytest.mark.unit
def test_fixed_memory_has_no_hotplug_slots(tmp_path: Path) -> None:
    spec = spec_of(kernel_spec(memorySlotSize="1Gi", memorySlots={"min": 2, "max": 2}))
    plan = build_launch_plan(spec, context(tmp_path))
    assert option_values(plan.argv, "-m") == ["size=2048M"]
    assert not any(v.startswith("pc-dimm") for v in option_values(plan.argv, "-device"))


@pytest.mark.unit
@pytest.mark.parametrize(("slots", "size", "message"), [
    ({"min": 3, "max": 2}, "1Gi", "guest.memorySlots: min 3 exceeds max 2"),
    ({"min": 1, "max": 2, "use": 5}, "1Gi", "use 5 is outside"),
    ({"min": 1, "max": 1}, "1000k", "whole number of MiB"),
    ({"min": 1, "max": 1}, "lots", "not a size quantity"),
])
def test_impossible_memory_is_a_spec_error(slots: dict[str, int], size: str,
                                           message: str) -> None:
    with pytest.raises(SpecError, match=message):
        memory_layout(IntRange(**slots), size)


@pytest.mark.unit
def test_every_plan_has_qmp_serial_console_and_no_reboot(tmp_path: Path) -> None:
    plan = build_launch_plan(spec_of(kernel_spec()), context(tmp_path))
    argv = plan.argv
    assert {"-nodefaults", "-no-reboot"} <= set(argv)
    assert option_values(argv, "-display") == ["none"]
    assert plan.qmp_socket == tmp_path / "work" / "qmp.sock"
    assert f"socket,id=qmp,path={plan.qmp_socket},server=on,wait=off" in option_values(
        argv, "-chardev")
    assert "chardev=qmp,mode=control" in option_values(argv, "-mon")
    assert "stdio,id=console,signal=off" in option_values(argv, "-chardev")
    assert option_values(argv, "-serial") == ["chardev:console"]
    assert argv[0] == "/usr/bin/qemu-system-x86_64"


@pytest.mark.unit
@pytest.mark.parametrize(("accel", "cpu"), [("kvm", "host"), ("tcg", "max")])
def test_accelerator_picks_the_cpu_model(accel: str, cpu: str, tmp_path: Path) -> None:
    plan = build_launch_plan(spec_of(kernel_spec()), context(tmp_path, accel=accel))
    assert option_values(plan.argv, "-accel") == [accel]
    assert option_values(plan.argv, "-cpu") == [cpu]


@pytest.mark.unit
def test_kernel_initrd_and_append_are_passed_with_console_first_and_user_last(
        tmp_path: Path) -> None:
    spec = spec_of(kernel_spec(kernelImage="/k/vmlinuz", initrdImage="/k/initrd",
                               appendKernelCmdline="quiet panic=10"))
    plan = build_launch_plan(spec, context(tmp_path))
    assert option_values(plan.argv, "-kernel") == ["/k/vmlinuz"]
    assert option_values(plan.argv, "-initrd") == ["/k/initrd"]
    (cmdline,) = option_values(plan.argv, "-append")
    assert cmdline.startswith("console=ttyS0 ")
    assert cmdline.endswith("quiet panic=10")  # after ours, so the user's panic= wins
    assert ("kernel", Path("/k/vmlinuz")) in plan.required_files
    assert ("initrd", Path("/k/initrd")) in plan.required_files


@pytest.mark.unit
def test_root_disk_is_a_qcow2_overlay_in_the_work_dir(tmp_path: Path) -> None:
    spec = spec_of({"guest": {"rootDisk": {"image": "/images/root.qcow2", "size": "10Gi"}}})
    plan = build_launch_plan(spec, context(tmp_path))
    (root,) = plan.disk_images
    assert (root.kind, root.backing_file, root.size_bytes) == (
        "root-overlay", Path("/images/root.qcow2"), 10 << 30)
    assert root.path.parent == tmp_path / "work"
    assert f"if=none,id=rootdisk,file={root.path},format=qcow2" in option_values(
        plan.argv, "-drive")
    # No kernel: the firmware boots the disk.
    assert "virtio-blk-pci,drive=rootdisk,serial=rootdisk,bootindex=0" in option_values(
        plan.argv, "-device")
    assert "-kernel" not in plan.argv


@pytest.mark.unit
def test_root_disk_with_a_kernel_is_mounted_as_root_not_booted_by_firmware(
        tmp_path: Path) -> None:
    spec = spec_of(kernel_spec(rootDisk={"image": "/images/root.raw"}))
    plan = build_launch_plan(spec, context(tmp_path))
    assert "root=/dev/vda rw" in (plan.kernel_cmdline or "")
    assert "virtio-blk-pci,drive=rootdisk,serial=rootdisk" in option_values(plan.argv, "-device")


@pytest.mark.unit
def test_root_disk_override_replaces_the_spec_image(tmp_path: Path) -> None:
    spec = spec_of({"guest": {"rootDisk": {"image": "registry/image:tag"}}})
    plan = build_launch_plan(spec, context(tmp_path, root_disk_override=Path("/vm/root.qcow2")))
    assert plan.required_files == (("root disk image", Path("/vm/root.qcow2")),)


@pytest.mark.unit
@pytest.mark.parametrize(("guest", "message"), [
    ({"rootDisk": {"image": ""}}, "nothing to boot"),
    ({"rootDisk": {"image": "/r"}, "initrdImage": "/i"}, "initrdImage needs guest.kernelImage"),
    ({"rootDisk": {"image": "/r"}, "appendKernelCmdline": "x"}, "Cmdline needs a kernel"),
])
def test_specs_without_a_bootable_combination_are_refused(guest: dict[str, Any], message: str,
                                                          tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=message):
        build_launch_plan(spec_of({"guest": guest}), context(tmp_path))


@pytest.mark.unit
def test_extra_disks_map_to_devices_and_guest_config(tmp_path: Path) -> None:
    (tmp_path / "disks" / "data").mkdir(parents=True)
    spec = spec_of({**kernel_spec(), "disks": [
        {"name": "data", "mountPath": "/data", "emptyDisk": {"size": "1Gi"}},
        {"name": "scratch", "mountPath": "/scratch", "emptyDisk": {"size": "64Mi"}},
        {"name": "cfg", "mountPath": "/etc/cfg", "configMap": {"name": "cfg"}},
        {"name": "creds", "mountPath": "/creds", "secret": {"secretName": "s"}},
        {"name": "cache", "mountPath": "/cache", "tmpfs": {"size": "16Mi"}},
    ]})
    plan = build_launch_plan(spec, context(tmp_path, writable_disk_dirs=frozenset({"data"})))
    images = {d.name: d for d in plan.disk_images}
    # An emptyDisk goes into the pod's volume for it when there is one, else the work dir.
    assert images["data"].path == tmp_path / "disks" / "data" / "disk.raw"
    assert images["scratch"].path == tmp_path / "work" / "disks" / "scratch.raw"
    assert (images["data"].kind, images["data"].size_bytes) == ("empty", 1 << 30)
    # configMap and secret: read-only images of what the pod mounts at <disks>/<name>.
    assert images["cfg"].source_dir == tmp_path / "disks" / "cfg"
    assert ("secret of disk creds", tmp_path / "disks" / "creds") in plan.required_dirs
    drives = option_values(plan.argv, "-drive")
    assert f"if=none,id=disk-cfg,file={images['cfg'].path},format=raw,readonly=on" in drives
    assert f"if=none,id=disk-data,file={images['data'].path},format=raw" in drives
    assert "virtio-blk-pci,drive=disk-creds,serial=creds" in option_values(plan.argv, "-device")
    # tmpfs: no device at all; the guest mounts it from the config.
    assert "cache" not in images
    disks = {d["name"]: d for d in plan.guest_config["disks"]}
    assert disks["cache"] == {"name": "cache", "source": "tmpfs", "mountPath": "/cache",
                              "readOnly": False, "filesystem": "tmpfs", "size": 16 * MIB}
    assert disks["cfg"]["readOnly"] is True
    assert disks["data"]["serial"] == "data"


@pytest.mark.unit
@pytest.mark.parametrize(("disks", "message"), [
    ([{"name": "a"}], "exactly one of emptyDisk, configMap, secret, tmpfs is expected, got none"),
    ([{"name": "a", "tmpfs": {}, "emptyDisk": {"size": "1Gi"}}], "got emptyDisk, tmpfs"),
    ([{"name": "a", "emptyDisk": {}}], "emptyDisk.size is required"),
    ([{"name": "a", "tmpfs": {}}, {"name": "a", "tmpfs": {}}], "appears twice"),
])
def test_malformed_disks_are_spec_errors(disks: list[dict[str, Any]], message: str,
                                         tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=message):
        build_launch_plan(spec_of({**kernel_spec(), "disks": disks}), context(tmp_path))


@pytest.mark.unit
def test_guest_ports_are_forwarded_and_may_not_take_the_runner_port(tmp_path: Path) -> None:
    spec = spec_of(kernel_spec(ports=[{"port": 5432}, {"port": 53, "protocol": "UDP"}]))
    plan = build_launch_plan(spec, context(tmp_path, listen_address="0.0.0.0"))
    assert option_values(plan.argv, "-netdev") == [
        f"user,id=net0,{DEFAULT_GUEST_NETWORK.netdev_options()},"
        "hostfwd=tcp:0.0.0.0:5432-:5432,hostfwd=udp:0.0.0.0:53-:53"]
    clash = spec_of(kernel_spec(ports=[{"port": 25183}]))
    with pytest.raises(SpecError, match="runner's own port"):
        build_launch_plan(clash, context(tmp_path))


@pytest.mark.unit
def test_spec_qmp_is_a_unix_socket_never_a_tcp_port(tmp_path: Path) -> None:
    spec = spec_of({**kernel_spec(ports=[{"port": 5432}]), "qmp": 20183})
    plan = build_launch_plan(spec, context(tmp_path, listen_address="0.0.0.0"))
    assert plan.qmp_spec_socket == tmp_path / "work" / "qmp-spec.sock"
    assert (f"socket,id=qmp-spec,path={plan.qmp_spec_socket},server=on,wait=off"
            in option_values(plan.argv, "-chardev"))
    assert "chardev=qmp-spec,mode=control" in option_values(plan.argv, "-mon")
    assert not any("host=" in v or "port=" in v for v in option_values(plan.argv, "-chardev"))
    # The guest's own ports still listen on the listen address: they are the VM's service.
    assert option_values(plan.argv, "-netdev") == [
        f"user,id=net0,{DEFAULT_GUEST_NETWORK.netdev_options()},"
        "hostfwd=tcp:0.0.0.0:5432-:5432"]


@pytest.mark.unit
def test_commas_in_paths_are_escaped_for_qemu(tmp_path: Path) -> None:
    plan = build_launch_plan(spec_of(kernel_spec()), context(tmp_path / "a,b"))
    assert any("path=" in v and "a,,b" in v for v in option_values(plan.argv, "-chardev"))


@pytest.mark.unit
def test_a_work_dir_too_long_for_a_unix_socket_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="too long for a unix socket"):
        build_launch_plan(spec_of(kernel_spec()), context(tmp_path / ("x" * 120)))


@pytest.mark.unit
def test_guest_config_carries_command_env_and_marker(tmp_path: Path) -> None:
    spec = spec_of(kernel_spec(command=["/bin/app"], args=["-v"],
                               env=[{"name": "A", "value": "1"}]))
    plan = build_launch_plan(spec, context(tmp_path))
    assert (plan.guest_config["command"], plan.guest_config["args"]) == (["/bin/app"], ["-v"])
    assert plan.guest_config["env"] == [{"name": "A", "value": "1"}]
    assert plan.guest_config["readyMarker"] == "READY"
    assert f"name=opt/vm.neon.tech/config,file={plan.guest_config_path}" in option_values(
        plan.argv, "-fw_cfg")


# ---- quantities, spec loading ---------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(("text", "size"), [
    ("1Gi", 1 << 30), ("512Mi", 512 * MIB), ("2G", 2 * 10**9), ("1e3", 1000), (1024, 1024),
    ("1.5Gi", 1536 * MIB)])
def test_sizes_parse_as_kubernetes_quantities(text: object, size: int) -> None:
    assert parse_bytes(text) == size


@pytest.mark.unit
@pytest.mark.parametrize("text", ["0.5", "100m", "1Gb", "", "-1", True])
def test_non_sizes_are_refused(text: object) -> None:
    with pytest.raises(QuantityError):
        parse_bytes(text)


@pytest.mark.unit
def test_spec_from_env_is_the_controllers_encoding() -> None:
    spec = spec_of(kernel_spec(cpus={"min": 1, "max": 2}))
    env = {"NEONVM_VM_SPEC": json.dumps(encode(spec)), "NEONVM_VM_NAME": "db",
           "NEONVM_VM_NAMESPACE": "prod"}
    loaded = load_spec(None, env)
    assert loaded.spec == spec
    assert loaded.key == "prod/db"


@pytest.mark.unit
def test_spec_file_may_hold_a_whole_virtual_machine(tmp_path: Path) -> None:
    path = tmp_path / "vm.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "vm.neon.tech/v1", "kind": "VirtualMachine",
        "metadata": {"name": "web", "namespace": "apps"},
        "spec": kernel_spec(cpus={"min": 2, "max": 2})}))
    loaded = load_spec(path, {})
    assert (loaded.key, loaded.spec.guest.cpus.min.cores) == ("apps/web", 2.0)


@pytest.mark.unit
@pytest.mark.parametrize(("text", "message"), [
    ("{", "not JSON or YAML"),
    ("[1]", "expected an object"),
    ('{"kind": "Pod", "spec": {}}', "kind is 'Pod'"),
    ('{"guest": {"memorySlots": {"min": "two"}}}', "invalid VM spec"),
])
def test_undecodable_specs_are_one_line_spec_errors(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=message) as err:
        parse_spec_document(text, "NEONVM_VM_SPEC")
    assert "\n" not in str(err.value)


@pytest.mark.unit
def test_no_spec_at_all_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match="no VM spec"):
        load_spec(None, {})


# ---- host, outcome, readiness (pure) --------------------------------------------------------


@pytest.mark.unit
def test_kvm_needs_a_device_and_hardware_virtualisation(tmp_path: Path) -> None:
    assert not probe_kvm(tmp_path / "no-kvm").usable
    assert choose_accel("auto", KvmProbe(False, "none")) == "tcg"
    assert choose_accel("auto", KvmProbe(True, "ok")) == "kvm"
    assert choose_accel("tcg", KvmProbe(True, "ok")) == "tcg"
    with pytest.raises(HostError, match="KVM is not usable: none"):
        choose_accel("kvm", KvmProbe(False, "none"))


@pytest.mark.unit
@pytest.mark.parametrize(("returncode", "reason", "killed", "code"), [
    (0, "guest-shutdown", False, ExitCode.GUEST_POWERED_OFF),
    (0, "guest-reset", False, ExitCode.GUEST_RESET),
    (0, "guest-panic", False, ExitCode.GUEST_RESET),
    (0, "host-qmp-quit", False, ExitCode.QEMU_FAILED),
    (0, None, False, ExitCode.QEMU_FAILED),
    (1, None, False, ExitCode.QEMU_FAILED),
    (-9, None, False, ExitCode.QEMU_FAILED),
    (-9, None, True, ExitCode.KILLED_AFTER_GRACE),
])
def test_only_a_guest_power_off_is_success(returncode: int, reason: str | None, killed: bool,
                                          code: ExitCode) -> None:
    outcome = decide_outcome(returncode, reason, killed_after_grace=killed, stop_requested=True)
    assert outcome.exit_code == code


@pytest.mark.unit
def test_shutdown_budget_keeps_a_margin_from_the_grace_period() -> None:
    assert shutdown_budget(60, 3) == 57
    assert shutdown_budget(None, 3) == 27  # Kubernetes' default 30 s
    assert shutdown_budget(2, 3) == 0
    assert shutdown_budget(60, 3, override_seconds=10) == 10


@pytest.mark.unit
def test_the_marker_counts_only_as_a_whole_line() -> None:
    assert is_marker_line("NEONVM_GUEST_READY\r", "NEONVM_GUEST_READY")
    assert not is_marker_line('  "readyMarker": "NEONVM_GUEST_READY",', "NEONVM_GUEST_READY")
    assert not is_marker_line("[0.0] Command line: x=NEONVM_GUEST_READY", "NEONVM_GUEST_READY")
    assert not is_marker_line("NEONVM_GUEST_READY", "")


@pytest.mark.unit
def test_a_kernel_record_inside_a_line_does_not_split_it() -> None:
    # Seen on the real node: the kernel's record landed between the marker and its newline.
    record = b"[    4.311707] IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready\r\n"
    assert split_console_lines(b"NEONVM_GUEST_READY" + record + b"\r\n") == (
        [b"NEONVM_GUEST_READY\r"], b"")
    # Inside the marker itself, and arriving in two chunks.
    lines, rest = split_console_lines(b"NEONVM_GU" + record[:20])
    assert (lines, rest) == ([], b"NEONVM_GU" + record[:20])
    lines, rest = split_console_lines(rest + record[20:] + b"EST_READY")
    assert (lines, rest) == ([], b"NEONVM_GUEST_READY")
    assert split_console_lines(rest + b"\r\nnext") == ([b"NEONVM_GUEST_READY\r"], b"next")
    # A record that starts its own line stays a line of its own.
    assert split_console_lines(record + b"app: running\n") == (
        [record[:-1], b"app: running"], b"")


@dataclass
class FakeClock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.unit
def test_ready_needs_qemu_qmp_running_and_the_marker_and_ends_at_stop() -> None:
    clock = FakeClock()
    state = RunnerState("ns/vm", "tcg", "READY", Sizing(), monotonic=clock, wall=clock)
    assert state.healthy()[0] and not state.snapshot().ready  # preparing
    state.qemu_started(42)
    state.qmp_connected(True)
    state.qmp_status("running")
    assert state.snapshot().not_ready_because.startswith("ready marker")
    clock.now += 4.5
    state.console_line(has_marker=True)
    snap = state.snapshot()
    assert (snap.ready, snap.phase, snap.boot_seconds) == (True, "Running", 4.5)
    state.qmp_status("paused")
    assert not state.snapshot().ready
    state.qmp_status("running")
    state.stop_requested(10)
    assert (state.snapshot().ready, state.snapshot().phase) == (False, "Stopping")
    assert state.healthy()[0]  # still alive while powering down
    state.qemu_exited(0)
    assert not state.healthy()[0]


@pytest.mark.unit
def test_without_a_marker_qmp_running_is_ready() -> None:
    state = RunnerState("ns/vm", "tcg", "", Sizing())
    state.qemu_started(1)
    state.qmp_connected(True)
    state.qmp_status("running")
    assert state.snapshot().ready


# ---- disk preparation (real qemu-img and mkfs.ext4) ----------------------------------------


def disk_tools() -> DiskTools:
    from neonvm.runner.host import optional_binary

    tools = DiskTools(qemu_img=optional_binary("qemu-img"), mkfs_ext4=optional_binary("mkfs.ext4"))
    if tools.qemu_img is None or tools.mkfs_ext4 is None or optional_binary("debugfs") is None:
        pytest.skip("qemu-img, mkfs.ext4 or debugfs not installed (scripts/setup-qemu.sh)")
    return tools


def test_prepared_disks_hold_what_the_spec_and_pod_provide(tmp_path: Path) -> None:
    tools = disk_tools()
    base = tmp_path / "base.raw"
    base.write_bytes(b"\0" * MIB)
    cfg = tmp_path / "disks" / "cfg"
    (cfg / "..2024").mkdir(parents=True)
    (cfg / "..2024" / "greeting").write_text("hello\n")
    (cfg / "..data").symlink_to("..2024")
    (cfg / "greeting").symlink_to("..data/greeting")
    spec = spec_of({"guest": {"rootDisk": {"image": str(base), "size": "64Mi"}}, "disks": [
        {"name": "cfg", "configMap": {"name": "cfg"}},
        {"name": "scratch", "emptyDisk": {"size": "32Mi"}}]})
    plan = build_launch_plan(spec, context(tmp_path))
    prepare(plan, tools)

    overlay = tmp_path / "work" / "rootdisk.qcow2"
    info = json.loads(subprocess.run([str(tools.qemu_img), "info", "--output=json", str(overlay)],
                                     capture_output=True, text=True, check=True).stdout)
    assert (info["format"], info["virtual-size"], info["backing-filename-format"]) == (
        "qcow2", 64 * MIB, "raw")
    assert base.read_bytes() == b"\0" * MIB  # the image itself is never written
    image = str(tmp_path / "work" / "disks" / "cfg.raw")

    def debugfs(request: str) -> str:
        return subprocess.run(["debugfs", "-R", request, image], capture_output=True,
                              text=True, check=True).stdout

    assert debugfs("cat /..2024/greeting") == "hello\n"
    assert 'Fast link dest: "..data/greeting"' in debugfs("stat /greeting")  # pod layout kept
    assert (tmp_path / "work" / "disks" / "scratch.raw").stat().st_size == 32 * MIB
    assert json.loads(plan.guest_config_path.read_text())["name"] == "demo"


def test_missing_files_and_mounts_are_named(tmp_path: Path) -> None:
    tools = DiskTools(qemu_img="/usr/bin/qemu-img", mkfs_ext4="/sbin/mkfs.ext4")
    plan = build_launch_plan(spec_of({"guest": {"rootDisk": {"image": "/nope/root.qcow2"}}}),
                             context(tmp_path))
    with pytest.raises(SpecError, match=r"root disk image not found: /nope/root\.qcow2"):
        check_prerequisites(plan, tools)
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"")
    plan = build_launch_plan(spec_of({**kernel_spec(kernelImage=str(kernel)), "disks": [
        {"name": "cfg", "configMap": {"name": "cfg"}}]}), context(tmp_path))
    with pytest.raises(SpecError, match="configMap of disk cfg not found"):
        check_prerequisites(plan, DiskTools(None, "/sbin/mkfs.ext4"))


def test_content_images_grow_with_their_files(tmp_path: Path) -> None:
    (tmp_path / "small").mkdir()
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "blob").write_bytes(b"x" * (8 * MIB))
    assert content_image_size(tmp_path / "big") > content_image_size(tmp_path / "small") + 8 * MIB


# ---- bad specs through the real command ------------------------------------------------------


def run_runner_command(args: list[str], env: dict[str, str], timeout: float = 60
                       ) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-m", "neonvm.runner.main", *args], env=full_env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


BAD_SPECS: list[tuple[str, dict[str, Any] | str, str]] = [
    ("not json", "{", "not JSON or YAML"),
    ("fails decode", {"guest": {"memorySlots": {"min": "two"}}}, "invalid VM spec"),
    ("cpus not a number", {"guest": {"kernelImage": "/k", "cpus": {"min": "two"}}},
     "guest.cpus.min: expected a number, got 'two'"),
    ("nothing to boot", {"guest": {}}, "nothing to boot"),
    ("cpus min > max", {"guest": {"kernelImage": "/k", "cpus": {"min": 4, "max": 2}}},
     "guest.cpus: min 4 exceeds max 2"),
    ("memory min > max", {"guest": {"kernelImage": "/k", "memorySlots": {"min": 4, "max": 2}}},
     "guest.memorySlots: min 4 exceeds max 2"),
    ("missing root image", {"guest": {"rootDisk": {"image": "/nonexistent/root.qcow2"}}},
     "root disk image not found: /nonexistent/root.qcow2"),
    ("missing kernel", {"guest": {"kernelImage": "/nonexistent/vmlinuz"}},
     "kernel not found: /nonexistent/vmlinuz"),
]


@pytest.mark.parametrize(("spec", "message"), [(s, m) for _, s, m in BAD_SPECS],
                         ids=[name for name, _, _ in BAD_SPECS])
def test_a_bad_spec_exits_non_zero_with_one_line(spec: dict[str, Any] | str, message: str,
                                                 tmp_path: Path) -> None:
    text = spec if isinstance(spec, str) else json.dumps(spec)
    # A stand-in QEMU: these specs must be refused before any QEMU is needed.
    result = run_runner_command(["--qemu", "/bin/true", "--work-dir", str(tmp_path / "w")],
                                {"NEONVM_VM_SPEC": text})
    assert result.returncode == ExitCode.RUNNER_ERROR
    assert result.stderr.splitlines() == [result.stderr.strip()], result.stderr
    assert result.stderr.startswith("error: ") and message in result.stderr


def test_a_missing_qemu_binary_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    result = run_runner_command(["--qemu", "/nonexistent/qemu-system-x86_64"],
                                {"NEONVM_VM_SPEC": json.dumps(kernel_spec())})
    assert result.returncode == ExitCode.RUNNER_ERROR
    assert result.stderr == "error: qemu binary not found: /nonexistent/qemu-system-x86_64\n"


def test_a_runner_port_in_use_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_runner_command(
            ["--qemu", "/bin/true", "--port", str(port), "--listen-address", "127.0.0.1",
             "--log-level", "ERROR", "--work-dir", str(tmp_path / "w")],
            {"NEONVM_VM_SPEC": json.dumps(kernel_spec(kernelImage=str(kernel)))})
    assert result.returncode == ExitCode.RUNNER_ERROR
    assert result.stderr == f"error: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_neonvm_runner_run_is_the_same_command(tmp_path: Path) -> None:
    from neonvm.cli import main

    result = CliRunner().invoke(main, ["runner", "run", "--qemu", "/bin/true"], env={
        k: "" for k in os.environ if k.startswith("NEONVM_")})
    assert result.exit_code == ExitCode.RUNNER_ERROR
    assert result.output == ("error: no VM spec: pass --spec-file (or set NEONVM_SPEC_FILE), "
                             "or set NEONVM_VM_SPEC\n")


EXEC_STRING_LIMIT = 128 * 1024
"""Linux's MAX_ARG_STRLEN: exec refuses any one argument or environment string longer."""


def big_guest_env(total: int) -> list[dict[str, str]]:
    """Guest env entries adding up to about ``total`` bytes of JSON."""
    return [{"name": f"SETTING_{i}", "value": "x" * 1000} for i in range(total // 1000 + 1)]


def test_a_spec_over_128_kib_cannot_start_from_the_environment_but_does_from_the_file(
        tmp_path: Path) -> None:
    spec = kernel_spec(env=big_guest_env(EXEC_STRING_LIMIT + 20_000))
    text = json.dumps(spec)
    assert len(text.encode()) > EXEC_STRING_LIMIT
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
    command = [sys.executable, "-m", "neonvm", "runner", "qemu-command", "--qemu", "/bin/true",
               "--accel", "tcg", "--work-dir", str(tmp_path / "work"), "-o", "json"]

    # What a runner pod with the spec in NEONVM_VM_SPEC met: the container never starts.
    with pytest.raises(OSError) as refused:
        subprocess.run(command, env={**env, "NEONVM_VM_SPEC": text}, capture_output=True,
                       check=False)
    assert refused.value.errno == errno.E2BIG

    # What it gets now: the path of the file the pod's downward-API volume holds.
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(text)
    result = subprocess.run(command, env={**env, "NEONVM_SPEC_FILE": str(spec_file)},
                            capture_output=True, text=True, check=False, cwd=REPO)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["guestConfig"]["env"] == spec["guest"]["env"]


def test_qemu_command_shows_the_command_line_without_starting_anything(tmp_path: Path) -> None:
    from neonvm.cli import main

    spec_file = tmp_path / "vm.json"
    spec_file.write_text(json.dumps(kernel_spec(cpus={"min": 1, "max": 3})))
    work_dir = tmp_path / "work"
    result = CliRunner().invoke(main, ["runner", "qemu-command", "--spec-file", str(spec_file),
                                       "--qemu", "/bin/true", "--accel", "tcg",
                                       "--work-dir", str(work_dir), "-o", "json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert "cpus=1,maxcpus=3" in shown["argv"]
    assert f"{work_dir}/qmp.sock" in " ".join(shown["argv"])
    assert not work_dir.exists()


# ---- a real guest under real QEMU -----------------------------------------------------------


def test_runner_reports_ready_once_the_guest_has_booted(start_runner: Any, tmp_path: Path
                                                       ) -> None:
    # A guest with every kind of device: CPUs and memory to hotplug into, a root disk,
    # a configMap, an emptyDisk and a tmpfs.
    root_src = tmp_path / "root-src"
    root_src.mkdir()
    (root_src / "greeting").write_text("hello from the root disk\n")
    root = tmp_path / "root.raw"
    with root.open("wb") as f:
        f.truncate(16 * MIB)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(root_src), str(root)], check=True)
    (tmp_path / "disks" / "settings").mkdir(parents=True)
    (tmp_path / "disks" / "settings" / "greeting").write_text("hello from the configMap\n")
    runner = start_runner(spec_overrides={
        "guest": {"cpus": {"min": 1, "max": 2, "use": 1},
                  "memorySlots": {"min": 1, "max": 3, "use": 2},
                  "rootDisk": {"image": str(root), "size": "64Mi"}},
        "disks": [{"name": "settings", "mountPath": "/etc/settings",
                   "configMap": {"name": "settings"}},
                  {"name": "scratch", "mountPath": "/scratch", "emptyDisk": {"size": "32Mi"}},
                  {"name": "cache", "mountPath": "/cache", "tmpfs": {"size": "8Mi"}}]})

    status = runner.wait_ready()
    assert status["phase"] == "Running"
    assert status["markerSeen"] and status["qmpStatus"] == "running"
    assert status["bootSeconds"] > 0 and status["qemuAlive"]
    assert (status["vcpus"], status["maxVcpus"]) == (1, 2)
    assert status["maxMemoryBytes"] == 384 * MIB
    # The slot above min is virtio-mem: the guest's driver plugs it after it binds, which
    # may be after the ready marker. QEMU's plugged size reaches `use`, and the guest's own
    # MemTotal report (from the scaling script's watcher) then includes it.
    def slot_plugged() -> dict[str, Any] | None:
        now = runner.status()
        if now is None or now["memoryBytes"] != 256 * MIB:
            return None
        return now if (now["guestMemTotalKb"] or 0) * 1024 > 128 * MIB else None
    wait_for(slot_plugged, timeout=120, interval=0.2, what="the virtio-mem slot to be plugged")
    assert runner.get("/healthz")[0] == 200
    code, metrics = runner.get("/metrics")
    assert code == 200
    assert 'neonvm_runner_info{accel="' in metrics and 'vm="tests/guest0"' in metrics
    assert "neonvm_runner_guest_ready 1.0" in metrics
    assert "neonvm_runner_boot_seconds " in metrics

    # What the guest itself saw, from its serial console (the runner's stdout).
    console = runner.console()
    assert "guest: cpus online=0 possible=0-1" in console
    assert "guest: rootdisk says: hello from the root disk" in console
    assert "guest: wrote to rootdisk" in console
    assert "guest: settings says: hello from the configMap" in console
    assert "guest: disk vdb serial=settings ro=1" in console
    assert "guest: wrote to scratch" in console
    config_text = console.split("guest: config begin\n")[1].split("guest: config end")[0]
    config = json.loads(config_text)
    assert config["name"] == "guest0"
    assert {d["name"]: d["filesystem"] for d in config["disks"]} == {
        "settings": "ext4", "scratch": "ext4", "cache": "tmpfs"}
    assert root.read_bytes().count(b"hello from the root disk") == 1  # image untouched

    runner.proc.send_signal(signal.SIGTERM)
    assert runner.wait_exit(timeout=120) == ExitCode.GUEST_POWERED_OFF


def test_sigterm_powers_the_guest_down_over_qmp_and_the_runner_exits_0(start_runner: Any
                                                                      ) -> None:
    runner = start_runner(mode="powerdown", grace=60)
    status = runner.wait_ready()
    qemu_pid = status["qemuPid"]

    runner.proc.send_signal(signal.SIGTERM)
    # Exit 0 means the guest powered off before the 57 s budget ran out (else: 3).
    assert runner.wait_exit(timeout=120) == ExitCode.GUEST_POWERED_OFF
    assert "guest: power button pressed, powering off" in runner.console()
    log = runner.log()
    assert "ACPI power-down requested" in log
    assert "SHUTDOWN (reason guest-shutdown" in log
    assert runner.termination_log.read_text() == (
        "guest powered off when asked to power down (exit 0)\n")
    assert not Path(f"/proc/{qemu_pid}").exists()
    assert runner.get("/healthz")[0] == 0  # the HTTP server went with the runner


def test_a_guest_that_ignores_power_down_is_killed_after_the_grace_period(start_runner: Any
                                                                         ) -> None:
    # Grace 8 s, margin 2 s: the guest gets 6 s and three presses (every 2 s).
    runner = start_runner(mode="ignore-powerdown", grace=8,
                          extra_args=["--grace-margin", "2", "--powerdown-interval", "2"])
    status = runner.wait_ready()
    qemu_pid = status["qemuPid"]

    runner.proc.send_signal(signal.SIGTERM)
    stopping = wait_for(lambda: (s := runner.status()) and s["phase"] == "Stopping" and s,
                        timeout=30, what="phase Stopping")
    assert stopping["ready"] is False and runner.get("/ready")[0] == 503
    assert runner.wait_exit(timeout=120) == ExitCode.KILLED_AFTER_GRACE
    assert "guest: ignoring the power button" in runner.console()
    log = runner.log()
    assert log.count("ACPI power-down requested") >= 2, "presses are repeated"
    assert "killing QEMU" in log
    assert runner.termination_log.read_text().startswith(
        "guest did not power off within 6s; QEMU was killed")
    assert not Path(f"/proc/{qemu_pid}").exists()


def test_a_guest_that_powers_off_on_its_own_ends_the_runner_with_0(start_runner: Any) -> None:
    runner = start_runner(mode="poweroff")
    assert runner.wait_exit(timeout=240) == ExitCode.GUEST_POWERED_OFF
    assert "guest: powering off on my own" in runner.console()
    assert runner.termination_log.read_text() == "guest powered off on its own (exit 0)\n"


def test_a_guest_crash_ends_the_runner_non_zero(start_runner: Any) -> None:
    runner = start_runner(mode="panic")
    assert runner.wait_exit(timeout=240) == ExitCode.GUEST_RESET
    assert "guest: crashing" in runner.console()
    assert "guest reset" in runner.termination_log.read_text()


def test_sigterm_during_boot_still_powers_the_guest_down(start_runner: Any) -> None:
    # The first presses arrive before the guest listens for them; repeats reach it.
    runner = start_runner(mode="powerdown", grace=120, extra_args=["--powerdown-interval", "1"])
    wait_for(lambda: (s := runner.status()) and s["phase"] == "Booting", timeout=60,
             interval=0.05, what="QEMU started")
    runner.proc.send_signal(signal.SIGTERM)
    assert runner.wait_exit(timeout=240) == ExitCode.GUEST_POWERED_OFF
    assert "guest: power button pressed, powering off" in runner.console()


def tcp_listeners(port: int) -> list[str]:
    """Addresses with a TCP socket listening on ``port`` in this network namespace."""
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            # The kernel prints each 32-bit word of the address in host (little-endian) order.
            raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1]
                           for i in range(0, len(address), 8))
            found.append(socket.inet_ntop(family, raw))
    return found


def test_spec_qmp_opens_no_tcp_port_and_a_spec_over_128_kib_comes_from_the_file(
        start_runner: Any) -> None:
    qmp = free_port()
    env = big_guest_env(EXEC_STRING_LIMIT + 20_000)
    # The runner's own port and guest ports on every address, as in a pod.
    runner = start_runner(mode="powerdown", extra_args=["--listen-address", "0.0.0.0"],
                          spec_overrides={"qmp": qmp, "guest": {"env": env}})
    wait_for(lambda: (s := runner.status()) and s["qemuPid"] and s, timeout=120,
             interval=0.1, what="QEMU started")

    spec_socket = runner.work_dir / "qmp-spec.sock"
    wait_for(spec_socket.exists, timeout=60, interval=0.1,
             what="QEMU listening on the spec.qmp unix socket")
    assert tcp_listeners(qmp) == [], f"QMP port {qmp} listens on {tcp_listeners(qmp)}"
    assert "0.0.0.0" in tcp_listeners(runner.port)  # the probes' port: still the pod's IP
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(30)
        conn.connect(str(spec_socket))
        greeting = json.loads(conn.makefile("r").readline())
    assert "QMP" in greeting

    # The spec came from the file: all of its > 128 KiB reached QEMU's guest config.
    config = json.loads((runner.work_dir / "guest-config.json").read_text())
    assert len(config["env"]) == len(env) and config["env"][-1] == env[-1]
