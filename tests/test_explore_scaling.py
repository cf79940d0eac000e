"""The scaling explorer (``neonvm/verify/scaling.py``): the shipped code keeps the order
and converges over every interleaving of its small world; each deliberate breakage of the
runner's fencing yields a counterexample."""

from __future__ import annotations

import pytest

from neonvm.verify.scaling import Mutants, ScalingModel, explore_scaling, initial_world


@pytest.mark.unit
@pytest.mark.slow
def test_every_interleaving_keeps_the_order_and_converges() -> None:
    # Two leaders (a failover; the deposed one never stops), stale reads (lag 2), a crash
    # mid-scale, a runner restart (pod replaced), the user scaling 1 -> 2 -> 1.
    report = explore_scaling()
    print(f"scaling explorer: {report.states} states, {report.transitions} transitions")
    assert report.violation is None, (report.violation, report.trace)
    assert report.complete and report.states > 1000


@pytest.mark.unit
def test_an_unfenced_runner_lets_a_deposed_leader_send_the_guest_back() -> None:
    # No runner restart here: the counterexample needs two leaders and nothing else.
    report = explore_scaling(initial_world(restarts=0), mutants=Mutants(unfenced_runner=True),
                             liveness=False)
    assert report.violation is not None and report.violation.property == "order", report
    assert any("failover" in step for step in report.trace), report.trace


@pytest.mark.unit
def test_a_new_pod_without_a_fence_floor_takes_a_plan_older_than_itself() -> None:
    report = explore_scaling(mutants=Mutants(no_floor=True), liveness=False)
    assert report.violation is not None and report.violation.property == "order", report
    assert any("runner restarts" in step for step in report.trace), report.trace
    assert explore_scaling(initial_world(restarts=0), mutants=Mutants(no_floor=True),
                           liveness=False).complete  # the floor only matters for new pods


@pytest.mark.unit
@pytest.mark.slow
def test_a_guest_that_refuses_unplugs_still_gets_the_newest_size_it_can_reach() -> None:
    # Every memory unplug answers 504 (fence recorded, memory kept) and stays pending: the
    # guest may finish it at any later step, refuse it (_OST 0x82: the DIMMs stay and
    # count as plugged again; a retry asks again), or do neither. The user goes 1/1 ->
    # 2/2 -> 1/1 (stuck) -> 2/2: the stuck plan is superseded (seq+1); the runner takes it
    # only once the guest has finished the pending unplug, then plugs the DIMM back. While
    # an unplug is pending or the newest size needs one, the newest plan is being tried.
    report = explore_scaling(initial_world(spec_changes=((2, 2), (1, 1), (2, 2)), restarts=0),
                             refuse_unplug=True)
    print(f"scaling explorer, unplugs refused: {report.states} states, "
          f"{report.transitions} transitions")
    assert report.violation is None, (report.violation, report.trace)
    assert report.complete and report.states > 1000


@pytest.mark.unit
def test_a_commit_of_the_spec_size_leaves_the_guest_at_its_boot_size_forever() -> None:
    # F1's mutant: the pod commit records the fresh spec, not what the pod was built with.
    report = explore_scaling(mutants=Mutants(commit_spec_size=True))
    assert report.violation is not None and report.violation.property == "convergence", report
    assert any("runner restarts" in step for step in report.trace), report.trace
    assert any("user sets" in step for step in report.trace), report.trace


@pytest.mark.unit
def test_a_plan_never_superseded_holds_the_vm_when_the_guest_refuses_an_unplug() -> None:
    # F2's mutant: a recorded plan waits to be committed or dropped before the next.
    report = explore_scaling(initial_world(spec_changes=((2, 2), (1, 1), (2, 2)), restarts=0),
                             refuse_unplug=True, mutants=Mutants(no_supersede=True),
                             max_states=20_000)
    assert report.violation is not None and report.violation.property == "convergence", report


@pytest.mark.unit
def test_an_unplug_still_pending_counted_as_plugged_lets_an_older_size_land_last() -> None:
    # Review S0's mutant: the runner forgets the unplug it started (504) and counts the
    # DIMM as plugged, so the plan asking for it back is answered at once; the guest then
    # finishes the older plan's eject after the newer plan's size.
    report = explore_scaling(initial_world(spec_changes=((2, 2), (1, 1), (2, 2)), restarts=0),
                             refuse_unplug=True,
                             mutants=Mutants(removal_counts_as_present=True), liveness=False)
    assert report.violation is not None and report.violation.property == "order", report
    assert report.trace[-1] == "the guest finishes the pending unplug", report.trace


@pytest.mark.unit
def test_the_guests_ost_answers_are_read_with_the_runners_rule() -> None:
    # The explorer's guest answers a pending eject through the shipped rule
    # (neonvm.runner.scaling.ost_refuses_eject): "in progress" changes nothing, "busy"
    # settles the removal with the DIMMs kept.
    model = ScalingModel(refuse_unplug=True)
    w = initial_world()
    w = w._replace(runner=w.runner._replace(guest=(1, 2), removing=(2, (1, 1), 0, 1)))
    assert model.ost(w, 0x84) is None
    refused = model.ost(w, 0x82)
    assert refused is not None and refused.runner.removing is None
    assert refused.runner.guest == (1, 2)
    misread = ScalingModel(refuse_unplug=True, mutants=Mutants(ost_misread=True)).ost(w, 0x84)
    assert misread is not None and misread.runner.removing == (2, (1, 1), 0, 1)
    assert not misread.runner.recorded and misread.runner.ejecting


@pytest.mark.unit
def test_a_refusal_misread_while_the_eject_is_in_flight_lets_an_older_size_land_last() -> None:
    # Review R1's rule as a mutant: the "eject in progress" _OST that Linux sends before
    # every eject is read as a refusal, so the runner settles the removal (the DIMM
    # counts as plugged) and takes the newer plan asking for it back; the guest then
    # finishes the older plan's eject.
    report = explore_scaling(initial_world(spec_changes=((2, 2), (1, 1), (2, 2)), restarts=0),
                             refuse_unplug=True, mutants=Mutants(ost_misread=True),
                             liveness=False)
    print(f"ost_misread: {report.states} states, {report.transitions} transitions, "
          f"{len(report.trace)} steps")
    assert report.violation is not None and report.violation.property == "order", report
    assert any("_OST 0x84" in step for step in report.trace), report.trace
    assert report.trace[-1] == "the guest finishes the pending unplug", report.trace


@pytest.mark.unit
def test_a_put_landing_after_its_plan_was_dropped_is_adopted_into_status() -> None:
    # Review S5: ApplyScale may be refused for good once (no token: the plan is dropped,
    # ScalingDisabled, no new plan for that spec) and a PUT may time out at its sender
    # while still on its way (it lands at any later step). Wherever the dropped plan's
    # PUT lands (a deposed leader's held one, a stale read's, the timed-out one), status
    # must come to say what the guest has.
    world = initial_world(restarts=0, crashes=0, refusals=1, timeouts=1)
    report = explore_scaling(world)
    print(f"scaling explorer, refusals and late PUTs: {report.states} states, "
          f"{report.transitions} transitions")
    assert report.violation is None, (report.violation, report.trace)
    assert report.complete and report.states > 1000
    # The same world without the adoption (review S5's code): status stays behind.
    broken = explore_scaling(world, mutants=Mutants(no_adoption=True))
    assert broken.violation is not None, broken
    assert broken.violation.property == "convergence", broken.violation
    assert any("refused for good" in step for step in broken.trace), broken.trace
    # One leader, no stale reads: the PUT that lands late is its own timed-out one.
    alone = world._replace(workers=world.workers[:1])
    late = explore_scaling(alone, lag=0, mutants=Mutants(no_adoption=True))
    print(f"no_adoption: {broken.states} states to the first violation, "
          f"{len(broken.trace)} steps; one leader: {late.states} states, "
          f"{len(late.trace)} steps: {late.trace}")
    assert late.violation is not None, late
    assert any("times out" in step for step in late.trace), late.trace
    assert any("a late PUT" in step for step in late.trace), late.trace


@pytest.mark.unit
@pytest.mark.slow
def test_a_guest_refusing_vcpu_and_memory_unplugs_still_gets_what_grows() -> None:
    # Review scalefix2 F2 in the model: vCPU unplugs are refused (pending) as well as
    # memory ones, and the user asks for 2/1, then 1/2 (the vCPUs shrink while the memory
    # grows), then 2/1. The runner converges what grows first and a refusal does not skip
    # the rest: every applied plan's growth reaches the guest ("growth"), besides order
    # and convergence.
    world = initial_world(spec_changes=((2, 1), (1, 2), (2, 1)), restarts=0)
    report = explore_scaling(world, refuse_unplug=True, refuse_cpu_unplug=True)
    print(f"scaling explorer, vCPU and memory unplugs refused: {report.states} states, "
          f"{report.transitions} transitions")
    assert report.violation is None, (report.violation, report.trace)
    assert report.complete and report.states > 1000
    # The order before F2 (vCPUs first, a refusal ends the request): 1/2 from 2/1 leaves
    # the memory at 1 slot while the vCPU unplug is pending.
    broken = explore_scaling(world, refuse_unplug=True, refuse_cpu_unplug=True,
                             mutants=Mutants(refusal_skips_rest=True), liveness=False)
    print(f"refusal_skips_rest: {broken.states} states, {len(broken.trace)} steps")
    assert broken.violation is not None and broken.violation.property == "growth", broken


@pytest.mark.unit
def test_the_look_after_a_drop_ends_only_with_a_write_decided_past_the_window() -> None:
    # Review MEDIUM 1 and 2: the look after a drop is recorded in status by the drop and
    # ended only by the write of a settled answer asked past the window. In the world of
    # refusals and late PUTs (the window closes once no PUT of the dropped plan is on its
    # way; calm runs take place past it), each way of ending it sooner leaves status
    # behind the guest with nobody looking.
    world = initial_world(restarts=0, crashes=0, refusals=1, timeouts=1)
    # The record cleared as the settled answer is seen, before the adopting write has
    # landed (MEDIUM 1's memory): the calm run's leader never performs the write it held.
    forgot = explore_scaling(world, mutants=Mutants(forget_before_write=True))
    assert forgot.violation is not None, forgot
    assert forgot.violation.property == "convergence", forgot.violation
    assert forgot.trace[-3:] == ["the late-PUT window closes", "w0 decides CommitScale",
                                 "(calm run)"], forgot.trace
    # A settled answer asked within the window taken for the last word: a late PUT lands
    # after it.
    early = explore_scaling(world, mutants=Mutants(end_in_window=True))
    assert early.violation is not None, early
    assert early.violation.property == "convergence", early.violation
    assert "w0 performs CommitScale" in early.trace, early.trace
    assert "the late-PUT window closes" not in early.trace, early.trace
    # No record at all (the window only: main's look for a new leader): a PUT that
    # lands, then the window closes before anyone looked. (The real window leaves one
    # periodic reconcile after the last landing; the model's window may close at once.)
    window_only = explore_scaling(world, mutants=Mutants(no_look_record=True))
    assert window_only.violation is not None, window_only
    assert window_only.violation.property == "convergence", window_only.violation
    # An adopt decided within the window (from an answer asked before a late PUT
    # landed) that lands after a write past the window ended the look.
    stale = explore_scaling(world, mutants=Mutants(stale_adopt_after_end=True))
    assert stale.violation is not None, stale
    assert stale.violation.property == "convergence", stale.violation
    closes = stale.trace.index("the late-PUT window closes")
    assert "w1 decides CommitScale" in stale.trace[:closes], stale.trace
    assert stale.trace[-2:] == ["w1 performs CommitScale", "(calm run)"], stale.trace
    print(f"stale_adopt_after_end: {stale.states} states, {len(stale.trace)} steps; "
          f"forget_before_write: {forgot.states} states, {len(forgot.trace)} steps; "
          f"end_in_window: {early.states} states, {len(early.trace)} steps; "
          f"no_look_record: {window_only.states} states, {len(window_only.trace)} steps")


LOOK_L1_WORLD = initial_world(restarts=0, crashes=0, refusals=1, timeouts=1, unanswered=1)
"""Refusals and late PUTs, and a runner that may once not answer ``GET /scale``: the
worker holds the Wait's Scaling=True condition write and performs it at any later step
on the VM as it is then (review lookfix L1)."""


@pytest.mark.unit
@pytest.mark.slow
def test_a_scaling_condition_written_after_a_drop_neither_ends_the_look_nor_lands() -> None:
    report = explore_scaling(LOOK_L1_WORLD)
    print(f"scaling explorer, refusals, late PUTs and a runner not answering: "
          f"{report.states} states, {report.transitions} transitions")
    assert report.violation is None, (report.violation, report.trace)
    assert report.complete and report.states > 1000


@pytest.mark.unit
def test_a_window_measured_from_the_scaling_condition_ends_the_look_before_a_late_put() -> None:
    # Review lookfix L1, the code before the fix: the Wait's Scaling=True lands over the
    # drop's condition with no plan recorded, and the window counts as passed once the
    # condition no longer says dropped: a settled answer asked before the dropped
    # plan's PUT lands ends the look.
    broken = explore_scaling(LOOK_L1_WORLD, mutants=Mutants(window_from_condition=True))
    print(f"window_from_condition: {broken.states} states, {len(broken.trace)} steps: "
          f"{broken.trace}")
    assert broken.violation is not None, broken
    assert broken.violation.property == "convergence", broken.violation
    wait = next(i for i, step in enumerate(broken.trace) if "performs ConditionsWrite" in step)
    refused = next(i for i, step in enumerate(broken.trace) if "refused for good" in step)
    assert refused < wait, broken.trace  # the condition write landed after the drop
    assert "the late-PUT window closes" not in broken.trace, broken.trace


REMOVAL_AFTER_REFUSAL_WORLD = initial_world(restarts=0, crashes=0, refusals=1, timeouts=1)
"""Refusals and late PUTs, with memory unplugs left pending by the guest
(``refuse_unplug``): a plan refused for its spec may leave a DIMM leaving."""


@pytest.mark.unit
@pytest.mark.slow
def test_a_refusal_with_an_unplug_pending_keeps_looking_until_the_guest_settles() -> None:
    report = explore_scaling(REMOVAL_AFTER_REFUSAL_WORLD, refuse_unplug=True)
    print(f"scaling explorer, refusals, late PUTs, unplugs pending: {report.states} "
          f"states, {report.transitions} transitions")
    assert report.violation is None, (report.violation, report.trace)
    assert report.complete and report.states > 1000


@pytest.mark.unit
def test_a_look_ended_with_a_removal_pending_leaves_status_behind_the_eject() -> None:
    # Review lookfix L6: without the pending-removal check, a settled-looking answer
    # with a DIMM still leaving ends the look; the guest ejects it later, unseen.
    broken = explore_scaling(REMOVAL_AFTER_REFUSAL_WORLD, refuse_unplug=True,
                             mutants=Mutants(end_with_removal_pending=True))
    print(f"end_with_removal_pending: {broken.states} states, {len(broken.trace)} steps: "
          f"{broken.trace}")
    assert broken.violation is not None, broken
    assert broken.violation.property == "convergence", broken.violation
    assert "unplug still pending" in broken.violation.message, broken.violation
