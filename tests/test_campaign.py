"""The fault-injection campaign: no seeded schedule of faults breaks the invariant.

Each schedule (see :mod:`neonvm.drills.campaign`) combines a crash right after one
reconcile step, stale reads, dropped watch events, injected conflicts, leader kills,
broken locks and etcd / API server crashes, on a few VMs, with real controller replicas
on the session's control plane; an independent checker watches every pod revision.

Sizing (the CI default fits about two minutes on two cores; docs/drills.md, "Sizing"):

* ``NEONVM_CAMPAIGN_SCHEDULES`` schedules (default 100), ``NEONVM_CAMPAIGN_WORKERS`` at a
  time (default 3), no new schedule after ``NEONVM_CAMPAIGN_BUDGET`` seconds (default
  90; 0: no limit), but never fewer than the first ``len(CRASH_STEPS)`` schedules, so a
  CI run crashes the leader after every reconcile step at least once. Long mode:
  ``NEONVM_CAMPAIGN_SCHEDULES=300 NEONVM_CAMPAIGN_BUDGET=0``.
* ``NEONVM_CAMPAIGN_SEED``: the campaign seed (default: a fresh one, printed).
* ``NEONVM_CAMPAIGN_ONLY=3,17``: only these schedule indexes (replaying a failure; the
  failure report prints this command, and ``neonvm drill campaign --seed S --schedule N``).
"""

from __future__ import annotations

import os
import time

import pytest

from neonvm.controller.actions import performed_actions
from neonvm.controller.faults import FaultConfig
from neonvm.dev.cluster import LocalCluster
from neonvm.drills.campaign import (
    CRASH_STEPS,
    SCHEDULES_ENV,
    campaign_seed,
    generate,
    run_campaign,
)
from neonvm.drills.schedule import FREQUENT_STEPS


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


@pytest.mark.unit
def test_a_schedule_is_a_pure_function_of_seed_and_index() -> None:
    assert generate(7, 3) == generate(7, 3)
    assert generate(7, 3) != generate(8, 3)
    assert generate(7, 3) != generate(7, 4)


@pytest.mark.unit
def test_consecutive_schedules_crash_after_every_reconcile_step_and_parse_as_faults() -> None:
    schedules = [generate(11, i) for i in range(20, 20 + len(CRASH_STEPS))]
    assert {s.crash_step for s in schedules} == set(CRASH_STEPS)
    for s in schedules:
        leader = FaultConfig.parse(s.leader_faults)
        assert leader.crash_after == s.crash_step and leader.crash_occurrence >= 1
        FaultConfig.parse(s.standby_faults)
        assert any(d.kind == "delete-pods" for d in s.disruptions)
        assert [d.at for d in s.disruptions] == sorted(d.at for d in s.disruptions)
        assert "intermediate" in s.classes


@pytest.mark.unit
def test_every_step_the_driver_performs_is_a_crash_step_in_the_actions_tables_order() -> None:
    """The crash steps are not listed by hand: each action declares its step, and the
    driver's actions table orders them. Every action with a step (decide's classes, found
    independently of the table) is crashed after, once, and the cycle keeps the order
    the campaign has always used, so a seed's schedules (and their replay commands) stay
    what they were; a new action's step goes last."""
    steps = [kind.step for kind in performed_actions()]
    assert sorted(CRASH_STEPS) == sorted(steps), "an action's step is not a crash step"
    assert len(set(CRASH_STEPS)) == len(CRASH_STEPS)
    assert set(CRASH_STEPS) >= FREQUENT_STEPS
    assert CRASH_STEPS[:14] == ("plan", "create", "commit", "ungate", "cleanup", "restart",
                                "add_finalizer", "sync", "finalize", "drop_plan",
                                "plan_scale", "apply_scale", "commit_scale", "drop_scale")


@pytest.mark.unit
def test_the_first_hundred_schedules_cover_all_three_classes_and_every_disruption() -> None:
    schedules = [generate(5, i) for i in range(100)]
    classes = {c for s in schedules for c in s.classes}
    assert classes == {"intermediate", "unobserved", "stale"}
    kinds = {d.kind for s in schedules for d in s.disruptions}
    assert kinds == {"delete-pods", "kill-leader", "pause-leader", "term-leader", "break-locks",
                     "recreate-vm", "restart-locks-etcd", "restart-etcd", "restart-apiserver"}


@pytest.mark.unit
def test_a_failure_names_the_command_that_replays_it() -> None:
    s = generate(1234, 42)
    assert s.replay() == "neonvm drill campaign --seed 1234 --schedule 42"
    assert "NEONVM_CAMPAIGN_SEED=1234" in s.replay_pytest()
    assert "NEONVM_CAMPAIGN_ONLY=42" in s.replay_pytest()


@pytest.mark.unit
def test_the_budget_stops_new_schedules_only_after_the_minimum_has_started(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import neonvm.drills.campaign as campaign

    ran: list[int] = []

    def fake_run(_cluster: object, schedule: campaign.Schedule, *_: object
                 ) -> campaign.ScheduleResult:
        ran.append(schedule.index)
        return campaign.ScheduleResult(schedule, ok=True)

    monkeypatch.setattr(campaign, "run_schedule", fake_run)
    schedules = [generate(3, i) for i in range(6)]
    result = run_campaign(None, schedules, progress=lambda _m: None, budget=0.0, minimum=4)
    assert ran == [0, 1, 2, 3] and result.skipped == 2  # the budget was over at once
    ran.clear()
    assert run_campaign(None, schedules, progress=lambda _m: None, budget=0.0).skipped == 6


BUDGET = _int_env("NEONVM_CAMPAIGN_BUDGET", 90)


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(BUDGET + 900 if BUDGET else 0)  # long mode (budget 0): no timeout
def test_no_schedule_of_the_campaign_breaks_the_invariant(cluster: LocalCluster) -> None:
    seed = campaign_seed()
    only = [int(x) for x in os.environ.get("NEONVM_CAMPAIGN_ONLY", "").split(",") if x.strip()]
    count = _int_env(SCHEDULES_ENV, 100)
    budget = BUDGET
    workers = _int_env("NEONVM_CAMPAIGN_WORKERS", 3)
    indexes = only or list(range(count))
    print(f"\ncampaign seed {seed}: {len(indexes)} schedule(s), {workers} at a time, "
          f"budget {budget or 'none'}s (replay: NEONVM_CAMPAIGN_SEED={seed})")
    started = time.monotonic()
    result = run_campaign(cluster, [generate(seed, i) for i in indexes],
                          progress=print, budget=budget or None, workers=workers,
                          minimum=0 if only else len(CRASH_STEPS))
    summary = result.summary(time.monotonic() - started)
    print(summary)
    assert result.results, "no schedule ran"
    assert result.ok, summary
