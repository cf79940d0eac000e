"""Leader election on a ``coordination.k8s.io/v1`` Lease, with epochs and release on stop.

Replicas campaign for one Lease whose record is client-go's, so other tools read it as
usual; ``leaseTransitions`` is the term's epoch, kept increasing across the Lease's deletion
by an :class:`EpochFloor`. Expiry is measured on this process's monotonic clock only; a
follower decides from a fresh read and writes by CAS; the leader stops believing before
its Lease can expire, stops its work, then releases. Storage is the
:class:`~neonvm.leader.lease_store.LeaseStore` the caller passes in. What is guaranteed and
what is not, the algorithm, the timing rules and why not ``kubernetes.leaderelection``:
docs/leader-election.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import queue
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from loguru import logger
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from neonvm.api.times import format_microtime as format_microtime  # re-exported
from neonvm.kube import short_error
from neonvm.leader.lease_store import STEP_DOWN_ANNOTATION as STEP_DOWN_ANNOTATION
from neonvm.leader.lease_store import LeaseClient as LeaseClient  # re-exported
from neonvm.leader.lease_store import (
    LeaseConflict,
    LeaseNamespaceNotFound,
    LeaseNotFound,
)
from neonvm.leader.lease_store import LeaseRecord as LeaseRecord  # re-exported
from neonvm.leader.lease_store import LeaseStore as LeaseStore  # re-exported
from neonvm.leader.lease_store import StepDownRequest as StepDownRequest  # re-exported

JITTER_FACTOR = 1.2
"""Campaign retries wait between ``retry_period`` and ``retry_period * JITTER_FACTOR``;
``renew_deadline`` must exceed the longest such wait (client-go's rule)."""

EXPIRY_TIMER_SLACK = 0.01
"""Seconds a follower's expiry timer fires after the computed instant (never before)."""

STOP_POLL = 0.25
"""Longest a waiting follower goes without looking at ``stop``."""

CLAIM_STALL_LIMIT = 30.0
"""Seconds one epoch-floor claim may run before ``health_check`` calls the elector wedged
(each etcd call is bounded by its own timeout; a claim is a few of them)."""

ACCESS_CHECK_PERIOD = 5.0
"""Seconds between two checks that the epoch floor's store still admits this replica
(only with a floor that has ``check_access``; see :class:`AccessRefused`)."""

ACCESS_CONFIRM_SECONDS = 3.0
"""A refusal ends the elector only once confirmed: refused again at least this many
seconds after the first refusal, with nothing admitted in between (see
:class:`AccessRefused`)."""

PRESENCE_TTL_LEASES = 2
"""The leader's presence key lives on an etcd lease of this many lease durations
(rounded up to whole seconds; docs/leader-election.md, "A leader cut off the locks'
etcd")."""

PRESENCE_GRACE_LEASES = 2
"""A standby asks a holder to step down once etcd has shown no presence of its term
for this many lease durations in a row."""

RESULT_POLL = 0.05
"""Longest the leader goes without looking at the answers of its calls in flight."""

WORK_JOIN_SLICE = 0.1
"""Seconds between health ticks while the elector waits for a term's work to return."""

DEFAULT_NAMESPACE = "neonvm-system"
DEFAULT_LEASE_NAME = "neonvm-controller"


def _spawn_thread(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, name="lease-call", daemon=True).start()


def new_identity() -> str:
    """``<hostname>_<random hex>``: unique per process start, so each takeover is a new term."""
    return f"{socket.gethostname()}_{secrets.token_hex(6)}"


def parse_microtime(value: str | None) -> datetime | None:
    """Parse a MicroTime or Time string as the API server returns it (for display only)."""
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


class LeadershipLost(RuntimeError):
    """Raised by :meth:`Leadership.check` once this term is over or in doubt."""


class AccessRefused(RuntimeError):
    """The epoch floor's store refused this replica its keys: a permission, not an
    outage (say, its etcd user lost the role on its prefix while it runs). Raised by an
    :class:`EpochFloor`'s ``claim`` or ``check_access``. The elector ends the term as
    ``access-refused``, releases the Lease once the work returned, stops campaigning and
    raises it out of :meth:`LeaderElector.run` (docs/leader-election.md, "A replica its
    etcd refuses")."""


class LeaseNamespaceMissing(RuntimeError):
    """The Lease's namespace does not exist: a configuration error, not a passing one."""

    def __init__(self, namespace: str, name: str) -> None:
        super().__init__(
            f"the Lease's namespace {namespace!r} does not exist: create it (kubectl "
            f"create namespace {namespace}) or choose another with --lease-namespace "
            f"(the Lease {namespace}/{name} is created there)")
        self.namespace = namespace


@dataclass(frozen=True)
class ElectionConfig:
    """Where to campaign and how fast. Times are seconds; validated on construction.

    ``lease_duration``: how long followers wait, after last seeing the Lease change,
    before taking it. ``renew_deadline``: how long one renewal may take; the leader stops
    leading when no renewal succeeded within ``retry_period + renew_deadline`` of the send
    of the last one that did, which must be below ``lease_duration`` (the difference is
    the safety margin). ``retry_period``: time between renewals (by send time: the next
    goes out whether or not the last has answered) and between campaign attempts.
    """

    namespace: str = DEFAULT_NAMESPACE
    name: str = DEFAULT_LEASE_NAME
    identity: str = field(default_factory=new_identity)
    lease_duration: float = 4.0
    renew_deadline: float = 2.5
    retry_period: float = 0.5
    shutdown_grace: float = 15.0
    """How long, after a term ended, the elector waits for its work (the ``on_started``
    thread) to return before giving up on releasing the Lease. Independent of the
    renew deadline: stopping workers and giving their locks up can take longer."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not self.namespace:
            problems.append("namespace must not be empty")
        if not self.name:
            problems.append("name must not be empty")
        if not self.identity:
            problems.append("identity must not be empty")
        for label, value in (("lease_duration", self.lease_duration),
                             ("renew_deadline", self.renew_deadline),
                             ("retry_period", self.retry_period),
                             ("shutdown_grace", self.shutdown_grace)):
            if not math.isfinite(value) or value <= 0:
                problems.append(f"{label} must be a positive number of seconds, got {value!r}")
        if not problems:
            if self.lease_duration <= self.renew_deadline + self.retry_period:
                problems.append(
                    f"lease_duration ({self.lease_duration}s) must be greater than "
                    f"renew_deadline ({self.renew_deadline}s) + retry_period "
                    f"({self.retry_period}s): the leader must stop before followers may "
                    "take over")
            if self.renew_deadline <= self.retry_period * JITTER_FACTOR:
                problems.append(
                    f"renew_deadline ({self.renew_deadline}s) must be greater than "
                    f"retry_period * {JITTER_FACTOR} ({self.retry_period * JITTER_FACTOR:g}s): "
                    "at least one retry must fit before the deadline")
        if problems:
            raise ValueError("invalid election config: " + "; ".join(problems))

    @property
    def belief(self) -> float:
        """Seconds after the send of its last successful renewal that a leader keeps
        leading: one retry period (when the next renewal goes out) plus the renew deadline
        (that renewal's whole budget). Below ``lease_duration`` by the safety margin."""
        return self.retry_period + self.renew_deadline

    @property
    def lease_duration_seconds(self) -> int:
        """What the Lease advertises: whole seconds, rounded up (never shorter than ours)."""
        return max(1, math.ceil(self.lease_duration))


class EpochFloor(Protocol):
    """A store, outside the Lease, of the lowest epoch a new term may use.

    Deleting the Lease resets ``leaseTransitions`` to 0; the floor keeps epochs increasing
    anyway. ``claim`` must be atomic: record ``epoch`` as the new minimum and return True
    iff ``epoch`` is greater than the stored one (any epoch when nothing is stored).
    Raising is treated like a refusal that may be retried with the same epoch, except
    :class:`AccessRefused`, which ends the elector. A floor may also have
    ``check_access()`` (raising :class:`AccessRefused`); the elector then calls it every
    :data:`ACCESS_CHECK_PERIOD` seconds, leading or not.
    """

    def claim(self, epoch: int, identity: str) -> bool: ...


@runtime_checkable
class PresenceStore(Protocol):
    """Where the leading term shows that it reaches the store of its locks (the locks'
    etcd); an :class:`EpochFloor` may be one. ``keep_presence`` blocks until ``stop``,
    keeping a record of (identity, epoch) that disappears by itself ``ttl`` seconds after
    the leader stops reaching the store; ``shows_presence`` reads it (raising when the
    store does not answer)."""

    def keep_presence(self, identity: str, epoch: int, ttl: int,
                      stop: threading.Event) -> None: ...

    def shows_presence(self, identity: str, epoch: int) -> bool: ...


@runtime_checkable
class StepDownWriter(Protocol):
    """A Lease store that can write a step-down request (the one the CLI writes)."""

    def request_step_down(self, base: LeaseRecord, request: StepDownRequest,
                          timeout: float) -> LeaseRecord: ...


class Leadership:
    """One term, as handed to ``on_started``: its epoch, and how to know it is over.

    ``lost`` is set the moment the term is over or in doubt (renewals failing past the
    deadline, deposed, step-down, stop). :meth:`check` also enforces the renew deadline
    on its own, from the caller's thread and clock, so leader work that checks before
    acting never acts after the deadline even if the elector thread has not run.
    """

    def __init__(self, epoch: int, identity: str, valid_until: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._epoch = epoch
        self._identity = identity
        self._clock = clock
        self._valid_until = valid_until
        self._lock = threading.Lock()
        self.lost = threading.Event()
        self.stepping_down = threading.Event()
        """Set by :meth:`step_down`: the work gave the term up and the Lease is released."""

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def identity(self) -> str:
        return self._identity

    @property
    def valid_until(self) -> float:
        """Monotonic instant at which this process stops believing it leads."""
        with self._lock:
            return self._valid_until

    def remaining(self) -> float:
        """Seconds of belief left (0 once lost): bound blocking calls by this."""
        if self.lost.is_set():
            return 0.0
        return max(0.0, self.valid_until - self._clock())

    def check(self) -> None:
        """Raise :class:`LeadershipLost` if this term is over or its deadline has passed."""
        if not self.lost.is_set() and self._clock() >= self.valid_until:
            self.lost.set()
        if self.lost.is_set():
            raise LeadershipLost(f"leadership of epoch {self._epoch} lost ({self._identity})")

    def step_down(self) -> None:
        """End this term from the leader work and hand the Lease over: the elector
        releases it (once the work has returned) and sits out a lease duration so that a
        standby takes it. Unlike setting ``lost`` alone, which ends the term but keeps the
        Lease until it expires or this replica campaigns again."""
        self.stepping_down.set()
        self.lost.set()

    def _extend(self, valid_until: float) -> None:
        with self._lock:
            self._valid_until = max(self._valid_until, valid_until)

    def __repr__(self) -> str:
        return (f"Leadership(epoch={self._epoch}, identity={self._identity!r}, "
                f"lost={self.lost.is_set()})")


@dataclass(frozen=True)
class ElectionMetrics:
    """Prometheus metrics of one elector, registered in a caller-owned registry."""

    is_leader: Gauge
    epoch: Gauge
    leader_changes: Counter
    renew_seconds: Histogram
    renew_failures: Counter

    @classmethod
    def register(cls, registry: CollectorRegistry) -> ElectionMetrics:
        return cls(
            is_leader=Gauge("neonvm_leader_is_leader",
                            "1 while this replica leads (its term is not lost)",
                            registry=registry),
            epoch=Gauge("neonvm_leader_epoch",
                        "Epoch (leaseTransitions) of this replica's current or last term",
                        registry=registry),
            leader_changes=Counter("neonvm_leader_changes_observed",
                                   "Changes of the Lease holder this replica has seen",
                                   registry=registry),
            renew_seconds=Histogram("neonvm_leader_renew_duration_seconds",
                                    "Latency of successful Lease renewals",
                                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                                             5, 10),
                                    registry=registry),
            renew_failures=Counter("neonvm_leader_renew_failures",
                                   "Lease renewals that failed (errors, timeouts, conflicts)",
                                   registry=registry),
        )


class EndReason(Enum):
    """Why a term ended; decides whether the Lease is released."""

    STOP = "stop"                  # shutdown requested: release
    STEP_DOWN = "step-down"        # asked to step down (by the Lease annotation or by the
    #                                leader work, Leadership.step_down): release, sit out
    DEPOSED = "deposed"            # someone else holds the Lease (or a newer term of ours)
    DEADLINE = "renew-deadline"    # renewals failed until the renew deadline
    WORK_LOST = "work-lost"        # lost was set from outside (check() saw the deadline,
    #                                or the leader work ended)
    REFUSED = "access-refused"     # the epoch floor's store refused this replica its keys
    #                                (AccessRefused): release, stop campaigning, raise


def _same_term_record(old: LeaseRecord, new: LeaseRecord) -> bool:
    """Whether ``new`` differs from ``old`` in its metadata only (same object, same
    spec): nothing its holder wrote, so no renewal."""
    return old.uid == new.uid and old.raw.get("spec") == new.raw.get("spec")


@dataclass
class _Refusals:
    """Refusals by the epoch floor's store not yet confirmed: since when, how many."""

    since: float | None = None
    count: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _PresenceCount:
    """A standby's count of the holder's absence from the locks' etcd: whose term
    (holder, epoch), since when etcd has answered "absent" without a gap, and when it
    last answered."""

    subject: tuple[str, int] | None = None
    absent_since: float | None = None
    last_answer: float | None = None

    def reset(self) -> None:
        self.subject = self.absent_since = self.last_answer = None


@dataclass
class _Observation:
    """The last Lease version seen, and when (local monotonic clock) it was first seen."""

    record: LeaseRecord | None = None
    seen_at: float = 0.0


class LeaderElector:
    """Campaign for the Lease, lead while it is held, hand over on stop (docs/leader-election.md).

    Callbacks: ``on_started(leadership)`` runs in its own thread at the start of each
    term. It may block until ``leadership.lost`` is set, or start workers and return;
    if it raises, the term ends. ``on_stopped()`` runs in the elector's thread after
    ``lost`` is set, at the end of every term that started: it must make the leader work
    stop (the elector then waits up to ``shutdown_grace`` for the ``on_started`` thread,
    releases the Lease only once that thread has returned, and does not campaign again
    before it has returned, so two terms' work never overlap in one process).
    """

    def __init__(
        self,
        store: LeaseStore,
        config: ElectionConfig,
        on_started: Callable[[Leadership], None],
        on_stopped: Callable[[], None],
        epoch_floor: EpochFloor | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        watch: bool = True,
        spawn: Callable[[Callable[[], None]], None] | None = None,
        access_check: Callable[[], None] | None = None,
        access_period: float = ACCESS_CHECK_PERIOD,
        access_confirm: float = ACCESS_CONFIRM_SECONDS,
    ) -> None:
        self.config = config
        self._spawn = spawn if spawn is not None else _spawn_thread
        """Runs one request off the elector's thread (tests pass a simulated one)."""
        self._max_in_flight = 2 * math.ceil(config.belief / config.retry_period) + 1
        self._lease: LeaseStore = store
        """The Lease's storage, built by the caller (the composition root: the real one is
        :class:`~neonvm.leader.lease_store.KubernetesLeaseStore`)."""
        self._watch_enabled = watch
        self._wake = threading.Event()
        """Set by the watch thread when the Lease may have changed: read it now."""
        self._on_started = on_started
        self._on_stopped = on_stopped
        self._epoch_floor = epoch_floor
        self._access_check = access_check if access_check is not None else getattr(
            epoch_floor, "check_access", None)
        """Raises AccessRefused when the floor's store refuses us (None: never checked)."""
        self._access_period = access_period
        self._access_confirm = access_confirm
        self._refused: AccessRefused | None = None
        """Set once the floor's store refused this replica, confirmed: the elector ends."""
        self._refusals = _Refusals()
        """Refusals not yet confirmed (see :meth:`_note_refusal`)."""
        self._presence = epoch_floor if isinstance(epoch_floor, PresenceStore) else None
        """The leader keeps its presence there; standbys read it (None: no presence)."""
        self._presence_ttl = max(2, math.ceil(PRESENCE_TTL_LEASES * config.lease_duration))
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = ElectionMetrics.register(self.registry)
        self._clock = clock
        self._observed = _Observation()
        self._last_tick = clock()
        self._finished = False
        self._leadership: Leadership | None = None
        self._claiming_since: float | None = None
        """When the epoch claim in progress began (None: none in progress)."""
        self._stopping: _Stopping | None = None
        """The last term's work while it has not returned (None once it has)."""
        self._acquired_once = False
        self._namespace_missing = False
        self._log = logger.bind(lease=f"{config.namespace}/{config.name}",
                                identity=config.identity)

    # ---- introspection -----------------------------------------------------------------

    @property
    def leadership(self) -> Leadership | None:
        """The current term, if this replica leads (and has not lost it)."""
        term = self._leadership
        return term if term is not None and not term.lost.is_set() else None

    def is_leader(self) -> bool:
        term = self.leadership
        if term is None:
            return False
        try:
            term.check()
        except LeadershipLost:
            return False
        return True

    def health_check(self) -> None:
        """Fails when the elector is wedged: running, yet its loop has not turned for a
        whole lease duration (it is neither renewing nor campaigning nor exiting)."""
        if self._finished:
            return
        stopping = self._stopping
        if stopping is not None and stopping.worker.is_alive():
            late = self._clock() - stopping.since
            if late > self.config.shutdown_grace + self.config.lease_duration:
                raise RuntimeError(
                    f"the leader work of epoch {stopping.epoch} has not stopped {late:.1f}s "
                    f"after its term ended (shutdown grace {self.config.shutdown_grace:g}s); "
                    "this replica will not lead again until it does")
        claiming_since = self._claiming_since
        if claiming_since is not None:
            # A term that is still starting: its epoch claim waits on etcd.
            claiming = self._clock() - claiming_since
            if claiming > CLAIM_STALL_LIMIT:
                raise RuntimeError(f"claiming the epoch has taken {claiming:.1f}s "
                                   f"(> {CLAIM_STALL_LIMIT:g}s)")
            return
        idle = self._clock() - self._last_tick
        if idle > self.config.lease_duration:
            raise RuntimeError(
                f"leader election loop has not run for {idle:.1f}s "
                f"(> lease duration {self.config.lease_duration:g}s)")

    # ---- the loop ----------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Campaign, lead, renew, until ``stop`` is set; then release if leading."""
        self._finished = False
        watch_stop = threading.Event()
        if self._watch_enabled:
            threading.Thread(target=self._watch_loop, args=(watch_stop,), daemon=True,
                             name=f"lease-watch-{self.config.name}").start()
        if self._access_check is not None:
            threading.Thread(target=self._access_loop, args=(watch_stop,), daemon=True,
                             name=f"access-check-{self.config.name}").start()
        if self._presence is not None and isinstance(self._lease, StepDownWriter):
            threading.Thread(target=self._presence_loop, args=(watch_stop,), daemon=True,
                             name=f"presence-check-{self.config.name}").start()
        try:
            while not stop.is_set():
                # Never two terms' work at once in one process: a term whose work is
                # still stopping (past the shutdown grace) blocks the next campaign.
                if not self._await_stopped_work(stop):
                    break
                term = self._campaign(stop)
                if term is None:
                    break
                reason = self._lead(term, stop)
                if reason is EndReason.REFUSED:
                    break
                if reason is EndReason.STEP_DOWN:
                    # Sit out so that a standby (which takes a released Lease at once)
                    # wins; with no standby we campaign again after a lease duration.
                    self._tick_wait(stop, self.config.lease_duration)
            if self._refused is not None:
                raise self._refused
        finally:
            watch_stop.set()
            self._finished = True
            self._log.info("leader election stopped")

    def _watch_loop(self, stop: threading.Event) -> None:
        """Wake the campaign whenever the Lease may have changed (a hint, never a decision).

        Without the watch (refused, or failing) the campaign still polls every retry
        period and wakes at the observed expiry: the watch only makes it sooner.
        """
        failing = False
        while not stop.is_set():
            began = self._clock()
            try:
                for _ in self._lease.watch(timeout=60.0):
                    self._wake.set()
                    if stop.is_set():
                        return
                failing = False
                # A watch the server ends at once (again and again) must not spin.
                if self._clock() - began < 1.0 and stop.wait(self.config.retry_period):
                    return
            except Exception as exc:
                if not failing:
                    self._log.warning("watching the Lease failed ({err}); polling every "
                                      "{period:g}s meanwhile", err=short_error(exc),
                                      period=self.config.retry_period)
                failing = True
                if stop.wait(max(self.config.retry_period, 5.0)):
                    return

    def _access_loop(self, stop: threading.Event) -> None:
        """Check every access period that the floor's store still admits this replica;
        a confirmed refusal ends the elector (see :meth:`_note_refusal`): after a first
        refusal the next check comes ``access_confirm`` seconds later. An outage is not
        a refusal (and confirms nothing): the claim retries it as before."""
        assert self._access_check is not None
        while not stop.is_set():
            wait = self._access_period
            try:
                self._access_check()
            except AccessRefused as exc:
                if self._note_refusal(exc):
                    return
                wait = min(wait, self._access_confirm)
            except Exception as exc:  # etcd away: not ours to decide here
                self._log.debug("checking access to the epoch floor failed: {err}",
                                err=short_error(exc))
            else:
                self._note_admitted()
            if stop.wait(wait):
                return

    def _note_refusal(self, exc: AccessRefused) -> bool:
        """Count one refusal (by an access check or an epoch claim); True once it is
        confirmed and the elector ends: refused again ``access_confirm`` seconds or more
        after the first refusal, with nothing admitted in between. A refusal that passes
        (a role rewritten by a revoke and a grant; one etcd member refusing by itself
        for a moment) must not end every replica at once."""
        now = self._clock()
        with self._refusals.lock:
            first = self._refusals.since is None
            if first:
                self._refusals.since = now
            since = self._refusals.since
            assert since is not None
            self._refusals.count += 1
            confirmed = self._refusals.count >= 2 and now - since >= self._access_confirm
        if confirmed:
            self._refuse(exc)
        elif first:
            self._log.warning("the epoch floor's store refused this replica ({err}); "
                              "stopping if it still does in {confirm:g}s",
                              err=short_error(exc), confirm=self._access_confirm)
        return confirmed

    def _refusal_pending(self) -> bool:
        """Refused and not yet confirmed nor admitted since (only with an access check,
        which settles it within an access period)."""
        with self._refusals.lock:
            return self._access_check is not None and self._refusals.since is not None

    def _note_admitted(self) -> None:
        """The floor's store answered a check or a claim: no refusal to confirm."""
        with self._refusals.lock:
            if self._refusals.since is not None:
                self._log.info("the epoch floor's store admits this replica again")
            self._refusals.since = None
            self._refusals.count = 0

    def _presence_loop(self, stop: threading.Event) -> None:
        """While not leading: ask the holder to step down once the locks' etcd has
        shown no presence of its term for ``PRESENCE_GRACE_LEASES`` lease durations in
        a row, read every :meth:`_presence_period` by this replica (so it reaches etcd
        itself). A holder cut off from etcd can do nothing, yet keeps the Lease while it
        reaches the API server; an etcd this replica cannot read proves nothing, and
        restarts the count (:meth:`_presence_sample`)."""
        count = _PresenceCount()
        while not stop.wait(self._presence_period()):
            self._presence_sample(count)

    def _presence_period(self) -> float:
        return min(1.0, self.config.lease_duration / 2)

    def _presence_sample(self, count: _PresenceCount) -> None:
        """One read of the presence key and what follows from it.

        The count is of consecutive answers: it restarts when the holder or epoch
        changes, when etcd shows the term, when etcd does not answer, and when two
        answers are more than two read periods apart (this process did not run in
        between, or a read was slow: no evidence for the gap). No request is written
        while the Lease already carries one naming the term (a live holder acts on it at
        its next renewal), nor once the holder's record has gone unchanged for a lease
        duration (it is not renewing: the expiry hands the Lease over).
        """
        assert self._presence is not None and isinstance(self._lease, StepDownWriter)
        grace = PRESENCE_GRACE_LEASES * self.config.lease_duration
        record = self._observed.record
        if (self._leadership is not None or record is None or not record.holder
                or record.holder == self.config.identity):
            count.reset()
            return
        if count.subject != (record.holder, record.transitions):
            count.reset()
            count.subject = (record.holder, record.transitions)
        try:
            shown = self._presence.shows_presence(record.holder, record.transitions)
        except Exception:  # etcd away from us too: no evidence either way
            count.absent_since = count.last_answer = None
            return
        now = self._clock()
        gap = None if count.last_answer is None else now - count.last_answer
        count.last_answer = now
        if shown:
            count.absent_since = None
            return
        if count.absent_since is None or gap is None or gap > 2 * self._presence_period():
            count.absent_since = now
            return
        if now - count.absent_since < grace:
            return
        observed = self._observed  # the campaign thread's newest read
        current = observed.record
        if current is None or (current.holder, current.transitions) != count.subject:
            return  # another term now: the next sample starts its count
        if current.step_down is not None and current.step_down.names(*count.subject):
            return  # asked already (by us or another standby)
        if self._clock() >= self._expires_at_of(observed):
            return  # not renewing: the campaign takes it at expiry
        count.absent_since = None  # ask again after another grace if it stays away
        self._ask_to_step_down(current, grace)

    def _ask_to_step_down(self, record: LeaseRecord, grace: float) -> None:
        """Write a step-down request naming ``record``'s term (conditional on the
        Lease's uid, holder and epoch still being that term's)."""
        assert isinstance(self._lease, StepDownWriter)
        request = StepDownRequest(record.holder, record.transitions,
                                  format_microtime(datetime.now(UTC)))
        try:
            self._lease.request_step_down(record, request, self.config.renew_deadline)
        except Exception as exc:  # its term ended meanwhile, or the API server is away
            self._log.info("could not ask {holder} to step down: {err}",
                           holder=record.holder, err=short_error(exc))
            return
        self._log.warning(
            "asked {holder} (epoch {epoch}) to step down: the locks' etcd has shown no "
            "presence of its term for {grace:g}s while this replica reaches it",
            holder=record.holder, epoch=record.transitions, grace=grace)

    def _refuse(self, exc: AccessRefused) -> None:
        if self._refused is None:
            self._refused = exc
            self._wake.set()  # a waiting campaign ends now

    def _tick_wait(self, stop: threading.Event, seconds: float) -> bool:
        """Wait up to ``seconds`` (returns True if stopped), keeping the health tick fresh."""
        deadline = self._clock() + seconds
        while True:
            self._last_tick = self._clock()
            left = deadline - self._clock()
            if left <= 0:
                return stop.is_set()
            if stop.wait(min(left, self.config.retry_period)):
                return True

    def _observe(self, record: LeaseRecord | None) -> None:
        """Remember a Lease version; restart the expiry clock only when the term's
        record changed: another object (uid) or another ``spec``. Every holder write
        changes the spec (a renewal its ``renewTime``, a raise ``leaseTransitions``, the
        release ``holderIdentity``); a change of the metadata alone (a standby's or the
        CLI's step-down request) is not a renewal and must not postpone the expiry
        (docs/leader-election.md, "A leader cut off the locks' etcd")."""
        old = self._observed.record
        if old is not None and record is not None \
                and old.resource_version == record.resource_version:
            return
        if old is not None and record is not None and _same_term_record(old, record):
            self._observed = _Observation(record, self._observed.seen_at)
            return
        if old is not None and record is not None and old.holder != record.holder:
            self.metrics.leader_changes.inc()
            self._log.info("leader is now {holder} (epoch {epoch})",
                           holder=record.holder or "<none>", epoch=record.transitions)
        self._observed = _Observation(record, self._clock())

    def _expires_at(self) -> float | None:
        """Monotonic instant at which the observed Lease may be taken (None: now)."""
        observed = self._observed
        if observed.record is None or not observed.record.holder:
            return None
        return self._expires_at_of(observed)

    def _expires_at_of(self, observed: _Observation) -> float:
        record = observed.record
        duration = (record.lease_duration_seconds if record is not None else None) \
            or self.config.lease_duration
        return observed.seen_at + duration

    def _expired(self) -> bool:
        expires_at = self._expires_at()
        return expires_at is None or self._clock() >= expires_at

    def _campaign_wait(self) -> float:
        """How long to wait before the next attempt: a jittered retry period, or less if
        the observed Lease expires sooner (a timer at last change + lease duration)."""
        wait = self.config.retry_period * random.uniform(1.0, JITTER_FACTOR)
        expires_at = self._expires_at()
        now = self._clock()
        if expires_at is not None and expires_at > now:
            # The attempt comes at or after the instant, never before it.
            wait = min(wait, expires_at - now + EXPIRY_TIMER_SLACK)
        return wait

    def _wait_for_wake(self, stop: threading.Event, seconds: float) -> bool:
        """Wait ``seconds`` or until the watch says the Lease changed; True if stopped."""
        deadline = self._clock() + seconds
        while not stop.is_set():
            left = deadline - self._clock()
            if left <= 0:
                return False
            if self._wake.wait(min(left, STOP_POLL)):
                return stop.is_set()
        return True

    # ---- campaign ----------------------------------------------------------------------

    def _campaign(self, stop: threading.Event) -> _Term | None:
        """Try to acquire every retry period (jittered); return the acquired term."""
        self._log.info("campaigning")
        while not stop.is_set() and self._refused is None:
            self._last_tick = self._clock()
            self._wake.clear()  # a change after this point wakes the next wait
            if self._refusal_pending():
                # Refused, not yet confirmed: do not take the Lease meanwhile (a
                # confirmed refusal sets the wake; an admission lets the next turn try).
                if self._wait_for_wake(stop, self.config.retry_period):
                    break
                continue
            acquired = self._try_acquire()
            if acquired is not None:
                return acquired
            if self._wait_for_wake(stop, self._campaign_wait()):
                break
        return None

    def _try_acquire(self, stop: threading.Event | None = None) -> _Term | None:
        """Read the Lease and, if the rules allow, take it by CAS; return the new term.

        While the acquisition is in flight, renewals already go out every retry period
        (conditional on the holder and epoch it writes): the first renewal cannot wait
        for the acquisition's answer, or two round trips would have to fit in the first
        window (docs/leader-election.md, "Renewals in flight").
        """
        stop = stop if stop is not None else threading.Event()
        timeout = self.config.renew_deadline
        try:
            current = self._lease.get(timeout)
        except Exception as exc:  # network, 5xx, timeout: try again next period
            self._log.warning("reading the Lease failed: {err}", err=short_error(exc))
            return None
        self._observe(current)
        now = datetime.now(UTC)
        me = self.config.identity
        spec = {
            "holderIdentity": me,
            "leaseDurationSeconds": self.config.lease_duration_seconds,
            "acquireTime": format_microtime(now),
            "renewTime": format_microtime(now),
        }
        if current is not None and current.holder not in ("", me) and not self._expired():
            # Our own identity may still hold it from a term we abandoned; its work
            # was stopped before we got here, so we may take it at once.
            return None
        epoch = 0 if current is None else current.transitions + 1
        base = (LeaseRecord(holder=me, lease_duration_seconds=None, acquire_time=None,
                            renew_time=None, transitions=0, resource_version="",
                            step_down=None, raw={})
                if current is None else dataclasses.replace(current, holder=me,
                                                            transitions=epoch, step_down=None))
        term = _Term(record=base, renewed_at=self._clock(), epoch=epoch, acquiring=True)
        term.next_renewal = term.renewed_at + self.config.retry_period

        def write() -> LeaseRecord:
            if current is None:
                return self._lease.create({**spec, "leaseTransitions": 0}, timeout)
            return self._lease.update(current, {**spec, "leaseTransitions": epoch}, timeout,
                                      drop_step_down=True)

        term.renewed_at = self._call(term, "acquire", write)
        answer = self._pump(term, stop, want="acquire")
        if answer is EndReason.REFUSED and term.pending.get("acquire"):
            # Refused while the acquisition is in flight: it may land all the same.
            # Take its answer (within the term's belief) and release what it took.
            answer = self._pump(term, stop, want="acquire", refusal_ends=False)
            term.acquiring = False
            if isinstance(answer, _Answer) and answer.error is None and not term.proven:
                term.record = answer.value
            if term.proven or (isinstance(answer, _Answer) and answer.error is None):
                self._log.info("acquired the Lease as this replica was refused; "
                               "releasing it")
                self._release(term)
            return None
        term.acquiring = False
        if not isinstance(answer, _Answer):  # stopped, or no answer within the window
            return None
        if answer.error is not None:
            if term.proven:
                # The answer was lost, but a renewal conditional on our holding the
                # Lease at this epoch succeeded: the acquisition took effect.
                self._log.info("acquired the Lease (leaseTransitions {n}; its answer "
                               "was lost, a renewal proved it)", n=epoch)
                self._acquired_once = True
                return term
            self._acquire_failed(answer.error)
            return None
        self._acquired_once = True
        self._namespace_missing = False
        acquired: LeaseRecord = answer.value
        if not term.proven:
            term.record = acquired
            self._observe(acquired)
        self._log.info("acquired the Lease (leaseTransitions {n})", n=acquired.transitions)
        return term

    def _acquire_failed(self, error: Exception) -> None:
        """A refused or failed acquisition: nothing, or the missing namespace raised."""
        if isinstance(error, LeaseConflict):  # someone else won this round (or created it)
            return None
        if isinstance(error, LeaseNamespaceNotFound):
            missing = LeaseNamespaceMissing(self.config.namespace, self.config.name)
            if not self._acquired_once:
                raise missing from error  # at start-up: a configuration error
            if not self._namespace_missing:  # later (deleted under us): say it once
                self._log.error("{err}; retrying quietly", err=str(missing))
            self._namespace_missing = True
            return None
        self._log.warning("acquiring the Lease failed: {err}", err=short_error(error))
        return None

    # ---- leading -----------------------------------------------------------------------

    def _lead(self, term: _Term, stop: threading.Event) -> EndReason:
        """From acquisition to the end of the term (always leaves the term ended)."""
        reason = self._claim_epoch(term, stop)
        if reason is None and self._clock() >= self._valid_until(term):
            reason = EndReason.DEADLINE
        if reason is not None:
            self._log.info("gave up the Lease before starting work: {r}", r=reason.value)
            if reason in (EndReason.STOP, EndReason.STEP_DOWN, EndReason.REFUSED):
                self._release(term)
            return reason
        leadership = Leadership(term.epoch, self.config.identity,
                                self._valid_until(term), self._clock)
        term.leadership = leadership
        self._leadership = leadership
        self.metrics.is_leader.set(1)
        self.metrics.epoch.set(leadership.epoch)
        self._log.info("started leading, epoch {epoch}", epoch=leadership.epoch)
        worker = threading.Thread(target=self._run_started, args=(leadership,),
                                  name=f"leader-work-{leadership.epoch}", daemon=True)
        presence_stop = threading.Event()
        if self._presence is not None:
            threading.Thread(target=self._keep_presence, args=(term.epoch, presence_stop),
                             name=f"presence-{term.epoch}", daemon=True).start()
        worker.start()
        try:
            reason = self._renew_loop(term, stop)
        finally:
            presence_stop.set()
        self._end_term(leadership, reason, worker)
        if reason in (EndReason.STOP, EndReason.STEP_DOWN, EndReason.REFUSED):
            if worker.is_alive():
                self._log.error("leader work of epoch {epoch} is still running {grace:g}s "
                                "after its term ended; not releasing the Lease (it will "
                                "expire instead)", epoch=leadership.epoch,
                                grace=self.config.shutdown_grace)
            else:
                self._release(term)
        return reason

    def _keep_presence(self, epoch: int, stop: threading.Event) -> None:
        assert self._presence is not None
        try:
            self._presence.keep_presence(self.config.identity, epoch, self._presence_ttl, stop)
        except Exception as exc:
            self._log.warning("keeping the presence key failed: {err}",
                              err=short_error(exc))

    def _run_started(self, leadership: Leadership) -> None:
        """``on_started`` may block until ``lost`` or start workers and return; if it
        raises, the work is broken and the term ends rather than guard nothing."""
        try:
            self._on_started(leadership)
        except Exception:
            self._log.exception("on_started raised; ending the term")
            leadership.lost.set()

    def _claim_epoch(self, term: _Term, stop: threading.Event) -> EndReason | None:
        """Raise our own leaseTransitions until the epoch floor accepts it; renewals go
        on meanwhile (the claim and each raise are calls in flight like them)."""
        floor = self._epoch_floor
        if floor is None:
            return None
        step = 1
        while True:
            epoch = term.epoch
            self._claiming_since = self._clock()
            try:
                answer = self._pump(term, stop, want="claim", send=(
                    "claim", functools.partial(floor.claim, epoch, self.config.identity)))
            finally:
                self._last_tick = self._clock()  # before the flag: a probe never sees idle
                self._claiming_since = None
            if not isinstance(answer, _Answer):
                return answer if answer is not None else EndReason.STOP
            if answer.error is None:
                self._note_admitted()
            if answer.error is None and answer.value:
                return None
            if isinstance(answer.error, AccessRefused) and self._note_refusal(answer.error):
                return EndReason.REFUSED
            if answer.error is not None:
                self._log.warning("claiming epoch {epoch} failed: {err}", epoch=epoch,
                                  err=short_error(answer.error))
                ended = self._pump(term, stop, until=self._clock()
                                   + self.config.retry_period)
                if ended is not None:
                    return ended if isinstance(ended, EndReason) else EndReason.STOP
                continue
            self._log.info("epoch floor refused epoch {epoch}; raising it by {step}",
                           epoch=epoch, step=step)
            ended = self._raise_epoch(term, stop, epoch + step)
            if ended is not None:
                return ended
            step *= 2

    def _raise_epoch(self, term: _Term, stop: threading.Event, to: int) -> EndReason | None:
        """Set our own Lease's leaseTransitions to ``to`` (conditional on holding it)."""
        term.raising_to = to
        try:
            while True:
                base = term.base()
                answer = self._pump(term, stop, want="raise", send=(
                    "raise", functools.partial(
                        self._lease.renew, base,
                        {"leaseTransitions": to,
                         "renewTime": format_microtime(datetime.now(UTC))},
                        timeout=self.config.belief)))
                if not isinstance(answer, _Answer):
                    return answer if answer is not None else EndReason.STOP
                if answer.error is None:
                    return None
                ended = self._pump(term, stop, until=self._clock()
                                   + self.config.retry_period)
                if ended is not None:
                    return ended if isinstance(ended, EndReason) else EndReason.STOP
        finally:
            term.raising_to = None

    def _renew_loop(self, term: _Term, stop: threading.Event) -> EndReason:
        """Renew every retry period until the term ends (see :meth:`_pump`)."""
        ended = self._pump(term, stop)
        assert isinstance(ended, EndReason)
        return ended

    def _renew(self, term: _Term, stop: threading.Event) -> EndReason | None:
        """Send one renewal now and keep renewing until one succeeds (None) or the term
        ends (why). The term's loop itself never waits for an answer like this."""
        before = term.successes
        term.next_renewal = self._clock()
        while term.successes == before:
            answer = self._pump(term, stop, want="renew")
            if not isinstance(answer, _Answer):
                return answer if answer is not None else EndReason.STOP
        return None

    # ---- the calls in flight -----------------------------------------------------------

    def _call(self, term: _Term, kind: str, fn: Callable[[], Any]) -> float:
        """Run ``fn`` (one request) off this thread; its answer lands in ``term.answers``.
        Returns the send time."""
        sent_at = self._clock()
        term.pending[kind] = term.pending.get(kind, 0) + 1

        def run() -> None:
            try:
                term.answers.put(_Answer(kind, sent_at, value=fn()))
            except Exception as exc:
                term.answers.put(_Answer(kind, sent_at, error=exc))

        self._spawn(run)
        return sent_at

    def _send_renewal(self, term: _Term) -> None:
        """The next renewal, on the schedule: one every retry period by *send* time,
        whether or not the previous ones have answered."""
        now = self._clock()
        term.next_renewal += self.config.retry_period
        if term.next_renewal <= now:  # behind by more than a period: start again from now
            term.next_renewal = now + self.config.retry_period
        if term.pending.get("renew", 0) >= self._max_in_flight:
            return  # calls that never answer (a store that ignores timeouts): send no more
        base = term.base()
        self._call(term, "renew", lambda: self._lease.renew(
            base, {"renewTime": format_microtime(datetime.now(UTC))},
            timeout=self.config.belief))

    def _pump(self, term: _Term, stop: threading.Event, *, want: str | None = None,
              until: float | None = None,
              send: tuple[str, Callable[[], Any]] | None = None,
              refusal_ends: bool = True) -> EndReason | _Answer | None:
        """The term's loop: send renewals when due, take their answers, end the term.

        Returns the first answer of kind ``want`` (after ``send`` sent it), None once the
        clock reaches ``until``, or why the term ended: the renew deadline passed (no
        renewal succeeded within ``retry_period + renew_deadline`` of the send of the last
        one that did), deposed, step-down, ``stop``, or ``lost`` set from outside, or
        (unless not ``refusal_ends``) a confirmed refusal of this replica.
        """
        if send is not None:
            self._call(term, *send)
        while True:
            self._last_tick = self._clock()
            if self._refused is not None and refusal_ends:
                return EndReason.REFUSED
            while True:
                try:
                    answer = term.answers.get_nowait()
                except queue.Empty:
                    break
                term.pending[answer.kind] -= 1
                ended = self._take(term, answer)
                if ended is not None:
                    return ended
                if answer.kind == want:
                    return answer
            now = self._clock()
            if until is not None and now >= until:
                return None
            if now >= self._valid_until(term):
                self._log.warning("could not renew the Lease within the renew deadline")
                return EndReason.DEADLINE
            leadership = term.leadership
            if leadership is not None and leadership.lost.is_set():
                if leadership.stepping_down.is_set():
                    return EndReason.STEP_DOWN
                return EndReason.WORK_LOST
            if now >= term.next_renewal and term.raising_to is None:
                self._send_renewal(term)
            wake = min(term.next_renewal, self._valid_until(term),
                       until if until is not None else math.inf)
            if stop.wait(max(0.0, min(wake - self._clock(), RESULT_POLL))):
                return EndReason.STOP

    def _take(self, term: _Term, answer: _Answer) -> EndReason | None:
        """Learn from one answer to our own writes or reads (None: the term goes on)."""
        me = self.config.identity
        if answer.kind in ("renew", "raise"):
            if answer.error is None:
                record: LeaseRecord = answer.value
                self.metrics.renew_seconds.observe(self._clock() - answer.sent_at)
                if record.holder != me:  # cannot happen with a conditional write
                    return EndReason.DEPOSED
                if answer.kind == "raise":
                    term.epoch = record.transitions
                elif record.transitions != term.epoch:
                    return None  # sent before our own raise: proves nothing now
                term.proven = True
                term.successes += 1
                if answer.sent_at >= term.renewed_at:
                    term.renewed_at = answer.sent_at
                    term.record = record
                    self._observe(record)
                    if term.leadership is not None:
                        term.leadership._extend(self._valid_until(term))
                return self._step_down_asked(term, record)
            self.metrics.renew_failures.inc()
            if isinstance(answer.error, LeaseNotFound) and not term.acquiring:
                self._log.warning("deposed: the Lease was deleted")
                return EndReason.DEPOSED
            if isinstance(answer.error, LeaseConflict):
                # Not ours at the epoch we tested, or not yet (while the acquisition is in
                # flight we do not know): a fresh read decides.
                if not term.acquiring and not term.pending.get("read"):
                    self._call(term, "read", lambda: self._lease.get(self.config.belief))
                return None
            self._log.warning("renewing the Lease failed: {err}",
                              err=short_error(answer.error))
            return None
        if answer.kind == "read" and answer.error is None:
            fresh: LeaseRecord | None = answer.value
            self._observe(fresh)
            if fresh is None or fresh.holder != me or fresh.transitions not in (
                    term.epoch, term.raising_to) or term.record.uid not in (None, fresh.uid):
                self._log.warning("deposed: the Lease now names {holder} (epoch {epoch})",
                                  holder=fresh.holder if fresh else "<deleted>",
                                  epoch=fresh.transitions if fresh else "-")
                return EndReason.DEPOSED
            return self._step_down_asked(term, fresh)
        if answer.kind == "read" and answer.error is not None:
            self._log.warning("re-reading the Lease failed: {err}",
                              err=short_error(answer.error))
        return None

    def _step_down_asked(self, term: _Term, record: LeaseRecord) -> EndReason | None:
        if record.step_down is not None and record.step_down.names(
                self.config.identity, term.epoch):
            term.record = record  # the release removes the request it saw
            self._log.info("step-down requested for epoch {epoch}", epoch=term.epoch)
            return EndReason.STEP_DOWN
        return None

    def _valid_until(self, term: _Term) -> float:
        """Monotonic instant at which ``term`` ends unless a renewal succeeds before it:
        ``retry_period + renew_deadline`` after the send of the last one that did."""
        return term.renewed_at + self.config.belief

    def _end_term(self, leadership: Leadership, reason: EndReason,
                  worker: threading.Thread) -> None:
        leadership.lost.set()
        self.metrics.is_leader.set(0)
        self._log.info("stopped leading, epoch {epoch}: {reason}", epoch=leadership.epoch,
                       reason=reason.value)
        try:
            self._on_stopped()
        except Exception:
            self._log.exception("on_stopped raised")
        self._stopping = _Stopping(worker, leadership.epoch, self._clock())
        deadline = self._clock() + self.config.shutdown_grace
        while worker.is_alive() and self._clock() < deadline:
            self._last_tick = self._clock()
            worker.join(timeout=min(WORK_JOIN_SLICE, max(0.0, deadline - self._clock())))
        self._last_tick = self._clock()
        if not worker.is_alive():
            self._stopping = None
        self._leadership = None

    def _await_stopped_work(self, stop: threading.Event) -> bool:
        """Before campaigning: wait for the last term's work to return (False if stopped).

        Within the shutdown grace the health tick stays fresh; past it, ``health_check``
        reports the stuck work (after one more lease duration), so that a replica whose
        work never returns is restarted rather than never leading again.
        """
        stopping = self._stopping
        if stopping is None:
            return True
        if stopping.worker.is_alive():
            self._log.error("not campaigning until the leader work of epoch {epoch} has "
                            "stopped", epoch=stopping.epoch)
        while stopping.worker.is_alive():
            if self._clock() - stopping.since <= self.config.shutdown_grace:
                self._last_tick = self._clock()
            if stop.wait(WORK_JOIN_SLICE):
                return False
        self._stopping = None
        self._last_tick = self._clock()
        return True

    def _release(self, term: _Term) -> None:
        """Hand the Lease over at once (client-go's ReleaseOnCancel), conditional on still
        holding it at our epoch: renewals still in flight fail after it (their holder test)."""
        now = format_microtime(datetime.now(UTC))
        spec = {"holderIdentity": "", "leaseDurationSeconds": 1,
                "acquireTime": now, "renewTime": now}
        try:
            released = self._lease.renew(term.base(), spec, timeout=self.config.renew_deadline,
                                         drop_step_down=True)
        except Exception as exc:
            self._log.warning("could not release the Lease ({err}); standbys will wait for "
                              "it to expire", err=short_error(exc))
            return
        self._observe(released)
        self._log.info("released the Lease")


@dataclass(frozen=True)
class _Stopping:
    """A term's work thread that was told to stop, and since when."""

    worker: threading.Thread
    epoch: int
    since: float


@dataclass
class _Answer:
    """The outcome of one call made off the elector's thread (see ``LeaderElector._call``)."""

    kind: str  # "acquire", "renew", "read", "claim", "raise"
    sent_at: float
    value: Any = None
    error: Exception | None = None


@dataclass
class _Term:
    """The leader's own view of its term: the newest answer to its writes, when the write
    that got it was sent, and the calls still in flight."""

    record: LeaseRecord
    renewed_at: float
    """Send time of the newest write (acquisition or renewal) that succeeded."""
    epoch: int = -1
    """leaseTransitions of this term (raised while the epoch floor refuses it)."""
    acquiring: bool = False
    """The acquisition is in flight: a renewal's refusal does not mean deposed yet."""
    proven: bool = False
    """A renewal conditional on holding the Lease at ``epoch`` succeeded."""
    successes: int = 0
    next_renewal: float = 0.0
    raising_to: int | None = None
    leadership: Leadership | None = None
    answers: queue.SimpleQueue[_Answer] = field(default_factory=queue.SimpleQueue)
    pending: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.epoch < 0:
            self.epoch = self.record.transitions

    def base(self) -> LeaseRecord:
        """What a renewal is conditional on: this Lease (uid), our identity, our epoch."""
        return dataclasses.replace(self.record, transitions=self.epoch)
