"""Kubernetes Events on VirtualMachines: plan, commit, restart, clean-up, alarms.

Events are for people (``kubectl describe neonvm``), never for the controller's own logic:
recording one is best effort, and a failure is logged and otherwise ignored.

Two things keep them cheap (client-go's ``EventBroadcaster`` and ``EventCorrelator`` are
the model):

* **Off the critical path.** A recorder built with ``background=True`` (the controller
  process's) only logs the event and puts it in a bounded queue; one background thread
  writes the Events. A worker never waits for the API server on an Event's account.
  When the queue is full the event is dropped and counted
  (``neonvm_controller_events_dropped_total``); :meth:`EventRecorder.close` sends what
  is still queued (for a bounded time) on a graceful shutdown. Without ``background``
  (tests, tools) :meth:`EventRecorder.record` writes at once, as before.
* **Repeats aggregated.** An event with the same involved object (uid), type, reason and
  message as one written in the last :data:`AGGREGATE_SECONDS` does not create a new
  Event: the existing one is patched, its ``count`` bumped and ``lastTimestamp`` moved.
  The memory of recent Events holds only what can still aggregate: an entry last
  written more than :data:`AGGREGATE_SECONDS` ago is dropped at the next write (messages
  name runner pods, so most keys never come back once their pod is replaced), and
  :data:`AGGREGATE_ENTRIES` bounds it beside (least recently written first). An Event
  that disappeared meanwhile (404) is created afresh.

Which events are emitted, and their reasons, types and messages, are the callers' (the
reconciler's) and do not change here.
"""

from __future__ import annotations

import datetime as dt
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from loguru import logger
from urllib3.exceptions import HTTPError

from neonvm import kube
from neonvm.api import types
from neonvm.api.types import VirtualMachine

COMPONENT = "neonvm-controller"
QUEUE_SIZE = 1000
"""Events waiting for the background writer; more are dropped (and counted)."""
AGGREGATE_SECONDS = 600.0
"""A repeat within this long of the last write bumps that Event (client-go: 10 min)."""
AGGREGATE_ENTRIES = 4096
"""Recent Events remembered for aggregation at most (least recently written forgotten
first); those older than :data:`AGGREGATE_SECONDS` are forgotten before that."""
MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True)
class PendingEvent:
    """One event to write: what the reconciler recorded, and when."""

    namespace: str
    name: str
    uid: str | None
    resource_version: str | None
    reason: str
    message: str
    warning: bool
    at: dt.datetime

    @property
    def key(self) -> tuple[str, str, str | None, str, str, bool]:
        """What makes two events repeats of each other."""
        return (self.namespace, self.name, self.uid, self.reason, self.message, self.warning)


@dataclass
class _Recent:
    """An Event written lately: its name, count and when it was last written."""

    name: str
    count: int
    written: float


class EventRecorder:
    """Writes core/v1 Events about VMs (best effort; see the module doc)."""

    def __init__(self, api: client.ApiClient | None, identity: str = "", *,
                 background: bool = False, queue_size: int = QUEUE_SIZE,
                 dropped: Any = None, aggregated: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``dropped``/``aggregated``: counters (``inc()``) of events dropped because the
        queue was full, and of repeats folded into an existing Event."""
        self._api = api
        self._identity = identity
        self._dropped = dropped
        self._aggregated = aggregated
        self._clock = clock
        self._recent: OrderedDict[tuple[str, str, str | None, str, str, bool], _Recent] = \
            OrderedDict()
        self._write_lock = threading.Lock()
        """Serializes writes (and the LRU) when ``record`` writes in the caller's thread."""
        self._queue: queue.Queue[PendingEvent | None] | None = None
        self._thread: threading.Thread | None = None
        if background and self._api is not None:
            self._queue = queue.Queue(maxsize=queue_size)
            self._thread = threading.Thread(target=self._run, name="event-writer",
                                            daemon=True)
            self._thread.start()

    # ---- recording (any thread) --------------------------------------------------------

    def record(self, vm: VirtualMachine, reason: str, message: str,
               warning: bool = False) -> None:
        log = logger.bind(vm=vm.key, reason=reason)
        (log.warning if warning else log.info)("event: {message}", message=message)
        if self._api is None:
            return
        event = PendingEvent(namespace=vm.namespace, name=vm.name, uid=vm.uid,
                             resource_version=vm.resource_version, reason=reason,
                             message=message[:1024], warning=warning,
                             at=dt.datetime.now(dt.UTC))
        if self._queue is None:
            self.write(event)
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            if self._dropped is not None:
                self._dropped.inc()
            log.debug("event queue full: event dropped")

    def remembered(self) -> int:
        """Recent Events remembered for aggregation (``neonvm_controller_remembered``)."""
        return len(self._recent)

    def pending(self) -> int:
        """Events queued for the background writer."""
        return self._queue.qsize() if self._queue is not None else 0

    def close(self, timeout: float = 5.0) -> None:
        """Write what is still queued (for at most ``timeout`` seconds), then stop."""
        if self._queue is None or self._thread is None:
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._queue.put(None, timeout=max(0.01, deadline - time.monotonic()))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    break
        self._thread.join(max(0.0, deadline - time.monotonic()))

    # ---- writing (the background thread, or the caller's) -------------------------------

    def _run(self) -> None:
        assert self._queue is not None
        while True:
            event = self._queue.get()
            if event is None:
                return
            self.write(event)

    def write(self, event: PendingEvent) -> None:
        """Create the Event, or bump the recent one it repeats (best effort)."""
        with self._write_lock:
            try:
                self._write_locked(event)
            except (ApiException, HTTPError, OSError) as exc:
                logger.bind(vm=f"{event.namespace}/{event.name}", reason=event.reason).debug(
                    "could not record event: {err}", err=exc)

    def _write_locked(self, event: PendingEvent) -> None:
        assert self._api is not None
        now = self._clock()
        self._forget_older_than(now - AGGREGATE_SECONDS)
        recent = self._recent.get(event.key)
        if recent is not None and now - recent.written <= AGGREGATE_SECONDS:
            try:
                kube.request(
                    self._api, "PATCH", f"{_events_path(event.namespace)}/{recent.name}",
                    body={"count": recent.count + 1, "lastTimestamp": _timestamp(event.at)},
                    content_type=MERGE_PATCH, timeout=10)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                del self._recent[event.key]  # gone meanwhile: create it afresh
            else:
                recent.count += 1
                recent.written = now
                self._recent.move_to_end(event.key)
                if self._aggregated is not None:
                    self._aggregated.inc()
                return
        name = f"{event.name}.{uuid.uuid4().hex[:16]}"
        kube.request(self._api, "POST", _events_path(event.namespace),
                     body=self._body(event, name), timeout=10)
        self._recent[event.key] = _Recent(name=name, count=1, written=now)
        self._recent.move_to_end(event.key)
        while len(self._recent) > AGGREGATE_ENTRIES:
            self._recent.popitem(last=False)

    def _forget_older_than(self, cutoff: float) -> None:
        """Drop the entries last written before ``cutoff``: no repeat can bump them any
        more. Every write moves its entry to the end, so the oldest are first."""
        while self._recent:
            oldest = next(iter(self._recent.values()))
            if oldest.written >= cutoff:
                return
            self._recent.popitem(last=False)

    def _body(self, event: PendingEvent, name: str) -> dict[str, Any]:
        """The core/v1 Event, as JSON (what the typed ``CoreV1Event`` serialized to: unset
        fields left out, the times as ``datetime.isoformat``)."""
        involved = {"apiVersion": types.API_VERSION, "kind": types.KIND, "name": event.name,
                    "namespace": event.namespace, "uid": event.uid,
                    "resourceVersion": event.resource_version}
        body: dict[str, Any] = {
            "metadata": {"name": name, "namespace": event.namespace},
            "involvedObject": {k: v for k, v in involved.items() if v is not None},
            "reason": event.reason,
            "message": event.message,
            "type": "Warning" if event.warning else "Normal",
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "firstTimestamp": event.at.isoformat(),
            "lastTimestamp": event.at.isoformat(),
            "count": 1,
        }
        if self._identity:
            body["reportingInstance"] = self._identity
        return body


def _events_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/events"


def _timestamp(at: dt.datetime) -> str:
    return at.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
