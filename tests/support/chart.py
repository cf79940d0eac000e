"""The real helm binary (:class:`Helm`, the ``helm`` fixture) and what ``helm template``
renders (:class:`Rendered`); the chart's values sets."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm import manifests
from neonvm.dev import binaries
from neonvm.dev.cluster import LocalCluster

CHART = manifests.CHART_DIR


HA_TLS_VALUES = CHART / "ci" / "ha-tls-values.yaml"


STANDARD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
)


@dataclass(frozen=True)
class Helm:
    """The real helm binary, with its config, cache and data kept in a temp directory."""

    binary: Path
    home: Path

    def run(self, *args: str, check: bool = True,
            kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run helm; it reaches a cluster only when given ``kubeconfig``."""
        env = {
            **os.environ,
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_DATA_HOME": str(self.home / "data"),
            "KUBECONFIG": str(kubeconfig or self.home / "no-cluster.kubeconfig"),
        }
        proc = subprocess.run(
            [str(self.binary), *args], env=env, capture_output=True, text=True, timeout=120
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}{proc.stdout}"
            )
        return proc

    def template(self, release: str, namespace: str, values: Path | None = None,
                 sets: tuple[str, ...] = (), crds: bool = False) -> Rendered:
        args = ["template", release, str(CHART), "--namespace", namespace]
        if values is not None:
            args += ["--values", str(values)]
        for s in sets:
            args += ["--set", s]
        if crds:
            args.append("--include-crds")
        out = self.run(*args).stdout
        return Rendered(release, namespace,
                        [d for d in yaml.safe_load_all(out) if d])

    def template_fails(self, *args: str) -> str:
        """Render with ``args`` expecting refusal; returns helm's error output."""
        proc = self.run("template", "probe", str(CHART), "--namespace", "probe", *args,
                        check=False)
        assert proc.returncode != 0, f"helm accepted {args}:\n{proc.stdout[:2000]}"
        return proc.stderr


@dataclass
class Rendered:
    """The objects ``helm template`` printed, with lookups by kind."""

    release: str
    namespace: str
    objects: list[dict[str, Any]] = field(default_factory=list)

    def all(self, kind: str) -> list[dict[str, Any]]:
        """The controller's objects of ``kind``: not the bundled etcd's, nor `helm test`'s
        (tests/test_chart_etcd.py checks those); ``objects`` holds every one."""
        return [o for o in self.objects if o["kind"] == kind
                and o["metadata"].get("labels", {}).get("app.kubernetes.io/component") != "etcd"
                and "helm.sh/hook" not in o["metadata"].get("annotations", {})]

    def one(self, kind: str) -> dict[str, Any]:
        found = self.all(kind)
        assert len(found) == 1, f"expected one {kind}, got {len(found)}"
        return found[0]

    @property
    def pod_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = self.one("Deployment")["spec"]["template"]["spec"]
        return spec

    @property
    def container(self) -> dict[str, Any]:
        (c,) = self.pod_spec["containers"]
        assert isinstance(c, dict)
        return c

    def env(self) -> dict[str, dict[str, Any]]:
        return {e["name"]: e for e in self.container["env"]}

    def service_account_user(self) -> str:
        sa = self.one("ServiceAccount")["metadata"]
        return f"system:serviceaccount:{sa['namespace']}:{sa['name']}"


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(binaries.require("helm"), tmp_path_factory.mktemp("helm-home"))


def _restricted_namespace(api: client.ApiClient) -> Iterator[str]:
    """A fresh namespace enforcing the ``restricted`` Pod Security Standard."""
    core = client.CoreV1Api(api)
    name = f"chart-{uuid.uuid4().hex[:8]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=name, labels={"pod-security.kubernetes.io/enforce": "restricted",
                           "pod-security.kubernetes.io/enforce-version": "latest"})))
    try:
        yield name
    finally:
        with contextlib.suppress(ApiException):
            core.delete_namespace(name)


def _service_account_kubeconfig(api: client.ApiClient, cluster: LocalCluster,
                                namespace: str, name: str, path: Path) -> Path:
    """A kubeconfig holding a real token of the ServiceAccount (TokenRequest API)."""
    token = client.CoreV1Api(api).create_namespaced_service_account_token(
        name, namespace, client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)))
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    admin["users"] = [{"name": "sa", "user": {"token": token.status.token}}]
    admin["contexts"] = [{"name": "sa", "context": {"cluster": admin["clusters"][0]["name"],
                                                    "user": "sa"}}]
    admin["current-context"] = "sa"
    path.write_text(yaml.safe_dump(admin))
    return path


@contextlib.contextmanager
def _running(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _lease_held(api: client.ApiClient, rendered: Rendered) -> bool:
    args = rendered.container["args"]
    ns = next(a.split("=", 1)[1] for a in args if a.startswith("--lease-namespace="))
    name = next(a.split("=", 1)[1] for a in args if a.startswith("--lease-name="))
    try:
        lease = client.CoordinationV1Api(api).read_namespaced_lease(name, ns)
    except ApiException as err:
        if err.status == 404:
            return False
        raise
    return bool(lease.spec.holder_identity)
