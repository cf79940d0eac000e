"""``neonvm-runner``: the program inside a runner pod. Runs one VM and exits with its fate.

Order of work, each step failing with one line and exit code 1 before anything runs:
load and decode the spec, find QEMU, choose KVM or TCG, build the QEMU command line,
check that every file and tool it needs exists. Then: serve HTTP (``/healthz``, ``/scale``,
``/ready``, ``/status``, ``/metrics``), create the disks, start QEMU and supervise it
until it exits (see :mod:`neonvm.runner.supervisor` for SIGTERM). The exit code says how
the VM ended (:class:`~neonvm.runner.state.ExitCode`), and the one-line reason also goes
to ``/dev/termination-log``, where Kubernetes shows it as the container's message.

Every flag has an environment variable (``NEONVM_...``), so the controller can configure
the runner through the pod's env alone.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import click
from loguru import logger

from neonvm import logs
from neonvm.api.rights import (
    DEFAULT_RIGHT_SECONDS,
    RIGHT_SECONDS_ENV,
    RIGHTS_CLOSED_ENV,
    RIGHTS_TOKEN_FILE_ENV,
    RIGHTS_URL_ENV,
)
from neonvm.api.scale_protocol import ScaleLimits, ScaleTarget, parse_fence_floor
from neonvm.runner.cpulimit import CpuLimiter, limiter_for
from neonvm.runner.diskimage import ImageError, root_has_path
from neonvm.runner.disks import DiskTools, check_prerequisites, prepare
from neonvm.runner.errors import HostError, RunnerError, SpecError
from neonvm.runner.guestboot import EXT_MAGIC_OFFSET, is_bare_ext_filesystem, read_first_bytes
from neonvm.runner.guestnet import NOTHING_BLOCKED, Blocked, GuestNetFilter, ipv6_nameserver
from neonvm.runner.host import (
    Accel,
    AccelChoice,
    acceleration_unavailable,
    choose_accel,
    find_binary,
    optional_binary,
    probe_kvm,
)
from neonvm.runner.initramfs import RunnerKernel, find_runner_kernel
from neonvm.runner.metrics import runner_registry
from neonvm.runner.qemu import CpuScalingMode, LaunchContext, LaunchPlan, build_launch_plan
from neonvm.runner.right import SelfFence, right_config, rights_blocked
from neonvm.runner.runtimedisk import GUEST_INIT
from neonvm.runner.scaling import Scaler
from neonvm.runner.server import RunnerHTTPServer
from neonvm.runner.spec import ENV_SPEC_FILE, LoadedSpec, load_spec
from neonvm.runner.state import ExitCode, Outcome, RunnerState, Sizing
from neonvm.runner.supervisor import ShutdownPolicy, Supervisor, shutdown_budget

DEFAULT_PORT = 25183
DEFAULT_READY_MARKER = "NEONVM_GUEST_READY"
DEFAULT_KERNEL_DIR = Path("/vm/kernel")


@dataclass(frozen=True)
class RunnerOptions:
    """The runner's settings (flags or ``NEONVM_*`` variables)."""

    spec_file: Path | None = None
    port: int | None = None
    listen_address: str = "0.0.0.0"
    work_dir: Path | None = None
    disks_dir: Path = Path("/vm/disks")
    qemu: str = "qemu-system-x86_64"
    accel: AccelChoice = "auto"
    ready_marker: str = DEFAULT_READY_MARKER
    grace_margin: float = 3.0
    shutdown_timeout: float | None = None
    powerdown_interval: float = 5.0
    root_disk: Path | None = None
    termination_log: Path | None = Path("/dev/termination-log")
    scaling_token_file: Path | None = None
    scaling_timeout: float = 60.0
    scaling_fence_floor: str | None = None
    pod_uid: str | None = None
    cpu_scaling_mode: CpuScalingMode = "QmpScaling"
    kernel_dir: Path = DEFAULT_KERNEL_DIR
    enable_acceleration: bool = False
    kvm_device: Path = Path("/dev/kvm")
    rights_url: str | None = None
    rights_token_file: Path | None = None
    right_seconds: float = DEFAULT_RIGHT_SECONDS
    rights_closed_url: str | None = None
    ssh_authorized_keys_file: Path | None = None


@dataclass(frozen=True)
class Launch:
    """Everything decided before anything is started."""

    loaded: LoadedSpec
    plan: LaunchPlan
    accel: Accel
    accel_reason: str
    port: int
    tools: DiskTools
    acceleration_unavailable: str | None = None


def plan_launch(options: RunnerOptions, env: Mapping[str, str], work_dir: Path,
                accel: Accel | None = None) -> Launch:
    """Decode the spec and build the QEMU plan (raises :class:`RunnerError`). Starts nothing."""
    loaded = load_spec(options.spec_file, env)
    spec = loaded.spec
    port = options.port or spec.runner_port or DEFAULT_PORT
    qemu = find_binary(options.qemu, "qemu binary")
    reason = "chosen by the caller"
    unavailable: str | None = None
    if accel is None:
        probe = probe_kvm(options.kvm_device)
        accel = choose_accel(options.accel, probe)
        reason = "forced by --accel" if options.accel != "auto" else probe.reason
        wanted = options.enable_acceleration or spec.enable_acceleration is True
        unavailable = acceleration_unavailable(options.accel, wanted, probe)
    writable = frozenset(
        d.name for d in spec.disks or []
        if d.empty_disk is not None and (options.disks_dir / d.name).is_dir()
        and os.access(options.disks_dir / d.name, os.W_OK))
    tools = DiskTools(qemu_img=optional_binary("qemu-img"),
                      mkfs_ext4=optional_binary("mkfs.ext4"))
    runner_kernel = _runner_kernel_for(options, spec.guest.kernel_image,
                                       spec.guest.root_disk.image, tools)
    ctx = LaunchContext(
        qemu_binary=qemu, accel=accel, work_dir=work_dir, runner_port=port,
        disks_dir=options.disks_dir, writable_disk_dirs=writable,
        listen_address=options.listen_address, root_disk_override=options.root_disk,
        vm_name=loaded.name, vm_namespace=loaded.namespace, ready_marker=options.ready_marker,
        cpu_scaling_mode=options.cpu_scaling_mode,
        runner_kernel=runner_kernel,
        guest_init=runner_kernel is not None and _carries_guest_init(
            options.root_disk or Path(spec.guest.root_disk.image or ""), tools),
        ssh_authorized_keys=read_authorized_keys(options.ssh_authorized_keys_file))
    plan = build_launch_plan(spec, ctx)
    return Launch(loaded=loaded, plan=plan, accel=accel, accel_reason=reason, port=port,
                  tools=tools, acceleration_unavailable=unavailable)


SSH_KEYS_LIMIT = 64 * 1024
"""The most of an authorized_keys file the runner reads (one ed25519 line is ~100 bytes)."""


def read_authorized_keys(path: Path | None) -> bytes | None:
    """The SSH public key file's contents; None when not given, absent (the Secret's
    volume is optional), empty, unreadable, or over :data:`SSH_KEYS_LIMIT` (a Secret
    planted under the VM's SSH name: the guest then boots without a key, and the log says
    why; docs/security.md, "Secrets of the namespace")."""
    if path is None:
        return None
    try:
        with path.open("rb") as f:
            data = f.read(SSH_KEYS_LIMIT + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("no SSH key for the guest: {path} unreadable: {err}", path=path, err=exc)
        return None
    if len(data) > SSH_KEYS_LIMIT:
        logger.warning("no SSH key for the guest: {path} holds more than {limit} bytes",
                       path=path, limit=SSH_KEYS_LIMIT)
        return None
    return data if data.strip() else None


def _runner_kernel_for(options: RunnerOptions, kernel_image: str | None,
                       root_image: str | None, tools: DiskTools) -> RunnerKernel | None:
    """The runner's kernel, when the spec names none and the root disk is a bare filesystem.

    A root disk with a partition table (or anything else) is left to the firmware, as
    before. A bare filesystem without a runner kernel is a one-line error: nothing could
    boot it.
    """
    if kernel_image:
        return None
    root = options.root_disk or (Path(root_image) if root_image else None)
    if root is None or not root.is_file() or not os.access(root, os.R_OK):
        return None  # the prerequisites check names a missing image
    head = read_first_bytes(root, EXT_MAGIC_OFFSET + 2, tools.qemu_img)
    if not is_bare_ext_filesystem(head):
        return None
    found = find_runner_kernel(options.kernel_dir)
    if found is None:
        raise SpecError(f"the root disk {root} is a bare ext4 filesystem, which needs a "
                        f"kernel: guest.kernelImage is empty and there is no runner kernel "
                        f"(vmlinuz, initrd.cpio) in {options.kernel_dir}")
    return found


def _carries_guest_init(root: Path, tools: DiskTools) -> bool:
    """Whether the bare-ext4 root disk holds vm-builder's ``/neonvm/bin/init``.

    An image this runner cannot read that way is booted with the runner's own init, and
    the log says why."""
    try:
        return root_has_path(root, GUEST_INIT, tools.qemu_img)
    except (ImageError, OSError) as exc:
        logger.warning("cannot look for {} in the root disk {} ({}): booting the runner's "
                       "init", GUEST_INIT, root, exc)
        return False


def ready_marker_for(plan: LaunchPlan, marker: str) -> str:
    """The console line ``/ready`` waits for: none for a vm-builder guest, which never
    prints one. There, as in NeonVM's runner (QmpScaling), the guest is ready once QEMU
    runs and QMP says ``running`` (docs/runner.md, "The vm-builder boot contract")."""
    return "" if plan.guest_init is not None else marker


def guest_blocked(rights_url: str | None, closed_url: str | None) -> Blocked:
    """What the guest's network filter closes besides the loopback: the rights URL's port
    when the runner self-fences, else the port of the rights URL it is told to close
    (``--rights-closed-url``: the leader's listener is reachable from any pod,
    docs/security.md, "Rights endpoint"), else nothing."""
    url = rights_url or closed_url
    return rights_blocked(url) if url else NOTHING_BLOCKED


def run_runner(options: RunnerOptions, env: Mapping[str, str], console: BinaryIO) -> int:
    """Run the VM to its end; returns the exit code. Raises RunnerError before QEMU starts."""
    early_stop: list[str] = []
    previous = _record_signals(early_stop.append)
    created_work_dir = options.work_dir is None
    work_dir = options.work_dir or Path(tempfile.mkdtemp(prefix="neonvm-runner-"))
    http: RunnerHTTPServer | None = None
    net_filter: GuestNetFilter | None = None
    right: SelfFence | None = None
    limiter: CpuLimiter | None = None
    try:
        try:
            work_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise HostError(f"cannot create work dir {work_dir}: {exc.strerror or exc}") from None
        launch = plan_launch(options, env, work_dir)
        check_prerequisites(launch.plan, launch.tools)
        log = logger.bind(vm=launch.loaded.key)
        log.info("accelerator {} ({})", launch.accel, launch.accel_reason)
        if launch.acceleration_unavailable:
            log.warning("{}", launch.acceleration_unavailable)
            _write_termination_text(options.termination_log,
                                    launch.acceleration_unavailable + "\n")
        plan = launch.plan
        log.info("boot: {}{}{}", plan.boot,
                 f" ({plan.argv[plan.argv.index('-kernel') + 1]})" if "-kernel" in plan.argv
                 else "",
                 f", the root disk's own init {plan.guest_init} with a runtime disk "
                 "(vm-builder image; ready when QEMU runs)" if plan.guest_init else "")
        ready_marker = ready_marker_for(plan, options.ready_marker)
        state = RunnerState(
            vm=launch.loaded.key, accel=launch.accel, ready_marker=ready_marker,
            acceleration_unavailable=launch.acceleration_unavailable,
            sizing=Sizing(vcpus=plan.cpus.vcpus, max_vcpus=plan.cpus.max_vcpus,
                          memory_bytes=plan.memory.current_bytes,
                          max_memory_bytes=plan.memory.max_bytes))
        scaler = make_scaler(launch, state, work_dir, options)
        if options.rights_url:  # self-fencing (docs/runner.md, "Self-fencing")
            if optional_binary("setpriv") is None:
                raise HostError("--rights-url needs setpriv (util-linux): without "
                                "--pdeathsig a runner that dies leaves QEMU unwatched")
            right = SelfFence(right_config(
                options.rights_url, options.right_seconds, launch.loaded.namespace,
                launch.loaded.name, options.pod_uid, options.scaling_token_file,
                options.rights_token_file))
            right.start()
        http = RunnerHTTPServer(state, runner_registry(state), options.listen_address,
                                launch.port, scaler)
        http.start()
        log.info("serving /healthz /ready /status /metrics /scale on {}:{} (PUT /scale {})",
                 options.listen_address, http.port,
                 "needs the bearer token" if options.scaling_token_file else
                 "refused: no --scaling-token-file")
        prepare(plan, launch.tools)
        if plan.guest_frames_socket is not None and plan.passed_frames_socket is not None:
            # Before QEMU starts: QEMU connects to both sockets at start.
            net_filter = GuestNetFilter(
                plan.guest_frames_socket, plan.passed_frames_socket,
                dns6=ipv6_nameserver(_resolv_conf()),
                blocked=guest_blocked(options.rights_url, options.rights_closed_url))
            net_filter.listen()
            net_filter.start()
        policy = ShutdownPolicy(
            budget_seconds=shutdown_budget(
                launch.loaded.spec.termination_grace_period_seconds, options.grace_margin,
                options.shutdown_timeout),
            powerdown_interval_seconds=options.powerdown_interval)
        supervisor = Supervisor(plan, state, policy, console, ready_marker,
                                launch.loaded.key, pdeathsig_wrapper=optional_binary("setpriv"),
                                scaler=scaler, right=right)
        limiter = limiter_for(env, int(launch.loaded.spec.guest.cpus.current), state.qemu_pid,
                              state.cpu_limit_applied, int(launch.loaded.spec.guest.cpus.max))
        if limiter is not None:
            limiter.start()
        outcome = asyncio.run(_supervise(supervisor, early_stop))
        _write_termination_log(options.termination_log, outcome,
                               launch.acceleration_unavailable)
        return int(outcome.exit_code)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if right is not None:
            right.stop()
        if limiter is not None:
            limiter.stop()
        if http is not None:
            http.stop()
        if net_filter is not None:
            net_filter.stop()
        if created_work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)


def make_scaler(launch: Launch, state: RunnerState, work_dir: Path,
                options: RunnerOptions) -> Scaler:
    """The live-scaling handler: bounds from the spec, fence file in the work dir."""
    plan = launch.plan
    cpus = launch.loaded.spec.guest.cpus
    limits = ScaleLimits(min_vcpus=max(1, cpus.min.rounded_up()), max_vcpus=plan.cpus.max_vcpus,
                         min_slots=plan.memory.min_slots, max_slots=plan.memory.max_slots,
                         slot_bytes=plan.memory.slot_bytes)
    return Scaler(work_dir, options.scaling_token_file, limits,
                  boot=ScaleTarget(vcpus=plan.cpus.vcpus, memory_slots=plan.memory.use_slots),
                  request_timeout=options.scaling_timeout,
                  on_size=lambda size: state.plugged(size.vcpus, size.memory_bytes),
                  agent_socket=plan.agent_socket,
                  guest_cpus=lambda: state.snapshot().guest_cpus_online,
                  fence_floor=(parse_fence_floor(options.scaling_fence_floor)
                               if options.scaling_fence_floor else None),
                  pod_uid=options.pod_uid or None)


def _record_signals(record: Callable[[str], None]) -> dict[int, Any]:
    """Until the supervisor runs, SIGTERM/SIGINT are remembered rather than fatal."""
    previous: dict[int, Any] = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous[signum] = signal.getsignal(signum)
        signal.signal(signum, lambda n, _frame: record(signal.Signals(n).name))
    return previous


async def _supervise(supervisor: Supervisor, early_stop: list[str]) -> Outcome:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, supervisor.request_stop, signal.Signals(signum).name)
    for name in early_stop:
        supervisor.request_stop(name)
    try:
        return await supervisor.run()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


def _write_termination_log(path: Path | None, outcome: Outcome,
                           prefix: str | None = None) -> None:
    """Kubernetes shows this file's content as the container's termination message."""
    text = f"{outcome.reason} (exit {int(outcome.exit_code)})\n"
    _write_termination_text(path, (prefix + "\n" if prefix else "") + text)


def _write_termination_text(path: Path | None, text: str) -> None:
    if path is None or not path.exists():
        return
    try:
        path.write_text(text)
    except OSError as exc:
        logger.debug("cannot write {}: {}", path, exc)


# ---- the command ---------------------------------------------------------------------------


def runner_options(command: Callable[..., None]) -> Callable[..., None]:
    """The runner's flags, shared by ``neonvm-runner`` and ``neonvm runner run``."""
    options = [
        click.option("--spec-file", type=click.Path(dir_okay=False, path_type=Path),
                     envvar=ENV_SPEC_FILE,
                     help="VM spec (JSON or YAML; a spec or a whole VirtualMachine). "
                          "Runner pods mount it from a pod annotation. Fallback: "
                          "$NEONVM_VM_SPEC."),
        click.option("--port", type=click.IntRange(1, 65535), envvar="NEONVM_RUNNER_PORT",
                     help=f"HTTP port [default: spec.runnerPort, else {DEFAULT_PORT}]"),
        click.option("--listen-address", default="0.0.0.0", show_default=True,
                     envvar="NEONVM_LISTEN_ADDRESS",
                     help="Address for HTTP and guest port forwards (spec.qmp opens "
                          "no TCP port: a unix socket in the work dir)."),
        click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path),
                     envvar="NEONVM_WORK_DIR",
                     help="QMP socket, root overlay, disk images [default: a temp dir, "
                          "removed at exit]"),
        click.option("--disks-dir", type=click.Path(file_okay=False, path_type=Path),
                     default=Path("/vm/disks"), show_default=True, envvar="NEONVM_DISKS_DIR",
                     help="Where the pod mounts each extra disk's volume (<dir>/<name>)."),
        click.option("--qemu", default="qemu-system-x86_64", show_default=True,
                     envvar="NEONVM_QEMU", help="QEMU binary (name on PATH or a path)."),
        click.option("--accel", type=click.Choice(["auto", "kvm", "tcg"]), default="auto",
                     show_default=True, envvar="NEONVM_ACCEL",
                     help="auto: KVM when usable, else TCG."),
        click.option("--ready-marker", default=DEFAULT_READY_MARKER, show_default=True,
                     envvar="NEONVM_READY_MARKER",
                     help="Serial-console line that means the guest has booted; '' for "
                          "QMP 'running' alone."),
        click.option("--grace-margin", type=click.FloatRange(0), default=3.0,
                     show_default=True, envvar="NEONVM_GRACE_MARGIN",
                     help="Seconds kept back from terminationGracePeriodSeconds to kill "
                          "QEMU and exit before the kubelet does."),
        click.option("--shutdown-timeout", type=click.FloatRange(0), default=None,
                     envvar="NEONVM_SHUTDOWN_TIMEOUT",
                     help="Seconds the guest gets to power off [default: grace period "
                          "minus margin]"),
        click.option("--powerdown-interval", type=click.FloatRange(0.1), default=5.0,
                     show_default=True, envvar="NEONVM_POWERDOWN_INTERVAL",
                     help="Seconds between repeated ACPI power-button presses."),
        click.option("--root-disk", type=click.Path(dir_okay=False, path_type=Path),
                     envvar="NEONVM_ROOT_DISK",
                     help="Root disk image file, overriding spec.guest.rootDisk.image."),
        click.option("--termination-log", type=click.Path(dir_okay=False, path_type=Path),
                     default=Path("/dev/termination-log"), show_default=True,
                     envvar="NEONVM_TERMINATION_LOG",
                     help="Where the exit reason is written, if the file exists."),
        click.option("--scaling-token-file", type=click.Path(dir_okay=False, path_type=Path),
                     envvar="NEONVM_SCALING_TOKEN_FILE",
                     help="File holding the bearer token PUT /scale must present (re-read "
                          "per request). Without it, PUT /scale is refused (401)."),
        click.option("--pod-uid", envvar="NEONVM_POD_UID",
                     help="This pod's uid (downward API): PUT /scale then expects the "
                          "bearer HMAC-SHA256(token file, pod uid), so a token meant for "
                          "another pod is refused."),
        click.option("--scaling-fence-floor", envvar="NEONVM_SCALING_FENCE_FLOOR",
                     callback=_check_floor,
                     help="epoch,token,seq: with no fence file in the work dir yet, refuse "
                          "PUT /scale fences up to this one (the controller sets it in a new "
                          "pod to the VM's scaling fence when the pod was created)."),
        click.option("--scaling-timeout", type=click.FloatRange(1), default=60.0,
                     show_default=True, envvar="NEONVM_SCALING_TIMEOUT",
                     help="Seconds a PUT /scale waits for the guest to eject vCPUs or "
                          "DIMMs before answering 504."),
        click.option("--cpu-scaling-mode", type=click.Choice(["QmpScaling", "SysfsScaling"]),
                     default="QmpScaling", show_default=True,
                     envvar="NEONVM_CPU_SCALING_MODE",
                     help="QmpScaling: vCPUs are hot-plugged over QMP. SysfsScaling: all "
                          "max vCPUs at boot, the guest agent onlines 'use' of them."),
        click.option("--enable-acceleration/--no-enable-acceleration", default=False,
                     show_default=True, envvar="NEONVM_ENABLE_ACCELERATION",
                     help="The VM asked for KVM (spec.enableAcceleration; runner pods get "
                          "it from the controller). If KVM is not usable the guest still "
                          "runs under TCG, and the runner reports AccelerationUnavailable "
                          "(log, /status, metric, termination message)."),
        click.option("--kvm-device", type=click.Path(path_type=Path), default=Path("/dev/kvm"),
                     show_default=True, envvar="NEONVM_KVM_DEVICE",
                     help="The KVM device to probe."),
        click.option("--kernel-dir", type=click.Path(file_okay=False, path_type=Path),
                     default=DEFAULT_KERNEL_DIR, show_default=True,
                     envvar="NEONVM_KERNEL_DIR",
                     help="The runner's kernel (vmlinuz) and initramfs (initrd.cpio), booted "
                          "when the spec names no kernel and the root disk is a bare ext4 "
                          "filesystem."),
        click.option("--rights-url", envvar=RIGHTS_URL_ENV,
                     help="Self-fencing: the leader's rights endpoint (http://host:port). "
                          "QEMU starts only once a right to run is granted, and is killed "
                          "(SIGKILL) when the right is not renewed in time. Needs --pod-uid "
                          "and --rights-token-file or --scaling-token-file. Absent: no "
                          "self-fencing."),
        click.option("--rights-token-file", type=click.Path(dir_okay=False, path_type=Path),
                     envvar=RIGHTS_TOKEN_FILE_ENV,
                     help="Self-fencing: the pod's projected ServiceAccount token of the "
                          "controller's rights audience, sent as the ask's bearer (re-read "
                          "per ask); without it the bearer is derived from "
                          "--scaling-token-file."),
        click.option("--rights-closed-url", envvar=RIGHTS_CLOSED_ENV,
                     help="Without self-fencing: a rights endpoint (http://host:port) whose "
                          "port the guest's network filter closes all the same (the "
                          "controller sets it while it serves rights)."),
        click.option("--right-seconds", type=click.FloatRange(0, min_open=True),
                     default=DEFAULT_RIGHT_SECONDS, show_default=True,
                     envvar=RIGHT_SECONDS_ENV,
                     help="How long one right lasts, counted from the ask's send time; "
                          "renewed every third of it."),
        click.option("--ssh-authorized-keys-file",
                     type=click.Path(dir_okay=False, path_type=Path),
                     envvar="NEONVM_SSH_AUTHORIZED_KEYS_FILE",
                     help="The VM's SSH public key (spec.enableSSH; the controller mounts it "
                          "from the VM's Secret). A vm-builder guest gets it on a disk "
                          "labelled ssh-authorized-keys; absent or empty: no such disk."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _check_floor(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value:
        try:
            parse_fence_floor(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    return value or None


def options_from_click(**kwargs: object) -> RunnerOptions:
    return RunnerOptions(**kwargs)  # type: ignore[arg-type]


def execute(options: RunnerOptions) -> None:
    """Run and exit with the runner's code; expected failures are one line on stderr."""
    try:
        code = run_runner(options, os.environ, sys.stdout.buffer)
    except RunnerError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(int(ExitCode.RUNNER_ERROR))
    sys.exit(code)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@runner_options
@click.option("--log-level", default="INFO", show_default=True, envvar="NEONVM_LOG_LEVEL",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--log-format", default="text", show_default=True, envvar="NEONVM_LOG_FORMAT",
              type=click.Choice(["text", "json"]), help="json: one JSON object per line.")
def main(log_level: str, log_format: str, **kwargs: object) -> None:
    """Run one NeonVM VirtualMachine in QEMU: the program inside a runner pod.

    The guest's serial console goes to stdout, the runner's logs to stderr. Exit codes:
    0 guest powered off, 1 cannot start (bad spec, missing file or tool), 2 bad flags,
    3 guest killed after the grace period, 4 QEMU failed, 5 guest rebooted or crashed.
    """
    logs.configure(log_level, log_format)
    execute(options_from_click(**kwargs))


def _resolv_conf() -> str:
    """The container's ``/etc/resolv.conf`` ("" if unreadable: no nameserver)."""
    try:
        return Path("/etc/resolv.conf").read_text(errors="replace")
    except OSError:
        return ""


if __name__ == "__main__":
    main()

