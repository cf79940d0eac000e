"""The soak: a large fleet under continuous churn for a long while, ``python -m benchmarks.soak``.

    python -m benchmarks.soak --minutes 60 --vms 2000 --write-docs
    python -m benchmarks.soak --minutes 5 --vms 200          # a trial

Opt-in (not part of ``python -m benchmarks``). It starts a private local control plane
with simulated (kwok) nodes in ``--work`` (free ports; never the default dev state
directory), with API Priority and Fairness on and the chart's FlowSchema for the
replicas' Lease requests (``--no-apf``: off, as the tests' clusters run), three
controller replicas as the drills run them (``neonvm.drills.target``: the demo's lease
timings), creates ``--vms`` VMs (the first ``--scale-vms`` of them scalable) and waits
until they converged (a cached LIST every ``--converge-poll`` s, the quorum judgement
once that says every VM has its pod). Then, for ``--minutes``, it keeps the fleet under
**churn**: every ``--churn-interval`` seconds the runner pods of ``--churn-pods`` random
VMs are deleted, ``--churn-scale`` scalable VMs change size (1 <-> 2 vCPUs and memory
slots; kwok's pods have no runner to resize live, so each one's pod is deleted a round
later and the replacement is built at the new size), one short-lived VM is created and
the oldest of the last ``--churn-live`` such VMs deleted. Meanwhile it records, every
``--sample-seconds``: the Lease holder and epoch, the leader's RSS (and every replica's),
the leader's anonymous and file-backed RSS and threads (``/proc``) and the sizes of its
memories that churn could grow (``neonvm_controller_remembered_entries``, docs/metrics.md),
the API server's request count (``apiserver_request_total``, every client) and the
replicas' own (``rest_client_requests_total``), the load average; and once a minute which
VMs of the fleet have not converged (a VM not converged at every look for
``--stuck-minutes`` is *stuck*).

The independent checker (:class:`neonvm.drills.observer.Watchdog`: every pod revision
watched, the pods polled) runs for the whole soak; at the end the churn stops, every VM
must converge and :func:`neonvm.drills.check.check` judges the namespace with its locks.
The verdict fails on a duplicate, a live runner pod deleted by anyone but the soak (lost
work), a VM stuck or not converged at the end, a scaled VM whose status size is not its
spec's at the end, or a finding of the final check. Leader
changes are listed with the replicas' own log lines about them (the soak never stops a
replica, so none is intended by it).

``--svg`` draws the leader's RSS and the API calls per minute over time, with the leader
changes marked; ``--write-docs`` puts the summary (first and last 10 minutes compared)
between the ``soak`` markers of docs/benchmarks.md. See docs/benchmarks.md, "Soak".
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- soak: begin -->", "<!-- soak: end -->"
NAMESPACE = "neonvm-soak"


def say(msg: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Sample:
    """One look, ``t`` seconds after the soak's clock started (fleet converged)."""

    t: float
    leader: str | None
    epoch: int | None
    leader_rss_mib: float | None
    rss_mib: dict[str, float]
    apiserver_requests: float | None
    controller_requests: float
    load1: float
    not_converged: int | None = None
    stuck: int | None = None
    leader_memory: dict[str, float] = field(default_factory=dict)
    """The leader's ``/proc`` memory (``rss_anon_mib``, ``rss_file_mib``, ``threads``) and
    its ``neonvm_controller_remembered_entries`` by structure: what grows, if RSS does."""


@dataclass
class Record:
    """Everything the soak saw (written as JSON next to its cluster)."""

    vms: int
    minutes: float
    samples: list[Sample] = field(default_factory=list)
    leader_changes: list[dict[str, Any]] = field(default_factory=list)
    churn: dict[str, Any] = field(default_factory=dict)
    watch: dict[str, Any] = field(default_factory=dict)
    check: dict[str, Any] = field(default_factory=dict)
    duplicates: int = 0
    duplicates_loose: int = 0
    lost: list[str] = field(default_factory=list)
    stuck_max: int = 0
    stuck_vms: list[str] = field(default_factory=list)
    not_converged_end: list[str] = field(default_factory=list)
    final_convergence_s: float | None = None
    namespace_gone_s: float | None = None
    """``--delete-namespace``: from the namespace's delete to its 404."""
    namespace_vms: int = 0
    refused_creates: int | None = None
    """Pod creates the API server refused in the terminating namespace (the replicas' log
    lines saying so, one per refusal)."""
    namespace_restarts: int | None = None
    """Restarts the replicas made while the namespace was being deleted (``Restart:`` log
    lines): each a status write before the plan and create that would follow it."""
    setup_s: float | None = None
    scaled_vms: int = 0
    """Fleet VMs made scalable (bounds 1 to 2 vCPUs and memory slots): the scale churn's."""
    scale_not_done: list[str] = field(default_factory=list)
    """Scaled VMs whose status size is not their spec's at the end."""
    apf: dict[str, Any] = field(default_factory=dict)
    """API Priority and Fairness: the Lease level, whether the replicas' Lease requests
    landed there, requests dispatched there and rejected anywhere (at the churn's end)."""
    failures: list[str] = field(default_factory=list)
    started: str = ""


# ---- measures -----------------------------------------------------------------------------


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def proc_memory(pid: int) -> dict[str, float]:
    """A process's anonymous and file-backed RSS (MiB) and threads, from /proc."""
    fields = {"RssAnon:": "rss_anon_mib", "RssFile:": "rss_file_mib", "Threads:": "threads"}
    out: dict[str, float] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            parts = line.split()  # "RssAnon:\t  1234 kB"
            if len(parts) >= 2 and parts[0] in fields:
                value = float(parts[1])
                out[fields[parts[0]]] = (value if parts[0] == "Threads:"
                                         else round(value / 1024, 1))
    except (OSError, ValueError):
        return {}
    return out


def gauge_by_label(text: str, name: str, label: str) -> dict[str, float]:
    """The series of gauge ``name`` in a Prometheus text page, by the value of ``label``."""
    out: dict[str, float] = {}
    for m in re.finditer(rf'^{re.escape(name)}\{{[^}}]*{re.escape(label)}="([^"]*)"[^}}]*\}} '
                         r"(\S+)$", text, re.MULTILINE):
        with contextlib.suppress(ValueError):
            out[m.group(1)] = float(m.group(2))
    return out


REMEMBERED = "neonvm_controller_remembered_entries"


def metric_sum(text: str, name: str, having: str = "") -> float:
    """The sum of every series of counter ``name`` in a Prometheus text page (only the
    series whose line contains ``having``)."""
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and having in line:
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(" ", 1)[1])
    return total


def apiserver_metrics(api: client.ApiClient) -> str | None:
    try:
        resp = api.rest_client.request("GET", api.configuration.host + "/metrics",
                                       _request_timeout=20)
        resp.read()
        return resp.data.decode() if isinstance(resp.data, bytes) else str(resp.data)
    except Exception:  # a slow scrape is a missing sample, not a failure
        return None


def apiserver_requests(api: client.ApiClient) -> float | None:
    text = apiserver_metrics(api)
    return None if text is None else metric_sum(text, "apiserver_request_total")


# ---- API Priority and Fairness ----------------------------------------------------------------

APF = "/apis/flowcontrol.apiserver.k8s.io/v1"


def chart_apf_objects() -> list[dict[str, Any]]:
    """The chart's PriorityLevelConfigurations and FlowSchemas (the Lease requests'; the
    TokenReviews' and issuer key fetches'), rendered by helm (``charts/neonvm-controller``,
    release ``soak`` in the Lease's namespace, default values), each schema's subject made
    the local replicas' identity: the user of their client certificate
    (:data:`~neonvm.dev.common.CONTROLLER_USER`), where the chart names its ServiceAccount.
    Nothing else is changed (docs/leader-election.md). The levels come first: a schema
    naming a missing level classifies into catch-all."""
    from neonvm import manifests
    from neonvm.dev import binaries
    from neonvm.dev.common import CONTROLLER_USER
    from neonvm.dev.replica import LEASE_NAMESPACE

    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "HELM_CACHE_HOME": home, "HELM_CONFIG_HOME": home,
               "HELM_DATA_HOME": home}
        out = subprocess.run(
            [str(binaries.require("helm")), "template", "soak", str(manifests.CHART_DIR),
             "--namespace", LEASE_NAMESPACE,
             "--show-only", "templates/priority-and-fairness.yaml"],
            env=env, capture_output=True, text=True, check=True, timeout=120).stdout
    objects = [d for d in yaml.safe_load_all(out) if d]
    for obj in objects:
        if obj["kind"] == "FlowSchema":
            for rule in obj["spec"]["rules"]:
                assert all(r.get("clusterScope") or r["namespaces"] == [LEASE_NAMESPACE]
                           for r in rule.get("resourceRules", []))  # leases; tokenreviews
                rule["subjects"] = [{"kind": "User", "user": {"name": CONTROLLER_USER}}]
    return sorted(objects, key=lambda o: o["kind"] != "PriorityLevelConfiguration")


def request_level(api: client.ApiClient, method: str, path: str,
                  body: dict[str, Any] | None = None) -> str | None:
    """The uid of the priority level the API server classified one request of ``api``'s
    user into (its answer's ``X-Kubernetes-PF-PriorityLevel-UID``; a refusal or a 404 is
    classified like any answer); None when it names none (APF off, or an exempt user)."""
    try:
        resp = api.rest_client.request(method, api.configuration.host + path, body=body,
                                       _request_timeout=10)
        headers = resp.getheaders()
    except ApiException as exc:
        headers = exc.headers or {}
    uid = headers.get("X-Kubernetes-PF-PriorityLevel-UID")
    return None if uid is None else str(uid)


# The requests install_apf sends as the replicas' user, by the level that should take them:
# a read of a Lease nobody holds, a TokenReview of a token that is none, the issuer's keys.
PROBES: dict[str, list[tuple[str, str, dict[str, Any] | None]]] = {
    "leader-election": [("GET", "/apis/coordination.k8s.io/v1/namespaces/{lease_ns}/leases/"
                                "apf-probe", None)],
    "token-reviews": [("POST", "/apis/authentication.k8s.io/v1/tokenreviews",
                       {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                        "spec": {"token": "apf-probe"}}),
                      ("GET", "/openid/v1/jwks", None)],
}


def install_apf(api: client.ApiClient, controller_api: client.ApiClient) -> dict[str, Any]:
    """Create :func:`chart_apf_objects` and show, from the API server's answers to requests
    as the replicas' user (:data:`PROBES`), that their Lease requests land in the chart's
    Lease level and their TokenReviews and issuer key fetches in its reviews level (each
    answer's ``X-Kubernetes-PF-PriorityLevel-UID``). Returns what the record keeps."""
    from neonvm import kube
    from neonvm.dev.replica import LEASE_NAMESPACE

    levels: dict[str, dict[str, Any]] = {}
    schemas: list[str] = []
    for obj in chart_apf_objects():
        level = obj["kind"] == "PriorityLevelConfiguration"
        made = kube.request(api, "POST", f"{APF}/"
                            f"{'prioritylevelconfigurations' if level else 'flowschemas'}",
                            body=obj)
        if level:
            levels[made["metadata"]["name"]] = made["metadata"]
        else:
            schemas.append(made["metadata"]["name"])
    found: dict[str, bool] = {}
    for _ in range(30):  # the API server's APF controller takes the new objects in a moment
        for suffix, probes in PROBES.items():
            (name,) = [n for n in levels if n.endswith(f"-{suffix}")]
            found[suffix] = all(
                request_level(controller_api, method, path.format(lease_ns=LEASE_NAMESPACE),
                              body) == levels[name]["uid"]
                for method, path, body in probes)
        if all(found.values()):
            break
        time.sleep(1.0)
    lease_level = next(n for n in levels if n.endswith("-leader-election"))
    reviews_level = next(n for n in levels if n.endswith("-token-reviews"))
    return {"level": lease_level, "lease_requests_in_level": found["leader-election"],
            "reviews_level": reviews_level, "reviews_in_level": found["token-reviews"],
            "flowschema": next(n for n in schemas if n.endswith("-leader-election")),
            "flowschemas": schemas}


def apf_counts(text: str | None, level: str, reviews_level: str = "") -> dict[str, float]:
    """Requests the API server dispatched in ``level`` (and ``reviews_level``) and
    rejected (any level), from its metrics page."""
    if text is None:
        return {}
    counts = {"lease_level_dispatched": metric_sum(
                  text, "apiserver_flowcontrol_dispatched_requests_total",
                  f'priority_level="{level}"'),
              "rejected_any_level": metric_sum(
                  text, "apiserver_flowcontrol_rejected_requests_total")}
    if reviews_level:
        counts["reviews_level_dispatched"] = metric_sum(
            text, "apiserver_flowcontrol_dispatched_requests_total",
            f'priority_level="{reviews_level}"')
    return counts


# ---- waiting for the fleet --------------------------------------------------------------------


def cached_ready(api: client.ApiClient, names: list[str]) -> int:
    """How many of ``names`` have a committed pod and no pod plan, from one LIST of the
    VMs served from the API server's watch cache (``resourceVersion=0``, raw JSON): a
    cheap hint, never the judgement (:func:`wait_fleet`)."""
    from neonvm import kube
    from neonvm.api import types

    wanted = set(names)
    doc = kube.request(api, "GET", f"/apis/{types.GROUP}/{types.VERSION}/namespaces/"
                                   f"{NAMESPACE}/{types.PLURAL}",
                       query=[("resourceVersion", "0")], timeout=60)
    return sum(1 for vm in doc.get("items") or []
               if vm["metadata"]["name"] in wanted
               and (vm.get("status") or {}).get("podName")
               and not (vm.get("status") or {}).get("pendingPod"))


def wait_fleet(api: client.ApiClient, names: list[str], timeout: float,
               poll: float) -> tuple[bool, float, Any]:
    """:func:`neonvm.drills.fleet.wait_converged`, lighter on the API server at
    thousands of VMs: every ``poll`` s (not 0.5 s) one cached LIST of the VMs
    (:func:`cached_ready`), and the quorum judgement (:func:`fleet.convergence`, pods
    then VMs) only once that hint says every VM has its pod, and at the end."""
    from neonvm.drills import fleet

    started = time.monotonic()
    last_said = -1e9
    while True:
        elapsed = time.monotonic() - started
        ready = None
        with contextlib.suppress(Exception):
            ready = cached_ready(api, names)
        if ready == len(names) or elapsed > timeout:
            st = fleet.convergence(api, NAMESPACE, names)
            if st.done or elapsed > timeout:
                return st.done, elapsed, st
        if elapsed - last_said >= 30.0:
            last_said = elapsed
            say(f"converging: {ready}/{len(names)} with a committed pod ({elapsed:.0f}s)")
        time.sleep(poll)


def metrics_port(log: Path) -> int | None:
    try:
        ports = re.findall(r"/metrics on [0-9.]+:(\d+)", log.read_text(errors="replace"))
    except OSError:
        return None
    return int(ports[-1]) if ports else None


def replica_metrics(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text: str = resp.read().decode()
            return text
    except OSError:
        return None


class Counters:
    """Per-source monotonically growing counters -> the total growth (a restart resets)."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.total = 0.0

    def add(self, source: str, value: float | None) -> None:
        if value is None:
            return
        before = self.last.get(source)
        if before is not None:
            self.total += value - before if value >= before else value
        self.last[source] = value


# ---- churn --------------------------------------------------------------------------------


SCALABLE = {"cpus": {"min": 1, "max": 2, "use": 1},
            "memorySlots": {"min": 1, "max": 2, "use": 1}}
"""The guest of the scale churn's VMs: room for one more vCPU and memory slot (so their
pods get a scaling token, as an autoscaled VM's do)."""


@contextlib.contextmanager
def churn(api: client.ApiClient, names: list[str], dog: Any, interval: float, pods: int,
          live: int, rng: random.Random, scalable: list[str] | None = None,
          scale: int = 0) -> Iterator[dict[str, Any]]:
    """Pod deletions, scale changes and VM creates/deletes every ``interval`` s (module
    docstring). A scale change flips ``scalable`` VM's size between 1 and 2 (vCPUs and
    memory slots); its runner pod is deleted one round later, so that the controller
    builds the replacement at the new size: kwok's pods have no runner to resize live
    (docs/benchmarks.md, "Soak")."""
    from neonvm import kube
    from neonvm.api import types
    from neonvm.drills import fleet

    counts: dict[str, Any] = {"pod deletions": 0, "scale changes": 0, "scale restarts": 0,
                              "VMs created": 0, "VMs deleted": 0, "errors": 0, "live": [],
                              "scaled": []}
    custom = client.CustomObjectsApi(api)
    core = client.CoreV1Api(api)
    stop = threading.Event()
    alive: list[dict[str, Any]] = []
    size: dict[str, int] = {}
    restart: list[str] = []
    path = f"/apis/{types.GROUP}/{types.VERSION}/namespaces/{NAMESPACE}/{types.PLURAL}"

    def delete_pod(name: str) -> bool:
        vm = custom.get_namespaced_custom_object(types.GROUP, types.VERSION, NAMESPACE,
                                                 types.PLURAL, name, _request_timeout=30)
        pod = (vm.get("status") or {}).get("podName")
        if not pod:
            return False
        dog.watcher.expect_pod_deletion(pod)
        try:
            core.delete_namespaced_pod(pod, NAMESPACE, _request_timeout=30)
        except ApiException:
            return False
        return True

    def restart_scaled() -> None:
        while restart:
            if delete_pod(restart.pop(0)):
                counts["scale restarts"] += 1

    def tick(n: int) -> None:
        restart_scaled()
        for name in rng.sample(names, min(pods, len(names))):
            if delete_pod(name):
                counts["pod deletions"] += 1
        for name in rng.sample(scalable or [], min(scale, len(scalable or []))):
            size[name] = 3 - size.get(name, 1)
            kube.request(api, "PATCH", f"{path}/{name}",
                         body={"spec": {"guest": {"cpus": {"use": size[name]},
                                                  "memorySlots": {"use": size[name]}}}},
                         content_type="application/merge-patch+json")
            counts["scale changes"] += 1
            restart.append(name)
        alive.append(custom.create_namespaced_custom_object(
            types.GROUP, types.VERSION, NAMESPACE, types.PLURAL,
            fleet.vm_body(f"churn-{n:05d}", 1), _request_timeout=30))
        counts["VMs created"] += 1
        while len(alive) > live:
            old = alive.pop(0)
            dog.watcher.expect_vm_deletion(old["metadata"]["uid"])
            with contextlib.suppress(ApiException):
                custom.delete_namespaced_custom_object(
                    types.GROUP, types.VERSION, NAMESPACE, types.PLURAL,
                    old["metadata"]["name"], _request_timeout=30)
                counts["VMs deleted"] += 1

    def run() -> None:
        n = 0
        while not stop.wait(interval):
            try:
                tick(n)
            except Exception as exc:
                counts["errors"] += 1
                say(f"churn error: {exc!s:.200}")
            n += 1

    thread = threading.Thread(target=run, name="churn", daemon=True)
    thread.start()
    try:
        yield counts
    finally:
        stop.set()
        thread.join(timeout=120)
        with contextlib.suppress(Exception):  # the last round's scale changes restart too
            restart_scaled()
        counts["live"] = [v["metadata"]["name"] for v in alive]
        counts["scaled"] = sorted(size)


def scale_not_done(api: client.ApiClient, scaled: list[str]) -> list[str]:
    """Scaled VMs whose status size (what the committed pod has) is not the spec's."""
    from neonvm.api.types import VirtualMachine
    from neonvm.controller.decide import desired_size, status_size
    from neonvm.drills import fleet

    wanted = set(scaled)
    out = []
    for obj in fleet.list_vms(api, NAMESPACE):
        if obj["metadata"]["name"] in wanted:
            vm = VirtualMachine.from_object(obj)
            if status_size(vm) != desired_size(vm):
                out.append(f"{vm.name}: status {status_size(vm)}, spec {desired_size(vm)}")
    return sorted(out)


# ---- the run ------------------------------------------------------------------------------


def leader_lines(state_dir: Path, replicas: int) -> list[str]:
    """The replicas' log lines about leading (started/stopped, step-down, lost)."""
    keys = ("started leading", "stopped leading", "step-down", "lost the Lease",
            "renew", "acquired the Lease", "released the Lease")
    out = []
    for i in range(replicas):
        path = state_dir / "logs" / f"controller-{i}.log"
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                if any(k in line for k in keys):
                    out.append(f"controller-{i}: {line[:400]}")
    return out


REFUSED = "is being deleted: no runner pod is created there"
"""The replica's log line for a create refused in a terminating namespace."""


RESTARTED = '"msg": "Restart: '
"""The replica's (JSON) log line for a Restart it performs."""


def refusals(state_dir: Path, replicas: int, text: str = REFUSED) -> int:
    """Lines of the replicas' logs holding ``text`` (default: refused creates)."""
    count = 0
    for i in range(replicas):
        with contextlib.suppress(OSError):
            count += (state_dir / "logs" / f"controller-{i}.log").read_text(
                errors="replace").count(text)
    return count


def delete_namespace(api: client.ApiClient, record: Record, state: Path,
                     args: argparse.Namespace) -> None:
    """Delete the soak's namespace with the replicas running; time it until it is gone
    and count the creates refused there (docs/reconciler.md, "A namespace being
    deleted")."""
    from neonvm.drills import fleet

    core = client.CoreV1Api(api)
    record.namespace_vms = len(fleet.list_vms(api, NAMESPACE))
    before = refusals(state, args.replicas)
    restarts = refusals(state, args.replicas, RESTARTED)
    say(f"deleting namespace {NAMESPACE} ({record.namespace_vms} VMs), replicas running")
    t0 = time.monotonic()
    core.delete_namespace(NAMESPACE, _request_timeout=30)
    deadline = t0 + args.namespace_timeout
    while time.monotonic() < deadline:
        try:
            core.read_namespace(NAMESPACE, _request_timeout=30)
        except ApiException as exc:
            if exc.status == 404:
                record.namespace_gone_s = round(time.monotonic() - t0, 1)
                break
        time.sleep(1.0)
    record.refused_creates = refusals(state, args.replicas) - before
    record.namespace_restarts = refusals(state, args.replicas, RESTARTED) - restarts
    if record.namespace_gone_s is None:
        record.failures.append(f"namespace {NAMESPACE} not gone {args.namespace_timeout:.0f}s "
                               f"after "
                               f"its delete")
    say(f"namespace gone after {record.namespace_gone_s} s; {record.refused_creates} "
        f"creates refused there, {record.namespace_restarts} restarts")


def soak(args: argparse.Namespace) -> Record:
    from neonvm.dev.binaries import install_binaries
    from neonvm.dev.cluster import LocalCluster
    from neonvm.dev.common import ClusterSpec
    from neonvm.drills import fleet
    from neonvm.drills.check import check
    from neonvm.drills.observer import Watchdog
    from neonvm.drills.target import LocalTarget, leader_tracker

    record = Record(vms=args.vms, minutes=args.minutes,
                    started=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    state = args.work / "state"
    install_binaries(with_nodes=True, with_helm=args.apf)
    spec = ClusterSpec.with_free_ports(nodes=args.nodes)
    spec.pods_per_node = -(-(args.vms + 2 * args.churn_live + 100) // args.nodes)
    spec.priority_and_fairness = args.apf
    cluster = LocalCluster(state, spec)
    say(f"starting a private control plane in {state} ({args.nodes} kwok nodes, "
        f"{spec.pods_per_node} pods each, API Priority and Fairness "
        f"{'on' if args.apf else 'off'})")
    cluster.up(progress=say)
    if args.apf:
        from neonvm import kube

        record.apf = install_apf(kube.api_client(cluster.kubeconfig),
                                 kube.api_client(cluster.kubeconfig_for("controller")))
        say(f"API Priority and Fairness: {record.apf}")
        if not record.apf["lease_requests_in_level"]:
            record.failures.append("the replicas' Lease requests are not classified into "
                                   f"the chart's level {record.apf['level']}")
        if not record.apf["reviews_in_level"]:
            record.failures.append("the replicas' TokenReviews are not classified into "
                                   f"the chart's level {record.apf['reviews_level']}")
    target = LocalTarget.prepare(state, args.replicas, say)
    api = target.api
    rng = random.Random(args.seed)
    names = [f"vm-{i:05d}" for i in range(args.vms)]
    scalable = names[:min(args.scale_vms, len(names))] if args.churn_scale else []
    record.scaled_vms = len(scalable)
    try:
        fleet.ensure_namespace(api, NAMESPACE)
        t0 = time.monotonic()
        say(f"creating {args.vms} VMs ({len(scalable)} of them scalable)")
        fleet.create_vms(api, NAMESPACE, scalable, 1, spec_extra={"guest": SCALABLE})
        fleet.create_vms(api, NAMESPACE, names[len(scalable):], 1)
        ok, seconds, st = wait_fleet(api, names, args.timeout, args.converge_poll)
        record.setup_s = round(time.monotonic() - t0, 1)
        if not ok:
            record.failures.append(f"the fleet did not converge: {len(st.converged)}/{st.total}"
                                   f" after {seconds:.0f}s")
            return record
        say(f"{args.vms} VMs converged in {record.setup_s:.0f}s; soaking for "
            f"{args.minutes:g} min")
        if args.minutes > 0:  # --minutes 0: no churn round at all (a fleet to delete)
            _soak(args, record, cluster, target, names, scalable, rng, Watchdog,
                  leader_tracker)
        say("churn stopped; waiting for every VM to converge")
        every = names + record.churn.get("live", [])
        t1 = time.monotonic()
        ok, seconds, st = wait_fleet(api, every, args.timeout, args.converge_poll)
        if ok:
            record.final_convergence_s = round(time.monotonic() - t1, 1)
        else:
            record.not_converged_end = sorted(st.waiting)[:50]
            record.failures.append(f"{len(st.waiting)} VM(s) not converged {args.timeout:.0f}s "
                                   f"after the churn stopped: "
                                   f"{dict(list(st.waiting.items())[:5])}")
        scaled = record.churn.get("scaled", [])
        if scaled:
            deadline = time.monotonic() + 180
            while (not_done := fleet.retrying(lambda: scale_not_done(api, scaled))) \
                    and time.monotonic() < deadline:
                time.sleep(10)
            record.scale_not_done = not_done
            if not_done:
                record.failures.append(f"{len(not_done)} scaled VM(s) not at their spec's "
                                       f"size at the end: {not_done[:5]}")
        result = fleet.retrying(lambda: check(api, namespace=NAMESPACE,
                                              locks=target.lock_reader(), settle=5.0,
                                              max_pending_seconds=args.timeout))
        record.check = result.as_dict()
        for f in result.findings:
            record.failures.append(f"check: {f.kind} {f.vm}: {f.detail}")
        if args.delete_namespace:
            if args.delete_at is not None:
                left = seconds_until(args.delete_at)
                say(f"waiting {left:.0f} s, until {args.delete_at} UTC, to delete the namespace")
                time.sleep(left)
            delete_namespace(api, record, state, args)
    finally:
        (args.work / "leader-lines.txt").write_text(
            "\n".join(leader_lines(state, args.replicas)) + "\n")
        if not args.keep_cluster:
            say("stopping the replicas and the control plane")
            for i in range(args.replicas):
                with contextlib.suppress(Exception):
                    cluster.stop_component(LocalTarget.replica_name(i))
            with contextlib.suppress(Exception):
                target.close()
            cluster.down()
    return record


def seconds_until(hh_mm: str) -> float:
    """Seconds from now to the UTC time ``HH:MM`` today (0 if it has passed)."""
    hh, mm = (int(x) for x in hh_mm.split(":"))
    now = time.gmtime()
    return max(0.0, (hh * 60 + mm) * 60.0 - (now.tm_hour * 3600 + now.tm_min * 60 + now.tm_sec))


def _soak(args: argparse.Namespace, record: Record, cluster: Any, target: Any,
          names: list[str], scalable: list[str], rng: random.Random, watchdog: Any,
          tracker: Any) -> None:
    from neonvm.drills import fleet

    api = target.api
    apiserver = Counters()
    started = time.monotonic()
    end = started + args.minutes * 60
    if args.until is not None:  # a wall-clock end (UTC, HH:MM) that comes first
        end = min(end, started + max(60.0, seconds_until(args.until)))
        say(f"churn until {args.until} UTC: {(end - started) / 60:.1f} min")
    not_since: dict[str, float] = {}
    with tracker(target, interval=0.5) as log, \
            watchdog(api, NAMESPACE, poll_interval=args.poll_seconds) as dog, \
            churn(api, names, dog, args.churn_interval, args.churn_pods, args.churn_live,
                  rng, scalable, args.churn_scale) as counts:
        controller = Counters()
        next_look = started
        while (now := time.monotonic()) < end:
            who, epoch = log.current
            rss: dict[str, float] = {}
            memory: dict[int, dict[str, float]] = {}
            leader_rss = None
            for i in range(args.replicas):
                pid = cluster.process_pid(f"controller-{i}")
                value = rss_mib(pid) if pid else None
                if value is not None:
                    rss[f"controller-{i}"] = round(value, 1)
                    memory[i] = proc_memory(pid)
                    port = metrics_port(cluster.log_file(f"controller-{i}"))
                    text = replica_metrics(port) if port is not None else None
                    if text is not None:
                        controller.add(f"{i}:{pid}", metric_sum(text,
                                                                "rest_client_requests_total"))
                        memory[i].update(gauge_by_label(text, REMEMBERED, "structure"))
            leader_memory: dict[str, float] = {}
            if who is not None:
                index = target.index_of(who)
                if index is not None:
                    leader_rss = rss.get(f"controller-{index}")
                    leader_memory = memory.get(index, {})
            apiserver.add("apiserver", apiserver_requests(api))
            sample = Sample(round(now - started, 1), who, epoch, leader_rss, rss,
                            apiserver.total if apiserver.last else None, controller.total,
                            os.getloadavg()[0], leader_memory=leader_memory)
            if now >= next_look:
                next_look = now + args.look_seconds
                with contextlib.suppress(Exception):
                    st = fleet.convergence(api, NAMESPACE, names)
                    waiting = set(st.waiting)
                    for name in list(not_since):
                        if name not in waiting:
                            del not_since[name]
                    for name in waiting:
                        not_since.setdefault(name, now)
                    stuck = [n for n, t in not_since.items()
                             if now - t >= args.stuck_minutes * 60]
                    sample.not_converged, sample.stuck = len(waiting), len(stuck)
                    if len(stuck) > record.stuck_max:
                        record.stuck_max, record.stuck_vms = len(stuck), sorted(stuck)[:20]
            record.samples.append(sample)
            # Written as it goes: a soak stopped early still leaves its record.
            (args.work / "soak.json").write_text(json.dumps(asdict(record), indent=1))
            say(f"{(now - started) / 60:5.1f} min: leader {who} (epoch {epoch}) RSS "
                f"{leader_rss} MiB; requests {sample.apiserver_requests} (API server), "
                f"{controller.total:.0f} (replicas); not converged {sample.not_converged}, "
                f"stuck {sample.stuck}; load {sample.load1:.1f}; duplicates so far "
                f"{dog.duplicates_so_far()}; churn {dict(counts, live=len(counts['live']))}")
            time.sleep(max(0.0, min(args.sample_seconds, end - time.monotonic())))
        report = dog.stop()
        if record.apf:
            record.apf.update(apf_counts(apiserver_metrics(api), record.apf["level"],
                                         record.apf.get("reviews_level", "")))
    record.churn = counts
    held = [(at, w, e) for at, w, e in log.changes if w]
    for (_, w0, e0), (at, w1, e1) in itertools.pairwise(held):
        record.leader_changes.append({"at_min": round((at - started) / 60, 2), "from": w0,
                                      "from_epoch": e0, "to": w1, "to_epoch": e1})
    record.watch = report.as_dict()
    record.duplicates = len(report.strict)
    record.duplicates_loose = len(report.loose)
    record.lost = [f"{u.pod} of {u.vm}" for u in report.watch.unexpected_deletions]
    for v in report.strict + report.loose:
        record.failures.append(f"duplicate: {v.vm} had {', '.join(v.pods)}")
    if record.lost:
        record.failures.append(f"lost work: {record.lost[:5]}")
    if record.stuck_max:
        record.failures.append(f"{record.stuck_max} VM(s) stuck for {args.stuck_minutes:g} min "
                               f"or more: {record.stuck_vms[:5]}")


# ---- the record as a table and a picture -----------------------------------------------------


def per_minute(samples: list[Sample], attr: str) -> list[tuple[float, float]]:
    """(minute, rate per minute) between consecutive samples with a value."""
    out = []
    pts = [(s.t, getattr(s, attr)) for s in samples if getattr(s, attr) is not None]
    for (t0, v0), (t1, v1) in itertools.pairwise(pts):
        if t1 > t0:
            out.append((t1 / 60, (v1 - v0) * 60 / (t1 - t0)))
    return out


def window(record: Record, first: bool, minutes: float = 10.0) -> dict[str, float | None]:
    span = record.samples[-1].t if record.samples else 0.0
    lo, hi = (0.0, minutes * 60) if first else (span - minutes * 60, span + 1)
    inside = [s for s in record.samples if lo <= s.t <= hi]
    rss = [s.leader_rss_mib for s in inside if s.leader_rss_mib is not None]
    api = [v for m, v in per_minute(record.samples, "apiserver_requests") if lo <= m * 60 <= hi]
    ctl = [v for m, v in per_minute(record.samples, "controller_requests") if lo <= m * 60 <= hi]
    nc = [s.not_converged for s in inside if s.not_converged is not None]

    def mean(xs: list[float] | list[int]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    return {"rss_mean": mean(rss), "rss_max": max(rss) if rss else None,
            "api_per_min": mean(api), "ctl_per_min": mean(ctl), "not_converged": mean(nc),
            "load": mean([s.load1 for s in inside])}


def memory_at(record: Record, minutes: list[float]) -> list[dict[str, float]]:
    """The leader's memory at the samples nearest to each of ``minutes`` (of those that
    have it)."""
    having = [s for s in record.samples if s.leader_memory]
    return [_nearest(having, m * 60).leader_memory for m in minutes] if having else []


def _nearest(samples: list[Sample], t: float) -> Sample:
    return min(samples, key=lambda s: abs(s.t - t))


def memory_line(record: Record) -> str | None:
    """What the leader held at the start, the middle and the end of the churn: its RSS
    split (anonymous, file), threads, and each memory's entries (docs/metrics.md)."""
    span = (record.samples[-1].t / 60) if record.samples else 0.0
    marks = [0.0, span / 2, span]
    at = memory_at(record, marks)
    if not at:
        return None
    keys = ["rss_anon_mib", "rss_file_mib", "threads"]
    keys += sorted({k for m in at for k in m} - set(keys))

    def v(m: dict[str, float], k: str) -> str:
        return "-" if k not in m else (f"{m[k]:,.1f}" if k.endswith("_mib") else f"{m[k]:,.0f}")

    parts = [f"{k} {' / '.join(v(m, k) for m in at)}" for k in keys]
    return (f"* the leader's memory at minutes {' / '.join(f'{m:.0f}' for m in marks)}: "
            + "; ".join(parts) + " (RSS in MiB from /proc; the rest: entries of "
            "`neonvm_controller_remembered_entries` by structure).")


def markdown(record: Record, args: argparse.Namespace, svg: str | None) -> str:
    a, b = window(record, True), window(record, False)

    def f(v: float | None, unit: str = "", digits: int = 0) -> str:
        return "-" if v is None else f"{v:,.{digits}f}{unit}"

    span = (record.samples[-1].t / 60) if record.samples else 0.0
    rows = [
        ("leader RSS, mean (max)", f"{f(a['rss_mean'], ' MiB')} ({f(a['rss_max'], ' MiB')})",
         f"{f(b['rss_mean'], ' MiB')} ({f(b['rss_max'], ' MiB')})"),
        ("API server requests per minute (every client)", f(a["api_per_min"]),
         f(b["api_per_min"])),
        ("controller replicas' requests per minute", f(a["ctl_per_min"]), f(b["ctl_per_min"])),
        ("fleet VMs not converged at a look, mean", f(a["not_converged"], digits=1),
         f(b["not_converged"], digits=1)),
        ("load average (1 min), mean", f(a["load"], digits=1), f(b["load"], digits=1)),
    ]
    changes = record.leader_changes
    verdict = "PASS" if not record.failures else "FAIL"
    lines = [
        f"`python -m benchmarks.soak --minutes {args.minutes:g}"
        f"{' --until ' + args.until if getattr(args, 'until', None) else ''} --vms {args.vms} "
        f"--churn-interval {args.churn_interval:g} --churn-pods {args.churn_pods}"
        f"{' --svg ' + svg if svg else ''}{' --delete-namespace' if args.delete_namespace else ''}"
        f"{' --write-docs' if args.write_docs else ''}`, started {record.started}: "
        f"**{verdict}**, {span:.1f} min of churn.",
        "",
        "| measure | first 10 min | last 10 min |", "|---|---|---|",
        *[f"| {m} | {x} | {y} |" for m, x, y in rows],
        "",
        f"* fleet: {record.vms} VMs converged in {f(record.setup_s, ' s')} before the clock "
        f"started; 3 replicas (the drills' lease timings: 6 s lease, 4 s renew deadline), "
        f"{args.nodes} kwok nodes.",
        f"* churn: {record.churn.get('pod deletions', 0)} runner pods deleted, "
        f"{record.churn.get('scale changes', 0)} scale changes (on {record.scaled_vms} "
        f"scalable VMs, each followed by its pod's restart: "
        f"{record.churn.get('scale restarts', 0)}; at the end "
        f"{len(record.churn.get('scaled', [])) - len(record.scale_not_done)} of the "
        f"{len(record.churn.get('scaled', []))} VMs scaled had their spec's size in status), "
        f"{record.churn.get('VMs created', 0)} VMs created and "
        f"{record.churn.get('VMs deleted', 0)} deleted, {record.churn.get('errors', 0)} "
        f"churn errors.",
        (f"* API Priority and Fairness on; the replicas' Lease requests "
         f"{'in' if record.apf.get('lease_requests_in_level') else 'NOT in'} the chart's "
         f"level ({record.apf.get('level')}): "
         f"{record.apf.get('lease_level_dispatched', 0):,.0f} requests dispatched there, "
         f"{record.apf.get('rejected_any_level', 0):,.0f} rejected in any level"
         + (f"; TokenReviews and issuer key fetches "
            f"{'in' if record.apf.get('reviews_in_level') else 'NOT in'} the chart's level "
            f"({record.apf['reviews_level']}): "
            f"{record.apf.get('reviews_level_dispatched', 0):,.0f} requests dispatched there."
            if record.apf.get("reviews_level") else ".")
         if record.apf else "* API Priority and Fairness off."),
        f"* leader changes: **{len(changes)}**"
        + ("" if not changes else " (" + "; ".join(
            f"{c['at_min']:.1f} min: {c['from']} (epoch {c['from_epoch']}) -> {c['to']} "
            f"(epoch {c['to_epoch']})" for c in changes) + "); the soak stops no replica, "
           "so none was intended by it"),
        f"* VMs lost (a live runner pod deleted by someone else): **{len(record.lost)}**; "
        f"stuck (not converged at every look for {args.stuck_minutes:g} min): "
        f"**{record.stuck_max}**; not converged after the churn stopped: "
        f"**{len(record.not_converged_end)}** (all converged "
        f"{f(record.final_convergence_s, ' s', 1)} after it stopped).",
        f"* checker: duplicates strict/loose **{record.duplicates}/"
        f"{record.duplicates_loose}**; {record.watch.get('pod_events', 0)} pod events "
        f"watched, {record.watch.get('pod_lists', 0)} pod lists polled, "
        f"{record.watch.get('watch_gaps', 0)} watch gap(s); final check "
        f"{'ok' if record.check.get('ok') else 'NOT ok'}.",
    ]
    if (held := memory_line(record)) is not None:
        lines.append(held)
    if args.delete_namespace:
        lines.append(f"* then the namespace ({record.namespace_vms} VMs) was deleted with the "
                     f"replicas running: gone after **{f(record.namespace_gone_s, ' s', 1)}**, "
                     f"**{record.refused_creates}** pod creates refused there (403 'being "
                     f"terminated', counted from the replicas' log lines)"
                     + ("." if record.namespace_restarts is None else
                        f", {record.namespace_restarts} restarts made meanwhile."))
    lines += [f"* FAILURE: {x}" for x in record.failures]
    if svg:
        lines += ["", f"![leader RSS and API calls per minute over the soak]({Path(svg).name})"]
    return "\n".join(lines)


def render_svg(record: Record, title: str) -> str:
    """Two panels over the soak's minutes: the leader's RSS, and requests per minute (API
    server, every client; the replicas' own); leader changes as red lines."""
    width, height, left, right = 900, 460, 70, 20
    panels = [(40, 190), (260, 410)]
    span = max(1.0, (record.samples[-1].t if record.samples else 60.0) / 60)
    rss = [(s.t / 60, s.leader_rss_mib) for s in record.samples
           if s.leader_rss_mib is not None]
    api = per_minute(record.samples, "apiserver_requests")
    ctl = per_minute(record.samples, "controller_requests")

    def x(m: float) -> float:
        return left + (width - left - right) * m / span

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="13">{title}</text>']

    def panel(top: float, bottom: float, series: list[tuple[str, str, list[tuple[float, float]]]],
              label: str) -> None:
        top_v = max([v for _, _, pts in series for _, v in pts] + [1.0]) * 1.1

        def y(v: float) -> float:
            return bottom - (bottom - top) * v / top_v

        out.append(f'<rect x="{left}" y="{top}" width="{width - left - right}" '
                   f'height="{bottom - top}" fill="none" stroke="#999"/>')
        for i in range(5):
            v = top_v * i / 4
            out.append(f'<text x="{left - 4}" y="{y(v) + 4:.1f}" text-anchor="end">'
                       f'{v:,.0f}</text>')
        out.append(f'<text x="12" y="{(top + bottom) / 2:.0f}" transform="rotate(-90 12 '
                   f'{(top + bottom) / 2:.0f})" text-anchor="middle">{label}</text>')
        for n, (name, colour, pts) in enumerate(series):
            if pts:
                path = " ".join(f"{x(m):.1f},{y(v):.1f}" for m, v in pts)
                out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" '
                           f'points="{path}"/>')
            out.append(f'<text x="{left + 8 + 260 * n}" y="{top + 14}" fill="{colour}">'
                       f'{name}</text>')
        for c in record.leader_changes:
            out.append(f'<line x1="{x(c["at_min"]):.1f}" x2="{x(c["at_min"]):.1f}" '
                       f'y1="{top}" y2="{bottom}" stroke="red" stroke-dasharray="3,2"/>')

    panel(*panels[0], [("leader RSS (MiB)", "#1f77b4", rss)], "MiB")
    panel(*panels[1], [("API server requests/min (every client)", "#2ca02c", api),
                       ("controller replicas' requests/min", "#ff7f0e", ctl)], "per minute")
    for m in range(0, int(span) + 1, max(1, int(span) // 12)):
        out.append(f'<text x="{x(m):.1f}" y="{panels[1][1] + 16}" text-anchor="middle">'
                   f'{m}</text>')
    out.append(f'<text x="{(width + left) / 2}" y="{height - 12}" text-anchor="middle">'
               f'minutes of churn (red: leader changes)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_docs(text: str) -> None:
    doc = DOC.read_text()
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in doc and END in doc:
        doc = doc[:doc.index(BEGIN)] + block + doc[doc.index(END) + len(END):]
    else:
        doc = doc.rstrip("\n") + "\n\n## Soak\n\n" + block + "\n"
    DOC.write_text(doc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0, help="Minutes of churn.")
    p.add_argument("--vms", type=int, default=2000, help="VMs of the fleet.")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--nodes", type=int, default=4, help="Simulated (kwok) nodes.")
    p.add_argument("--churn-interval", type=float, default=5.0)
    p.add_argument("--churn-pods", type=int, default=5,
                   help="Runner pods deleted per churn round.")
    p.add_argument("--churn-live", type=int, default=10,
                   help="Short-lived VMs alive at once (the oldest is deleted).")
    p.add_argument("--churn-scale", type=int, default=1,
                   help="Scale changes per churn round (each followed by its pod's restart).")
    p.add_argument("--scale-vms", type=int, default=100,
                   help="Fleet VMs made scalable (1 to 2 vCPUs and memory slots).")
    p.add_argument("--apf", action=argparse.BooleanOptionalAction, default=True,
                   help="Run the API server with API Priority and Fairness and the chart's "
                        "Lease FlowSchema.")
    p.add_argument("--converge-poll", type=float, default=10.0,
                   help="Seconds between the convergence waits' looks (cached VM list).")
    p.add_argument("--sample-seconds", type=float, default=30.0)
    p.add_argument("--look-seconds", type=float, default=60.0,
                   help="Seconds between convergence looks at the fleet.")
    p.add_argument("--poll-seconds", type=float, default=15.0,
                   help="The polling checker's period (the watching one sees every event).")
    p.add_argument("--stuck-minutes", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=900.0,
                   help="Seconds allowed for the fleet to converge (before and after).")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--work", type=Path, default=Path("/tmp/neonvm-soak"),
                   help="The private cluster's state, logs and the record (JSON).")
    p.add_argument("--svg", default=None, help="Write the picture here (e.g. docs/soak.svg).")
    p.add_argument("--write-docs", action="store_true")
    p.add_argument("--keep-cluster", action="store_true")
    p.add_argument("--delete-namespace", action="store_true",
                   help="At the end, delete the fleet's namespace with the replicas "
                        "running: time until it is gone, creates refused there.")
    p.add_argument("--namespace-timeout", type=float, default=420.0)
    p.add_argument("--delete-at", default=None,
                   help="With --delete-namespace: wait until this UTC time (HH:MM) after the "
                        "final check before deleting the namespace.")
    p.add_argument("--until", default=None,
                   help="Stop the churn at this UTC time (HH:MM) if it comes before "
                        "--minutes are up.")
    p.add_argument("--report", type=Path, default=None,
                   help="Render a recorded soak.json (picture, table, docs) without a run; "
                        "give the run's other options too.")
    args = p.parse_args(argv)
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    if args.report is not None:
        data = json.loads(args.report.read_text())
        data["samples"] = [Sample(**s) for s in data["samples"]]
        record = Record(**data)
    else:
        if (args.work / "state").exists():
            shutil.rmtree(args.work / "state")
        args.work.mkdir(parents=True, exist_ok=True)
        record = soak(args)
        (args.work / "soak.json").write_text(json.dumps(asdict(record), indent=1))
    if args.svg:
        Path(args.svg).write_text(render_svg(
            record, f"neonvm soak: {args.vms} VMs under churn, 3 replicas, "
                    f"{(record.samples[-1].t / 60) if record.samples else 0:.0f} min "
                    f"({record.started}; shared 2-core machine)"))
    text = markdown(record, args, args.svg)
    print(text)
    if args.write_docs:
        write_docs(text)
        say(f"wrote {DOC.relative_to(ROOT)}")
    return 0 if not record.failures else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
