"""A drill's story as a picture: the timeline recorder and its hand-written SVG.

:class:`Timeline` collects, on the drill's monotonic clock: the fault windows, the
leader (from the Lease poller), and events from the judges' own reads: runner pods
created by a plan, gates lifted, pod terminations (from the pod watch), plans recorded
in status and lock hand-offs (sampled once a second), and the counts of VMs converged,
plans pending and guests running. :func:`render_svg` draws it.

Why hand-written SVG: the picture is a few lanes of rectangles, ticks and two step
lines; plotting libraries are large dependencies for that, and SVG is text, so the
picture committed under docs/ diffs and reviews like the rest. See docs/drills.md,
"Timelines".
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape
from typing import Any

from kubernetes import client, watch

from neonvm.api import types

LANES = ("plan", "pod created", "gate lifted", "termination", "lock hand-off")
"""Event lanes, top to bottom, below the leader lane."""

COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7",
           "#9c755f")
LANE_COLOURS = {"plan": "#4e79a7", "pod created": "#f28e2b", "gate lifted": "#59a14f",
                "termination": "#e15759", "lock hand-off": "#b07aa1"}


@dataclass
class Sample:
    at: float
    converged: int
    plans: int
    guests: int


@dataclass
class Timeline:
    """Everything drawn, times on ``time.monotonic()``; ``origin`` is the picture's 0."""

    title: str
    vms: int
    origin: float = field(default_factory=time.monotonic)
    end: float | None = None
    faults: list[tuple[float, float | None, str]] = field(default_factory=list)
    leaders: list[tuple[float, str | None, int | None]] = field(default_factory=list)
    events: list[tuple[float, str, str]] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    lanes: tuple[str, ...] = LANES
    """Event lanes drawn, top to bottom (a drill may name its own)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fault_begins(self, label: str) -> None:
        with self._lock:
            self.faults.append((time.monotonic(), None, label))

    def fault_ends(self) -> None:
        with self._lock:
            for i, (start, stop, label) in enumerate(self.faults):
                if stop is None:
                    self.faults[i] = (start, time.monotonic(), label)

    def event(self, lane: str, detail: str = "", at: float | None = None) -> None:
        with self._lock:
            self.events.append((time.monotonic() if at is None else at, lane, detail))

    def on_pod_event(self, kind: str, pod: dict[str, Any], old: dict[str, Any] | None
                     ) -> None:
        """Feed from the pod watch: creation, gate lifted, termination."""
        name = str((pod.get("metadata") or {}).get("name"))
        deleting = (pod.get("metadata") or {}).get("deletionTimestamp") is not None
        was_deleting = old is not None and (old.get("metadata") or {}).get(
            "deletionTimestamp") is not None
        if kind == "ADDED" and old is None:
            self.event("pod created", name)
        elif kind == "MODIFIED" and old is not None and _gated(old) and not _gated(pod):
            self.event("gate lifted", name)
        if (deleting and not was_deleting) or (kind == "DELETED" and old is not None
                                               and not was_deleting):
            self.event("termination", name)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _at, lane, _detail in self.events:
            out[lane] = out.get(lane, 0) + 1
        return out


def _gated(pod: dict[str, Any]) -> bool:
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(g.get("name") == types.SCHEDULING_GATE for g in gates)


class Sampler:
    """Once a second: VMs converged, plans pending, guests running, and lock hand-offs (a
    VM's lock under a new holder or token). With ``vms_api`` it also watches the
    namespace's VMs, so that every plan recorded in status is an event however short it
    lives. Read errors (the API server or the locks' etcd down) skip the sample."""

    def __init__(self, timeline: Timeline, read_fleet: Callable[[], tuple[list[Any],
                                                                          list[Any]]],
                 read_locks: Callable[[], list[Any]] | None, interval: float = 1.0,
                 vms_api: client.ApiClient | None = None, namespace: str = "") -> None:
        self.timeline = timeline
        self._read_fleet = read_fleet
        self._read_locks = read_locks
        self._interval = interval
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, name="timeline", daemon=True)]
        if vms_api is not None:
            self._threads.append(threading.Thread(target=self._watch_vms, name="timeline-vms",
                                                  args=(vms_api, namespace), daemon=True))
        self._plans: dict[str, str] = {}
        self._plans_lock = threading.Lock()
        self._locks: dict[str, tuple[Any, Any]] = {}

    def __enter__(self) -> Sampler:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)

    def _plan_seen(self, name: str, plan: str | None, at: float) -> None:
        with self._plans_lock:
            if plan and self._plans.get(name) != plan:
                self.timeline.event("plan", f"{name}: {plan}", at)
            if plan:
                self._plans[name] = plan
            else:
                self._plans.pop(name, None)

    def _watch_vms(self, api: client.ApiClient, namespace: str) -> None:
        custom = client.CustomObjectsApi(api)
        while not self._stop.is_set():
            w = watch.Watch()
            try:
                for event in w.stream(custom.list_namespaced_custom_object, types.GROUP,
                                      types.VERSION, namespace, types.PLURAL,
                                      timeout_seconds=20, _request_timeout=30):
                    if self._stop.is_set():
                        w.stop()
                        return
                    vm = event.get("object") or {}
                    name = str((vm.get("metadata") or {}).get("name"))
                    plan = ((vm.get("status") or {}).get("pendingPod") or {}).get("name")
                    self._plan_seen(name, plan, time.monotonic())
            except Exception:  # the API server restarts in some drills
                self._stop.wait(0.5)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                self.sample_fleet()
            if self._read_locks is not None:
                with contextlib.suppress(Exception):
                    self.sample_locks()
            self._stop.wait(self._interval)

    def sample_fleet(self) -> None:
        pods, vms = self._read_fleet()
        now = time.monotonic()
        by_vm: dict[str, list[Any]] = {}
        for p in pods:
            by_vm.setdefault((p.metadata.labels or {}).get(types.LABEL_VM_NAME, ""),
                             []).append(p)
        guests = sum(1 for p in pods if p.metadata.deletion_timestamp is None
                     and not any(g.name == types.SCHEDULING_GATE
                                 for g in p.spec.scheduling_gates or [])
                     and (p.status.phase if p.status else None) == "Running")
        converged = plans = 0
        for vm in vms:
            name = vm["metadata"]["name"]
            status = vm.get("status") or {}
            plan = (status.get("pendingPod") or {}).get("name")
            self._plan_seen(name, plan, now)
            if plan:
                plans += 1
                continue
            mine = by_vm.get(name, [])
            if (len(mine) == 1 and mine[0].metadata.name == status.get("podName")
                    and mine[0].metadata.deletion_timestamp is None
                    and not any(g.name == types.SCHEDULING_GATE
                                for g in mine[0].spec.scheduling_gates or [])):
                converged += 1
        with self.timeline._lock:
            self.timeline.samples.append(Sample(now, converged, plans, guests))

    def sample_locks(self) -> None:
        assert self._read_locks is not None
        locks = self._read_locks()
        now = time.monotonic()
        for lk in locks:
            key = f"{lk.namespace}/{lk.name}"
            seen = (lk.holder, lk.token)
            before = self._locks.get(key)
            if before is not None and before != seen:
                self.timeline.event("lock hand-off", f"{key}: {before[0]} -> {lk.holder}", now)
            self._locks[key] = seen


# ---- the picture -----------------------------------------------------------------------------

WIDTH = 960
LEFT = 130
RIGHT = 20
ROW = 22


def render_svg(tl: Timeline) -> str:
    """The timeline as a standalone SVG document (module docstring)."""
    end = tl.end or max([tl.origin + 1.0, *(s.at for s in tl.samples),
                         *(e[0] for e in tl.events), *(f[1] or f[0] for f in tl.faults)])
    span = max(1.0, end - tl.origin)
    plot = WIDTH - LEFT - RIGHT

    def x(at: float) -> float:
        return LEFT + plot * min(1.0, max(0.0, (at - tl.origin) / span))

    top = 62
    leader_y = top
    lane_y = {lane: top + ROW * (i + 1) for i, lane in enumerate(tl.lanes)}
    chart_top = top + ROW * (len(tl.lanes) + 1) + 14
    chart_h = 140
    axis_y = chart_top + chart_h
    height = axis_y + 70
    out: list[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="{LEFT}" y="22" font-size="14" font-weight="bold">{escape(tl.title)}</text>',
    ]
    for start, stop, label in tl.faults:
        x0, x1 = x(start), x(stop if stop is not None else end)
        out.append(f'<rect x="{x0:.1f}" y="{top - 26}" width="{max(1.0, x1 - x0):.1f}" '
                   f'height="{axis_y - top + 26}" fill="#e15759" fill-opacity="0.12">'
                   f'<title>{escape(label)}</title></rect>')
        out.append(f'<text x="{x0 + 3:.1f}" y="{top - 14}" fill="#b22222">'
                   f'fault: {escape(label)}</text>')
    # The leader lane: one coloured bar per holder, grey where nobody leads.
    out.append(f'<text x="{LEFT - 6}" y="{leader_y + 4}" text-anchor="end">leader</text>')
    colour: dict[str, str] = {}
    leaders = tl.leaders or [(tl.origin, None, None)]
    for i, (at, who, epoch) in enumerate(leaders):
        stop = leaders[i + 1][0] if i + 1 < len(leaders) else end
        if who is None:
            fill, text = "#cccccc", "no leader"
        else:
            fill = colour.setdefault(who, COLOURS[len(colour) % len(COLOURS)])
            text = f"{who} (epoch {epoch})"
        x0, x1 = x(at), x(stop)
        out.append(f'<rect x="{x0:.1f}" y="{leader_y - 7}" width="{max(1.0, x1 - x0):.1f}" '
                   f'height="14" fill="{fill}"><title>{escape(text)}</title></rect>')
        if x1 - x0 > 90:
            out.append(f'<text x="{x0 + 3:.1f}" y="{leader_y + 4}" fill="white">'
                       f'{escape(text)}</text>')
    changes = max(0, len([c for c in leaders if c[1]]) - 1)
    for lane, ly in lane_y.items():
        mine = [e for e in tl.events if e[1] == lane]
        out.append(f'<text x="{LEFT - 6}" y="{ly + 4}" text-anchor="end">{lane} '
                   f'({len(mine)})</text>')
        out.append(f'<line x1="{LEFT}" y1="{ly}" x2="{WIDTH - RIGHT}" y2="{ly}" '
                   f'stroke="#eeeeee"/>')
        for at, _lane, detail in mine:
            out.append(f'<line x1="{x(at):.1f}" y1="{ly - 7}" x2="{x(at):.1f}" y2="{ly + 7}" '
                       f'stroke="{LANE_COLOURS.get(lane, "#555555")}" stroke-width="1.5">'
                       f'<title>{escape(detail)}</title></line>')
    # Counts: VMs converged, guests running, plans pending.
    top_count = max([tl.vms, 1, *(max(s.guests, s.plans) for s in tl.samples)])

    def count_y(count: int) -> float:
        return axis_y - chart_h * count / top_count

    out.append(f'<line x1="{LEFT}" y1="{axis_y}" x2="{WIDTH - RIGHT}" y2="{axis_y}" '
               f'stroke="black"/>')
    out.append(f'<line x1="{LEFT}" y1="{chart_top}" x2="{LEFT}" y2="{axis_y}" '
               f'stroke="black"/>')
    for count in (0, top_count):
        out.append(f'<text x="{LEFT - 6}" y="{count_y(count) + 4:.1f}" text-anchor="end">'
                   f'{count}</text>')
    series = (("plans pending", "plans", "#f28e2b"), ("guests running", "guests", "#1f77b4"),
              ("VMs converged", "converged", "#2e7d32"))  # drawn last: on top
    for i, (label, attr, stroke) in enumerate(series):
        if tl.samples:
            points = []
            prev: float | None = None
            for s in tl.samples:
                value = count_y(getattr(s, attr))
                if prev is not None:
                    points.append(f"{x(s.at):.1f},{prev:.1f}")
                points.append(f"{x(s.at):.1f},{value:.1f}")
                prev = value
            out.append(f'<polyline points="{" ".join(points)}" fill="none" '
                       f'stroke="{stroke}" stroke-width="1.5"/>')
        out.append(f'<rect x="{LEFT + 10 + 150 * i}" y="{chart_top - 2}" width="10" '
                   f'height="3" fill="{stroke}"/>')
        out.append(f'<text x="{LEFT + 24 + 150 * i}" y="{chart_top + 2}">{label}</text>')
    step = _tick_step(span)
    t = 0.0
    while t <= span + 1e-6:
        xt = x(tl.origin + t)
        out.append(f'<line x1="{xt:.1f}" y1="{axis_y}" x2="{xt:.1f}" y2="{axis_y + 4}" '
                   f'stroke="black"/>')
        out.append(f'<text x="{xt:.1f}" y="{axis_y + 16}" text-anchor="middle">{t:g}</text>')
        t += step
    out.append(f'<text x="{LEFT + plot / 2:.1f}" y="{axis_y + 32}" text-anchor="middle">'
               f'seconds since the fleet converged and the judges started</text>')
    out.append(f'<text x="{LEFT}" y="{axis_y + 52}">{changes} leader change(s); '
               f'{tl.vms} VMs; events: '
               f'{escape(", ".join(f"{k} {v}" for k, v in sorted(tl.counts().items())))}'
               f'</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _tick_step(span: float) -> float:
    for step in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1200):
        if span / step <= 12:
            return float(step)
    return 3600.0
