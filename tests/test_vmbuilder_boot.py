"""NeonVM's vm-builder boot contract: a root disk carrying ``/neonvm/bin/init`` boots that
init with the runner's runtime disk, and its ENTRYPOINT, services and readiness work.

Pure parts (runtime files, the ISO 9660 writer, the ext4 lookup in raw and qcow2 images,
the plan) are quick unit tests. The boots under TCG are opt-in like
``tests/test_runner_kernel.py``: ``NEONVM_TEST_BOOT=1 pytest tests/test_vmbuilder_boot.py``.
docs/runner.md, "The vm-builder boot contract", is the specification.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from neonvm.api.schema import decode
from neonvm.api.types import VirtualMachineSpec
from neonvm.dev import guestdisk, vmbuilderdisk
from neonvm.runner import diskimage, runtimedisk
from neonvm.runner.errors import SpecError
from neonvm.runner.initramfs import RunnerKernel
from neonvm.runner.main import RunnerOptions, plan_launch, ready_marker_for
from neonvm.runner.qemu import build_launch_plan
from tests.support import wait_for
from tests.support.runner import context
from tests.support.vmbuilder_boot import (  # boot_kit: the fixture
    REPO,
    boot_kit,  # noqa: F401
    boot_skip_reason,
    free_port,
    http_get,
    port_in_use,
)

TOOLS = "/usr/sbin:/sbin:/usr/bin:/bin"
RUNNER_KERNEL = RunnerKernel(kernel=Path("/vm/kernel/vmlinuz"),
                             initrd=Path("/vm/kernel/initrd.cpio"))


def spec_of(data: dict[str, Any]) -> VirtualMachineSpec:
    return decode(VirtualMachineSpec, data, ".spec")


def files_for(**kw: Any) -> dict[str, bytes]:
    args: dict[str, Any] = {"command": None, "args": None, "env": [], "settings": None,
                            "disks": [], "swap_bytes": None, "boot_memory_bytes": 1 << 30}
    args.update(kw)
    return runtimedisk.runtime_files(**args)


def tool(name: str) -> str:
    found = shutil.which(name, path=TOOLS)
    if found is None:
        pytest.skip(f"{name} not installed")
    return found


# ---- the runtime disk's files (pure, and run in a real shell) ------------------------------


@pytest.mark.unit
def test_args_without_command_is_only_args_sh_so_the_image_entrypoint_stays() -> None:
    files = files_for(args=["--port", "5432"])
    assert "command.sh" not in files
    assert files["args.sh"] == b"'--port' '5432'"


@pytest.mark.unit
def test_without_command_or_args_neither_file_exists_so_the_image_runs_as_baked() -> None:
    files = files_for()
    assert sorted(files) == ["mounts.sh", "sysctl.conf"]
    assert files["sysctl.conf"] == b"kernel.core_pattern=core\nkernel.core_uses_pid=1\n"
    assert files["mounts.sh"] == b"set -euo pipefail\n"


@pytest.mark.unit
def test_command_args_and_env_are_shell_words_a_spec_cannot_inject_into(tmp_path: Path) -> None:
    nasty = "x'; echo INJECTED; '$(echo INJECTED)`echo INJECTED`"
    files = files_for(command=["printf", "<%s>\\n"], args=[nasty, "a b"],
                      env=[("GREETING", nasty)])
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    # vm-builder's vmstart: env.sh, then command.sh, a space, args.sh, in one script.
    starter = (files["env.sh"] + files["command.sh"] + b" " + files["args.sh"] + b"\n"
               + b'printf "env <%s>\\n" "$GREETING"\n')
    out = subprocess.run(["sh", "-c", starter.decode()], capture_output=True, text=True,
                         check=True).stdout
    assert out.splitlines() == [f"<{nasty}>", "<a b>", f"env <{nasty}>"]


@pytest.mark.unit
def test_sysctls_follow_neonvms_two_and_env_names_are_checked() -> None:
    files = files_for(settings={"sysctl": ["vm.swappiness = 17"]})
    assert files["sysctl.conf"].decode().splitlines() == [
        "kernel.core_pattern=core", "kernel.core_uses_pid=1", "vm.swappiness=17"]
    with pytest.raises(SpecError, match="not a valid variable name"):
        files_for(env=[("BAD-NAME", "x")])


@pytest.mark.unit
def test_mounts_sh_mounts_disks_by_label_tmpfs_by_size_and_makes_the_swap(tmp_path: Path) -> None:
    files = files_for(
        disks=[{"name": "data", "source": "emptyDisk", "mountPath": "/data", "label": "data"},
               {"name": "cfg", "source": "configMap", "mountPath": "/etc/cfg dir",
                "label": "cfg", "readOnly": True},
               {"name": "scratch", "source": "tmpfs", "mountPath": "/scratch",
                "size": 8 << 20}],
        swap_bytes=1 << 30, boot_memory_bytes=1 << 30)
    # Run it against stand-ins that log their argv: the order and the words are the contract.
    bin_dir = tmp_path / "neonvm" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls"
    for name in ("sh", "mkdir", "chmod", "mount", "blkid"):
        out = "/dev/vdx" if name == "blkid" else ""
        (bin_dir / name).write_text(f"#!/bin/sh\necho {name} \"$@\" >> {log}\n"
                                    f"[ -n '{out}' ] && echo {out}\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    script = files["mounts.sh"].decode().replace("/neonvm/bin/", f"{bin_dir}/")
    subprocess.run(["bash", "-c", script], check=True)
    assert log.read_text().splitlines() == [
        "sh /neonvm/runtime/resize-swap-internal.sh 1073741824",
        "mkdir -p /data", "blkid -L data", "mount /dev/vdx /data", "chmod 0777 /data",
        "mkdir -p /etc/cfg dir", "blkid -L cfg", "mount -o ro /dev/vdx /etc/cfg dir",
        "mkdir -p /scratch", "chmod 0777 /scratch",
        f"mount -t tmpfs -o size={8 << 20} scratch /scratch",
        "mount -o remount,size=1073741824 /dev/shm",  # swap above half the boot memory
    ]
    assert b"mkswap -L swapdisk" in files["resize-swap-internal.sh"]


@pytest.mark.unit
def test_the_swap_disk_carries_the_label_the_guest_looks_for(tmp_path: Path) -> None:
    blkid = tool("blkid")
    disk = tmp_path / "swap.raw"
    disk.write_bytes(runtimedisk.swap_header(64 << 20))
    os.truncate(disk, 64 << 20)
    out = subprocess.run([blkid, "-p", "-o", "export", str(disk)], capture_output=True,
                         text=True, check=True).stdout
    assert "TYPE=swap" in out.splitlines() and "LABEL=swapdisk" in out.splitlines()


# ---- the ISO 9660 image ---------------------------------------------------------------------


@pytest.mark.unit
def test_the_runtime_disk_is_an_iso9660_volume_vmruntime_other_tools_read(tmp_path: Path) -> None:
    files = files_for(command=["/bin/app"], args=["x"], env=[("A", "b")],
                      swap_bytes=1 << 20)
    image = runtimedisk.iso9660_image(files)
    assert image == runtimedisk.iso9660_image(dict(reversed(list(files.items()))))
    iso = tmp_path / "runtime.iso"
    iso.write_bytes(image)
    blkid = tool("blkid")
    out = subprocess.run([blkid, "-p", "-o", "export", str(iso)], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert "TYPE=iso9660" in out and "LABEL=vmruntime" in out
    isoinfo = shutil.which("isoinfo")  # genisoimage; optional
    if isoinfo is None:
        return
    for name, data in files.items():
        got = subprocess.run([isoinfo, "-i", str(iso), "-x", f"/{name.upper()};1"],
                             capture_output=True, check=True).stdout
        assert got == data, name


@pytest.mark.unit
def test_iso_names_are_plain_lower_case_names() -> None:
    assert runtimedisk.iso_name("resize-swap-internal.sh") == b"RESIZE-SWAP-INTERNAL.SH;1"
    for bad in ("Upper.sh", "a/b", "x" * 31, ""):
        with pytest.raises(ValueError):
            runtimedisk.iso_name(bad)


# ---- finding /neonvm/bin/init in an image ---------------------------------------------------


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    mkfs, qemu_img = tool("mkfs.ext4"), tool("qemu-img")
    mkfs2 = tool("mkfs.ext2")
    root = tmp_path_factory.mktemp("images")
    tree = root / "tree"
    (tree / "neonvm" / "bin").mkdir(parents=True)
    (tree / "neonvm" / "bin" / "busybox").write_bytes(b"\x7fELF")
    (tree / "neonvm" / "bin" / "init").symlink_to("busybox")
    (tree / "etc").mkdir()
    for i in range(2000):  # a directory of many blocks (an htree in ext4)
        (tree / "etc" / f"f{i}").write_text("")
    (tree / "link").symlink_to("neonvm/bin")
    out: dict[str, Path] = {}
    for name, make in (("ext4.raw", mkfs), ("ext2.raw", mkfs2)):
        raw = root / name
        raw.write_bytes(b"")
        os.truncate(raw, 32 << 20)
        subprocess.run([make, "-q", "-F", "-d", str(tree), str(raw)], check=True)
        out[name] = raw
    for name, extra in (("vmbuilder.qcow2", ["-o", "cluster_size=2M,lazy_refcounts=on"]),
                        ("compressed.qcow2", ["-c"])):
        out[name] = root / name
        subprocess.run([qemu_img, "convert", "-q", *extra, "-f", "raw", "-O", "qcow2",
                        str(out["ext4.raw"]), str(out[name])], check=True)
    out["backed.qcow2"] = root / "backed.qcow2"  # read through qemu-img dd
    subprocess.run([qemu_img, "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b",
                    str(out["vmbuilder.qcow2"]), str(out["backed.qcow2"])], check=True)
    return out


@pytest.mark.unit
@pytest.mark.parametrize("image", ["ext4.raw", "ext2.raw", "vmbuilder.qcow2",
                                   "compressed.qcow2", "backed.qcow2"])
def test_init_is_found_in_raw_and_qcow2_images_without_mounting(images: dict[str, Path],
                                                                image: str) -> None:
    path, qemu_img = images[image], tool("qemu-img")
    assert diskimage.root_has_path(path, "/neonvm/bin/init", qemu_img)
    assert diskimage.root_has_path(path, "/etc/f1999", qemu_img)
    assert diskimage.root_has_path(path, "/link/init", qemu_img)  # a symlink on the way
    assert not diskimage.root_has_path(path, "/neonvm/bin/missing", qemu_img)
    assert not diskimage.root_has_path(path, "/neonvm/bin/init/x", qemu_img)


@pytest.mark.unit
def test_a_disk_that_is_not_ext_is_an_image_error(tmp_path: Path) -> None:
    disk = tmp_path / "zero.raw"
    disk.write_bytes(bytes(4096))
    with pytest.raises(diskimage.ImageError):
        diskimage.root_has_path(disk, "/neonvm/bin/init", None)


# ---- the plan (pure) -----------------------------------------------------------------------


@pytest.mark.unit
def test_a_vmbuilder_root_boots_its_init_with_the_runtime_disk_as_vdb(tmp_path: Path) -> None:
    spec = spec_of({"guest": {"rootDisk": {"image": "/disks/root.qcow2"}, "args": ["x"],
                              "settings": {"swap": "64Mi"}},
                    "disks": [{"name": "data", "mountPath": "/data",
                               "emptyDisk": {"size": "16Mi"}}]})
    plan = build_launch_plan(spec, context(tmp_path, runner_kernel=RUNNER_KERNEL,
                                           guest_init=True))
    argv = plan.argv
    assert plan.guest_init == "/neonvm/bin/init"
    cmdline = argv[argv.index("-append") + 1].split()
    assert cmdline[:4] == ["console=ttyS1", "panic=-1", "init=/neonvm/bin/init", "loglevel=6"]
    assert "root=/dev/vda" in cmdline and "rw" in cmdline
    # ttyS0 goes nowhere (the image's agetty), ttyS1 is the console on stdout.
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "-serial"] == [
        "null", "chardev:console"]
    blk = [a for a in argv if a.startswith("virtio-blk-pci")]
    assert blk[0].startswith("virtio-blk-pci,drive=rootdisk,")
    assert blk[1] == "virtio-blk-pci,drive=runtime,serial=runtime"  # the guest's vdb
    runtime = [d for d in plan.disk_images if d.name == "runtime"]
    assert runtime and runtime[0].kind == "file" and runtime[0].contents is not None
    assert runtime[0].path == tmp_path / "work" / "runtime.iso"
    assert any(d.name == "swapdisk" and d.label == "swapdisk" for d in plan.disk_images)
    assert any(a.startswith(f"if=none,id=runtime,file={tmp_path}/work/runtime.iso,format=raw,"
                            "readonly=on") for a in argv)


@pytest.mark.unit
def test_a_plain_root_keeps_the_runners_own_init_and_console(tmp_path: Path) -> None:
    spec = spec_of({"guest": {"rootDisk": {"image": "/disks/root.qcow2"},
                              "command": ["/app/run"]}})
    plan = build_launch_plan(spec, context(tmp_path, runner_kernel=RUNNER_KERNEL))
    assert plan.guest_init is None
    assert "init=" not in plan.argv[plan.argv.index("-append") + 1]
    assert "null" not in plan.argv and not any("drive=runtime" in a for a in plan.argv)
    assert ready_marker_for(plan, "READY") == "READY"


@pytest.mark.unit
def test_the_runner_recognises_a_vmbuilder_disk_and_then_waits_for_no_marker(
        tmp_path: Path) -> None:
    if guestdisk.missing():
        pytest.skip("missing: " + ", ".join(guestdisk.missing()))
    tool("qemu-system-x86_64")
    _raw, vmbuilder = vmbuilderdisk.build_disk(tmp_path / "vmb")
    plain = guestdisk.build_rootfs(tmp_path / "plain")[1]
    kernel_dir = tmp_path / "kernel"
    kernel_dir.mkdir()
    for name in ("vmlinuz", "initrd.cpio"):
        (kernel_dir / name).write_bytes(b"stand-in")
    spec_file = tmp_path / "vm.yaml"
    spec_file.write_text(yaml.safe_dump({"guest": {"rootDisk": {"image": "/nonexistent"}}}))
    found = {}
    for name, disk in (("vmbuilder", vmbuilder), ("plain", plain)):
        launch = plan_launch(RunnerOptions(spec_file=spec_file, root_disk=disk,
                                           kernel_dir=kernel_dir), {}, tmp_path / name,
                             accel="tcg")
        found[name] = (launch.plan.guest_init, ready_marker_for(launch.plan, "READY"))
    assert found == {"vmbuilder": ("/neonvm/bin/init", ""), "plain": (None, "READY")}


# ---- real boots under TCG (opt-in) ----------------------------------------------------------


@contextmanager
def runner(tmp: Path, kit: tuple[Path, Path], guest: dict[str, Any],
           disks: list[dict[str, Any]] | None = None) -> Iterator[tuple[subprocess.Popen[bytes],
                                                                       Path, int]]:
    """The real runner on the vm-builder disk; yields (process, console file, HTTP port)."""
    qcow2, kernel_dir = kit
    spec = {"terminationGracePeriodSeconds": 60, "disks": disks or [], "guest": {
        "cpus": {"min": 1, "max": 1}, "memorySlotSize": "256Mi",
        "memorySlots": {"min": 1, "max": 1}, "rootDisk": {"image": str(qcow2)}, **guest}}
    spec_file = tmp / "vm.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    console = tmp / "console.log"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
    with console.open("wb") as out, (tmp / "runner.log").open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "neonvm.runner.main", "--spec-file", str(spec_file),
             "--kernel-dir", str(kernel_dir), "--accel", "tcg", "--work-dir", str(tmp / "work"),
             "--listen-address", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=err, env=env, cwd=REPO)
    try:
        yield proc, console, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_for_entrypoint(proc: subprocess.Popen[bytes], console: Path, tmp: Path) -> str:
    wait_for(lambda: b"VMBUILDER_ENTRYPOINT argv" in console.read_bytes()
             or proc.poll() is not None, timeout=300, interval=0.5,
             what="the image's ENTRYPOINT to run")
    text = console.read_text(errors="replace")
    assert proc.poll() is None, text[-3000:] + (tmp / "runner.log").read_text()[-3000:]
    wait_for(lambda: "VMBUILDER_ENTRYPOINT report done" in console.read_text(errors="replace"),
             timeout=60, interval=0.5, what="the end of the ENTRYPOINT's report")
    return console.read_text(errors="replace")


@pytest.mark.slow
@pytest.mark.skipif(boot_skip_reason() is not None, reason=boot_skip_reason() or "")
def test_a_vmbuilder_guest_runs_its_entrypoint_with_spec_args_serves_9100_and_10301_and_is_ready(
        tmp_path: Path, boot_kit: tuple[Path, Path]) -> None:  # noqa: F811
    """``args`` without ``command``: the image's ENTRYPOINT runs with the spec's args in
    place of its CMD, with the image's ENV and the spec's env; the runtime disk's sysctls,
    swap and mounts apply; the root filesystem is grown to ``rootDisk.size``; vector's
    :9100 and vm-monitor's :10301 answer through the runner's port forwards; ``/ready``
    turns 200 without any console marker; SIGTERM powers the guest off (exit 0)."""
    busy = [p for p in (vmbuilderdisk.VECTOR_PORT, vmbuilderdisk.MONITOR_PORT)
            if port_in_use(p)]
    if busy:
        pytest.skip(f"port(s) {busy} already in use on this host")
    guest = {"rootDisk": {"image": str(boot_kit[0]), "size": "64Mi"},
             "args": ["from-args", "two words"],
             "env": [{"name": "GREETING", "value": "hello 'q' $HOME"}],
             "settings": {"sysctl": ["vm.swappiness = 17"], "swap": "32Mi"},
             "ports": [{"port": vmbuilderdisk.VECTOR_PORT, "name": "vector"},
                       {"port": vmbuilderdisk.MONITOR_PORT, "name": "monitor"}]}
    disks = [{"name": "scratch", "mountPath": "/scratch", "tmpfs": {"size": "8Mi"}},
             {"name": "data", "mountPath": "/data", "emptyDisk": {"size": "16Mi"}}]
    with runner(tmp_path, boot_kit, guest, disks) as (proc, console, port):
        text = _wait_for_entrypoint(proc, console, tmp_path)
        for line in ("neonvm-init: handing over to /neonvm/bin/init of the root filesystem "
                     "(vm-builder image)",
                     "vminit: runtime disk: args.sh env.sh mounts.sh resize-swap-internal.sh "
                     "sysctl.conf",
                     "VMBUILDER_ENTRYPOINT argv: from-args two words",
                     "VMBUILDER_ENTRYPOINT GREETING=hello 'q' $HOME BAKED=from-the-image",
                     "VMBUILDER_ENTRYPOINT swappiness 17",
                     "VMBUILDER_ENTRYPOINT SwapTotal: 32764 kB",
                     "VMBUILDER_ENTRYPOINT mount /scratch tmpfs rw",
                     "VMBUILDER_ENTRYPOINT mount /data ext4 rw"):
            assert line in text, text[-4000:]
        assert "baked-cmd" not in text  # the spec's args replaced the image's CMD
        assert "NEONVM_GUEST_READY" not in text
        root_kb = int(text.split("VMBUILDER_ENTRYPOINT root-kb ")[1].split()[0])
        assert root_kb > 40 * 1024, root_kb  # the 32 MiB image grown to 64 MiB
        status, body = http_get(f"http://127.0.0.1:{port}/ready")
        assert status == 200, body
        wait_for(lambda: http_get(f"http://127.0.0.1:{vmbuilderdisk.VECTOR_PORT}/metrics")[0]
                 == 200, timeout=60, interval=1, what="the guest's :9100")
        metrics = http_get(f"http://127.0.0.1:{vmbuilderdisk.VECTOR_PORT}/metrics")[1]
        assert "host_load1{" in metrics and "host_memory_available_bytes{" in metrics
        assert http_get(f"http://127.0.0.1:{vmbuilderdisk.MONITOR_PORT}/monitor") == (
            200, "vm-monitor stand-in\n")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert "VMBUILDER_ENTRYPOINT SIGTERM" in console.read_text(errors="replace")


@pytest.mark.slow
@pytest.mark.skipif(boot_skip_reason() is not None, reason=boot_skip_reason() or "")
@pytest.mark.parametrize(("guest", "argv"), [
    ({}, "/app/entrypoint.sh baked-cmd"),  # neither: ENTRYPOINT and CMD as baked
    ({"command": ["/app/entrypoint.sh", "from-command"], "args": ["and-args"]},
     "/app/entrypoint.sh from-command and-args"),  # command replaces the ENTRYPOINT
], ids=["as-baked", "command"])
def test_without_args_the_image_cmd_runs_and_command_replaces_the_entrypoint(
        tmp_path: Path, boot_kit: tuple[Path, Path], guest: dict[str, Any], argv: str) -> None:  # noqa: F811
    with runner(tmp_path, boot_kit, guest) as (proc, console, port):
        text = _wait_for_entrypoint(proc, console, tmp_path)
        started = text.split("VMBUILDER_ENTRYPOINT argv: ")[1].splitlines()[0]
        assert f"/app/entrypoint.sh {started}".strip() == argv
        assert http_get(f"http://127.0.0.1:{port}/ready")[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
