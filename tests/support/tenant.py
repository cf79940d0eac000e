"""A release's identities and RBAC installed on the cluster (:func:`installed`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from kubernetes import client, dynamic
from kubernetes.client.exceptions import ApiException

from neonvm import kube, manifests
from tests.support.chart import Rendered


def _identity(rendered: Rendered) -> list[dict[str, Any]]:
    kinds = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
             "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    return [o for o in rendered.objects if o["kind"] in kinds]


@contextlib.contextmanager
def installed(api: client.ApiClient, *releases: Rendered) -> Iterator[None]:
    """Create the releases' identities, RBAC and fences; suspend the local cluster's own
    fence meanwhile (in a cluster installed by the chart, the chart's fences are the only
    ones)."""
    dyn = dynamic.DynamicClient(api)
    admission = client.AdmissionregistrationV1Api(api)
    created: list[dict[str, Any]] = []

    def resource(obj: dict[str, Any]) -> tuple[Any, str | None]:
        r = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        return r, (obj["metadata"].get("namespace") if r.namespaced else None)

    try:
        for rendered in releases:
            for obj in _identity(rendered):
                r, ns = resource(obj)
                r.create(body=obj, namespace=ns)
                created.append(obj)
        with contextlib.suppress(ApiException):
            admission.delete_validating_admission_policy_binding(manifests.POLICY_NAME)
        yield
    finally:
        for obj in reversed(created):
            r, ns = resource(obj)
            with contextlib.suppress(ApiException):
                r.delete(name=obj["metadata"]["name"], namespace=ns)
        kube.apply(api, manifests.admission_policy_binding())
