"""The shipped cluster interface's pod writes, and the API client's pool, on a real server.

``KubeCluster.create_pod`` and ``ungate_pod`` send the manifest (or the JSON patch) as
it is and hand back the API server's JSON as decoded, without the ``kubernetes``
client's typed models on the way in or out: those cost about 2 ms of CPU per call under
the GIL every worker shares, and they refuse, client-side, a field the client's models
do not know. Errors keep the interface's contract (an ``ApiException`` with the
server's status and message). ``kube.api_client(pool_size=N)`` keeps N connections, so
``neonvm controller run``'s workers do not each open (and throw away) a TLS connection
per request beyond the default pool.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm import kube
from neonvm.api import types
from neonvm.api.types import PendingPod, VirtualMachine
from neonvm.controller import podspec
from neonvm.controller.cluster import KubeCluster
from neonvm.controller.config import HTTP_POOL_BEYOND_WORKERS, http_pool_size
from neonvm.dev.cluster import LocalCluster
from tests.support.harness import create_vm


def _runner_manifest(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    vm = VirtualMachine.from_object(create_vm(api, namespace, name))
    plan = PendingPod(name=f"{name}-{vm.uid[:8]}-1", plan_seq=1, token=7, epoch=3,
                      generation=vm.generation)
    return podspec.runner_pod(vm, plan, podspec.PodDefaults(runner_image="neonvm-runner:dev"))


@pytest.mark.cluster
def test_create_and_ungate_send_and_answer_plain_json_without_typed_models(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = _runner_manifest(api, namespace, "plain")
    typed: list[str] = []
    deserialize = client.ApiClient.response_deserialize

    def counting(self: client.ApiClient, *args: Any, **kwargs: Any) -> Any:
        typed.append("response_deserialize")
        return deserialize(self, *args, **kwargs)

    monkeypatch.setattr(client.ApiClient, "response_deserialize", counting)
    cluster = KubeCluster(controller_api)

    created = cluster.create_pod(namespace, manifest)
    meta = created["metadata"]
    assert meta["name"] == manifest["metadata"]["name"] and meta["uid"]
    # The server's own text, not a typed model's rendering of it ("+00:00").
    assert meta["creationTimestamp"].endswith("Z"), meta["creationTimestamp"]
    gates = [g["name"] for g in created["spec"]["schedulingGates"]]
    assert gates == [types.SCHEDULING_GATE]

    with pytest.raises(ApiException) as taken:  # the name is taken: 409, as before
        cluster.create_pod(namespace, manifest)
    assert taken.value.status == 409 and "already exists" in kube.api_error_message(taken.value)

    with pytest.raises(ApiException) as stale:  # a failed `test` operation: 422
        cluster.ungate_pod(namespace, meta["name"], uid=meta["uid"], resource_version="1",
                           gate_index=0)
    assert stale.value.status in (409, 422), stale.value.body

    ungated = cluster.ungate_pod(namespace, meta["name"], uid=meta["uid"],
                                 resource_version=meta["resourceVersion"], gate_index=0)
    assert not (ungated.get("spec") or {}).get("schedulingGates")
    assert ungated["metadata"]["uid"] == meta["uid"]
    assert typed == [], f"typed models were built for the pod writes: {typed}"


@pytest.mark.cluster
def test_a_client_with_a_pool_for_its_workers_keeps_a_connection_per_worker(
        cluster: LocalCluster) -> None:
    workers = 24
    api = kube.api_client(cluster.kubeconfig, pool_size=http_pool_size(workers))
    try:
        core = client.CoreV1Api(api)
        start = threading.Barrier(workers)

        def one() -> None:
            start.wait(30)
            for _ in range(3):
                core.list_namespace(limit=1, _request_timeout=30)

        threads = [threading.Thread(target=one) for _ in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        pools = list(api.rest_client.pool_manager.pools._container.values())
        assert len(pools) == 1
        pool = pools[0]
        kept = sum(1 for conn in list(pool.pool.queue) if conn is not None)
        # Every connection opened for the burst was kept for the next one (a pool of
        # the default size, 5 per CPU, throws away all beyond it after each request).
        assert kept == pool.num_connections, (
            f"{pool.num_connections} connections opened, {kept} kept")
    finally:
        api.close()
    assert http_pool_size(workers) == workers + HTTP_POOL_BEYOND_WORKERS
