"""The runner's own kernel: NeonVM-style bare-ext4 root disks boot, the guest gets its
command, env, sysctls, swap and disks through the boot script in fw_cfg.

The pure parts (boot script, plan, root-disk detection, initramfs archive) are quick unit
tests. The real boot under TCG takes about a minute on this machine, so it is opt-in:
``NEONVM_TEST_BOOT=1 pytest tests/test_runner_kernel.py`` (it also runs with
``NEONVM_TEST_REAL_NODE=1``, the real-node opt-in).
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from neonvm.api.schema import decode
from neonvm.api.types import VirtualMachineSpec
from neonvm.dev import guestdisk
from neonvm.runner import guestboot, initramfs
from neonvm.runner.errors import SpecError
from neonvm.runner.initramfs import RunnerKernel
from neonvm.runner.qemu import build_launch_plan
from tests.support import wait_for
from tests.support.runner import context

REPO = Path(__file__).resolve().parent.parent


def spec_of(data: dict[str, Any]) -> VirtualMachineSpec:
    return decode(VirtualMachineSpec, data, ".spec")




RUNNER_KERNEL = RunnerKernel(kernel=Path("/vm/kernel/vmlinuz"),
                             initrd=Path("/vm/kernel/initrd.cpio"))


def run_sh(script: str, *args: str) -> str:
    """Run ``script`` in a POSIX shell, printing what the given shell code prints."""
    return subprocess.run(["sh", "-c", script, "sh", *args], capture_output=True, text=True,
                          check=True).stdout


# ---- the plan (pure) ---------------------------------------------------------------------


@pytest.mark.unit
def test_without_kernel_image_a_bare_root_boots_the_runner_kernel_with_the_boot_script(
        tmp_path: Path) -> None:
    spec = spec_of({"guest": {"rootDisk": {"image": "/disks/root.qcow2"},
                              "command": ["/app/run"], "args": ["--x"],
                              "appendKernelCmdline": "quiet",
                              "env": [{"name": "A", "value": "b"}],
                              "settings": {"sysctl": ["vm.swappiness=10"], "swap": "64Mi"}}})
    plan = build_launch_plan(spec, context(tmp_path, runner_kernel=RUNNER_KERNEL))
    argv = plan.argv
    assert plan.boot == "runner kernel"
    assert argv[argv.index("-kernel") + 1] == "/vm/kernel/vmlinuz"
    assert argv[argv.index("-initrd") + 1] == "/vm/kernel/initrd.cpio"
    cmdline = argv[argv.index("-append") + 1]
    assert "root=" not in cmdline and cmdline.endswith(" quiet")
    assert not any("bootindex" in a for a in argv)
    assert f"name=opt/vm.neon.tech/boot.sh,file={tmp_path}/work/guest-boot.sh" in argv
    assert ("runner kernel", RUNNER_KERNEL.kernel) in plan.required_files
    swap = [d for d in plan.disk_images if d.name == "swapdisk"]
    assert swap and swap[0].kind == "blank" and swap[0].size_bytes == 64 << 20
    assert any(a.endswith("serial=swapdisk") for a in argv)
    assert plan.boot_script is not None and "exec chroot /newroot '/app/run' '--x'" in \
        plan.boot_script


@pytest.mark.unit
def test_kernel_image_stays_an_override_and_other_disks_stay_with_the_firmware(
        tmp_path: Path) -> None:
    with_kernel = build_launch_plan(
        spec_of({"guest": {"kernelImage": "/k", "rootDisk": {"image": "/r"}}}),
        context(tmp_path, runner_kernel=RUNNER_KERNEL))
    assert with_kernel.boot == "spec kernel"
    assert with_kernel.argv[with_kernel.argv.index("-kernel") + 1] == "/k"
    assert with_kernel.boot_script is None
    firmware = build_launch_plan(spec_of({"guest": {"rootDisk": {"image": "/r"}}}),
                                 context(tmp_path))
    assert firmware.boot == "firmware" and "-kernel" not in firmware.argv
    assert any(a.endswith("bootindex=0") for a in firmware.argv)


# ---- the boot script (pure, and run in a real shell) ---------------------------------------


@pytest.mark.unit
def test_boot_script_quotes_every_value_so_a_spec_cannot_inject_commands(tmp_path: Path) -> None:
    nasty = "x'; echo INJECTED; '$(echo INJECTED)`echo INJECTED`"
    script = guestboot.boot_script(
        marker="READY", command=["/bin/echo", nasty], args=["a b"],
        env=[("GREETING", nasty)], settings={"sysctl": [f"kernel.x = {nasty}"]},
        disks=[{"mountPath": "/data dir", "serial": "data", "readOnly": True,
                "filesystem": "ext4"},
               {"mountPath": "/scratch", "filesystem": "tmpfs", "size": 1 << 20}],
        swap=True)
    harness = script + r"""
neonvm_sysctl() { printf 'sysctl <%s> <%s>\n' "$1" "$2"; }
neonvm_mount_disk() { printf 'disk <%s> <%s> <%s>\n' "$1" "$2" "$3"; }
neonvm_mount_tmpfs() { printf 'tmpfs <%s> <%s>\n' "$1" "$2"; }
neonvm_sysctls; neonvm_mounts
(neonvm_env; printf 'env <%s>\n' "$GREETING"; neonvm_exec)
printf 'marker <%s> swap <%s> command <%s>\n' "$NEONVM_MARKER" "$NEONVM_SWAP_SERIAL" \
    "$NEONVM_HAS_COMMAND"
"""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "chroot").write_text("#!/bin/sh\nshift\nprintf 'argv'\nprintf ' <%s>' \"$@\"\n"
                                 "printf '\\n'\n")
    (fake / "chroot").chmod(0o755)
    out = run_sh(f"PATH={fake}:$PATH\n" + harness)
    assert "INJECTED\n" not in out and not out.startswith("INJECTED")
    assert out.splitlines() == [
        f"sysctl <kernel.x> <{nasty}>",
        "disk <data> </data dir> <ro>",
        f"tmpfs </scratch> <{1 << 20}>",
        f"env <{nasty}>",
        f"argv </bin/echo> <{nasty}> <a b>",
        "marker <READY> swap <swapdisk> command <1>",
    ]


@pytest.mark.unit
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"env": [("BAD-NAME", "x")]}, "not a valid variable name"),
    ({"settings": {"sysctl": ["no equals sign"]}}, "is not 'key = value'"),
])
def test_boot_script_refuses_what_the_guest_could_not_apply(kwargs: dict[str, Any],
                                                          message: str) -> None:
    args: dict[str, Any] = {"marker": "M", "command": ["/x"], "args": None, "env": [],
                            "settings": None, "disks": [], "swap": False}
    args.update(kwargs)
    with pytest.raises(SpecError, match=message):
        guestboot.boot_script(**args)


@pytest.mark.unit
def test_swap_size_from_settings_swap_or_neonvm_swap_info() -> None:
    assert guestboot.swap_bytes(None) is None
    assert guestboot.swap_bytes({"swap": "1Gi"}) == 1 << 30
    assert guestboot.swap_bytes({"swapInfo": {"size": "64Mi"}}) == 64 << 20
    with pytest.raises(SpecError, match="below 1Mi"):
        guestboot.swap_bytes({"swap": "1Ki"})


# ---- root disk detection (real images) -----------------------------------------------------


def _tools_or_skip() -> str:
    qemu_img = shutil.which("qemu-img")
    mkfs = shutil.which("mkfs.ext4", path="/usr/sbin:/sbin:/usr/bin:/bin")
    if qemu_img is None or mkfs is None:
        pytest.skip("qemu-img or mkfs.ext4 not installed (scripts/setup-qemu.sh)")
    return qemu_img


@pytest.mark.unit
def test_a_bare_ext4_disk_is_recognised_raw_or_qcow2_but_a_partitioned_disk_is_not(
        tmp_path: Path) -> None:
    qemu_img = _tools_or_skip()
    mkfs = shutil.which("mkfs.ext4", path="/usr/sbin:/sbin:/usr/bin:/bin")
    assert mkfs is not None
    bare = tmp_path / "bare.raw"
    bare.write_bytes(b"")
    os.truncate(bare, 8 << 20)
    subprocess.run([mkfs, "-q", "-F", str(bare)], check=True)
    partitioned = tmp_path / "parted.raw"
    # An MBR with one partition whose ext4 starts at sector 2048: the disk's own offset
    # 1080 holds no superblock.
    data = bytearray(4 << 20)
    data[510:512] = b"\x55\xaa"
    partitioned.write_bytes(bytes(data))
    for raw in (bare, partitioned):
        for fmt_args in ((), ("-c",)):  # uncompressed, then compressed qcow2
            qcow2 = raw.with_suffix(".qcow2" if not fmt_args else ".z.qcow2")
            subprocess.run([qemu_img, "convert", "-q", *fmt_args, "-f", "raw", "-O", "qcow2",
                            str(raw), str(qcow2)], check=True)
    n = guestboot.EXT_MAGIC_OFFSET + 2

    def bare_fs(p: Path) -> bool:
        return guestboot.is_bare_ext_filesystem(guestboot.read_first_bytes(p, n, qemu_img))

    assert bare_fs(bare) and bare_fs(tmp_path / "bare.qcow2") and bare_fs(tmp_path / "bare.z.qcow2")
    assert not any(bare_fs(p) for p in (partitioned, tmp_path / "parted.qcow2",
                                        tmp_path / "parted.z.qcow2"))


# ---- the initramfs archive ---------------------------------------------------------------


@pytest.mark.unit
def test_modules_come_after_their_dependencies() -> None:
    dep = ("kernel/a.ko: kernel/b.ko kernel/c.ko\nkernel/b.ko: kernel/c.ko\nkernel/c.ko:\n"
           "kernel/d.ko:\n")
    assert initramfs.module_closure(dep, ["a", "missing", "d"]) == [
        "kernel/c.ko", "kernel/b.ko", "kernel/a.ko", "kernel/d.ko"]


@pytest.mark.unit
def test_the_initramfs_is_a_reproducible_newc_archive_cpio_can_read(tmp_path: Path) -> None:
    if shutil.which("cpio") is None:
        pytest.skip("cpio not installed")
    busybox = tmp_path / "busybox"
    busybox.write_bytes(b"\x7fELF static stand-in")
    modules = tmp_path / "modules" / "9.9"
    (modules / "kernel").mkdir(parents=True)
    (modules / "kernel" / "virtio_blk.ko").write_bytes(b"blk")
    (modules / "kernel" / "virtio.ko").write_bytes(b"virtio")
    (modules / "modules.dep").write_text("kernel/virtio_blk.ko: kernel/virtio.ko\n"
                                         "kernel/virtio.ko:\n")
    files = initramfs.initramfs_files("9.9", modules_root=tmp_path / "modules",
                                      busybox=busybox)
    first, second = io.BytesIO(), io.BytesIO()
    initramfs.write_cpio(files, first)
    initramfs.write_cpio(dict(reversed(list(files.items()))), second)
    assert first.getvalue() == second.getvalue()
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run(["cpio", "-idm", "--quiet", "--no-absolute-filenames"], cwd=out,
                   input=first.getvalue(), check=True)
    assert (out / "init").read_bytes() == initramfs.INIT_SCRIPT.read_bytes()
    assert stat.S_IMODE((out / "init").stat().st_mode) == 0o755
    scaling = out / initramfs.SCALING_SCRIPT_PATH  # the guest side of live scaling
    assert scaling.read_bytes() == initramfs.SCALING_SCRIPT.read_bytes()
    assert stat.S_IMODE(scaling.stat().st_mode) == 0o755
    assert os.readlink(out / "bin" / "sh") == "busybox"
    assert (out / "lib" / "modules" / "load-order").read_text() == "virtio.ko\nvirtio_blk.ko\n"
    assert (out / "lib" / "modules" / "virtio_blk.ko").read_bytes() == b"blk"


# ---- a real boot under TCG (opt-in) -------------------------------------------------------


def _boot_skip_reason() -> str | None:
    if "1" not in (os.environ.get("NEONVM_TEST_BOOT"), os.environ.get("NEONVM_TEST_REAL_NODE")):
        return "real guest boots are opt-in (NEONVM_TEST_BOOT=1; about a minute under TCG)"
    absent = initramfs.missing() + guestdisk.missing()
    if shutil.which("qemu-system-x86_64") is None:
        absent.append("qemu-system-x86_64 (qemu-system-x86)")
    return "missing: " + ", ".join(absent) if absent else None


@pytest.mark.slow
@pytest.mark.skipif(_boot_skip_reason() is not None, reason=_boot_skip_reason() or "")
def test_a_bare_ext4_root_boots_with_the_runner_kernel_and_runs_the_guest_command(
        tmp_path: Path) -> None:
    """The NeonVM way, under TCG: no kernelImage, a qcow2 holding a bare ext4 root; the
    runner's init mounts it, applies sysctls and swap, mounts the disks and runs the
    command with its env; SIGTERM stops the command and powers the guest off."""
    _root, qcow2 = guestdisk.build_rootfs(tmp_path)
    kernel = initramfs.build_initramfs(tmp_path / "kernel")
    spec = {"terminationGracePeriodSeconds": 60, "guest": {
        "cpus": {"min": 1, "max": 1}, "memorySlotSize": "256Mi",
        "memorySlots": {"min": 1, "max": 1}, "rootDisk": {"image": str(qcow2)},
        "command": ["/app/report.sh"], "args": ["first", "second arg"],
        "env": [{"name": "GREETING", "value": "hello 'quoted' $HOME"},
                {"name": "REPORT_SYSCTLS", "value": "vm.swappiness kernel.pid_max"}],
        "settings": {"sysctl": ["vm.swappiness = 13", "kernel.pid_max=65000"],
                     "swap": "64Mi"}},
        "disks": [{"name": "data", "mountPath": "/data", "emptyDisk": {"size": "32Mi"}},
                  {"name": "scratch", "mountPath": "/scratch", "tmpfs": {"size": "16Mi"}}]}
    spec_file = tmp_path / "vm.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    console = tmp_path / "console.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
    with console.open("wb") as out, (tmp_path / "runner.log").open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "neonvm.runner.main", "--spec-file", str(spec_file),
             "--kernel-dir", str(kernel.kernel.parent), "--accel", "tcg",
             "--work-dir", str(tmp_path / "work"), "--listen-address", "127.0.0.1",
             "--port", str(_free_port())], stdout=out, stderr=err, env=env, cwd=REPO)
    try:
        started = time.monotonic()
        wait_for(lambda: b"app: running" in console.read_bytes() or proc.poll() is not None,
                 timeout=300, interval=0.5, what="the guest command to run")
        booted = time.monotonic() - started
        text = console.read_text(errors="replace")
        assert proc.poll() is None, text[-3000:] + (tmp_path / "runner.log").read_text()
        for line in ("neonvm-init: root filesystem /dev/vda mounted",
                     "NEONVM_GUEST_READY",
                     "app: argv first second arg",
                     "app: GREETING=hello 'quoted' $HOME",
                     "app: sysctl vm.swappiness=13",
                     "app: sysctl kernel.pid_max=65000",
                     "app: SwapTotal: 65532 kB",
                     "app: mount /data ext4 rw",
                     "app: mount /scratch tmpfs rw"):
            assert line in text, text[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        text = console.read_text(errors="replace")
        assert "app: SIGTERM, exiting" in text
        assert "neonvm-init: command exited with code 0: powering off" in text
        print(f"\nbare-ext4 guest: command running {booted:.1f}s after the runner started")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.skipif(_boot_skip_reason() is not None, reason=_boot_skip_reason() or "")
def test_without_a_command_the_roots_init_takes_over_and_a_failing_command_fails_the_vm(
        tmp_path: Path) -> None:
    """A raw bare-ext4 root: with no command the runner's init hands over to the root's
    /sbin/init (here a script that prints the marker and powers off: runner exit 0); a
    command that exits 3 reboots the guest, which ends the runner with 5 (VM failed)."""
    tree = tmp_path / "tree"
    shutil.copytree(guestdisk.build_rootfs(tmp_path / "disk")[0].parent / "rootfs", tree,
                    symlinks=True)
    (tree / "sbin" / "init").write_text("#!/bin/sh\necho \"own init: pid $$\"\n"
                                        "echo NEONVM_GUEST_READY\npoweroff -f\n")
    (tree / "sbin" / "init").chmod(0o755)
    image = tmp_path / "root.ext4"
    with image.open("wb") as f:
        f.truncate(16 << 20)
    mkfs = shutil.which("mkfs.ext4", path="/usr/sbin:/sbin:/usr/bin:/bin")
    assert mkfs is not None
    subprocess.run([mkfs, "-q", "-F", "-d", str(tree), str(image)], check=True)
    kernel = initramfs.build_initramfs(tmp_path / "kernel")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
    for name, guest, code, lines in (
            ("no-command", {}, 0,
             ["neonvm-init: no command: handing over to /sbin/init of the root filesystem",
              "own init: pid 1"]),
            ("failing", {"command": ["/bin/sh", "-c", "echo failing; exit 3"]}, 5,
             ["failing", "neonvm-init: command exited with code 3: rebooting (the VM fails)"])):
        spec_file = tmp_path / f"{name}.yaml"
        spec_file.write_text(yaml.safe_dump({"guest": {
            "cpus": {"min": 1, "max": 1}, "memorySlotSize": "256Mi",
            "memorySlots": {"min": 1, "max": 1}, "rootDisk": {"image": str(image)}, **guest}}))
        result = subprocess.run(
            [sys.executable, "-m", "neonvm.runner.main", "--spec-file", str(spec_file),
             "--kernel-dir", str(kernel.kernel.parent), "--accel", "tcg",
             "--work-dir", str(tmp_path / f"work-{name}"), "--listen-address", "127.0.0.1",
             "--port", str(_free_port())], env=env, cwd=REPO, capture_output=True,
            timeout=300)
        console = result.stdout.decode(errors="replace")
        assert result.returncode == code, console[-3000:] + result.stderr.decode()[-2000:]
        for line in lines:
            assert line in console, console[-3000:]
