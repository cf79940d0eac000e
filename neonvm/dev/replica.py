"""How a controller replica is started as its own process: the one place that writes the
``neonvm controller run`` command line.

Used by ``neonvm demo``, the drills' local target, the fault campaign and the tests'
harness (``tests/support/harness.py``). It lives under :mod:`neonvm.dev` so that the
CLI may import it; like all of ``neonvm/``, it imports nothing from ``tests/``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from neonvm.leader.election import DEFAULT_NAMESPACE as LEASE_NAMESPACE
from neonvm.leader.etcd import EtcdConfig

if TYPE_CHECKING:
    from neonvm.dev.cluster import LocalCluster

__all__ = ["DEMO_TIMINGS", "DEV_RUNNER_IMAGE", "LEASE_NAMESPACE", "controller_argv",
           "local_replica_argv", "replica_env"]

DEV_RUNNER_IMAGE = "neonvm-runner:dev"

DEMO_TIMINGS = ("--lease-duration", "6", "--renew-deadline", "4", "--retry-period", "1",
                "--session-ttl", "6")
"""Shorter than the defaults, so a killed leader is replaced within seconds."""

ALLOCATOR_ENV = {"MALLOC_ARENA_MAX": "2"}
"""The allocator setting the chart's Deployment and the controller image run the
controller with (docs/reconciler.md says why)."""


def replica_env() -> dict[str, str]:
    """A local replica's whole environment: :data:`ALLOCATOR_ENV`, as in the chart, and
    ``PYTHONPATH`` naming the directory of the ``neonvm`` package this process runs, so the
    replicas run the same code as their starter (a worktree's, not the checkout an editable
    install points at)."""
    import neonvm

    return {**ALLOCATOR_ENV,
            "PYTHONPATH": str(Path(neonvm.__file__).resolve().parent.parent)}


def controller_argv(*, kubeconfig: str, etcd_endpoints: str | EtcdConfig, identity: str,
                    lease_namespace: str | None = None, watch_namespace: str | None = None,
                    etcd_prefix: str | None = None, health_host: str | None = None,
                    runner_image: str | None = None, faults: str = "",
                    extra: Sequence[str] = ()) -> list[str]:
    """The command line of one ``neonvm controller run`` in this Python, logging JSON, its
    health endpoint on a free port. An option left at None is not passed (the
    controller's default applies); ``faults`` non-empty adds ``--fault``; ``extra`` comes
    last. ``etcd_endpoints`` may be a whole :class:`EtcdConfig` (TLS files and prefix
    too: the local cluster's locks etcd wants a client certificate)."""
    tls: list[str] = []
    if isinstance(etcd_endpoints, EtcdConfig):
        config = etcd_endpoints
        etcd_endpoints = ",".join(config.endpoints)
        etcd_prefix = config.prefix if etcd_prefix is None else etcd_prefix
        for flag, path in (("--etcd-ca", config.ca), ("--etcd-cert", config.cert),
                           ("--etcd-key", config.key)):
            if path is not None:
                tls += [flag, str(path)]
    argv = [sys.executable, "-m", "neonvm", "--log-format", "json", "controller", "run",
            "--kubeconfig", kubeconfig, "--etcd-endpoints", etcd_endpoints, *tls]
    if etcd_prefix is not None:
        argv += ["--etcd-prefix", etcd_prefix]
    argv += ["--identity", identity, "--health-port", "0"]
    if health_host is not None:
        argv += ["--health-host", health_host]
    if lease_namespace is not None:
        argv += ["--lease-namespace", lease_namespace]
    if watch_namespace is not None:
        argv += ["--watch-namespace", watch_namespace]
    if runner_image is not None:
        argv += ["--runner-image", runner_image]
    argv += list(extra)
    return argv + (["--fault", faults] if faults else [])


def local_replica_argv(cluster: LocalCluster, index: int, faults: str = "") -> list[str]:
    """Replica ``index`` of the demo and of the drills' local target: the controller
    identity's kubeconfig, the cluster's locks etcd, the demo's lease timings; it
    campaigns in the default Lease namespace (``LEASE_NAMESPACE``)."""
    return controller_argv(
        kubeconfig=str(cluster.kubeconfig_for("controller")),
        etcd_endpoints=cluster.locks_etcd_config(),
        identity=f"replica-{index}-{int(time.time() * 1000) % 100000}",
        extra=(*DEMO_TIMINGS, "--runner-image", DEV_RUNNER_IMAGE),
        faults=faults)
