"""What the runner knows about its VM, shared between the supervisor and the HTTP server.

The supervisor (asyncio) records facts as they happen: QEMU started, a serial line
carried the ready marker, QMP reported a run state, shutdown was requested, QEMU exited.
The HTTP server (its own thread) only reads immutable :class:`Snapshot` copies, so a probe
never sees a half-updated state and never blocks the supervisor for more than a copy.

Readiness is derived, never stored: the guest is ready when QEMU is alive, shutdown has
not been requested, QMP's last word is ``running``, and the ready marker has appeared on
the serial console since QEMU started (or no marker is configured). So a paused guest, a
lost QMP connection or a power-down in progress each make ``/ready`` fail at once.

:func:`decide_outcome` maps how QEMU ended to the runner's exit code; that code becomes the
pod's phase (0 → Succeeded, else Failed), which is how the controller learns what happened.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from enum import IntEnum
from typing import Any, Literal

Phase = Literal["Preparing", "Booting", "Running", "Stopping", "Exited"]


class ExitCode(IntEnum):
    """The runner's exit codes (docs/runner.md, "Exit codes")."""

    GUEST_POWERED_OFF = 0
    """QEMU exited 0 after the guest powered itself off (on its own or when asked)."""
    RUNNER_ERROR = 1
    """The runner could not start the VM: bad spec, missing file or tool, port in use."""
    USAGE = 2
    """Bad command-line flags (click's code)."""
    KILLED_AFTER_GRACE = 3
    """Shutdown was requested and the guest did not power off in time: QEMU was killed."""
    QEMU_FAILED = 4
    """QEMU exited non-zero, died by a signal, or was stopped by something other than
    the guest (a host-side ``quit``, a signal sent to QEMU directly)."""
    GUEST_RESET = 5
    """The guest rebooted or panicked; ``-no-reboot`` turns either into QEMU exiting."""


@dataclass(frozen=True)
class Outcome:
    exit_code: ExitCode
    reason: str


def decide_outcome(qemu_returncode: int, shutdown_reason: str | None,
                   killed_after_grace: bool, stop_requested: bool,
                   grace_seconds: float = 0.0, stderr_tail: str = "") -> Outcome:
    """The runner's exit code for how QEMU ended.

    ``shutdown_reason`` is the ``reason`` of QMP's ``SHUTDOWN`` event (None if none was
    seen). Only a guest-initiated power-off with QEMU exiting 0 counts as success.
    """
    detail = f": {stderr_tail}" if stderr_tail else ""
    if killed_after_grace:
        return Outcome(ExitCode.KILLED_AFTER_GRACE,
                       f"guest did not power off within {grace_seconds:g}s; QEMU was killed")
    if qemu_returncode < 0:
        try:
            name = signal.Signals(-qemu_returncode).name
        except ValueError:
            name = f"signal {-qemu_returncode}"
        return Outcome(ExitCode.QEMU_FAILED, f"QEMU was killed by {name}{detail}")
    if qemu_returncode > 0:
        return Outcome(ExitCode.QEMU_FAILED, f"QEMU exited with code {qemu_returncode}{detail}")
    if shutdown_reason == "guest-shutdown":
        how = "when asked to power down" if stop_requested else "on its own"
        return Outcome(ExitCode.GUEST_POWERED_OFF, f"guest powered off {how}")
    if shutdown_reason in ("guest-reset", "guest-panic"):
        return Outcome(ExitCode.GUEST_RESET,
                       f"guest {'panicked' if shutdown_reason == 'guest-panic' else 'reset'}"
                       " (reboot or crash; -no-reboot ends QEMU)")
    if shutdown_reason is None:
        return Outcome(ExitCode.QEMU_FAILED, "QEMU exited 0 without reporting why (no QMP "
                                             "SHUTDOWN event)")
    return Outcome(ExitCode.QEMU_FAILED, f"QEMU was stopped by the host ({shutdown_reason})")


@dataclass(frozen=True)
class Snapshot:
    """The runner's state at one instant (what /status returns)."""

    vm: str
    phase: Phase
    accel: str
    ready: bool
    ready_marker: str
    marker_seen: bool
    qemu_pid: int | None
    qemu_alive: bool
    qemu_started_at: float | None
    """Wall-clock time (Unix seconds) QEMU was started."""
    uptime_seconds: float | None
    boot_seconds: float | None
    """From QEMU start to the ready marker (or to QMP ``running`` without a marker)."""
    qmp_connected: bool
    qmp_status: str | None
    stop_requested_at: float | None
    shutdown_budget_seconds: float | None
    powerdown_requests: int
    shutdown_reason: str | None
    qemu_exit_code: int | None
    exit_code: int | None
    outcome: str | None
    console_lines: int
    vcpus: int
    max_vcpus: int
    memory_bytes: int
    max_memory_bytes: int
    not_ready_because: str
    guest_cpus_online: int | None = None
    """Online CPUs as the guest last reported them (its hotplug agent's console line)."""
    guest_mem_total_kb: int | None = None
    """MemTotal (KiB) as the guest last reported it."""
    guest_reported_at: float | None = None
    acceleration_unavailable: str | None = None
    """Set when the VM asked for acceleration (``enableAcceleration``) and KVM is not
    usable: why. The guest then runs under TCG; the condition is reported, not hidden."""
    cpu_limit: dict[str, Any] | None = None
    """QEMU's CPU time cap as last applied, or why there is none
    (:mod:`neonvm.runner.cpulimit`)."""

    def as_json(self) -> dict[str, Any]:
        """camelCase keys, as the rest of the API."""
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            head, *rest = key.split("_")
            out[head + "".join(p.title() for p in rest)] = value
        return out


@dataclass
class _Facts:
    phase: Phase = "Preparing"
    qemu_pid: int | None = None
    qemu_alive: bool = False
    started_mono: float | None = None
    started_wall: float | None = None
    ended_mono: float | None = None
    ready_mono: float | None = None
    marker_seen: bool = False
    qmp_connected: bool = False
    qmp_status: str | None = None
    stop_requested_wall: float | None = None
    shutdown_budget: float | None = None
    powerdown_requests: int = 0
    shutdown_reason: str | None = None
    qemu_exit_code: int | None = None
    exit_code: int | None = None
    outcome: str | None = None
    console_lines: int = 0
    guest_cpus_online: int | None = None
    guest_mem_total_kb: int | None = None
    guest_reported_at: float | None = None
    cpu_limit: dict[str, Any] | None = None


@dataclass(frozen=True)
class Sizing:
    vcpus: int = 0
    max_vcpus: int = 0
    memory_bytes: int = 0
    max_memory_bytes: int = 0


class RunnerState:
    """Thread-safe record of facts; see the module docstring."""

    def __init__(self, vm: str, accel: str, ready_marker: str, sizing: Sizing,
                 monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 acceleration_unavailable: str | None = None) -> None:
        self._vm = vm
        self._accel = accel
        self._acceleration_unavailable = acceleration_unavailable
        self._marker = ready_marker
        self._sizing = sizing
        self._monotonic = monotonic
        self._wall = wall
        self._lock = threading.Lock()
        self._facts = _Facts()

    # ---- facts -------------------------------------------------------------------------

    def qemu_started(self, pid: int) -> None:
        with self._lock:
            f = self._facts
            f.phase, f.qemu_pid, f.qemu_alive = "Booting", pid, True
            f.started_mono, f.started_wall = self._monotonic(), self._wall()

    def console_line(self, has_marker: bool) -> None:
        with self._lock:
            self._facts.console_lines += 1
            if has_marker and not self._facts.marker_seen:
                self._facts.marker_seen = True
                self._update_ready()

    def qmp_connected(self, connected: bool) -> None:
        with self._lock:
            self._facts.qmp_connected = connected
            if not connected:
                self._facts.qmp_status = None

    def qmp_status(self, status: str) -> None:
        with self._lock:
            self._facts.qmp_status = status
            self._update_ready()

    def shutdown_event(self, reason: str) -> None:
        with self._lock:
            self._facts.shutdown_reason = reason
            self._facts.qmp_status = "shutdown"

    def stop_requested(self, budget_seconds: float) -> None:
        with self._lock:
            f = self._facts
            if f.stop_requested_wall is None:
                f.stop_requested_wall = self._wall()
                f.shutdown_budget = budget_seconds
            if f.phase != "Exited":
                f.phase = "Stopping"

    def plugged(self, vcpus: int, memory_bytes: int) -> None:
        """What QEMU has plugged now (after a live scaling change, or a periodic read)."""
        with self._lock:
            self._sizing = replace(self._sizing, vcpus=vcpus, memory_bytes=memory_bytes)

    def guest_size(self, cpus_online: int, mem_total_kb: int) -> None:
        """What the guest reported it sees."""
        with self._lock:
            f = self._facts
            f.guest_cpus_online, f.guest_mem_total_kb = cpus_online, mem_total_kb
            f.guest_reported_at = self._wall()

    def qemu_pid(self) -> int | None:
        """QEMU's pid while it runs."""
        with self._lock:
            return self._facts.qemu_pid if self._facts.qemu_alive else None

    def cpu_limit_applied(self, report: dict[str, Any]) -> None:
        with self._lock:
            self._facts.cpu_limit = dict(report)

    def powerdown_requested(self) -> None:
        with self._lock:
            self._facts.powerdown_requests += 1

    def qemu_exited(self, returncode: int) -> None:
        with self._lock:
            f = self._facts
            f.qemu_alive, f.qemu_exit_code, f.ended_mono = False, returncode, self._monotonic()

    def finished(self, outcome: Outcome) -> None:
        with self._lock:
            f = self._facts
            f.phase, f.exit_code, f.outcome = "Exited", int(outcome.exit_code), outcome.reason

    def _update_ready(self) -> None:
        f = self._facts
        if f.ready_mono is None and self._is_ready(f) and f.started_mono is not None:
            f.ready_mono = self._monotonic()
            if f.phase == "Booting":
                f.phase = "Running"

    # ---- reading -----------------------------------------------------------------------

    def _is_ready(self, f: _Facts) -> bool:
        return not self._not_ready_because(f)

    def _not_ready_because(self, f: _Facts) -> str:
        if not f.qemu_alive:
            return "QEMU is not running"
        if f.stop_requested_wall is not None:
            return "shutting down"
        if not f.qmp_connected:
            return "QMP not connected"
        if f.qmp_status != "running":
            return f"QMP status is {f.qmp_status}"
        if self._marker and not f.marker_seen:
            return f"ready marker {self._marker!r} not yet seen on the serial console"
        return ""

    def snapshot(self) -> Snapshot:
        with self._lock:
            f = replace(self._facts)
            sizing = self._sizing
        now = self._monotonic()
        uptime = None
        if f.started_mono is not None:
            uptime = (f.ended_mono if f.ended_mono is not None else now) - f.started_mono
        boot = (f.ready_mono - f.started_mono
                if f.ready_mono is not None and f.started_mono is not None else None)
        because = self._not_ready_because(f)
        return Snapshot(
            vm=self._vm, phase=f.phase, accel=self._accel, ready=not because,
            ready_marker=self._marker, marker_seen=f.marker_seen,
            qemu_pid=f.qemu_pid, qemu_alive=f.qemu_alive, qemu_started_at=f.started_wall,
            uptime_seconds=uptime, boot_seconds=boot, qmp_connected=f.qmp_connected,
            qmp_status=f.qmp_status, stop_requested_at=f.stop_requested_wall,
            shutdown_budget_seconds=f.shutdown_budget,
            powerdown_requests=f.powerdown_requests, shutdown_reason=f.shutdown_reason,
            qemu_exit_code=f.qemu_exit_code, exit_code=f.exit_code, outcome=f.outcome,
            console_lines=f.console_lines, vcpus=sizing.vcpus,
            max_vcpus=sizing.max_vcpus, memory_bytes=sizing.memory_bytes,
            max_memory_bytes=sizing.max_memory_bytes, not_ready_because=because,
            guest_cpus_online=f.guest_cpus_online, guest_mem_total_kb=f.guest_mem_total_kb,
            guest_reported_at=f.guest_reported_at, cpu_limit=f.cpu_limit,
            acceleration_unavailable=self._acceleration_unavailable,
        )

    def healthy(self) -> tuple[bool, str]:
        """Liveness: the runner answers (trivially) and QEMU runs, or is not started yet."""
        with self._lock:
            phase, alive = self._facts.phase, self._facts.qemu_alive
        if phase == "Preparing":
            return True, "preparing disks"
        if alive:
            return True, "QEMU running"
        return False, "QEMU is not running"
