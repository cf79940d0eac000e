"""One VM key's turn on a worker: :meth:`Handler.handle` answers an :class:`Outcome`, and
:meth:`Handler.apply` is the one switch that turns it into work-queue calls.

``handle(key)`` never raises: it finds the VM's uid, takes its lock, runs one reconcile
and answers one outcome; errors map to outcomes in one place, :func:`outcome_of_error`.
The contract (each outcome, when, and what the queue does; controller-runtime's
``Reconcile`` result/error contract is the model): docs/architecture.md, "The handler's
contract"; the ``behind`` outcome: docs/reconciler.md, "Echoes of our own writes".
The handler decides nothing about the VM and performs no action.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from neonvm import logs
from neonvm.controller.actions import Done
from neonvm.controller.authority import Authority, AuthorityLost, RetryableError, WrongVM
from neonvm.controller.informer import object_uid
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.mutations import FencedOut
from neonvm.controller.observe import split_key
from neonvm.controller.reconciler import ReconcileResult, Seen
from neonvm.controller.timers import VMTimers
from neonvm.controller.update import ConflictRetriesExhausted
from neonvm.controller.workqueue import WorkQueue
from neonvm.kube import short_error
from neonvm.leader.election import LeadershipLost
from neonvm.leader.etcd import EtcdError
from neonvm.leader.lock import LockGuard, LockHeld, LockLost, SessionLost

Kind = Literal["requeue", "gone", "again", "temporary", "dropped", "permanent", "behind"]


@dataclass(frozen=True)
class Outcome:
    """What became of one key's turn (see the module doc for each kind)."""

    kind: Kind
    after: float = 0.0
    """``requeue``: seconds until the key comes back."""
    direct: bool = True
    """``temporary``: the key's next turn starts with a quorum read."""
    stuck: str | None = None
    """``requeue``: the reconcile ended stuck, for this (Degraded) reason."""
    converged: bool = False
    """``requeue``: the reconcile ended Done; the key comes back for a periodic re-check
    from the cache (not a direct read)."""
    message: str = ""
    """For the log line."""
    bug: BaseException | None = None
    """``temporary``: an error nobody expected, logged with its traceback."""


DROPPED = Outcome("dropped")
GONE = Outcome("gone")
BEHIND = Outcome("behind")

BEHIND_FALLBACK_SECONDS = 10.0
"""How soon a key skipped as ``behind`` comes back (from the cache) if no watch event
brings it back first."""

AUTHORITY_ERRORS = (AuthorityLost, LeadershipLost, LockLost, SessionLost)
"""The reconcile's authority (term, epoch, lock, session) went away under it."""
TEMPORARY_ERRORS = (ApiException, EtcdError, OSError, HTTPError, RetryableError,
                    ConflictRetriesExhausted)
"""Failures of a server or the network, expected now and then: retried with backoff."""


def outcome_of_error(exc: BaseException, term_ending: bool) -> Outcome:
    """The outcome of a turn that raised ``exc``: the only place errors are sorted."""
    if isinstance(exc, AUTHORITY_ERRORS):
        return DROPPED if term_ending else Outcome(
            "temporary", message=f"reconcile stopped: {exc}")
    if isinstance(exc, WrongVM):
        return Outcome("again", message=f"{exc}: taking the lock for the new VM")
    if isinstance(exc, LockHeld):
        return Outcome("temporary", direct=False, message=str(exc))
    if isinstance(exc, FencedOut):
        # Only a fence of our own epoch with a higher token gets here (the locks' tokens
        # went back); one ahead by its epoch is marked on that VM alone.
        return Outcome("permanent", message=f"fenced out: {exc}; ending this term for a "
                                            f"new epoch")
    message = f"reconcile failed ({short_error(exc)})"
    if isinstance(exc, TEMPORARY_ERRORS):
        return Outcome("temporary", message=message)
    return Outcome("temporary", message=message, bug=exc)


def outcome_of_result(result: ReconcileResult, stuck_delay: Callable[[], float]) -> Outcome:
    """The outcome of a reconcile that ended; ``stuck_delay`` is called for a stuck one."""
    if result.stuck:
        return Outcome("requeue", after=stuck_delay(), stuck=result.stuck)
    return Outcome("requeue", after=result.requeue_after,
                   converged=isinstance(result.action, Done))


class Reconciles(Protocol):
    """What the handler needs of the reconciler."""

    def reconcile(self, key: str, authority: Authority, *,
                  direct_first: bool = False) -> ReconcileResult: ...


class VMCache(Protocol):
    """What the handler needs of the VM cache."""

    def get(self, key: str) -> dict[str, Any] | None: ...

    def discard(self, key: str, uid: str) -> bool: ...


class ObjectCache(Protocol):
    """A cache of objects by ``namespace/name`` (the pods', for :meth:`Handler.handle`)."""

    def get(self, key: str) -> dict[str, Any] | None: ...


def _rv_number(obj: dict[str, Any] | None) -> int | None:
    try:
        return int(((obj or {}).get("metadata") or {}).get("resourceVersion", ""))
    except (TypeError, ValueError):
        return None


def _compare(cached: dict[str, Any] | None, seen_rv: str) -> int | None:
    """The cached object's resourceVersion minus ``seen_rv``'s (None when either is not
    a number: then nothing is skipped)."""
    try:
        seen = int(seen_rv)
    except ValueError:
        return None
    have = _rv_number(cached)
    return None if have is None else have - seen


def _older(cached: dict[str, Any] | None, seen_rv: str) -> bool:
    """The cached object is an older version than ``seen_rv``."""
    delta = _compare(cached, seen_rv)
    return delta is not None and delta < 0


def _newer(cached: dict[str, Any] | None, seen_rv: str) -> bool:
    """The cached object is a newer version than ``seen_rv``."""
    delta = _compare(cached, seen_rv)
    return delta is not None and delta > 0


def cache_behind(seen: Seen | None, vm: dict[str, Any] | None,
                 pods: ObjectCache | None) -> bool:
    """The cached VM (``vm``) or one of its cached pods is an older version than the
    last reconcile saw (:class:`~neonvm.controller.reconciler.Seen`), for the same VM.

    A pod missing from the cache does not count: it may have been deleted since, and
    its deletion is news. Nor is a VM *newer* than the last reconcile saw ever behind,
    whatever its pods: that version is someone else's write (ours are what ``seen``
    holds), and a pod whose event was lost must not hold it back until a relist."""
    if seen is None or vm is None or object_uid(vm) != seen.uid:
        return False
    if _older(vm, seen.vm):
        return True
    if _newer(vm, seen.vm):
        return False
    if pods is None:
        return False
    return any(_older(pods.get(key), rv) for key, rv in seen.pods)


class Handler:
    """Handles one key at a time per worker; shared by a term's workers (thread-safe)."""

    def __init__(self, *, queue: WorkQueue, vms: VMCache, reconciler: Reconciles,
                 read_vm: Callable[[str, str], dict[str, Any] | None],
                 acquire: Callable[[str, str, str], LockGuard],
                 authority: Callable[[LockGuard], Authority],
                 release_lock: Callable[[str], None], timers: VMTimers,
                 term_ending: Callable[[], bool], end_term: Callable[[], None],
                 metrics: ControllerMetrics, log: Any,
                 recheck: Callable[[], float] | None = None,
                 pods: ObjectCache | None = None,
                 behind_fallback: float = BEHIND_FALLBACK_SECONDS) -> None:
        self.queue = queue
        self._vms = vms
        self._reconciler = reconciler
        self._read_vm = read_vm
        self._acquire = acquire
        self._authority = authority
        self._release_lock = release_lock
        self.timers = timers
        self._term_ending = term_ending
        self._end_term = end_term
        self._metrics = metrics
        self._log = log
        self._recheck = recheck
        """The delay of a converged VM's next re-check (None: the reconcile's own)."""
        self._pods = pods
        self._behind_fallback = behind_fallback
        self._seen: dict[str, Seen] = {}
        """Per VM key: the versions its last reconcile in this term ended on."""
        self._seen_lock = threading.Lock()
        self._busy: set[str] = set()
        """Keys being handled now."""

    def in_hand(self, key: str) -> bool:
        """``key`` is being handled now, or the cache is behind what its last reconcile
        in this term saw (see :func:`cache_behind`): either way, what the cache shows
        brings nothing a reconcile does not have or get through the watch events still
        on their way."""
        with self._seen_lock:
            if key in self._busy:
                return True
            seen = self._seen.get(key)
        return cache_behind(seen, self._vms.get(key), self._pods)

    @logs.per_reconcile
    def process(self, key: str, direct: bool) -> Outcome:
        """One turn of ``key``: :meth:`handle`, then :meth:`apply`."""
        outcome = self.handle(key, direct)
        self.apply(key, outcome)
        return outcome

    def handle(self, key: str, direct: bool = False) -> Outcome:
        """Reconcile ``key`` under its lock; never raises (see the module doc)."""
        with self._seen_lock:
            seen = self._seen.pop(key, None)
            self._busy.add(key)
        self._log.bind(vm=key).debug("turn (direct={direct})", direct=direct)
        try:
            return self._handle(key, direct, seen)
        finally:
            with self._seen_lock:
                self._busy.discard(key)

    def _handle(self, key: str, direct: bool, seen: Seen | None) -> Outcome:
        try:
            if not direct and cache_behind(seen, self._vms.get(key), self._pods):
                with self._seen_lock:
                    self._seen.setdefault(key, seen)  # type: ignore[arg-type]
                return BEHIND
            uid = self._vm_uid(key, direct)
            if uid is None:
                self._release_lock(key)
                self.timers.forget(key)
                return GONE
            namespace, name = split_key(key)
            guard = self._acquire(namespace, name, uid)
            result = self._reconciler.reconcile(key, self._authority(guard),
                                                direct_first=direct)
        except Exception as exc:
            return outcome_of_error(exc, self._term_ending())
        if result.seen is not None and not result.stuck:
            with self._seen_lock:
                self._seen[key] = result.seen
        if not result.stuck:
            self.timers.unstuck(key)
        return outcome_of_result(result, lambda: self.timers.stuck(key))

    def apply(self, key: str, outcome: Outcome) -> None:
        """The one switch from an outcome to the work queue (and the log)."""
        log = self._log.bind(vm=key)
        match outcome.kind:
            case "requeue":
                self.queue.forget(key)
                if outcome.stuck:
                    log.warning("not converging ({reason}); looking again in {delay:.1f}s",
                                reason=outcome.stuck, delay=outcome.after,
                                backoff=outcome.after)
                if outcome.converged:
                    after = outcome.after
                    if self._recheck is not None:
                        after = max(after, self._recheck())
                    self.queue.add_after(key, after, periodic=True)
                else:
                    stuck = outcome.stuck is not None
                    self.queue.add_after(key, outcome.after, direct=stuck,
                                         direct_when_due=not stuck)
            case "behind":
                self.queue.add_after(key, self._behind_fallback, periodic=True)
            case "gone":
                self.queue.forget(key)
            case "again":
                log.info("{msg}", msg=outcome.message)
                self.queue.add(key, direct=True)
            case "temporary":
                delay = self.queue.add_rate_limited(key, direct=outcome.direct)
                if outcome.bug is not None:
                    log.opt(exception=outcome.bug).error(
                        "{msg}; retrying in {delay:.2f}s", msg=outcome.message, delay=delay)
                else:
                    log.warning("{msg}; retrying in {delay:.2f}s", msg=outcome.message,
                                delay=delay)
            case "dropped":
                pass
            case "permanent":
                log.error("{msg}", msg=outcome.message)
                self._end_term()

    def _vm_uid(self, key: str, direct: bool) -> str | None:
        """The VM's uid: from the cache, or (``direct``, or not cached) a quorum read.

        A direct read that finds no VM while the cache still holds one means the watch
        missed its deletion: the cached copy is dropped. Left there, every requeue that
        starts from the cache would take the gone VM's lock again until the next relist.
        """
        cached = self._vms.get(key)
        raw = None if direct else cached
        if raw is None:
            namespace, name = split_key(key)
            raw = self._read_vm(namespace, name)
        if raw is None:
            stale_uid = object_uid(cached)
            if stale_uid and self._vms.discard(key, stale_uid):
                self._metrics.cache_evictions.inc()
                self._log.bind(vm=key).info(
                    "dropped a deleted VM from the cache (its deletion event was missed)",
                    uid=stale_uid)
            return None
        return object_uid(raw)
