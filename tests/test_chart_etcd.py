"""The chart's bundled etcd, its `helm test` hook, and the chart under Helm 3 as well as Helm 4.

What is shown here:

* Helm 3 and Helm 4 (both built from the Go module proxy, ``neonvm dev install``) lint
  the chart strictly and render the same objects, for the default values (bundled etcd)
  and for the external-etcd values (``ci/ha-tls-values.yaml``).
* With default values the chart brings its etcd: three members started in parallel,
  TLS to clients and between peers with certificates required, preferred (or required)
  anti-affinity, a PodDisruptionBudget of one, a volume per member (or an emptyDir). The
  controller's default etcd values name exactly what it makes: its Service, its client
  Secret, its pods' labels (the NetworkPolicy's selector).
* The generated certificates: the members' server certificate verifies against the CA
  the controller's Secret carries and names the Services; the controller's client
  certificate verifies against the CA the members trust for clients, not against the
  peer CA.
* For real: three etcd processes started with the rendered flags and the rendered
  Secrets (peer and client URLs moved to loopback ports, nothing else) form a cluster;
  the controller's etcd client with the rendered client Secret writes and reads; without
  the client certificate it is refused; and the `helm test` pod's own script passes
  against them (and fails when the controller's health endpoint does not answer).
* On the real API server, with each Helm: ``helm install --dry-run=server``, then a real
  install, an upgrade that keeps every certificate (``lookup``), and uninstall.

What is not: no etcd pod runs here (the local cluster's real node has no cluster DNS
nor kube-proxy, so members could not find each other by name; docs/chart.md, "The
bundled etcd"), and `helm test` itself is not run against a live release.
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from kubernetes import client

from neonvm.dev import binaries
from neonvm.dev.cluster import LocalCluster, free_port
from neonvm.leader.etcd import Etcd, EtcdConfig, EtcdError
from tests.support import wait_for
from tests.support.chart import CHART, HA_TLS_VALUES, Helm, Rendered, _restricted_namespace

HELMS = ("helm", "helm3")


def _helm(name: str, home: Path) -> Helm:
    path = binaries.find(name)
    if path is None:
        pytest.skip(f"{name} is not built (neonvm dev install)")
    return Helm(path, home)


@pytest.fixture(scope="module", params=HELMS, ids=["helm4", "helm3"])
def any_helm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return _helm(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def helm4(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return _helm("helm", tmp_path_factory.mktemp("helm4"))


def _kinds(rendered: Rendered) -> list[tuple[str, str]]:
    return sorted((o["kind"], o["metadata"]["name"]) for o in rendered.objects)


def _etcd(rendered: Rendered, kind: str) -> list[dict[str, Any]]:
    return [o for o in rendered.objects if o["kind"] == kind
            and o["metadata"]["labels"].get("app.kubernetes.io/component") == "etcd"]


def _secret_files(rendered: Rendered, name: str) -> dict[str, bytes]:
    (secret,) = [o for o in rendered.objects
                 if o["kind"] == "Secret" and o["metadata"]["name"] == name]
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


# ---- Helm 3 and Helm 4 ---------------------------------------------------------------------


@pytest.mark.parametrize("values", [None, HA_TLS_VALUES], ids=["default", "ha-tls"])
def test_helm_3_and_helm_4_lint_and_render_the_same_objects(
    tmp_path: Path, values: Path | None,
) -> None:
    helm4, helm3 = _helm("helm", tmp_path / "4"), _helm("helm3", tmp_path / "3")
    for helm in (helm4, helm3):
        args = ["lint", str(CHART), "--strict", "--namespace", "neonvm-system"]
        args += ["--values", str(values)] if values else []
        assert "1 chart(s) linted, 0 chart(s) failed" in helm.run(*args).stdout
    four = helm4.template("neonvm-controller", "neonvm-system", values)
    three = helm3.template("neonvm-controller", "neonvm-system", values)
    assert _kinds(four) == _kinds(three)
    assert [o for o in four.objects if o["kind"] != "Secret"] == \
        [o for o in three.objects if o["kind"] != "Secret"]
    assert ("StatefulSet", "neonvm-etcd") in _kinds(four) if values is None \
        else ("StatefulSet", "neonvm-etcd") not in _kinds(four)


# ---- the bundled etcd as rendered -----------------------------------------------------------


def test_default_values_bring_a_three_member_tls_etcd_the_controller_is_pointed_at(
    any_helm: Helm,
) -> None:
    rendered = any_helm.template("neonvm-controller", "neonvm-system")
    (sts,) = _etcd(rendered, "StatefulSet")
    assert sts["metadata"]["name"] == "neonvm-etcd"
    spec = sts["spec"]
    assert spec["replicas"] == 3
    assert spec["podManagementPolicy"] == "Parallel"  # ready needs a quorum
    assert spec["serviceName"] == "neonvm-etcd-headless"
    pod = spec["template"]["spec"]
    (etcd,) = pod["containers"]
    flags = dict(a.split("=", 1) for a in etcd["args"])
    domain = "neonvm-etcd-headless.neonvm-system.svc.cluster.local"
    assert flags["--initial-cluster"] == ",".join(
        f"neonvm-etcd-{i}=https://neonvm-etcd-{i}.{domain}:2380" for i in range(3))
    assert flags["--listen-client-urls"] == "https://0.0.0.0:2379"
    assert flags["--listen-peer-urls"] == "https://0.0.0.0:2380"
    assert flags["--client-cert-auth"] == flags["--peer-client-cert-auth"] == "true"
    assert {v for k, v in flags.items() if k.endswith("-file")} == {
        f"/etc/etcd/{d}/{f}" for d in ("server", "peer") for f in ("ca.crt", "tls.crt", "tls.key")}
    assert etcd["image"] == "gcr.io/etcd-development/etcd:v3.6.16"
    assert etcd["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v} == {
        "neonvm-etcd-server", "neonvm-etcd-peer"}
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert "storageClassName" not in claim["spec"]
    terms = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"

    (pdb,) = _etcd(rendered, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    pod_labels = spec["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()

    # What the controller is told is what the chart makes.
    env = rendered.env()
    services = {s["metadata"]["name"]: s for s in _etcd(rendered, "Service")}
    assert set(services) == {"neonvm-etcd", "neonvm-etcd-headless"}
    assert env["NEONVM_ETCD_ENDPOINTS"]["value"] == "https://neonvm-etcd:2379"
    assert services["neonvm-etcd-headless"]["spec"]["publishNotReadyAddresses"] is True
    (volume,) = [v for v in rendered.pod_spec["volumes"] if v["name"] == "etcd-tls"]
    assert {o["metadata"]["name"] for o in _etcd(rendered, "Secret")} == {
        "neonvm-etcd-ca", "neonvm-etcd-server", "neonvm-etcd-peer",
        volume["secret"]["secretName"]}
    (policy,) = [p for p in rendered.all("NetworkPolicy")  # not self-fencing's
                 if not p["metadata"]["name"].endswith("-rights-from-runners")]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert not rendered.one("Deployment")["spec"]["selector"]["matchLabels"].items() <= \
        pod_labels.items()


def test_anti_affinity_hard_storage_and_an_emptydir_for_tests(helm4: Helm) -> None:
    hard = helm4.template("r", "ns", sets=(
        "etcd.bundled.antiAffinity=hard", "etcd.bundled.persistence.storageClass=fast",
        "etcd.bundled.persistence.size=8Gi"))
    (sts,) = _etcd(hard, "StatefulSet")
    (term,) = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "fast"
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"

    empty = helm4.template("r", "ns", sets=("etcd.bundled.persistence.enabled=false",
                                            "etcd.bundled.replicas=1"))
    (sts,) = _etcd(empty, "StatefulSet")
    assert "volumeClaimTemplates" not in sts["spec"]
    assert {"name": "data", "emptyDir": {}} in sts["spec"]["template"]["spec"]["volumes"]
    assert "--initial-cluster=neonvm-etcd-0=https://neonvm-etcd-0.neonvm-etcd-headless" \
        ".ns.svc.cluster.local:2380" in sts["spec"]["template"]["spec"]["containers"][0]["args"]

    external = helm4.template("r", "ns", HA_TLS_VALUES)
    assert not [o for o in external.objects
                if o["metadata"]["labels"].get("app.kubernetes.io/component") == "etcd"]


@pytest.mark.parametrize(("sets", "message"), [
    (("etcd.endpoints={https://etcd.example:2379}",),
     "not the bundled etcd (https://neonvm-etcd:2379): set etcd.bundled.enabled=false"),
    (("etcd.insecure=true", "etcd.tls.enabled=false", "etcd.endpoints={http://neonvm-etcd:2379}"),
     "etcd.bundled speaks TLS only"),
    (("etcd.tls.secretName=mine",), "etcd.tls.secretName must be neonvm-etcd-client"),
    (("etcd.auth.enabled=true", "etcd.auth.secretName=a"), "set etcd.auth.enabled=false"),
    (("etcd.networkPolicy.etcdPodSelector.app=etcd",), "the policy would guard nothing"),
    (("etcd.bundled.antiAffinity=sometimes",), "etcd/bundled/antiAffinity"),
], ids=["external-endpoint", "insecure", "other-secret", "password-auth", "selector", "schema"])
def test_values_that_would_leave_the_bundled_etcd_unused_or_unguarded_are_refused(
    helm4: Helm, sets: tuple[str, ...], message: str,
) -> None:
    assert message in helm4.template_fails(*[a for s in sets for a in ("--set", s)])


def test_members_served_under_other_names_are_accepted_as_the_bundled_etcd(helm4: Helm) -> None:
    rendered = helm4.template("r", "ns", sets=(
        "etcd.endpoints={https://neonvm-etcd-0.neonvm-etcd-headless.ns.svc:2379,"
        "https://neonvm-etcd.ns.svc.cluster.local:2379}",))
    assert "neonvm-etcd-0.neonvm-etcd-headless" in rendered.env()["NEONVM_ETCD_ENDPOINTS"]["value"]


def test_the_image_tag_is_the_charts_app_version_unless_a_digest_pins_it(helm4: Helm) -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    rendered = helm4.template("r", "ns")
    assert rendered.container["image"] == f"ghcr.io/neonvm/neonvm-controller:{chart['appVersion']}"
    digest = "sha256:" + "ab" * 32
    pinned = helm4.template("r", "ns", sets=(f"image.digest={digest}",
                                             f"etcd.bundled.image.digest={digest}"))
    assert pinned.container["image"] == f"ghcr.io/neonvm/neonvm-controller@{digest}"
    (sts,) = _etcd(pinned, "StatefulSet")
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == \
        f"gcr.io/etcd-development/etcd@{digest}"
    assert "etcd/bundled/image/digest" in helm4.template_fails(
        "--set", "etcd.bundled.image.digest=latest")


# ---- certificates -------------------------------------------------------------------------


def _verifies(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    key = ca.public_key()
    try:
        if isinstance(key, rsa.RSAPublicKey):
            assert cert.signature_hash_algorithm is not None
            key.verify(cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(),
                       cert.signature_hash_algorithm)
        else:
            assert isinstance(key, ec.EllipticCurvePublicKey)
            assert cert.signature_hash_algorithm is not None
            key.verify(cert.signature, cert.tbs_certificate_bytes,
                       ec.ECDSA(cert.signature_hash_algorithm))
    except Exception:
        return False
    return cert.issuer == ca.subject


def test_generated_certificates_chain_to_the_right_cas_and_name_the_services(helm4: Helm) -> None:
    rendered = helm4.template("neonvm-controller", "neonvm-system")
    load = x509.load_pem_x509_certificate
    server = _secret_files(rendered, "neonvm-etcd-server")
    peer = _secret_files(rendered, "neonvm-etcd-peer")
    controller = _secret_files(rendered, "neonvm-etcd-client")
    ca = _secret_files(rendered, "neonvm-etcd-ca")
    # The controller trusts the members' server certificate ...
    assert _verifies(load(server["tls.crt"]), load(controller["ca.crt"]))
    names = load(server["tls.crt"]).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert {"neonvm-etcd", "neonvm-etcd.neonvm-system.svc",
            "*.neonvm-etcd-headless.neonvm-system.svc.cluster.local"} <= set(names)
    # ... the members trust the controller's certificate as a client ...
    assert _verifies(load(controller["tls.crt"]), load(server["ca.crt"]))
    assert load(controller["tls.crt"]).subject.rfc4514_string() == "CN=neonvm-controller"
    # ... and peers only certificates of the peer CA: no client speaks raft.
    assert _verifies(load(peer["tls.crt"]), load(peer["ca.crt"]))
    assert not _verifies(load(controller["tls.crt"]), load(peer["ca.crt"]))
    assert ca["peer-ca.crt"] == peer["ca.crt"] and ca["ca.crt"] == server["ca.crt"]


# ---- three real etcd members from the rendered flags and Secrets ------------------------------


class Members:
    """Three etcd processes run with the StatefulSet's flags and Secrets, on loopback."""

    def __init__(self, rendered: Rendered, root: Path) -> None:
        (sts,) = _etcd(rendered, "StatefulSet")
        self.args: list[str] = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        self.root = root
        self.ports = [(free_port(), free_port()) for _ in range(3)]
        for kind in ("server", "peer", "client"):
            d = root / kind
            d.mkdir(parents=True)
            for name, data in _secret_files(rendered, f"neonvm-etcd-{kind}").items():
                (d / name).write_bytes(data)
                (d / name).chmod(0o600)
        self.procs: list[subprocess.Popen[bytes]] = []

    def argv(self, i: int) -> list[str]:
        """The rendered arguments with names, URLs and paths moved to this host."""
        cluster = ",".join(f"neonvm-etcd-{j}=https://127.0.0.1:{p}"
                           for j, (_c, p) in enumerate(self.ports))
        client_port, peer_port = self.ports[i]
        moved = {
            "--name": f"neonvm-etcd-{i}",
            "--data-dir": str(self.root / f"data-{i}"),
            "--listen-client-urls": f"https://127.0.0.1:{client_port}",
            "--advertise-client-urls": f"https://127.0.0.1:{client_port}",
            "--listen-peer-urls": f"https://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls": f"https://127.0.0.1:{peer_port}",
            "--initial-cluster": cluster,
            "--listen-metrics-urls": f"http://127.0.0.1:{free_port()}",
        }
        out = [str(binaries.require("etcd"))]
        for arg in self.args:
            flag, _, value = arg.partition("=")
            value = moved.get(flag, value)
            out.append(f"{flag}={value.replace('/etc/etcd/', str(self.root) + '/')}")
        return out

    def start(self) -> None:
        for i in range(3):
            log = (self.root / f"etcd-{i}.log").open("wb")
            self.procs.append(subprocess.Popen(self.argv(i), stdout=log, stderr=log))

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(timeout=30)

    @property
    def endpoints(self) -> str:
        return ",".join(f"https://127.0.0.1:{c}" for c, _p in self.ports)

    def config(self, with_certificate: bool = True) -> EtcdConfig:
        d = self.root / "client"
        return EtcdConfig(endpoints=tuple(self.endpoints.split(",")), prefix="/neonvm",
                          ca=d / "ca.crt", cert=d / "tls.crt" if with_certificate else None,
                          key=d / "tls.key" if with_certificate else None, timeout=5.0)


@pytest.fixture(scope="module")
def members(helm4: Helm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Members]:
    rendered = helm4.template("neonvm-controller", "neonvm-system")
    m = Members(rendered, tmp_path_factory.mktemp("etcd-members"))
    m.start()
    try:
        def quorum() -> bool:
            try:
                with Etcd(m.config()) as etcd:
                    etcd.put("/neonvm/probe", b"1")
                return True
            except EtcdError:
                return False
        wait_for(quorum, timeout=120, interval=0.5, what="the three members to form a cluster")
        yield m
    finally:
        m.stop()


@pytest.mark.cluster
def test_the_rendered_members_form_a_cluster_that_the_controllers_certificate_may_use(
    members: Members,
) -> None:
    with Etcd(members.config()) as etcd:
        etcd.put("/neonvm/x", b"written")
        for endpoint in members.endpoints.split(","):  # every member answers for it
            one = EtcdConfig(endpoints=(endpoint,), prefix="/neonvm",
                             ca=members.config().ca, cert=members.config().cert,
                             key=members.config().key, timeout=5.0)
            with Etcd(one) as single:
                got = single.get("/neonvm/x")
                assert got is not None and got.value == b"written"
    with Etcd(members.config(with_certificate=False)) as anonymous, \
            pytest.raises(EtcdError):
        anonymous.get("/neonvm/x")


def _test_pod_script(rendered: Rendered) -> tuple[str, str, dict[str, str]]:
    """The `helm test` pod's script, its health URL argument and its etcd environment."""
    (pod,) = [o for o in rendered.objects if o["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    python, flag, script, url = container["command"]
    assert (python, flag) == ("python3", "-c")
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    return script, url, env


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"[+]election ok\nhealthz check passed\n"
        self.send_response(200 if self.path.startswith("/healthz") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        return None


@pytest.mark.cluster
def test_the_helm_test_script_passes_against_the_members_and_a_healthy_controller(
    helm4: Helm, members: Members,
) -> None:
    rendered = helm4.template("neonvm-controller", "neonvm-system")
    script, url, env = _test_pod_script(rendered)
    assert url == ("http://neonvm-controller-metrics.neonvm-system.svc:8081/healthz?verbose")
    assert env["NEONVM_ETCD_ENDPOINTS"] == "https://neonvm-etcd:2379"
    assert re.fullmatch(r"/etc/neonvm/etcd-tls/tls\.crt", env["NEONVM_ETCD_CERT"])
    (pod,) = [o for o in rendered.objects if o["kind"] == "Pod"]
    deploy_selector = rendered.one("Deployment")["spec"]["selector"]["matchLabels"]
    assert not deploy_selector.items() <= pod["metadata"]["labels"].items()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    local = {**os.environ, **members.config().env(), "PYTHONPATH": str(Path.cwd())}
    try:
        ok = subprocess.run(
            [sys.executable, "-c", script, f"http://127.0.0.1:{server.server_port}/healthz"],
            env=local, capture_output=True, text=True, timeout=120)
        print(ok.stdout)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "answered over TLS" in ok.stdout
        assert "refused without a client certificate" in ok.stdout
    finally:
        server.shutdown()
    down = subprocess.run(
        [sys.executable, "-c", script, f"http://127.0.0.1:{free_port()}/healthz"],
        env=local, capture_output=True, text=True, timeout=120)
    assert down.returncode == 1 and "controller http" in down.stdout and "FAILED" in down.stdout


# ---- helm install on the real API server, with each Helm --------------------------------------


@pytest.fixture
def release_namespace(api: client.ApiClient) -> Iterator[str]:
    yield from _restricted_namespace(api)


@pytest.mark.cluster
def test_each_helm_installs_upgrades_keeping_the_certificates_and_uninstalls(
    any_helm: Helm, cluster: LocalCluster, api: client.ApiClient, release_namespace: str,
) -> None:
    release = f"r{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(api)
    apps = client.AppsV1Api(api)

    def run(*args: str) -> str:
        return any_helm.run(*args, "--namespace", release_namespace,
                            kubeconfig=cluster.kubeconfig).stdout

    dry = run("install", release, str(CHART), "--dry-run=server")
    assert "kind: StatefulSet" in dry
    try:
        run("install", release, str(CHART))
        sts = apps.read_namespaced_stateful_set("neonvm-etcd", release_namespace)
        assert sts.spec.replicas == 3
        names = ("ca", "server", "peer", "client")

        def secrets() -> dict[str, dict[str, str]]:
            return {n: core.read_namespaced_secret(f"neonvm-etcd-{n}", release_namespace).data
                    for n in names}
        before = secrets()
        template_before = api.sanitize_for_serialization(sts.spec.template)
        run("upgrade", release, str(CHART), "--reuse-values", "--set", "replicaCount=2")
        assert secrets() == before
        sts = apps.read_namespaced_stateful_set("neonvm-etcd", release_namespace)
        # Same certificates, same pod template: no member restarts on an upgrade.
        assert api.sanitize_for_serialization(sts.spec.template) == template_before
        history = json.loads(run("history", release, "--output", "json"))
        assert [h["status"] for h in history] == ["superseded", "deployed"]
    finally:
        any_helm.run("uninstall", release, "--namespace", release_namespace,
                     kubeconfig=cluster.kubeconfig, check=False)
    with pytest.raises(client.exceptions.ApiException):
        apps.read_namespaced_stateful_set("neonvm-etcd", release_namespace)

