"""Watching the invariant at every revision, and timing pod replacement.

:class:`neonvm.invariant.InvariantChecker` polls: each quorum list is a true snapshot, but
a duplicate that lives between two polls is missed. :class:`PodWatchChecker` closes that
gap. It lists the runner pods of a namespace, then watches them from the list's
resourceVersion, and after *every* event re-evaluates the VM it touched. Events of one
namespace arrive in etcd revision order, so the state it holds after an event is the
namespace's state at that revision: a duplicate at any revision is seen, however short.

It shares no code with the controller (its own list and watch over raw JSON, its own copy
of the liveness rule; ``tests/test_drills.py`` checks the rule against
:func:`neonvm.invariant.live_pods_by_vm`).

It also records **lost work**: a live runner pod (ungated, not terminating) that starts
terminating although the driver did not announce its deletion
(:meth:`PodWatchChecker.expect_pod_deletion`) and its VM is not being deleted
(:meth:`PodWatchChecker.expect_vm_deletion`). The controller never needs to kill the
running guest of a live VM; when it does, a status was overwritten somewhere, even if the
pod fence kept it from ever running two guests.

What is not guaranteed: when the watch breaks (API server restart, 410 Gone) the checker
re-lists, and revisions between the last event and the new list are not seen. Each such
gap is counted (``gaps``) so a verdict can say so; the polling checker runs beside it.

:class:`Watchdog` runs both checkers together. :class:`ReplacementClock` (fed by the same
events) measures "runner pod deleted -> replacement created" and "old pod gone ->
replacement ungated" per VM.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from neonvm.api import types
from neonvm.invariant import CheckerReport, InvariantChecker, Violation

Pod = dict[str, Any]


def is_live(pod: Pod, strict: bool = True) -> bool:
    """The invariant's liveness rule on a raw pod (same rule as neonvm.invariant)."""
    spec = pod.get("spec") or {}
    if any(g.get("name") == types.SCHEDULING_GATE for g in spec.get("schedulingGates") or []):
        return False
    if ((pod.get("status") or {}).get("phase") or "Pending") in ("Succeeded", "Failed"):
        return False
    return strict or (pod.get("metadata") or {}).get("deletionTimestamp") is None


def vm_of(pod: Pod) -> str | None:
    meta = pod.get("metadata") or {}
    name = (meta.get("labels") or {}).get(types.LABEL_VM_NAME)
    return f"{meta.get('namespace')}/{name}" if name else None


def is_gated(pod: Pod) -> bool:
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(g.get("name") == types.SCHEDULING_GATE for g in gates)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


@dataclass
class ReplacementClock:
    """Per VM: when its runner pod was deleted, and how long the replacement took.

    ``created``: delete observed (deletionTimestamp set, or gone) -> next pod ADDED.
    ``started``: old pod gone -> the replacement's gate removed.
    Both are measured on this process's monotonic clock at event receipt.
    """

    created: list[float] = field(default_factory=list)
    started: list[float] = field(default_factory=list)
    _deleted_at: dict[str, float] = field(default_factory=dict)
    _gone_at: dict[str, float] = field(default_factory=dict)

    def observe(self, kind: str, old: Pod | None, new: Pod, now: float) -> None:
        vm = vm_of(new)
        if vm is None:
            return
        meta = new.get("metadata") or {}
        deleting = meta.get("deletionTimestamp") is not None
        was_deleting = old is not None and (old.get("metadata") or {}).get(
            "deletionTimestamp") is not None
        if kind == "ADDED":
            since = self._deleted_at.pop(vm, None)
            if since is not None:
                self.created.append(now - since)
            return
        # The deletion *starts* when the deletionTimestamp appears (or, for a pod that
        # goes at once, at DELETED); the later DELETED of a terminating pod is its end.
        if (deleting and not was_deleting) or (kind == "DELETED" and not was_deleting
                                               and old is not None):
            self._deleted_at.setdefault(vm, now)
        if kind == "DELETED" and not is_gated(new):
            self._gone_at[vm] = now
        if kind == "MODIFIED" and old is not None and is_gated(old) and not is_gated(new):
            since = self._gone_at.pop(vm, None)
            if since is not None:
                self.started.append(now - since)

    def summary(self) -> dict[str, Any]:
        return {
            "replacements": len(self.created),
            "created_p50_s": percentile(self.created, 0.5),
            "created_p99_s": percentile(self.created, 0.99),
            "started_p50_s": percentile(self.started, 0.5),
            "started_p99_s": percentile(self.started, 0.99),
        }


@dataclass(frozen=True)
class UnexpectedDeletion:
    """A live runner pod (ungated, not terminating) whose deletion nobody announced."""

    vm: str
    pod: str
    resource_version: str


@dataclass
class WatchReport:
    events: int = 0
    lists: int = 0
    gaps: int = 0
    """Watch restarts: revisions between the last event and the re-list were not seen."""
    errors: int = 0
    strict: list[Violation] = field(default_factory=list)
    loose: list[Violation] = field(default_factory=list)
    unexpected_deletions: list[UnexpectedDeletion] = field(default_factory=list)
    """Lost work: a running guest killed though its VM lives and no driver asked."""


class PodWatchChecker:
    """Evaluates the invariant after every pod event in ``namespace`` (module docstring)."""

    def __init__(self, api: client.ApiClient, namespace: str,
                 clock: ReplacementClock | None = None,
                 on_event: Callable[[str, Pod], None] | None = None,
                 on_change: Callable[[str, Pod, Pod | None], None] | None = None) -> None:
        self._core = client.CoreV1Api(api)
        self._namespace = namespace
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-watch-checker",
                                        daemon=True)
        self._pods: dict[str, Pod] = {}
        self._open: dict[tuple[str, bool], tuple[str, ...]] = {}
        self._resp: Any = None
        self._lock = threading.Lock()
        self.synced = threading.Event()
        self.clock = clock or ReplacementClock()
        self.report = WatchReport()
        self._on_event = on_event
        self._on_change = on_change
        """Like ``on_event``, with the pod as it was before the event (None: unseen)."""
        self._expected_pods: set[str] = set()
        self._expected_vm_uids: set[str] = set()

    def expect_pod_deletion(self, name: str) -> None:
        """The driver is about to delete pod ``name``: not lost work."""
        with self._lock:
            self._expected_pods.add(name)

    def expect_vm_deletion(self, vm_uid: str) -> None:
        """The driver is about to delete the VM with ``vm_uid``: its pods may go."""
        with self._lock:
            self._expected_vm_uids.add(vm_uid)

    def start(self) -> PodWatchChecker:
        self._thread.start()
        return self

    def stop(self) -> WatchReport:
        self._stop.set()
        resp = self._resp
        sock = getattr(getattr(resp, "connection", None), "sock", None)
        if sock is not None:
            # Unblocks the watch thread's read at once (closing the response would wait
            # for the server to end the watch).
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=10)
        return self.report


    # ---- evaluation ------------------------------------------------------------------

    def _evaluate(self, vm: str, rv: str) -> None:
        for strict, sink in ((True, self.report.strict), (False, self.report.loose)):
            names = tuple(sorted(
                str((p.get("metadata") or {}).get("name")) for p in self._pods.values()
                if vm_of(p) == vm and is_live(p, strict)))
            key = (vm, strict)
            if len(names) > 1:
                if self._open.get(key) != names:
                    sink.append(Violation(vm, names, strict, rv, time.time()))
                self._open[key] = names
            else:
                self._open.pop(key, None)

    # ---- list and watch --------------------------------------------------------------

    def _list(self) -> str:
        resp = self._core.list_namespaced_pod(
            self._namespace, label_selector=types.LABEL_VM_NAME, _preload_content=False,
            _request_timeout=30)
        try:
            body = json.loads(resp.data)
        finally:
            resp.release_conn()
        rv = str((body.get("metadata") or {}).get("resourceVersion") or "")
        with self._lock:
            self._pods = {str(p["metadata"]["name"]): p for p in body.get("items") or []}
            for vm in {vm_of(p) for p in self._pods.values()} - {None}:
                assert vm is not None
                self._evaluate(vm, rv)
        self.report.lists += 1
        self.synced.set()
        return rv

    def _events(self, rv: str) -> Iterator[dict[str, Any]]:
        resp = self._core.list_namespaced_pod(
            self._namespace, label_selector=types.LABEL_VM_NAME, watch=True,
            resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=30,
            _preload_content=False, _request_timeout=(10, 45))
        self._resp = resp
        try:
            for line in iter_resp_lines(resp):
                if self._stop.is_set():
                    return
                if line:
                    yield json.loads(line)
        finally:
            self._resp = None
            resp.release_conn()

    def _apply(self, kind: str, pod: Pod) -> str:
        meta = pod.get("metadata") or {}
        name = str(meta.get("name"))
        rv = str(meta.get("resourceVersion") or "")
        now = time.monotonic()
        with self._lock:
            old = self._pods.get(name)
            self._judge_deletion(kind, old, pod, rv)
            if kind == "DELETED":
                self._pods.pop(name, None)
            else:
                self._pods[name] = pod
            self.report.events += 1
            self.clock.observe(kind, old, pod, now)
            for vm in {vm_of(pod), vm_of(old) if old else None} - {None}:
                assert vm is not None
                self._evaluate(vm, rv)
        if self._on_event is not None:
            self._on_event(kind, pod)
        if self._on_change is not None:
            self._on_change(kind, pod, old)
        return rv

    def _judge_deletion(self, kind: str, old: Pod | None, new: Pod, rv: str) -> None:
        """Record the deletion of a live pod that neither the driver nor a VM deletion
        explains (caller holds the lock)."""
        if old is None or not is_live(old, strict=False):
            return  # gated, finished or already terminating before this event
        now_deleting = kind == "DELETED" or (new.get("metadata") or {}).get(
            "deletionTimestamp") is not None
        if not now_deleting:
            return
        meta = new.get("metadata") or {}
        uid = (meta.get("labels") or {}).get(types.LABEL_VM_UID, "")
        if meta.get("name") in self._expected_pods or uid in self._expected_vm_uids:
            return
        self.report.unexpected_deletions.append(
            UnexpectedDeletion(vm_of(new) or "", str(meta.get("name")), rv))

    def _run(self) -> None:
        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self._list()
                for event in self._events(rv):
                    kind = str(event.get("type"))
                    obj = event.get("object") or {}
                    if kind == "ERROR":
                        raise RuntimeError(f"watch error: {obj.get('code')} {obj.get('message')}")
                    if kind == "BOOKMARK":
                        rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                        continue
                    rv = self._apply(kind, obj)
            except Exception:
                if self._stop.is_set():
                    return
                self.report.errors += 1
                self.report.gaps += 1
                rv = None
                self._stop.wait(0.2)


@dataclass
class WatchdogReport:
    """Both checkers' findings, merged for a verdict."""

    poll: CheckerReport
    watch: WatchReport
    replacement: dict[str, Any]

    @property
    def strict(self) -> list[Violation]:
        return _distinct(self.poll.strict + self.watch.strict)

    @property
    def loose(self) -> list[Violation]:
        return _distinct(self.poll.loose + self.watch.loose)

    @property
    def ok(self) -> bool:
        return not self.strict and not self.loose and not self.watch.unexpected_deletions

    def as_dict(self) -> dict[str, Any]:
        return {
            "duplicates": len(self.strict),
            "duplicates_loose": len(self.loose),
            "unexpected_deletions": [f"{u.vm}: {u.pod} at resourceVersion "
                                     f"{u.resource_version}"
                                     for u in self.watch.unexpected_deletions],
            "violations": [{"vm": v.vm, "pods": list(v.pods), "strict": v.strict,
                            "resourceVersion": v.resource_version}
                           for v in self.strict + self.loose],
            "pod_lists": self.poll.samples,
            "pod_events": self.watch.events,
            "watch_gaps": self.watch.gaps,
            "checker_errors": self.poll.errors + self.watch.errors,
            **self.replacement,
        }


def _distinct(violations: list[Violation]) -> list[Violation]:
    """One entry per (VM, set of pods): the same duplicate seen twice is one episode."""
    seen: set[tuple[str, tuple[str, ...]]] = set()
    out = []
    for v in violations:
        if (v.vm, v.pods) not in seen:
            seen.add((v.vm, v.pods))
            out.append(v)
    return out


class Watchdog:
    """The polling checker and the watching checker over one namespace, as one."""

    def __init__(self, api: client.ApiClient, namespace: str, poll_interval: float = 0.2,
                 on_event: Callable[[str, Pod], None] | None = None,
                 on_change: Callable[[str, Pod, Pod | None], None] | None = None) -> None:
        self.poller = InvariantChecker(api, namespace, interval=poll_interval)
        self.watcher = PodWatchChecker(api, namespace, on_event=on_event, on_change=on_change)

    def __enter__(self) -> Watchdog:
        self.watcher.start()
        self.poller.__enter__()
        self.watcher.synced.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> WatchdogReport:
        poll = self.poller.stop()
        watch = self.watcher.stop()
        return WatchdogReport(poll, watch, self.watcher.clock.summary())

    def duplicates_so_far(self) -> int:
        return len(_distinct(self.poller.report.strict + self.watcher.report.strict))
