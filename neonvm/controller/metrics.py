"""Prometheus metrics of the controller, registered in the health server's registry.

One :class:`ControllerMetrics` per process, built on the registry the health server
serves at ``/metrics`` (never the global default registry, so tests can build several).
Beside the project's own ``neonvm_controller_*`` families it serves, under the names and
labels their dashboards query: controller-runtime's (``controller_runtime_*``,
``workqueue_*``, ``rest_client_*``, ``leader_election_master_status``; controller and
queue name ``virtualmachine``), NeonVM's VM lifecycle families, and the process,
platform and GC collectors. docs/metrics.md lists every family and what it counts.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from kubernetes import client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from neonvm import kube
from neonvm.leader.health import add_process_collectors

CONTROLLER = "virtualmachine"
"""The controller's and its work queue's name in controller-runtime's families (the
``controller`` and ``name`` labels): NeonVM's VM controller's."""

RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45,
                     0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0,
                     4.5, 5, 6, 7, 8, 9, 10, 15, 20, 25, 30, 40, 50, 60)
"""controller-runtime's reconcile time buckets (NeonVM's lifecycle histograms too)."""
QUEUE_BUCKETS = tuple(1e-8 * 10 ** i for i in range(12))
"""client-go's work queue buckets: 10 ns to 1000 s, ten times apart."""
REST_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
"""client-go's request latency buckets."""
RUNNING_BUCKETS = (1, 5, 10, 12, 14, 16, 18, 20, 25, 30, 40, 50, 60, 80, 100, 120, 140,
                   160, 200, 300)
"""NeonVM's buckets for the times up to a VM's Running."""
RESULTS = ("success", "error", "requeue", "requeue_after")
"""controller-runtime's reconcile results."""
FAILURE_PENDING_SECONDS = 60.0
"""NeonVM's failure pending period: a VM counts as failing once its reconciles have only
failed for this long (NeonVM's ``--failure-pending-period`` default)."""
LOW_PRIORITY = "-100"
"""The ``priority`` label of the periodic line's depth: controller-runtime's LowPriority,
which its priority queue gives to the same kind of work (initial lists, resyncs)."""
REMEMBERED_PODS = 10_000
"""Runner pods whose creation time is kept until their VM is Running or the pod is
deleted, at most (oldest dropped)."""


class TurnOutcome(Protocol):
    """What :meth:`ControllerMetrics.turn_ended` reads of a handler's outcome."""

    @property
    def kind(self) -> str: ...

    @property
    def after(self) -> float: ...

    @property
    def converged(self) -> bool: ...


def reconcile_result(outcome: TurnOutcome | None) -> str:
    """controller-runtime's ``result`` of one turn: ``error`` for a failed one,
    ``success`` for a converged (or gone) VM, ``requeue_after`` for one that comes back
    after a delay (still converging, stuck, or skipped while the cache is behind),
    ``requeue`` for one that comes back at once (also a turn dropped as the term ends:
    the next leader takes the VM up)."""
    if outcome is None or outcome.kind in ("temporary", "permanent", "raised"):
        return "error"
    if outcome.kind == "gone" or (outcome.kind == "requeue" and outcome.converged):
        return "success"
    if outcome.kind == "behind" or (outcome.kind == "requeue" and outcome.after > 0):
        return "requeue_after"
    return "requeue"


class QueueMetrics:
    """client-go's work queue families for one queue, and controller-runtime's active
    workers; a :class:`~neonvm.controller.workqueue.WorkQueue` tells it what happens.

    Called under the queue's lock: each method only takes its own lock. The gauges are
    read at scrape time from the queue attached (a term's queue, from its construction
    to its shutdown) and from the keys being worked on.
    """

    def __init__(self, registry: CollectorRegistry, name: str = CONTROLLER,
                 clock: Callable[[], float] = time.monotonic,
                 on_attach: Callable[[], None] | None = None) -> None:
        """``on_attach`` is called when a queue attaches or detaches (a term starts or
        ends)."""
        self.name = name
        self._clock = clock
        self._on_attach = on_attach
        labels = ["name", "controller"]
        self._adds = Counter("workqueue_adds_total", "Total number of adds handled by "
                             "workqueue", labels, registry=registry).labels(name, name)
        self._retries = Counter(
            "workqueue_retries_total", "Total number of items added to the workqueue with "
            "a non-zero delay (rate-limited requeues, explicit RequeueAfter or AddAfter "
            "calls)", labels, registry=registry).labels(name, name)
        self._latency = Histogram(
            "workqueue_queue_duration_seconds", "How long in seconds an item stays in "
            "workqueue before being requested", labels, buckets=QUEUE_BUCKETS,
            registry=registry).labels(name, name)
        self._work = Histogram(
            "workqueue_work_duration_seconds", "How long in seconds processing an item "
            "from workqueue takes.", labels, buckets=QUEUE_BUCKETS,
            registry=registry).labels(name, name)
        self._lock = threading.Lock()
        self._started: dict[str, float] = {}
        self._depth: Callable[[], tuple[int, int]] | None = None
        self.attached = 0
        """Queues attached so far (each term's queue attaches once)."""

    # ---- told by the queue ------------------------------------------------------------

    def attach(self, depth: Callable[[], tuple[int, int]]) -> None:
        """A new queue: ``depth()`` answers its ready keys (event line, periodic line)."""
        with self._lock:
            self._depth = depth
            self.attached += 1
        if self._on_attach is not None:
            self._on_attach()

    def detach(self, depth: Callable[[], tuple[int, int]]) -> None:
        with self._lock:
            if self._depth != depth:  # bound methods: equal, never identical
                return
            self._depth = None
        if self._on_attach is not None:
            self._on_attach()

    def added(self) -> None:
        self._adds.inc()

    def delayed(self) -> None:
        self._retries.inc()

    def taken(self, key: str, waited: float | None) -> None:
        if waited is not None:
            self._latency.observe(waited)
        with self._lock:
            self._started[key] = self._clock()

    def done(self, key: str) -> None:
        with self._lock:
            started = self._started.pop(key, None)
        if started is not None:
            self._work.observe(max(0.0, self._clock() - started))

    # ---- read at scrape time ----------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            running = [self._clock() - t for t in self._started.values()]
            depth_of = self._depth
        labels = ["name", "controller"]
        depth = GaugeMetricFamily("workqueue_depth", "Current depth of workqueue by "
                                  "workqueue and priority", labels=[*labels, "priority"])
        event, periodic = depth_of() if depth_of is not None else (0, 0)
        depth.add_metric([self.name, self.name, "0"], event)
        depth.add_metric([self.name, self.name, LOW_PRIORITY], periodic)
        yield depth
        yield _gauge("workqueue_unfinished_work_seconds", "How many seconds of work has "
                     "been done that is in progress and hasn't been observed by "
                     "work_duration. Large values indicate stuck threads. One can deduce "
                     "the number of stuck threads by observing the rate at which this "
                     "increases.", labels, [self.name, self.name], sum(running))
        yield _gauge("workqueue_longest_running_processor_seconds", "How many seconds has "
                     "the longest running processor for workqueue been running.", labels,
                     [self.name, self.name], max(running, default=0.0))
        yield _gauge("controller_runtime_active_workers", "Number of currently used "
                     "workers per controller", ["controller"], [self.name], len(running))


class FailingObjects:
    """NeonVM's failing objects: VMs whose turns have only failed for the pending period
    (actively retried: one failed within the last period), per NeonVM's failure lag."""

    def __init__(self, period: float = FAILURE_PENDING_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.period = period
        self._clock = clock
        self._lock = threading.Lock()
        self._first: dict[str, float] = {}
        self._last: dict[str, float] = {}

    def failed(self, key: str) -> None:
        now = self._clock()
        with self._lock:
            self._first.setdefault(key, now)
            self._last[key] = now

    def succeeded(self, key: str) -> None:
        with self._lock:
            self._first.pop(key, None)
            self._last.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._first.clear()
            self._last.clear()

    def counts(self) -> tuple[int, int]:
        """(failing and retried within the period, failing and not retried since)."""
        now = self._clock()
        with self._lock:
            failing = [k for k, t in self._first.items() if now - t >= self.period]
            retried = sum(1 for k in failing if now - self._last[k] < self.period)
        return retried, len(failing) - retried


class Lifecycle:
    """NeonVM's VM lifecycle families: VM creation to runner pod creation, runner pod
    creation to Running, VM creation to Running (first runs only, as NeonVM), and
    restarts. The reconciler reports the pods it creates; the VM informer the VMs'
    changes (a change seen in a term's first list is no transition, so a new leader
    counts nothing twice)."""

    def __init__(self, registry: CollectorRegistry,
                 wall: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)) -> None:
        self._wall = wall
        self.to_runner = Histogram(
            "vm_creation_to_runner_creation_duration_seconds",
            "Time duration from VirtualMachine.CreationTimestamp to runner "
            "Pod.CreationTimestamp", buckets=RECONCILE_BUCKETS, registry=registry)
        self.runner_to_running = Histogram(
            "vm_runner_creation_to_vm_running_duration_seconds",
            "Time duration from runner Pod.CreationTimestamp to the moment when "
            "VirtualMachine.Status.Phase becomes Running", buckets=RUNNING_BUCKETS,
            registry=registry)
        self.to_running = Histogram(
            "vm_creation_to_vm_running_duration_seconds",
            "Time duration from VirtualMachine.CreationTimeStamp to the moment when "
            "VirtualMachine.Status.Phase becomes Running", buckets=RUNNING_BUCKETS,
            registry=registry)
        self.restarts = 0
        self._lock = threading.Lock()
        self._pods: OrderedDict[str, dt.datetime] = OrderedDict()
        """Creation times of runner pods this replica created, by uid."""

    def runner_created(self, vm: Mapping[str, Any], pod: Mapping[str, Any]) -> None:
        """The reconciler created ``pod`` (as the API server answered) for ``vm`` (raw)."""
        meta = pod.get("metadata") or {}
        created = _timestamp(meta.get("creationTimestamp"))
        if created is None:
            return
        with self._lock:
            self._pods[str(meta.get("uid", ""))] = created
            while len(self._pods) > REMEMBERED_PODS:
                self._pods.popitem(last=False)
        vm_created = _timestamp((vm.get("metadata") or {}).get("creationTimestamp"))
        if vm_created is not None and not _status(vm).get("restartCount"):
            self.to_runner.observe(max(0.0, (created - vm_created).total_seconds()))

    def pod_deleted(self, uid: str) -> None:
        """The pod informer saw runner pod ``uid`` deleted: its VM can no longer become
        Running with it."""
        with self._lock:
            self._pods.pop(uid, None)

    def remembered(self) -> int:
        """Runner pods whose creation time is kept."""
        with self._lock:
            return len(self._pods)

    def vm_changed(self, old: Mapping[str, Any] | None,
                   new: Mapping[str, Any] | None) -> None:
        """The VM informer's change: a restart counted, a first Running observed."""
        if old is None or new is None:
            return
        before, after = _status(old), _status(new)
        restarts = int(after.get("restartCount") or 0) - int(before.get("restartCount") or 0)
        if restarts > 0:
            with self._lock:
                self.restarts += restarts
        if before.get("phase") == "Running" or after.get("phase") != "Running":
            return
        now = self._wall()
        with self._lock:
            pod_created = self._pods.pop(str(after.get("podUID", "")), None)
        if pod_created is not None:
            self.runner_to_running.observe(max(0.0, (now - pod_created).total_seconds()))
        vm_created = _timestamp((new.get("metadata") or {}).get("creationTimestamp"))
        if vm_created is not None and not after.get("restartCount"):
            self.to_running.observe(max(0.0, (now - vm_created).total_seconds()))

    def collect(self) -> Iterator[Metric]:
        # NeonVM's counter has no _total suffix, which prometheus_client adds to every
        # counter: served untyped under the exact name its queries use.
        restarts = Metric("vm_restarts_count", "Total number of VM restarts across the "
                          "cluster captured by VirtualMachine reconciler", "unknown")
        with self._lock:
            restarts.add_sample("vm_restarts_count", {}, self.restarts)
        yield restarts


class ControllerMetrics:
    """The controller's families; see the module doc and docs/metrics.md."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._lease: str | None = None
        self._workers = 0
        self.reconciles = Counter(
            "neonvm_controller_reconciles_total", "Reconciles finished, by result.",
            ["result"], registry=r)
        self.reconcile_seconds = Histogram(
            "neonvm_controller_reconcile_duration_seconds", "Wall time of one reconcile.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        self.turn_seconds = Histogram(
            "neonvm_controller_turn_duration_seconds",
            "Wall time of one key's turn on a worker (lock, reconcile, requeue), by the "
            "handler's outcome: the sum over the run is the workers' busy time.",
            ["outcome"], buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r)
        self.queue_wait_seconds = Histogram(
            "neonvm_controller_queue_wait_seconds",
            "Time a key waited for a worker once ready (not its delay before that), by the "
            "queue's line (event: watch events, Waits, retries; periodic: re-checks, scans).",
            ["line"], buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r)
        self.heap_trim_seconds = Histogram(
            "neonvm_controller_heap_trim_duration_seconds",
            "Wall time of one malloc_trim of the process's C heap (the heap trimmer).",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1), registry=r)
        self.actions = Counter(
            "neonvm_controller_actions_total", "Actions performed, by kind and outcome.",
            ["action", "outcome"], registry=r)
        self.conflicts = Counter(
            "neonvm_controller_conflicts_total",
            "409 Conflicts absorbed by re-reading and re-applying the mutation.", registry=r)
        self.plans_resumed = Counter(
            "neonvm_controller_plans_resumed_total",
            "Reconciles that found a recorded plan (status.pendingPod) and carried it on.",
            registry=r)
        self.queue_depth = Gauge(
            "neonvm_controller_queue_depth", "VM keys ready to be reconciled.", registry=r)
        self.gate_stripped = Counter(
            "neonvm_controller_gate_stripped_total",
            "ALARM: a runner pod came back from create without our scheduling gate.",
            registry=r)
        self.create_refused = Counter(
            "neonvm_controller_pod_create_refused_total",
            "Pod creates refused by the API server (validation or admission).", registry=r)
        self.fenced = Counter(
            "neonvm_controller_fenced_total",
            "Reconciles that found the VM's status fenced ahead of this leader's (epoch, "
            "token): marked Degraded when ahead by epoch, the term ended when by token only.",
            registry=r)
        self.leading = Gauge(
            "neonvm_controller_leading", "1 while this replica leads and reconciles.",
            registry=r)
        self.locks_held = Gauge(
            "neonvm_controller_locks_held", "Per-VM etcd locks held by this replica.",
            registry=r)
        self.scans = Counter(
            "neonvm_controller_scans_total",
            "Periodic requeue scans run (mid_plan: VMs that look mid-plan; resync: every VM).",
            ["scan"], registry=r)
        self.cache_evictions = Counter(
            "neonvm_controller_cache_evictions_total",
            "Deleted VMs dropped from the cache after a direct read found them gone (their "
            "watch deletion event was missed).", registry=r)
        self.stuck = Counter(
            "neonvm_controller_stuck_reconciles_total",
            "Reconciles that ended without converging, by the step that kept not taking "
            "effect (step budget used up) or was refused for good (ungate forbidden); "
            "the VM is retried with exponential backoff.", ["step"], registry=r)
        self.sync_deadline_step_downs = Counter(
            "neonvm_controller_sync_deadline_step_downs_total",
            "Terms given up because the caches did not sync within the sync deadline "
            "(the Lease is released for a standby).", registry=r)
        self.events_dropped = Counter(
            "neonvm_controller_events_dropped_total",
            "Kubernetes Events not written because the event queue was full.", registry=r)
        self.events_aggregated = Counter(
            "neonvm_controller_events_aggregated_total",
            "Repeated Kubernetes Events folded into an existing one (its count bumped).",
            registry=r)
        self.resync_differing = Gauge(
            "neonvm_controller_resync_differing",
            "VMs the last resync found differing from the caches (requeued, read directly).",
            registry=r)
        self.swept = Counter(
            "neonvm_controller_swept_total", "Objects removed by sweeps, by kind.",
            ["kind"], registry=r)
        self.undecodable = Counter(
            "neonvm_controller_undecodable_objects_total",
            "VM versions the informer could not decode (nested too deep) and left out of "
            "the cache; each also gets a Warning Event, reason Undecodable.", registry=r)
        self.worker_errors = Counter(
            "neonvm_controller_worker_errors_total",
            "Exceptions that escaped a worker's turn (outside the reconcile's own error "
            "handling); the worker logs, requeues the key with backoff and goes on.",
            registry=r)

        add_process_collectors(r)
        # ---- controller-runtime's families (controller "virtualmachine") ----
        ctl = ["controller"]
        self.reconcile_total = Counter(
            "controller_runtime_reconcile_total", "Total number of reconciliations per "
            "controller", ["controller", "result"], registry=r)
        self.reconcile_errors = Counter(
            "controller_runtime_reconcile_errors_total", "Total number of reconciliation "
            "errors per controller", ctl, registry=r).labels(CONTROLLER)
        self.terminal_errors = Counter(
            "controller_runtime_terminal_reconcile_errors_total", "Total number of "
            "terminal reconciliation errors per controller", ctl, registry=r
        ).labels(CONTROLLER)
        self.reconcile_panics = Counter(
            "controller_runtime_reconcile_panics_total", "Total number of reconciliation "
            "panics per controller", ctl, registry=r).labels(CONTROLLER)
        self.reconcile_time = Histogram(
            "controller_runtime_reconcile_time_seconds", "Length of time per "
            "reconciliation per controller", ctl, buckets=RECONCILE_BUCKETS, registry=r
        ).labels(CONTROLLER)
        for result in RESULTS:
            self.reconcile_total.labels(CONTROLLER, result)
        self.failing = FailingObjects(clock=clock)
        """NeonVM's failing objects, this term's (cleared as a term starts and ends)."""
        self.workqueue = QueueMetrics(r, CONTROLLER, clock, on_attach=self.failing.clear)
        """Handed to the term's :class:`~neonvm.controller.workqueue.WorkQueue`."""
        self.rest_requests = Counter(
            "rest_client_requests_total", "Number of HTTP requests, partitioned by status "
            "code, method, and host.", ["code", "method", "host"], registry=r)
        self.rest_latency = Histogram(
            "rest_client_request_duration_seconds", "Request latency in seconds. Broken "
            "down by verb and host.", ["verb", "host"], buckets=REST_BUCKETS, registry=r)
        # ---- NeonVM's ----
        self.neonvm_reconcile_seconds = Histogram(
            "reconcile_duration_seconds", "Time duration of reconciles", ["outcome"],
            buckets=RECONCILE_BUCKETS, registry=r)
        self.lifecycle = Lifecycle(r)
        self._remembered: dict[str, Callable[[], int]] = {
            "lifecycle_pods": self.lifecycle.remembered}
        r.register(_Derived(self))

    def remembered(self, structure: str, size: Callable[[], int]) -> None:
        """Serve ``size()`` as ``neonvm_controller_remembered_entries{structure=...}``:
        how many entries one of the controller's memories holds (read at scrape time;
        ``size`` must be cheap)."""
        self._remembered[structure] = size

    def describe(self, lease: str, workers: int) -> None:
        """The Lease this replica campaigns for (``leader_election_master_status``'s
        ``name``) and its workers (``controller_runtime_max_concurrent_reconciles``)."""
        self._lease = lease
        self._workers = workers

    def observe_requests(self, *apis: client.ApiClient) -> None:
        """Count every request sent through ``apis`` in the ``rest_client_*`` families."""
        for api in apis:
            kube.observe_requests(api, self._request_sent)

    def _request_sent(self, method: str, host: str, code: str, seconds: float) -> None:
        self.rest_requests.labels(code, method, host).inc()
        self.rest_latency.labels(method, host).observe(seconds)

    def turn_ended(self, key: str, outcome: TurnOutcome | None, seconds: float) -> None:
        """One key's turn on a worker ended with ``outcome`` (None: it raised)."""
        kind = outcome.kind if outcome is not None else "raised"
        self.turn_seconds.labels(outcome=kind).observe(seconds)
        result = reconcile_result(outcome)
        self.reconcile_total.labels(CONTROLLER, result).inc()
        self.reconcile_time.observe(seconds)
        if result == "error":
            self.reconcile_errors.inc()
            if kind == "permanent":
                self.terminal_errors.inc()
            if kind == "raised":
                self.reconcile_panics.inc()
            self.failing.failed(key)
        elif kind not in ("dropped", "behind"):
            self.failing.succeeded(key)
        if kind not in ("dropped", "behind"):
            self.neonvm_reconcile_seconds.labels(
                "failure" if result == "error" else "success").observe(seconds)


class _Derived(Collector):
    """The families read at scrape time (from other metrics' state)."""

    def __init__(self, metrics: ControllerMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        yield from m.workqueue.collect()
        yield _gauge("controller_runtime_max_concurrent_reconciles", "Maximum number of "
                     "concurrent reconciles per controller", ["controller"], [CONTROLLER],
                     m._workers)
        if m._lease is not None:
            leading = sum(s.value for f in m.leading.collect() for s in f.samples)
            yield _gauge("leader_election_master_status", "Gauge of if the reporting "
                         "system is master of the relevant lease, 0 indicates backup, 1 "
                         "indicates master. 'name' is the string used to identify the "
                         "lease. Please make sure to group by name.", ["name"],
                         [m._lease], leading)
        retried, not_retried = m.failing.counts()
        failing = GaugeMetricFamily(
            "reconcile_failing_objects", "Number of objects that are failing to reconcile "
            "for each specific controller", labels=["controller", "outcome",
                                                    "actively_retried"])
        failing.add_metric([CONTROLLER, "failure", "true"], retried)
        failing.add_metric([CONTROLLER, "failure", "false"], not_retried)
        yield failing
        yield from m.lifecycle.collect()
        remembered = GaugeMetricFamily(
            "neonvm_controller_remembered_entries", "Entries held by one of the "
            "controller's memories of VMs, pods and events, by structure (what should "
            "not grow with churn; docs/metrics.md).", labels=["structure"])
        for structure, size in sorted(m._remembered.items()):
            remembered.add_metric([structure], size())
        yield remembered


def _gauge(name: str, documentation: str, labels: list[str], values: list[str],
           value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=labels)
    family.add_metric(values, value)
    return family


def _status(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    status = obj.get("status")
    return status if isinstance(status, Mapping) else {}


def _timestamp(text: Any) -> dt.datetime | None:
    """An API object's RFC 3339 timestamp, or None when missing or malformed."""
    if not isinstance(text, str) or not text:
        return None
    try:
        at = dt.datetime.fromisoformat(text)
    except ValueError:
        return None
    return at.replace(tzinfo=dt.UTC) if at.tzinfo is None else at
