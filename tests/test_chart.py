"""The HA Helm chart, checked with the real helm binary and the real local API server.

What is shown here:

* ``helm lint`` and ``helm template`` pass for the default values and for the HA-with-TLS
  values (``ci/ha-tls-values.yaml``); values that break ``values.schema.json`` (or a rule
  between values) are refused with helm's own message.
* The rendered objects have the HA shape (replicas, spread, budget, probes, restricted
  security context, etcd TLS and auth wiring) and carry the standard labels.
* The RBAC rules and the admission fence are exactly the generator's output
  (``neonvm/manifests.py``), the fence naming the release's ServiceAccount.
* The real API server accepts every rendered object (server-side dry run, strict field
  validation), and a pod made from the Deployment's template passes the ``restricted``
  Pod Security Standard.
* The chart's ServiceAccount (impersonated) may make every call the controller makes for
  a VM's lifecycle, and is refused what the controller must not do.
* When ``neonvm controller run`` exists: the real controller, started with the command
  line the chart renders and the ServiceAccount's own token, takes a VM through its
  lifecycle with the chart's fence in force.

What is not: the ServiceMonitor reaches no API server here (the prometheus-operator CRD
is not installed in the local cluster); its wiring to the metrics Service is checked on
the rendered objects only. No image is pulled and no Deployment pod runs (the local
cluster has no kubelet that runs containers).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, dynamic
from kubernetes.client.exceptions import ApiException

from neonvm import kube, manifests
from neonvm.api import times, types
from neonvm.dev.cluster import LocalCluster, free_port
from tests.support import wait_for
from tests.support.chart import (
    CHART,
    HA_TLS_VALUES,
    STANDARD_LABELS,
    Helm,
    Rendered,
    _lease_held,
    _restricted_namespace,
    _running,
    _service_account_kubeconfig,
)

SCHEMA_ERROR = "values don't meet the specifications of the schema"
VALUE_SETS = {"default": None, "ha-tls": HA_TLS_VALUES}


# ---- helm ---------------------------------------------------------------------------------


def _without_rights(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``objects`` but self-fencing's rights Service and NetworkPolicy (rendered with
    rbac.liveScaling; tests/test_chart_self_fencing.py checks them)."""
    return [o for o in objects if not o["metadata"]["name"].endswith(
        ("-rights", "-rights-from-runners"))]


def _release() -> str:
    return f"r{uuid.uuid4().hex[:8]}"


# ---- lint, template, schema ---------------------------------------------------------------


@pytest.mark.parametrize("values", list(VALUE_SETS), ids=list(VALUE_SETS))
def test_helm_lint_passes_strictly(helm: Helm, values: str) -> None:
    args = ["lint", str(CHART), "--strict", "--namespace", "neonvm-system"]
    if VALUE_SETS[values] is not None:
        args += ["--values", str(VALUE_SETS[values])]
    out = helm.run(*args).stdout
    assert "1 chart(s) linted, 0 chart(s) failed" in out


@pytest.mark.parametrize("values", list(VALUE_SETS), ids=list(VALUE_SETS))
def test_every_templated_object_carries_the_standard_labels(helm: Helm, values: str) -> None:
    # With live scaling, so that self-fencing's objects are rendered and checked too.
    rendered = helm.template("neonvm-controller", "neonvm-system", VALUE_SETS[values],
                             sets=("rbac.liveScaling=true",))
    kinds = sorted(o["kind"] for o in rendered.objects)
    expected = ["ClusterRole"] * 3 + [  # the controller's, and the user roles edit, view
                "ClusterRoleBinding", "Deployment", "PodDisruptionBudget",
                "Role", "RoleBinding", "Service", "ServiceAccount",
                "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                "FlowSchema", "PriorityLevelConfiguration"]
    if values == "ha-tls":
        expected.append("ServiceMonitor")
    else:  # the bundled etcd (tests/test_chart_etcd.py)
        expected += ["StatefulSet", "Service", "Service", "PodDisruptionBudget",
                     "Secret", "Secret", "Secret", "Secret"]
    expected.append("Pod")  # `helm test`
    expected.append("NetworkPolicy")  # only the controller (and `helm test`) reach etcd
    # Self-fencing, served with live scaling (tests/test_chart_self_fencing.py): the rights Service,
    # its ClusterRole (nodes) and Role (its EndpointSlice), their bindings, the
    # NetworkPolicy that admits only runner pods to the rights port, and the TokenReviews'
    # priority level and FlowSchema (tests/test_chart_priority.py).
    expected += ["ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Service",
                 "NetworkPolicy", "FlowSchema", "PriorityLevelConfiguration"]
    assert kinds == sorted(expected)
    pod_labels = rendered.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    for obj in [*rendered.objects, {"kind": "pod template", "metadata": {"labels": pod_labels}}]:
        labels = obj["metadata"].get("labels", {})
        missing = [k for k in STANDARD_LABELS if k not in labels]
        assert not missing, f"{obj['kind']} lacks {missing}"
        assert labels["app.kubernetes.io/instance"] == "neonvm-controller"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"


def test_the_deployment_runs_three_replicas_spread_over_nodes_and_zones(helm: Helm) -> None:
    rendered = helm.template("neonvm-controller", "neonvm-system")
    deploy = rendered.one("Deployment")
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    selector = deploy["spec"]["selector"]["matchLabels"]
    assert deploy["spec"]["replicas"] == 3
    assert selector.items() <= pod_labels.items()

    spread = {c["topologyKey"]: c for c in rendered.pod_spec["topologySpreadConstraints"]}
    assert spread["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"
    assert spread["topology.kubernetes.io/zone"]["whenUnsatisfiable"] == "ScheduleAnyway"
    for c in spread.values():
        assert c["maxSkew"] == 1
        assert c["labelSelector"]["matchLabels"].items() <= pod_labels.items()
        assert c["matchLabelKeys"] == ["pod-template-hash"]

    pdb = rendered.one("PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] == 1
    assert pdb["selector"]["matchLabels"] == selector
    assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_the_controller_gets_the_lease_settings_and_probes_on_its_health_port(
    helm: Helm,
) -> None:
    rendered = helm.template("neonvm-controller", "neonvm-system", HA_TLS_VALUES)
    c = rendered.container
    args = c["args"]
    assert args[args.index("controller"):args.index("controller") + 2] == ["controller", "run"]
    assert "--lease-namespace=neonvm-system" in args
    assert "--lease-name=neonvm-controller" in args
    # ... and `neonvm locks` run in the pod acts on this installation's locks.
    env = rendered.env()
    assert env["NEONVM_CONTROLLER_RUN_LEASE_NAMESPACE"]["value"] == "neonvm-system"
    assert env["NEONVM_CONTROLLER_RUN_LEASE_NAME"]["value"] == "neonvm-controller"
    assert "--lease-duration=20" in args
    assert "--renew-deadline=15" in args
    assert "--retry-period=3" in args
    assert "--workers=8" in args
    assert "--health-port=8081" in args
    assert "--session-ttl=15" in args
    assert "--runner-image=registry.example.com/neonvm/neonvm-runner:0.1.0" in args
    assert "--log-format=json" in args
    (port,) = [p for p in c["ports"] if p["name"] != "rights"]  # rights: self-fencing
    assert port == {"name": "metrics", "containerPort": 8081, "protocol": "TCP"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}

    (service,) = _without_rights(rendered.all("Service"))
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert service["spec"]["selector"].items() <= (
        rendered.one("Deployment")["spec"]["template"]["metadata"]["labels"].items())


def test_the_kvm_device_plugin_also_tells_the_controller_its_resource(helm: Helm) -> None:
    """kvmDevicePlugin.enabled alone makes runner pods request /dev/kvm: the controller gets
    ``--kvm-resource`` with the plugin's resource name; without the plugin it gets none,
    and an explicit extraArgs value comes after it (the last one is the one used)."""
    def kvm_args(*sets: str) -> list[str]:
        args = helm.template("neonvm-controller", "neonvm-system", sets=sets).container["args"]
        return [a for a in args if a.startswith("--kvm-resource")]

    assert kvm_args() == []
    assert kvm_args("kvmDevicePlugin.enabled=true") == [
        "--kvm-resource=devices.kubevirt.io/kvm"]
    assert kvm_args("kvmDevicePlugin.enabled=true",
                    "kvmDevicePlugin.resourceName=example.com/kvm") == [
        "--kvm-resource=example.com/kvm"]
    assert kvm_args("kvmDevicePlugin.enabled=true",
                    "controller.extraArgs={--kvm-resource=other.example/kvm}") == [
        "--kvm-resource=devices.kubevirt.io/kvm", "--kvm-resource=other.example/kvm"]


def test_the_pod_runs_with_a_restricted_security_context(helm: Helm) -> None:
    rendered = helm.template("neonvm-controller", "neonvm-system")
    pod_sc = rendered.pod_spec["securityContext"]
    sc = rendered.container["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] != 0
    assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}


def test_etcd_endpoints_tls_files_and_credentials_reach_the_controller(helm: Helm) -> None:
    values = yaml.safe_load(HA_TLS_VALUES.read_text())["etcd"]
    rendered = helm.template("neonvm-controller", "neonvm-system", HA_TLS_VALUES)
    env = rendered.env()
    assert env["NEONVM_ETCD_ENDPOINTS"]["value"] == ",".join(values["endpoints"])
    assert env["NEONVM_ETCD_PREFIX"]["value"] == values["prefix"]

    (mount,) = [m for m in rendered.container["volumeMounts"] if m["name"] == "etcd-tls"]
    assert mount["readOnly"] is True
    (volume,) = [v for v in rendered.pod_spec["volumes"] if v["name"] == "etcd-tls"]
    assert volume["secret"]["secretName"] == values["tls"]["secretName"]
    files = {item["path"]: item["key"] for item in volume["secret"]["items"]}
    assert files == {"ca.crt": "ca.crt", "tls.crt": "tls.crt", "tls.key": "tls.key"}
    for var, file in (("NEONVM_ETCD_CA", "ca.crt"), ("NEONVM_ETCD_CERT", "tls.crt"),
                      ("NEONVM_ETCD_KEY", "tls.key")):
        assert env[var]["value"] == f"{mount['mountPath']}/{file}"

    for var, key in (("NEONVM_ETCD_USER", "username"), ("NEONVM_ETCD_PASSWORD", "password")):
        ref = env[var]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": values["auth"]["secretName"], "key": key}
        assert "value" not in env[var]

    plain = helm.template("neonvm-controller", "neonvm-system", sets=INSECURE_ETCD).env()
    assert not {"NEONVM_ETCD_CA", "NEONVM_ETCD_CERT", "NEONVM_ETCD_USER"} & plain.keys()


# ---- the locks' etcd is closed by default ------------------------------------------------

INSECURE_ETCD = ("etcd.insecure=true", "etcd.tls.enabled=false",
                 "etcd.endpoints={http://neonvm-etcd:2379}", "etcd.bundled.enabled=false")


def test_default_values_speak_tls_to_etcd_with_a_client_certificate(helm: Helm) -> None:
    rendered = helm.template("neonvm-controller", "neonvm-system")
    env = rendered.env()
    assert all(e.startswith("https://") for e in env["NEONVM_ETCD_ENDPOINTS"]["value"].split(","))
    (mount,) = [m for m in rendered.container["volumeMounts"] if m["name"] == "etcd-tls"]
    (volume,) = [v for v in rendered.pod_spec["volumes"] if v["name"] == "etcd-tls"]
    assert volume["secret"]["secretName"] == "neonvm-etcd-client"
    for var, file in (("NEONVM_ETCD_CA", "ca.crt"), ("NEONVM_ETCD_CERT", "tls.crt"),
                      ("NEONVM_ETCD_KEY", "tls.key")):
        assert env[var]["value"] == f"{mount['mountPath']}/{file}"


def test_default_values_let_only_the_controller_pods_reach_etcd(helm: Helm) -> None:
    rendered = helm.template("nvm", "ops")
    (policy,) = _without_rights(rendered.all("NetworkPolicy"))
    spec = policy["spec"]
    assert policy["metadata"]["namespace"] == "ops"
    assert spec["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "neonvm-etcd"}}
    assert spec["policyTypes"] == ["Ingress"]
    clients, peers = spec["ingress"]
    pod_labels = rendered.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    controller, tester = clients["from"]
    for peer in (controller, tester):
        assert peer["namespaceSelector"] == {
            "matchLabels": {"kubernetes.io/metadata.name": "ops"}}
    assert controller["podSelector"]["matchLabels"].items() <= pod_labels.items()
    # The `helm test` pod, and not the controller's pods by those labels.
    (test_pod,) = [o for o in rendered.objects if o["kind"] == "Pod"]
    assert tester["podSelector"]["matchLabels"].items() <= test_pod["metadata"]["labels"].items()
    assert not tester["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert clients["ports"] == [{"protocol": "TCP", "port": 2379}]
    # Members of the etcd cluster reach each other; nobody else is named.
    assert peers["from"] == [{"podSelector": spec["podSelector"]}]
    assert {p["port"] for p in peers["ports"]} == {2379, 2380}


def test_every_helm_test_hook_is_a_pod(helm: Helm) -> None:
    """Helm 3's `helm test --logs` asks for the logs of every test hook as a pod, and
    fails ("unable to get pod logs for ...") on a hook of any other kind."""
    rendered = helm.template("nvm", "ops")
    hooks = [o for o in rendered.objects
             if "test" in o["metadata"].get("annotations", {}).get("helm.sh/hook", "")]
    assert hooks and {o["kind"] for o in hooks} == {"Pod"}


def test_runner_pods_of_the_watched_namespace_may_not_reach_the_etcd_ports(helm: Helm) -> None:
    rendered = helm.template("nvm", "ops", sets=("controller.watchNamespace=tenant",))
    (runners,) = [p for p in rendered.all("NetworkPolicy")
                  if p["metadata"]["namespace"] == "tenant"]
    spec = runners["spec"]
    assert spec["podSelector"] == {"matchExpressions": [
        {"key": "vm.neon.tech/name", "operator": "Exists"}]}
    assert spec["policyTypes"] == ["Egress"]
    (rule,) = spec["egress"]
    tcp = [(p["port"], p["endPort"]) for p in rule["ports"] if p["protocol"] == "TCP"]
    assert tcp == [(1, 2378), (2381, 65535)]  # every TCP port but 2379 and 2380
    allowed = {port for low, high in tcp for port in (low, high)}
    assert not {2379, 2380} & allowed

    elsewhere = helm.template("nvm", "ops", sets=(
        "etcd.networkPolicy.runnerNamespaces={a,b}", "etcd.networkPolicy.clientPort=12379",
        "etcd.networkPolicy.peerPort=12380"))
    runner_policies = [p for p in elsewhere.all("NetworkPolicy")
                       if "Egress" in p["spec"]["policyTypes"]]
    assert sorted(p["metadata"]["namespace"] for p in runner_policies) == ["a", "b"]
    tcp = [(p["port"], p["endPort"]) for p in runner_policies[0]["spec"]["egress"][0]["ports"]
           if p["protocol"] == "TCP"]
    assert tcp == [(1, 12378), (12381, 65535)]

    assert not _without_rights(helm.template("nvm", "ops", sets=(
        "etcd.networkPolicy.enabled=false",)).all("NetworkPolicy"))


@pytest.mark.parametrize(("sets", "message"), [
    (("etcd.tls.enabled=false", "etcd.endpoints={http://e:2379}"),
     "at '/etcd/tls/enabled': value must be true"),
    (("etcd.endpoints={http://e:2379}",), "https://"),
    (("etcd.tls.certKey=", "etcd.tls.keyKey="), "no client credentials"),
    (("etcd.tls.secretName=",), "secretName"),
    (("etcd.networkPolicy.etcdPodSelector=null",), "etcdPodSelector"),
], ids=["plain", "http-endpoint", "no-credentials", "no-secret", "empty-etcd-selector"])
def test_plain_or_anonymous_etcd_is_refused_unless_insecure_is_set(
        helm: Helm, sets: tuple[str, ...], message: str) -> None:
    args = [a for s in sets for a in ("--set", s)]
    assert message in helm.template_fails(*args)


def test_insecure_etcd_renders_plain_http_when_asked_for_by_name(helm: Helm) -> None:
    env = helm.template("nvm", "ops", sets=INSECURE_ETCD).env()
    assert env["NEONVM_ETCD_ENDPOINTS"]["value"] == "http://neonvm-etcd:2379"


def test_a_ca_only_tls_setup_passes_no_client_certificate(helm: Helm) -> None:
    rendered = helm.template(
        "neonvm-controller", "neonvm-system", HA_TLS_VALUES,
        sets=("etcd.tls.certKey=", "etcd.tls.keyKey=", "etcd.tls.caKey=root.pem",
              "etcd.bundled.enabled=false"),
    )
    env = rendered.env()
    assert env["NEONVM_ETCD_CA"]["value"].endswith("/ca.crt")
    assert "NEONVM_ETCD_CERT" not in env and "NEONVM_ETCD_KEY" not in env
    (volume,) = [v for v in rendered.pod_spec["volumes"] if v["name"] == "etcd-tls"]
    assert volume["secret"]["items"] == [{"key": "root.pem", "path": "ca.crt"}]


def test_the_rbac_rules_are_the_generated_ones_and_the_lease_is_namespaced(helm: Helm) -> None:
    # The user roles are ClusterRoles too: test_tenant_boundaries.py checks them; the
    # self-fencing roles, test_chart_self_fencing.py.
    rendered = helm.template("nvm", "ops", sets=("leaderElection.namespace=leases",
                                                 "rbac.userRoles=false",
                                                 "controller.rightSeconds=0"))
    sa = rendered.one("ServiceAccount")["metadata"]
    subject = {"kind": "ServiceAccount", "name": sa["name"], "namespace": "ops"}

    cluster_role = rendered.one("ClusterRole")
    # Secrets: `create` alone, for the VMs' SSH key Secrets (rbac.sshKeys, on by default).
    assert cluster_role["rules"] == manifests.controller_rules() + manifests.ssh_key_rules()
    assert not any("leases" in r["resources"] for r in cluster_role["rules"])
    crb = rendered.one("ClusterRoleBinding")
    assert crb["roleRef"]["name"] == cluster_role["metadata"]["name"]
    assert crb["subjects"] == [subject]

    assert not any("secrets" in r["resources"] and set(r["verbs"]) != {"create"}
                   for r in cluster_role["rules"])
    no_ssh = helm.template("nvm", "ops", sets=("rbac.sshKeys=false", "rbac.userRoles=false",
                                               "controller.rightSeconds=0"))
    assert not any("secrets" in r["resources"] for r in no_ssh.one("ClusterRole")["rules"])
    checking = helm.template("nvm", "ops", sets=("rbac.checkImagePullSecrets=true",
                                                 "rbac.userRoles=false",
                                                 "controller.rightSeconds=0"))
    assert checking.one("ClusterRole")["rules"] == (
        manifests.controller_rules() + manifests.pull_secret_rules()
        + manifests.ssh_key_rules())

    role = rendered.one("Role")
    assert role["metadata"]["namespace"] == "leases"
    assert role["rules"] == manifests.leader_election_rules()
    rb = rendered.one("RoleBinding")
    assert rb["metadata"]["namespace"] == "leases"
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                             "name": role["metadata"]["name"]}
    assert rb["subjects"] == [subject]
    assert "--lease-namespace=leases" in rendered.container["args"]
    assert rendered.pod_spec["serviceAccountName"] == sa["name"]


def test_the_admission_fence_names_the_release_service_account(helm: Helm) -> None:
    rendered = helm.template("nvm", "ops", sets=("serviceAccount.name=vm-operator",))
    user = "system:serviceaccount:ops:vm-operator"
    assert rendered.service_account_user() == user
    policy = rendered.one("ValidatingAdmissionPolicy")
    assert policy["spec"] == manifests.admission_policy([user])["spec"]
    assert manifests.CHART_SA_PLACEHOLDER not in json.dumps(rendered.objects)
    binding = rendered.one("ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"],
                               "validationActions": ["Deny"]}

    disabled = helm.template("nvm", "ops", sets=("admissionPolicy.enabled=false",))
    assert not disabled.all("ValidatingAdmissionPolicy")
    assert not disabled.all("ValidatingAdmissionPolicyBinding")


def test_the_service_monitor_is_opt_in_and_scrapes_the_metrics_service(helm: Helm) -> None:
    assert not helm.template("nvm", "ops").all("ServiceMonitor")
    rendered = helm.template("nvm", "ops", sets=("metrics.serviceMonitor.enabled=true",
                                                 "metrics.serviceMonitor.labels.release=prom"))
    monitor = rendered.one("ServiceMonitor")
    (service,) = _without_rights(rendered.all("Service"))
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items())
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ops"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    assert endpoint["path"] == "/metrics"


SCHEMA_VIOLATIONS = [
    pytest.param(["--set", "replicaCount=three"],
                 "at '/replicaCount': got string, want integer", id="replicas-not-a-number"),
    pytest.param(["--set-string", "controller.healthPort=8080"],
                 "at '/controller/healthPort': got string, want integer", id="port-as-string"),
    pytest.param(["--set", "etcd.endpoints=null"],
                 "at '/etcd': missing property 'endpoints'", id="etcd-endpoints-missing"),
    pytest.param(["--values", "EMPTY_ENDPOINTS"],
                 "at '/etcd/endpoints': minItems: got 0, want 1", id="etcd-endpoints-empty"),
    pytest.param(["--set", "etcd.endpoints={etcd:2379}"],
                 "at '/etcd/endpoints/0': 'etcd:2379' does not match pattern",
                 id="etcd-endpoint-without-scheme"),
    pytest.param(["--set", "etcd.tls.secretName="],
                 "at '/etcd/tls/secretName': minLength: got 0, want 1",
                 id="tls-without-secret"),
    pytest.param(["--set", "etcd.endpoints={http://e:2379}"],
                 "at '/etcd/endpoints/0': 'http://e:2379' does not match pattern "
                 "'^https://'", id="tls-with-http-endpoints"),
    pytest.param(["--set", "etcd.insecure=true", "--set", "etcd.tls.enabled=false"],
                 "at '/etcd/endpoints/0': 'https://neonvm-etcd:2379' does not match pattern "
                 "'^http://'", id="https-without-tls"),
    pytest.param(["--set", "etcd.auth.enabled=true"],
                 "at '/etcd/auth/secretName': minLength: got 0, want 1",
                 id="auth-without-secret"),
    pytest.param(["--set", "replicas=3"], "additional properties 'replicas' not allowed",
                 id="unknown-top-level-key"),
    pytest.param(["--set", "admissionPolicy.validationActions={Deny,Warn}"],
                 "at '/admissionPolicy/validationActions': 'not' failed", id="deny-with-warn"),
]


@pytest.mark.parametrize(("args", "reason"), SCHEMA_VIOLATIONS)
def test_values_that_break_the_schema_are_refused_with_helms_message(
    helm: Helm, tmp_path: Path, args: list[str], reason: str,
) -> None:
    empty = tmp_path / "empty-endpoints.yaml"
    empty.write_text("etcd:\n  endpoints: []\n")
    args = [str(empty) if a == "EMPTY_ENDPOINTS" else a for a in args]
    message = helm.template_fails(*args)
    assert SCHEMA_ERROR in message
    assert reason in message
    lint = helm.run("lint", str(CHART), *args, check=False)
    assert lint.returncode != 0
    assert "[ERROR] values.yaml" in lint.stdout and reason in lint.stdout


@pytest.mark.parametrize(("sets", "message"), [
    pytest.param(("leaderElection.renewDeadlineSeconds=4",),
                 "renewDeadlineSeconds (4) must be below leaseDurationSeconds (4)",
                 id="renew-deadline-not-below-lease-duration"),
    pytest.param(("leaderElection.retryPeriodSeconds=9",),
                 "must exceed 1.2 x retryPeriodSeconds (9)", id="retry-period-too-long"),
    pytest.param(("etcd.endpoints={https://e:2379}", "etcd.tls.enabled=true",
                  "etcd.tls.secretName=s", "etcd.tls.keyKey="),
                 "certKey and etcd.tls.keyKey go together", id="cert-without-key"),
    pytest.param(("serviceAccount.create=false",), "serviceAccount.name is required",
                 id="no-service-account"),
])
def test_inconsistent_values_fail_the_render_with_a_reason(
    helm: Helm, sets: tuple[str, ...], message: str,
) -> None:
    args = [a for s in sets for a in ("--set", s)]
    assert message in helm.template_fails(*args)


# ---- the real API server ------------------------------------------------------------------


def _dry_run_create(dyn: dynamic.DynamicClient, obj: dict[str, Any],
                    namespace: str) -> dict[str, Any]:
    resource = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
    kwargs: dict[str, Any] = {}
    if resource.namespaced:
        kwargs["namespace"] = obj["metadata"].get("namespace", namespace)
    result = resource.create(body=obj, dry_run="All", field_validation="Strict", **kwargs)
    out: dict[str, Any] = result.to_dict()
    return out


def _apply_crds(api: client.ApiClient, rendered: Rendered) -> None:
    ext = client.ApiextensionsV1Api(api)
    for crd in rendered.all("CustomResourceDefinition"):
        kube.apply(api, crd)
        name = crd["metadata"]["name"]
        wait_for(lambda name=name: any(  # type: ignore[misc]
            c.type == "Established" and c.status == "True"
            for c in ext.read_custom_resource_definition(name).status.conditions or []),
            what=f"CRD {name} established")


@pytest.fixture
def release_namespace(api: client.ApiClient) -> Iterator[str]:
    yield from _restricted_namespace(api)


@pytest.mark.cluster
@pytest.mark.parametrize("values", list(VALUE_SETS), ids=list(VALUE_SETS))
def test_the_api_server_accepts_every_rendered_object(
    helm: Helm, api: client.ApiClient, release_namespace: str, values: str,
) -> None:
    rendered = helm.template(_release(), release_namespace, VALUE_SETS[values], crds=True)
    (crd,) = rendered.all("CustomResourceDefinition")
    assert crd == manifests.crd()
    _apply_crds(api, rendered)

    dyn = dynamic.DynamicClient(api)
    checked = []
    for obj in rendered.objects:
        if obj["kind"] in ("CustomResourceDefinition", "ServiceMonitor"):
            continue
        accepted = _dry_run_create(dyn, obj, release_namespace)
        assert accepted["metadata"]["name"] == obj["metadata"]["name"]
        checked.append(obj["kind"])
    assert len(checked) >= 10, checked

    # The restricted Pod Security Standard is enforced on pods, not on Deployments: make
    # the pod the ReplicaSet would make, and let the real PodSecurity admission judge it.
    template = rendered.one("Deployment")["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {**template["metadata"], "name": "pss-probe"}, "spec": template["spec"]}
    _dry_run_create(dyn, pod, release_namespace)


@pytest.mark.cluster
def test_a_pod_that_breaks_the_restricted_standard_is_refused_there(
    helm: Helm, api: client.ApiClient, release_namespace: str,
) -> None:
    """The check above can fail: the same pod with privilege escalation is refused."""
    rendered = helm.template(_release(), release_namespace,
                             sets=("securityContext.allowPrivilegeEscalation=true",))
    template = rendered.one("Deployment")["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {**template["metadata"], "name": "pss-probe"}, "spec": template["spec"]}
    with pytest.raises(ApiException) as refused:
        _dry_run_create(dynamic.DynamicClient(api), pod, release_namespace)
    assert refused.value.status == 403
    assert "allowPrivilegeEscalation" in kube.api_error_message(refused.value)


@pytest.mark.cluster
def test_helm_installs_upgrades_and_uninstalls_the_release_on_the_real_api_server(
    helm: Helm, cluster: LocalCluster, api: client.ApiClient, release_namespace: str,
) -> None:
    release = _release()
    fullname = f"{release}-neonvm-controller"
    apps = client.AppsV1Api(api)
    rbac = client.RbacAuthorizationV1Api(api)
    admission = client.AdmissionregistrationV1Api(api)

    def run(*args: str) -> str:
        return helm.run(*args, "--namespace", release_namespace,
                        kubeconfig=cluster.kubeconfig).stdout

    try:
        run("install", release, str(CHART))
        assert apps.read_namespaced_deployment(fullname, release_namespace).spec.replicas == 3
        assert rbac.read_cluster_role(fullname).rules
        policy = admission.read_validating_admission_policy(f"{fullname}-runner-pod-fence")
        assert f"system:serviceaccount:{release_namespace}:{fullname}" in json.dumps(
            api.sanitize_for_serialization(policy.spec))

        run("upgrade", release, str(CHART), "--reuse-values", "--set", "replicaCount=5")
        assert apps.read_namespaced_deployment(fullname, release_namespace).spec.replicas == 5
        history = json.loads(run("history", release, "--output", "json"))
        assert [h["revision"] for h in history] == [1, 2]
        assert history[-1]["status"] == "deployed"
    finally:
        helm.run("uninstall", release, "--namespace", release_namespace,
                 kubeconfig=cluster.kubeconfig, check=False)
    assert _gone(lambda: apps.read_namespaced_deployment(fullname, release_namespace))
    assert _gone(lambda: rbac.read_cluster_role(fullname))
    assert _gone(lambda: admission.read_validating_admission_policy(
        f"{fullname}-runner-pod-fence"))
    # Helm never deletes what it installed from crds/: VMs outlive the controller.
    client.ApiextensionsV1Api(api).read_custom_resource_definition(manifests.crd()["metadata"]["name"])


# ---- RBAC and the fence, for real ---------------------------------------------------------


DEV_FENCE = manifests.POLICY_NAME
"""The local cluster's own fence (for the ``neonvm-controller`` user). While a test installs
the chart's fence (for the chart's ServiceAccount), the local one's binding is suspended:
in a cluster installed by the chart, the chart's fence is the only one."""


@dataclass
class Installed:
    """The chart's identity, RBAC and fence, created for real; removed on exit."""

    rendered: Rendered
    admin_kubeconfig: Path
    created: list[dict[str, Any]] = field(default_factory=list)

    @property
    def fence_name(self) -> str:
        name: str = self.rendered.one("ValidatingAdmissionPolicy")["metadata"]["name"]
        return name

    def as_service_account(self) -> client.ApiClient:
        """The admin kubeconfig, impersonating the chart's ServiceAccount."""
        sa_api = kube.api_client(self.admin_kubeconfig)
        sa_api.set_default_header("Impersonate-User", self.rendered.service_account_user())
        return sa_api


IDENTITY_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                  "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


@contextlib.contextmanager
def _install_identity(cluster: LocalCluster, api: client.ApiClient, rendered: Rendered,
                      ) -> Iterator[Installed]:
    """Create the chart's ServiceAccount, RBAC and fence, and make its fence the only one."""
    dyn = dynamic.DynamicClient(api)
    installed = Installed(rendered, cluster.kubeconfig)
    admission = client.AdmissionregistrationV1Api(api)
    try:
        for obj in rendered.objects:
            if obj["kind"] in IDENTITY_KINDS:
                resource = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
                ns = obj["metadata"].get("namespace") if resource.namespaced else None
                resource.create(body=obj, namespace=ns)
                installed.created.append(obj)
        with contextlib.suppress(ApiException):
            admission.delete_validating_admission_policy_binding(DEV_FENCE)
        if any(o["kind"] == "ValidatingAdmissionPolicyBinding" for o in installed.created):
            _wait_until_fenced_by(api, installed.fence_name)
        yield installed
    finally:
        for obj in reversed(installed.created):
            resource = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
            ns = obj["metadata"].get("namespace") if resource.namespaced else None
            with contextlib.suppress(ApiException):
                resource.delete(name=obj["metadata"]["name"], namespace=ns)
        kube.apply(api, manifests.admission_policy_binding())
        _wait_until_fenced_by(api, DEV_FENCE)


def _wait_until_fenced_by(api: client.ApiClient, fence: str) -> None:
    """Wait until ``fence`` refuses an ungated runner pod (policies load asynchronously)."""
    core = client.CoreV1Api(api)
    probe = _runner_pod({"metadata": {"name": "probe", "uid": str(uuid.uuid4())}},
                        "fence-probe", gated=False)
    wait_for(lambda: _fence_denies(_refused_or_none(lambda: core.create_namespaced_pod(
        "default", probe, dry_run="All")), fence), what=f"{fence} in force")


def _refused_or_none(call: Callable[[], object]) -> ApiException | None:
    try:
        call()
    except ApiException as err:
        return err
    return None


def _runner_pod(vm: dict[str, Any], name: str, gated: bool = True) -> dict[str, Any]:
    """A runner pod as the controller creates it: gated, labelled and owned by the VM."""
    meta = vm["metadata"]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {types.LABEL_VM_NAME: meta["name"], types.LABEL_VM_UID: meta["uid"]},
            "ownerReferences": [{"apiVersion": types.API_VERSION, "kind": types.KIND,
                                 "name": meta["name"], "uid": meta["uid"],
                                 "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": {
            "schedulingGates": [{"name": types.SCHEDULING_GATE}] if gated else [],
            "restartPolicy": "Never",
            "containers": [{"name": "runner", "image": "neonvm-runner:test"}],
        },
    }


def _ungate_patch(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The controller's ungate: only our gate goes, only from the pod it observed."""
    gates = pod["spec"]["schedulingGates"]
    index = next(i for i, g in enumerate(gates) if g["name"] == types.SCHEDULING_GATE)
    return [
        {"op": "test", "path": "/metadata/uid", "value": pod["metadata"]["uid"]},
        {"op": "test", "path": "/metadata/resourceVersion",
         "value": pod["metadata"]["resourceVersion"]},
        {"op": "test", "path": f"/spec/schedulingGates/{index}/name",
         "value": types.SCHEDULING_GATE},
        {"op": "remove", "path": f"/spec/schedulingGates/{index}"},
    ]


def _refused(call: Callable[[], object]) -> ApiException:
    with pytest.raises(ApiException) as err:
        call()
    return err.value


def _forbidden(call: Callable[[], object]) -> None:
    err = _refused(call)
    assert err.status == 403, f"expected 403, got {err.status}: {kube.api_error_message(err)}"


def _fence_denies(err: ApiException | None, fence: str) -> bool:
    return (err is not None and err.status in (403, 422)
            and f"'{fence}'" in kube.api_error_message(err))


@pytest.fixture
def lease_namespace(api: client.ApiClient) -> Iterator[str]:
    yield from _restricted_namespace(api)


@pytest.mark.cluster
def test_the_service_account_may_do_what_the_controller_does_and_nothing_more(
    helm: Helm, cluster: LocalCluster, api: client.ApiClient, namespace: str,
    lease_namespace: str,
) -> None:
    rendered = helm.template(_release(), lease_namespace)
    custom = client.CustomObjectsApi(api)
    vm = custom.create_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, _sample_vm("lifecycle"))
    name = vm["metadata"]["name"]

    with _install_identity(cluster, api, rendered) as installed:
        sa_api = installed.as_service_account()
        sa_custom = client.CustomObjectsApi(sa_api)
        sa_core = client.CoreV1Api(sa_api)
        admin_core = client.CoreV1Api(api)
        fence = installed.fence_name

        # Watch and read VMs, everywhere and directly.
        listed = sa_custom.list_cluster_custom_object(types.GROUP, types.VERSION, types.PLURAL)
        assert name in [v["metadata"]["name"] for v in listed["items"]]
        _drain_watch(sa_custom.list_cluster_custom_object(
            types.GROUP, types.VERSION, types.PLURAL, watch=True, timeout_seconds=1,
            resource_version=listed["metadata"]["resourceVersion"], _preload_content=False))
        vm = sa_custom.get_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, name)

        # Add the finalizer (a PUT carrying resourceVersion) and write status both ways.
        vm["metadata"]["finalizers"] = [types.FINALIZER]
        vm = sa_custom.replace_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, name, vm)
        vm["status"] = {"phase": "Pending"}
        vm = sa_custom.replace_namespaced_custom_object_status(
            types.GROUP, types.VERSION, namespace, types.PLURAL, name, vm)
        vm = sa_custom.patch_namespaced_custom_object_status(
            types.GROUP, types.VERSION, namespace, types.PLURAL, name,
            {"metadata": {"resourceVersion": vm["metadata"]["resourceVersion"]},
             "status": {"phase": "Pending", "restartCount": 0}})

        # Create the gated runner pod; list, watch and read pods directly.
        pod_name = f"{name}-{vm['metadata']['uid'][:8]}-1"
        pod = sa_core.create_namespaced_pod(namespace, _runner_pod(vm, pod_name)).to_dict()
        pod = api.sanitize_for_serialization(sa_core.read_namespaced_pod(pod_name, namespace))
        selector = f"{types.LABEL_VM_NAME}={name}"
        assert [p.metadata.name for p in sa_core.list_namespaced_pod(
            namespace, label_selector=selector).items] == [pod_name]
        _drain_watch(sa_core.list_pod_for_all_namespaces(
            watch=True, timeout_seconds=1, label_selector=selector, _preload_content=False))

        # Only the chart's ServiceAccount may ungate: the admin is refused by the chart's
        # fence (wait until the API server has loaded it), the ServiceAccount is not
        # (wait until the suspended local fence has let go).
        wait_for(lambda: _fence_denies(_refused_or_none(lambda: admin_core.patch_namespaced_pod(
            pod_name, namespace, _ungate_patch(pod), dry_run="All")), fence),
            what="the chart's fence refusing the admin's ungate")
        wait_for(lambda: _try(lambda: sa_core.patch_namespaced_pod(
            pod_name, namespace, _ungate_patch(pod), dry_run="All")),
            what="the chart's ServiceAccount allowed to ungate")
        err = _refused(lambda: sa_core.create_namespaced_pod(
            namespace, _runner_pod(vm, f"{name}-ungated", gated=False)))
        assert _fence_denies(err, fence), kube.api_error_message(err)
        ungated = sa_core.patch_namespaced_pod(pod_name, namespace, _ungate_patch(pod))
        assert not ungated.spec.scheduling_gates

        # Events about the VM, in its namespace, in both event APIs.
        sa_core.create_namespaced_event(namespace, client.CoreV1Event(
            metadata=client.V1ObjectMeta(name=f"{name}.{uuid.uuid4().hex[:16]}"),
            involved_object=client.V1ObjectReference(
                api_version=types.API_VERSION, kind=types.KIND, name=name,
                namespace=namespace, uid=vm["metadata"]["uid"]),
            reason="PodCreated", message="runner pod created", type="Normal"))
        client.EventsV1Api(sa_api).create_namespaced_event(namespace, client.EventsV1Event(
            metadata=client.V1ObjectMeta(name=f"{name}.{uuid.uuid4().hex[:16]}"),
            event_time=_micro_now(), action="Ungate", reason="PodUngated",
            reporting_controller="neonvm.dev/controller", reporting_instance="test",
            regarding=client.V1ObjectReference(
                api_version=types.API_VERSION, kind=types.KIND, name=name,
                namespace=namespace, uid=vm["metadata"]["uid"]),
            note="runner pod ungated", type="Normal"))

        # The Lease: read, create, replace, in the lease namespace only.
        _lease_lifecycle(sa_api, lease_namespace)
        sa_leases = client.CoordinationV1Api(sa_api)
        _forbidden(lambda: sa_leases.create_namespaced_lease(namespace, _lease("elsewhere")))
        _forbidden(lambda: sa_leases.list_namespaced_lease(lease_namespace))
        _forbidden(lambda: sa_leases.delete_namespaced_lease("neonvm", lease_namespace))

        # VM deleted: delete its pods with a uid precondition, then drop the finalizer.
        custom.delete_namespaced_custom_object(types.GROUP, types.VERSION, namespace,
                                               types.PLURAL, name)
        sa_core.delete_namespaced_pod(pod_name, namespace, body=client.V1DeleteOptions(
            preconditions=client.V1Preconditions(uid=pod["metadata"]["uid"])))
        vm = sa_custom.get_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, name)
        assert vm["metadata"].get("deletionTimestamp")
        vm["metadata"]["finalizers"] = []
        sa_custom.replace_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, name, vm)
        wait_for(lambda: _gone(lambda: custom.get_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, name)), what="VM gone")

        # What the controller must never do.
        other = custom.create_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, _sample_vm("other"))
        _forbidden(lambda: sa_custom.delete_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, other["metadata"]["name"]))
        _forbidden(lambda: sa_custom.create_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, _sample_vm("mine")))
        _forbidden(lambda: sa_core.list_namespaced_secret(namespace))
        _forbidden(lambda: sa_core.read_namespaced_secret("any", lease_namespace))
        _forbidden(lambda: sa_core.list_namespaced_config_map(namespace))
        _forbidden(lambda: sa_core.create_namespaced_pod_eviction(
            pod_name, namespace, client.V1Eviction(metadata=client.V1ObjectMeta(
                name=pod_name, namespace=namespace))))
        _forbidden(lambda: client.RbacAuthorizationV1Api(sa_api).list_cluster_role())
        sa_api.close()


def _try(call: Callable[[], object]) -> bool:
    try:
        call()
    except ApiException:
        return False
    return True


def _gone(call: Callable[[], object]) -> bool:
    try:
        call()
    except ApiException as err:
        if err.status == 404:
            return True
        raise
    return False


def _drain_watch(resp: Any) -> None:
    """A watch the server accepted: read it to its (short) end and close it."""
    try:
        resp.read()
    finally:
        resp.release_conn()


def _micro_now() -> str:
    from datetime import UTC, datetime

    return times.format_microtime(datetime.now(UTC))


def _lease(name: str) -> client.V1Lease:
    return client.V1Lease(metadata=client.V1ObjectMeta(name=name),
                          spec=client.V1LeaseSpec(holder_identity="test_0",
                                                  lease_duration_seconds=15,
                                                  lease_transitions=0))


def _lease_lifecycle(sa_api: client.ApiClient, namespace: str) -> None:
    """The election's calls: GET (absent), create, GET, replace by resourceVersion."""
    leases = client.CoordinationV1Api(sa_api)
    assert _gone(lambda: leases.read_namespaced_lease("neonvm", namespace))
    leases.create_namespaced_lease(namespace, _lease("neonvm"))
    lease = leases.read_namespaced_lease("neonvm", namespace)
    lease.spec.holder_identity = "test_1"
    lease.spec.lease_transitions = 1
    replaced = leases.replace_namespaced_lease("neonvm", namespace, lease)
    assert replaced.spec.lease_transitions == 1


def _sample_vm(prefix: str) -> dict[str, Any]:
    path = Path(__file__).resolve().parent.parent / "examples" / "vm-deploy.yaml"
    obj: dict[str, Any] = yaml.safe_load(path.read_text())
    obj["metadata"] = {"name": f"{prefix}-{uuid.uuid4().hex[:6]}"}
    obj.pop("status", None)
    return obj


# ---- the real controller, as the chart runs it --------------------------------------------


def _controller_cli_exists() -> bool:
    try:
        import neonvm.cli.controller  # noqa: F401
    except ModuleNotFoundError:
        return False
    return True


@pytest.mark.cluster
@pytest.mark.skipif(not _controller_cli_exists(), reason="neonvm controller run not written yet")
def test_the_controller_runs_a_vm_lifecycle_with_the_charts_command_line_and_identity(
    helm: Helm, cluster: LocalCluster, api: client.ApiClient, namespace: str,
    lease_namespace: str, tmp_path: Path,
) -> None:
    health_port = free_port()
    etcd = cluster.locks_etcd_config(f"/chart-test-{uuid.uuid4().hex[:8]}")
    rendered = helm.template(_release(), lease_namespace, sets=(
        f"controller.healthPort={health_port}",
        f"etcd.endpoints={{{cluster.locks_etcd_url}}}", "etcd.bundled.enabled=false",
        f"etcd.prefix={etcd.prefix}",
        "controller.logFormat=text",
        "leaderElection.leaseDurationSeconds=6", "leaderElection.renewDeadlineSeconds=4",
        "leaderElection.retryPeriodSeconds=1",
        # Self-fencing needs a pod IP its EndpointSlice may name; its own tests run it
        # (tests/test_self_fencing_cluster.py, tests/test_real_node_fencing.py).
        "controller.rightSeconds=0",
    ))
    custom = client.CustomObjectsApi(api)
    core = client.CoreV1Api(api)
    with _install_identity(cluster, api, rendered) as installed:
        sa = rendered.one("ServiceAccount")["metadata"]["name"]
        kubeconfig = _service_account_kubeconfig(api, cluster, lease_namespace, sa,
                                                  tmp_path / "sa.kubeconfig")
        container = rendered.container
        neonvm_cli = shutil.which("neonvm") or f"{sys.executable} -m neonvm"
        argv = [*neonvm_cli.split(), *container["args"]]
        argv.insert(argv.index("run") + 1, f"--kubeconfig={kubeconfig}")
        env = {**os.environ, **{e["name"]: e["value"] for e in container["env"] if "value" in e},
               "POD_NAME": "chart-test", "POD_NAMESPACE": lease_namespace}
        # The chart's default TLS files, mounted here as the kubelet would mount its Secret.
        for var, path in (("NEONVM_ETCD_CA", etcd.ca), ("NEONVM_ETCD_CERT", etcd.cert),
                          ("NEONVM_ETCD_KEY", etcd.key)):
            assert env[var].startswith("/etc/"), env[var]
            env[var] = str(path)
        env.pop("KUBECONFIG", None)
        log = tmp_path / "controller.log"
        with _running(argv, env, log) as proc:
            wait_for(lambda: proc.poll() is not None or _lease_held(api, rendered),
                     timeout=60, what="the controller leading")
            assert proc.poll() is None, log.read_text()[-3000:]
            # The probes the chart renders answer on the controller: live, and ready once
            # the leader's caches synced.
            for kind in ("livenessProbe", "readinessProbe"):
                path = container[kind]["httpGet"]["path"]
                wait_for(lambda path=path: _http_status(health_port, path) == 200,
                         timeout=60, what=f"{kind} {path} passing")

            # A short grace period: the simulated node ends the runner pod's graceful
            # deletion only when it is over (30 s by default), and the VM goes after it.
            sample = _sample_vm("chart")
            sample["spec"]["terminationGracePeriodSeconds"] = 2
            vm = custom.create_namespaced_custom_object(
                types.GROUP, types.VERSION, namespace, types.PLURAL, sample)
            name = vm["metadata"]["name"]

            def committed() -> str | None:
                fresh = custom.get_namespaced_custom_object(
                    types.GROUP, types.VERSION, namespace, types.PLURAL, name)
                pod_name = (fresh.get("status") or {}).get("podName")
                if not pod_name:
                    return None
                pod = core.read_namespaced_pod(pod_name, namespace)
                return None if pod.spec.scheduling_gates else str(pod_name)

            pod_name = wait_for(committed, timeout=90,
                                what="a committed, ungated runner pod")
            pods = core.list_namespaced_pod(namespace,
                                            label_selector=f"{types.LABEL_VM_NAME}={name}")
            assert [p.metadata.name for p in pods.items] == [pod_name]

            custom.delete_namespaced_custom_object(types.GROUP, types.VERSION, namespace,
                                                   types.PLURAL, name)
            wait_for(lambda: _gone(lambda: custom.get_namespaced_custom_object(
                types.GROUP, types.VERSION, namespace, types.PLURAL, name)),
                timeout=90, what="the VM's finalizer dropped and the VM gone")
            assert not core.list_namespaced_pod(
                namespace, label_selector=f"{types.LABEL_VM_NAME}={name}").items
            assert proc.poll() is None, log.read_text()[-3000:]
        assert installed.fence_name


def _http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return 0


