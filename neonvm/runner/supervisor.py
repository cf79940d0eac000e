"""Start QEMU, watch it, and power the guest down when the pod is asked to stop.

One asyncio task per source of facts: the serial console (forwarded byte for byte to the
runner's stdout, and scanned line by line for the ready marker), QEMU's stderr (logged),
the QMP session (run state, ``SHUTDOWN`` reason) and the process itself.

The shutdown sequence, on :meth:`Supervisor.request_stop` (SIGTERM or SIGINT):

1. ``/ready`` turns false at once (phase ``Stopping``).
2. ``system_powerdown`` over QMP: an ACPI power-button press. Repeated every
   ``powerdown_interval`` seconds, because a guest still booting may not be listening yet
   and drops the press.
3. The guest powers off, QEMU exits 0, the runner exits 0. Or the budget runs out (a
   second SIGINT cuts it short): QEMU gets SIGKILL and the runner exits 3.

Guaranteed: QEMU never outlives :meth:`Supervisor.run` (it is killed on any exit path),
and when ``setpriv`` is installed QEMU also gets SIGKILL if the runner process dies
(``--pdeathsig``), so a killed runner leaves no guest behind. The outcome is decided
only after QEMU's stdout and QMP socket are drained, so the final ``SHUTDOWN`` reason is
known. Not guaranteed: that a guest powers off when asked; that is what the budget is for.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
from dataclasses import dataclass
from typing import Any, BinaryIO

from loguru import logger

from neonvm.api.scale_protocol import ScaleError
from neonvm.runner.errors import HostError
from neonvm.runner.qemu import LaunchPlan
from neonvm.runner.qmp import QMPClient, QMPError, QMPEvent
from neonvm.runner.right import SelfFence
from neonvm.runner.scaling import GUEST_SIZE_PREFIX, Scaler, parse_guest_size
from neonvm.runner.state import ExitCode, Outcome, RunnerState, decide_outcome

DEFAULT_GRACE_PERIOD = 30
"""Kubernetes' default terminationGracePeriodSeconds."""
QMP_POLL_INTERVAL = 2.0
"""How often ``query-status`` re-confirms the run state (events may be missed)."""
POWERDOWN_RETRY_SOON = 0.2
"""Retry delay when a power-down request could not be sent (QMP not connected yet)."""


@dataclass(frozen=True)
class ShutdownPolicy:
    budget_seconds: float
    """How long the guest gets to power off after the stop request."""
    powerdown_interval_seconds: float = 5.0


def shutdown_budget(termination_grace_period: int | None, margin_seconds: float,
                    override_seconds: float | None = None) -> float:
    """Seconds to wait for the guest: the pod's grace period minus a margin.

    The margin leaves the runner time to kill QEMU and exit before the kubelet's own
    SIGKILL, so the pod's exit code is the runner's, not 137.
    """
    if override_seconds is not None:
        return max(0.0, override_seconds)
    grace = DEFAULT_GRACE_PERIOD if termination_grace_period is None else termination_grace_period
    return max(0.0, grace - margin_seconds)


def is_marker_line(line: str, marker: str) -> bool:
    """True if ``line`` is the ready marker alone (surrounding whitespace ignored).

    Whole-line equality, not "contains": the kernel echoes its command line and a guest
    may print its config, and either may contain the marker text without meaning it.
    """
    return bool(marker) and line.strip() == marker


# A kernel log record that began after other text on its line: the kernel writes its
# console records straight to the UART, so one can land inside a line a guest program had
# queued (seen: "NEONVM_GUEST_READY[    4.311707] IPv6: ... ready" and then the newline).
_INTERLEAVED_KERNEL_RECORD = re.compile(rb"(?<=[^\n])\[ *\d+\.\d+\][^\n]*\n")


def split_console_lines(pending: bytes) -> tuple[list[bytes], bytes]:
    """The complete lines of ``pending`` as the guest's programs wrote them, and the rest.

    Kernel records that interrupted a line are taken out first (the console file keeps
    them), so a marker or a size report split by one is still one line. A record at the
    start of a line is a line of its own and stays."""
    cut = pending.rfind(b"\n") + 1
    if cut == 0:
        return [], pending
    *lines, unfinished = _INTERLEAVED_KERNEL_RECORD.sub(b"", pending[:cut]).split(b"\n")
    return lines, unfinished + pending[cut:]


class Supervisor:
    """Runs one QEMU from a :class:`LaunchPlan`; :meth:`run` returns how it ended."""

    def __init__(self, plan: LaunchPlan, state: RunnerState, policy: ShutdownPolicy,
                 console: BinaryIO, ready_marker: str, vm: str,
                 pdeathsig_wrapper: str | None = None, scaler: Scaler | None = None,
                 right: SelfFence | None = None) -> None:
        """``right``: self-fencing (docs/runner.md, "Self-fencing"): QEMU starts only
        after the first grant, and its watchdog kills QEMU when the right runs out."""
        self._plan = plan
        self._right = right
        self._scaler = scaler
        self._state = state
        self._policy = policy
        self._console = console
        self._marker = ready_marker
        self._log = logger.bind(vm=vm)
        self._wrapper = pdeathsig_wrapper
        self._stop = asyncio.Event()
        self._kill_now = asyncio.Event()
        self._qmp: QMPClient | None = None
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=3)
        self._stop_signal: str | None = None

    # ---- control -----------------------------------------------------------------------

    def request_stop(self, signame: str) -> None:
        """Begin the shutdown sequence; a second SIGINT kills QEMU at once."""
        if self._stop.is_set():
            if signame == "SIGINT":
                self._log.warning("second SIGINT: killing QEMU now")
                self._kill_now.set()
            return
        self._stop_signal = signame
        self._log.info("{} received: powering the guest down (budget {:g}s)", signame,
                       self._policy.budget_seconds)
        self._state.stop_requested(self._policy.budget_seconds)
        self._stop.set()

    # ---- the run -----------------------------------------------------------------------

    async def run(self) -> Outcome:
        argv = list(self._plan.argv)
        if self._wrapper:
            argv = [self._wrapper, "--pdeathsig", "KILL", "--", *argv]
        await self._first_right()
        if self._right is not None and self._right.condemned() and not self._right.granted():
            outcome = Outcome(ExitCode.RUNNER_ERROR, "condemned by the leader before QEMU "
                                                     "started: it took this pod for dead")
            self._state.finished(outcome)
            return outcome
        gave_up = self._right.gave_up() if self._right is not None else None
        if gave_up is not None:
            self._log.error("{}", gave_up)
            outcome = Outcome(ExitCode.RUNNER_ERROR, gave_up)
            self._state.finished(outcome)
            return outcome
        if self._stop.is_set():
            outcome = Outcome(ExitCode.GUEST_POWERED_OFF, "stopped before QEMU started")
            self._state.finished(outcome)
            return outcome
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            raise HostError(f"cannot start QEMU ({argv[0]}): {exc.strerror or exc}") from None
        if self._right is not None:
            self._right.arm(proc.pid)
        self._state.qemu_started(proc.pid)
        self._log.info("QEMU started (pid {})", proc.pid)
        assert proc.stdout is not None and proc.stderr is not None
        console_task = asyncio.create_task(self._pump_console(proc.stdout), name="console")
        stderr_task = asyncio.create_task(self._pump_stderr(proc.stderr), name="stderr")
        qmp_task = asyncio.create_task(self._qmp_session(proc), name="qmp")
        exit_task = asyncio.create_task(proc.wait(), name="qemu-exit")
        try:
            stop_task = asyncio.create_task(self._stop.wait(), name="stop")
            await asyncio.wait({exit_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
            stop_task.cancel()
            killed = False
            if not exit_task.done():
                killed = await self._power_down(proc, exit_task)
            returncode = await exit_task
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        self._state.qemu_exited(returncode)
        self._log.debug("QEMU process ended ({}); draining console and QMP", returncode)
        for task in (console_task, stderr_task):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(task, 5)
        if self._qmp is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._qmp.closed.wait(), 2)
        self._log.debug("drained")
        qmp_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await qmp_task
        snap = self._state.snapshot()
        outcome = decide_outcome(
            returncode, snap.shutdown_reason, killed_after_grace=killed,
            stop_requested=self._stop.is_set(), grace_seconds=self._policy.budget_seconds,
            stderr_tail=self._stderr_tail[-1] if self._stderr_tail else "")
        if self._right is not None and self._right.fired:
            outcome = Outcome(ExitCode.QEMU_FAILED, self._right.fired)
        self._state.finished(outcome)
        self._log.info("QEMU exited with code {}: {} (runner exits {})", returncode,
                       outcome.reason, int(outcome.exit_code))
        return outcome

    async def _first_right(self) -> None:
        """Self-fencing: wait for the first right to run (or a stop request, a
        ``Condemned`` refusal, or giving up: :meth:`SelfFence.gave_up`)."""
        if self._right is None or self._right.granted():
            return
        self._log.info("waiting for the first right to run before starting QEMU")
        while (not self._right.granted() and not self._right.condemned()
               and self._right.gave_up() is None and not self._stop.is_set()):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.05)

    async def _power_down(self, proc: asyncio.subprocess.Process,
                          exit_task: asyncio.Task[int]) -> bool:
        """Press the power button until QEMU exits or the budget ends; True if killed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._policy.budget_seconds
        kill_task = asyncio.create_task(self._kill_now.wait(), name="kill-now")
        try:
            while not exit_task.done() and not self._kill_now.is_set():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                sent = await self._send_powerdown()
                pause = self._policy.powerdown_interval_seconds if sent else POWERDOWN_RETRY_SOON
                await asyncio.wait({exit_task, kill_task}, timeout=min(pause, remaining),
                                   return_when=asyncio.FIRST_COMPLETED)
        finally:
            kill_task.cancel()
        if exit_task.done():
            return False
        self._log.warning("guest still running after {:g}s: killing QEMU",
                          self._policy.budget_seconds)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        return True

    async def _send_powerdown(self) -> bool:
        client = self._qmp
        if client is None or client.closed.is_set():
            return False
        try:
            await client.execute("system_powerdown", timeout=2)
        except QMPError as exc:
            self._log.warning("system_powerdown failed: {}", exc)
            return False
        self._state.powerdown_requested()
        self._log.info("ACPI power-down requested")
        return True

    # ---- sources of facts --------------------------------------------------------------

    async def _pump_console(self, stream: asyncio.StreamReader) -> None:
        pending = b""
        while chunk := await stream.read(65536):
            with contextlib.suppress(OSError, ValueError):
                self._console.write(chunk)
                self._console.flush()
            pending += chunk
            lines, pending = split_console_lines(pending)
            for line in lines:
                self._console_line(line)
            if len(pending) > 65536:
                self._console_line(pending)
                pending = b""
        if pending:
            self._console_line(pending)

    def _console_line(self, raw: bytes) -> None:
        line = raw.decode("utf-8", errors="replace")
        has_marker = is_marker_line(line, self._marker)
        self._state.console_line(has_marker)
        if line.lstrip().startswith(GUEST_SIZE_PREFIX):
            size = parse_guest_size(line)
            if size is not None:
                self._state.guest_size(size.cpus_online, size.mem_total_kb)
        if has_marker:
            self._log.info("ready marker seen on the serial console")

    async def _pump_stderr(self, stream: asyncio.StreamReader) -> None:
        while raw := await stream.readline():
            line = raw.decode("utf-8", errors="replace").rstrip()
            if line:
                self._stderr_tail.append(line)
                self._log.bind(source="qemu").warning("{}", line)

    async def _qmp_session(self, proc: asyncio.subprocess.Process) -> None:
        client: QMPClient | None = None
        while proc.returncode is None:
            try:
                client = await QMPClient.connect(self._plan.qmp_socket, self._on_event)
                break
            except (OSError, QMPError, ValueError):
                await asyncio.sleep(0.05)
        if client is None:
            return
        self._qmp = client
        self._state.qmp_connected(True)
        self._log.debug("QMP connected")
        if self._scaler is not None:
            self._scaler.attach(asyncio.get_running_loop(), client)
        try:
            while not client.closed.is_set():
                try:
                    status = await client.execute("query-status", timeout=5)
                    self._state.qmp_status(str(status.get("status")))
                    if self._scaler is not None:
                        await self._scaler.refresh(client)
                except (QMPError, ScaleError, KeyError, TypeError):
                    pass
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(client.closed.wait(), QMP_POLL_INTERVAL)
        finally:
            if self._scaler is not None:
                self._scaler.detach()
            self._state.qmp_connected(False)
            await client.close()

    def _on_event(self, message: QMPEvent) -> None:
        event = message.get("event")
        data: dict[str, Any] = message.get("data") or {}
        if self._scaler is not None:
            self._scaler.on_qmp_event(str(event), data)
        if event == "SHUTDOWN":
            reason = str(data.get("reason", "unknown"))
            self._state.shutdown_event(reason)
            self._log.info("QMP: SHUTDOWN (reason {}, guest {})", reason, data.get("guest"))
        elif event == "STOP":
            self._state.qmp_status("paused")
        elif event == "RESUME":
            self._state.qmp_status("running")
        elif event in ("POWERDOWN", "RESET", "GUEST_PANICKED"):
            self._log.info("QMP: {}{}", event, f" {data}" if data else "")
        else:
            self._log.debug("QMP: {}{}", event, f" {data}" if data else "")
