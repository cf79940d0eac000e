"""Objects the local cluster gets once its API server is up: the CRD, the controller's
RBAC and admission fence, and the namespace of the controller's leader-election Lease
(so that ``neonvm controller run`` with its defaults can campaign at once)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from neonvm import kube, manifests
from neonvm.dev.common import CONTROLLER_USER
from neonvm.leader.election import DEFAULT_NAMESPACE as LEASE_NAMESPACE

if TYPE_CHECKING:
    from neonvm.dev.cluster import LocalCluster


def apply_cluster_objects(cluster: LocalCluster, progress: Callable[[str], None]) -> None:
    api = kube.api_client(cluster.kubeconfig)
    try:
        for obj in manifests.cluster_objects(controller_user=CONTROLLER_USER):
            kube.apply(api, obj)
        kube.apply(api, lease_namespace())
        progress(f"applied CRD, RBAC, admission policy and namespace {LEASE_NAMESPACE}")
        _wait_crd_established(api, manifests.crd()["metadata"]["name"])
    finally:
        api.close()


def lease_namespace() -> dict[str, Any]:
    """The namespace ``neonvm controller run`` campaigns in by default."""
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": LEASE_NAMESPACE}}


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
