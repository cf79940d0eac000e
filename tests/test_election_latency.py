"""The election under a slow API server: what latency a term survives, and that a term
it does not survive still ends before anyone may take the Lease.

Over the in-memory Lease store of ``tests/support/election.py`` and a simulated
clock: every call the elector makes off its own thread (the acquisition, renewals,
re-reads, the epoch claim) completes ``latency`` simulated seconds after it was sent, and
the elector's waits (``stop.wait``) are what moves the clock. Nothing here depends on
how fast the machine is, and no assertion is about wall-clock time.

The rule under test (``docs/leader-election.md``, "Renewals in flight"): renewals go out
every retry period by send time, each conditional on the holder and epoch rather than
on the previous answer, and a term ends when no renewal succeeded within
``retry_period + renew_deadline`` of the send of the last one that did. So a term lasts
as long as every renewal answers within the renew deadline, and ends, at the latest,
``retry_period + renew_deadline`` (< ``lease_duration``) after the send of the last write
of it that the server applied.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from neonvm.leader.election import ElectionConfig, EndReason, LeaderElector, Leadership
from neonvm.leader.lease_store import LeaseRecord
from tests.support.election import FakeLeaseStore

pytestmark = pytest.mark.unit

LEASE, RENEW, RETRY = 4.0, 2.5, 0.5  # the chart's defaults
RUN_FOR = 120.0  # simulated seconds of leading per case


@dataclass
class SimulatedTime:
    """A clock that only moves when the elector waits, and calls that answer after
    ``latency(now)`` simulated seconds (the store applies the write at that moment)."""

    latency: Callable[[float], float]
    now: float = 1000.0
    stop_at: float = float("inf")
    calls: list[tuple[float, int, Callable[[], None]]] = field(default_factory=list)
    order: itertools.count[int] = field(default_factory=itertools.count)

    def clock(self) -> float:
        return self.now

    def spawn(self, fn: Callable[[], None]) -> None:
        heapq.heappush(self.calls, (self.now + self.latency(self.now), next(self.order), fn))

    def advance(self, seconds: float) -> None:
        target = self.now + seconds
        while self.calls and self.calls[0][0] <= target:
            due, _, fn = heapq.heappop(self.calls)
            self.now = max(self.now, due)
            fn()
        self.now = target


class SimulatedStop(threading.Event):
    """``stop`` whose ``wait`` is simulated time passing; it sets itself at ``stop_at``."""

    def __init__(self, time: SimulatedTime) -> None:
        super().__init__()
        self.time = time

    def wait(self, timeout: float | None = None) -> bool:
        if not self.is_set():
            self.time.advance(timeout if timeout is not None else 1.0)
            if self.time.now >= self.time.stop_at:
                self.set()
        return self.is_set()


class RecordingStore(FakeLeaseStore):
    """Remembers the earliest instant at which each applied write of ours may have been
    applied: its send time (answer time minus the latency)."""

    def __init__(self, time: SimulatedTime) -> None:
        super().__init__()
        self.time = time
        self.applied_sends: list[float] = []

    def _applied(self, record: LeaseRecord) -> LeaseRecord:
        now = self.time.now
        # The call runs at its answer time; it was sent latency earlier at the latest
        # (the latency at send time is what the simulation used).
        self.applied_sends.append(min(now, now - self._latency_before(now)))
        return record

    def _latency_before(self, now: float) -> float:
        # Constant or stepwise latencies: the latency in force just before ``now`` is what
        # delayed this call, a conservative (earlier) send estimate either way.
        return min(self.time.latency(now - 1e-9), self.time.latency(now))

    def create(self, spec: dict[str, Any], timeout: float) -> LeaseRecord:
        return self._applied(super().create(spec, timeout))

    def update(self, base: LeaseRecord, spec: dict[str, Any], timeout: float, *,
               drop_step_down: bool = False) -> LeaseRecord:
        return self._applied(super().update(base, spec, timeout, drop_step_down=drop_step_down))

    def renew(self, base: LeaseRecord, spec: dict[str, Any], timeout: float, *,
              drop_step_down: bool = False) -> LeaseRecord:
        return self._applied(super().renew(base, spec, timeout, drop_step_down=drop_step_down))


@dataclass
class Outcome:
    reason: EndReason | None
    started: list[Leadership]
    lost_at: float | None
    valid_until: float | None
    store: RecordingStore
    elector: LeaderElector


def lead_under(latency: Callable[[float], float], run_for: float = RUN_FOR,
               **config: float) -> Outcome:
    """Campaign once on an empty store and lead, under ``latency``, until the term ends or
    ``run_for`` simulated seconds passed (then ``stop`` ends it)."""
    time = SimulatedTime(latency)
    time.stop_at = time.now + run_for
    store = RecordingStore(time)
    started: list[Leadership] = []
    settings: dict[str, Any] = {"lease_duration": LEASE, "renew_deadline": RENEW,
                                "retry_period": RETRY, **config}
    elector = LeaderElector(
        store, ElectionConfig(namespace="ns", name="l", identity="me_1", **settings),
        started.append, lambda: None, clock=time.clock, watch=False,
        spawn=time.spawn)
    stop = SimulatedStop(time)
    term = elector._try_acquire(stop)
    if term is None:
        return Outcome(None, started, None, None, store, elector)
    reason = elector._lead(term, stop)
    lost_at = time.now
    valid_until = started[0].valid_until if started else None
    return Outcome(reason, started, lost_at, valid_until, store, elector)


def steady(seconds: float) -> Callable[[float], float]:
    return lambda _now: seconds


# ---- below the renew deadline: the term lasts --------------------------------------------


@pytest.mark.parametrize("latency", [0.5, 1.0, 1.05, 1.5, 2.0, 2.4])
def test_at_a_steady_latency_below_the_renew_deadline_no_term_ends(latency: float) -> None:
    """Every call (the acquisition too) takes ``latency``; the term lasts until stopped.
    1.05 s is where the old loop flapped: it waited for each answer, then a retry period,
    so two renewals had to fit in the renew deadline."""
    out = lead_under(steady(latency))
    assert out.started, "the acquisition became a term"
    assert out.reason is EndReason.STOP, f"the term ended ({out.reason}) at {latency} s"
    assert out.elector.registry.get_sample_value("neonvm_leader_renew_failures_total") == 0


def test_a_renewal_may_take_the_whole_renew_deadline_less_the_loops_own_slack() -> None:
    """2.45 s of 2.5: the loop looks at answers every 50 ms, its only slack."""
    out = lead_under(steady(RENEW - 0.05))
    assert out.reason is EndReason.STOP


@pytest.mark.parametrize("latency", [0.2, 1.0, 2.0])
def test_the_tests_timings_survive_latency_below_their_renew_deadline(latency: float) -> None:
    out = lead_under(steady(latency), lease_duration=3.0, renew_deadline=2.0,
                     retry_period=0.5)
    assert out.reason is EndReason.STOP


def test_a_spike_shorter_than_the_renew_deadline_is_ridden_out() -> None:
    """Normal service, then 2.3 s for five seconds, then normal again."""
    start = 1000.0

    def spike(now: float) -> float:
        return 2.3 if start + 30 <= now < start + 35 else 0.05

    out = lead_under(spike, run_for=60)
    assert out.reason is EndReason.STOP


# ---- above it: the term ends, and before the Lease can be taken ---------------------------


def ended_in_time(out: Outcome) -> None:
    """The safety property: the leader's belief ended before any follower may take over.

    A follower takes over no earlier than ``lease_duration`` after it first saw the last
    version we wrote, which is after that write was applied, which is after it was sent.
    """
    assert out.valid_until is not None and out.store.applied_sends
    takeover_earliest = max(out.store.applied_sends) + LEASE
    assert out.valid_until < takeover_earliest
    assert out.valid_until <= max(out.store.applied_sends) + RETRY + RENEW


@pytest.mark.parametrize("latency", [2.6, 3.0, 5.0])
def test_when_latency_rises_above_the_renew_deadline_the_term_ends_before_the_lease_can_expire(
        latency: float) -> None:
    start = 1000.0

    def rising(now: float) -> float:
        return latency if now >= start + 20 else 0.3

    out = lead_under(rising)
    assert out.started
    assert out.reason is EndReason.DEADLINE
    assert out.started[0].lost.is_set()
    ended_in_time(out)


def test_a_term_whose_answers_never_come_back_ends_in_time() -> None:
    """Writes still apply (the server is fine) but every answer is lost: the followers'
    clocks restart at each applied renewal; the leader's belief ran from the last answer
    it got, so it ends first."""
    start = 1000.0

    def answers_lost(now: float) -> float:
        return 60.0 if now >= start + 10 else 0.1

    out = lead_under(answers_lost)
    assert out.reason is EndReason.DEADLINE
    ended_in_time(out)


def test_at_a_latency_above_the_window_no_term_starts() -> None:
    """3.5 s per call: the acquisition's own answer comes after its window (3 s) ended,
    and no renewal can answer in time either: never a term that could outlive the lease."""
    out = lead_under(steady(3.5))
    assert out.started == []


# ---- the rule is checked at construction -----------------------------------------------


def test_the_lease_must_outlast_a_renewal_sent_a_retry_period_late_plus_its_whole_deadline(
        ) -> None:
    with pytest.raises(ValueError, match=r"must be greater than renew_deadline \(3.5s\) "
                                         r"\+ retry_period \(0.5s\)"):
        ElectionConfig(lease_duration=4.0, renew_deadline=3.5, retry_period=0.5)
    assert ElectionConfig(lease_duration=4.0, renew_deadline=2.5, retry_period=0.5).belief \
        == pytest.approx(3.0)
