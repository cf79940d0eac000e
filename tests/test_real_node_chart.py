"""The chart's controller really running: three pods on a real node, a kill-leader drill.

Opt-in like tests/test_real_node.py (``NEONVM_TEST_REAL_NODE=1``; it builds the real
node's binaries and the controller image on first run). It starts a cluster of its own:
the session's cluster runs without the ServiceAccount admission plugin, so its pods would
get no token. ``NEONVM_TEST_REAL_NODE=1 pytest tests/test_real_node_chart.py -s``
prints the timings docs/real-node.md records.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from neonvm import kube
from neonvm.api import types
from neonvm.dev import binaries, chartnode, nodeservices, realnode
from neonvm.dev.cluster import ClusterSpec, LocalCluster
from neonvm.drills.drills import DrillOptions, run_drill
from neonvm.drills.target import KubeTarget
from neonvm.leader.election import LeaseClient


def _skip_reason() -> str | None:
    if os.environ.get("NEONVM_TEST_REAL_NODE") != "1":
        return "real node not requested (set NEONVM_TEST_REAL_NODE=1; see docs/real-node.md)"
    problem = realnode.unavailable_reason()
    if problem:
        return f"a real node cannot start on this host: {problem}"
    from neonvm.dev import images

    problem = images.unavailable_reason()
    if problem:
        return f"images cannot be built here: {problem}"
    if binaries.find("helm") is None:
        return "helm is not built (neonvm dev install --with-helm, or tests/test_chart.py)"
    return None


@pytest.fixture(scope="module")
def chart_cluster(tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[LocalCluster, realnode.RealNode]]:
    """A cluster with two kwok nodes, ServiceAccount tokens on, and one real node with
    cluster DNS and Service routing (neonvm.dev.nodeservices)."""
    spec = ClusterSpec.with_free_ports(nodes=2)
    spec.service_account_tokens = True
    cluster = LocalCluster(Path(tmp_path_factory.mktemp("chart-cluster")), spec)
    node = realnode.RealNode(cluster, 0, cluster_dns=True)
    try:
        cluster.up()
        realnode.build()
        node.start()
        yield cluster, node
    finally:
        node.stop()
        cluster.down()


class RunnerPodNodes:
    """Every node a runner pod (any namespace) was seen on, polled in the background."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.nodes: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        core = client.CoreV1Api(self.api)
        while not self._stop.wait(1.0):
            try:
                pods = core.list_pod_for_all_namespaces(label_selector=types.LABEL_VM_NAME,
                                                        _request_timeout=30).items
            except Exception:  # a missed poll only loses a sample
                continue
            self.nodes |= {p.spec.node_name for p in pods if p.spec.node_name}

    def __enter__(self) -> RunnerPodNodes:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


REACH = """
import socket, sys
failed = 0
for host, port in ((sys.argv[1], int(sys.argv[2])), (sys.argv[3], int(sys.argv[4]))):
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as exc:
        print("cannot reach", host, port, exc)
        failed += 1
    else:
        print("reached", host, port)
sys.exit(1 if failed else 0)
"""


def _reach_from_a_pod(api: client.ApiClient, cluster: LocalCluster, node: realnode.RealNode,
                      image: str, name: str) -> tuple[str, str]:
    """Run a pod of ``image`` on the node that connects to the `kubernetes` Service IP
    and to the locks' etcd at the node IP; (phase, log)."""
    from neonvm.dev.pki import KUBERNETES_SERVICE_IP

    core = client.CoreV1Api(api)
    core.create_namespaced_pod("default", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {
            "nodeName": node.name, "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "containers": [{
                "name": "reach", "image": image, "imagePullPolicy": "Never",
                "command": ["/opt/neonvm/bin/python3", "-c", REACH, KUBERNETES_SERVICE_IP,
                            "443", node.node_ip, str(cluster.spec.ports["locks-etcd"])],
            }],
        },
    })
    deadline = time.monotonic() + 300
    phase = ""
    while time.monotonic() < deadline:
        phase = core.read_namespaced_pod(name, "default").status.phase
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(1.0)
    log = core.read_namespaced_pod_log(name, "default")
    core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
    return phase, log


@pytest.mark.cluster
@pytest.mark.realnode
@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_pods_reach_the_api_server_and_the_locks_etcd_only_through_the_nodes_forwarding(
    chart_cluster: tuple[LocalCluster, realnode.RealNode],
) -> None:
    """The API server and the locks' etcd listen on 127.0.0.1; a pod reaches them through
    the node's NAT chain, and cannot without it."""
    cluster, node = chart_cluster
    image = chartnode.import_controller_image(node, print)
    api = kube.api_client(cluster.kubeconfig)
    try:
        node._remove_forwarding()
        try:
            phase, log = _reach_from_a_pod(api, cluster, node, image, "reach-without")
        finally:
            node._forward_control_plane()
        print(log)
        assert phase == "Failed" and log.count("cannot reach") == 2, (phase, log)
        phase, log = _reach_from_a_pod(api, cluster, node, image, "reach-with")
        print(log)
        assert phase == "Succeeded", (phase, log)
        assert log.count("reached") == 2
    finally:
        api.close()


@pytest.mark.cluster
@pytest.mark.realnode
@pytest.mark.slow
@pytest.mark.timeout(2400)  # an image rebuild, a cluster start and the drill
@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_chart_runs_three_controller_pods_on_the_real_node_and_survives_kill_leader(
    chart_cluster: tuple[LocalCluster, realnode.RealNode],
) -> None:
    cluster, node = chart_cluster
    api = kube.api_client(cluster.kubeconfig)
    core = client.CoreV1Api(api)
    try:
        installed = chartnode.install(cluster, node, replicas=3, timeout=600, progress=print)
        print(f"helm install {installed.helm_seconds:.1f}s; 3 pods Ready "
              f"{installed.ready_seconds:.1f}s after it began")

        pods = chartnode.ready_pods(api)
        assert len(pods) == 3
        assert {p.spec.node_name for p in pods} == {node.name}
        # Pod networking, not the host's: each pod has an address of the node's subnet.
        prefix = node.node_ip.rsplit(".", 1)[0] + "."
        assert all(p.status.pod_ip.startswith(prefix) and not p.spec.host_network
                   for p in pods), [(p.metadata.name, p.status.pod_ip) for p in pods]

        # One leader, and it is one of the three pods (identity "<pod name>_<random>").
        lease = LeaseClient(api, chartnode.NAMESPACE, chartnode.RELEASE).get(10.0)
        assert lease is not None and lease.holder
        names = {p.metadata.name for p in pods}
        leader_pod = lease.holder.rsplit("_", 1)[0]
        assert leader_pod in names

        # Two crashes of the leader: its container's process SIGKILLed on the node (the
        # kubelet restarts the container in the same pod), then its pod deleted with
        # grace 0 (the kubelet sends SIGTERM, SIGKILL 2 s later; the Deployment makes a
        # new pod).
        for same_host in (True, False):
            leader = LeaseClient(api, chartnode.NAMESPACE, chartnode.RELEASE).get(10.0)
            assert leader is not None and leader.holder
            leader_pod = leader.holder.rsplit("_", 1)[0]
            names = {p.metadata.name for p in chartnode.ready_pods(api)}
            assert leader_pod in names
            how = "SIGKILL of the leader container" if same_host else "leader pod deleted"
            target = KubeTarget(api, cluster.kubeconfig, chartnode.NAMESPACE,
                                chartnode.RELEASE, etcd_endpoints=cluster.locks_etcd_config(),
                                same_host=same_host)
            with RunnerPodNodes(api) as seen:
                verdict = run_drill("kill-leader", target,
                                    DrillOptions(vms=6, signal="KILL", timeout=600, seed=17),
                                    print)
            print(f"== {how}")
            for key, value in verdict.rows():
                print(f"{key}: {value}")
            assert verdict.ok, verdict.failures
            assert verdict.leader_before is not None
            assert verdict.leader_before.rsplit("_", 1)[0] == leader_pod
            assert verdict.failover_seconds is not None
            assert verdict.leader_after not in (None, verdict.leader_before)
            assert verdict.convergence_seconds is not None
            assert verdict.duplicates == 0 and verdict.duplicates_loose == 0
            assert verdict.check.get("ok"), verdict.check
            # The locks were read from the etcd the pods use, and every one was released.
            assert not any(n.startswith("locks not checked") for n in verdict.notes), \
                verdict.notes
            # Runner pods ran on the kwok nodes: the real node is reserved for the
            # controller.
            assert seen.nodes and node.name not in seen.nodes, seen.nodes

            # Three replicas again: the container restarted, or a new pod.
            started = time.monotonic()
            chartnode.wait_ready(api, 3, timeout=600)
            print(f"3 controller pods Ready again {time.monotonic() - started:.1f}s after "
                  f"the drill ended")
            pods_now = {p.metadata.name: p for p in chartnode.controller_pods(api)}
            if same_host:
                restarts = pods_now[leader_pod].status.container_statuses[0].restart_count
                assert restarts >= 1
            else:
                assert leader_pod not in pods_now
        assert core.read_node(node.name).spec.unschedulable is not True
    finally:
        chartnode.uninstall(cluster, node)
        api.close()


@pytest.mark.skipif(binaries.find("helm") is None, reason="helm is not built")
def test_the_real_node_values_pass_the_charts_schema_and_place_the_pods(tmp_path: Path) -> None:
    """The values chartnode installs with are accepted by the chart's schema and render a
    Deployment pinned to the real node, tolerating its taint, with the node's etcd."""
    import subprocess

    import yaml

    from neonvm import manifests

    cluster = LocalCluster(tmp_path / "c", ClusterSpec.with_free_ports(nodes=2))
    node = realnode.RealNode(cluster, 0)
    chosen = chartnode.values(node, "ghcr.io/neonvm/neonvm-controller:9.9.9")
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(chosen))
    home = tmp_path / "helm"
    env = {**os.environ, "HELM_CACHE_HOME": str(home / "cache"),
           "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}
    out = subprocess.run(
        [str(binaries.require("helm")), "template", chartnode.RELEASE, str(manifests.CHART_DIR),
         "--namespace", chartnode.NAMESPACE, "--values", str(values_file)],
        env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    [deploy] = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"]
    assert deploy["metadata"]["name"] == chartnode.RELEASE
    pod = deploy["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {realnode.REAL_LABEL: "true"}
    assert {"key": realnode.REAL_LABEL, "operator": "Equal", "value": "true",
            "effect": "NoSchedule"} in pod["tolerations"]
    assert not pod.get("hostNetwork")
    [container] = pod["containers"]
    assert container["image"] == "ghcr.io/neonvm/neonvm-controller:9.9.9"
    assert container["imagePullPolicy"] == "Never"
    env_vars = {e["name"]: e.get("value") for e in container["env"]}
    assert env_vars["NEONVM_ETCD_ENDPOINTS"] == (
        f"https://{node.node_ip}:{cluster.spec.ports['locks-etcd']}")
    assert container["livenessProbe"]["initialDelaySeconds"] == 180


@pytest.mark.unit
def test_drill_pods_targets_the_state_dirs_chart_pods_only(tmp_path: Path) -> None:
    """``--pods`` drills the chart's pods of the --state-dir cluster: not with another
    kubeconfig, and not the drills that restart local components."""
    from click.testing import CliRunner

    from neonvm.cli import main

    other = tmp_path / "prod.kubeconfig"
    other.write_text("apiVersion: v1\nkind: Config\n")
    state = str(tmp_path / "state")
    runner = CliRunner()
    with_kubeconfig = runner.invoke(main, ["drill", "kill-leader", "--state-dir", state,
                                           "--pods", "--kubeconfig", str(other), "--yes"])
    assert with_kubeconfig.exit_code == 2
    assert "--pods drills the chart's pods" in with_kubeconfig.output, with_kubeconfig.output
    local_only = runner.invoke(main, ["drill", "etcd-restart", "--state-dir", state, "--pods"])
    assert local_only.exit_code == 2
    assert "nor stale-read, etcd-restart" in local_only.output, local_only.output


# ---- the chart with its default values, its own etcd included ---------------------------


@pytest.mark.cluster
@pytest.mark.realnode
@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("helm", ["helm", "helm3"], ids=["helm4", "helm3"])
@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_chart_with_default_values_runs_its_etcd_three_controllers_and_a_vm_on_the_real_node(
    chart_cluster: tuple[LocalCluster, realnode.RealNode], helm: str,
) -> None:
    """`helm install` with no values at all (Helm 4, then Helm 3): three etcd members
    and three controller replicas Ready on the real node, the members' claims bound, a VM
    whose guest boots there, and `helm test` passing. The node serves the cluster's DNS
    and routes ClusterIPs (the members find each other by the headless Service's names,
    the controller reaches https://neonvm-etcd:2379)."""
    from tests.support import chartdefaults
    from tests.support.harness import converged

    if binaries.find(helm) is None:
        pytest.skip(f"{helm} is not built (neonvm dev install --with-helm)")
    cluster, node = chart_cluster
    api = kube.api_client(cluster.kubeconfig)
    core = client.CoreV1Api(api)
    try:
        result = chartdefaults.install_and_test(cluster, node, helm, progress=print)
        print(f"{result.version}: installed in {result.install_seconds:.1f}s; 3 members Ready "
              f"{result.etcd_ready_seconds:.1f}s, 3 controllers Ready "
              f"{result.controllers_ready_seconds:.1f}s after it began; guest booted "
              f"{result.vm_ready_seconds:.1f}s after the VM was created; helm test "
              f"{result.test_seconds:.1f}s")
        assert "null" in chartdefaults.helm(cluster, helm).run(
            "get", "values", chartdefaults.RELEASE, "--namespace", chartdefaults.NAMESPACE)

        members = chartdefaults.pods(api, chartdefaults.ETCD)
        replicas = chartdefaults.pods(api, chartdefaults.CONTROLLER)
        for group in (members, replicas):
            assert len(group) == 3
            assert all(chartdefaults._ready(p) and p.spec.node_name == node.name
                       for p in group), chartdefaults.pod_states(api)
        assert {c.image for p in members for c in p.spec.containers} == {
            chartdefaults.chart_etcd_image()}
        claims = core.list_namespaced_persistent_volume_claim(
            chartdefaults.NAMESPACE, label_selector="app.kubernetes.io/name=neonvm-etcd").items
        assert sorted(c.status.phase for c in claims) == ["Bound"] * 3
        assert {c.spec.storage_class_name for c in claims} == {chartdefaults.STORAGE_CLASS}
        # The members' names resolve to their pods, and back (etcd checks a peer's
        # wildcard certificate name by the reverse lookup).
        for member in members:
            fqdn = (f"{member.metadata.name}.neonvm-etcd-headless.{chartdefaults.NAMESPACE}"
                    f".svc.cluster.local")
            assert nodeservices.resolve(node, fqdn) == [member.status.pod_ip]
            reverse = ".".join(reversed(member.status.pod_ip.split("."))) + ".in-addr.arpa"
            assert nodeservices.resolve(node, reverse, nodeservices.PTR) == [fqdn]

        lease = LeaseClient(api, chartdefaults.NAMESPACE, chartdefaults.RELEASE).get(10.0)
        assert lease is not None and lease.holder
        assert lease.holder.rsplit("_", 1)[0] in {p.metadata.name for p in replicas}

        status = result.vm["status"]
        assert status["phase"] == "Running"
        assert converged(api, chartdefaults.VM_NAMESPACE, [result.vm["metadata"]["name"]])
        vm_pod = core.read_namespaced_pod(result.vm_pod, chartdefaults.VM_NAMESPACE)
        assert vm_pod.spec.node_name == node.name
        # Self-fencing by default (issue 32): the pod carries its right and the projected
        # rights token (no scaling token Secret: rbac.liveScaling is off), and its runner
        # was granted with that token before QEMU started.
        assert (vm_pod.metadata.annotations or {}).get("vm.neon.tech/right-seconds") == "30"
        assert [v.name for v in vm_pod.spec.volumes or [] if v.projected is not None] == [
            "vm-rights-token"]
        assert "right to run granted" in result.guest_log, result.guest_log[-3000:]
        assert "NEONVM_GUEST_READY" in result.guest_log, result.guest_log[-3000:]
        assert f"app: argv hello from the chart {helm}" in result.guest_log, \
            result.guest_log[-3000:]

        out = result.test_output
        assert "Phase:          Succeeded" in out or "Phase: Succeeded" in out, out
        assert "/healthz?verbose: 200" in out, out
        assert "answered over TLS" in out, out
        assert "refused without a client certificate" in out, out
    finally:
        chartdefaults.uninstall(cluster, node, helm)
        api.close()


# ---- the node's DNS and Service routing, as pure functions ------------------------------


def _service(ns: str, name: str, cluster_ip: str | None, ports: list[dict[str, object]]
             ) -> dict[str, object]:
    return {"metadata": {"namespace": ns, "name": name},
            "spec": {"clusterIP": cluster_ip, "ports": ports}}


def _slice(ns: str, svc: str, endpoints: list[dict[str, object]],
           ports: list[dict[str, object]]) -> dict[str, object]:
    return {"metadata": {"namespace": ns, "name": f"{svc}-x",
                         "labels": {"kubernetes.io/service-name": svc}},
            "addressType": "IPv4", "endpoints": endpoints, "ports": ports}


SERVICES = [
    _service("default", "kubernetes", "10.96.0.1", [{"name": "https", "port": 443}]),
    _service("ns", "etcd", "10.96.0.20", [{"name": "client", "port": 2379}]),
    _service("ns", "etcd-headless", "None", [{"name": "peer", "port": 2380}]),
]
SLICES = [
    _slice("ns", "etcd", [{"addresses": ["10.251.1.5"], "conditions": {"ready": True}},
                          {"addresses": ["10.251.1.6"], "conditions": {"ready": False}},
                          {"addresses": ["10.251.1.7"], "conditions": {}}],
           [{"name": "client", "port": 2379}]),
    _slice("ns", "etcd-headless",
           [{"addresses": ["10.251.1.5"], "hostname": "etcd-0", "conditions": {"ready": True}},
            {"addresses": ["10.251.1.6"], "hostname": "etcd-1",
             "conditions": {"ready": False}}],
           [{"name": "peer", "port": 2380}]),
]


def _query(name: str, qtype: int) -> bytes:
    import struct

    return (struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0) + nodeservices._encode(name)
            + struct.pack("!HH", qtype, 1))


@pytest.mark.unit
def test_node_dns_tables_follow_the_kubernetes_dns_specification() -> None:
    t = nodeservices.build_tables(SERVICES, SLICES)
    # A ClusterIP Service: its ClusterIP; a headless one: its ready endpoints, and a
    # name per endpoint with a hostname (a StatefulSet member), with its reverse.
    assert t.a["etcd.ns.svc.cluster.local"] == ["10.96.0.20"]
    assert t.a["etcd-headless.ns.svc.cluster.local"] == ["10.251.1.5"]
    assert t.a["etcd-0.etcd-headless.ns.svc.cluster.local"] == ["10.251.1.5"]
    assert "etcd-1.etcd-headless.ns.svc.cluster.local" not in t.a
    assert t.ptr["10.251.1.5"] == "etcd-0.etcd-headless.ns.svc.cluster.local"
    # Routes: ready endpoints (no condition counts as ready), never the `kubernetes`
    # Service (the node forwards it to the API server itself).
    assert t.routes == [nodeservices.Route("10.96.0.20", 2379, "tcp",
                                           (("10.251.1.5", 2379), ("10.251.1.7", 2379)))]
    rules = nodeservices.restore_text("NVS-t", t.routes).splitlines()
    assert rules[:2] == ["*nat", ":NVS-t - [0:0]"] and rules[-1] == "COMMIT"
    assert "--probability 0.50000 -j DNAT --to-destination 10.251.1.5:2379" in rules[2]
    assert rules[3].endswith("--dport 2379 -j DNAT --to-destination 10.251.1.7:2379")


@pytest.mark.unit
def test_node_dns_answers_a_ptr_nodata_and_nxdomain_and_leaves_other_names() -> None:
    import struct

    t = nodeservices.build_tables(SERVICES, SLICES)

    def reply(name: str, qtype: int) -> tuple[int, int, bytes]:
        out = nodeservices.answer(_query(name, qtype), t)
        assert out is not None
        ident, flags, _qd, count = struct.unpack("!HHHH", out[:8])
        assert ident == 7 and flags & 0x8000
        return flags & 0xF, count, out

    rcode, count, out = reply("etcd-0.etcd-headless.ns.svc.cluster.local", nodeservices.A)
    assert (rcode, count) == (nodeservices.NOERROR, 1) and out.endswith(
        bytes([10, 251, 1, 5]))
    assert reply("etcd.ns.svc.cluster.local.", nodeservices.AAAA)[:2] == (0, 0)  # NODATA
    assert reply("ns.svc.cluster.local", nodeservices.A)[:2] == (0, 0)  # empty non-terminal
    assert reply("nope.ns.svc.cluster.local", nodeservices.A)[0] == nodeservices.NXDOMAIN
    rcode, count, out = reply("5.1.251.10.in-addr.arpa", nodeservices.PTR)
    assert (rcode, count) == (0, 1)
    assert out.endswith(nodeservices._encode("etcd-0.etcd-headless.ns.svc.cluster.local"))
    # Names outside the cluster domain, and addresses it does not know, are forwarded.
    assert nodeservices.answer(_query("example.com", nodeservices.A), t) is None
    assert nodeservices.answer(_query("9.9.9.9.in-addr.arpa", nodeservices.PTR), t) is None


@pytest.mark.unit
def test_etcd_image_is_the_built_binary_under_the_charts_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chart's etcd image for the real node: the etcd binary built here at
    ``/usr/local/bin/etcd`` (on PATH: the chart runs ``etcd``), named as the chart's
    ``etcd.bundled.image``, the same bytes each time; refused when the versions differ."""
    import io
    import json
    import tarfile

    from tests.support import chartdefaults

    fake = tmp_path / "etcd"
    fake.write_bytes(b"#!/bin/sh\n")
    monkeypatch.setenv("NEONVM_BIN_ETCD", str(fake))
    monkeypatch.setenv("NEONVM_CACHE_DIR", str(tmp_path / "cache"))
    name = chartdefaults.chart_etcd_image()
    assert name.endswith(":" + binaries.ETCD_VERSION)
    first = chartdefaults.etcd_image_archive().read_bytes()
    chartdefaults.etcd_image_archive().unlink()
    assert chartdefaults.etcd_image_archive().read_bytes() == first
    with tarfile.open(fileobj=io.BytesIO(first)) as tar:
        index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
        [manifest_ref] = index["manifests"]
        assert manifest_ref["annotations"]["io.containerd.image.name"] == name
        blob = tar.extractfile(f"blobs/sha256/{manifest_ref['digest'][7:]}")
        manifest = json.load(blob)  # type: ignore[arg-type]
        config = json.load(tar.extractfile(  # type: ignore[arg-type]
            f"blobs/sha256/{manifest['config']['digest'][7:]}"))
        assert any(e.startswith("PATH=/usr/local/bin:") for e in config["config"]["Env"])
        layer = tar.extractfile(f"blobs/sha256/{manifest['layers'][0]['digest'][7:]}")
        with tarfile.open(fileobj=layer, mode="r:gz") as files:
            etcd = files.getmember("usr/local/bin/etcd")
            assert etcd.mode == 0o755
            assert files.extractfile(etcd).read() == fake.read_bytes()  # type: ignore[union-attr]
    with pytest.raises(realnode.RealNodeError, match="another version"):
        chartdefaults.etcd_image_archive("gcr.io/etcd-development/etcd:v3.5.0")
