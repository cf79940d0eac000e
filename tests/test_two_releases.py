"""Two releases of the chart in one cluster, each converging its own VMs side by side.

Each release watches its own namespace, campaigns for its own Lease there, keeps its
keys under its own etcd prefix as its own etcd user, and runs the real controller with
the command line the chart renders and its own ServiceAccount's token, under its own
admission fence. Neither may fence the other out (docs/chart.md, "Per installation"):
both fleets converge, every VM with one runner pod, and each installation's etcd keys
name only its own VMs.

tests/test_tenant_boundaries.py shows the two fences and RBAC side by side with one
call of each kind; tests/test_locks.py shows two installations on one prefix under one
identity. This runs both whole controllers. Opt-in (``NEONVM_TEST_LONG=1``): it installs
two releases and starts two controllers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm.dev import binaries
from neonvm.dev.cluster import LocalCluster, free_port
from neonvm.leader.etcd import Etcd, EtcdConfig
from neonvm.leader.lock import parse_lock_key
from tests.support import wait_for
from tests.support.chart import Helm, Rendered, _lease_held, _running, _service_account_kubeconfig
from tests.support.harness import converged, create_vm
from tests.support.tenant import installed

VMS = 3


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    try:
        binary = binaries.require("helm")
    except binaries.BinaryError as exc:
        pytest.skip(str(exc))
    return Helm(binary, tmp_path_factory.mktemp("helm-home"))


@pytest.fixture
def namespaces(api: client.ApiClient) -> Iterator[list[str]]:
    """Two fresh namespaces, one per release; deleted afterwards (VMs' finalizers
    dropped first, as no controller runs by then)."""
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    names = [f"t-{uuid.uuid4().hex[:10]}" for _ in range(2)]
    for name in names:
        core.create_namespace({"metadata": {"name": name}})
    yield names
    for name in names:
        with contextlib.suppress(ApiException):
            for vm in custom.list_namespaced_custom_object(
                    "vm.neon.tech", "v1", name, "virtualmachines").get("items", []):
                if vm["metadata"].get("finalizers"):
                    custom.patch_namespaced_custom_object(
                        "vm.neon.tech", "v1", name, "virtualmachines", vm["metadata"]["name"],
                        {"metadata": {"finalizers": None}})
            core.delete_namespace(name)


def _release(helm: Helm, cluster: LocalCluster, namespace: str, etcd: EtcdConfig
             ) -> Rendered:
    return helm.template(f"r{uuid.uuid4().hex[:6]}", namespace, sets=(
        f"controller.watchNamespace={namespace}",
        f"controller.healthPort={free_port()}",
        f"etcd.endpoints={{{cluster.locks_etcd_url}}}", "etcd.bundled.enabled=false",
        f"etcd.prefix={etcd.prefix}",
        "leaderElection.leaseDurationSeconds=6", "leaderElection.renewDeadlineSeconds=4",
        "leaderElection.retryPeriodSeconds=1",
        # Self-fencing (on by default) needs a pod IP its EndpointSlice may name: not
        # this test's subject (tests/test_chart_self_fencing.py).
        "controller.rightSeconds=0",
    ))


def _command(api: client.ApiClient, cluster: LocalCluster, rendered: Rendered,
             etcd: EtcdConfig, path: Path) -> tuple[list[str], dict[str, str]]:
    """The chart's container command line and environment, with the ServiceAccount's
    own token and the etcd user's TLS files (as the kubelet would mount them)."""
    sa = rendered.one("ServiceAccount")["metadata"]["name"]
    kubeconfig = _service_account_kubeconfig(api, cluster, rendered.namespace, sa, path)
    container = rendered.container
    neonvm_cli = shutil.which("neonvm") or f"{sys.executable} -m neonvm"
    argv = [*neonvm_cli.split(), *container["args"]]
    argv.insert(argv.index("run") + 1, f"--kubeconfig={kubeconfig}")
    env = {**os.environ, **{e["name"]: e["value"] for e in container["env"] if "value" in e},
           "POD_NAME": f"{rendered.release}-0", "POD_NAMESPACE": rendered.namespace}
    for var, file in (("NEONVM_ETCD_CA", etcd.ca), ("NEONVM_ETCD_CERT", etcd.cert),
                      ("NEONVM_ETCD_KEY", etcd.key)):
        env[var] = str(file)
    env.pop("KUBECONFIG", None)
    return argv, env


def _installations(etcd: EtcdConfig) -> set[tuple[str, str]]:
    """(lease namespace, VM namespace) of every lock key under the prefix."""
    with Etcd(etcd) as reader:
        keys = [kv.key for kv in reader.get_prefix(etcd.prefix + "/").kvs]
    found = set()
    for key in keys:
        parsed = parse_lock_key(key, etcd.prefix)
        if parsed is not None:
            found.add((parsed[0].lease_namespace, parsed[1]))
    return found


@pytest.mark.cluster
@pytest.mark.nodes
@pytest.mark.slow
@pytest.mark.long
def test_two_releases_each_converge_their_own_vms_side_by_side(
        helm: Helm, cluster: LocalCluster, api: client.ApiClient, namespaces: list[str],
        tmp_path: Path) -> None:
    etcds = [cluster.locks_etcd_config(f"/release-{i}-{uuid.uuid4().hex[:6]}")
             for i in range(2)]
    releases = [_release(helm, cluster, ns, etcd)
                for ns, etcd in zip(namespaces, etcds, strict=True)]
    logs = [tmp_path / f"{r.release}.log" for r in releases]
    with installed(api, *releases), contextlib.ExitStack() as stack:
        procs = []
        for i, (rendered, etcd) in enumerate(zip(releases, etcds, strict=True)):
            argv, env = _command(api, cluster, rendered, etcd, tmp_path / f"sa-{i}.kubeconfig")
            procs.append(stack.enter_context(_running(argv, env, logs[i])))
        try:
            for rendered, proc in zip(releases, procs, strict=True):
                wait_for(lambda r=rendered, p=proc: p.poll() is not None or _lease_held(api, r),
                         timeout=60, what=f"{rendered.release} leading")
                assert proc.poll() is None, "a release's controller exited"
            names: dict[str, list[str]] = {ns: [] for ns in namespaces}
            for ns in namespaces:
                for j in range(VMS):
                    names[ns].append(create_vm(api, ns, f"vm-{j}")["metadata"]["name"])
            for ns in namespaces:
                wait_for(lambda ns=ns: converged(api, ns, names[ns]), timeout=120,
                         what=f"the VMs of {ns} converged")
            assert all(p.poll() is None for p in procs)
            # Each installation's locks name its own VMs only (same names on both sides).
            for ns, etcd in zip(namespaces, etcds, strict=True):
                assert _installations(etcd) == {(ns, ns)}, (ns, _installations(etcd))
        except BaseException:
            for log in logs:
                print(f"---- {log.name} ----\n{log.read_text()[-8000:]}")
            raise
