"""The chart's API Priority and Fairness objects for the controller's Lease requests and
its TokenReviews (docs/security.md, "A review outage").

Rendered by the real helm binary, and validated by the real local API server (a dry-run
create with strict field validation). See docs/leader-election.md, "What the shorter
defaults cost".
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from kubernetes import client

from neonvm import kube
from neonvm.controller.rights import TOKEN_REVIEWS
from tests.support.chart import Helm

APF = "/apis/flowcontrol.apiserver.k8s.io/v1"
DRY_RUN = [("dryRun", "All"), ("fieldValidation", "Strict")]


def test_the_objects_are_rendered_by_default_and_can_be_turned_off(helm: Helm) -> None:
    rendered = helm.template("neonvm-controller", "neonvm-system")
    level = rendered.one("PriorityLevelConfiguration")
    schema = rendered.one("FlowSchema")
    assert schema["spec"]["priorityLevelConfiguration"]["name"] == level["metadata"]["name"]
    assert level["spec"]["limited"]["lendablePercent"] == 0
    rule = schema["spec"]["rules"][0]
    assert rule["subjects"] == [{"kind": "ServiceAccount", "serviceAccount": {
        "name": "neonvm-controller", "namespace": "neonvm-system"}}]
    assert rule["resourceRules"][0]["resources"] == ["leases"]
    assert rule["resourceRules"][0]["namespaces"] == ["neonvm-system"]
    off = helm.template("neonvm-controller", "neonvm-system",
                        sets=("leaderElection.priorityAndFairness.enabled=false",))
    assert off.all("FlowSchema") == [] and off.all("PriorityLevelConfiguration") == []


def test_the_leaders_token_reviews_share_the_lease_requests_level(helm: Helm) -> None:
    """The request the rights endpoint's reviewer sends (a POST of a cluster-scoped
    TokenReview) is matched by the schema: a review outage of the service accounts'
    level must not end every guest's right while the leader keeps its Lease."""
    rule = helm.template("neonvm-controller", "neonvm-system").one("FlowSchema")[
        "spec"]["rules"][0]
    _, apis, group, version, resource = TOKEN_REVIEWS.split("/")
    assert (apis, version) == ("apis", "v1")
    assert {"verbs": ["create"], "apiGroups": [group], "resources": [resource],
            "clusterScope": True} in rule["resourceRules"]


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _create(api: client.ApiClient, path: str, obj: dict[str, Any]) -> dict[str, Any]:
    return kube.request(api, "POST", path, body=obj)


@pytest.mark.cluster
def test_the_api_server_accepts_the_objects_as_rendered(
        helm: Helm, api: client.ApiClient, namespace: str) -> None:
    """Server-side validation (a dry-run create) of both objects, as the chart renders
    them for a release in ``namespace``.

    Not checked here: that the API server then classifies the Lease requests into the
    chart's level (it says so in each answer's ``X-Kubernetes-PF-PriorityLevel-UID``). The
    local control plane runs kube-apiserver with ``--enable-priority-and-fairness=false``
    (``neonvm/dev/cluster.py``), so it classifies nothing.
    """
    rendered = helm.template(f"apf-{uuid.uuid4().hex[:6]}", namespace)
    level, schema = rendered.one("PriorityLevelConfiguration"), rendered.one("FlowSchema")
    created_level = kube.request(api, "POST", f"{APF}/prioritylevelconfigurations",
                                 body=level, query=DRY_RUN)
    assert created_level["spec"]["limited"]["nominalConcurrencyShares"] == 10
    assert created_level["spec"]["limited"]["lendablePercent"] == 0
    created_schema = kube.request(api, "POST", f"{APF}/flowschemas", body=schema,
                                  query=DRY_RUN)
    # The API server writes an absent list (the cluster-scoped rule's namespaces) as null.
    assert _without_nulls(created_schema["spec"]["rules"]) == schema["spec"]["rules"]
    assert created_schema["spec"]["matchingPrecedence"] == 500
