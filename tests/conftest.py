"""Shared fixtures: one real control plane per test session, a fresh namespace per test.

The control plane (etcd for the API server, a second etcd for locks, kube-apiserver, and
with ``nodes`` also kube-scheduler, kube-controller-manager and kwok) runs on free
loopback ports in a temporary state directory, so tests never touch a developer's
``neonvm dev up`` cluster. ``NEONVM_TEST_NODES=0`` runs tests without simulated nodes.

Tests marked ``unit`` need no servers: ``pytest -m unit`` runs them alone, quickly.
Tests marked ``long`` (infrastructure drills, minutes-long real-server runs whose figures
live in docs/) are opt-in: ``NEONVM_TEST_LONG=1`` runs them, so the test command stays
within its budget.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from neonvm import kube
from neonvm.dev.cluster import ClusterSpec, LocalCluster
from neonvm.invariant import InvariantChecker

# Fixtures several test files share, defined next to their helpers in tests/support/.
from tests.support.chart import helm  # noqa: F401  (fixtures)
from tests.support.failover import prefix, replicas  # noqa: F401  (fixtures)
from tests.support.neonvm_manifests import autoscale_scheduler  # noqa: F401  (fixtures)
from tests.support.runner import start_runner, test_guest  # noqa: F401  (fixtures)
from tests.support.runner_scaling import qmp_loop  # noqa: F401  (fixtures)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("NEONVM_TEST_LONG") == "1":
        return
    skip = pytest.mark.skip(reason="long run, opt-in (NEONVM_TEST_LONG=1; see docs/drills.md)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A real local control plane, started once per test session."""
    nodes = int(os.environ.get("NEONVM_TEST_NODES", "2"))
    state_dir = Path(tmp_path_factory.mktemp("cluster"))
    c = LocalCluster(state_dir, ClusterSpec.with_free_ports(nodes=nodes))
    try:
        c.up()
    except Exception:
        c.down()
        raise
    try:
        yield c
    finally:
        c.down()


@pytest.fixture(scope="session")
def api(cluster: LocalCluster) -> Iterator[client.ApiClient]:
    """Admin ApiClient for the session's cluster."""
    a = kube.api_client(cluster.kubeconfig)
    yield a
    a.close()


@pytest.fixture(scope="session")
def controller_api(cluster: LocalCluster) -> Iterator[client.ApiClient]:
    """ApiClient as the controller's identity (the only one the fence lets ungate)."""
    a = kube.api_client(cluster.kubeconfig_for("controller"))
    yield a
    a.close()


@pytest.fixture
def namespace(api: client.ApiClient) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards even when the test fails."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    try:
        # Drop finalizers of leftover VMs so the namespace can go without a controller.
        custom = client.CustomObjectsApi(api)
        vms = custom.list_namespaced_custom_object("vm.neon.tech", "v1", name, "virtualmachines")
        for vm in vms.get("items", []):
            if vm["metadata"].get("finalizers"):
                custom.patch_namespaced_custom_object(
                    "vm.neon.tech", "v1", name, "virtualmachines", vm["metadata"]["name"],
                    {"metadata": {"finalizers": None}},
                )
        core.delete_namespace(name)
    except client.ApiException:
        pass


@pytest.fixture
def held() -> Iterator[list[socket.socket]]:
    sockets: list[socket.socket] = []
    yield sockets
    for sock in sockets:
        sock.close()


@pytest.fixture
def checker(api: client.ApiClient, namespace: str) -> Iterator[InvariantChecker]:
    """Fails the test if any pod list ever showed two live runner pods for one VM."""
    with InvariantChecker(api, namespace, interval=0.02) as c:
        yield c
    assert c.report.samples > 0
    assert c.report.strict == [], f"two live runner pods at once: {c.report.strict}"
