"""Controller replicas as processes on the shared cluster: the ``replicas`` and ``prefix``
fixtures, the leader among them, a VM's status and its one pod."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from neonvm.dev.cluster import LocalCluster
from tests.support import (
    replica_group,
    wait_for,
)
from tests.support.harness import (
    Replica,
    Replicas,
    get_vm,
    runner_pods,
)


@pytest.fixture
def prefix() -> str:
    """A fresh key prefix in the locks' etcd per test (its own locks and epoch floor)."""
    return f"/t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def replicas(cluster: LocalCluster, api: client.ApiClient, namespace: str, prefix: str,
             tmp_path: Path) -> Iterator[Replicas]:
    with replica_group(cluster, api, namespace, tmp_path / "replicas", prefix=prefix,
                       workers=4) as group:
        yield group


def leader_of(replicas: Replicas) -> Replica:
    found = wait_for(replicas.leader, 60, what="a leader")
    assert found is not None
    return found


def vm_status(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    vm = get_vm(api, namespace, name)
    assert vm is not None
    status: dict[str, Any] = vm.get("status") or {}
    return status


def only_pod(api: client.ApiClient, namespace: str, name: str) -> str:
    (pod,) = runner_pods(api, namespace, name)
    return str(pod.metadata.name)
