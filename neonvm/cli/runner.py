"""``neonvm runner``: run the VM runner, or show the QEMU command line it would run.

``neonvm runner run`` is ``neonvm-runner`` under the main command (same flags and
environment variables). ``neonvm runner qemu-command`` builds the QEMU invocation for a
spec without starting anything, for reviewing what a spec turns into.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from neonvm.cli.output import OUTPUT_OPTION, emit
from neonvm.runner.errors import RunnerError
from neonvm.runner.main import execute, options_from_click, plan_launch, runner_options


@click.group()
def runner() -> None:
    """The program inside a runner pod: runs one VM in QEMU."""


@runner.command("run")
@runner_options
def run(**kwargs: Any) -> None:
    """Run the VM until it ends (see ``neonvm-runner --help`` for exit codes)."""
    execute(options_from_click(**kwargs))


@runner.command("qemu-command")
@runner_options
@OUTPUT_OPTION
def qemu_command(output: str, **kwargs: Any) -> None:
    """Print the QEMU command line for a spec; starts nothing, creates nothing."""
    options = options_from_click(**kwargs)
    work_dir = options.work_dir or Path("/vm/run")
    try:
        launch = plan_launch(options, os.environ, work_dir)
    except RunnerError as exc:
        raise click.ClickException(str(exc)) from None
    plan = launch.plan
    if output == "table":
        emit(_option_rows(plan.argv), output, columns=["option", "value"])
        return
    emit({
        "vm": launch.loaded.key,
        "accel": launch.accel,
        "port": launch.port,
        "argv": list(plan.argv),
        "kernelCmdline": plan.kernel_cmdline,
        "cpus": {"vcpus": plan.cpus.vcpus, "maxVcpus": plan.cpus.max_vcpus},
        "memory": {"bootBytes": plan.memory.boot_bytes,
                   "currentBytes": plan.memory.current_bytes,
                   "maxBytes": plan.memory.max_bytes},
        "diskImages": [{"name": d.name, "kind": d.kind, "path": str(d.path),
                        "sizeBytes": d.size_bytes} for d in plan.disk_images],
        "requiredFiles": [{"what": w, "path": str(p)} for w, p in plan.required_files],
        "guestConfig": dict(plan.guest_config),
    }, output)


def _option_rows(argv: tuple[str, ...]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [{"option": "(binary)", "value": argv[0]}]
    i = 1
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            rows.append({"option": argv[i], "value": argv[i + 1]})
            i += 2
        else:
            rows.append({"option": argv[i], "value": ""})
            i += 1
    return rows


@runner.command("kvm-device-plugin")
@click.option("--resource", default="devices.kubevirt.io/kvm", show_default=True,
              envvar="NEONVM_KVM_RESOURCE", help="Extended resource to advertise.")
@click.option("--count", type=click.IntRange(1, 10000), default=100, show_default=True,
              help="How many pods may hold it at once on a node (all share /dev/kvm).")
@click.option("--device", type=click.Path(path_type=Path), default=Path("/dev/kvm"),
              show_default=True, help="The device node handed to containers.")
@click.option("--plugin-dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("/var/lib/kubelet/device-plugins"), show_default=True,
              help="The kubelet's device plugin directory (kubelet.sock).")
@click.option("--probe", type=click.Path(path_type=Path), default=None,
              help="Path whose existence means the device is healthy [default: --device].")
def kvm_device_plugin(resource: str, count: int, device: Path, plugin_dir: Path,
                      probe: Path | None) -> None:
    """A kubelet device plugin giving /dev/kvm to runner pods (the chart's DaemonSet)."""
    from neonvm.runner import kvmplugin

    kvmplugin.main(resource, count, device, plugin_dir, probe)
