"""The handler's contract: what each end of a key's turn comes to, and what the queue does.

Specifications of :mod:`neonvm.controller.handler` over fakes (pure: no servers). The
real-server tests (``test_reconcile*.py``, ``test_fence_integrity.py``) run the same
handler inside a leader term.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from loguru import logger

from neonvm.controller import actions as act
from neonvm.controller.authority import AuthorityLost, RetryableError, WrongVM
from neonvm.controller.handler import Handler, Outcome, outcome_of_error
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.mutations import FencedOut
from neonvm.controller.reconciler import ReconcileResult
from neonvm.controller.timers import VMTimers
from neonvm.controller.update import ConflictRetriesExhausted
from neonvm.controller.workqueue import Backoff, WorkQueue
from neonvm.leader.election import LeadershipLost
from neonvm.leader.etcd import EtcdError
from neonvm.leader.lock import LockHeld, LockInfo, LockLost, SessionLost
from tests.support.authority import StaticAuthority

pytestmark = pytest.mark.unit

KEY = "ns/vm"
VM = {"metadata": {"name": "vm", "namespace": "ns", "uid": "u1"}}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeCache:
    def __init__(self, raw: dict[str, Any] | None) -> None:
        self.raw = raw

    def get(self, key: str) -> dict[str, Any] | None:
        return self.raw

    def discard(self, key: str, uid: str) -> bool:
        self.raw = None
        return True


class FakeReconciler:
    def __init__(self, *results: ReconcileResult | Exception) -> None:
        self.results = list(results)
        self.direct_first: list[bool] = []

    def reconcile(self, key: str, authority: Any, *,
                  direct_first: bool = False) -> ReconcileResult:
        self.direct_first.append(direct_first)
        result = self.results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result


class World:
    """A handler over fakes, and what it did to them."""

    def __init__(self, *results: ReconcileResult | Exception, cached: bool = True,
                 on_server: bool = True, acquire_error: Exception | None = None) -> None:
        self.clock = FakeClock()
        self.queue = WorkQueue(Backoff(base=1.0, cap=8.0), clock=self.clock)
        self.timers = VMTimers(Backoff(base=10.0, cap=100.0), clock=self.clock)
        self.cache = FakeCache(dict(VM) if cached else None)
        self.reconciler = FakeReconciler(*results)
        self.released: list[str] = []
        self.ended = False
        self.ending = False
        self.acquire_error = acquire_error
        self.metrics = ControllerMetrics()
        on_server_vm = dict(VM) if on_server else None
        self.handler = Handler(
            queue=self.queue, vms=self.cache, reconciler=self.reconciler,
            read_vm=lambda namespace, name: on_server_vm,
            acquire=self._acquire, authority=lambda guard: StaticAuthority(),
            release_lock=self.released.append, timers=self.timers,
            term_ending=lambda: self.ending, end_term=self._end, metrics=self.metrics,
            log=logger)

    def _acquire(self, namespace: str, name: str, uid: str) -> Any:
        if self.acquire_error is not None:
            raise self.acquire_error
        return object()

    def _end(self) -> None:
        self.ended = True

    def turn(self, direct: bool = False) -> Outcome:
        taken = self.queue.take(0)
        if taken is not None:
            direct = taken.direct
        try:
            return self.handler.process(KEY, direct)
        finally:
            if taken is not None:
                self.queue.done(KEY)

    def next_turn_at(self) -> tuple[float, bool] | None:
        """In how many seconds the key comes back, and whether read directly (advances
        the fake clock to then; the key is taken, ready for :meth:`turn`'s ``direct``)."""
        start = self.clock.now
        for step in range(0, 1000):
            self.clock.now = start + step / 4
            taken = self.queue.take(0)
            if taken is not None:
                self.queue.done(taken.key)
                return self.clock.now - start, taken.direct
        return None


def lock_held() -> LockHeld:
    return LockHeld(LockInfo(namespace="ns", name="vm", key="k", token=7, create_revision=7,
                             lease=1, record=None, malformed="x", raw=b"x"))


def ended(action: act.Action, after: float, stuck: str | None = None) -> ReconcileResult:
    return ReconcileResult(action=action, requeue_after=after, steps=1, stuck=stuck)


# ---- errors map to outcomes in one place -------------------------------------------------


@pytest.mark.parametrize(("error", "kind", "direct"), [
    (AuthorityLost("lock lost"), "temporary", True),
    (LeadershipLost("lease expired"), "temporary", True),
    (LockLost("gone"), "temporary", True),
    (SessionLost("revoked"), "temporary", True),
    (WrongVM("re-created"), "again", True),
    (lock_held(), "temporary", False),
    (FencedOut("token ahead"), "permanent", True),
    (ApiException(status=500), "temporary", True),
    (EtcdError("unavailable"), "temporary", True),
    (OSError("connection refused"), "temporary", True),
    (RetryableError("quota"), "temporary", True),
    (ConflictRetriesExhausted("409 x 5"), "temporary", True),
])
def test_each_error_of_a_turn_has_one_outcome(error: Exception, kind: str,
                                              direct: bool) -> None:
    outcome = outcome_of_error(error, term_ending=False)
    assert (outcome.kind, outcome.direct, outcome.bug) == (kind, direct, None)


def test_lost_authority_while_the_term_ends_is_dropped_and_nothing_else() -> None:
    for error in (AuthorityLost("x"), LeadershipLost("x"), LockLost("x"), SessionLost("x")):
        assert outcome_of_error(error, term_ending=True).kind == "dropped"
    assert outcome_of_error(ApiException(status=500), term_ending=True).kind == "temporary"


def test_an_unexpected_error_is_a_bug_retried_with_backoff() -> None:
    error = KeyError("status")
    outcome = outcome_of_error(error, term_ending=False)
    assert (outcome.kind, outcome.bug) == ("temporary", error)


# ---- outcomes: what the queue does ----------------------------------------------------------


def test_a_reconcile_that_ended_comes_back_after_its_wait_read_directly() -> None:
    w = World(ended(act.Wait(seconds=2.0), 2.0))
    assert w.turn() == Outcome("requeue", after=2.0)
    assert w.next_turn_at() == (2.0, True)
    assert w.reconciler.direct_first == [False]


def test_a_temporary_error_backs_off_per_key_until_a_reconcile_ends() -> None:
    w = World(ApiException(status=503), ApiException(status=503),
              ended(act.Done(), 30.0), ApiException(status=503))
    w.turn()
    assert w.next_turn_at() == (1.0, True)
    w.turn()
    assert w.next_turn_at() == (2.0, True), "doubled"
    w.turn()  # ends normally: the backoff is forgotten
    assert w.queue.failures(KEY) == 0
    w.next_turn_at()
    w.turn()
    assert w.next_turn_at() == (1.0, True), "from the start again"


def test_a_lock_held_elsewhere_is_retried_from_the_cache() -> None:
    w = World(acquire_error=lock_held())
    assert w.turn().kind == "temporary"
    assert w.next_turn_at() == (1.0, False)


def test_a_re_created_vm_is_taken_again_at_once() -> None:
    w = World(WrongVM("lock taken for uid u0"))
    assert w.turn().kind == "again"
    assert w.next_turn_at() == (0.0, True)


def test_a_fence_ahead_by_its_token_ends_the_term_and_requeues_nothing() -> None:
    w = World(FencedOut("token ahead"))
    assert w.turn().kind == "permanent"
    assert w.ended
    assert w.next_turn_at() is None


def test_a_turn_dropped_by_an_ending_term_requeues_nothing() -> None:
    w = World(AuthorityLost("the term is ending"))
    w.ending = True
    assert w.turn().kind == "dropped"
    assert w.next_turn_at() is None and not w.ended


def test_stuck_reconciles_back_off_longer_each_time_and_one_normal_end_resets() -> None:
    w = World(ended(act.Wait(seconds=0.0), 0.0, stuck="CreatePodNotTakingEffect"),
              ended(act.Wait(seconds=0.0), 0.0, stuck="CreatePodNotTakingEffect"),
              ended(act.Done(), 30.0),
              ended(act.Wait(seconds=0.0), 0.0, stuck="CreatePodNotTakingEffect"))
    assert w.turn().after == 10.0
    assert w.timers.backing_off(KEY), "the scans leave it alone meanwhile"
    assert w.turn().after == 20.0
    assert w.turn().after == 30.0  # its own requeue time
    assert not w.timers.backing_off(KEY)
    assert w.turn().after == 10.0, "the streak starts again"


# ---- a gone VM ------------------------------------------------------------------------------


def test_a_gone_vm_releases_its_lock_and_is_forgotten() -> None:
    """Nothing is remembered about a VM that no longer exists: not its stuck streak, not
    its create failures (both grew without bound over a fleet's churn before)."""
    w = World(cached=False, on_server=False)
    w.timers.stuck(KEY)
    w.timers.create_failed(KEY)
    w.queue.add_rate_limited(KEY)
    assert w.turn(direct=True) == Outcome("gone")
    assert w.released == [KEY]
    assert w.timers.keys() == set()
    assert w.queue.failures(KEY) == 0
    assert w.reconciler.direct_first == [], "no reconcile of a gone VM"


def test_a_direct_read_that_finds_the_vm_gone_drops_its_cached_copy() -> None:
    w = World(cached=True, on_server=False)
    assert w.turn(direct=True) == Outcome("gone")
    assert w.cache.raw is None
    assert w.metrics.cache_evictions._value.get() == 1
