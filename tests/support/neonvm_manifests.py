"""The autoscale scheduler fixture of the NeonVM manifests' tests."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from neonvm.dev.cluster import LocalCluster, free_port

SCHEDULER = "autoscale-scheduler"


@pytest.fixture(scope="module")
def autoscale_scheduler(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
                        ) -> Iterator[str]:
    """A kube-scheduler whose one profile is named ``autoscale-scheduler``."""
    if cluster.spec.nodes == 0:
        pytest.skip("needs simulated nodes (NEONVM_TEST_NODES > 0)")
    work = tmp_path_factory.mktemp("autoscale-scheduler")
    kubeconfig = cluster.kubeconfig_for("scheduler")
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump({
        "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": SCHEDULER}]}))
    binary = next(Path(os.path.expanduser("~/.cache/neonvm/bin")).glob(
        "kubernetes-*/kube-scheduler"))
    name = f"autoscale-scheduler-{uuid.uuid4().hex[:6]}"
    pid = cluster.start_process(name, [
        str(binary), f"--config={config}", f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}", "--bind-address=127.0.0.1",
        f"--secure-port={free_port()}", f"--cert-dir={work / 'serving'}", "--v=1"], {})
    try:
        yield SCHEDULER
    finally:
        os.kill(pid, signal.SIGTERM)
