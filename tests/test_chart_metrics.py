"""The chart's monitoring objects, rendered by the real helm binary (docs/metrics.md).

* the controller's port is named ``metrics`` (the probes and the Service use that name);
* the PodMonitor (runner pods), the PrometheusRule (alerts) and the dashboard ConfigMap
  are opt-in, carry the standard labels, and select what they should;
* the alert rules pass ``promtool check rules`` when promtool is on the PATH;
* every query of the shipped dashboard and of the alert rules names only families the
  controller serves (tests/test_metrics.py runs them against a live replica, through a
  real Prometheus).

Not here: no prometheus-operator is installed, so the PodMonitor and PrometheusRule reach
no API server.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from neonvm.controller.informer import RUNNER_PORT_NAME
from neonvm.controller.metrics import ControllerMetrics
from neonvm.leader.election import ElectionMetrics
from tests.support.chart import STANDARD_LABELS, Helm
from tests.support.metrics import dashboard_queries, selectors

pytestmark = pytest.mark.unit

OPT_INS = ("metrics.podMonitor.enabled=true", "metrics.prometheusRule.enabled=true",
           "metrics.dashboard.enabled=true")


def test_the_controller_port_is_named_metrics_and_everything_uses_that_name(
        helm: Helm) -> None:
    rendered = helm.template("nvm", "ops", sets=("rbac.liveScaling=true",))
    container = rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    # rights: self-fencing's port, served with live scaling
    # (tests/test_chart_self_fencing.py), not scraped.
    assert [p["name"] for p in container["ports"]] == ["metrics", "rights"]
    assert container["livenessProbe"]["httpGet"]["port"] == "metrics"
    assert container["readinessProbe"]["httpGet"]["port"] == "metrics"
    (service,) = [s for s in rendered.all("Service")
                  if not s["metadata"]["name"].endswith("-rights")]
    (port,) = service["spec"]["ports"]
    assert (port["name"], port["targetPort"]) == ("metrics", "metrics")


def test_the_monitoring_objects_are_opt_in_and_carry_the_standard_labels(
        helm: Helm) -> None:
    kinds = {o["kind"] for o in helm.template("nvm", "ops").objects}
    assert not kinds & {"PodMonitor", "PrometheusRule", "ConfigMap"}
    rendered = helm.template("nvm", "ops", sets=OPT_INS)
    for kind in ("PodMonitor", "PrometheusRule", "ConfigMap"):
        labels = rendered.one(kind)["metadata"]["labels"]
        assert [k for k in STANDARD_LABELS if k not in labels] == [], kind


def test_the_pod_monitor_scrapes_the_runner_port_of_runner_pods(helm: Helm) -> None:
    rendered = helm.template("nvm", "ops", sets=(
        "metrics.podMonitor.enabled=true", "metrics.podMonitor.labels.release=prom"))
    monitor = rendered.one("PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"] == {
        "matchExpressions": [{"key": "vm.neon.tech/name", "operator": "Exists"}]}
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("runner", "/metrics")
    assert endpoint["port"] == RUNNER_PORT_NAME  # as the runner pods name their port
    watched = helm.template("nvm", "ops", sets=("metrics.podMonitor.enabled=true",
                                                "controller.watchNamespace=vms"))
    assert watched.one("PodMonitor")["spec"]["namespaceSelector"] == {"matchNames": ["vms"]}
    listed = helm.template("nvm", "ops", sets=("metrics.podMonitor.enabled=true",
                                               "metrics.podMonitor.namespaces={a,b}"))
    assert listed.one("PodMonitor")["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}


def served_families() -> dict[str, set[str]]:
    """Every sample name a fresh controller registry serves, with its label names."""
    metrics = ControllerMetrics()
    metrics.describe("neonvm-controller", 4)
    ElectionMetrics.register(metrics.registry)  # the elector's, on the same registry
    text = generate_latest(metrics.registry).decode()
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    # Families whose series appear with their first sample (labels known only then).
    names.update({
        "rest_client_requests_total": {"code", "method", "host"},
        "rest_client_request_duration_seconds_bucket": {"verb", "host", "le"},
        "neonvm_controller_stuck_reconciles_total": {"step"},
        "neonvm_controller_gate_stripped_total": set(),
        "up": set()})
    return names


def test_the_alert_rules_select_series_the_controller_serves(helm: Helm) -> None:
    rule = helm.template("nvm", "ops", sets=("metrics.prometheusRule.enabled=true",)
                         ).one("PrometheusRule")
    served = served_families()
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert len(rules) >= 8
    for r in rules:
        assert 'namespace="ops", job="nvm-neonvm-controller-metrics"' in r["expr"], r["alert"]
        for name, labels in selectors(r["expr"]):
            assert name in served, (r["alert"], name)
            assert labels <= served[name], (r["alert"], name, labels)
        assert r["labels"]["severity"] in ("warning", "critical")
    custom = helm.template("nvm", "ops", sets=("metrics.prometheusRule.enabled=true",
                                               'metrics.prometheusRule.selector=job="x"'))
    assert all('{job="x"}' in r["expr"] or '{job="x"}[' in r["expr"]
               for g in custom.one("PrometheusRule")["spec"]["groups"] for r in g["rules"])


def test_the_alert_rules_pass_promtool(helm: Helm, tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no promtool on the PATH (apt-get install prometheus)")
    rule = helm.template("nvm", "ops", sets=("metrics.prometheusRule.enabled=true",)
                         ).one("PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 9 rules found" in proc.stdout


def test_the_dashboard_configmap_holds_the_shipped_dashboard_for_the_sidecar(
        helm: Helm) -> None:
    rendered = helm.template("nvm", "ops", sets=("metrics.dashboard.enabled=true",
                                                 "metrics.dashboard.namespace=grafana"))
    config = rendered.one("ConfigMap")
    assert config["metadata"]["namespace"] == "grafana"
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(config["data"]["neonvm-controller.json"])
    assert board == json.loads((Path(__file__).resolve().parents[1] / "charts" /
                                "neonvm-controller" / "files" / "dashboard.json").read_text())
    assert board["uid"] == "neonvm-controller"


def test_every_dashboard_query_names_families_the_controller_serves() -> None:
    served = served_families()
    queries = dashboard_queries()
    assert len(queries) >= 25
    for query in queries:
        for name, labels in selectors(query):
            assert name in served, (query, name)
            assert labels <= served[name], (query, name, labels)
