"""The judges (``neonvm check``, the watching checker) and the drills, as specifications.

The judges are tested first on fabricated states, with the controller *not* running:
a test builds the very violation a judge must report (two ungated pods, a pod nobody
owns, a lock for a VM that does not exist, a plan stuck in status) and expects the judge
to report it, and to stay quiet on a healthy state. Then whole drills run against the
session's control plane with real controller replicas and must pass.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from kubernetes import client

from neonvm.api import types
from neonvm.cli import main
from neonvm.dev.cluster import LocalCluster
from neonvm.drills import fleet
from neonvm.drills.check import (
    DUPLICATE,
    DUPLICATE_LOOSE,
    ORPHAN_LOCK,
    ORPHAN_POD,
    POD_MISSING,
    STUCK,
    ClusterSnapshot,
    LockView,
    check,
    evaluate,
)
from neonvm.drills.observer import PodWatchChecker, ReplacementClock, Watchdog, is_live
from neonvm.invariant import live_pods_by_vm
from tests.support import wait_for

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)

# ---- fabricated objects (pure tests) ------------------------------------------------------


def pod_dict(name: str, vm: str = "vm", *, gated: bool = False, phase: str = "Running",
             terminating: bool = False, vm_uid: str = "uid-vm", namespace: str = "ns",
             created: dt.datetime = NOW, deletion: dt.datetime | None = None
             ) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name, "namespace": namespace, "uid": f"uid-{name}",
        "labels": {types.LABEL_VM_NAME: vm, types.LABEL_VM_UID: vm_uid},
        "creationTimestamp": created.isoformat(), "resourceVersion": "1",
    }
    if terminating or deletion is not None:
        meta["deletionTimestamp"] = (deletion or NOW).isoformat()
    spec: dict[str, Any] = {"containers": [{"name": "runner", "image": "x"}]}
    if gated:
        spec["schedulingGates"] = [{"name": types.SCHEDULING_GATE}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec,
            "status": {"phase": phase}}


def as_v1(pod: dict[str, Any]) -> client.V1Pod:
    """The same pod as the typed client returns it."""
    v1: client.V1Pod = client.ApiClient().deserialize(json.dumps(pod), "V1Pod",
                                                      "application/json")
    return v1


def vm_dict(name: str = "vm", *, uid: str = "uid-vm", status: dict[str, Any] | None = None,
            created: dt.datetime = NOW, status_written: dt.datetime | None = None,
            deleting: dt.datetime | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "uid": uid,
                            "creationTimestamp": created.isoformat()}
    if status_written is not None:
        meta["managedFields"] = [{"manager": "neonvm", "operation": "Update",
                                  "subresource": "status",
                                  "time": status_written.isoformat()}]
    if deleting is not None:
        meta["deletionTimestamp"] = deleting.isoformat()
        meta["finalizers"] = [types.FINALIZER]
    return {"metadata": meta, "status": status or {}}


def snapshot(pods: list[dict[str, Any]], vms: list[dict[str, Any]],
             locks: list[LockView] | None = None, now: dt.datetime = NOW) -> ClusterSnapshot:
    typed = [as_v1(p) for p in pods]
    return ClusterSnapshot(typed, vms, typed, locks, now)


def kinds(findings: list[Any]) -> list[str]:
    return sorted(f.kind for f in findings)


# ---- the liveness rule and the pure judgement ------------------------------------------------


@pytest.mark.unit
def test_the_watching_checker_uses_the_same_liveness_rule_as_the_polling_one() -> None:
    pods = [pod_dict("a"), pod_dict("b", gated=True), pod_dict("c", terminating=True),
            pod_dict("d", phase="Succeeded"), pod_dict("e", phase="Pending"),
            pod_dict("f", phase="Failed", terminating=True)]
    for strict in (True, False):
        polled = live_pods_by_vm([as_v1(p) for p in pods], strict)["ns/vm"]
        watched = [p["metadata"]["name"] for p in pods if is_live(p, strict)]
        assert sorted(polled) == sorted(watched)
    assert sorted(live_pods_by_vm([as_v1(p) for p in pods], True)["ns/vm"]) == ["a", "c", "e"]


@pytest.mark.unit
def test_a_healthy_fleet_has_no_findings() -> None:
    pods = [pod_dict("vm-1"), pod_dict("old", terminating=True, gated=False, phase="Succeeded")]
    vms = [vm_dict(status={"podName": "vm-1", "podUID": "uid-vm-1", "phase": "Running"},
                   status_written=NOW)]
    assert evaluate(snapshot(pods, vms, []), max_pending_seconds=60) == []


@pytest.mark.unit
def test_two_live_pods_are_a_duplicate_and_a_terminating_one_still_counts_strictly() -> None:
    vms = [vm_dict(status={"podName": "a", "phase": "Running"})]
    both_running = evaluate(snapshot([pod_dict("a"), pod_dict("b")], vms), 60)
    assert kinds(both_running) == [DUPLICATE, DUPLICATE_LOOSE]
    assert both_running[0].objects == ("a", "b")
    one_terminating = evaluate(snapshot([pod_dict("a"), pod_dict("b", terminating=True)],
                                        vms), 60)
    assert kinds(one_terminating) == [DUPLICATE]
    one_gated = evaluate(snapshot([pod_dict("a"), pod_dict("b", gated=True)], vms), 60)
    assert one_gated == []


@pytest.mark.unit
def test_a_pod_name_in_status_that_does_not_exist_is_reported() -> None:
    vms = [vm_dict(status={"podName": "ghost", "phase": "Running"})]
    assert kinds(evaluate(snapshot([], vms), 60)) == [POD_MISSING]
    replaced = [vm_dict(status={"podName": "a", "podUID": "other", "phase": "Running"})]
    assert kinds(evaluate(snapshot([pod_dict("a")], replaced), 60)) == [POD_MISSING]
    terminal = [vm_dict(status={"podName": "ghost", "phase": "Succeeded"})]
    assert evaluate(snapshot([], terminal), 60) == []


@pytest.mark.unit
def test_orphan_pods_are_reported_unless_still_within_their_grace_period() -> None:
    vms = [vm_dict("vm", uid="new-uid", status={"podName": "", "pendingPod": None},
                   status_written=NOW)]
    stale_uid = pod_dict("old", vm_uid="old-uid")
    no_vm = pod_dict("lost", vm="gone")
    leaving = pod_dict("leaving", vm="gone", deletion=NOW + dt.timedelta(seconds=20))
    stuck = pod_dict("stuck", vm="gone", deletion=NOW - dt.timedelta(seconds=20))
    found = evaluate(snapshot([stale_uid, no_vm, leaving, stuck], vms), 60)
    orphans = sorted(f.objects[0] for f in found if f.kind == ORPHAN_POD)
    assert orphans == ["lost", "old", "stuck"]


@pytest.mark.unit
def test_a_lock_for_a_vm_uid_that_does_not_exist_is_an_orphan() -> None:
    vms = [vm_dict(status={"podName": "a", "phase": "Running"})]
    locks = [LockView("ns", "vm", "uid-vm", "r1", 10), LockView("ns", "old", "uid-old", "r1", 11),
             LockView("ns", "bad", None, None, 12)]
    found = evaluate(snapshot([pod_dict("a")], vms, locks), 60)
    assert [(f.kind, f.vm) for f in found] == [(ORPHAN_LOCK, "ns/old")]


@pytest.mark.unit
def test_stuck_is_judged_on_a_lower_bound_of_age_from_the_servers_clock() -> None:
    long_ago = NOW - dt.timedelta(seconds=300)
    recent = NOW - dt.timedelta(seconds=5)
    plan = {"pendingPod": {"name": "vm-p2", "planSeq": 2}, "planSeq": 2}
    # Last status write long ago: the plan is at least that old.
    assert kinds(evaluate(snapshot([], [vm_dict(status=plan, status_written=long_ago)]),
                          60)) == [STUCK]
    # Written recently and no pod yet: not provably old.
    assert evaluate(snapshot([], [vm_dict(status=plan, status_written=recent)]), 60) == []
    # Its pod was created long ago: the plan (recorded before) is older still.
    old_pod = pod_dict("vm-p2", gated=True, created=long_ago)
    assert kinds(evaluate(snapshot([old_pod], [vm_dict(status=plan, status_written=recent)]),
                          60)) == [STUCK]
    # Never planned although created long ago and never written since.
    assert kinds(evaluate(snapshot([], [vm_dict(status={}, created=long_ago)]), 60)) == [STUCK]
    assert evaluate(snapshot([], [vm_dict(status={}, created=recent)]), 60) == []
    # A deletion that does not finish.
    assert kinds(evaluate(snapshot([], [vm_dict(deleting=long_ago)]), 60)) == [STUCK]


@pytest.mark.unit
def test_the_replacement_clock_times_creation_after_a_delete_and_start_after_the_old_pod_went(
) -> None:
    clock = ReplacementClock()
    old = pod_dict("p1")
    clock.observe("MODIFIED", old, pod_dict("p1", terminating=True), now=10.0)
    clock.observe("ADDED", None, pod_dict("p2", gated=True), now=10.4)
    clock.observe("DELETED", pod_dict("p1", terminating=True), pod_dict("p1", terminating=True),
                  now=12.0)
    clock.observe("MODIFIED", pod_dict("p2", gated=True), pod_dict("p2"), now=12.5)
    assert clock.created == pytest.approx([0.4])
    assert clock.started == pytest.approx([0.5])
    # The old pod's disappearance is not a new deletion: the next one starts the clock.
    clock.observe("MODIFIED", pod_dict("p2"), pod_dict("p2", terminating=True), now=20.0)
    clock.observe("ADDED", None, pod_dict("p3", gated=True), now=20.3)
    assert clock.created == pytest.approx([0.4, 0.3])


@pytest.mark.unit
def test_a_live_pod_deleted_without_notice_is_lost_work_but_an_announced_one_is_not() -> None:
    checker = PodWatchChecker(client.ApiClient(), "ns")
    running = pod_dict("p1")
    checker._apply("ADDED", running)
    checker.expect_pod_deletion("p1")
    checker._apply("MODIFIED", pod_dict("p1", terminating=True))
    assert checker.report.unexpected_deletions == []
    checker._apply("ADDED", pod_dict("p2", vm="vm2"))
    checker._apply("MODIFIED", pod_dict("p2", vm="vm2", terminating=True))
    assert [u.pod for u in checker.report.unexpected_deletions] == ["p2"]
    checker._apply("ADDED", pod_dict("p3", vm="vm3", vm_uid="dying"))
    checker.expect_vm_deletion("dying")
    checker._apply("DELETED", pod_dict("p3", vm="vm3", vm_uid="dying"))
    gated = pod_dict("p4", vm="vm4", gated=True)
    checker._apply("ADDED", gated)
    checker._apply("DELETED", gated)
    assert [u.pod for u in checker.report.unexpected_deletions] == ["p2"]
    assert checker.report.strict == []


# ---- against the real servers (no controller running) ---------------------------------------


def make_vm(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = client.CustomObjectsApi(api).create_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, fleet.vm_body(name))
    return obj


def make_runner_pod(api: client.ApiClient, namespace: str, name: str, vm: dict[str, Any]
                    ) -> client.V1Pod:
    """A gated pod labelled for ``vm`` (``api`` must be the controller's: the admission
    fence lets no one else create a runner pod)."""
    meta = vm["metadata"]
    body = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {types.LABEL_VM_NAME: meta["name"],
                                              types.LABEL_VM_UID: meta["uid"]}},
        "spec": {"schedulingGates": [{"name": types.SCHEDULING_GATE}],
                 "terminationGracePeriodSeconds": 0,
                 "containers": [{"name": "runner", "image": "neonvm-runner:dev"}]},
    }
    pod: client.V1Pod = client.CoreV1Api(api).create_namespaced_pod(namespace, body)
    return pod


def ungate(controller_api: client.ApiClient, namespace: str, name: str) -> None:
    """Remove the gate as the controller's identity (the only one the fence allows)."""
    client.CoreV1Api(controller_api).patch_namespaced_pod(
        name, namespace, [{"op": "remove", "path": "/spec/schedulingGates/0"}])


def run_cli(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


@pytest.mark.cluster
def test_check_passes_an_empty_namespace_and_reports_two_ungated_pods_of_one_vm(
        cluster: LocalCluster, api: client.ApiClient, controller_api: client.ApiClient,
        namespace: str) -> None:
    kubeconfig = str(cluster.kubeconfig)
    ok = run_cli("check", "--kubeconfig", kubeconfig, "-n", namespace, "-o", "json")
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["ok"] is True

    vm = make_vm(api, namespace, "twin")
    for name in ("twin-a", "twin-b"):
        make_runner_pod(controller_api, namespace, name, vm)
        ungate(controller_api, namespace, name)
    bad = run_cli("check", "--kubeconfig", kubeconfig, "-n", namespace, "-o", "json")
    assert bad.exit_code == 1
    report = json.loads(bad.stdout)
    duplicates = [f for f in report["findings"] if f["kind"] == DUPLICATE]
    assert [d["objects"] for d in duplicates] == [["twin-a", "twin-b"]]
    table = run_cli("check", "--kubeconfig", kubeconfig, "-n", namespace)
    assert table.exit_code == 1 and "VIOLATED" in table.output and "twin-b" in table.output


@pytest.mark.cluster
def test_check_reports_orphans_missing_pods_and_stuck_plans(
        cluster: LocalCluster, api: client.ApiClient, controller_api: client.ApiClient,
        namespace: str) -> None:
    custom = client.CustomObjectsApi(api)
    vm = make_vm(api, namespace, "lonely")
    # A pod for a VM uid that does not exist (a deleted VM of the same name).
    make_runner_pod(controller_api, namespace, "lonely-old",
                    {"metadata": {"name": "lonely", "uid": str(uuid.uuid4())}})
    # Status naming a pod that does not exist, and a plan recorded in status.
    vm["status"] = {"podName": "lonely-ghost", "phase": "Running",
                    "pendingPod": {"name": "lonely-next", "planSeq": 2}, "planSeq": 2}
    custom.replace_namespaced_custom_object_status(
        types.GROUP, types.VERSION, namespace, types.PLURAL, "lonely", vm)
    # A lock for a VM uid that does not exist, in the locks' etcd.
    from neonvm.leader.etcd import Etcd, Put
    from neonvm.leader.lock import DEFAULT_INSTALLATION, LockRecord, lock_key

    config = cluster.locks_etcd_config()
    orphan_key = lock_key(config.prefix, DEFAULT_INSTALLATION, namespace, "deleted-vm")
    with Etcd(config) as etcd:
        etcd.txn([], [Put(orphan_key, LockRecord("someone", 1, "no-such-uid", 0.0).encode())])
    def findings() -> set[tuple[str, str]]:
        # Ages have one-second resolution: the plan is "older than 0s" a moment later.
        result = run_cli("check", "--kubeconfig", str(cluster.kubeconfig), "-n", namespace,
                         "--etcd-endpoints", cluster.locks_etcd_url,
                         "--max-pending-seconds", "0", "-o", "json", env=config.env())
        assert result.exit_code == 1, result.output
        return {(f["kind"], f["vm"]) for f in json.loads(result.stdout)["findings"]}

    found = wait_for(lambda: (lambda f: f if (STUCK, f"{namespace}/lonely") in f else None)(
        findings()), 30, what="the plan is provably older than 0s")
    assert found == {
        (ORPHAN_POD, f"{namespace}/lonely"),
        (POD_MISSING, f"{namespace}/lonely"),
        (STUCK, f"{namespace}/lonely"),
        (ORPHAN_LOCK, f"{namespace}/deleted-vm"),
    }
    with Etcd(config) as etcd:
        etcd.delete(orphan_key)


@pytest.mark.cluster
def test_with_settle_a_finding_that_resolves_is_dropped_but_a_duplicate_never_is(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    vm = make_vm(api, namespace, "settling")
    make_runner_pod(controller_api, namespace, "orphan", {"metadata": {"name": "gone", "uid": "x"}})
    for name in ("settling-a", "settling-b"):
        make_runner_pod(controller_api, namespace, name, vm)
        ungate(controller_api, namespace, name)

    def meanwhile(_seconds: float) -> None:
        client.CoreV1Api(api).delete_namespaced_pod("orphan", namespace,
                                                   grace_period_seconds=0)
        wait_for(lambda: not [p for p in fleet.list_runner_pods(api, namespace)
                              if p.metadata.name == "orphan"], 30, what="orphan gone")

    report = check(api, namespace=namespace, settle=1.0, sleep=meanwhile)
    assert report.passes == 2
    assert kinds(report.findings) == [DUPLICATE, DUPLICATE_LOOSE]
    assert any("resolved" in n for n in report.notes)


@pytest.mark.cluster
def test_the_watchdog_sees_a_duplicate_and_an_unannounced_deletion(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    vm = make_vm(api, namespace, "watched")
    with Watchdog(api, namespace) as dog:
        for name in ("watched-a", "watched-b"):
            make_runner_pod(controller_api, namespace, name, vm)
        ungate(controller_api, namespace, "watched-a")
        ungate(controller_api, namespace, "watched-b")
        client.CoreV1Api(api).delete_namespaced_pod("watched-b", namespace)
        wait_for(lambda: dog.watcher.report.unexpected_deletions, 30,
                 what="the deletion is seen")
        report = dog.stop()
    assert [(v.vm, v.pods) for v in report.strict] == [
        (f"{namespace}/watched", ("watched-a", "watched-b"))]
    assert [u.pod for u in report.watch.unexpected_deletions] == ["watched-b"]
    assert not report.ok


# ---- drills ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_drills_refuse_a_real_cluster_without_yes_and_local_only_drills_anywhere_but_local(
        tmp_path: Path) -> None:
    other = tmp_path / "prod.kubeconfig"
    other.write_text("apiVersion: v1\nkind: Config\n")
    state = str(tmp_path / "state")
    refused = run_cli("drill", "kill-leader", "--state-dir", state, "--kubeconfig", str(other))
    assert refused.exit_code == 2 and "--yes" in refused.output
    local_only = run_cli("drill", "etcd-restart", "--state-dir", state, "--kubeconfig",
                         str(other), "--yes")
    assert local_only.exit_code == 2 and "local control plane" in local_only.output


@pytest.fixture
def drill_replicas(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """Replicas a drill starts in the session cluster are stopped afterwards."""
    yield cluster
    for i in range(3):
        cluster.stop_component(f"controller-{i}")


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["kill-leader", "--signal", "TERM"],
    ["pod-storm", "--storm-seconds", "5"],
], ids=["kill-leader-term", "pod-storm"])
def test_a_drill_against_the_local_control_plane_passes_with_no_duplicates(
        drill_replicas: LocalCluster, args: list[str]) -> None:
    cluster = drill_replicas
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_FAULTS")}
    result = run_cli("drill", *args, "--state-dir", str(cluster.state_dir), "--vms", "3",
                     "--replicas", "2", "--timeout", "180", "-o", "json", env=env)
    verdict = json.loads(result.stdout)
    assert result.exit_code == 0, verdict["failures"]
    assert verdict["ok"] and verdict["duplicates"] == 0 and verdict["duplicates_loose"] == 0
    assert verdict["convergence_seconds"] is not None
    assert verdict["watch"]["pod_events"] > 0
    if args[0] == "kill-leader":
        assert verdict["leader_after"] != verdict["leader_before"]
        assert verdict["failover_seconds"] is not None
    else:
        assert verdict["fault"]["pod deletions"] > 0
