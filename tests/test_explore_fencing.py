"""The self-fencing explorer (``neonvm/verify/fencing.py``): the right to run and the
force-delete keep at most one running guest over every interleaving of a partition, a
heal, a failover and drifting clocks; each deliberate breakage of the margin, the
runner's kill, the ledger (a condemn mark kept past its term among them), the runner's
clock, or the write before a term's first grant (skipped for a runner not started, or
counted from a grant that wrote nothing) yields two running guests; the two gaps
docs/protocol.md names ("Self-fencing", "What is not covered") are found."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from neonvm.api import rights as contract
from neonvm.controller import rights
from neonvm.verify.fencing import (
    FREEZES,
    SCENARIOS,
    SHIPPED_SAFE,
    FencingConfig,
    Mutants,
    Timing,
    explore_fencing,
)

SHIPPED = FencingConfig()


def caught(mutant: str, scenario: str) -> list[str]:
    """The trace of the first violation of ``mutant`` in ``scenario`` (asserted found)."""
    cfg = FencingConfig(mutants=Mutants(**{mutant: True}))
    report = explore_fencing(scenario, cfg, liveness=False)
    assert report.violation is not None, f"{mutant} not caught in {report.states} states"
    assert report.violation.property == "at-most-one-running-guest", report.violation
    return report.trace


# ---- the design as shipped --------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("scenario", SHIPPED_SAFE)
def test_the_shipped_rules_never_run_two_guests_and_always_recover(scenario: str) -> None:
    report = explore_fencing(scenario, SHIPPED)
    print(f"{scenario}: {report.states} states, {report.transitions} transitions")
    assert report.violation is None, (report.violation, report.trace)
    assert report.complete and report.states > 500


# ---- mutants ---------------------------------------------------------------------------


@pytest.mark.unit
def test_replacing_at_the_deadline_without_the_margin_runs_two_guests() -> None:
    # (a) max(issued, term_start) + D: the runner's clock runs slow, the guest lives on.
    trace = caught("no_margin", "fence-partition")
    assert any("condemn P" in s for s in trace) and trace[-1].startswith("leader grants Q")


@pytest.mark.unit
def test_the_clock_rate_term_is_needed_only_because_clocks_drift() -> None:
    trace = caught("no_rho", "fence-partition")
    assert any("P's clock +2" in s for s in trace), "caught through a slow runner clock"
    # No runner clock slower than the leader's (a faster one only kills early): the same
    # mutant is safe.
    never_slow = Timing(runner_rates=(3, 4))
    report = explore_fencing("fence-partition", FencingConfig(
        timing=never_slow, mutants=Mutants(no_rho=True)), liveness=False)
    assert report.complete and report.violation is None


@pytest.mark.unit
def test_the_margin_without_slack_for_the_kill_runs_two_guests() -> None:
    trace = caught("no_epsilon", "fence-partition")
    assert not any("watchdog" in s for s in trace), "the guest outlived its deadline"


@pytest.mark.unit
def test_a_runner_that_forgets_to_kill_runs_beside_its_replacement() -> None:
    # (b)
    trace = caught("forget_kill", "fence-partition")
    assert any("cut off" in s for s in trace)


@pytest.mark.unit
def test_a_grant_between_condemns_test_and_its_mark_starts_a_guest_beside_the_replacement(
        ) -> None:
    # (c) Only a runner that has not started its guest yet can use it: a running guest
    # is dead by the time the test passes, and a killed guest never starts again.
    trace = caught("test_then_mark", "fence-fresh")
    test = next(i for i, s in enumerate(trace) if "test passes" in s)
    grant = next(i for i, s in enumerate(trace) if "grants P" in s)
    assert test < grant and any("QEMU starts" in s for s in trace[grant:])
    for scenario in ("fence-partition", "fence-failover"):
        report = explore_fencing(scenario, FencingConfig(mutants=Mutants(test_then_mark=True)),
                                 liveness=False)
        assert report.complete and report.violation is None, scenario


@pytest.mark.unit
def test_ignoring_term_start_after_a_leader_change_runs_two_guests() -> None:
    # (d) The new term never granted P, so it takes P for dead at once.
    trace = caught("ignore_term_start", "fence-failover")
    begins = next(i for i, s in enumerate(trace) if "term 2 begins" in s)
    assert any("condemn P" in s for s in trace[begins:])
    assert not any("term 2): records" in s for s in trace)


@pytest.mark.unit
def test_a_runner_that_counts_from_the_answer_outlives_the_margin() -> None:
    # (e)
    trace = caught("deadline_from_answer", "fence-partition")
    ask = next(i for i, s in enumerate(trace) if "asks" in s)
    take = next(i for i, s in enumerate(trace) if "takes the grant" in s)
    assert any(s.startswith("tick") for s in trace[ask:take]), "the answer came late"


@pytest.mark.unit
def test_a_ledger_that_answers_before_it_records_lets_the_test_miss_a_grant() -> None:
    # (f)
    trace = caught("answer_before_record", "fence-partition")
    assert any("not yet recorded" in s for s in trace)


@pytest.mark.unit
def test_the_explorer_runs_the_shipped_ledger_and_catches_a_margin_taken_out_of_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader in the model is the shipped RightsLedger: a ledger whose margin forgets
    rho and epsilon (as the contract's function would compute it with both at 0) is
    caught without any model switch."""
    def no_margin(issued: float, term_start: float, seconds: float, rho: float = 0.0,
                  epsilon: float = 0.0) -> float:
        return contract.dead_for_sure_after(issued, term_start, seconds, 0.0, 0.0)

    monkeypatch.setattr(rights, "dead_for_sure_after", no_margin)
    report = explore_fencing("fence-partition", SHIPPED, liveness=False)
    assert report.violation is not None
    assert report.violation.property == "at-most-one-running-guest"


# ---- a mark must not outlive its term (each process keeps one ledger for life) ----------


STAMPED = dataclasses.replace(SHIPPED, stamp_first_grant=True)


def caught_stamped(mutant: str, scenario: str) -> list[str]:
    """:func:`caught`, with the write before a term's first grant on (as shipped)."""
    cfg = dataclasses.replace(STAMPED, mutants=Mutants(**{mutant: True}))
    report = explore_fencing(scenario, cfg, liveness=False)
    assert report.violation is not None, f"{mutant} not caught in {report.states} states"
    assert report.violation.property == "at-most-one-running-guest", report.violation
    return report.trace


@pytest.mark.unit
def test_terms_of_two_processes_that_keep_their_ledgers_never_run_two_guests() -> None:
    report = explore_fencing("fence-fresh-flap", STAMPED)
    print(f"fence-fresh-flap: {report.states} states, {report.transitions} transitions")
    assert report.violation is None, (report.violation, report.trace)
    assert report.complete and report.states > 500


def _mark_kept_then_delete(trace: list[str]) -> None:
    condemned = next(i for i, s in enumerate(trace) if "term 1): condemn P" in s)
    started = next(i for i, s in enumerate(trace) if "QEMU starts" in s)
    kept = next(i for i, s in enumerate(trace) if "term 3 begins" in s and "kept" in s)
    resent = next(i for i, s in enumerate(trace) if "term 3): P condemned" in s)
    assert condemned < started < kept < resent, trace


@pytest.mark.unit
def test_a_mark_kept_into_the_processs_next_term_kills_a_pod_another_leader_granted() -> None:
    # (g) A condemns fresh P in term 1, its DELETE misses (409: B wrote P before granting
    # it in term 2), and A, leading again in term 3, deletes P on its old mark while P's
    # guest runs on B's right.
    cfg = dataclasses.replace(STAMPED, mutants=Mutants(marks_outlive_term=True))
    report = explore_fencing("fence-fresh-flap", cfg, liveness=False)
    assert report.violation is not None
    assert report.violation.property == "at-most-one-running-guest"
    _mark_kept_then_delete(report.trace)


@pytest.mark.unit
def test_the_explorer_catches_a_shipped_ledger_that_keeps_its_marks_across_terms(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No model switch: the ledger's own ``begin_term`` is asked whether marks survive."""
    begin_term = rights.RightsLedger.begin_term

    def keeping(self: rights.RightsLedger, active: Callable[[], bool]) -> float:
        kept = {uid for uid in ("p-uid",) if self.is_condemned(uid)}
        start = begin_term(self, active)
        self._condemned |= kept
        return start

    monkeypatch.setattr(rights.RightsLedger, "begin_term", keeping)
    report = explore_fencing("fence-fresh-flap", STAMPED, liveness=False)
    assert report.violation is not None
    _mark_kept_then_delete(report.trace)


# ---- the write only for a runner that has not started its guest ------------------------


@pytest.mark.unit
def test_writing_the_pod_only_for_runners_not_started_never_runs_two_guests() -> None:
    """The shipped rule (an ask that says its guest has started is granted without the
    write) over a running guest's failover; ``fence-fresh-failover`` and
    ``fence-fresh-flap`` (above and below) run it with a fresh runner."""
    assert STAMPED.skip_mark_when_started
    report = explore_fencing("fence-failover", STAMPED)
    print(f"fence-failover, stamped: {report.states} states, {report.transitions} "
          "transitions")
    assert report.complete and report.violation is None, (report.violation, report.trace)


@pytest.mark.long
@pytest.mark.unit
def test_someone_else_saying_started_for_a_fresh_runner_never_runs_two_guests() -> None:
    """Opt-in (NEONVM_TEST_LONG=1; 40,727 states, about 2 s): whoever holds the pod's
    credential may say started; the grant it gets writes nothing, and is not the term's
    write, so the runner's own first ask is still written first."""
    report = explore_fencing("fence-fresh-forged", STAMPED, liveness=False)
    print(f"fence-fresh-forged: {report.states} states, {report.transitions} transitions")
    assert report.complete and report.violation is None, (report.violation, report.trace)


def _granted_unwritten_then_delete_lands(trace: list[str]) -> None:
    sent = next(i for i, s in enumerate(trace) if "term 1): condemn P" in s)
    unwritten = next(i for i, s in enumerate(trace) if "term 2): records" in s)
    started = next(i for i, s in enumerate(trace) if "QEMU starts" in s)
    lands = next(i for i, s in enumerate(trace) if "DELETE of P (term 1) lands" in s)
    assert sent < unwritten < started < lands, trace
    assert not any("writes P" in s for s in trace), trace


@pytest.mark.unit
def test_a_leader_that_skips_the_write_whatever_the_ask_says_runs_two_guests() -> None:
    # (h) A fresh runner granted by term 2 without a write: term 1's DELETE lands after.
    trace = caught_stamped("skip_mark_always", "fence-fresh-failover")
    _granted_unwritten_then_delete_lands(trace)


@pytest.mark.unit
def test_a_runner_that_says_started_before_it_started_runs_two_guests() -> None:
    # (i)
    trace = caught_stamped("started_early", "fence-fresh-failover")
    _granted_unwritten_then_delete_lands(trace)
    assert "says its guest has started" in trace[0]


@pytest.mark.unit
def test_a_grant_without_a_write_taken_for_the_terms_write_runs_two_guests() -> None:
    # (j) Someone else says started for P; the leader then counts P as written.
    trace = caught_stamped("grant_is_mark", "fence-fresh-forged")
    forged = next(i for i, s in enumerate(trace) if "not its runner" in s)
    _granted_unwritten_then_delete_lands(trace[:forged] + trace[forged + 1:])


# ---- the gaps docs/protocol.md names ---------------------------------------------------


@pytest.mark.unit
def test_a_deposed_terms_delete_in_flight_meets_a_fresh_runner_granted_by_the_next_term(
        ) -> None:
    report = explore_fencing("fence-fresh-failover", SHIPPED, liveness=False)
    assert report.violation is not None, report.states
    trace = report.trace
    sent = next(i for i, s in enumerate(trace) if "term 1): condemn P" in s)
    begins = next(i for i, s in enumerate(trace) if "term 2 begins" in s)
    started = next(i for i, s in enumerate(trace) if "QEMU starts" in s)
    lands = next(i for i, s in enumerate(trace) if "DELETE of P (term 1) lands" in s)
    assert sent < begins < started < lands, trace
    # Writing the pod before a term's first grant to a runner not started, and deleting
    # with its resourceVersion, closes it (shipped: STAMPED).
    fixed = explore_fencing("fence-fresh-failover", dataclasses.replace(
        SHIPPED, stamp_first_grant=True))
    print(f"fence-fresh-failover, stamped: {fixed.states} states")
    assert fixed.complete and fixed.violation is None, (fixed.violation, fixed.trace)


@pytest.mark.unit
def test_a_deposed_leader_that_grants_after_its_term_defeats_term_start() -> None:
    report = explore_fencing("fence-frozen-leader", SHIPPED, liveness=False)
    assert report.violation is not None
    assert any("wakes from a freeze" in s for s in report.trace)


@pytest.mark.unit
def test_a_node_stopped_and_thawed_runs_the_old_guest_only_until_the_watchdog_wakes() -> None:
    # SIGSTOP of the whole node: the runner's clock runs on, so on the thaw its watchdog
    # finds the deadline passed and kills before time moves on. The two guests overlap
    # for that moment only (the strict count sees it).
    report = explore_fencing("fence-freeze")
    print(f"fence-freeze: {report.states} states, {report.transitions} transitions")
    assert report.complete and report.violation is None, (report.violation, report.trace)
    strict = explore_fencing("fence-freeze", moment=False, liveness=False)
    assert strict.violation is not None
    assert any("thaws: the watchdog finds the deadline passed" in s for s in strict.trace)


@pytest.mark.unit
def test_a_node_whose_clock_stopped_runs_the_old_guest_on_after_it_resumes() -> None:
    # A suspend the monotonic clock does not count breaks the rate bound: after the
    # resume the watchdog sees the deadline still ahead.
    report = explore_fencing("fence-suspend", liveness=False)
    assert report.violation is not None
    assert report.violation.property == "two-guests-past-a-moment"
    assert any("P's clock +0" in s for s in report.trace)


@pytest.mark.unit
def test_every_scenario_is_described() -> None:
    assert set(SHIPPED_SAFE) | set(FREEZES) < set(SCENARIOS)
    assert all(text for text, _fresh, _budget in SCENARIOS.values())
