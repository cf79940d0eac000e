"""One controller replica: campaign, and while leading, reconcile every VM under its lock.

:class:`ControllerProcess` owns what lives as long as the process (the API client, the
metrics, the elector and its Lease store: the composition root); each term the elector
hands over runs a :class:`LeaderTerm` until it is lost, owning what must not outlive it
(informers, work queue, workers, etcd session and locks, timers, periodic scans). What a
worker does with a key is the :class:`~neonvm.controller.handler.Handler`'s. What a term
guarantees, and what not: docs/reconciler.md, "What a leader term guarantees".
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from loguru import logger

from neonvm import kube
from neonvm.api import types
from neonvm.controller import actions as act
from neonvm.controller.acceleration import HTTPRunnerStatus, RunnerReports
from neonvm.controller.authority import AuthorityLost
from neonvm.controller.cluster import KubeCluster
from neonvm.controller.config import ControllerConfig
from neonvm.controller.events import EventRecorder
from neonvm.controller.fencing import SelfFencing
from neonvm.controller.handler import Handler, Outcome
from neonvm.controller.heap import HeapTrimmer
from neonvm.controller.informer import (
    MAX_CACHED_VM_BYTES,
    Informer,
    Lister,
    Obj,
    Undecodable,
    project_pod,
)
from neonvm.controller.leader_endpoint import LeaderEndpoint
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.midplan import MidPlanSet
from neonvm.controller.observe import pod_index, split_key
from neonvm.controller.reconciler import Reconciler
from neonvm.controller.resync import differing, pod_vm_key
from neonvm.controller.rights import RightsLedger, TokenReviewer
from neonvm.controller.scaling import RunnerScaling
from neonvm.controller.sweeps import Sweeps, iter_items
from neonvm.controller.timers import Jitter, VMTimers
from neonvm.controller.wiring import Wiring
from neonvm.controller.workqueue import WorkQueue
from neonvm.kube import short_error
from neonvm.leader.election import ElectionConfig, LeaderElector, Leadership, LeadershipLost
from neonvm.leader.epoch import EpochFloor
from neonvm.leader.etcd import Etcd, EtcdConfig, EtcdError
from neonvm.leader.health import HealthServer
from neonvm.leader.lease_store import KubernetesLeaseStore
from neonvm.leader.lock import Installation, LockGuard, LockLost, LockManager
from neonvm.leader.session import Session

RIGHTS_PUBLISH_SECONDS = 10.0
"""How often the leader checks that the rights Service still points at it."""

SESSION_REVOKE_TIMEOUT = 2.0
"""Seconds a stopping term gives etcd to revoke its session (and so its locks)."""

INFORMER_END_GRACE = 5.0
"""Seconds, from its end, a finished term's informer threads get to end before its memory
is collected at the start of the process's next term (each had 0.5 s while it stopped;
one still running holds the term)."""


# ---- authority --------------------------------------------------------------------------


class WorkerAuthority:
    """A reconcile's authority: the term's leadership (epoch E) and the VM lock (token T).

    Remembers the epoch it was created under; :meth:`check` fails as soon as the term is
    lost, its epoch changed, the term is stopping, or the lock is gone (a local flag
    check plus one etcd read of the lock key).
    """

    def __init__(self, term: LeaderTerm, guard: LockGuard) -> None:
        self._term = term
        self._guard = guard
        self._epoch = term.leadership.epoch
        self._lease = act.Fence(epoch=self._epoch, token=guard.token)

    @property
    def lease(self) -> act.Fence:
        return self._lease

    @property
    def vm_uid(self) -> str | None:
        return self._guard.vm_uid

    def check(self) -> None:
        if self._term.stopping.is_set():
            raise AuthorityLost("the term is ending")
        try:
            self._term.leadership.check()
        except LeadershipLost as exc:
            raise AuthorityLost(str(exc)) from exc
        if self._term.leadership.epoch != self._epoch:
            raise AuthorityLost(f"epoch changed from {self._epoch}")
        if self._guard.lost.is_set() or not self._guard.check():
            raise AuthorityLost(f"lock lost: {self._guard.lost_reason}")


# ---- one term ---------------------------------------------------------------------------


class LeaderTerm:
    """Everything done while holding one leadership term (see module doc): the wiring.

    The term owns the informers, the work queue, the etcd session and its locks, the
    workers, and the periodic scans; what a worker does with a key is the
    :class:`~neonvm.controller.handler.Handler`'s, and the sweeps are
    :class:`~neonvm.controller.sweeps.Sweeps`.
    """

    def __init__(self, process: ControllerProcess, leadership: Leadership) -> None:
        self.process = process
        self.leadership = leadership
        self.stopping = threading.Event()
        self.config = process.config
        self.metrics = process.metrics
        waits = self.metrics.queue_wait_seconds
        self.queue = WorkQueue(
            self.config.backoff,
            on_wait=lambda seconds, periodic: waits.labels(
                line="periodic" if periodic else "event").observe(seconds),
            metrics=self.metrics.workqueue)
        self.timers = VMTimers(self.config.stuck_backoff)
        self._locks: LockManager | None = None
        self._session: Session | None = None
        self._locks_mutex = threading.Lock()
        self.log = logger.bind(epoch=leadership.epoch, identity=leadership.identity)
        api = process.api
        ns = self.config.watch_namespace
        wiring = process.wiring
        self.vm_store = wiring.store()
        self.pod_store = wiring.store(index=pod_index)
        self.mid_plan = MidPlanSet(self.vm_store, self.pod_store.by_index)
        # Raw listers (no generated API classes, docs/benchmarks.md; kube.Lister).
        vms_path = f"/apis/{types.GROUP}/{types.VERSION}/{types.PLURAL}"
        pods_path = "/api/v1/pods"
        if ns:
            vms_path = f"/apis/{types.GROUP}/{types.VERSION}/namespaces/{ns}/{types.PLURAL}"
            pods_path = f"/api/v1/namespaces/{ns}/pods"
        list_vms: Lister = kube.Lister(api, vms_path)
        list_pods: Lister = kube.Lister(api, pods_path, label_selector=types.LABEL_VM_NAME)
        self._list_vms, self._list_pods = list_vms, list_pods
        self.informers = [
            Informer("virtualmachines", list_vms, self.vm_store, self._on_vm,
                     accept=wiring.event_filter("virtualmachines"),
                     relist_seconds=self.config.relist_seconds,
                     on_undecodable=self._on_undecodable_vm,
                     max_object_bytes=MAX_CACHED_VM_BYTES),
            # Pods are cached as projections (what cached decisions read); VMs in full
            # (they are written back).
            Informer("pods", list_pods, self.pod_store, self._on_pod,
                     accept=wiring.event_filter("pods"),
                     relist_seconds=self.config.relist_seconds, transform=project_pod),
        ]
        cluster = KubeCluster(api)  # the reconcile's calls and the token Secret's
        self.reconciler = Reconciler(
            cluster, RunnerScaling(api, secrets=cluster),
            runner_reports=RunnerReports(HTTPRunnerStatus()),
            cache=wiring.observer(self.vm_store, self.pod_store),
            writer=wiring.writer(api), after_step=wiring.after_step(),
            metrics=self.metrics, events=process.events,
            config=self.config.reconciler, on_finalized=self._release_lock,
            timers=self.timers, old_crd_warned=process.old_crd_warned,
            fencing=process.fencing,
        )
        # Late-bound (lambdas): tests swap the term's listers and locks.
        self.handler = Handler(
            queue=self.queue, vms=self.vm_store, reconciler=self.reconciler,
            read_vm=self.reconciler.reader.get_vm_raw,
            acquire=lambda namespace, name, uid: self.locks().acquire(
                namespace, name, uid, self.leadership.epoch),
            authority=lambda guard: WorkerAuthority(self, guard),
            release_lock=self._release_lock, timers=self.timers,
            term_ending=lambda: self.stopping.is_set() or self.leadership.lost.is_set(),
            end_term=self.leadership.lost.set, metrics=self.metrics, log=self.log,
            recheck=Jitter(self.config.recheck_seconds, self.config.recheck_spread),
            pods=self.pod_store)
        pods = self.reconciler.cluster  # the reconciler's own uid-guarded pod delete
        self.sweeps = Sweeps(
            delete_pod=lambda namespace, name, uid: pods.delete_pod(namespace, name, uid=uid),
            list_vms=lambda **kw: self._list_vms(**kw),
            list_pods=lambda **kw: self._list_pods(**kw), locks=lambda: self.locks(),
            metrics=self.metrics, log=self.log,
            orphan_grace_seconds=self.config.orphan_grace_seconds)

    # ---- event handlers (informer threads) ---------------------------------------------

    def _on_vm(self, key: str, old: Obj | None, new: Obj | None) -> None:
        self.metrics.lifecycle.vm_changed(old, new)  # restarts, first Running
        self.mid_plan.touch(key)
        self.queue.add(key)

    def _on_undecodable_vm(self, found: Undecodable) -> None:
        """A VM too deeply nested to decode (the informer leaves it out): a Warning Event
        on it, once per version. Not a Degraded condition: a status write is a PUT of the
        object read back, and nothing of it can be read."""
        self.metrics.undecodable.inc()
        self.process.events.record(
            types.VirtualMachine.from_object({"metadata": found.metadata}), "Undecodable",
            found.reason, warning=True)

    def _on_pod(self, key: str, old: Obj | None, new: Obj | None) -> None:
        for obj in (old, new):
            vm_key = pod_index(obj) if obj is not None else None
            if vm_key:
                self.mid_plan.touch(vm_key)
                self.queue.add(vm_key)
        uid = (old.get("metadata") or {}).get("uid") if new is None and old else None
        if uid:  # deleted: what was learnt of it is no use any more
            self.reconciler.acceleration.reports.forget(uid)
            self.metrics.lifecycle.pod_deleted(uid)
            if self.process.rights_reviewer is not None:
                self.process.rights_reviewer.forget_pod(
                    str(((old or {}).get("metadata") or {}).get("namespace") or ""), uid)

    # ---- locks -------------------------------------------------------------------------

    def locks(self) -> LockManager:
        """The current lock manager; a new session (and manager) after a session loss."""
        with self._locks_mutex:
            # A worker left over from a stopping term must not open a fresh session
            # (its keepalive would outlive the term and its locks would look held).
            if self.stopping.is_set():
                raise AuthorityLost("the term is ending")
            if self._locks is not None and self._session is not None \
                    and not self._session.lost.is_set():
                return self._locks
            if self._locks is not None:
                self._locks.close()
            self._session = Session(self.process.etcd, ttl=self.config.session_ttl,
                                    name=f"controller-{self.leadership.epoch}")
            self._locks = LockManager(self.process.etcd, self._session,
                                      self.leadership.identity, self.process.etcd_config.prefix,
                                      self.process.installation)
            self.log.info("etcd session started for per-VM locks",
                          lease=f"{self._session.lease_id:x}")
            return self._locks

    def _release_lock(self, key: str) -> None:
        """The VM is finalized (or gone): give its lock up."""
        namespace, name = split_key(key)
        with self._locks_mutex:
            locks = self._locks
        if locks is None:
            return
        for guard in locks.held():
            if (guard.namespace, guard.name) == (namespace, name):
                with contextlib.suppress(EtcdError, LockLost):
                    guard.release()
                    self.log.bind(vm=key).info("released the lock of a finalized VM")

    # ---- the term ----------------------------------------------------------------------

    def run(self) -> None:
        """Until the term is lost or the process stops; returns after cleaning up."""
        self.metrics.leading.set(1)
        # Self-fencing: every earlier term's grants were issued before now.
        self.process.rights.begin_term(self.active)
        self.log.info("leading: starting informers and {n} workers", n=self.config.workers)
        workers: list[threading.Thread] = []
        try:
            for informer in self.informers:
                informer.start()
            sync_deadline = time.monotonic() + self.config.sync_deadline_seconds
            while not all(i.synced.is_set() for i in self.informers):
                if self.leadership.lost.wait(0.1):
                    return
                if time.monotonic() >= sync_deadline:
                    syncing = [i.name for i in self.informers if not i.synced.is_set()]
                    self.log.error(
                        "caches not synced after {s:g}s ({syncing}): stepping down and "
                        "releasing the Lease for a standby",
                        s=self.config.sync_deadline_seconds, syncing=", ".join(syncing))
                    self.metrics.sync_deadline_step_downs.inc()
                    self.leadership.step_down()
                    return
            self._publish_rights()
            self.log.info("caches synced: {vms} VMs, {pods} runner pods",
                          vms=len(self.vm_store.all_keys()), pods=len(self.pod_store.all_keys()))
            for key in self.vm_store.all_keys():
                self.queue.add(key, direct=True)
            for i in range(self.config.workers):
                t = threading.Thread(target=self._worker, name=f"worker-{i}", daemon=True)
                t.start()
                workers.append(t)
            self._housekeeping()
        finally:
            self._shutdown(workers)

    def _housekeeping(self) -> None:
        """Periodic requeues, sweeps and metrics, until the term ends."""
        now = time.monotonic()
        next_plan_scan = now + self.config.plan_requeue_seconds
        next_resync = now + self.config.resync_seconds
        next_sweep = now + min(5.0, self.config.sweep_seconds)
        sweep_period = Jitter(self.config.sweep_seconds, 0.25)
        next_rights = now + RIGHTS_PUBLISH_SECONDS
        while not self.leadership.lost.wait(0.5) and not self.stopping.is_set():
            try:
                self.leadership.check()
            except LeadershipLost:
                break
            self.metrics.queue_depth.set(len(self.queue))
            locks = self._locks
            self.metrics.locks_held.set(len(locks.held()) if locks is not None else 0)
            now = time.monotonic()
            if now >= next_plan_scan:
                next_plan_scan = now + self.config.plan_requeue_seconds
                # Not the VMs being handled, nor those whose cache is behind their last
                # reconcile: the events on their way bring them up (and, if lost, the
                # resync's diff does). Nor those already waiting for a worker: they get
                # a turn anyway (a new VM's first, from the cache, costs no reads), and
                # the next scan still finds them if that turn leaves them mid-plan.
                self._requeue(k for k in self.mid_plan.scan()
                              if not self.handler.in_hand(k) and not self.queue.queued(k))
                self.metrics.scans.labels(scan="mid_plan").inc()
            if now >= next_resync:
                next_resync = now + self.config.resync_seconds
                self._requeue(self._resync_keys())
                self.metrics.scans.labels(scan="resync").inc()
            if now >= next_sweep:
                next_sweep = now + sweep_period()
                self.sweeps.run()
            if now >= next_rights:
                next_rights = now + RIGHTS_PUBLISH_SECONDS
                self._publish_rights()

    def _publish_rights(self) -> None:
        """Point the rights Service at this replica (self-fencing; best effort, looked
        at again every :data:`RIGHTS_PUBLISH_SECONDS`)."""
        endpoint = self.process.rights_endpoint
        if endpoint is None:
            return
        try:
            if endpoint.publish():
                self.log.info("rights Service {ns}/{svc} points at this replica ({ip})",
                              ns=endpoint.namespace, svc=endpoint.service, ip=endpoint.ip)
        except Exception as exc:
            self.log.warning("could not point the rights Service at this replica: {err}",
                             err=short_error(exc))

    def _requeue(self, keys: Iterable[str]) -> None:
        """A periodic scan's requeue: read directly, behind event-driven work, skipping
        VMs in a stuck backoff."""
        for key in keys:
            if not self.timers.backing_off(key):
                self.queue.add(key, direct=True, periodic=True)

    def _resync_keys(self) -> set[str]:
        """The VMs whose cached copy (or cached pods) differ from the server's.

        Two direct lists, paginated and metadata-only (names, uids, resourceVersions,
        labels: no spec, no status), compared with the caches: a VM missing from the
        cache (its ADDED event lost), one cached but gone from the server (its DELETED
        lost: the direct read drops it), one cached with another uid or resourceVersion,
        and the VM of any runner pod that differs the same way. Converged VMs whose
        caches agree cost nothing here: their own periodic re-check reads the cache. A
        list that fails is logged; the next resync tries again.
        """
        keys: set[str] = set()
        try:
            keys |= differing(iter_items(self._list_vms, metadata_only=True),
                               self.vm_store, lambda meta, key: key)
            keys |= differing(iter_items(self._list_pods, metadata_only=True),
                               self.pod_store, pod_vm_key)
        except Exception as exc:
            self.log.warning("resync list failed: {err}", err=short_error(exc))
        self.metrics.resync_differing.set(len(keys))
        return keys

    def active(self) -> bool:
        """The term still holds (not stopping, leadership valid): what a grant checks."""
        if self.stopping.is_set():
            return False
        try:
            self.leadership.check()
        except LeadershipLost:
            return False
        return True

    def synced_caches(self) -> tuple[Any, Any] | None:
        """The VM and pod caches, once both synced (the rights endpoint reads them)."""
        if not all(i.synced.is_set() for i in self.informers):
            return None
        return self.vm_store, self.pod_store

    def _shutdown(self, workers: list[threading.Thread]) -> None:
        self.stopping.set()
        self.process.rights.end_term()
        self.queue.shut_down()
        deadline = time.monotonic() + 8.0
        for t in workers:
            t.join(max(0.1, deadline - time.monotonic()))
        for informer in self.informers:
            informer.stop(timeout=0.5)
        with self._locks_mutex:
            locks, session = self._locks, self._session
            self._locks = self._session = None
        # One revoke of the session's etcd lease deletes every lock key bound to it at
        # once (and tells each guard); a transaction per lock would make the stop take
        # time proportional to the locks held. Releasing guard by guard is left for
        # locks the revoke did not cover (none, unless it failed: then they expire).
        held = len(locks.held()) if locks is not None else 0
        revoked = session is None
        if session is not None:
            try:
                session.close(timeout=SESSION_REVOKE_TIMEOUT)
                revoked = True
            except Exception as exc:
                self.log.warning("revoking the lock session failed: {err}",
                                 err=short_error(exc))
        if locks is not None:
            locks.close()
            self.log.info("released {n} VM lock(s){how}", n=held,
                          how="" if revoked else " one by one (the revoke failed; "
                          "any left expire with the session TTL)")
        self._withdraw_rights()
        self.metrics.leading.set(0)
        self.metrics.locks_held.set(0)
        self.log.info("stopped leading work")

    def await_informers(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for the informers' threads to end."""
        deadline = time.monotonic() + timeout
        for informer in self.informers:
            informer.stop(timeout=max(0.0, deadline - time.monotonic()))

    def _withdraw_rights(self) -> None:
        """Empty the rights Service's slice if it still names this replica (best effort:
        the next term overwrites it anyway)."""
        endpoint = self.process.rights_endpoint
        if endpoint is None:
            return
        try:
            if endpoint.withdraw():
                self.log.info("rights Service {ns}/{svc} no longer points at this replica",
                              ns=endpoint.namespace, svc=endpoint.service)
        except Exception as exc:
            self.log.warning("could not withdraw the rights Service's endpoint: {err}",
                             err=short_error(exc))

    # ---- workers -----------------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            taken = self.queue.take(timeout=0.5)
            if taken is None:
                if self.queue.shutting_down or self.stopping.is_set():
                    return
                continue
            started = time.monotonic()
            outcome: Outcome | None = None
            try:
                outcome = self.handler.process(taken.key, taken.direct)
            except Exception:
                # Handler.handle never raises, but what follows it (the outcome mapping,
                # Handler.apply) runs outside its guard: a bug there must cost one key a
                # retry, not the term a worker.
                self.metrics.worker_errors.inc()
                self.log.bind(vm=taken.key).exception(
                    "worker: processing the key raised; requeued with backoff")
                try:
                    self.queue.add_rate_limited(taken.key, direct=True)
                except Exception:
                    self.log.bind(vm=taken.key).exception("worker: could not requeue the key")
            finally:
                self.queue.done(taken.key)
                self.metrics.turn_ended(taken.key, outcome, time.monotonic() - started)


# ---- the process ------------------------------------------------------------------------


@dataclass(frozen=True)
class _FinishedTerm:
    """What a process keeps of its last term: a weak reference (nothing that holds it)
    and when its work returned (``time.monotonic``)."""

    term: weakref.ref[LeaderTerm]
    ended: float


class ControllerProcess:
    """A replica: campaigns for the Lease and runs a :class:`LeaderTerm` while leading."""

    def __init__(self, api: client.ApiClient, etcd_config: EtcdConfig,
                 election: ElectionConfig, config: ControllerConfig, *,
                 wiring: Wiring | None = None, metrics: ControllerMetrics | None = None,
                 events: EventRecorder | None = None) -> None:
        self.api = api
        self.etcd_config = etcd_config
        self.etcd = Etcd(etcd_config)
        self.election = election
        self.config = config
        self.wiring = wiring or Wiring()
        """How each term's parts are built (the one seam wrappers are composed at)."""
        self.metrics = metrics or ControllerMetrics()
        self.events = events or EventRecorder(
            api, election.identity, background=True, dropped=self.metrics.events_dropped,
            aggregated=self.metrics.events_aggregated)
        self._term: LeaderTerm | None = None
        self._stop = threading.Event()
        """:meth:`run`'s: set once the process stops (no next term to free memory for)."""
        self._finished: _FinishedTerm | None = None
        """The last term this process led, until the next term's start frees it."""
        self.rights = RightsLedger()
        """Self-fencing: the rights granted by this process (docs/protocol.md,
        "Self-fencing"); its terms begin and end it."""
        defaults = config.reconciler.pod_defaults
        self.fencing = (SelfFencing.from_api(self.rights, api)
                        if defaults.right_seconds > 0 and defaults.rights_url else None)
        """Built only when self-fencing is on: otherwise no pod is ever condemned, whatever
        its annotations say (docs/security.md, "Rights endpoint")."""
        self.rights_endpoint: LeaderEndpoint | None = None
        """Set by the command line: the Service runners ask, pointed at each leader."""
        self.rights_reviewer: TokenReviewer | None = None
        """Set by the command line: the rights tokens' reviewer, told of deleted pods."""
        self.old_crd_warned = threading.Event()
        """Set once a term's reconciler has warned that the CRD prunes a status field
        (it warns once per process)."""
        # Every etcd key of this installation (locks, epoch floor) is scoped by its Lease.
        self.installation = Installation(election.namespace, election.name)
        # Its own client and pool: renewals must not queue behind the workers' requests.
        self.elector_api = self.wiring.elector_api(api)
        self.elector = LeaderElector(
            KubernetesLeaseStore(self.elector_api, election.namespace, election.name),
            election, on_started=self._lead_and_free, on_stopped=self._stopped,
            epoch_floor=EpochFloor(self.etcd, etcd_config.prefix, self.installation,
                                   registry=self.metrics.registry),
            registry=self.metrics.registry,
        )
        self.metrics.describe(election.name, config.workers)  # docs/metrics.md
        self.metrics.remembered("events_recent", self.events.remembered)
        self.metrics.remembered("runner_reports", lambda: self._term_size(
            lambda t: t.reconciler.acceleration.reports.remembered()))
        self.metrics.remembered("vm_cache", lambda: self._term_size(
            lambda t: len(t.vm_store.all_keys())))
        self.metrics.remembered("pod_cache", lambda: self._term_size(
            lambda t: len(t.pod_store.all_keys())))
        self.metrics.observe_requests(api, self.elector_api)

    @property
    def term(self) -> LeaderTerm | None:
        return self._term

    def _term_size(self, size: Callable[[LeaderTerm], int]) -> int:
        """``size`` of the leading term's memory (0 when not leading)."""
        term = self._term
        return size(term) if term is not None else 0

    def _lead_and_free(self, leadership: Leadership) -> None:
        """``on_started``: free what the process's last term left, then lead this one.

        A term's parts call back into it (informer handlers, the handler's and the
        sweeps' callbacks), so a finished term is cyclic garbage: left to the collector's
        next full pass, its caches stayed allocated while the next term built its own.
        So before a term of a process that led before builds anything, the last term's
        informer threads get what is left of :data:`INFORMER_END_GRACE` since it ended,
        and one full collection runs. Nothing runs after a term ends: its Lease's
        release (a step-down, a refusal, a stop) and the process's exit never wait on
        it. docs/reconciler.md, "What a leader term guarantees"."""
        self._free_finished(leadership)
        self._lead(leadership)

    def _free_finished(self, leadership: Leadership) -> None:
        """The last term's informers' remaining grace, then one ``gc.collect()``; not
        if this term has already ended or the process stops (nothing will be built)."""
        finished = self._finished
        if finished is None or leadership.lost.is_set() or self._stop.is_set():
            return
        self._finished = None
        term = finished.term()
        if term is not None:
            term.await_informers(max(0.0, finished.ended + INFORMER_END_GRACE
                                     - time.monotonic()))
            term = None  # this frame must not hold it through the collection
        started = time.monotonic()
        found = gc.collect()
        logger.bind(epoch=leadership.epoch).info(
            "freed the last term: {n} objects collected in {s:.2f}s",
            n=found, s=time.monotonic() - started)

    def _lead(self, leadership: Leadership) -> LeaderTerm:
        """Run one term until it ends; the term, ended (recorded for the next term's
        start to free)."""
        term = LeaderTerm(self, leadership)
        self._term = term
        try:
            term.run()
        finally:
            # Only our own: a later term may already be recorded (the elector does not
            # start one before this returns, but this must not depend on it).
            if self._term is term:
                self._term = None
            self._finished = _FinishedTerm(weakref.ref(term), time.monotonic())
        return term

    def term_epoch(self) -> str:
        """The leading term's epoch ("" when not leading), as a pod's right-term mark."""
        term = self._term
        return str(term.leadership.epoch) if term is not None else ""

    def rights_caches(self) -> tuple[Any, Any] | None:
        """The leading term's synced (VM, pod) caches; None when not leading (whether the
        term is still active the rights endpoint asks its ledger: RightsService)."""
        term = self._term
        return term.synced_caches() if term is not None else None

    def _stopped(self) -> None:
        term = self._term
        if term is not None:
            term.stopping.set()

    def health_check(self) -> None:
        """Liveness ("not wedged"): the elector loop turns.

        Caches that have not synced yet are *not* a liveness failure: the first list of
        a large fleet, or of a throttled API server, may take longer than any probe
        allows, and restarting the replica would only start that list again.
        """
        self.elector.health_check()

    def ready_check(self) -> None:
        """Readiness ("synced"): a standby is ready; a leader once its caches synced."""
        self.elector.health_check()
        term = self._term
        if term is not None and not term.stopping.is_set():
            syncing = [i.name for i in term.informers if not i.synced.is_set()]
            if syncing:
                raise RuntimeError(f"leading, caches not synced yet: {', '.join(syncing)}")

    def register_health(self, health: HealthServer) -> None:
        """``/healthz`` runs :meth:`health_check`, ``/readyz`` :meth:`ready_check`."""
        health.add_check("controller", self.health_check, readiness=False)
        health.add_check("caches", self.ready_check, liveness=False)

    def run(self, stop: threading.Event) -> None:
        self._stop = stop
        trimmer = HeapTrimmer(
            self.config.heap_trim_seconds,
            on_trim=lambda seconds, _released: self.metrics.heap_trim_seconds.observe(seconds))
        trimmer.start(stop)
        try:
            self.elector.run(stop)
        finally:
            self.events.close()  # the Events still queued, for a few seconds at most
            self.etcd.close()
            self.elector_api.close()

