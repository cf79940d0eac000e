"""Helpers to drive the controller from tests and benchmarks.

* VM manifests (:func:`vm_manifest`) and small read helpers over the admin client;
* :class:`Replica`: one ``neonvm controller run`` as a separate process (its own
  session, its own log file), with SIGKILL / SIGTERM and its exit code;
* :class:`Replicas`: a set of them that is always stopped at the end (context manager).

Nothing here is used by the controller itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm.api import types
from neonvm.dev.replica import controller_argv
from neonvm.leader.etcd import EtcdConfig


def vm_manifest(name: str, *, restart_policy: str | None = None,
                spec: dict[str, Any] | None = None,
                labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A small valid VirtualMachine; ``spec`` entries replace the defaults."""
    body: dict[str, Any] = {
        "guest": {
            "cpus": {"min": 1, "max": 2, "use": 1},
            "memorySlots": {"min": 1, "max": 2, "use": 1},
            "memorySlotSize": "256Mi",
            "rootDisk": {"image": "vm-postgres:15-bullseye", "size": "1Gi"},
        },
    }
    if restart_policy:
        body["restartPolicy"] = restart_policy
    body.update(spec or {})
    meta: dict[str, Any] = {"name": name}
    if labels:
        meta["labels"] = labels
    return {"apiVersion": types.API_VERSION, "kind": types.KIND, "metadata": meta,
            "spec": body}


def create_vm(api: client.ApiClient, namespace: str, name: str, **kwargs: Any) -> dict[str, Any]:
    obj: dict[str, Any] = client.CustomObjectsApi(api).create_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, vm_manifest(name, **kwargs))
    return obj


def get_vm(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        obj: dict[str, Any] = client.CustomObjectsApi(api).get_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return obj


def list_vms(api: client.ApiClient, namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = client.CustomObjectsApi(api).list_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL).get("items") or []
    return items


def delete_vm(api: client.ApiClient, namespace: str, name: str) -> None:
    with contextlib.suppress(ApiException):
        client.CustomObjectsApi(api).delete_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, name)


def runner_pods(api: client.ApiClient, namespace: str, vm: str | None = None) -> list[Any]:
    """Pods labelled for ``vm`` (or for any VM), quorum read."""
    selector = f"{types.LABEL_VM_NAME}={vm}" if vm else types.LABEL_VM_NAME
    items: list[Any] = client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=selector).items
    return items


def is_gated(pod: Any) -> bool:
    return any(g.name == types.SCHEDULING_GATE for g in pod.spec.scheduling_gates or [])


def converged(api: client.ApiClient, namespace: str, names: Sequence[str]) -> bool:
    """Every VM has exactly one pod, ungated, not terminating, named ``status.podName``."""
    pods = runner_pods(api, namespace)
    by_vm: dict[str, list[Any]] = {}
    for p in pods:
        by_vm.setdefault(p.metadata.labels[types.LABEL_VM_NAME], []).append(p)
    for name in names:
        vm = get_vm(api, namespace, name)
        if vm is None:
            return False
        status = vm.get("status") or {}
        mine = by_vm.get(name, [])
        if len(mine) != 1 or status.get("pendingPod"):
            return False
        pod = mine[0]
        if (pod.metadata.name != status.get("podName") or is_gated(pod)
                or pod.metadata.deletion_timestamp is not None):
            return False
    return True


@dataclass
class Replica:
    """One ``neonvm controller run`` process."""

    name: str
    identity: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> Replica:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def kill(self) -> None:
        """SIGKILL (no clean-up at all: locks and Lease stay until they expire)."""
        if self.running():
            assert self.process is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM and wait (graceful: workers stop, locks and the Lease are released)."""
        if self.running():
            assert self.process is not None
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.exit_code()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class Replicas:
    """Controller replicas as separate processes; every one is stopped on exit."""

    api: client.ApiClient
    """Admin client, to read the Lease."""
    kubeconfig: Path
    etcd_endpoints: str | EtcdConfig
    """Endpoints, or a whole config (TLS files and prefix: see ``controller_argv``)."""
    lease_namespace: str
    log_dir: Path
    lease_name: str = "neonvm-controller"
    extra_args: Sequence[str] = ()
    members: list[Replica] = field(default_factory=list)

    def start(self, name: str, *, faults: str = "", args: Sequence[str] = (),
              env: dict[str, str] | None = None) -> Replica:
        identity = f"{name}_{os.urandom(3).hex()}"
        argv = controller_argv(
            kubeconfig=str(self.kubeconfig), etcd_endpoints=self.etcd_endpoints,
            identity=identity, lease_namespace=self.lease_namespace, health_host="127.0.0.1",
            extra=(*self.extra_args, *args))
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_FAULTS")}
        full_env.update(env or {})
        if faults:
            full_env["NEONVM_FAULTS"] = faults
        replica = Replica(name, identity, argv, full_env,
                          self.log_dir / f"{name}.log").start()
        self.members.append(replica)
        return replica

    def leader(self) -> Replica | None:
        """The member whose identity the Lease names (None: nobody, or not one of ours)."""
        try:
            lease = client.CoordinationV1Api(self.api).read_namespaced_lease(
                self.lease_name, self.lease_namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        holder = lease.spec.holder_identity
        return next((r for r in self.members if r.identity == holder and r.running()), None)

    def stop_all(self) -> None:
        for r in self.members:
            r.kill()

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.members)
