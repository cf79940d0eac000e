"""Prometheus metrics of the reconciler, registered in the health server's registry.

One :class:`ControllerMetrics` per process, built on the registry the health server
serves at ``/metrics`` (never the global default registry, so tests can build several).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ControllerMetrics:
    """Counters and gauges named ``neonvm_controller_*``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
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
