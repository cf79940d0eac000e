"""Liveness, readiness and start-up of a controller replica, against the real servers.

* Liveness means "not wedged", readiness means "synced": a leader whose first LIST
  cannot finish (here: its identity may not list VMs and pods yet, the way a throttled
  API server or a huge fleet keeps a LIST from finishing) stays live, and is ready only
  once its caches synced. It does not hold the Lease forever though: past its sync
  deadline it steps down and releases the Lease, and a standby takes over.
* A Lease namespace that does not exist is one error line at start-up and exit code 1,
  not a warning every retry period forever.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from kubernetes import client

from neonvm import kube
from neonvm.controller.events import EventRecorder
from neonvm.controller.manager import ControllerConfig, ControllerProcess
from neonvm.dev.cluster import LocalCluster
from neonvm.leader.election import ElectionConfig
from neonvm.leader.health import HealthServer
from tests.support import wait_for

pytestmark = pytest.mark.cluster


def probe(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}?verbose",
                                    timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_a_leader_whose_caches_cannot_sync_stays_live_and_is_ready_only_once_synced(
        cluster: LocalCluster, api: client.ApiClient, namespace: str) -> None:
    rbac = client.RbacAuthorizationV1Api(api)
    user = f"syncing-{uuid.uuid4().hex[:8]}"

    def grant(name: str, rules: list[dict[str, object]]) -> None:
        rbac.create_namespaced_role(namespace, {"metadata": {"name": name}, "rules": rules})
        rbac.create_namespaced_role_binding(namespace, {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": name},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                          "name": user}]})

    # It may campaign, but not (yet) list what its caches hold.
    grant("elect", [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                     "verbs": ["get", "create", "update"]}])
    as_user = kube.api_client(cluster.kubeconfig)
    as_user.set_default_header("Impersonate-User", user)
    process = ControllerProcess(
        as_user, cluster.locks_etcd_config(f"/t-{uuid.uuid4().hex[:8]}"),
        ElectionConfig(namespace=namespace, name="probes", lease_duration=4,
                       renew_deadline=3, retry_period=0.5),
        # A sync deadline far beyond this test: it must stay leader while unsynced.
        ControllerConfig(workers=1, watch_namespace=namespace, sync_deadline_seconds=3600),
        events=EventRecorder(None))
    health = HealthServer(0, process.metrics.registry, host="127.0.0.1")
    process.register_health(health)
    health.start()
    stop = threading.Event()
    runner = threading.Thread(target=process.run, args=(stop,), daemon=True)
    runner.start()
    try:
        term = wait_for(lambda: process.term, 60, what="leading")
        # Leading, the informers' LISTs refused again and again: never synced.
        for _ in range(5):
            wait_for(lambda: probe(health.port, "/readyz")[0] == 500, 30,
                     what="not ready while the caches sync")
            status, body = probe(health.port, "/healthz")
            assert status == 200, body
            assert not any(i.synced.is_set() for i in term.informers)
        _, body = probe(health.port, "/readyz")
        assert "caches not synced yet" in body, body

        grant("cache", [{"apiGroups": ["vm.neon.tech"], "resources": ["virtualmachines"],
                         "verbs": ["list", "watch"]},
                        {"apiGroups": [""], "resources": ["pods"],
                         "verbs": ["list", "watch"]}])
        wait_for(lambda: probe(health.port, "/readyz")[0] == 200, 90,
                 what="ready once the caches synced")
        assert all(i.synced.is_set() for i in term.informers)
        assert probe(health.port, "/healthz")[0] == 200
    finally:
        stop.set()
        runner.join(30)
        health.stop()
        as_user.close()


def test_a_leader_whose_caches_do_not_sync_by_the_deadline_releases_the_lease_to_a_standby(
        cluster: LocalCluster, api: client.ApiClient, namespace: str) -> None:
    rbac = client.RbacAuthorizationV1Api(api)
    user = f"nosync-{uuid.uuid4().hex[:8]}"
    # It may campaign, but never list what its caches hold.
    rbac.create_namespaced_role(namespace, {
        "metadata": {"name": "elect"},
        "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                   "verbs": ["get", "create", "update"]}]})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "elect"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "elect"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                      "name": user}]})
    as_user = kube.api_client(cluster.kubeconfig)
    as_user.set_default_header("Impersonate-User", user)
    prefix = f"/t-{uuid.uuid4().hex[:8]}"

    def replica(identity: str) -> ControllerProcess:
        return ControllerProcess(
            as_user, cluster.locks_etcd_config(prefix),
            ElectionConfig(namespace=namespace, name="nosync", identity=identity,
                           lease_duration=4, renew_deadline=3, retry_period=0.5),
            ControllerConfig(workers=1, watch_namespace=namespace, sync_deadline_seconds=3),
            events=EventRecorder(None))

    def holder() -> str | None:
        lease = client.CoordinationV1Api(api).read_namespaced_lease("nosync", namespace)
        return lease.spec.holder_identity

    first, second = replica("first"), replica("second")
    stop = threading.Event()
    runners = [threading.Thread(target=p.run, args=(stop,), daemon=True)
               for p in (first, second)]
    try:
        runners[0].start()
        wait_for(lambda: first.term, 60, what="the first replica leading")
        runners[1].start()
        # The first leader's caches never sync: past its deadline it gives the Lease up
        # (rather than hold it while reconciling nothing) and the standby takes it.
        wait_for(lambda: holder() == "second", 60, what="the standby holding the Lease")
        steps = first.metrics.registry.get_sample_value(
            "neonvm_controller_sync_deadline_step_downs_total")
        assert steps is not None and steps >= 1, steps
    finally:
        stop.set()
        for runner in runners:
            if runner.is_alive() or runner.ident is not None:
                runner.join(30)
        as_user.close()


def test_a_missing_lease_namespace_is_one_error_line_and_exit_code_1(
        cluster: LocalCluster, tmp_path: Path) -> None:
    missing = f"no-such-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "controller.log"
    etcd = cluster.locks_etcd_config(f"/t-{uuid.uuid4().hex[:8]}")
    argv = [sys.executable, "-m", "neonvm", "controller", "run",
            "--kubeconfig", str(cluster.kubeconfig_for("controller")),
            "--etcd-endpoints", etcd.endpoints[0], "--etcd-ca", str(etcd.ca),
            "--etcd-cert", str(etcd.cert), "--etcd-key", str(etcd.key),
            "--etcd-prefix", etcd.prefix,
            "--lease-namespace", missing, "--health-port", "0", "--health-host", "127.0.0.1",
            "--lease-duration", "4", "--renew-deadline", "3", "--retry-period", "0.5"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: proc.poll() is not None, 60, what="the replica to exit")
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(10)
    text = log.read_text()
    assert proc.returncode == 1, text
    errors = [line for line in text.splitlines() if "does not exist" in line]
    assert len(errors) == 1, text
    assert f"the Lease's namespace '{missing}' does not exist" in errors[0]
    assert f"kubectl create namespace {missing}" in errors[0]
    assert "acquiring the Lease failed" not in text, text
