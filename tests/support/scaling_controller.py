"""The controller scaling real runners: set a VM's use, read its scaling status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kubernetes import client

from neonvm import kube
from neonvm.api import types
from neonvm.controller import actions as act
from neonvm.controller.podspec import ANNOTATION_SPEC
from neonvm.controller.reconciler import Reconciler, ReconcileResult
from tests.support import shipped_reconciler
from tests.support.authority import StaticAuthority
from tests.support.harness import create_vm, get_vm, runner_pods
from tests.support.runner import REPO, RunningRunner

NOWHERE = {"neonvm.test/unschedulable": "true"}


OLD = StaticAuthority(epoch=1, token=10)


def settle(reconciler: Reconciler, key: str, authority: StaticAuthority,
           rounds: int = 10) -> ReconcileResult:
    result = reconciler.reconcile(key, authority, direct_first=True)
    for _ in range(rounds):
        if isinstance(result.action, act.Done):
            return result
        result = reconciler.reconcile(key, authority, direct_first=True)
    return result


def _running_on(runner: Any, api: client.ApiClient, controller_api: client.ApiClient,
                namespace: str, name: str, token_sync_seconds: float) -> Reconciler:
    """A scalable VM (1..2 vCPUs, 1..2 slots) whose pod is marked Running at the fake
    runner's address, settled by a reconciler that scales through that runner."""
    from neonvm.controller.scaling import RunnerScaling

    create_vm(api, namespace, name, spec={
        "nodeSelector": NOWHERE,
        "guest": {"cpus": {"min": 1, "max": 2, "use": 1},
                  "memorySlots": {"min": 1, "max": 2, "use": 1},
                  "memorySlotSize": "1Gi", "rootDisk": {"image": "/nonexistent.raw"}}})
    key = f"{namespace}/{name}"
    reconciler = shipped_reconciler(controller_api, scaling=RunnerScaling(
        controller_api, address=lambda vm, pod: f"http://127.0.0.1:{runner.port}",
        token_sync_seconds=token_sync_seconds))
    settle(reconciler, key, OLD)
    (pod,) = runner_pods(api, namespace, name)
    client.CoreV1Api(api).patch_namespaced_pod_status(pod.metadata.name, namespace, {
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "podIPs": [{"ip": "127.0.0.1"}]}})
    settle(reconciler, key, OLD)
    return reconciler


def vm_path(namespace: str) -> str:
    return f"/apis/{types.GROUP}/{types.VERSION}/namespaces/{namespace}/{types.PLURAL}"


def set_use(api: client.ApiClient, namespace: str, name: str, cpus: int, slots: int) -> None:
    kube.request(api, "PATCH", f"{vm_path(namespace)}/{name}", [
        {"op": "replace", "path": "/spec/guest/cpus/use", "value": cpus},
        {"op": "replace", "path": "/spec/guest/memorySlots/use", "value": slots}],
        content_type="application/json-patch+json")


def status_of(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    raw = get_vm(api, namespace, name)
    assert raw is not None
    status: dict[str, Any] = raw.get("status") or {}
    # every condition in one list, NeonVM's and this controller's (status.extraConditions)
    status["conditions"] = [*(status.get("conditions") or []), *status.pop("extraConditions", [])]
    return status


def start_runner_for(pod: Any, token: str, port: int, tmp_path: Path) -> RunningRunner:
    """Start the runner as the kubelet would for ``pod`` (its spec and env), on loopback."""
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(pod.metadata.annotations[ANNOTATION_SPEC])
    token_file = tmp_path / "token"
    token_file.write_text(token)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
    for e in pod.spec.containers[0].env or []:
        ref = e.value_from.field_ref if e.value_from is not None else None
        if ref is not None and ref.field_path == "metadata.uid":
            env[e.name] = pod.metadata.uid  # the downward API, as the kubelet fills it in
        elif e.value is not None:
            env[e.name] = e.value
    env.update({"NEONVM_SPEC_FILE": str(spec_file), "NEONVM_SCALING_TOKEN_FILE": str(token_file)})
    work_dir, termination_log = tmp_path / "work", tmp_path / "termination-log"
    termination_log.write_text("")
    console_path, log_path = tmp_path / "console.log", tmp_path / "runner.log"
    args = [sys.executable, "-m", "neonvm.runner.main", "--port", str(port),
            "--listen-address", "127.0.0.1", "--work-dir", str(work_dir),
            "--disks-dir", str(tmp_path / "disks"), "--termination-log", str(termination_log)]
    with console_path.open("wb") as out, log_path.open("wb") as err:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=err, cwd=REPO)
    return RunningRunner(proc, port, console_path, log_path, termination_log, work_dir)
