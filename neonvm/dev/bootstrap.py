"""Objects the local cluster gets once its API server is up: the CRD and its RBAC."""

from __future__ import annotations

import time
from collections.abc import Callable

from neonvm import kube, manifests
from neonvm.dev.cluster import CONTROLLER_USER, LocalCluster


def apply_cluster_objects(cluster: LocalCluster, progress: Callable[[str], None]) -> None:
    api = kube.api_client(cluster.kubeconfig)
    try:
        for obj in manifests.cluster_objects(controller_user=CONTROLLER_USER):
            kube.apply(api, obj)
        progress("applied CRD, RBAC and admission policy")
        _wait_crd_established(api, manifests.crd()["metadata"]["name"])
    finally:
        api.close()


def _wait_crd_established(api: object, name: str, timeout: float = 30.0) -> None:
    from kubernetes import client

    ext = client.ApiextensionsV1Api(api)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        crd = ext.read_custom_resource_definition(name)
        conds = {c.type: c.status for c in (crd.status.conditions or [])}
        if conds.get("Established") == "True":
            return
        time.sleep(0.1)
    raise TimeoutError(f"CRD {name} not established after {timeout}s")
