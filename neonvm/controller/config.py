"""One replica's knobs (:class:`ControllerConfig`, filled by the CLI from flags and
environment) and the API client's pool size they imply (docs/reconciler.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from neonvm.controller.reconciler import ReconcilerConfig
from neonvm.controller.workqueue import Backoff


@dataclass(frozen=True)
class ControllerConfig:
    """Knobs of one replica (the CLI fills these from flags and environment)."""

    workers: int = 16
    """Reconcile workers in the leader. A worker spends nearly all of a turn waiting for
    the API server's answers (docs/benchmarks.md, "Where a convergence's time goes"), so
    more of them keep more requests in flight; 16 converged a burst of new VMs fastest in
    the sweep of 4, 8, 16 and 32 measured there."""
    watch_namespace: str | None = None
    """Reconcile VMs of this namespace only (None: all namespaces)."""
    resync_seconds: float = 30.0
    """Compare metadata-only lists of VMs and pods with the caches this often, and requeue
    (read directly) the VMs that differ."""
    recheck_seconds: float = 300.0
    """A converged VM is re-checked from the cache this often, stretched by up to
    ``recheck_spread`` of itself at random."""
    recheck_spread: float = 0.25
    plan_requeue_seconds: float = 2.0
    sweep_seconds: float = 300.0
    """Sweep the locks and runner pods of deleted VMs this often, stretched by up to a
    quarter at random. Each sweep lists every pod and VM (metadata only), which at scale
    costs the leader more than its workers do (docs/benchmarks.md, "At scale"). Leftovers are rare
    (the handler releases a deleted VM's lock; the garbage collector removes its pods),
    and they block nothing meanwhile."""
    orphan_grace_seconds: float = 30.0
    """A pod whose VM is gone is deleted by the sweep only after this long (the garbage
    collector normally removes it first)."""
    session_ttl: int = 10
    relist_seconds: float = 300.0
    """The informers re-list this often, healing a cache that missed watch events."""
    sync_deadline_seconds: float = 300.0
    """A leader whose caches have not synced this long after its term started steps down
    and releases the Lease, so that a standby (which may be able to list) takes over
    instead of this replica holding the Lease while reconciling nothing."""
    heap_trim_seconds: float = 10.0
    """Hand the C heap's free pages back to the kernel this often (0: never); see
    :mod:`neonvm.controller.heap`."""
    reconciler: ReconcilerConfig = field(default_factory=ReconcilerConfig)
    backoff: Backoff = field(default_factory=Backoff)
    stuck_backoff: Backoff = field(default_factory=lambda: Backoff(base=1.0, cap=300.0))
    """Requeue delay of a VM whose reconciles keep ending stuck (per VM, doubling with
    each stuck reconcile in a row, reset by one that ends normally)."""


HTTP_POOL_BEYOND_WORKERS = 8
"""Connections of the API client's pool beyond one per worker: the two informers' watches,
the Events recorder, the term's scans and sweeps, live scaling's Secrets."""


def http_pool_size(workers: int) -> int:
    """The API client's pool for ``workers`` workers: each worker's request finds a kept
    connection (beyond the pool, every request would open one, TLS handshake included,
    and close it after)."""
    return workers + HTTP_POOL_BEYOND_WORKERS
