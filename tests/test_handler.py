"""The handler's contract: what each end of a key's turn comes to, and what the queue does.

Specifications of :mod:`neonvm.controller.handler` over fakes (pure: no servers). The
real-server tests (``test_reconcile*.py``, ``test_fence_integrity.py``) run the same
handler inside a leader term.
"""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from neonvm.controller import actions as act
from neonvm.controller.authority import AuthorityLost, RetryableError, WrongVM
from neonvm.controller.handler import Outcome, outcome_of_error
from neonvm.controller.mutations import FencedOut
from neonvm.controller.reconciler import ReconcileResult
from neonvm.controller.update import ConflictRetriesExhausted
from neonvm.leader.election import LeadershipLost
from neonvm.leader.etcd import EtcdError
from neonvm.leader.lock import LockHeld, LockInfo, LockLost, SessionLost
from tests.support.handler import KEY, World

pytestmark = pytest.mark.unit


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
