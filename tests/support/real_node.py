"""Real-node tests: why one is skipped, a node started with its images, its pods' events."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import Any

from kubernetes import client

from neonvm.dev import realnode
from neonvm.dev.cluster import LocalCluster


def _skip_reason(default: bool = False) -> str | None:
    """Why a real-node test does not run here, or None. ``default`` tests run unless
    ``NEONVM_TEST_REAL_NODE=0``, but only on binaries already built (a cold build takes
    many minutes; the test command builds them first); the others need ``=1``."""
    wanted = os.environ.get("NEONVM_TEST_REAL_NODE")
    if wanted == "0":
        return "real node turned off (NEONVM_TEST_REAL_NODE=0)"
    if wanted != "1" and not default:
        return "real node not requested (set NEONVM_TEST_REAL_NODE=1; see docs/real-node.md)"
    problem = realnode.unavailable_reason()
    if problem:
        return f"a real node cannot start on this host: {problem}"
    if wanted != "1" and not realnode.built():
        return ("the real node's binaries are not built (bash scripts/test.sh or "
                "neonvm dev install --real-nodes builds them)")
    return None


def _images_skip_reason(default: bool = False) -> str | None:
    from neonvm.dev import images

    reason = _skip_reason(default)
    if reason:
        return reason
    problem = images.unavailable_reason()
    return f"images cannot be built here: {problem}" if problem else None


def _started_node_with_images(cluster: LocalCluster,
                              names: tuple[str, ...]) -> tuple[realnode.RealNode, list[str]]:
    """Build the images (cached after the first time), start a real node and import
    their OCI archives into its containerd, as `ctr images import` does."""
    from neonvm.controller import podspec
    from neonvm.dev import images

    realnode.build()
    built = images.build(names)
    if "runner" in names:
        assert podspec.DEFAULT_RUNNER_IMAGE in [b.reference for b in built]
    node = realnode.RealNode(cluster, 0)
    node.start()
    for image in built:
        node.ctr("images", "import", "--platform", "linux/amd64", str(image.archive),
                 timeout=600)
        assert image.reference in node.ctr("images", "ls", "-q").split()
    return node, [b.reference for b in built]


def _print_pods_and_events(cluster: LocalCluster, namespace: str) -> None:
    """What kubectl shows (printed; pytest shows it when the test failed)."""
    for args in (["get", "pods", "-o", "wide"], ["get", "events", "--sort-by=.lastTimestamp"],
                 ["get", "neonvm", "-o", "yaml"]):
        out = subprocess.run(["kubectl", "--kubeconfig", str(cluster.kubeconfig), "-n",
                              namespace, *args], capture_output=True, text=True, timeout=60)
        print(f"---- kubectl {' '.join(args)} ----\n{out.stdout[-6000:]}{out.stderr[-2000:]}")


class _PodEvents:
    """Every watch event of a VM's pods, in the API server's order (resourceVersion):
    enough to tell whether a replacement was ungated before the old pod was gone."""

    def __init__(self, api: client.ApiClient, namespace: str, vm: str) -> None:
        from kubernetes import watch

        from neonvm.api import types

        self.events: list[tuple[str, str, bool, float]] = []
        self._watch = watch.Watch()
        self._core = client.CoreV1Api(api)
        self._args = (namespace, f"{types.LABEL_VM_NAME}={vm}")
        self._gate = types.SCHEDULING_GATE
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        namespace, selector = self._args
        try:
            for event in self._watch.stream(self._core.list_namespaced_pod, namespace,
                                            label_selector=selector, timeout_seconds=1800):
                pod = event["object"]
                gated = any(g.name == self._gate for g in pod.spec.scheduling_gates or [])
                self.events.append((event["type"], pod.metadata.name, gated,
                                    time.monotonic()))
        except Exception as exc:  # the stream ends when the test stops it or the cluster goes
            self.events.append(("ERROR", repr(exc), True, time.monotonic()))

    def stop(self) -> None:
        self._watch.stop()

    def first(self, predicate: Any) -> int | None:
        return next((i for i, e in enumerate(list(self.events)) if predicate(e)), None)
