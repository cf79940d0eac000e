"""An independent count of running guests: QEMU processes, read from the host's /proc.

The self-fencing drills (docs/drills.md, "Self-fencing drills on real nodes") judge the
invariant by guests, not pods: at no moment may two guests of one VM run. This module
looks only at the host's processes, never at the controller or the API server:

* a **guest** is a QEMU process (``comm`` starting ``qemu-system``) whose environment
  (inherited from its runner) names the VM (``NEONVM_VM_NAMESPACE``/``NEONVM_VM_NAME``,
  checked against QEMU's own ``-name guest=<name>``), its pod (``NEONVM_POD_UID``) and
  its right's length D (``NEONVM_RIGHT_SECONDS``); its node is read from its cgroup path;
* it **runs** while its state is neither stopped (``T``, ``t``) nor dead (``Z``, ``X``,
  gone, or dying: in exit(), or with SIGKILL pending, as a stopped process killed shows
  ``R`` for a moment);
* a **frozen** guest (SIGSTOPped) **may run** until its right's deadline has surely
  passed: every grant it holds was asked before the freeze, so its deadline is before
  ``freeze + D`` on the host's boot-time clock, and the freeze happened before the first
  sample that saw it stopped. A frozen guest without a right (not self-fencing) may run
  for as long as it exists.

Between two samples nothing is known, so every interval is taken at its widest: a guest
runs from its process's start time (``/proc/<pid>/stat``, boot-time clock) until the
first sample that saw it stopped or gone. :class:`GuestCounter` samples on a short
interval (the known QEMU pids every ``fast`` seconds, the whole of /proc every ``scan``
seconds, so a new QEMU is found late but dated from its start) and
:meth:`GuestCounter.report` gives every moment where more than one guest of one VM ran,
or may have run. The classification is pure (:func:`classify`, :func:`overlaps`) and
unit-tested on fixture /proc trees.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
STOPPED = frozenset("Tt")
DEAD = frozenset("ZX")
PF_EXITING = 0x4


def boottime() -> float:
    """The host's boot-time clock (counts a suspend), the clock of /proc start times."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass(frozen=True)
class Proc:
    """One process as /proc shows it (only what the counter needs)."""

    pid: int
    comm: str
    state: str
    start: float
    """Start time, seconds on the boot-time clock."""
    cpu: float
    """User + system CPU seconds."""


@dataclass(frozen=True)
class Guest:
    """A QEMU process of a VM (identity: pid and start time)."""

    pid: int
    start: float
    vm: str
    """``namespace/name``."""
    pod_uid: str
    node: str
    """The cgroup root it lives under (``/neonvm-<tag>`` for a real node), or ``""``."""
    right_seconds: float | None
    """D, or None for a guest that does not self-fence."""

    @property
    def key(self) -> tuple[int, float]:
        return (self.pid, self.start)


def read_stat(proc_root: Path, pid: int) -> Proc | None:
    """``/proc/<pid>/stat`` parsed, or None when the process is gone. A process with
    SIGKILL pending (``/proc/<pid>/status``) is dying: state ``X``."""
    try:
        raw = (proc_root / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    proc = parse_stat(pid, raw)
    if proc is not None and proc.state not in DEAD and proc.comm.startswith("qemu-system") \
            and _sigkill_pending(proc_root, pid):
        return Proc(proc.pid, proc.comm, "X", proc.start, proc.cpu)
    return proc


def _sigkill_pending(proc_root: Path, pid: int) -> bool:
    """Whether SIGKILL is pending (thread or process): such a process never returns to
    user mode, so no guest instruction runs again (KVM also leaves guest mode on a
    pending signal)."""
    try:
        lines = (proc_root / str(pid) / "status").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("SigPnd", "ShdPnd"):
            with contextlib.suppress(ValueError):
                if int(value.strip(), 16) & (1 << (signal.SIGKILL - 1)):
                    return True
    return False


def parse_stat(pid: int, raw: str) -> Proc | None:
    """Parse a stat line; the command name may hold spaces and parentheses."""
    try:
        comm = raw[raw.index("(") + 1:raw.rindex(")")]
        rest = raw[raw.rindex(")") + 2:].split()
        # rest[0] is field 3 (state); utime, stime are 14, 15; starttime is 22.
        # Field 9 holds the kernel's task flags: PF_EXITING once it is in exit(), where
        # it may show R or D for a moment after a SIGKILL; it runs no guest code then.
        state = "X" if int(rest[6]) & PF_EXITING and rest[0] not in DEAD else rest[0]
        return Proc(pid=pid, comm=comm, state=state,
                    start=int(rest[19]) / CLK_TCK,
                    cpu=(int(rest[11]) + int(rest[12])) / CLK_TCK)
    except (ValueError, IndexError):
        return None


def _environ(proc_root: Path, pid: int) -> dict[str, str]:
    try:
        raw = (proc_root / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _argv(proc_root: Path, pid: int) -> list[str]:
    try:
        raw = (proc_root / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _cgroup_root(proc_root: Path, pid: int) -> str:
    """The first path component of the process's cgroup (any hierarchy that has one)."""
    try:
        lines = (proc_root / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        path = line.split(":", 2)[-1]
        first = path.strip("/").split("/")[0]
        if first:
            return "/" + first
    return ""


def identify(proc_root: Path, proc: Proc) -> Guest | None:
    """The guest a QEMU process runs, or None if it is not a runner's QEMU.

    The VM comes from the environment QEMU inherited from its runner and must agree with
    QEMU's ``-name guest=<name>``: a QEMU started by anything else is not counted.
    """
    if not proc.comm.startswith("qemu-system"):
        return None
    env = _environ(proc_root, proc.pid)
    name, namespace = env.get("NEONVM_VM_NAME"), env.get("NEONVM_VM_NAMESPACE")
    if not name or namespace is None:
        return None
    argv = _argv(proc_root, proc.pid)
    named = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-name"]
    if not any(n.split(",")[0] == f"guest={name}" for n in named):
        return None
    seconds: float | None = None
    with contextlib.suppress(ValueError):
        if env.get("NEONVM_RIGHTS_URL"):
            seconds = float(env.get("NEONVM_RIGHT_SECONDS", "30"))
    return Guest(pid=proc.pid, start=proc.start, vm=f"{namespace}/{name}",
                 pod_uid=env.get("NEONVM_POD_UID", ""),
                 node=_cgroup_root(proc_root, proc.pid), right_seconds=seconds)


# ---- classification (pure) ---------------------------------------------------------------


@dataclass
class History:
    """What the samples saw of one guest."""

    guest: Guest
    seen: list[tuple[float, str, float]] = field(default_factory=list)
    """(sample time, state letter, CPU seconds), in time order."""
    gone_at: float | None = None
    """The first sample that found it gone (or a zombie)."""

    def observe(self, at: float, state: str | None, cpu: float = 0.0) -> None:
        if self.gone_at is not None:
            return
        if state is None or state in DEAD:
            self.gone_at = at
            return
        # Of a run of samples in one state, keep the first and the latest.
        if len(self.seen) >= 2 and self.seen[-1][1] == self.seen[-2][1] == state:
            self.seen[-1] = (at, state, cpu)
            return
        self.seen.append((at, state, cpu))


@dataclass(frozen=True)
class Interval:
    """A span in which a guest ran, or may have run (frozen within its right)."""

    start: float
    end: float
    running: bool
    """True: not stopped (its vCPUs could run). False: frozen, counted until the deadline."""


def classify(history: History, now: float) -> list[Interval]:
    """The spans in which the guest ran or may have run, each at its widest.

    It runs from its start until the first sample that saw it stopped or gone (or
    ``now``). From the first sample that saw it stopped, it may run until that sample
    plus D (every grant was asked before the freeze), or until it is gone or seen
    running again, whichever is first; without a right, until it is gone or running.
    """
    out: list[Interval] = []
    d = history.guest.right_seconds
    run_from: float | None = history.guest.start
    frozen_from: float | None = None
    for at, state, _cpu in history.seen:
        if state in STOPPED:
            if run_from is not None:
                out.append(Interval(run_from, at, True))
                run_from = None
            if frozen_from is None:
                frozen_from = at
        else:
            if frozen_from is not None:
                # Thawed: it was at most frozen until this sample; it ran from the sample
                # before (the widest view: the thaw happened right after that sample).
                out.append(Interval(frozen_from, _bounded(frozen_from, at, d), False))
                frozen_from = None
            if run_from is None:
                run_from = _previous(history, at)
    end = history.gone_at if history.gone_at is not None else now
    if run_from is not None:
        out.append(Interval(run_from, end, True))
    if frozen_from is not None:
        out.append(Interval(frozen_from, _bounded(frozen_from, end, d), False))
    return [i for i in out if i.end > i.start]


def _bounded(frozen_from: float, until: float, d: float | None) -> float:
    return until if d is None else min(until, frozen_from + d)


def _previous(history: History, at: float) -> float:
    """The time of the sample just before ``at`` (the earliest a thaw can have been)."""
    before = [s[0] for s in history.seen if s[0] < at]
    return before[-1] if before else history.guest.start


@dataclass(frozen=True)
class Overlap:
    """A moment where more than one guest of one VM ran (or may have run)."""

    vm: str
    start: float
    end: float
    pids: tuple[int, ...]
    running: bool
    """True: all of them were seen not stopped (two running guests). False: at least one
    was frozen within its right (two guests that *may* run)."""

    @property
    def seconds(self) -> float:
        return self.end - self.start


def overlaps(histories: Iterable[History], now: float) -> list[Overlap]:
    """Every span where a VM had two or more guests that ran or may have run.

    One entry per maximal span with the same set of guests; ``running`` says whether
    all of them were running (not frozen) in it."""
    by_vm: dict[str, list[tuple[Interval, int]]] = {}
    for h in histories:
        for iv in classify(h, now):
            by_vm.setdefault(h.guest.vm, []).append((iv, h.guest.pid))
    out: list[Overlap] = []
    for vm, spans in sorted(by_vm.items()):
        cuts = sorted({t for iv, _ in spans for t in (iv.start, iv.end)})
        current: tuple[tuple[int, ...], bool] | None = None
        begun = 0.0
        for lo, hi in itertools.pairwise(cuts):
            mid = (lo + hi) / 2
            running: dict[int, bool] = {}
            for iv, pid in spans:
                if iv.start <= mid < iv.end:
                    running[pid] = running.get(pid, False) or iv.running
            pids = tuple(sorted(running))
            state = (pids, all(running.values())) if len(pids) > 1 else None
            if state != current:
                if current is not None:
                    out.append(Overlap(vm, begun, lo, current[0], current[1]))
                current, begun = state, lo
        if current is not None:
            out.append(Overlap(vm, begun, cuts[-1], current[0], current[1]))
    return out


# ---- the sampler -------------------------------------------------------------------------


@dataclass
class CounterReport:
    """What :meth:`GuestCounter.report` found."""

    guests: list[History]
    overlaps: list[Overlap]
    samples: int
    scans: int

    @property
    def running_overlaps(self) -> list[Overlap]:
        """Moments with two guests of one VM both running (not frozen)."""
        return [o for o in self.overlaps if o.running]

    def summary(self) -> str:
        return (f"{len(self.guests)} guests seen in {self.samples} samples "
                f"({self.scans} scans of /proc); moments with two guests of one VM: "
                f"{len(self.running_overlaps)} running, "
                f"{len(self.overlaps) - len(self.running_overlaps)} more that may run "
                f"(frozen within their right)")


class GuestCounter:
    """Samples the host's QEMU processes in a thread of its own (module docstring).

    ``scope`` keeps the guests that belong to the drill (e.g. a node's cgroup root):
    other QEMU processes on the host are not counted.
    """

    def __init__(self, scope: Callable[[Guest], bool] = lambda _g: True, *,
                 fast: float = 0.01, scan: float = 0.25, proc_root: Path = Path("/proc"),
                 clock: Callable[[], float] = boottime) -> None:
        self.scope = scope
        self.fast, self.scan = fast, scan
        self.proc_root = proc_root
        self.clock = clock
        self._histories: dict[tuple[int, float], History] = {}
        self._ignored: set[tuple[int, float]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples = 0
        self.scans = 0
        self._listeners: list[Callable[[float, History, str | None], None]] = []

    def on_change(self, listener: Callable[[float, History, str | None], None]) -> None:
        """Call ``listener(at, history, state)`` when a guest appears, changes state or
        goes (state None)."""
        self._listeners.append(listener)

    def __enter__(self) -> GuestCounter:
        self.scan_now()
        self._thread = threading.Thread(target=self._run, name="guest-counter", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        next_scan = time.monotonic() + self.scan
        while not self._stop.wait(self.fast):
            if time.monotonic() >= next_scan:
                self.scan_now()
                next_scan = time.monotonic() + self.scan
            else:
                self.sample_known()

    def scan_now(self) -> None:
        """Look at every process: find new guests, then sample all known ones."""
        try:
            pids = [int(p) for p in os.listdir(self.proc_root) if p.isdigit()]
        except OSError:
            return
        found: list[tuple[Proc, Guest | None]] = []
        for pid in pids:
            proc = read_stat(self.proc_root, pid)
            if proc is None or not proc.comm.startswith("qemu-system"):
                continue
            key = (proc.pid, proc.start)
            with self._lock:
                known = key in self._histories or key in self._ignored
            if known:
                continue
            guest = identify(self.proc_root, proc)
            found.append((proc, guest if guest is not None and self.scope(guest) else None))
        at = self.clock()
        with self._lock:
            for proc, guest in found:
                if guest is None:
                    self._ignored.add((proc.pid, proc.start))
                else:
                    self._histories[guest.key] = History(guest)
            self.scans += 1
        self.sample_known(at)

    def sample_known(self, at: float | None = None) -> None:
        with self._lock:
            live = [h for h in self._histories.values() if h.gone_at is None]
        reads = [(h, read_stat(self.proc_root, h.guest.pid)) for h in live]
        at = self.clock() if at is None else at
        with self._lock:
            self.samples += 1
            for h, proc in reads:
                same = proc is not None and abs(proc.start - h.guest.start) < 1.5 / CLK_TCK
                state = proc.state if same and proc is not None else None
                before = _category(h.seen[-1][1]) if h.seen else "new"
                h.observe(at, state, proc.cpu if same and proc is not None else 0.0)
                after = "gone" if h.gone_at is not None else _category(h.seen[-1][1])
                if after != before:
                    for listener in self._listeners:
                        listener(at, h, None if after == "gone" else state)

    def histories(self) -> list[History]:
        with self._lock:
            return list(self._histories.values())

    def report(self, now: float | None = None) -> CounterReport:
        now = self.clock() if now is None else now
        with self._lock:
            hs = [History(h.guest, list(h.seen), h.gone_at) for h in self._histories.values()]
            samples, scans = self.samples, self.scans
        return CounterReport(hs, overlaps(hs, now), samples, scans)

    def running(self, vm: str | None = None) -> list[Guest]:
        """Guests seen running (not stopped) at the latest sample."""
        with self._lock:
            return [h.guest for h in self._histories.values()
                    if h.gone_at is None and h.seen and h.seen[-1][1] not in STOPPED
                    and (vm is None or h.guest.vm == vm)]


def _category(state: str) -> str:
    return "stopped" if state in STOPPED else "gone" if state in DEAD else "running"


def in_cgroup_roots(roots: Mapping[str, str]) -> Callable[[Guest], bool]:
    """A scope: guests under one of these cgroup roots (root -> node name)."""
    return lambda g: g.node in roots
