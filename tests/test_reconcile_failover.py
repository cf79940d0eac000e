"""Replicas of ``neonvm controller run`` as separate processes: crashes, failovers, faults.

Every test runs real processes against the real API server and the locks' etcd, with an
independent checker listing the namespace's pods continuously; the ``checker`` fixture
fails the test if any sample ever showed two live runner pods for one VM (strict form:
not gated and not fully gone). Leaders are killed with SIGKILL, or kill themselves with
``os._exit(137)`` right after a given step (fault injection), so nothing is cleaned up:
the next leader must resume from what is recorded in the API server.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from neonvm.api import types
from neonvm.controller.faults import CRASH_EXIT_CODE, read_crash_record
from neonvm.dev.cluster import LocalCluster
from neonvm.invariant import InvariantChecker
from neonvm.leader.etcd import Etcd
from neonvm.leader.lock import Installation, LockTable, lock_key
from tests.support import (
    create_pull_secret,
    health_port,
    metrics_of,
    wait_for,
)
from tests.support.failover import leader_of, only_pod, vm_status
from tests.support.harness import (
    Replicas,
    converged,
    create_vm,
    delete_vm,
    get_vm,
    is_gated,
    list_vms,
    runner_pods,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

HOLD = "test.neon.tech/hold"


def vm_version(api: client.ApiClient, namespace: str, name: str) -> str:
    vm = get_vm(api, namespace, name)
    assert vm is not None
    return str(vm["metadata"]["resourceVersion"])


def locks_of(cluster: LocalCluster, prefix: str, namespace: str) -> list[Any]:
    etcd = Etcd(cluster.locks_etcd_config(prefix))
    try:
        return LockTable(etcd, prefix).list(namespace)
    finally:
        etcd.close()


def grace(cluster: LocalCluster) -> dict[str, Any]:
    """With simulated nodes, a short graceful shutdown keeps the old pod around briefly."""
    return {"terminationGracePeriodSeconds": 3} if cluster.spec.nodes else {}


# ---- crash right after each step -------------------------------------------------------------


@pytest.mark.parametrize("step", ["plan", "create", "commit", "ungate"])
def test_the_next_leader_resumes_the_plan_of_a_leader_killed_right_after(
        step: str, cluster: LocalCluster, api: client.ApiClient, namespace: str,
        replicas: Replicas, checker: InvariantChecker, tmp_path: Path) -> None:
    record_path = tmp_path / "crash.json"
    doomed = replicas.start("doomed", faults=f"crash_after={step},crash_record={record_path}")
    assert leader_of(replicas) is doomed
    replicas.start("standby")
    created = create_vm(api, namespace, "vm", spec=grace(cluster))

    wait_for(lambda: doomed.exit_code() is not None, 60, what=f"crash after {step}")
    assert doomed.exit_code() == CRASH_EXIT_CODE
    record = read_crash_record(record_path)
    assert record is not None, "the crash left its record (the supervisor's signal)"
    assert (record["fault"], record["step"], record["vm"], record["pid"]) == (
        "crash_after", step, f"{namespace}/vm", doomed.pid)
    wait_for(lambda: converged(api, namespace, ["vm"]), 90, what="convergence")

    status = vm_status(api, namespace, "vm")
    assert status["planSeq"] == 1, "the recorded plan was resumed, not replaced"
    assert status["podName"] == f"vm-{created['metadata']['uid'][:8]}-1"
    assert status["restartCount"] == 0
    wait_for(lambda: vm_status(api, namespace, "vm")["fence"]["epoch"] >= 1, 30,
             what="the next leader's fence on the VM")


def test_a_leader_killed_right_after_the_restart_write_is_resumed_once(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, replicas: Replicas,
        checker: InvariantChecker) -> None:
    doomed = replicas.start("doomed", faults="crash_after=restart")
    assert leader_of(replicas) is doomed
    replicas.start("standby")
    create_vm(api, namespace, "vm", spec=grace(cluster))
    wait_for(lambda: converged(api, namespace, ["vm"]), 60)
    first = only_pod(api, namespace, "vm")

    client.CoreV1Api(api).delete_namespaced_pod(first, namespace)
    wait_for(lambda: doomed.exit_code() is not None, 60, what="crash after restart")
    assert doomed.exit_code() == CRASH_EXIT_CODE
    wait_for(lambda: converged(api, namespace, ["vm"])
             and only_pod(api, namespace, "vm") != first, 90)
    status = vm_status(api, namespace, "vm")
    assert (status["restartCount"], status["planSeq"]) == (1, 2)


def test_a_leader_killed_while_cleaning_up_a_deleted_vm_leaves_nothing_behind(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, prefix: str,
        replicas: Replicas, checker: InvariantChecker) -> None:
    doomed = replicas.start("doomed", faults="crash_after=cleanup")
    assert leader_of(replicas) is doomed
    replicas.start("standby")
    create_vm(api, namespace, "vm", spec=grace(cluster))
    create_vm(api, namespace, "stays", spec=grace(cluster))
    wait_for(lambda: converged(api, namespace, ["vm", "stays"]), 60)
    assert {lock.name for lock in locks_of(cluster, prefix, namespace)} == {"vm", "stays"}

    delete_vm(api, namespace, "vm")
    wait_for(lambda: doomed.exit_code() is not None, 60, what="crash after cleanup")
    assert doomed.exit_code() == CRASH_EXIT_CODE
    wait_for(lambda: get_vm(api, namespace, "vm") is None, 90, what="VM finalized")
    assert runner_pods(api, namespace, "vm") == []
    wait_for(lambda: {lock.name for lock in locks_of(cluster, prefix, namespace)}
             == {"stays"}, 60, what="the deleted VM's lock released or swept")
    assert converged(api, namespace, ["stays"])


# ---- the seed's scenario, with processes -----------------------------------------------------


def test_a_deleted_runner_pod_gets_exactly_one_replacement_started_after_the_old_is_gone(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, replicas: Replicas,
        checker: InvariantChecker) -> None:
    replicas.start("a")
    replicas.start("b")
    create_vm(api, namespace, "seed", spec={"terminationGracePeriodSeconds": 5})
    wait_for(lambda: converged(api, namespace, ["seed"]), 60)
    old = only_pod(api, namespace, "seed")
    core = client.CoreV1Api(api)
    if not cluster.spec.nodes:
        # Without a kubelet, hold the pod in Terminating as a slow guest shutdown would.
        core.patch_namespaced_pod(old, namespace, {"metadata": {"finalizers": [HOLD]}})
    core.delete_namespaced_pod(old, namespace)

    def replacement_waiting() -> str | None:
        pods = {p.metadata.name: p for p in runner_pods(api, namespace, "seed")}
        new = vm_status(api, namespace, "seed").get("podName")
        if old in pods and new in pods and new != old:
            assert is_gated(pods[new]), "the replacement runs beside the old pod"
            return str(new)
        return None

    new = wait_for(replacement_waiting, 60, what="a gated replacement beside the old pod")
    if not cluster.spec.nodes:
        core.patch_namespaced_pod(old, namespace, {"metadata": {"finalizers": None}})
    wait_for(lambda: converged(api, namespace, ["seed"]), 90)
    assert only_pod(api, namespace, "seed") == new
    assert vm_status(api, namespace, "seed")["restartCount"] == 1


# ---- many VMs, three replicas, the leader killed ---------------------------------------------


def test_three_replicas_and_many_vms_converge_with_no_duplicates_when_the_leader_dies(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, replicas: Replicas,
        checker: InvariantChecker) -> None:
    for name in ("r1", "r2", "r3"):
        replicas.start(name)
    first = leader_of(replicas)
    names = [f"vm-{i:02d}" for i in range(24)]
    for name in names:
        create_vm(api, namespace, name, spec=grace(cluster))

    def some_progress() -> bool:
        done = [v for v in list_vms(api, namespace) if (v.get("status") or {}).get("podName")]
        return len(done) >= 6

    wait_for(some_progress, 120, what="the first leader at work")
    first.kill()
    second = wait_for(lambda: (lambda r: r if r is not None and r is not first else None)(
        replicas.leader()), 60, what="a new leader")
    assert second is not first
    wait_for(lambda: converged(api, namespace, names), 240, what="all VMs converge")

    # The seed's scenario on a handful of VMs, under the new leader.
    victims = names[:5]
    before = {n: only_pod(api, namespace, n) for n in victims}
    for n in victims:
        client.CoreV1Api(api).delete_namespaced_pod(before[n], namespace)
    wait_for(lambda: converged(api, namespace, names)
             and all(only_pod(api, namespace, n) != before[n] for n in victims), 180)
    for vm in list_vms(api, namespace):
        status = vm["status"]
        expected = 1 if vm["metadata"]["name"] in victims else 0
        assert status["restartCount"] == expected
        assert status["planSeq"] == expected + 1, "no VM was ever planned twice"


# ---- stale reads, dropped events, conflicts --------------------------------------------------


def test_stale_reads_dropped_events_and_conflicts_never_produce_a_second_pod(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, replicas: Replicas,
        checker: InvariantChecker) -> None:
    replica = replicas.start(
        "faulty", faults="stale_reads=0.3,drop_watch_events=0.3,conflict=0.3,seed=5")
    names = [f"vm-{i}" for i in range(5)]
    for name in names:
        create_vm(api, namespace, name, spec=grace(cluster))
    wait_for(lambda: converged(api, namespace, names), 120)
    for round_ in range(2):
        before = {n: only_pod(api, namespace, n) for n in names}
        for n in names:
            client.CoreV1Api(api).delete_namespaced_pod(before[n], namespace)
        wait_for(lambda before=before: converged(api, namespace, names)  # type: ignore[misc]
                 and all(only_pod(api, namespace, n) != before[n] for n in names),
                 180, what=f"round {round_}")
    for name in names:
        status = vm_status(api, namespace, name)
        assert (status["restartCount"], status["planSeq"]) == (2, 3)
    assert replica.running()
    assert "absorbed" in replica.log(), "injected conflicts were met and absorbed"


# ---- graceful handover -----------------------------------------------------------------------


def test_sigterm_releases_locks_and_lease_and_a_standby_carries_on(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, prefix: str,
        replicas: Replicas, checker: InvariantChecker) -> None:
    first = replicas.start("first")
    assert leader_of(replicas) is first
    standby = replicas.start("standby")
    create_vm(api, namespace, "vm", spec=grace(cluster))
    wait_for(lambda: converged(api, namespace, ["vm"]), 60)
    (lock,) = locks_of(cluster, prefix, namespace)
    assert lock.record.holder == first.identity

    assert first.terminate() == 0
    assert "released the Lease" in first.log()
    assert wait_for(replicas.leader, 30) is standby
    wait_for(lambda: [lk.record.holder for lk in locks_of(cluster, prefix, namespace)]
             == [standby.identity], 30, what="the standby takes the VM's lock")
    pod = only_pod(api, namespace, "vm")
    client.CoreV1Api(api).delete_namespaced_pod(pod, namespace)
    wait_for(lambda: converged(api, namespace, ["vm"])
             and only_pod(api, namespace, "vm") != pod, 60)
    assert types.FINALIZER in (get_vm(api, namespace, "vm") or {})["metadata"]["finalizers"]


# ---- orphans and quota -----------------------------------------------------------------------


def test_a_pod_whose_vm_vanished_without_the_controller_is_swept(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, replicas: Replicas,
        checker: InvariantChecker) -> None:
    first = replicas.start("first")
    create_vm(api, namespace, "gone", spec=grace(cluster))
    create_vm(api, namespace, "kept", spec=grace(cluster))
    wait_for(lambda: converged(api, namespace, ["gone", "kept"]), 60)
    orphan = only_pod(api, namespace, "gone")
    assert first.terminate() == 0

    # Someone strips the finalizer and deletes the VM while no controller runs.
    custom = client.CustomObjectsApi(api)
    custom.patch_namespaced_custom_object(types.GROUP, types.VERSION, namespace, types.PLURAL,
                                          "gone", {"metadata": {"finalizers": None}})
    delete_vm(api, namespace, "gone")
    wait_for(lambda: get_vm(api, namespace, "gone") is None, 30)

    second = replicas.start("second", args=["--orphan-grace", "0", "--sweep", "1"])
    wait_for(lambda: not runner_pods(api, namespace, "gone"), 60, what=f"{orphan} removed")
    if not cluster.spec.nodes:  # no garbage collector: it was the controller's sweep
        wait_for(lambda: "its VM no longer exists" in second.log(), 30)
    assert converged(api, namespace, ["kept"])


@pytest.mark.nodes
def test_a_replacement_refused_for_quota_while_the_old_pod_terminates_is_retried(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, replicas: Replicas,
        checker: InvariantChecker) -> None:
    if not cluster.spec.nodes:
        pytest.skip("needs simulated nodes: a terminating pod counts against quota only "
                    "while its kubelet shuts it down")
    client.CoreV1Api(api).create_namespaced_resource_quota(
        namespace, {"metadata": {"name": "one-pod"}, "spec": {"hard": {"pods": "1"}}})
    replica = replicas.start("only")
    create_vm(api, namespace, "vm", spec={"terminationGracePeriodSeconds": 5})
    wait_for(lambda: converged(api, namespace, ["vm"]), 60)
    old = only_pod(api, namespace, "vm")
    client.CoreV1Api(api).delete_namespaced_pod(old, namespace)

    wait_for(lambda: "exceeded quota" in replica.log(), 60, what="the create refused by quota")
    wait_for(lambda: converged(api, namespace, ["vm"])
             and only_pod(api, namespace, "vm") != old, 90)
    status = vm_status(api, namespace, "vm")
    assert (status["restartCount"], status["planSeq"]) == (1, 2)
    degraded = next((c for c in [*(status.get("conditions") or []),
                                 *(status.get("extraConditions") or [])]
                     if c["type"] == "Degraded"), None)
    assert degraded is None, "quota is transient: retried, not Degraded"


def test_a_vm_waiting_for_its_pull_secret_is_left_alone_until_it_exists_then_converges(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, replicas: Replicas,
        checker: InvariantChecker) -> None:
    leader = replicas.start("only")
    assert leader_of(replicas) is leader
    create_vm(api, namespace, "vm", spec={**grace(cluster),
                                          "imagePullSecrets": [{"name": "regcred"}]})

    def degraded() -> dict[str, Any] | None:
        return next((c for c in vm_status(api, namespace, "vm").get("conditions") or []
                     if c["type"] == "Degraded" and c["status"] == "True"), None)

    cond = wait_for(degraded, 60, what="Degraded for the missing pull secret")
    assert cond is not None and cond["reason"] == "ImagePullSecretNotFound"
    planned = vm_status(api, namespace, "vm")["pendingPod"]["name"]
    port = wait_for(lambda: health_port(leader), 30)
    waits = 'neonvm_controller_reconciles_total{result="wait"}'
    scans = 'neonvm_controller_scans_total{scan="mid_plan"}'
    # Degraded is visible before the first Wait is counted (the count follows the status
    # write), and that write's own watch event brings one more look. Let both settle.
    first = wait_for(lambda: (m := metrics_of(port)).get(waits, 0) >= 1 and m, 30,
                     what="the first Wait counted")
    before = wait_for(lambda: (m := metrics_of(port)).get(scans, 0) >= first.get(scans, 0) + 2
                      and m, 30, what="two scans after the first Wait")
    started = time.monotonic()
    version = vm_version(api, namespace, "vm")

    # Six mid-plan scans pass (one every 2 s), and none of them reconciles or writes the
    # held-back VM: only its own 15 s requeue looks at it again.
    after = wait_for(lambda: (m := metrics_of(port)).get(scans, 0) >= before.get(scans, 0) + 6
                     and m,
                     60, what="six mid-plan scans")
    requeues_due = 1 + int((time.monotonic() - started) // 15)
    assert vm_version(api, namespace, "vm") == version
    assert after.get(waits, 0) - before.get(waits, 0) <= requeues_due, (
        "rechecked by its own 15 s wait, not by every scan")
    assert not runner_pods(api, namespace, "vm")

    create_pull_secret(api, namespace, "regcred")
    wait_for(lambda: converged(api, namespace, ["vm"]), 90, what="convergence")
    assert only_pod(api, namespace, "vm") == planned, "the recorded plan went ahead"
    wait_for(lambda: degraded() is None, 30, what="Degraded cleared after the commit")
    events = client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector="involvedObject.name=vm").items
    assert [e.reason for e in events].count("ImagePullSecretNotFound") == 1


def test_a_deleted_vm_whose_deletion_the_cache_missed_is_never_locked_again(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, prefix: str,
        replicas: Replicas, checker: InvariantChecker) -> None:
    # The VM exists before the replica starts, so its first list caches it; every watch
    # event after that is dropped, so the cache keeps that first version for good.
    create_vm(api, namespace, "vm", spec=grace(cluster))
    blind = replicas.start("blind", faults="drop_watch_events=0.999,seed=1",
                           args=["--resync", "3"])
    wait_for(lambda: converged(api, namespace, ["vm"]), 90, what="convergence")
    delete_vm(api, namespace, "vm")
    wait_for(lambda: get_vm(api, namespace, "vm") is None, 90, what="the VM gone")
    wait_for(lambda: not locks_of(cluster, prefix, namespace), 30, what="its lock released")
    etcd = Etcd(cluster.locks_etcd_config(prefix))
    try:
        table = LockTable(etcd, prefix)
        infos, since = table.snapshot(namespace)
        assert not infos
        port = wait_for(lambda: health_port(blind), 30)
        resyncs = 'neonvm_controller_scans_total{scan="resync"}'
        before = metrics_of(port)
        wait_for(lambda: metrics_of(port).get(resyncs, 0) >= before.get(resyncs, 0) + 3, 60,
                 what="three resyncs")
        assert metrics_of(port).get("neonvm_controller_cache_evictions_total", 0) >= 1
        installation = Installation(namespace, replicas.lease_name)
        stream = etcd.watch(lock_key(prefix, installation, namespace, "vm"),
                            start_revision=since + 1,
                            timeout=1.0)
        try:
            retaken = [e.revision for e in stream if e.kind == "put"]
        finally:
            stream.close()
    finally:
        etcd.close()
    assert retaken == [], (
        f"the lock of the deleted VM was taken again at revisions {retaken}: a requeue "
        f"started from the cache, which still holds the VM")


# ---- health and metrics ------------------------------------------------------------------


def test_the_leader_serves_health_and_reconcile_metrics(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, replicas: Replicas,
        checker: InvariantChecker) -> None:
    leader = replicas.start("leader")
    assert leader_of(replicas) is leader
    create_vm(api, namespace, "vm", spec=grace(cluster))
    wait_for(lambda: converged(api, namespace, ["vm"]), 60)
    port = wait_for(lambda: health_port(leader), 30)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
        assert resp.status == 200
    metrics: dict[str, float] = {}

    def scrape() -> bool:
        metrics.update(metrics_of(port))
        # The VM converging and its reconcile ending in Done are separate moments.
        return (metrics.get("neonvm_controller_locks_held", 0) >= 1
                and metrics.get('neonvm_controller_reconciles_total{result="done"}', 0) >= 1
                and metrics.get('neonvm_controller_scans_total{scan="mid_plan"}', 0) >= 1)

    wait_for(scrape, 30)
    assert metrics["neonvm_controller_leading"] == 1
    assert metrics['neonvm_controller_actions_total{action="Ungate",outcome="done"}'] >= 1
    assert metrics['neonvm_controller_reconciles_total{result="done"}'] >= 1
    assert "neonvm_controller_queue_depth" in metrics
    assert metrics["neonvm_leader_is_leader"] == 1
