"""Where a drill runs, and the faults it can inject there.

Two targets:

* :class:`LocalTarget`: the local control plane of a state directory (``neonvm dev``).
  Controller replicas are processes the cluster records (``controller-<i>``, started with
  :func:`neonvm.dev.replica.local_replica_argv`), so a drill can SIGKILL, SIGTERM, SIGSTOP and
  SIGCONT them, restart them with fault injection, and restart etcd, the locks' etcd and
  the API server. Playing the kubelet, it restarts a replica that died.
* :class:`KubeTarget`: a cluster reached by kubeconfig, with the controller deployed by
  the chart. Killing the leader deletes its pod (grace 0 for KILL: the old process may
  outlive its pod object for a moment, which is the zombie-leader case the fence is for;
  the chart's grace period for TERM). Pausing it runs a short privileged ``hostPID`` pod
  on the leader's node that sends SIGSTOP or SIGCONT to the process whose environment has
  ``POD_NAME=<leader pod>`` (a signal from inside the container would be ignored: the
  controller is PID 1 of its namespace). Component restarts are not possible there.
  ``neonvm drill --state-dir DIR --pods`` makes one for the chart installed on the local
  cluster's real node (:mod:`neonvm.dev.chartnode`), reading locks from that cluster's
  locks etcd.

Both find the leader from the Lease: its ``holderIdentity`` names the process (local: the
``--identity`` on the replica's command line; chart: ``<pod name>_<random>``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm import kube
from neonvm.dev.replica import (
    DEMO_TIMINGS,
    DEV_RUNNER_IMAGE,
    LEASE_NAMESPACE,
    controller_argv,
    local_replica_argv,
    replica_env,
)
from neonvm.drills.check import LockReader, LockView, etcd_lock_reader
from neonvm.leader.election import DEFAULT_LEASE_NAME, DEFAULT_NAMESPACE, LeaseClient
from neonvm.leader.etcd import EtcdConfig

Progress = Callable[[str], None]


class DrillError(RuntimeError):
    """A drill cannot run as asked (wrong target, missing access); one line for the CLI."""


@dataclass(frozen=True)
class Route:
    """How one replica reaches its servers when not directly: a kubeconfig naming another
    API server address and the locks' etcd config with other endpoints (the
    infrastructure drills' proxies, :mod:`neonvm.drills.infra`)."""

    kubeconfig: Path
    etcd: EtcdConfig


@dataclass(frozen=True)
class LeaderInfo:
    identity: str
    epoch: int
    renew_time: str | None


class Target(Protocol):
    """What a drill needs from where it runs."""

    api: client.ApiClient
    local: bool
    lease_namespace: str
    lease_name: str

    @property
    def description(self) -> str: ...

    def leader(self) -> LeaderInfo | None: ...

    def signal_leader(self, identity: str, sig: signal.Signals) -> None: ...

    def heal(self) -> list[str]:
        """Bring dead replicas back (what a kubelet or Deployment would do)."""
        ...

    def lock_reader(self) -> LockReader | None: ...

    def break_locks(self, namespace: str) -> list[LockView]: ...

    def close(self) -> None: ...


def read_leader(api: client.ApiClient, namespace: str, name: str) -> LeaderInfo | None:
    record = LeaseClient(api, namespace, name).get(10.0)
    if record is None or not record.holder:
        return None
    return LeaderInfo(record.holder, record.transitions, record.renew_time)


def _break_locks(endpoints: str | EtcdConfig | None, prefix: str | None, namespace: str
                 ) -> list[LockView]:
    """``neonvm locks break --force`` for every lock of ``namespace``."""
    from neonvm.leader.etcd import Etcd
    from neonvm.leader.lock import LockTable

    config = endpoints if isinstance(endpoints, EtcdConfig) else EtcdConfig.from_env()
    overrides: dict[str, Any] = {}
    if endpoints and not isinstance(endpoints, EtcdConfig):
        overrides["endpoints"] = endpoints
    if prefix:
        overrides["prefix"] = prefix
    config = config.with_overrides(**overrides) if overrides else config
    broken = []
    with Etcd(config) as etcd:
        table = LockTable(etcd, config.prefix)
        for info in table.list(namespace):
            gone = table.break_lock(info.namespace, info.name)
            if gone is not None:
                broken.append(LockView(gone.namespace, gone.name,
                                       gone.record.vm_uid if gone.record else None,
                                       gone.record.holder if gone.record else None, gone.token))
    return broken


def restart_component(cluster: Any, name: str, sig: signal.Signals = signal.SIGTERM,
                      timeout: float = 120.0) -> float:
    """Stop a local control-plane component with ``sig`` and start it again.

    SIGTERM is an operator's restart (kube-apiserver drains for up to 20 s before it is
    killed), SIGKILL a crash. Waits for the ports to be released (a killed process's
    sockets outlive its pid for a moment) and for the component to be healthy. Returns
    the seconds it was unavailable.
    """
    started = time.monotonic()
    cluster.stop_component(name, sig)
    cluster.start_component(name, timeout=timeout)
    return time.monotonic() - started


# ---- the local control plane ---------------------------------------------------------------


@dataclass
class LocalTarget:
    """The local control plane of ``cluster`` with ``replicas`` controller processes."""

    cluster: Any
    """A :class:`neonvm.dev.cluster.LocalCluster` (Any: keeps this import light)."""
    replicas: int
    api: client.ApiClient
    lease_namespace: str = DEFAULT_NAMESPACE
    lease_name: str = DEFAULT_LEASE_NAME
    local: bool = True
    started: list[str] = field(default_factory=list)
    faults: dict[int, str] = field(default_factory=dict)
    """Replica index -> fault spec it runs with (empty: none)."""
    routes: dict[int, Route] = field(default_factory=dict)
    """Replica index -> the proxies it reaches its servers through (empty: direct)."""

    @property
    def description(self) -> str:
        return f"local control plane in {self.cluster.state_dir}"

    @classmethod
    def prepare(cls, state_dir: Path | None, replicas: int, progress: Progress
                ) -> LocalTarget:
        """Start what is not running: the control plane (with nodes) and the replicas."""
        from neonvm.dev.binaries import install_binaries
        from neonvm.dev.cluster import ClusterSpec, LocalCluster

        cluster = LocalCluster(state_dir)
        saved = (cluster.state_dir / "cluster.json").exists()
        healthy = saved and all(s.healthy for s in cluster.status())
        started: list[str] = []
        if not healthy:
            spec = cluster.spec if saved else ClusterSpec.with_free_ports(nodes=3)
            if spec.nodes == 0:
                spec.nodes = 3
            cluster = LocalCluster(state_dir, spec)
            install_binaries(with_nodes=True)
            progress(f"starting the local control plane in {cluster.state_dir}")
            cluster.up(progress=progress)
            started.append("control plane")
        elif cluster.spec.nodes == 0:
            progress("note: this cluster has no simulated nodes: pods never run, so "
                     "terminating pods are not exercised")
        target = cls(cluster, replicas, kube.api_client(cluster.kubeconfig), started=started)
        started += target.heal()
        return target

    # ---- replicas ----------------------------------------------------------------------

    @staticmethod
    def replica_name(index: int) -> str:
        return f"controller-{index}"

    def _binary(self) -> str:
        return Path(sys.executable).name

    def replica_alive(self, index: int) -> bool:
        alive: bool = self.cluster.process_alive(self.replica_name(index), self._binary())
        return alive

    def _argv(self, index: int) -> list[str]:
        route = self.routes.get(index)
        if route is None:
            return local_replica_argv(self.cluster, index, self.faults.get(index, ""))
        return controller_argv(
            kubeconfig=str(route.kubeconfig), etcd_endpoints=route.etcd,
            identity=f"replica-{index}-{int(time.time() * 1000) % 100000}",
            extra=(*DEMO_TIMINGS, "--runner-image", DEV_RUNNER_IMAGE),
            faults=self.faults.get(index, ""))

    def restart_replica(self, index: int, sig: signal.Signals = signal.SIGTERM) -> int:
        """Stop replica ``index`` (SIGTERM: it releases what it holds) and start it with
        its current route and faults."""
        self.cluster.stop_component(self.replica_name(index), sig)
        return self.start_replica(index)

    @staticmethod
    def index_of(identity: str) -> int | None:
        """The replica index in a local identity (``replica-<i>-<stamp>``)."""
        parts = identity.split("-")
        if len(parts) >= 3 and parts[0] == "replica" and parts[1].isdigit():
            return int(parts[1])
        return None

    def start_replica(self, index: int) -> int:
        pid: int = self.cluster.start_process(self.replica_name(index), self._argv(index),
                                              replica_env())
        return pid

    def heal(self) -> list[str]:
        with contextlib.suppress(ApiException):
            client.CoreV1Api(self.api).create_namespace(
                client.V1Namespace(metadata=client.V1ObjectMeta(name=LEASE_NAMESPACE)))
        healed = []
        for i in range(self.replicas):
            if not self.replica_alive(i):
                self.start_replica(i)
                healed.append(self.replica_name(i))
        return healed

    def restart_replicas(self, faults: str | None) -> None:
        """Stop every replica, then start them all with ``faults`` (None: no faults)."""
        for i in range(self.replicas):
            self.cluster.stop_component(self.replica_name(i), signal.SIGKILL)
        self.faults = {i: faults for i in range(self.replicas)} if faults else {}
        for i in range(self.replicas):
            self.start_replica(i)

    def pid_of(self, identity: str) -> int | None:
        """The replica process whose ``--identity`` is ``identity``."""
        for pid_file in sorted((self.cluster.state_dir / "run").glob("*.pid")):
            try:
                pid = int(pid_file.read_text())
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except (OSError, ValueError):
                continue
            for flag, value in itertools.pairwise(argv):
                if flag == b"--identity" and value.decode() == identity:
                    return pid
        return None

    # ---- faults ------------------------------------------------------------------------

    def leader(self) -> LeaderInfo | None:
        return read_leader(self.api, self.lease_namespace, self.lease_name)

    def signal_leader(self, identity: str, sig: signal.Signals) -> None:
        pid = self.pid_of(identity)
        if pid is None:
            raise DrillError(f"no local replica process has identity {identity} (is the "
                             f"leader a replica of another cluster or test?)")
        os.kill(pid, sig)

    def restart_component(self, name: str, sig: signal.Signals = signal.SIGTERM) -> float:
        """Stop and start one control-plane component; seconds until it is healthy."""
        return restart_component(self.cluster, name, sig)

    def lock_reader(self) -> LockReader | None:
        return etcd_lock_reader(self.cluster.locks_etcd_config())

    def break_locks(self, namespace: str) -> list[LockView]:
        return _break_locks(self.cluster.locks_etcd_config(), None, namespace)

    def close(self) -> None:
        self.api.close()


# ---- a cluster reached by kubeconfig ---------------------------------------------------------


@dataclass
class KubeTarget:
    """A real cluster running the chart's Deployment (see the module docstring)."""

    api: client.ApiClient
    kubeconfig: Path
    lease_namespace: str = DEFAULT_NAMESPACE
    lease_name: str = DEFAULT_LEASE_NAME
    helper_image: str = "busybox:1.36"
    local: bool = False
    etcd_endpoints: str | EtcdConfig | None = None
    """The locks' etcd as this machine reaches it, or a whole config (None:
    ``$NEONVM_ETCD_*``)."""
    same_host: bool = False
    """The pods' processes run on this machine (the local cluster's real node): KILL,
    STOP and CONT go straight to the leader container's processes (found by
    ``POD_NAME=<pod>`` in their environment), so KILL is a crash of the container (the
    kubelet restarts it in the same pod). Deleting the pod, even with grace 0, is not a
    crash: the kubelet still sends SIGTERM first and SIGKILL 2 s later."""

    @property
    def description(self) -> str:
        return f"chart's controller pods in the cluster of {self.kubeconfig}"

    def leader(self) -> LeaderInfo | None:
        return read_leader(self.api, self.lease_namespace, self.lease_name)

    def _pod_of(self, identity: str) -> Any:
        name = identity.rsplit("_", 1)[0]
        try:
            return client.CoreV1Api(self.api).read_namespaced_pod(name, self.lease_namespace)
        except ApiException as exc:
            if exc.status == 404:
                raise DrillError(f"leader {identity}: no pod {self.lease_namespace}/{name} "
                                 f"(is the controller deployed by the chart?)") from None
            raise

    def signal_leader(self, identity: str, sig: signal.Signals) -> None:
        pod = self._pod_of(identity)
        core = client.CoreV1Api(self.api)
        if self.same_host and sig != signal.SIGTERM:
            pids = pod_pids(pod.metadata.name)
            if not pids:
                raise DrillError(f"no process of pod {pod.metadata.name} on this machine")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            return
        if sig in (signal.SIGKILL, signal.SIGTERM):
            grace = 0 if sig == signal.SIGKILL else None
            core.delete_namespaced_pod(
                pod.metadata.name, self.lease_namespace,
                body=client.V1DeleteOptions(grace_period_seconds=grace,
                                            preconditions=client.V1Preconditions(
                                                uid=pod.metadata.uid)))
            return
        self._signal_on_node(pod, sig)

    def _signal_on_node(self, pod: Any, sig: signal.Signals) -> None:
        """SIGSTOP/SIGCONT the leader's process from a hostPID pod on its node."""
        core = client.CoreV1Api(self.api)
        name = f"neonvm-drill-signal-{uuid.uuid4().hex[:6]}"
        script = (
            "n=0; for d in /proc/[0-9]*; do "
            f"if tr '\\0' '\\n' < $d/environ 2>/dev/null | grep -qx 'POD_NAME={pod.metadata.name}';"
            f" then kill -{sig.name.removeprefix('SIG')} ${{d#/proc/}} && n=$((n+1)); fi; done; "
            "echo signalled $n; [ $n -gt 0 ]")
        body = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": self.lease_namespace},
            "spec": {
                "nodeName": pod.spec.node_name, "hostPID": True, "restartPolicy": "Never",
                "tolerations": [{"operator": "Exists"}],
                "containers": [{"name": "signal", "image": self.helper_image,
                                "command": ["sh", "-c", script],
                                "securityContext": {"privileged": True}}],
            },
        }
        core.create_namespaced_pod(self.lease_namespace, body)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                phase = core.read_namespaced_pod(name, self.lease_namespace).status.phase
                if phase == "Succeeded":
                    return
                if phase == "Failed":
                    raise DrillError(f"could not {sig.name} the leader's process on node "
                                     f"{pod.spec.node_name} (helper pod {name} failed)")
                time.sleep(0.5)
            raise DrillError(f"helper pod {name} did not finish within 120s")
        finally:
            with contextlib.suppress(ApiException):
                core.delete_namespaced_pod(name, self.lease_namespace, grace_period_seconds=0)

    def heal(self) -> list[str]:
        return []  # the Deployment restarts pods

    def lock_reader(self) -> LockReader | None:
        return etcd_lock_reader(self.etcd_endpoints)

    def break_locks(self, namespace: str) -> list[LockView]:
        if self.etcd_endpoints:
            return _break_locks(self.etcd_endpoints, None, namespace)
        if not os.environ.get("NEONVM_ETCD_ENDPOINTS", "").strip():
            raise DrillError("break-lock needs the locks' etcd: set NEONVM_ETCD_ENDPOINTS "
                             "(and NEONVM_ETCD_CA/CERT/KEY if it uses TLS)")
        return _break_locks(None, None, namespace)

    def close(self) -> None:
        self.api.close()


def pod_pids(pod_name: str) -> list[int]:
    """Processes on this machine whose environment has ``POD_NAME=<pod_name>`` (the chart
    sets it in the controller container)."""
    marker = f"POD_NAME={pod_name}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in env:
            pids.append(int(proc.name))
    return pids


@contextlib.contextmanager
def leader_tracker(target: Target, interval: float = 0.1) -> Iterator[LeaderLog]:
    """Polls the Lease in the background; yields the log of leader changes."""
    log = LeaderLog()
    import threading

    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            try:
                log.record(target.leader())
            except Exception:  # API server restarts are part of some drills
                log.errors += 1
            stop.wait(interval)

    thread = threading.Thread(target=run, name="leader-tracker", daemon=True)
    thread.start()
    try:
        yield log
    finally:
        stop.set()
        thread.join(timeout=5)


@dataclass
class LeaderLog:
    """Leader changes seen by polling the Lease: (monotonic time, identity, epoch)."""

    changes: list[tuple[float, str | None, int | None]] = field(default_factory=list)
    errors: int = 0

    def record(self, info: LeaderInfo | None) -> None:
        who = info.identity if info else None
        epoch = info.epoch if info else None
        if not self.changes or self.changes[-1][1:] != (who, epoch):
            self.changes.append((time.monotonic(), who, epoch))

    @property
    def current(self) -> tuple[str | None, int | None]:
        return self.changes[-1][1:] if self.changes else (None, None)

    def first_other_than(self, identity: str, since: float) -> tuple[float, str] | None:
        """When a leader other than ``identity`` was first seen after ``since``."""
        for at, who, _epoch in self.changes:
            if at >= since and who and who != identity:
                return at, who
        return None
