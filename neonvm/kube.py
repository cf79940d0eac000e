"""Thin helpers over the official ``kubernetes`` client: clients from kubeconfig, apply.

Everything that talks to the API server builds its client here, so timeouts and error
wording are the same across the CLI, the controller and the tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

FIELD_MANAGER = "neonvm"

# Cluster-scoped kinds the project applies, and where they live in the REST API.
_CLUSTER_PATHS = {
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"):
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"):
        "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"):
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"):
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"):
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings",
    ("v1", "Namespace"): "/api/v1/namespaces",
    ("v1", "Node"): "/api/v1/nodes",
}


def api_client(kubeconfig: Path | str | None = None) -> client.ApiClient:
    """An ApiClient for ``kubeconfig`` (default: $KUBECONFIG, then in-cluster)."""
    if kubeconfig is None:
        import os

        kubeconfig = os.environ.get("KUBECONFIG")
    if kubeconfig:
        return config.new_client_from_config(config_file=str(kubeconfig))
    cfg = client.Configuration()
    config.load_incluster_config(client_configuration=cfg)
    return client.ApiClient(cfg)


def request(
    api: client.ApiClient,
    method: str,
    path: str,
    body: Any = None,
    query: list[tuple[str, str]] | None = None,
    content_type: str = "application/json",
    timeout: float = 30.0,
) -> dict[str, Any]:
    """A raw REST call (for content types the generated API lacks); raises ApiException."""
    method, url, headers, payload, _ = api.param_serialize(
        method,
        path,
        query_params=query or [],
        header_params={"Content-Type": content_type, "Accept": "application/json"},
        body=body,
        auth_settings=["BearerToken"],
    )
    resp = api.call_api(method, url, header_params=headers, body=payload,
                        _request_timeout=timeout)
    resp.read()
    if not 200 <= resp.status <= 299:
        raise ApiException(http_resp=resp)
    result: dict[str, Any] = json.loads(resp.data or b"{}")
    return result


def apply(api: client.ApiClient, obj: dict[str, Any], force: bool = True) -> dict[str, Any]:
    """Server-side apply of a cluster-scoped object (idempotent)."""
    key = (obj["apiVersion"], obj["kind"])
    if key not in _CLUSTER_PATHS:
        raise ValueError(f"apply: unsupported kind {key}")
    return request(
        api,
        "PATCH",
        f"{_CLUSTER_PATHS[key]}/{obj['metadata']['name']}",
        body=obj,
        query=[("fieldManager", FIELD_MANAGER), ("force", "true" if force else "false")],
        content_type="application/apply-patch+yaml",
    )


def api_error_message(err: ApiException) -> str:
    """The API server's own message for a failed call (e.g. a validation error)."""
    try:
        body = json.loads(err.body or "{}")
        return str(body.get("message") or err.reason)
    except (ValueError, TypeError):
        return f"{err.status} {err.reason}"
