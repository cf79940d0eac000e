"""The controller's /metrics as its operators read it (docs/metrics.md).

* controller-runtime's families: a turn's outcome becomes a reconcile result, errors,
  terminal errors and panics are counted, the work queue counts adds, delayed adds,
  waits, work, depth per line and the keys in hand;
* NeonVM's lifecycle families: creation to runner pod, runner pod to Running, creation to
  Running, restarts, failing objects;
* ``rest_client_*`` for every request sent through an observed client (real API server);
* a live replica that converged a few VMs: each query of NeonVM's controller dashboards,
  and each query of the chart's own dashboard, returns data from its /metrics; with a
  ``prometheus`` binary on the PATH the queries are run by a real Prometheus scraping
  the replica (and the chart's alert rules load and evaluate there).
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from neonvm import kube
from neonvm.controller.metrics import CONTROLLER, ControllerMetrics, reconcile_result
from neonvm.controller.workqueue import WorkQueue
from neonvm.dev import binaries
from neonvm.dev.cluster import LocalCluster
from tests.support import health_port, replica_group, wait_for
from tests.support.chart import Helm
from tests.support.harness import converged, create_vm, get_vm, runner_pods
from tests.support.metrics import dashboard_queries, selectors

NEONVM_DASHBOARD_QUERIES = [
    # neonvm/grafana/controller-runtime-metrics.json (neondatabase/autoscaling), panels
    'sum(rate(controller_runtime_reconcile_total{job="$job", namespace="$namespace"}[5m])) '
    'by (instance, pod)',
    'sum(rate(controller_runtime_reconcile_errors_total{job="$job", '
    'namespace="$namespace"}[5m])) by (instance, pod)',
    *(f'histogram_quantile({q}, sum(rate(workqueue_queue_duration_seconds_bucket{{job="$job", '
      f'namespace="$namespace"}}[5m])) by (instance, name, le))' for q in ("0.50", "0.90", "0.99")),
    'sum(rate(workqueue_adds_total{job="$job", namespace="$namespace"}[5m])) by (instance, name)',
    *(f'histogram_quantile({q}, sum(rate(workqueue_work_duration_seconds_bucket{{job="$job", '
      f'namespace="$namespace"}}[5m])) by (instance, name, le))' for q in ("0.50", "0.90", "0.99")),
    'sum(rate(workqueue_retries_total{job="$job", namespace="$namespace"}[5m])) '
    'by (instance, name)',
    # neonvm/grafana/controller-resources-metrics.json, panels
    'rate(process_cpu_seconds_total{job="$job", namespace="$namespace", pod="$pod"}[5m]) * 100',
    'process_resident_memory_bytes{job="$job", namespace="$namespace", pod="$pod"}',
]
"""Every panel query of NeonVM's two controller dashboards, as written there."""

NEONVM_DASHBOARD_VARIABLES = [
    # Both dashboards' template variables (Grafana's label_values(selector, label)).
    ("controller_runtime_reconcile_total", "namespace"),
    ('controller_runtime_reconcile_total{namespace=~"$namespace"}', "job"),
    ('controller_runtime_reconcile_total{namespace=~"$namespace", job=~"$job"}', "pod"),
]

JOB = "neonvm-controller"
POD = "r0"
"""The target labels a Prometheus Operator scrape gives the replica (set by hand here)."""


# ---- pure logic -----------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    kind: str
    after: float = 0.0
    converged: bool = False


def samples(metrics: ControllerMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(metrics: ControllerMetrics, family: str, /, **labels: str) -> float:
    return samples(metrics).get((family, frozenset(labels.items())), -1.0)


@pytest.mark.unit
@pytest.mark.parametrize(("turn", "result"), [
    (Turn("requeue", after=300.0, converged=True), "success"),
    (Turn("gone"), "success"),
    (Turn("requeue", after=2.0), "requeue_after"),
    (Turn("behind"), "requeue_after"),
    (Turn("requeue"), "requeue"),
    (Turn("again"), "requeue"),
    (Turn("dropped"), "requeue"),
    (Turn("temporary"), "error"),
    (Turn("permanent"), "error"),
    (None, "error"),
])
def test_a_turns_outcome_is_the_reconcile_result_controller_runtime_would_count(
        turn: Turn | None, result: str) -> None:
    assert reconcile_result(turn) == result


@pytest.mark.unit
def test_turns_count_results_errors_terminal_errors_and_panics() -> None:
    m = ControllerMetrics()
    # Every result and error counter is served before the first reconcile (at 0), as
    # controller-runtime does: a dashboard's rate() has a series from the start.
    for result in ("success", "error", "requeue", "requeue_after"):
        assert value(m, "controller_runtime_reconcile_total", controller=CONTROLLER,
                     result=result) == 0
    assert value(m, "controller_runtime_reconcile_errors_total", controller=CONTROLLER) == 0
    m.turn_ended("ns/a", Turn("requeue", after=300.0, converged=True), 0.2)
    m.turn_ended("ns/a", Turn("temporary"), 0.1)
    m.turn_ended("ns/b", Turn("permanent"), 0.1)
    m.turn_ended("ns/c", None, 0.1)
    assert value(m, "controller_runtime_reconcile_total", controller=CONTROLLER,
                 result="success") == 1
    assert value(m, "controller_runtime_reconcile_total", controller=CONTROLLER,
                 result="error") == 3
    assert value(m, "controller_runtime_reconcile_errors_total", controller=CONTROLLER) == 3
    assert value(m, "controller_runtime_terminal_reconcile_errors_total",
                 controller=CONTROLLER) == 1
    assert value(m, "controller_runtime_reconcile_panics_total", controller=CONTROLLER) == 1
    assert value(m, "controller_runtime_reconcile_time_seconds_count",
                 controller=CONTROLLER) == 4
    assert value(m, "neonvm_controller_turn_duration_seconds_count", outcome="raised") == 1
    assert value(m, "reconcile_duration_seconds_count", outcome="failure") == 3
    assert value(m, "reconcile_duration_seconds_count", outcome="success") == 1


@pytest.mark.unit
def test_a_vm_counts_as_failing_once_its_turns_only_failed_for_the_pending_period() -> None:
    now = [0.0]
    m = ControllerMetrics(clock=lambda: now[0])
    WorkQueue(metrics=m.workqueue)  # a term started

    def failing(retried: str) -> float:
        return value(m, "reconcile_failing_objects", controller=CONTROLLER,
                     outcome="failure", actively_retried=retried)

    m.turn_ended("ns/a", Turn("temporary"), 0.1)
    m.turn_ended("ns/b", Turn("temporary"), 0.1)
    now[0] = 59.0
    assert (failing("true"), failing("false")) == (0, 0)  # not for a minute yet
    m.turn_ended("ns/a", Turn("temporary"), 0.1)
    now[0] = 61.0
    assert (failing("true"), failing("false")) == (1, 1)  # b not retried within the period
    m.turn_ended("ns/a", Turn("requeue", after=300.0, converged=True), 0.1)
    assert (failing("true"), failing("false")) == (0, 1)  # a success clears a
    WorkQueue(metrics=m.workqueue)  # the next term starts from nothing
    assert (failing("true"), failing("false")) == (0, 0)


@pytest.mark.unit
def test_the_work_queue_counts_adds_delays_waits_work_and_its_lines() -> None:
    now = [100.0]
    m = ControllerMetrics(clock=lambda: now[0])
    q = WorkQueue(clock=lambda: now[0], metrics=m.workqueue)
    labels = {"name": CONTROLLER, "controller": CONTROLLER}
    q.add("ns/a")
    q.add("ns/a")  # deduplicated: not an add
    q.add("ns/b", periodic=True)
    q.add_after("ns/c", 5.0)
    q.add_rate_limited("ns/d")
    assert value(m, "workqueue_adds_total", **labels) == 2
    assert value(m, "workqueue_retries_total", **labels) == 2
    assert value(m, "workqueue_depth", priority="0", **labels) == 1
    assert value(m, "workqueue_depth", priority="-100", **labels) == 1
    now[0] += 2.0
    assert q.get() == "ns/a"  # waited 2 s
    now[0] += 3.0
    assert value(m, "controller_runtime_active_workers", controller=CONTROLLER) == 1
    assert value(m, "workqueue_longest_running_processor_seconds", **labels) == 3.0
    assert value(m, "workqueue_unfinished_work_seconds", **labels) == 3.0
    q.done("ns/a")
    assert value(m, "controller_runtime_active_workers", controller=CONTROLLER) == 0
    found = samples(m)
    assert found[("workqueue_queue_duration_seconds_count", frozenset(labels.items()))] == 1
    assert found[("workqueue_queue_duration_seconds_sum", frozenset(labels.items()))] == 2.0
    assert found[("workqueue_work_duration_seconds_sum", frozenset(labels.items()))] == 3.0
    q.shut_down()  # the term ended: nothing waits any more
    assert value(m, "workqueue_depth", priority="-100", **labels) == 0


def vm_object(created: str, *, phase: str | None = None, restarts: int = 0,
              pod_uid: str = "") -> dict[str, Any]:
    return {"metadata": {"name": "a", "namespace": "ns", "creationTimestamp": created},
            "status": {"phase": phase, "restartCount": restarts, "podUID": pod_uid}}


@pytest.mark.unit
def test_the_lifecycle_histograms_time_a_first_run_and_restarts_are_counted() -> None:
    wall = [dt.datetime(2026, 1, 1, 0, 0, 30, tzinfo=dt.UTC)]
    m = ControllerMetrics()
    m.lifecycle._wall = lambda: wall[0]
    vm = vm_object("2026-01-01T00:00:00Z")
    m.lifecycle.runner_created(vm, {"metadata": {"uid": "p1",
                                                 "creationTimestamp": "2026-01-01T00:00:02Z"}})
    m.lifecycle.vm_changed(vm, vm_object("2026-01-01T00:00:00Z", phase="Pending",
                                         pod_uid="p1"))
    running = vm_object("2026-01-01T00:00:00Z", phase="Running", pod_uid="p1")
    m.lifecycle.vm_changed(vm_object("2026-01-01T00:00:00Z", phase="Pending", pod_uid="p1"),
                           running)
    m.lifecycle.vm_changed(running, running)  # still Running: no second sample
    m.lifecycle.vm_changed(None, running)  # a term's first list: no transition
    assert value(m, "vm_creation_to_runner_creation_duration_seconds_sum") == 2.0
    assert value(m, "vm_runner_creation_to_vm_running_duration_seconds_sum") == 28.0
    assert value(m, "vm_creation_to_vm_running_duration_seconds_sum") == 30.0
    assert value(m, "vm_creation_to_vm_running_duration_seconds_count") == 1
    # A restart: counted; its new pod and its Running again are not first runs.
    restarted = vm_object("2026-01-01T00:00:00Z", phase="Pending", restarts=1, pod_uid="p2")
    m.lifecycle.vm_changed(running, restarted)
    m.lifecycle.runner_created(restarted, {"metadata": {
        "uid": "p2", "creationTimestamp": "2026-01-01T00:01:00Z"}})
    wall[0] += dt.timedelta(seconds=60)
    m.lifecycle.vm_changed(restarted, vm_object("2026-01-01T00:00:00Z", phase="Running",
                                                restarts=1, pod_uid="p2"))
    assert value(m, "vm_restarts_count") == 1
    assert value(m, "vm_creation_to_runner_creation_duration_seconds_count") == 1
    assert value(m, "vm_runner_creation_to_vm_running_duration_seconds_count") == 2
    assert value(m, "vm_creation_to_vm_running_duration_seconds_count") == 1


@pytest.mark.unit
def test_leader_status_and_workers_are_served_once_the_replica_is_described() -> None:
    m = ControllerMetrics()
    assert ("leader_election_master_status", frozenset({("name", "x")})) not in samples(m)
    m.describe("neonvm-controller", 8)
    assert value(m, "leader_election_master_status", name="neonvm-controller") == 0
    assert value(m, "controller_runtime_max_concurrent_reconciles", controller=CONTROLLER) == 8
    m.leading.set(1)
    assert value(m, "leader_election_master_status", name="neonvm-controller") == 1


@pytest.mark.unit
def test_the_process_platform_and_gc_collectors_are_served() -> None:
    names = {name for name, _ in samples(ControllerMetrics())}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
            "python_info", "python_gc_collections_total"} <= names


# ---- a real API server ------------------------------------------------------------------


@pytest.mark.cluster
def test_every_request_through_an_observed_client_is_counted_by_code_method_and_host(
        cluster: LocalCluster) -> None:
    api = kube.api_client(cluster.kubeconfig)
    try:
        m = ControllerMetrics()
        m.observe_requests(api)
        host = urllib.parse.urlsplit(api.configuration.host).netloc
        kube.request(api, "GET", "/api/v1/namespaces/default")
        assert kube.get_or_none(api, f"/api/v1/namespaces/n-{uuid.uuid4().hex[:8]}") is None
        assert value(m, "rest_client_requests_total", code="200", method="GET", host=host) == 1
        assert value(m, "rest_client_requests_total", code="404", method="GET", host=host) == 1
        assert value(m, "rest_client_request_duration_seconds_count", verb="GET",
                     host=host) == 2
    finally:
        api.close()


# ---- a live replica ---------------------------------------------------------------------


@dataclass
class Scraped:
    """One replica's /metrics after a few VMs converged (and one restarted)."""

    namespace: str
    port: int
    text: str
    prometheus: Prometheus | None


@pytest.fixture(scope="module")
def scraped(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Scraped]:
    api = kube.api_client(cluster.kubeconfig)
    core = client.CoreV1Api(api)
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    log_dir = tmp_path_factory.mktemp("metrics")
    names = [f"vm{i}" for i in range(4)]
    try:
        with replica_group(cluster, api, namespace, log_dir / "replicas", workers=4) as group:
            leader = group.start(POD)
            wait_for(lambda: group.leader() is leader, 60, what="r0 to lead")
            port = wait_for(lambda: health_port(leader), 30, what="the health port")
            prometheus = Prometheus.start(log_dir, port, namespace)
            try:
                for name in names:
                    create_vm(api, namespace, name, restart_policy="Always")
                wait_for(lambda: converged(api, namespace, names) and all(
                    (get_vm(api, namespace, n) or {}).get("status", {}).get("phase")
                    == "Running" for n in names), 180, what="the VMs to run")
                # One restart: the runner pod goes, the VM gets a new one.
                old = runner_pods(api, namespace, "vm0")[0].metadata.name
                core.delete_namespaced_pod(old, namespace, grace_period_seconds=0)
                wait_for(lambda: (get_vm(api, namespace, "vm0") or {}).get("status", {})
                         .get("restartCount", 0) >= 1, 120, what="vm0 to restart")
                wait_for(lambda: "vm_restarts_count 1.0" in scrape(port), 30,
                         what="the restart to be counted")
                if prometheus is not None:
                    prometheus.wait_for_scrapes(3)
                yield Scraped(namespace, port, scrape(port), prometheus)
            finally:
                if prometheus is not None:
                    prometheus.stop()
    finally:
        for vm in client.CustomObjectsApi(api).list_namespaced_custom_object(
                "vm.neon.tech", "v1", namespace, "virtualmachines").get("items", []):
            client.CustomObjectsApi(api).patch_namespaced_custom_object(
                "vm.neon.tech", "v1", namespace, "virtualmachines", vm["metadata"]["name"],
                {"metadata": {"finalizers": None}})
        core.delete_namespace(namespace)
        api.close()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("query", NEONVM_DASHBOARD_QUERIES + [
    selector for selector, _ in NEONVM_DASHBOARD_VARIABLES])
def test_each_neonvm_dashboard_query_selects_series_the_replica_serves(
        scraped: Scraped, query: str) -> None:
    families = {s.name: s for f in text_string_to_metric_families(scraped.text)
                for s in f.samples}
    for name, labels in selectors(query):
        assert name in families, f"{name} is not served"
        assert labels <= set(families[name].labels), (name, labels)


@pytest.mark.cluster
@pytest.mark.slow
def test_the_lifecycle_and_standard_families_have_data_after_vms_converged(
        scraped: Scraped) -> None:
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(scraped.text) for s in f.samples}
    ctl = (("controller", CONTROLLER),)
    queue = (("controller", CONTROLLER), ("name", CONTROLLER))
    assert values[("controller_runtime_reconcile_total", (*ctl, ("result", "success")))] >= 4
    assert values[("controller_runtime_reconcile_time_seconds_count", ctl)] >= 4
    assert values[("workqueue_adds_total", queue)] >= 4
    assert values[("workqueue_queue_duration_seconds_count", queue)] >= 4
    assert values[("workqueue_work_duration_seconds_count", queue)] >= 4
    assert values[("workqueue_retries_total", queue)] >= 1
    assert values[("controller_runtime_max_concurrent_reconciles", ctl)] == 4
    assert values[("leader_election_master_status", (("name", "neonvm-controller"),))] == 1
    assert values[("vm_creation_to_runner_creation_duration_seconds_count", ())] == 4
    assert values[("vm_creation_to_vm_running_duration_seconds_count", ())] == 4
    assert values[("vm_runner_creation_to_vm_running_duration_seconds_count", ())] >= 4
    assert values[("vm_restarts_count", ())] == 1
    writes = [v for (name, labels), v in values.items()
              if name == "rest_client_requests_total" and ("method", "PUT") in labels]
    assert sum(writes) >= 4  # each VM's status written at least once
    assert values[("process_resident_memory_bytes", ())] > 0


# ---- a real Prometheus ------------------------------------------------------------------


@dataclass
class Prometheus:
    """A ``prometheus`` server scraping one replica every second, with the chart's alert
    rules loaded; its target labels are those a Prometheus Operator scrape would give."""

    proc: subprocess.Popen[bytes]
    port: int

    @classmethod
    def start(cls, workdir: Path, target: int, namespace: str) -> Prometheus | None:
        binary = shutil.which("prometheus")
        if binary is None:
            return None
        rules = workdir / "rules.yaml"
        rules.write_text(yaml.safe_dump(rendered_rules(workdir)))
        config = workdir / "prometheus.yaml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": JOB, "static_configs": [{
                "targets": [f"127.0.0.1:{target}"],
                "labels": {"namespace": namespace, "pod": POD}}]}]}))
        port = free_port()
        proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=(workdir / "prometheus.log").open("wb"))
        server = cls(proc, port)
        wait_for(server.ready, 60, what="prometheus to start")
        return server

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2):
                return True
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[Any]:
        return list(self.api("query", query=expr)["result"])

    def wait_for_scrapes(self, n: int) -> None:
        def scrapes() -> float:
            found = self.query(f"count_over_time(up{{job='{JOB}'}}[5m])")
            return float(found[0]["value"][1]) if found else 0.0

        wait_for(lambda: scrapes() >= n, 60, what="a few scrapes")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rendered_rules(workdir: Path) -> dict[str, Any]:
    """The chart's PrometheusRule spec (helm template with prometheusRule on)."""
    helm = Helm(binaries.require("helm"), workdir / "helm-home")
    rule = helm.template("nvm", "ops", sets=(
        "metrics.prometheusRule.enabled=true",
        f'metrics.prometheusRule.selector=job="{JOB}"')).one("PrometheusRule")
    return dict(rule["spec"])


def substitute(query: str, namespace: str) -> str:
    return (query.replace("$job", JOB).replace("$namespace", namespace)
            .replace("$pod", POD).replace("$__rate_interval", "1m"))


def need_prometheus(scraped: Scraped) -> Prometheus:
    if scraped.prometheus is None:
        pytest.skip("no prometheus binary on the PATH (apt-get install prometheus)")
    return scraped.prometheus


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("query", NEONVM_DASHBOARD_QUERIES)
def test_each_neonvm_dashboard_query_returns_data_from_a_real_prometheus(
        scraped: Scraped, query: str) -> None:
    prometheus = need_prometheus(scraped)
    result = prometheus.query(substitute(query, scraped.namespace))
    print(f"{query}\n  -> {[(r['metric'], r['value'][1]) for r in result]}")
    assert result, f"no data for {query}"


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize(("selector", "label"), NEONVM_DASHBOARD_VARIABLES)
def test_each_neonvm_dashboard_variable_has_values_in_a_real_prometheus(
        scraped: Scraped, selector: str, label: str) -> None:
    prometheus = need_prometheus(scraped)
    values = prometheus.api(f"label/{label}/values",
                            **{"match[]": substitute(selector, scraped.namespace)})
    assert values == [{"job": JOB, "namespace": scraped.namespace, "pod": POD}[label]]


@pytest.mark.cluster
@pytest.mark.slow
def test_each_query_of_the_charts_dashboard_returns_data_from_a_real_prometheus(
        scraped: Scraped) -> None:
    prometheus = need_prometheus(scraped)
    empty = [q for q in dashboard_queries()
             if not prometheus.query(substitute(q, scraped.namespace))]
    assert empty == []


@pytest.mark.cluster
@pytest.mark.slow
def test_the_charts_alert_rules_load_and_evaluate_without_firing_on_a_healthy_replica(
        scraped: Scraped) -> None:
    prometheus = need_prometheus(scraped)
    groups = wait_for(lambda: [g for g in prometheus.api("rules")["groups"]
                               if all(r.get("lastEvaluation", "").startswith("2")
                                      and not r["lastEvaluation"].startswith("0001")
                                      for r in g["rules"])], 30, what="the rules to run")
    rules = [r for g in groups for r in g["rules"]]
    assert rules and all(r["health"] == "ok" for r in rules), rules
    assert [r["name"] for r in rules if r["state"] == "firing"] == []
