"""The chart's self-fencing values (``controller.rightSeconds``, ``controller.rightsPort``),
rendered by the real helm binary: a 30 s right served by default (runners ask with a
projected ServiceAccount token the leader reviews: no Secret rights, so no
``rbac.liveScaling``), nothing added with 0, and when served, the controller's flags
(its rights audience), the selector-less rights Service the leader points at itself, and
the generated RBAC (docs/protocol.md, "Self-fencing"; docs/chart.md)."""

from __future__ import annotations

from typing import Any

import pytest

from neonvm import manifests
from tests.support.chart import Helm, Rendered

ON = ("controller.rightSeconds=30", "controller.rightsPort=8090")


def _serves_rights(rendered: Rendered) -> bool:
    """Anything of the rights endpoint in the render: flags, port, Service, policy, roles."""
    return (any(a.startswith("--rights-") for a in rendered.container["args"])
            or "rights" in {p["name"] for p in rendered.container["ports"]}
            or any(o["metadata"]["name"].endswith(("-rights", "-rights-from-runners",
                                                   "-self-fencing", "-rights-endpoint"))
                   for o in rendered.objects))


def _rules(rendered: Rendered) -> list[dict[str, Any]]:
    return [r for kind in ("ClusterRole", "Role") for o in rendered.all(kind)
            for r in o.get("rules") or []]


def test_with_default_values_every_vm_on_the_runner_image_self_fences(helm: Helm) -> None:
    """Default values: a 30 s right (its drills' figures: docs/drills.md), served, with
    the release's rights audience; the controller may create TokenReviews and read no
    Secret (issue 32: a dead node must cost seconds by default)."""
    rendered = helm.template("nvm", "ops")
    args = rendered.container["args"]
    fullname = rendered.one("Deployment")["metadata"]["name"]
    assert "--right-seconds=30" in args
    assert any(a.startswith("--rights-url=") for a in args)
    # A leader change's first asks wait on the API server: 32 threads, not 8
    # (docs/protocol.md, "A term's first grants are the tighter limit").
    assert "--rights-workers=32" in args
    # One audience per release (namespace and name): another release's runners' tokens,
    # or the API server's, are refused (docs/security.md, "Rights endpoint").
    assert f"--rights-audience=vm.neon.tech/rights/ops/{fullname}" in args
    rules = _rules(rendered)
    assert {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
            "verbs": ["create"]} in rules
    # No Secret may be read (rbac.sshKeys' `create` alone is another feature's).
    assert not [r for r in rules if "secrets" in r.get("resources", [])
                and {"get", "list", "watch"} & set(r["verbs"])]
    assert not [r for r in _rules(helm.template("nvm", "ops", sets=("rbac.sshKeys=false",)))
                if "secrets" in r.get("resources", [])]
    # The issuer keys, for verifying runners' tokens locally (docs/security.md).
    assert {"nonResourceURLs": ["/.well-known/openid-configuration", "/openid/v1/jwks"],
            "verbs": ["get"]} in rules
    with_scaling = helm.template("nvm", "ops", sets=("rbac.liveScaling=true",))
    assert with_scaling.container["args"] == args


def test_self_fencing_off_adds_nothing(helm: Helm) -> None:
    rendered = helm.template("nvm", "ops", sets=("controller.rightSeconds=0",))
    assert "--right-seconds=0" in rendered.container["args"]
    assert not _serves_rights(rendered)


@pytest.mark.parametrize("watch", ["", "vms"])
def test_with_a_right_the_leader_serves_it_behind_a_service_it_points_at_itself(
        helm: Helm, watch: str) -> None:
    sets = (*ON, f"controller.watchNamespace={watch}") if watch else ON
    helm.run("lint", "--strict", str(manifests.CHART_DIR), "--set", ",".join(sets))
    rendered = helm.template("nvm", "ops", sets=sets)
    args = rendered.container["args"]
    fullname = rendered.one("Deployment")["metadata"]["name"]
    assert "--right-seconds=30" in args
    assert "--rights-bind=0.0.0.0:8090" in args
    # Fully qualified, trailing dot: never resolved through the search list, where
    # `<svc>.<ns>.svc.svc.cluster.local` is a tenant's namespace `svc` (docs/security.md).
    assert f"--rights-url=http://{fullname}-rights.ops.svc.cluster.local.:8090" in args
    assert f"--rights-service=ops/{fullname}-rights" in args
    assert rendered.env()["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert {"name": "rights", "containerPort": 8090, "protocol": "TCP"} in \
        rendered.container["ports"]

    service = next(o for o in rendered.all("Service")
                   if o["metadata"]["name"] == f"{fullname}-rights")
    assert "selector" not in service["spec"], "the leader writes its endpoints"
    assert service["spec"]["ports"] == [{"name": "rights", "port": 8090,
                                         "targetPort": 8090, "protocol": "TCP"}]

    nodes = next(o for o in rendered.all("ClusterRole")
                 if o["metadata"]["name"] == f"{fullname}-self-fencing")
    assert nodes["rules"] == manifests.self_fencing_rules()
    endpoint = next(o for o in rendered.all("Role")
                    if o["metadata"]["name"] == f"{fullname}-rights-endpoint")
    assert endpoint["metadata"]["namespace"] == "ops"
    assert endpoint["rules"] == manifests.rights_endpoint_rules()
    for kind, role in (("ClusterRoleBinding", nodes), ("RoleBinding", endpoint)):
        binding = next(o for o in rendered.all(kind)
                       if o["roleRef"]["name"] == role["metadata"]["name"])
        assert binding["subjects"][0]["name"] == rendered.pod_spec["serviceAccountName"]


def test_a_negative_right_is_refused_by_the_schema(helm: Helm) -> None:
    assert "rightSeconds" in helm.template_fails("--set", "controller.rightSeconds=-1")


def test_the_rights_url_names_the_clusters_dns_domain(helm: Helm) -> None:
    sets = (*ON, "controller.clusterDomain=corp.example")
    args = helm.template("nvm", "ops", sets=sets).container["args"]
    url = next(a for a in args if a.startswith("--rights-url="))
    assert url.endswith("-rights.ops.svc.corp.example.:8090")
    from neonvm.runner.right import rights_endpoint  # the runner takes it as given

    host, port = rights_endpoint(url.split("=", 1)[1])
    assert host.endswith(".svc.corp.example.") and port == 8090
    assert "clusterDomain" in helm.template_fails(
        "--set", ",".join((*ON, "controller.clusterDomain=bad/domain")))


@pytest.mark.parametrize("port", [8090, 1, 65535])
def test_the_rights_port_admits_runner_pods_only_and_every_other_port_stays_open(
        helm: Helm, port: int) -> None:
    """Any pod could otherwise flood the leader's rights endpoint (docs/security.md,
    "Rights endpoint"); health and metrics must stay reachable."""
    sets = ("controller.rightSeconds=30", f"controller.rightsPort={port}")
    helm.run("lint", "--strict", str(manifests.CHART_DIR), "--set", ",".join(sets))
    rendered = helm.template("nvm", "ops", sets=sets)
    fullname = rendered.one("Deployment")["metadata"]["name"]
    (policy,) = [o for o in rendered.all("NetworkPolicy")
                 if o["metadata"]["name"] == f"{fullname}-rights-from-runners"]
    pod_labels = rendered.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["metadata"]["namespace"] == "ops"
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    runners, others = policy["spec"]["ingress"]
    assert runners["ports"] == [{"protocol": "TCP", "port": port}]
    assert runners["from"] == [{"namespaceSelector": {}, "podSelector": {"matchExpressions": [
        {"key": "vm.neon.tech/name", "operator": "Exists"}]}}]
    assert "from" not in others

    def open_to_all(p: int) -> bool:
        return any(r["protocol"] == "TCP" and r["port"] <= p <= r.get("endPort", r["port"])
                   for r in others["ports"])
    assert not open_to_all(port)
    assert all(open_to_all(p) for p in {1, port - 1, port + 1, 8080, 8081, 65535} - {port}
               if 1 <= p <= 65535)


def test_the_rights_policy_is_off_with_self_fencing_or_when_turned_off(
        helm: Helm) -> None:
    for sets in (("controller.rightSeconds=0",),
                 (*ON, "controller.rightsNetworkPolicy=false")):
        rendered = helm.template("nvm", "ops", sets=sets)
        assert not [o for o in rendered.all("NetworkPolicy")
                    if o["metadata"]["name"].endswith("-rights-from-runners")]
