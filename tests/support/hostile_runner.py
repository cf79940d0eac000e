"""A scalable VM and its pod's conditions, for tests against a hostile runner."""

from __future__ import annotations

from typing import Any

from kubernetes import client


def _pod_running(api: client.ApiClient, namespace: str, name: str) -> bool:
    """Plays the kubelet once the VM's pod is started: Running on 127.0.0.1 (the VM's
    ``runnerPort`` is its runner's port on loopback). True once done."""
    from tests.support.harness import get_vm, is_gated, runner_pods

    raw = get_vm(api, namespace, name) or {}
    status = raw.get("status") or {}
    pods = runner_pods(api, namespace, name)
    if (len(pods) != 1 or pods[0].metadata.name != status.get("podName") or is_gated(pods[0])
            or not status.get("scalingTokenSecret")):
        return False
    if pods[0].status.phase != "Running":
        client.CoreV1Api(api).patch_namespaced_pod_status(pods[0].metadata.name, namespace, {
            "status": {"phase": "Running", "podIP": "127.0.0.1",
                       "podIPs": [{"ip": "127.0.0.1"}]}})
    return True


def scalable_vm(api: client.ApiClient, namespace: str, name: str, port: int) -> None:
    from tests.support.harness import create_vm
    from tests.support.scaling_controller import NOWHERE

    create_vm(api, namespace, name, spec={
        "nodeSelector": NOWHERE, "runnerPort": port,
        "guest": {"cpus": {"min": 1, "max": 2, "use": 1},
                  "memorySlots": {"min": 1, "max": 2, "use": 1}, "memorySlotSize": "1Gi",
                  "rootDisk": {"image": "/nonexistent.raw"}}})


def condition(api: client.ApiClient, namespace: str, name: str,
              type_: str) -> dict[str, Any] | None:
    from tests.support.scaling_controller import status_of

    return next((c for c in status_of(api, namespace, name).get("conditions") or []
                 if c["type"] == type_), None)
