"""A fleet of VMs in one namespace: create, watch converge, delete, prove clean-up.

Convergence is judged from two quorum lists (pods, then VMs): a VM has converged when it
has exactly one runner pod, that pod is ``status.podName``, ungated, not terminating, and
no plan is pending. It is the invariant's second clause, "once faults stop", and says
nothing about safety (the checkers do that).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm.api import types

Progress = Callable[[str], None]
T = TypeVar("T")

TRANSIENT_STATUS = (0, 429, 500, 502, 503, 504)


def transient(exc: BaseException) -> bool:
    """A failure that a restart of the API server or of an etcd explains."""
    from urllib3.exceptions import HTTPError

    from neonvm.leader.etcd import EtcdUnavailable

    if isinstance(exc, ApiException):
        return exc.status in TRANSIENT_STATUS
    return isinstance(exc, OSError | HTTPError | EtcdUnavailable)


def retrying(fn: Callable[[], T], timeout: float = 120.0) -> T:
    """``fn()``, retried while it fails transiently (drills restart the API server)."""
    deadline = time.monotonic() + timeout
    delay = 0.2
    while True:
        try:
            return fn()
        except Exception as exc:
            if not transient(exc) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(2.0, delay * 2)


def _quiet(_msg: str) -> None:
    return None


def vm_body(name: str, grace_seconds: int | None = 1,
            labels: dict[str, str] | None = None,
            spec_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A small VM (1 CPU, one 256Mi slot) whose runner pod shuts down within ``grace``.
    ``spec_extra`` is merged into the spec (``guest`` key by key): a node selector and a
    real guest put the runner pods on a real node (see docs/real-node.md)."""
    spec: dict[str, Any] = {
        "guest": {
            "cpus": {"min": 1, "max": 1, "use": 1},
            "memorySlots": {"min": 1, "max": 1, "use": 1},
            "memorySlotSize": "256Mi",
            "rootDisk": {"image": "vm-postgres:15-bullseye", "size": "1Gi"},
        },
        "restartPolicy": "Always",
    }
    if grace_seconds is not None:
        spec["terminationGracePeriodSeconds"] = grace_seconds
    for key, value in (spec_extra or {}).items():
        spec[key] = {**spec["guest"], **value} if key == "guest" else value
    meta: dict[str, Any] = {"name": name, "labels": {"drill.vm.neon.tech/member": "true",
                                                     **(labels or {})}}
    return {"apiVersion": types.API_VERSION, "kind": types.KIND, "metadata": meta,
            "spec": spec}


def ensure_namespace(api: client.ApiClient, name: str) -> None:
    with contextlib.suppress(ApiException):
        retrying(lambda: client.CoreV1Api(api).create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(
                name=name, labels={"drill.vm.neon.tech/namespace": "true"}))))


def create_vms(api: client.ApiClient, namespace: str, names: Sequence[str],
               grace_seconds: int | None = 1, threads: int = 8,
               spec_extra: dict[str, Any] | None = None) -> None:
    custom = client.CustomObjectsApi(api)

    def one(name: str) -> None:
        try:
            retrying(lambda: custom.create_namespaced_custom_object(
                types.GROUP, types.VERSION, namespace, types.PLURAL,
                vm_body(name, grace_seconds, spec_extra=spec_extra), _request_timeout=30))
        except ApiException as exc:
            if exc.status != 409:
                raise

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(names)))) as pool:
        list(pool.map(one, names))


def list_vms(api: client.ApiClient, namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = retrying(
        lambda: client.CustomObjectsApi(api).list_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, _request_timeout=30)
    ).get("items") or []
    return items


def list_runner_pods(api: client.ApiClient, namespace: str) -> list[Any]:
    items: list[Any] = retrying(lambda: client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=types.LABEL_VM_NAME, _request_timeout=30)).items
    return items


@dataclass
class Convergence:
    total: int
    converged: list[str] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)
    """VM -> why it has not converged yet."""

    @property
    def done(self) -> bool:
        return len(self.converged) == self.total and not self.waiting


def convergence(api: client.ApiClient, namespace: str,
                names: Sequence[str] | None = None) -> Convergence:
    """Which VMs have converged (pods listed before the VMs are read)."""
    pods = list_runner_pods(api, namespace)
    vms = list_vms(api, namespace)
    wanted = set(names) if names is not None else {v["metadata"]["name"] for v in vms}
    by_vm: dict[str, list[Any]] = {}
    for p in pods:
        by_vm.setdefault((p.metadata.labels or {}).get(types.LABEL_VM_NAME, ""), []).append(p)
    state = Convergence(total=len(wanted))
    found = set()
    for vm in vms:
        name = vm["metadata"]["name"]
        if name not in wanted:
            continue
        found.add(name)
        status = vm.get("status") or {}
        mine = by_vm.get(name, [])
        why = ""
        if status.get("pendingPod"):
            why = f"plan {status['pendingPod'].get('name')} pending"
        elif len(mine) != 1:
            why = f"{len(mine)} pods"
        else:
            pod = mine[0]
            gated = any(g.name == types.SCHEDULING_GATE for g in pod.spec.scheduling_gates or [])
            if pod.metadata.name != status.get("podName"):
                why = f"pod {pod.metadata.name} is not status.podName {status.get('podName')}"
            elif gated:
                why = "pod gated"
            elif pod.metadata.deletion_timestamp is not None:
                why = "pod terminating"
        if why:
            state.waiting[name] = why
        else:
            state.converged.append(name)
    for name in wanted - found:
        state.waiting[name] = "VM missing"
    return state


def wait_converged(api: client.ApiClient, namespace: str, names: Sequence[str] | None,
                   timeout: float, progress: Progress = _quiet,
                   interval: float = 0.5) -> tuple[bool, float, Convergence]:
    """Poll until every VM converged; (converged, seconds, last state)."""
    started = time.monotonic()
    last_said = 0.0
    state = Convergence(total=len(names or []))
    while True:
        try:
            state = convergence(api, namespace, names)
        except Exception as exc:
            if not transient(exc):
                raise
            state.waiting = {"(api)": str(exc)[:80]}
        elapsed = time.monotonic() - started
        if state.done:
            return True, elapsed, state
        if elapsed > timeout:
            return False, elapsed, state
        if elapsed - last_said >= 5.0:
            last_said = elapsed
            sample = ", ".join(f"{k}: {v}" for k, v in list(state.waiting.items())[:3])
            progress(f"converging: {len(state.converged)}/{state.total} "
                     f"({elapsed:.0f}s; {sample})")
        time.sleep(interval)


def delete_vms(api: client.ApiClient, namespace: str, names: Sequence[str] | None = None,
               threads: int = 8) -> None:
    custom = client.CustomObjectsApi(api)
    targets = list(names) if names is not None else [
        v["metadata"]["name"] for v in list_vms(api, namespace)]

    def one(name: str) -> None:
        with contextlib.suppress(ApiException):
            retrying(lambda: custom.delete_namespaced_custom_object(
                types.GROUP, types.VERSION, namespace, types.PLURAL, name,
                _request_timeout=30))

    if targets:
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(targets)))) as pool:
            list(pool.map(one, targets))


def wait_gone(api: client.ApiClient, namespace: str, timeout: float,
              progress: Progress = _quiet) -> tuple[bool, float, str]:
    """Until the namespace holds no VMs and no runner pods; (gone, seconds, what is left)."""
    started = time.monotonic()
    left = ""
    while time.monotonic() - started <= timeout:
        try:
            vms = list_vms(api, namespace)
            pods = list_runner_pods(api, namespace)
        except Exception as exc:
            if not transient(exc):
                raise
            left = str(exc)[:80]
            time.sleep(0.5)
            continue
        if not vms and not pods:
            return True, time.monotonic() - started, ""
        left = f"{len(vms)} VMs, {len(pods)} runner pods"
        time.sleep(0.5)
    progress(f"not cleaned up after {timeout:.0f}s: {left}")
    return False, time.monotonic() - started, left


def wait_namespace_gone(api: client.ApiClient, namespace: str, timeout: float) -> bool:
    """Wait until ``namespace`` no longer exists; False if it still does at ``timeout``."""
    core = client.CoreV1Api(api)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            core.read_namespace(namespace, _request_timeout=10)
        except ApiException as exc:
            if exc.status == 404:
                return True
        time.sleep(1.0)
    return False


def drop_namespace(api: client.ApiClient, namespace: str) -> None:
    """Delete the namespace; strip VM finalizers first (no controller may be left)."""
    custom = client.CustomObjectsApi(api)
    with contextlib.suppress(ApiException):
        for vm in list_vms(api, namespace):
            if vm["metadata"].get("finalizers"):
                custom.patch_namespaced_custom_object(
                    types.GROUP, types.VERSION, namespace, types.PLURAL,
                    vm["metadata"]["name"], {"metadata": {"finalizers": None}})
    with contextlib.suppress(ApiException):
        client.CoreV1Api(api).delete_namespace(namespace)
