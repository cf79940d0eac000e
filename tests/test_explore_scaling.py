"""The scaling explorer (``neonvm/verify/scaling.py``): the shipped code keeps the order
and converges over every interleaving of its small world; each deliberate breakage of the
runner's fencing yields a counterexample."""

from __future__ import annotations

import pytest

from neonvm.controller import decide
from neonvm.controller.actions import Fence
from neonvm.verify.scaling import (
    Mutants,
    ScalingModel,
    ScalingReport,
    World,
    explore_scaling,
    frac,
    initial_world,
)


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


# ---- the pod's fenced writes (issue 31: a fraction of cpus.use is a plan too) ------------
#
# With pod_writes the explorer also models what RunnerScaling._tell_kubernetes does after
# an ApplyScale the runner answered 200 (or, with no token recorded, in place of the PUT
# of a fraction-only plan): the pod's GET, the PATCH of its usage/resources annotations
# and scale-fence, and the in-place resize of its CPU request, each a step of its own
# that any other step may interleave with (a failover, a deposed leader, a crash, a
# retry, the kubelet changing the pod). The spec and status carry cpus.use in millicores.


def _one_leader(world: World) -> World:
    return world._replace(workers=world.workers[:1])


@pytest.mark.unit
def test_the_explorers_pods_are_the_shipped_pod_specs() -> None:
    # Annotations, CPU request and QoS class come from podspec.runner_pod: a pod built at
    # 500m says 500m and is Burstable; one built at cpus.max (2 vCPUs) is Guaranteed (its
    # request equals its limit), which the tell never resizes.
    world = initial_world(cpus=500, token=True)
    assert (world.runner.ann, world.runner.req, world.runner.guaranteed) == (
        (500, 1, 1), (500, 1), False)
    model = ScalingModel(pod_writes=True)
    _, runner, created = model._replaced(world.vm._replace(use=(2, 2), use_milli=0),
                                         Fence(1, 10))
    assert (runner.ann[:2], runner.req[0], runner.guaranteed) == ((2000, 2), 2000, True)
    assert created[2:] == ((2, 2), 2000)


FRACTIONS = (frac(500, 1), frac(750, 1))
"""The user changes cpus.use within the one vCPU the guest has: 1000m -> 500m -> 750m."""
FRACTION_WORLD = _one_leader(initial_world(FRACTIONS, token=True))
"""One leader, stale reads, a crash, a runner restart; cpus.use 1000m -> 500m -> 750m."""


@pytest.mark.unit
def test_a_fraction_reaches_status_only_with_the_plan_that_wrote_it_on_the_pod() -> None:
    # Order (no annotation or CPU request from an older spec after a newer one),
    # claims (status.cpus never newly says a fraction the pod's annotations do not
    # carry) and pod convergence (the calm run brings status.cpus, the annotations and
    # the CPU request to cpus.use, and goes quiet), with a crash anywhere in the tell,
    # a replaced pod, with and without a scaling token (without: the fenced annotation
    # write alone, no PUT), and with the kubelet changing the pod under the writes
    # (409s, read again).
    for world in (FRACTION_WORLD, FRACTION_WORLD._replace(vm=FRACTION_WORLD.vm._replace(
            token=False)), FRACTION_WORLD._replace(bumps_left=1)):
        report = explore_scaling(world, pod_writes=True)
        print(f"fractions, token={world.vm.token}, bumps={world.bumps_left}: "
              f"{report.states} states, {report.transitions} transitions")
        assert report.violation is None, (report.violation, report.trace)
        assert report.complete and report.states > 1000


@pytest.mark.unit
def test_with_no_fault_the_pod_and_status_follow_every_fraction() -> None:
    # One leader, no crash, no replaced pod, the kubelet changing the pod twice: the
    # calm run also brings the pod's annotations and CPU request to the spec's use.
    world = _one_leader(initial_world(FRACTIONS, token=True, restarts=0, crashes=0, bumps=2))
    report = explore_scaling(world, pod_writes=True)
    print(f"fractions, no fault: {report.states} states, {report.transitions} transitions")
    assert report.violation is None, (report.violation, report.trace)
    assert report.complete


@pytest.mark.unit
def test_two_leaders_and_whole_sizes_write_the_pod_in_plan_order() -> None:
    # The first world's failover, deposed leader and crash (no restart), with the pod's
    # writes: a deposed leader's tell of plan #1 never lands over plan #2's, and the
    # pod's record ends at the spec.
    report = explore_scaling(initial_world(restarts=0, token=True), pod_writes=True)
    print(f"two leaders, pod writes: {report.states} states, {report.transitions} "
          f"transitions")
    assert report.violation is None, (report.violation, report.trace)
    assert report.complete and report.states > 1000


POD_WORLD = initial_world(restarts=0, token=True)


@pytest.mark.unit
def test_an_annotation_write_without_the_scale_fence_puts_an_older_plan_back() -> None:
    report = explore_scaling(POD_WORLD, pod_writes=True, liveness=False,
                             mutants=Mutants(unfenced_annotation=True))
    print(f"unfenced_annotation: {report.states} states, {len(report.trace)} steps: "
          f"{report.trace}")
    assert report.violation is not None and report.violation.property == "order", report
    assert "annotations got (2000, 2)" in report.violation.message, report.violation
    patched = report.trace.index("w1 performs TellKubernetes (patch of plan #2)")
    assert report.trace[patched + 1:] == ["w0 performs TellKubernetes (read of plan #1)",
                                          "w0 performs TellKubernetes (patch of plan #1)"]


@pytest.mark.unit
def test_an_annotation_write_without_the_resource_version_lands_over_a_newer_one() -> None:
    report = explore_scaling(POD_WORLD, pod_writes=True, liveness=False,
                             mutants=Mutants(no_resource_version=True))
    print(f"no_resource_version: {report.states} states, {len(report.trace)} steps: "
          f"{report.trace}")
    assert report.violation is not None and report.violation.property == "order", report
    read = report.trace.index("w0 performs TellKubernetes (read of plan #1)")
    patched = report.trace.index("w1 performs TellKubernetes (patch of plan #2)")
    assert read < patched, report.trace  # read before plan #2's write, patched after
    assert report.trace[-1] == "w0 performs TellKubernetes (patch of plan #1)"


@pytest.mark.unit
def test_a_commit_without_the_generation_check_claims_a_fraction_never_written() -> None:
    report = explore_scaling(FRACTION_WORLD, pod_writes=True, liveness=False,
                             mutants=Mutants(commit_any_generation=True))
    print(f"commit_any_generation: {report.states} states, {len(report.trace)} steps: "
          f"{report.trace}")
    assert report.violation is not None and report.violation.property == "claims", report
    assert "says 750m" in report.violation.message, report.violation
    assert report.trace[-2:] == ["user sets use (750m, 1)", "w0 performs CommitScale"]


@pytest.mark.unit
def test_a_commit_that_ignores_the_pods_scale_fence_claims_a_lost_write() -> None:
    report = explore_scaling(FRACTION_WORLD, pod_writes=True, liveness=False,
                             mutants=Mutants(commit_pod_behind=True))
    print(f"commit_pod_behind: {report.states} states, {len(report.trace)} steps: "
          f"{report.trace}")
    assert report.violation is not None and report.violation.property == "claims", report
    assert "w0 crashes" in report.trace, report.trace


@pytest.mark.unit
def test_a_fraction_copied_into_status_outside_a_plan_is_never_on_the_pod() -> None:
    # The code before 67ae728: status followed a cpus.use changed within its vCPUs.
    report = explore_scaling(FRACTION_WORLD, pod_writes=True, liveness=False,
                             mutants=Mutants(fraction_outside_plan=True))
    print(f"fraction_outside_plan: {report.states} states, {report.trace}")
    assert report.violation is not None and report.violation.property == "claims", report
    assert report.trace == ["user sets use (500m, 1)", "w0 decides FollowFraction",
                            "w0 performs FollowFraction"]


# The explorer's four findings (docs/verification.md, "The pod's fenced writes"): each
# test states the property the shipped code now keeps, and the code before its fix as a
# mutant breaks it.


def _holds(report: ScalingReport, prop: str) -> None:
    """Assert no violation (``prop``: the property the code before the fix broke)."""
    print(f"{report.states} states: {report.violation}: {report.trace}")
    assert report.violation is None, (prop, report.violation, report.trace)
    assert report.complete, report


def _breaks(report: ScalingReport, prop: str) -> list[str]:
    """Assert that ``report`` found a violation of ``prop``; its trace."""
    print(f"{report.states} states, {len(report.trace)} steps: {report.trace}")
    assert report.violation is not None and report.violation.property == prop, report
    return report.trace


BACK_TO_WHOLE = _one_leader(initial_world((frac(500, 1), frac(1000, 1)), token=True,
                                          restarts=0, crashes=0))
"""One leader, no fault: cpus.use 1000m -> 500m -> 1000m (bug 1)."""


@pytest.mark.unit
def test_a_fraction_that_returns_to_whole_vcpus_leaves_no_older_fraction_on_the_pod() -> None:
    # Bug 1: the tell of a plan decided at 500m lands after cpus.use went back to 1000m;
    # the commit records whole vCPUs, which equal the spec. The pod's annotations (500m)
    # are not the spec's: decide plans again (decide.pod_behind).
    _holds(explore_scaling(BACK_TO_WHOLE, pod_writes=True), "pod-convergence")
    trace = _breaks(explore_scaling(BACK_TO_WHOLE, pod_writes=True,
                                    mutants=Mutants(pod_record_ignored=True)),
                    "pod-convergence")
    assert trace[-2] == "user sets use (1, 1)", trace  # 1000m, after the PUT of 500m


@pytest.mark.unit
def test_a_lost_tell_of_whole_vcpus_is_written_again() -> None:
    # Bug 2: a leader that dies between the PUT and the annotation write of a
    # whole-vCPU plan: the commit records whole vCPUs, which equal the spec; the pod's
    # annotations still say the old size, so decide plans again.
    world = initial_world(restarts=0, crashes=0, token=True)
    _holds(explore_scaling(world, pod_writes=True), "pod-convergence")
    _breaks(explore_scaling(world, pod_writes=True,
                            mutants=Mutants(pod_record_ignored=True)), "pod-convergence")


@pytest.mark.unit
def test_a_lost_resize_is_done_again() -> None:
    # Bug 3: a crash between the annotation write and the resize: the pod carries the
    # plan's scale-fence, so the commit records the fraction; its CPU request is not
    # cpus.use, so decide plans again and that plan's tell resizes.
    world = _one_leader(initial_world((frac(500, 1),), token=True, restarts=0))
    _holds(explore_scaling(world, pod_writes=True), "pod-convergence")
    trace = _breaks(explore_scaling(world, pod_writes=True,
                                    mutants=Mutants(pod_record_ignored=True)),
                    "pod-convergence")
    assert "w0 crashes" in trace, trace


@pytest.mark.unit
def test_two_leaders_never_resize_the_pod_to_an_older_fraction() -> None:
    # Bug 4: two ApplyScales of one plan decided from reads of two specs (500m, then
    # 750m): a pod that already carries the plan's scale-fence is resized only when its
    # annotations carry this read's size, so the older read's resize never lands after
    # the newer one's.
    world = initial_world(FRACTIONS, token=True, restarts=0, crashes=0)
    report = explore_scaling(world, pod_writes=True, max_states=20_000)
    print(f"{report.states} states: {report.violation}: {report.trace}")
    assert report.violation is None, (report.violation, report.trace)  # within the cap
    trace = _breaks(explore_scaling(world, pod_writes=True, pod_convergence=False,
                                    liveness=False, mutants=Mutants(resize_any_read=True)),
                    "order")
    assert trace[-1].endswith("performs TellKubernetes (resize of plan #1)"), trace


# A tenant's write: the pod's scale-fence planted above every plan (docs/protocol.md,
# "The pod's record"). The calm run must go quiet (no plan after the faults stop).


def _planted(token: bool, **faults: int) -> World:
    """One leader; cpus.use 1000m -> 1500m (2 slots) -> 500m; the pod's scale-fence at
    (99, 99, 99) from the start: no plan's tell writes over it."""
    world = _one_leader(initial_world((frac(1500, 2), frac(500, 1)), token=token, **faults))
    return world._replace(runner=world.runner._replace(scale_fence=(99, 99, 99)))


@pytest.mark.unit
@pytest.mark.parametrize("token", [True, False])
def test_a_scale_fence_no_plan_wrote_costs_no_plan_loop(token: bool) -> None:
    # Order, claims and a quiet calm run, with the faults (stale reads, a crash, a
    # replaced pod: its new pod carries no planted fence). The pod's record cannot
    # follow while the fence is there (pod convergence is not asked): decide waits and
    # says so (PodScaleFenceAhead), and the commits record whole vCPUs.
    _holds(explore_scaling(_planted(token), pod_writes=True, pod_convergence=False),
           "quiescence")


@pytest.mark.unit
@pytest.mark.parametrize("token", [True, False])
def test_a_plan_for_a_pod_whose_record_no_plan_can_write_loops(
        token: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # The decision before decide.pod_fence_ahead (review-podwrites F1): the pod behind
    # the spec is planned again after every plan. The calm run's states look converged
    # (guest and status at the spec), only its not going quiet shows the loop.
    monkeypatch.setattr(decide, "pod_fence_ahead", lambda vm, pod: False)
    world = _planted(token, restarts=0, crashes=0)
    trace = _breaks(explore_scaling(world, pod_writes=True, pod_convergence=False),
                    "quiescence")
    assert trace[-1] == "(calm run)", trace
    if not token:
        return  # without a token, 1500m (2 vCPUs) is refused: the loop starts at 500m
    # Wherever the calm run is cut, the loop shows: mid-plan, as no convergence; else
    # as no quiet (before the quiet check, such a cut passed: at 40 steps, the default).
    changed = next(w for step, w, _ in ScalingModel(pod_writes=True).successors(world)
                   if "user sets use" in step)
    cuts = {steps: ScalingModel(pod_writes=True, pod_convergence=False).converges(
        changed, max_steps=steps) for steps in range(38, 42)}
    assert all(v is not None for v in cuts.values()), cuts
    assert cuts[40] is not None and cuts[40].property == "quiescence", cuts
