"""Scaling that cannot go on: stuck guests, silent runners, a plan fenced ahead (issue 29,
items 2 and 3).

* A runner answering 504 (the guest neither finishes nor refuses an unplug, and the
  runner gives up after its own wait) is asked once per reconcile: the reconcile ends
  stuck (Degraded, the VM's stuck backoff) instead of asking again up to the step budget,
  and the authority is checked again after each PUT. Three such VMs and two workers do
  not keep an honest VM from converging.
* A runner that gives no answer to ``GET /scale`` is asked at decide's pace for a grace
  period, then with the stuck backoff (Degraded ``RunnerUnreachable``); one that
  misbehaves at once (``RunnerMisbehaving``, see ``tests/test_hostile_runner.py``).
* A ``status.pendingScale`` whose epoch is ahead of the leader's is ``FenceAhead`` like
  ``status.fence``: Degraded with the remedy, looked at again after 300 s, and a VM being
  deleted still loses its finalizer.

docs/protocol.md, "Live scaling"; docs/reconciler.md, "Fencing".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from neonvm.api import types
from neonvm.controller import actions as act
from neonvm.controller import decide as d
from neonvm.controller.authority import AuthorityLost
from neonvm.controller.observe import Snapshot
from neonvm.controller.scaling import RunnerScaling
from tests.support import shipped_reconciler, wait_for
from tests.support.authority import StaticAuthority
from tests.support.hostile_runners import HonestRunner
from tests.support.scaling_decide import obs, scale_plan, vm

OLD = StaticAuthority(epoch=1, token=10)


# ---- the rules, without servers ---------------------------------------------------------


@pytest.mark.unit
def test_a_silent_runner_is_asked_at_decides_pace_for_a_grace_period_then_with_backoff(
        ) -> None:
    from neonvm.controller.scaling import RUNNER_GRACE_SECONDS, runner_trouble

    now = [1000.0]
    scaling = RunnerScaling(client.ApiClient(), clock=lambda: now[0],
                            address=lambda vm, pod: "http://127.0.0.1:1")  # nobody there
    planned = Snapshot(obs=obs(vm(cpus_use=2, pending=scale_plan(), phase="Scaling")),
                       record=None)
    first = scaling.observe(planned).obs
    assert first.runner_error is not None and not first.runner_error.misbehaving
    assert runner_trouble(first.runner_error) is None
    assert isinstance(d.decide(first), act.Wait)  # decide's own short wait (2 s)
    now[0] += RUNNER_GRACE_SECONDS
    later = scaling.observe(planned).obs
    trouble = runner_trouble(later.runner_error)
    assert trouble is not None and trouble[0] == "RunnerUnreachable", trouble
    # A plan for another pod (the VM's pod was replaced) starts the count again.
    replaced = vm(cpus_use=2, pending=scale_plan(), phase="Scaling")
    replaced.status.pod_uid = "uid-2"
    scaling.observe(Snapshot(obs=obs(replaced), record=None))
    assert runner_trouble(scaling.observe(planned).obs.runner_error) is None


@pytest.mark.unit
def test_a_silent_runner_stays_degraded_while_looked_at_with_the_stuck_backoff() -> None:
    # The manager's own stuck backoff and a fake clock; each look at the silent runner is
    # spaced by the backoff plus a GET's whole deadline. Before, the count of failures was
    # forgotten after 300 s, the backoff's cap: once the cap was reached, the next look
    # started a new grace period, the reconcile ended normally (Degraded "Recovered") and
    # the backoff went back to 1 s.
    from neonvm.controller.manager import ControllerConfig
    from neonvm.controller.scaling import RUNNER_GRACE_SECONDS, runner_trouble

    backoff = ControllerConfig().stuck_backoff
    look_timeout = 3.0
    now = [1000.0]
    scaling = RunnerScaling(client.ApiClient(), clock=lambda: now[0],
                            look_timeout=look_timeout,
                            address=lambda vm, pod: "http://127.0.0.1:1")  # nobody there
    planned = Snapshot(obs=obs(vm(cpus_use=2, pending=scale_plan(), phase="Scaling")),
                       record=None)
    while runner_trouble(scaling.observe(planned).obs.runner_error) is None:
        assert now[0] - 1000.0 <= RUNNER_GRACE_SECONDS
        now[0] += 2.0  # decide's own pace
    for streak in range(20):  # 1, 2, 4 ... 256, then the cap (300 s) eleven times
        now[0] += backoff.delay(streak) + look_timeout
        trouble = runner_trouble(scaling.observe(planned).obs.runner_error)
        assert trouble is not None and trouble[0] == "RunnerUnreachable", (now[0], trouble)


@pytest.mark.unit
@pytest.mark.parametrize(("outcome", "later"), [
    ("guest_refused", True), ("runner_504", True), ("runner_503", True),
    ("unreachable", True), ("runner_misbehaving", True),
    # These are quick, or change what the next observation decides: asked again at once.
    ("stale", False), ("token_refused", False), ("no_pod", False), ("done", False),
    ("runner_400", False), ("runner_401", False),
])
def test_which_apply_outcomes_end_the_reconcile_for_the_backoff(outcome: str,
                                                                later: bool) -> None:
    from neonvm.controller.scaling import asks_again_later

    assert asks_again_later(outcome) is later


# ---- a guest that neither finishes nor refuses an unplug --------------------------------


@pytest.fixture
def stuck_runner() -> Any:
    runner = HonestRunner(stuck_put=0.5)
    yield runner
    runner.close()


@pytest.mark.cluster
def test_an_unplug_the_guest_never_settles_is_asked_once_per_reconcile(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        stuck_runner: HonestRunner) -> None:
    from tests.support.scaling_controller import _running_on, set_use, status_of

    reconciler = _running_on(stuck_runner, api, controller_api, namespace, "unplug",
                             token_sync_seconds=3600.0)
    key = f"{namespace}/unplug"
    set_use(api, namespace, "unplug", 2, 2)
    result = reconciler.reconcile(key, OLD, direct_first=True)
    # Before: 30 PUTs in this one reconcile (the step budget), each as long as the
    # runner's own wait for the guest (60 s in a real runner): 30 minutes per worker.
    assert stuck_runner.puts == 1, stuck_runner.puts
    assert result.stuck == "ApplyScaleNotTakingEffect", result
    status = status_of(api, namespace, "unplug")
    assert status["pendingScale"]["seq"] == 1, status  # kept: asked again after backoff
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ApplyScaleNotTakingEffect")
    assert "runner_504" in degraded["message"], degraded
    # The next reconcile (after the backoff) asks once more, and says nothing new.
    again = reconciler.reconcile(key, OLD, direct_first=True)
    assert again.stuck == "ApplyScaleNotTakingEffect" and stuck_runner.puts == 2


@pytest.mark.cluster
def test_a_runner_answering_200_slowly_without_applying_is_asked_once_per_reconcile(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    # A hostile runner: every PUT waits, then answers 200; GET /scale goes on reporting
    # the older fence. Before, each such answer counted as progress and the same PUT was
    # sent again up to the step budget (30): 30 deadlines (45 minutes) per reconcile.
    from tests.support.scaling_controller import _running_on, set_use, status_of

    runner = HonestRunner(lying_put=0.3)
    try:
        reconciler = _running_on(runner, api, controller_api, namespace, "liar",
                                 token_sync_seconds=3600.0)
        key = f"{namespace}/liar"
        set_use(api, namespace, "liar", 2, 2)
        result = reconciler.reconcile(key, OLD, direct_first=True)
        assert runner.puts == 1, runner.puts
        assert result.stuck == "ApplyScaleNotTakingEffect", result
        status = status_of(api, namespace, "liar")
        assert status["pendingScale"]["seq"] == 1, status  # kept: asked again after backoff
        degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True",
                                                            "ApplyScaleNotTakingEffect")
        again = reconciler.reconcile(key, OLD, direct_first=True)
        assert again.stuck == "ApplyScaleNotTakingEffect" and runner.puts == 2, runner.puts
    finally:
        runner.close()


class LostAfterAPut:
    """An authority that holds until ``runner`` has been sent a PUT, then is lost (a
    leader deposed while its PUT was on its way)."""

    def __init__(self, runner: HonestRunner) -> None:
        self._runner = runner
        self.lease = OLD.lease
        self.vm_uid: str | None = None

    def check(self) -> None:
        if self._runner.puts:
            raise AuthorityLost("the lock was lost while the PUT was on its way")


@pytest.mark.cluster
def test_the_authority_is_checked_again_after_each_put(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        stuck_runner: HonestRunner) -> None:
    from tests.support.scaling_controller import _running_on, set_use, status_of

    reconciler = _running_on(stuck_runner, api, controller_api, namespace, "deposed",
                             token_sync_seconds=3600.0)
    set_use(api, namespace, "deposed", 2, 2)
    with pytest.raises(AuthorityLost):
        reconciler.reconcile(f"{namespace}/deposed", LostAfterAPut(stuck_runner),
                             direct_first=True)
    # Nothing after the PUT: no second PUT, no condition written by a deposed leader.
    assert stuck_runner.puts == 1, stuck_runner.puts
    conditions = status_of(api, namespace, "deposed").get("conditions") or []
    assert not any(c["type"] == "Degraded" and c["status"] == "True" for c in conditions)


@pytest.mark.cluster
def test_three_stuck_vms_and_two_workers_leave_an_honest_vm_converging(
        cluster: Any, api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    # A real controller (two workers). Each stuck VM's runner holds every PUT for 8 s
    # and answers 504 (a real runner: 60 s). Before, one reconcile of each asked up to
    # 30 times in a row: both workers were held for minutes at a time.
    from tests.support import replica_group
    from tests.support.hostile_runner import _pod_running, condition, scalable_vm
    from tests.support.scaling_controller import set_use, status_of

    stuck = {f"stuck{i}": HonestRunner(stuck_put=8.0) for i in range(3)}
    honest = HonestRunner()
    names = [*stuck, "honest"]
    try:
        with replica_group(cluster, api, namespace, tmp_path / "replicas",
                           workers=2) as replicas:
            replicas.start("r0")
            for name, runner in stuck.items():
                scalable_vm(api, namespace, name, runner.port)
            scalable_vm(api, namespace, "honest", honest.port)
            for name in names:
                wait_for(lambda n=name: _pod_running(api, namespace, n), 180,  # type: ignore[misc]
                         what=f"{name}'s pod started")
                wait_for(lambda n=name: status_of(api, namespace, n).get("phase") == "Running",
                         120, what=f"{name} Running")
            for name in stuck:
                set_use(api, namespace, name, 2, 2)
            wait_for(lambda: all(r.puts for r in stuck.values()), 120,
                     what="every stuck VM's PUT on its way")
            set_use(api, namespace, "honest", 2, 2)
            wait_for(lambda: (s := status_of(api, namespace, "honest")).get("cpus") == 2
                     and s.get("memorySize") == "2Gi" and "pendingScale" not in s, 120,
                     what="the honest VM at 2 vCPUs, 2Gi")
            for name in stuck:
                wait_for(lambda n=name: (c := condition(api, namespace, n, "Degraded"))
                         is not None and c["status"] == "True"
                         and c["reason"] == "ApplyScaleNotTakingEffect", 120,
                         what=f"{name} Degraded")
                assert status_of(api, namespace, name)["pendingScale"]["seq"] == 1
            print("PUTs per stuck VM:", {n: r.puts for n, r in stuck.items()})
    finally:
        for runner in stuck.values():
            runner.close()
        honest.close()


@pytest.mark.cluster
def test_two_runners_answering_200_slowly_and_two_workers_leave_an_honest_vm_converging(
        cluster: Any, api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    # A real controller (two workers). Each liar's runner holds every PUT for 8 s, then
    # answers 200 and applies nothing (GET /scale keeps the older fence). Before, each
    # reconcile of each liar sent up to 30 PUTs in a row: both workers held for 4 minutes
    # at a time, and the honest VM waited.
    from tests.support import replica_group
    from tests.support.hostile_runner import _pod_running, condition, scalable_vm
    from tests.support.scaling_controller import set_use, status_of

    liars = {f"liar{i}": HonestRunner(lying_put=8.0) for i in range(2)}
    honest = HonestRunner()
    names = [*liars, "honest"]
    try:
        with replica_group(cluster, api, namespace, tmp_path / "replicas",
                           workers=2) as replicas:
            replicas.start("r0")
            for name, runner in liars.items():
                scalable_vm(api, namespace, name, runner.port)
            scalable_vm(api, namespace, "honest", honest.port)
            for name in names:
                wait_for(lambda n=name: _pod_running(api, namespace, n), 180,  # type: ignore[misc]
                         what=f"{name}'s pod started")
                wait_for(lambda n=name: status_of(api, namespace, n).get("phase") == "Running",
                         120, what=f"{name} Running")
            for name in liars:
                set_use(api, namespace, name, 2, 2)
            wait_for(lambda: all(r.puts for r in liars.values()), 120,
                     what="every liar's PUT on its way")
            set_use(api, namespace, "honest", 2, 2)
            wait_for(lambda: (s := status_of(api, namespace, "honest")).get("cpus") == 2
                     and s.get("memorySize") == "2Gi" and "pendingScale" not in s, 120,
                     what="the honest VM at 2 vCPUs, 2Gi")
            for name in liars:
                wait_for(lambda n=name: (c := condition(api, namespace, n, "Degraded"))
                         is not None and c["status"] == "True"
                         and c["reason"] == "ApplyScaleNotTakingEffect", 120,
                         what=f"{name} Degraded")
                assert status_of(api, namespace, name)["pendingScale"]["seq"] == 1
            print("PUTs per liar:", {n: r.puts for n, r in liars.items()})
    finally:
        for runner in liars.values():
            runner.close()
        honest.close()


# ---- a scaling plan fenced ahead ---------------------------------------------------------


def _plant_plan_ahead(api: client.ApiClient, namespace: str, name: str,
                      epoch: int) -> None:
    """Write a ``status.pendingScale`` of a higher epoch (a restore, a user, a bug)."""
    from tests.support.harness import get_vm

    raw = get_vm(api, namespace, name)
    assert raw is not None
    status = raw["status"]
    status["pendingScale"] = {"cpus": 2, "memorySlots": 2, "seq": status.get("scaleSeq", 0) + 1,
                              "epoch": epoch, "token": 999, "podName": status["podName"],
                              "podUID": status["podUID"], "generation": 1}
    client.CustomObjectsApi(api).replace_namespaced_custom_object_status(
        types.GROUP, types.VERSION, namespace, types.PLURAL, name, raw)


@pytest.mark.cluster
def test_a_scaling_plan_of_a_higher_epoch_is_degraded_and_its_vm_still_deletes(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    from tests.support.harness import create_vm, delete_vm, get_vm
    from tests.support.scaling_controller import NOWHERE, settle, status_of

    create_vm(api, namespace, "ahead", spec={
        "nodeSelector": NOWHERE,
        "guest": {"cpus": {"min": 1, "max": 2, "use": 1},
                  "memorySlots": {"min": 1, "max": 2, "use": 1}, "memorySlotSize": "1Gi",
                  "rootDisk": {"image": "/nonexistent.raw"}}})
    key = f"{namespace}/ahead"
    reconciler = shipped_reconciler(controller_api)
    settle(reconciler, key, OLD)
    _plant_plan_ahead(api, namespace, "ahead", epoch=7)

    # Before: "fenced out, but the fresh copy is not", a LIST and a GET once a second,
    # forever, and nothing on the VM said so.
    result = reconciler.reconcile(key, OLD, direct_first=True)
    assert result.requeue_after == 300.0 and isinstance(result.action, act.Wait), result
    degraded = next(c for c in status_of(api, namespace, "ahead")["conditions"]
                    if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "FenceAhead"), degraded
    assert "status.pendingScale epoch 7" in degraded["message"], degraded
    assert status_of(api, namespace, "ahead")["pendingScale"]["epoch"] == 7  # left alone

    # Deleted, it goes: its pods, then its finalizer (the scaling plan is moot).
    delete_vm(api, namespace, "ahead")
    for _ in range(20):
        if get_vm(api, namespace, "ahead") is None:
            break
        reconciler.reconcile(key, OLD, direct_first=True)
    wait_for(lambda: get_vm(api, namespace, "ahead") is None, 60, what="the VM gone")


# ---- the explorer ------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.slow
def test_every_interleaving_with_reconciles_ending_stuck_over_the_runner_keeps_the_order(
        ) -> None:
    # The scaling explorer's world (two leaders, stale reads, a crash, a runner restart,
    # the user scaling 1 -> 2 -> 1), where a reconcile may also end stuck over the
    # runner: after a PUT answered 504, or finding the runner misbehaving on GET /scale,
    # the worker holds the stuck Degraded write and performs it at any later step.
    from neonvm.verify.scaling import explore_scaling, initial_world

    report = explore_scaling(initial_world(stuck=1, unanswered=1))
    print(f"scaling explorer, stuck ends: {report.states} states, "
          f"{report.transitions} transitions")
    assert report.violation is None, (report.violation, report.trace)
    assert report.complete and report.states > 1000


@pytest.mark.unit
@pytest.mark.slow
def test_a_guest_that_never_settles_an_unplug_with_stuck_reconciles_keeps_the_order(
        ) -> None:
    # Every memory unplug answers 504 and stays pending; the reconcile that sent it may
    # end stuck there (its Degraded write held). The user goes 1/1 -> 2/2 -> 1/1 -> 2/2.
    from neonvm.verify.scaling import explore_scaling, initial_world

    report = explore_scaling(initial_world(spec_changes=((2, 2), (1, 1), (2, 2)), restarts=0,
                                           stuck=1), refuse_unplug=True)
    print(f"scaling explorer, unplugs never settled, stuck ends: {report.states} states, "
          f"{report.transitions} transitions")
    assert report.violation is None, (report.violation, report.trace)
    assert report.complete and report.states > 1000
