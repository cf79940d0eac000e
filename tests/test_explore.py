"""The interleaving explorer: what it proves about the protocol, that it catches bugs,
that its model behaves like the real servers, and that its counterexamples are real.

* The protocol: every CI scenario explored to the end keeps every invariant; the
  explorer's two findings stay pinned as tests.
* Mutation testing of the checker: each deliberate breakage of the model driver yields a
  counterexample; the breakages of the pod fence yield two runnable pods.
* The model's semantics, step by step (unit).
* Replay: counterexamples played against the real API server end in the same violation
  (``cluster``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner
from kubernetes import client

from neonvm import kube
from neonvm.cli.verify import verify
from neonvm.controller import action_table, mutations
from neonvm.controller import actions as act
from neonvm.controller import decide as d
from neonvm.dev.cluster import LocalCluster
from neonvm.verify.actors import Actors, Config, calm
from neonvm.verify.explore import Bounds, Counterexample, Liveness, Scenario, explore
from neonvm.verify.invariants import converged
from neonvm.verify.model import (
    LEADER,
    NODE,
    STANDBY,
    ZOMBIE,
    Budget,
    Lock,
    Pod,
    Worker,
    World,
)
from neonvm.verify.scenarios import (
    ci_scenarios,
    fresh_world,
    lockless_pod_deleted,
    paused_writers,
    settle,
)
from neonvm.verify.trace import format_counterexample
from tests.support.replay import Replayer

SHIPPED = Config()
"""The driver as shipped: the committed pod is read by name after the VM read."""
BEFORE_F4 = Config(read_committed_pod=False)
"""The driver before eabc9e7, which only listed the pods before reading the VM."""


def first(scenario: Scenario, **kw: object) -> Counterexample:
    report = explore(scenario, Bounds(liveness=False), **kw)  # type: ignore[arg-type]
    assert report.counterexamples, f"no counterexample in {report.states} states"
    return report.counterexamples[0]


def runnable(w: World) -> list[Pod]:
    return [p for p in w.pods if not p.gated]


# ---- the protocol -------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.slow
@pytest.mark.parametrize("scenario", ci_scenarios(SHIPPED), ids=lambda s: s.name)
def test_every_ci_scenario_keeps_every_invariant(scenario: Scenario) -> None:
    report = explore(scenario)
    assert report.complete, f"bounds hit at {report.states} states"
    assert not report.counterexamples, format_counterexample(report.counterexamples[0])


@pytest.mark.unit
def test_listing_before_reading_the_vm_made_a_fresh_commit_look_like_a_vanished_pod() -> None:
    """The explorer's second finding, fixed in the driver by eabc9e7: without the GET of
    the committed pod after the VM read, a pod created and committed between the list
    and the VM read is missing from the list, and decide() restarts it while it runs."""
    cx = first(lockless_pod_deleted(BEFORE_F4, Budget(pod_delete=1)))
    assert cx.invariant == "runs-only-the-committed-pod"
    restarts = [(n, s) for n, (s, _w) in enumerate(cx.trace)
                if s.kind == "get" and s.args[0] and s.args[0][0] == "Restart"]
    n, step = restarts[-1]
    restarted = step.args[0][1]
    # When the restart of the committed pod was decided, that pod existed.
    before = cx.trace[n - 1][1] if n else cx.initial
    assert any(p.name == restarted for p in before.pods)
    assert runnable(cx.trace[-1][1])[0].name == restarted


@pytest.mark.unit
def test_the_driver_as_shipped_survives_the_same_race() -> None:
    report = explore(lockless_pod_deleted(SHIPPED, Budget(pod_delete=1)))
    assert report.complete and not report.counterexamples


@pytest.mark.unit
def test_the_paused_writers_start_from_a_reachable_state() -> None:
    w = paused_writers(Config())
    roles = [(x.role, x.pc) for x in w.workers]
    assert roles == [(ZOMBIE, "patch"), (LEADER, "idle"), (ZOMBIE, "act")]
    assert w.workers[2].action is not None and w.workers[2].action[0] == "CreatePod"
    assert w.vm is not None and w.vm.status.pod_name == w.pods[0].name


# ---- mutation testing: the checker catches deliberate bugs --------------------------------


def broken(name: str) -> Config:
    return dataclasses.replace(SHIPPED, breakages=frozenset({name}))


@pytest.mark.unit
def test_ungating_from_a_cached_list_runs_two_pods() -> None:
    cx = first(lockless_pod_deleted(broken("cached_ungate"),
                                    Budget(pod_delete=1, dropped_event=1)))
    assert cx.invariant == "at-most-one-runnable"
    assert len(runnable(cx.trace[-1][1])) == 2
    assert any("lost event" in s.text for s, _ in cx.trace)


@pytest.mark.unit
def test_an_ungate_without_uid_and_version_precondition_runs_two_pods() -> None:
    cfg = dataclasses.replace(broken("ungate_without_precondition"), history=1)
    scenario = Scenario("paused-writers", "", cfg,
                        paused_writers(cfg)._replace(budget=Budget(pod_delete=1)))
    cx = first(scenario, invariants=frozenset({"at-most-one-runnable"}))
    last = cx.trace[-1][1]
    two = runnable(last)
    assert len(two) == 2
    # One of them is a re-created namesake of the pod the paused ungate was decided for.
    assert len({p.name for p in two}) == 2 and cx.trace[-1][0].actor.startswith("c0")


@pytest.mark.unit
def test_the_seeds_retry_writes_a_stale_status_over_a_newer_one() -> None:
    cx = first(lockless_pod_deleted(broken("blind_retry"), Budget(pod_delete=1, conflict=1)))
    assert cx.invariant in ("restart-count-monotonic", "plan-seq-monotonic",
                            "runs-only-the-committed-pod")
    assert "blind retry" in cx.trace[-1][0].text


@pytest.mark.unit
def test_creating_before_recording_the_plan_is_caught_at_the_create() -> None:
    cx = first(lockless_pod_deleted(broken("create_before_record"), Budget(pod_delete=1)))
    assert cx.invariant == "creates-only-recorded-plans"
    assert cx.trace[-1][0].kind == "create"


@pytest.mark.unit
def test_adopting_a_pod_on_its_name_alone_commits_a_planted_pod() -> None:
    """Without the fence check, the pod the user planted under the recorded plan's name is
    committed (and would be ungated): the checker catches it."""
    scenario = next(s for s in ci_scenarios(broken("adopt_without_fence"))
                    if s.name == "planted-pod")
    cx = first(scenario)
    assert cx.invariant == "adopts-only-its-own-pods"
    assert any(s.kind == "plant" for s, _ in cx.trace)
    last = cx.trace[-1][1]
    assert last.vm is not None
    planted = next(p for p in last.pods if p.planted)
    assert planted.uid == last.vm.status.pod_uid or not planted.gated


@pytest.mark.unit
def test_adopting_a_pod_that_carries_any_fence_commits_a_planted_pod() -> None:
    """Checking only that *some* fence annotations are there (not the plan's epoch and
    token) commits the pod the user planted with an older fence: the checker catches it."""
    scenario = next(s for s in ci_scenarios(broken("adopt_any_fence"))
                    if s.name == "planted-pod")
    cx = first(scenario)
    assert cx.invariant == "adopts-only-its-own-pods"
    plant = next(s for s, _ in cx.trace if s.kind == "plant")
    assert plant.args[2] is not None, "caught by the plant with a wrong fence"
    last = cx.trace[-1][1]
    assert last.vm is not None
    planted = next(p for p in last.pods if p.planted)
    assert planted.fence is not None and last.vm.status.pending is None
    assert planted.uid == last.vm.status.pod_uid or not planted.gated


@pytest.mark.unit
def test_a_planted_pod_is_dropped_and_deleted_and_the_vm_gets_its_own() -> None:
    """One concrete run of the shipped code: plan recorded, pod planted under its name, the
    plan is dropped, a new plan is created and committed, the planted pod deleted."""
    actors = Actors(SHIPPED)
    w = running_vm(SHIPPED)
    assert w.vm is not None
    w = w._replace(pods=(), budget=Budget(plant=1))  # the pod is gone (and was restarted)
    w = w._replace(vm=w.vm._replace(status=w.vm.status._replace(
        pod_name="", pod_uid="", phase="Pending", ip=None, node=None)))
    w = actors.calm_leader_step(w)[1]  # type: ignore[index]  # RecordPlan decided
    w = actors.calm_leader_step(w)[1]  # type: ignore[index]  # ... and written
    assert w.vm is not None and w.vm.status.pending is not None
    planned = w.vm.status.pending.name
    w = next(t for s, t in actors.adversary_steps(w) if s.kind == "plant"
             and s.args[0] == planned)
    w = calm(w)
    seen: list[str] = []
    for _ in range(60):
        env = actors.environment_steps(w)
        if env:
            w = env[0][1]
            continue
        if converged(w) is None and w.workers[0].pc == "idle":
            break
        step, w = actors.calm_leader_step(w)  # type: ignore[misc]
        seen.append(step.text)
    assert converged(w) is None, seen
    assert w.vm is not None and w.vm.status.pod_name != planned
    assert [p.fence for p in w.pods] == [(w.vm.status.fence.epoch,  # type: ignore[union-attr]
                                          w.vm.status.fence.token)]  # type: ignore[union-attr]
    assert any("DropPlan" in t for t in seen) and any(planned in t and "DeletePod" in t
                                                      for t in seen), seen


def _sync_before_d9c1dc9(action: act.Action, lease: act.Fence) -> Callable[[Any], Any]:
    """The sync mutation as it was before the explorer's first finding was fixed."""
    if not isinstance(action, act.SyncStatus):
        return mutations_before(action, lease)

    def sync(vm: Any) -> Any:
        s = vm.status
        if not s.pod_name or s.phase in d.TERMINAL_PHASES:
            return None
        if (s.phase, s.node, s.pod_ip) == (action.phase, action.node, action.ip):
            return None
        new = mutations._fresh_status(vm, lease)
        new.phase, new.node, new.pod_ip = action.phase, action.node, action.ip
        return new

    return sync


mutations_before = action_table.status_mutation


@pytest.mark.unit
def test_the_explorer_finds_the_stale_sync_when_the_old_mutation_is_put_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(action_table, "status_mutation", _sync_before_d9c1dc9)
    scenario = next(s for s in ci_scenarios() if s.name == "seed-pod-deleted")
    cx = first(scenario)
    assert cx.invariant == "status-describes-its-pod"
    assert "SyncStatus" in cx.trace[-1][0].text and "409" not in cx.trace[-1][0].text


@pytest.mark.unit
def test_a_driver_that_never_sweeps_locks_leaves_one_behind_for_a_deleted_vm() -> None:
    scenario = next(s for s in ci_scenarios(broken("no_lock_sweep")) if s.name == "vm-deleted")
    report = explore(scenario)
    assert report.counterexamples
    cx = report.counterexamples[0]
    assert cx.invariant == "deleted-vm-leaves-nothing" and "lock" in cx.message
    assert cx.continuation, "the calm run that never removes the lock is part of the trace"


@pytest.mark.unit
def test_the_shipped_code_yields_no_counterexample_where_the_breakages_do() -> None:
    for scenario in (
        lockless_pod_deleted(SHIPPED, Budget(pod_delete=1, dropped_event=1)),
        Scenario("paused-writers", "", dataclasses.replace(SHIPPED, history=1),
                 paused_writers(SHIPPED)._replace(budget=Budget(pod_delete=1))),
    ):
        report = explore(scenario)
        assert report.complete and not report.counterexamples, scenario.name


@pytest.mark.unit
@pytest.mark.parametrize("name", ["noop_retry", "delete_without_uid", "create_from_cache"])
def test_breakages_the_protocol_absorbs_yield_no_counterexample(name: str) -> None:
    """The literal seed retry (intent lost, success reported) and a delete without uid
    precondition are harmless here: the driver observes again after every write, and
    pod names are never reused while a pod of that name may still be deleted. A create
    from a stale cached VM is harmless too: the pod is gated, and only an ungate, whose
    own quorum list sees it, can run anything (the shipped driver still creates only
    from a direct observation or its own write's answer, so as not to bring back the
    name of a plan committed since)."""
    scenario = lockless_pod_deleted(dataclasses.replace(broken(name), history=1),
                                    Budget(pod_delete=1, conflict=1))
    report = explore(scenario, Bounds(liveness=False))
    assert report.complete and not report.counterexamples


# ---- the model's semantics ------------------------------------------------------------------


def running_vm(cfg: Config) -> World:
    return settle(cfg, fresh_world(2))


@pytest.mark.unit
def test_the_fault_free_protocol_settles_on_one_running_committed_pod() -> None:
    w = running_vm(Config())
    assert converged(w) is None
    assert w.vm is not None and [p.name for p in w.pods] == [w.vm.status.pod_name]


@pytest.mark.unit
def test_a_write_decided_from_an_old_version_conflicts_then_reapplies_the_intent() -> None:
    cfg = Config()
    actors = Actors(cfg)
    w = fresh_world(1)
    w = next(iter(actors.worker_steps(w, 0, latest_only=True)))[1]  # take the lock
    step, w = next(iter(actors.worker_steps(w, 0, latest_only=True)))
    assert w.workers[0].action == ("AddFinalizer",)
    conflict = next(t for s, t in actors.adversary_steps(
        w._replace(budget=Budget(conflict=1))) if s.kind == "conflict")
    step, w = next(iter(actors.worker_steps(conflict, 0, latest_only=True)))
    assert "409" in step.text and w.workers[0].pc == "retry"
    step, w = next(iter(actors.worker_steps(w, 0, latest_only=True)))
    assert w.workers[0].pc == "act" and w.workers[0].base_fresh
    step, w = next(iter(actors.worker_steps(w, 0, latest_only=True)))
    assert "→ ok" in step.text and w.vm is not None and w.vm.finalizer


@pytest.mark.unit
def test_deleting_an_unbound_pod_removes_it_and_a_running_one_terminates_until_done() -> None:
    w = running_vm(Config())._replace(budget=Budget(pod_delete=1))
    actors = Actors(Config())
    _, w = next((s, t) for s, t in actors.adversary_steps(w) if s.kind == "delete-pod")
    assert w.pods[0].terminating and w.pods[0].node == NODE
    gone = [t for s, t in actors.environment_steps(w) if s.kind == "gone"]
    assert gone and gone[0].pods == ()
    gated = Pod("p", "u9", "x", gated=True, node=None, phase="Pending", terminating=False)
    w2 = w._replace(pods=(gated,), budget=Budget(pod_delete=1))
    _, w3 = next((s, t) for s, t in actors.adversary_steps(w2) if s.kind == "delete-pod")
    assert w3.pods == ()


@pytest.mark.unit
def test_a_cache_offers_past_versions_but_never_older_than_what_it_showed() -> None:
    cfg = Config(history=2)
    w = running_vm(cfg)
    w = w._replace(workers=(w.workers[0], Worker(role=LEADER, epoch=w.epoch, token=0,
                                                 pc="idle", lag_vm=2, lag_pods=2)))
    actors = Actors(dataclasses.replace(cfg, locks=False))
    reads = [(s, t) for s, t in actors.worker_steps(w, 1, latest_only=False)
             if s.kind == "observe"]
    assert len(reads) == 9  # 3 VM versions x 3 pod-list versions
    _, after = next((s, t) for s, t in reads if s.args[1:3] == (2, 2))
    assert (after.workers[1].lag_vm, after.workers[1].lag_pods) == (2, 2)
    _, after = next((s, t) for s, t in reads if s.args[1:3] == (0, 0))
    again = [s for s, _ in actors.worker_steps(after._replace(workers=(
        after.workers[0], after.workers[1]._replace(pc="idle", action=None))), 1, False)
        if s.kind == "observe"]
    assert len(again) == 1  # having seen the newest versions, the cache offers only those


@pytest.mark.unit
def test_calm_switches_off_deposed_leaders_faults_and_stale_caches() -> None:
    w = paused_writers(Config())._replace(budget=Budget(pod_delete=1, crash=1))
    c = calm(w)
    assert [x.role for x in c.workers] == [STANDBY, LEADER, STANDBY]
    assert c.budget == Budget() and c.vm_hist == () and c.pod_hist == ()


@pytest.mark.unit
def test_liveness_reports_a_vm_whose_leader_stopped_mid_plan() -> None:
    w = running_vm(Config())
    stuck = w._replace(pods=(), workers=(w.workers[0]._replace(pc="stopped"),
                                         *w.workers[1:]))
    verdict = Liveness(Actors(Config()), 100).check(stuck)
    assert verdict is not None and verdict[0].invariant == "converges"


@pytest.mark.unit
def test_a_lock_left_by_a_deposed_leader_of_a_deleted_vm_is_swept() -> None:
    w = running_vm(Config())
    gone = w._replace(vm=None, pods=(), lock=Lock(epoch=1, token=9), workers=(
        w.workers[0]._replace(pc="halt"), w.workers[1]))
    assert converged(gone) is not None
    assert Liveness(Actors(Config()), 100).check(gone) is None


@pytest.mark.unit
def test_a_counterexample_prints_actor_action_and_resulting_state() -> None:
    cx = first(lockless_pod_deleted(broken("cached_ungate"),
                                    Budget(pod_delete=1, dropped_event=1)))
    text = format_counterexample(cx)
    assert text.startswith("VIOLATION at-most-one-runnable")
    assert "user: kubectl delete pod" in text and "PATCH pod" in text and "⇒ VM{" in text


# ---- the CLI ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_cli_exits_1_with_the_trace_when_the_driver_is_broken() -> None:
    result = CliRunner().invoke(verify, [
        "explore", "--scenario", "lockless-pod-deleted", "--break", "cached_ungate",
        "--no-liveness", "-o", "json"])
    assert result.exit_code == 1, result.output
    assert '"invariant": "at-most-one-runnable"' in result.output
    assert '"total_states"' in result.output


@pytest.mark.unit
def test_the_cli_lists_what_can_be_chosen() -> None:
    runner = CliRunner()
    assert "paused-writers" in runner.invoke(verify, ["scenarios"]).output
    assert "blind_retry" in runner.invoke(verify, ["breakages", "-o", "json"]).output
    assert "at-most-one-runnable" in runner.invoke(verify, ["invariants"]).output
    bad = runner.invoke(verify, ["explore", "--scenario", "nope"])
    assert bad.exit_code == 2 and "unknown scenario 'nope'" in bad.output


# ---- replay against the real API server ----------------------------------------------------


REPLAYS = {
    "seed-retry": (broken("blind_retry"), Budget(pod_delete=1, conflict=1), None),
    "cached-ungate": (broken("cached_ungate"), Budget(pod_delete=1, dropped_event=1), None),
    "list-before-get": (BEFORE_F4, Budget(pod_delete=1), "runs-only-the-committed-pod"),
}


@pytest.mark.cluster
@pytest.mark.parametrize("case", sorted(REPLAYS))
def test_a_counterexample_replayed_on_the_real_api_server_ends_in_the_same_violation(
        case: str, cluster: LocalCluster, api: client.ApiClient, namespace: str) -> None:
    cfg, budget, invariant = REPLAYS[case]
    scenario = lockless_pod_deleted(cfg, budget)
    cx = first(scenario)
    if invariant:
        assert cx.invariant == invariant
    controller = kube.api_client(cluster.kubeconfig_for("controller"))
    try:
        # The replayer checks, after every step, that the server answered as the model
        # said and holds exactly the model's VM and pods; it raises at any difference.
        result = Replayer(api, controller, namespace, cfg).run(scenario.world, cx.trace)
    finally:
        controller.close()
        core = client.CoreV1Api(api)
        for pod in core.list_namespaced_pod(namespace).items:
            core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
    assert result.vm is not None
    status = result.vm.get("status") or {}
    if case == "cached-ungate":
        assert len(result.runnable) == 2
    elif case == "seed-retry":
        # The stale retry put back a status that names the deleted pod, restart undone.
        last = cx.trace[-1][1]
        assert last.vm is not None
        assert status.get("restartCount", 0) == last.vm.status.restart_count
        assert status.get("restartCount", 0) < max(
            w.vm.status.restart_count for _, w in cx.trace if w.vm is not None)
    else:
        # The pod that runs is not the one the VM's status names.
        assert len(result.runnable) == 1
        assert status.get("podName") != result.runnable[0]
