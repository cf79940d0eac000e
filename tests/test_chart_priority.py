"""The chart's API Priority and Fairness objects: a level for the controller's Lease
requests, and (with self-fencing) another for its TokenReviews and issuer key fetches, so
that a new leader's burst of reviews neither waits behind the service accounts' level nor
delays its renewals (docs/leader-election.md, "What the shorter defaults cost";
docs/security.md, "A review outage").

Rendered by the real helm binary; validated by the real local API server (a dry-run
create with strict field validation); classified by APF's matching rules
(tests/support/apf.py) beside the server's own schemas; and, opt-in
(``NEONVM_TEST_LONG=1``: it starts a control plane of its own), by a real API server with
Priority and Fairness on, from the level it names in its answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from neonvm import kube
from neonvm.controller.rights import TOKEN_REVIEWS
from neonvm.controller.token_verify import DISCOVERY_PATH, JWKS_PATH
from neonvm.dev.cluster import ClusterSpec, LocalCluster
from tests.support.apf import Request, classify, service_account
from tests.support.chart import Helm, Rendered

APF = "/apis/flowcontrol.apiserver.k8s.io/v1"
DRY_RUN = [("dryRun", "All"), ("fieldValidation", "Strict")]
PF = "leaderElection.priorityAndFairness"


@pytest.fixture(scope="module")
def default(helm: Helm) -> Rendered:
    """The chart as rendered with its defaults (self-fencing on), for a release
    ``neonvm-controller`` in ``neonvm-system``."""
    return helm.template("neonvm-controller", "neonvm-system")


def _levels(rendered: Rendered) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in rendered.all("PriorityLevelConfiguration")}


def _requests(namespace: str, sa: str, lease_namespace: str) -> dict[str, list[Request]]:
    """What the controller sends, by what it is for: its Lease requests (every verb its
    elector uses), its TokenReviews (the path its rights endpoint posts to) and its
    issuer key fetches (token_verify's paths), and a worker's pod LIST."""
    user, groups = service_account(namespace, sa)
    _, _, group, _, resource = TOKEN_REVIEWS.split("/")
    return {
        "lease": [Request(user, groups, verb, "coordination.k8s.io", "leases", lease_namespace)
                  for verb in ("get", "create", "update", "patch", "watch", "list")],
        "reviews": [Request(user, groups, "create", group, resource, None),
                    Request(user, groups, "get", path=DISCOVERY_PATH),
                    Request(user, groups, "get", path=JWKS_PATH)],
        "workers": [Request(user, groups, "list", "", "pods", None)],
    }


# ---- rendering ----------------------------------------------------------------------------


def test_two_levels_and_their_schemas_are_rendered_by_default_and_can_be_turned_off(
        helm: Helm, default: Rendered) -> None:
    rendered = default
    levels = _levels(rendered)
    assert sorted(levels) == ["neonvm-controller-leader-election",
                              "neonvm-controller-token-reviews"]
    schemas = {s["metadata"]["name"]: s for s in rendered.all("FlowSchema")}
    assert sorted(schemas) == sorted(levels)
    for name, schema in schemas.items():
        assert schema["spec"]["priorityLevelConfiguration"]["name"] == name
        assert [r["subjects"] for r in schema["spec"]["rules"]] == [[{
            "kind": "ServiceAccount", "serviceAccount": {
                "name": "neonvm-controller", "namespace": "neonvm-system"}}]]
    lease = levels["neonvm-controller-leader-election"]["spec"]["limited"]
    assert (lease["nominalConcurrencyShares"], lease["lendablePercent"]) == (10, 0)
    reviews = levels["neonvm-controller-token-reviews"]["spec"]["limited"]
    assert (reviews["nominalConcurrencyShares"], reviews["lendablePercent"]) == (10, 50)
    assert reviews["limitResponse"]["queuing"] == {
        "queues": 1, "handSize": 1, "queueLengthLimit": 200}
    off = helm.template("neonvm-controller", "neonvm-system", sets=(f"{PF}.enabled=false",))
    assert off.all("FlowSchema") == [] and off.all("PriorityLevelConfiguration") == []


def test_the_reviews_level_takes_its_values_even_zero(helm: Helm) -> None:
    rendered = helm.template("neonvm-controller", "neonvm-system", sets=(
        f"{PF}.tokenReviews.lendablePercent=0",
        f"{PF}.tokenReviews.nominalConcurrencyShares=3",
        f"{PF}.tokenReviews.matchingPrecedence=700"))
    limited = _levels(rendered)["neonvm-controller-token-reviews"]["spec"]["limited"]
    assert (limited["nominalConcurrencyShares"], limited["lendablePercent"]) == (3, 0)
    schemas = {s["metadata"]["name"]: s for s in rendered.all("FlowSchema")}
    assert schemas["neonvm-controller-token-reviews"]["spec"]["matchingPrecedence"] == 700
    assert schemas["neonvm-controller-leader-election"]["spec"]["matchingPrecedence"] == 500


def test_without_self_fencing_only_the_lease_requests_get_a_level(helm: Helm) -> None:
    """No rights served, no reviews: no level whose seats nobody uses."""
    rendered = helm.template("neonvm-controller", "neonvm-system",
                             sets=("controller.rightSeconds=0",))
    assert list(_levels(rendered)) == ["neonvm-controller-leader-election"]
    assert [r["resourceRules"] for r in rendered.one("FlowSchema")["spec"]["rules"]] == [[{
        "verbs": ["get", "create", "update", "patch", "watch", "list"],
        "apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
        "namespaces": ["neonvm-system"]}]]


def test_lease_requests_and_token_reviews_land_in_different_levels(default: Rendered) -> None:
    """By the chart's schemas alone: the Lease requests in the Lease level, the reviews
    and key fetches in theirs (they used to share the Lease's: a new leader's burst of
    reviews delayed its renewals), the workers' requests in neither; another
    ServiceAccount's in neither."""
    schemas = default.all("FlowSchema")
    catch_all = {"metadata": {"name": "catch-all"}, "spec": {
        "matchingPrecedence": 10000, "priorityLevelConfiguration": {"name": "catch-all"},
        "rules": [{"subjects": [{"kind": "Group", "group": {"name": "*"}}],
                   "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                      "clusterScope": True, "namespaces": ["*"]}],
                   "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]}]}}
    requests = _requests("neonvm-system", "neonvm-controller", "neonvm-system")
    assert {classify([*schemas, catch_all], r) for r in requests["lease"]} == {
        "neonvm-controller-leader-election"}
    assert {classify([*schemas, catch_all], r) for r in requests["reviews"]} == {
        "neonvm-controller-token-reviews"}
    assert {classify([*schemas, catch_all], r) for r in requests["workers"]} == {"catch-all"}
    # The two schemas match disjoint requests: their order does not matter.
    for reviews_first in (499, 501):
        reordered = [{**s, "spec": {**s["spec"], "matchingPrecedence": reviews_first}}
                     if s["metadata"]["name"].endswith("-token-reviews") else s
                     for s in schemas]
        assert [classify([*reordered, catch_all], r) for rs in requests.values()
                for r in rs] == [classify([*schemas, catch_all], r)
                                 for rs in requests.values() for r in rs]
    others = _requests("neonvm-system", "someone-else", "neonvm-system")
    assert {classify([*schemas, catch_all], r) for rs in others.values() for r in rs} == {
        "catch-all"}


# ---- the API server -----------------------------------------------------------------------


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


@pytest.mark.cluster
def test_the_api_server_accepts_the_objects_as_rendered(
        default: Rendered, api: client.ApiClient) -> None:
    """Server-side validation (a dry-run create) of the four objects as rendered."""
    for level in default.all("PriorityLevelConfiguration"):
        created = kube.request(api, "POST", f"{APF}/prioritylevelconfigurations",
                               body=level, query=DRY_RUN)
        assert created["spec"]["limited"] == level["spec"]["limited"]
    for schema in default.all("FlowSchema"):
        created = kube.request(api, "POST", f"{APF}/flowschemas", body=schema, query=DRY_RUN)
        # The API server writes an absent list (a cluster-scoped rule's namespaces) as null.
        assert _without_nulls(created["spec"]["rules"]) == schema["spec"]["rules"]
        assert created["spec"]["matchingPrecedence"] == 500


@pytest.mark.cluster
@pytest.mark.parametrize("release_namespace", ["neonvm-system", "kube-system"])
def test_the_charts_schemas_win_over_the_servers_own(
        helm: Helm, default: Rendered, api: client.ApiClient, release_namespace: str) -> None:
    """Beside the API server's built-in schemas (service-accounts at 9000; for a release in
    kube-system kube-system-service-accounts at 900), the reviews and key fetches land in
    the chart's reviews level, the renewals (JSON patches) in its Lease level, and the
    workers' requests in neither. A release in kube-system is the exception for the Lease
    reads, creates and updates: the built-in system-leader-election (100) takes those of
    every kube-system ServiceAccount into the built-in leader-election level, which lends
    no seats either (the chart's default precedence, 500, is older than this test)."""
    builtin = kube.request(api, "GET", f"{APF}/flowschemas")["items"]
    assert {"service-accounts", "system-leader-election"} <= {
        s["metadata"]["name"] for s in builtin}
    rendered = (default if release_namespace == "neonvm-system"
                else helm.template("neonvm-controller", release_namespace))
    schemas = [*builtin, *rendered.all("FlowSchema")]
    requests = _requests(release_namespace, "neonvm-controller", release_namespace)
    lease = {r.verb: classify(schemas, r) for r in requests["lease"]}
    reviews = {classify(schemas, r) for r in requests["reviews"]}
    assert reviews == {"neonvm-controller-token-reviews"}
    assert lease["patch"] == "neonvm-controller-leader-election"
    builtin_lease = {"get", "create", "update"} if release_namespace == "kube-system" else set()
    assert {v for v, level in lease.items() if level == "leader-election"} == builtin_lease
    assert set(lease.values()) <= {"neonvm-controller-leader-election", "leader-election"}
    assert not {classify(schemas, r) for r in requests["workers"]} & (
        set(lease.values()) | reviews)


@pytest.fixture(scope="module")
def apf_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A control plane of its own (no nodes) with API Priority and Fairness on, which the
    session's runs without (``neonvm/dev/cluster.py``)."""
    spec = ClusterSpec.with_free_ports(nodes=0)
    spec.priority_and_fairness = True
    c = LocalCluster(Path(tmp_path_factory.mktemp("apf-cluster")), spec)
    try:
        c.up()
        yield c
    finally:
        c.down()


@pytest.mark.long
def test_a_real_api_server_puts_leases_and_reviews_in_the_charts_two_levels(
        apf_cluster: LocalCluster) -> None:
    """The soak's and the failover benchmark's installation (benchmarks/soak.py,
    ``install_apf``): the chart's objects for the local replicas' user, then that user's
    Lease read, TokenReview and JWKS read, each answered with the uid of the level the
    server classified it into (``X-Kubernetes-PF-PriorityLevel-UID``)."""
    from benchmarks.soak import install_apf, request_level

    api = kube.api_client(apf_cluster.kubeconfig)
    controller_api = kube.api_client(apf_cluster.kubeconfig_for("controller"))
    try:
        apf = install_apf(api, controller_api)
        assert apf["lease_requests_in_level"] and apf["reviews_in_level"], apf
        assert apf["level"] != apf["reviews_level"]
        levels = {o["metadata"]["name"]: o["metadata"]["uid"] for o in kube.request(
            api, "GET", f"{APF}/prioritylevelconfigurations")["items"]}
        pods = request_level(controller_api, "GET", "/api/v1/pods?limit=1")
        assert pods is not None
        assert pods not in (levels[apf["level"]], levels[apf["reviews_level"]])
    finally:
        api.close()
        controller_api.close()
