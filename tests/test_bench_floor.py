"""The benchmarks' floor does, per VM, what the controller's convergence writes, and no more.

``benchmarks.controller_bench.floor_rate`` is the like-for-like baseline every
convergence figure in docs/benchmarks.md is set against: if it skipped a write, or wrote
something the controller does not, every percentage there would be wrong. Here it runs
on a few VMs of the session's real control plane, and its result is read back.
"""

from __future__ import annotations

from typing import Any

from kubernetes import client

from benchmarks import controller_bench as cb
from neonvm.api import types
from neonvm.dev.cluster import LocalCluster
from neonvm.drills import fleet


def _pods_by_vm(api: client.ApiClient, namespace: str) -> dict[str, list[dict[str, Any]]]:
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace).items
    out: dict[str, list[dict[str, Any]]] = {}
    for pod in pods:
        vm = (pod.metadata.labels or {}).get(types.LABEL_VM_NAME, "")
        out.setdefault(vm, []).append(api.sanitize_for_serialization(pod))
    return out


def test_the_floor_leaves_each_vm_converged_with_the_controllers_own_runner_pod(
    cluster: LocalCluster, api: client.ApiClient, namespace: str
) -> None:
    result = cb.floor_rate(cluster, api, namespace, 4, threads=2, progress=lambda _m: None)

    assert result["vms"] == 4 and result["writes_per_vm"] == cb.FLOOR_WRITES
    assert result["vms_per_s"] > 0
    names = [f"raw-{i:04d}" for i in range(4)]
    # The benchmark's own check of convergence: one pod, named status.podName, ungated,
    # no plan pending. The controller's convergence is judged by the same check.
    state = fleet.convergence(api, namespace, names)
    assert sorted(state.converged) == names
    pods = _pods_by_vm(api, namespace)
    for name in names:
        [pod] = pods[name]
        # The controller's template, not a stand-in: its container, labels and gate list.
        assert [c["name"] for c in pod["spec"]["containers"]] == ["neonvm-runner"]
        assert pod["metadata"]["labels"][types.LABEL_VM_NAME] == name
        assert not any(g["name"] == types.SCHEDULING_GATE
                       for g in pod["spec"].get("schedulingGates") or [])
        vm = client.CustomObjectsApi(api).get_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, name)
        status = vm["status"]
        assert status["podName"] == pod["metadata"]["name"]
        assert status["podUID"] == pod["metadata"]["uid"]
        assert "pendingPod" not in status
        # The controller's status mutation: the fence it wrote with is recorded.
        assert status["fence"] == {"epoch": cb.FLOOR_FENCE.epoch, "token": cb.FLOOR_FENCE.token}
