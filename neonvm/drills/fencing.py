"""Self-fencing drills on two real kubelet nodes (issue 32; docs/drills.md, "Self-fencing
drills on real nodes").

A VM's runner pod boots its guest under QEMU on one real node; the drill then fails that
node and the VM must come back on the other one, never with two guests running, as
counted by :mod:`neonvm.drills.guests` from the host's processes:

* ``power-off``: the node's kubelet, containerd, shims and every pod process (runners,
  QEMU) SIGSTOPped at once, the pods' network cut; once the replacement's guest runs,
  the node's pod processes are SIGKILLed (a powered-off node keeps nothing), then the
  kubelet and containerd are continued (the node boots again, empty);
* ``partition``: the kubelet SIGSTOPped (it reaches nobody) and the node's pods' network
  cut, runners and QEMU left running: each runner must kill its guest at its deadline;
* ``kubelet-crash``: the kubelet SIGKILLed and kept down for longer than the node's
  grace and the right's bound; runners still renew: nothing may be replaced;
* ``freeze-thaw``: as power-off, but at the end everything is continued (QEMU first,
  the worst order): how long the old guest runs after the thaw is measured.

Each under a SIGKILL of the leader at a random moment. The controller replicas are
local processes serving rights on loopback; :class:`RightsProxy` plays kube-proxy for
the rights Service: it forwards the runners' asks to the address the leader wrote in
the Service's EndpointSlice (``--rights-service``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import re
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm import kube
from neonvm.dev.replica import replica_env
from neonvm.drills import fleet, guests
from neonvm.drills.timeline import Sample, Timeline, render_svg

if TYPE_CHECKING:
    from neonvm.dev.cluster import LocalCluster
    from neonvm.dev.realnode import RealNode

Say = Callable[[str], None]
DRILLS = ("power-off", "partition", "kubelet-crash", "freeze-thaw")
LANES = ("freeze", "deadline bound", "old guest gone", "pod created", "pod ungated",
         "guest running", "leader killed")
SERVICE_NAMESPACE = "neonvm-system"
SERVICE = "neonvm-rights"


# ---- the rights Service: a forwarder to the leader's EndpointSlice -----------------------


class RightsProxy:
    """Listens on ``host:port`` and forwards each connection to the address and port
    the rights EndpointSlice names (refreshed every 0.5 s): what kube-proxy does for
    the chart's selector-less rights Service."""

    def __init__(self, api: client.ApiClient, host: str = "0.0.0.0", port: int = 0, *,
                 namespace: str = SERVICE_NAMESPACE, service: str = SERVICE) -> None:
        self.api = api
        self.namespace, self.service = namespace, service
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.port = self.sock.getsockname()[1]
        self.target: tuple[str, int] | None = None
        self._stop = threading.Event()
        self.forwarded = 0
        self.refused = 0
        self.bearers: dict[str, int] = {}
        """Asks seen, by their credential (:func:`bearer_kind`)."""
        self.answers: dict[str, int] = {}
        """Answers seen, by status code."""
        self._counts = threading.Lock()

    def __enter__(self) -> RightsProxy:
        for fn in (self._follow, self._accept):
            threading.Thread(target=fn, daemon=True, name=f"rights-proxy-{fn.__name__}"
                             ).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self.sock.close()

    def _note(self, data: bytes, *, asked: bool) -> None:
        kind = bearer_kind(data) if asked else answer_code(data)
        if kind is not None:
            with self._counts:
                counts = self.bearers if asked else self.answers
                counts[kind] = counts.get(kind, 0) + 1

    def tally(self) -> dict[str, Any]:
        """What went through: connections, asks by credential, answers by code."""
        with self._counts:
            return {"forwarded": self.forwarded, "refused": self.refused,
                    "asks_by_bearer": dict(self.bearers), "answers_by_code": dict(self.answers)}

    def _follow(self) -> None:
        path = (f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices/"
                f"{self.service}-leader")
        while not self._stop.wait(0.5):
            try:
                found = kube.get_or_none(self.api, path, timeout=5)
            except Exception:  # the API may be away; keep the last one
                continue
            if found is None:
                self.target = None
                continue
            addrs = [a for e in found.get("endpoints") or [] for a in e.get("addresses") or []]
            ports = [p.get("port") for p in found.get("ports") or []]
            self.target = (addrs[0], int(ports[0])) if addrs and ports else None

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(conn,), daemon=True).start()

    def _pipe(self, conn: socket.socket) -> None:
        target = self.target
        if target is None:
            self.refused += 1
            conn.close()
            return
        try:
            up = socket.create_connection(target, timeout=5)
        except OSError:
            self.refused += 1
            conn.close()
            return
        self.forwarded += 1
        sel = selectors.DefaultSelector()
        sel.register(conn, selectors.EVENT_READ, up)
        sel.register(up, selectors.EVENT_READ, conn)
        try:
            # Until either side closes, or nothing moves for 30 s.
            while not self._stop.is_set():
                events = sel.select(timeout=30)
                if not events:
                    return
                for key, _ in events:
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    data = src.recv(65536)
                    if not data:
                        return
                    self._note(data, asked=src is conn)
                    key.data.sendall(data)
        except OSError:
            pass
        finally:
            sel.close()
            conn.close()
            up.close()


_BEARER = re.compile(rb"^authorization:[ \t]*bearer[ \t]+([^\s]+)[ \t]*\r?$",
                     re.IGNORECASE | re.MULTILINE)
_ANSWER = re.compile(rb"^HTTP/1\.[01] (\d{3}) ")


def bearer_kind(chunk: bytes) -> str | None:
    """The credential of the HTTP request whose head starts ``chunk``: ``"jwt"`` (a
    projected ServiceAccount token: three dot-separated parts, reviewed by the leader),
    ``"other"`` (any other bearer: the scaling token's HMAC), ``"none"``; None if the
    chunk does not start a request (a body, a later segment)."""
    line = chunk.split(b"\r\n", 1)[0]
    if not (line.startswith(b"POST ") or line.startswith(b"GET ")) or b" HTTP/1." not in line:
        return None
    head = chunk.split(b"\r\n\r\n", 1)[0]
    found = _BEARER.search(head)
    if found is None:
        return "none"
    return "jwt" if found.group(1).count(b".") == 2 else "other"


def answer_code(chunk: bytes) -> str | None:
    """The status code of the HTTP answer whose head starts ``chunk``, else None."""
    found = _ANSWER.match(chunk)
    return found.group(1).decode() if found else None


# ---- a node's processes and network ------------------------------------------------------


def cgroup_pids(root: str) -> list[int]:
    """Processes whose cgroup (any hierarchy) lies under ``root`` (a node's pods)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/cgroup").read_text()
        except OSError:
            continue
        if f":{root}/" in text:
            found.append(int(entry))
    return found


@dataclass
class NodeFault:
    """Stops, continues and cuts one real node (its processes on this host)."""

    node: RealNode
    stopped: list[int] = field(default_factory=list)

    @property
    def chain(self) -> str:
        return f"NVMCUT-{self.node.tag}"

    def daemons(self) -> list[int]:
        ctrd, kubelet = self.node.process_names()
        pids = [self.node.cluster.process_pid(n) for n in (kubelet, ctrd)]
        return [p for p in pids if p is not None]

    def pod_pids(self) -> list[int]:
        return cgroup_pids(self.node.cgroup_root)

    def _qemu_first(self, pids: list[int]) -> list[int]:
        def is_qemu(pid: int) -> bool:
            proc = guests.read_stat(Path("/proc"), pid)
            return proc is not None and proc.comm.startswith("qemu-system")
        return sorted(pids, key=lambda p: not is_qemu(p))

    def freeze(self, *, kubelet_only: bool = False) -> int:
        """SIGSTOP the node (every pod process, shims, containerd, kubelet), or only the
        kubelet; returns how many processes were stopped."""
        if kubelet_only:
            pids = self.daemons()[:1]
        else:
            pids = [*self._qemu_first(self.pod_pids()), *self.node.shim_pids(),
                    *self.daemons()]
        for _round in range(3):  # processes forked meanwhile
            for pid in pids:
                if pid not in self.stopped:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGSTOP)
                        self.stopped.append(pid)
            if kubelet_only:
                break
            pids = [*self.pod_pids(), *self.node.shim_pids()]
        return len(self.stopped)

    def kill_pods(self) -> int:
        """SIGKILL every pod process and shim (a powered-off node keeps nothing)."""
        pids = [*self.pod_pids(), *self.node.shim_pids()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def thaw(self) -> float:
        """SIGCONT what was stopped, QEMU first (the worst order); the boot-time clock
        at the first SIGCONT."""
        order = self._qemu_first(self.stopped)
        at = guests.boottime()
        for pid in order:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.stopped = []
        return at

    def cut(self) -> None:
        """Drop everything the node's pods send or receive (through its bridge)."""
        self.heal()
        _ipt("-N", self.chain)
        _ipt("-A", self.chain, "-j", "DROP")
        br = self.node.bridge
        for rule in (("INPUT", "-i"), ("FORWARD", "-i"), ("FORWARD", "-o"), ("OUTPUT", "-o")):
            _ipt("-I", rule[0], rule[1], br, "-j", self.chain)

    def heal(self) -> None:
        if subprocess.run(["iptables", "-S", self.chain], capture_output=True).returncode:
            return
        br = self.node.bridge
        for rule in (("INPUT", "-i"), ("FORWARD", "-i"), ("FORWARD", "-o"), ("OUTPUT", "-o")):
            while subprocess.run(["iptables", "-w", "10", "-D", rule[0], rule[1], br, "-j",
                                  self.chain], capture_output=True).returncode == 0:
                pass
        _ipt("-F", self.chain)
        _ipt("-X", self.chain)


def _ipt(*args: str) -> None:
    proc = subprocess.run(["iptables", "-w", "10", *args], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"iptables {' '.join(args)}: {proc.stderr.strip()}")


# ---- the rig: cluster, nodes, images, replicas -------------------------------------------


@dataclass
class Rig:
    """Two real nodes with the runner and guest images, self-fencing replicas, the
    rights forwarder, one namespace."""

    cluster: LocalCluster
    api: client.ApiClient
    nodes: list[RealNode]
    right_seconds: float
    replicas: int
    proxy: RightsProxy
    namespace: str
    say: Say
    rights_ports: list[int] = field(default_factory=list)

    @property
    def rights_url(self) -> str:
        return f"http://{self.nodes[0].node_ip}:{self.proxy.port}"

    def replica_name(self, i: int) -> str:
        return f"fence-controller-{i}"

    def start_replica(self, i: int) -> int:
        from neonvm.dev.replica import DEMO_TIMINGS, DEV_RUNNER_IMAGE, controller_argv

        argv = controller_argv(
            kubeconfig=str(self.cluster.kubeconfig_for("controller")),
            etcd_endpoints=self.cluster.locks_etcd_config(),
            identity=f"fence-{i}-{int(time.time() * 1000) % 100000}",
            watch_namespace=self.namespace,
            extra=(*DEMO_TIMINGS, "--runner-image", DEV_RUNNER_IMAGE,
                   "--lease-namespace", self.namespace,
                   "--right-seconds", f"{self.right_seconds:g}",
                   "--rights-url", self.rights_url,
                   "--rights-bind", f"0.0.0.0:{self.rights_ports[i]}",
                   "--rights-service", f"{SERVICE_NAMESPACE}/{SERVICE}",
                   # As the chart's default: runners ask with a projected token of
                   # this audience, reviewed by the leader (docs/protocol.md).
                   "--rights-audience", f"vm.neon.tech/rights/{self.namespace}/drill",
                   # An EndpointSlice refuses loopback addresses: the host address
                   # on node 0's bridge (the forwarder connects to it).
                   "--pod-ip", self.nodes[0].node_ip))
        pid: int = self.cluster.start_process(self.replica_name(i), argv, replica_env())
        return pid

    def leader(self) -> str | None:
        return self.lease()[0]

    def lease(self) -> tuple[str | None, int | None]:
        """The Lease's holder and its leaseTransitions (the epoch)."""
        try:
            lease = client.CoordinationV1Api(self.api).read_namespaced_lease(
                "neonvm-controller", self.namespace)
        except ApiException:
            return None, None
        return lease.spec.holder_identity, lease.spec.lease_transitions

    def kill_leader(self) -> str | None:
        """SIGKILL the leader's process; it is started again (as a standby) 2 s later."""
        holder = self.leader()
        if not holder or not holder.startswith("fence-"):
            return None
        i = int(holder.split("-")[1])
        pid = self.cluster.process_pid(self.replica_name(i))
        if pid is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

        def restart() -> None:
            time.sleep(2)
            self.start_replica(i)
        threading.Thread(target=restart, daemon=True).start()
        return holder

    def close(self) -> None:
        for i in range(self.replicas):
            self.cluster.stop_component(self.replica_name(i))
        self.proxy.__exit__()


def prepare(cluster: LocalCluster, api: client.ApiClient, *, right_seconds: float,
            replicas: int = 2, say: Say = print, reuse_images: bool = False) -> Rig:
    """Start two real nodes (idempotent), import the runner and guest images into both,
    start the proxy and ``replicas`` self-fencing controller replicas."""
    from neonvm.dev import guestdisk, images, realguest, realnode
    from neonvm.dev.common import free_port
    from neonvm.dev.replica import DEV_RUNNER_IMAGE

    problem = realguest.unavailable_reason()
    if problem:
        raise realnode.RealNodeError(problem)
    nodes = realnode.start(cluster, 2, say)
    if len({n.node_ip for n in nodes}) != 2:
        raise realnode.RealNodeError("the two real nodes got the same pod subnet")
    have = [node.ctr("images", "ls", "-q").split() for node in nodes]
    if reuse_images and all(f"docker.io/library/{DEV_RUNNER_IMAGE}" in listed
                            for listed in have):
        # A re-run where only the drills' code changed: the runner image in the nodes
        # is kept (it is rebuilt whenever any source under neonvm/ changes).
        say("reusing the runner and guest images already in the nodes")
        nodes_to_import: list[RealNode] = []
    else:
        nodes_to_import = nodes
        [runner] = images.build(("runner",), None, say)
        disk_dir = cluster.state_dir / "guest-disk"
        disk_dir.mkdir(parents=True, exist_ok=True)
        _raw, qcow2 = guestdisk.build_rootfs(disk_dir)
        disk = guestdisk.disk_image_archive(qcow2, disk_dir / "rootdisk.oci.tar",
                                            guestdisk.DISK_IMAGE)
    for node in nodes_to_import:
        # Always imported: the runner image's tag does not change with its sources.
        for archive in (runner.archive, disk):
            node.ctr("images", "import", "--platform", "linux/amd64", str(archive),
                     timeout=600)
        node.ctr("images", "tag", "--force", runner.reference,
                 f"docker.io/library/{DEV_RUNNER_IMAGE}")
        say(f"{node.name}: runner and guest images imported")
    namespace = f"fence-{uuid.uuid4().hex[:6]}"
    fleet.ensure_namespace(api, namespace)
    fleet.ensure_namespace(api, SERVICE_NAMESPACE)
    with contextlib.suppress(ApiException):
        client.CoreV1Api(api).create_namespaced_service(SERVICE_NAMESPACE, client.V1Service(
            metadata=client.V1ObjectMeta(name=SERVICE),
            spec=client.V1ServiceSpec(ports=[client.V1ServicePort(name="rights", port=80)])))
    proxy = RightsProxy(api).__enter__()
    rig = Rig(cluster, api, nodes, right_seconds, replicas, proxy, namespace, say,
              [free_port() for _ in range(replicas)])
    for i in range(replicas):
        rig.start_replica(i)
    return rig


# ---- one VM on a node ----------------------------------------------------------------------


def create_vm(rig: Rig, name: str) -> None:
    from neonvm.dev import realguest

    body = fleet.vm_body(name, spec_extra=realguest.vm_spec(args=("fence",)))
    kube.request(rig.api, "POST",
                 f"/apis/vm.neon.tech/v1/namespaces/{rig.namespace}/virtualmachines",
                 body=body, timeout=10)


def ready_pod(rig: Rig, vm: str) -> Any | None:
    """The VM's live runner pod if it is Ready (its guest booted)."""
    for pod in fleet.list_runner_pods(rig.api, rig.namespace):
        if (pod.metadata.labels or {}).get("vm.neon.tech/name") != vm:
            continue
        if pod.metadata.deletion_timestamp is None and any(
                c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []):
            return pod
    return None


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.25
             ) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


class PodWatch:
    """Polls the namespace's runner pods (every 0.2 s) and records, on the boot-time
    clock, when a pod was first seen, ungated, Ready, terminating and gone."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.seen: dict[str, dict[str, float]] = {}
        self.nodes: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pod-watch")

    def __enter__(self) -> PodWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _mark(self, uid: str, what: str, at: float) -> None:
        self.seen.setdefault(uid, {}).setdefault(what, at)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                pods = fleet.list_runner_pods(self.rig.api, self.rig.namespace)
            except Exception:  # a leader kill or API hiccup: next round
                continue
            at = guests.boottime()
            live = set()
            for pod in pods:
                uid = pod.metadata.uid
                live.add(uid)
                self._mark(uid, "created", at)
                if pod.spec.node_name:
                    self.nodes[uid] = pod.spec.node_name
                if not pod.spec.scheduling_gates:
                    self._mark(uid, "ungated", at)
                if any(c.type == "Ready" and c.status == "True"
                       for c in pod.status.conditions or []):
                    self._mark(uid, "ready", at)
                if pod.metadata.deletion_timestamp is not None:
                    self._mark(uid, "terminating", at)
            for uid in self.seen:
                if uid not in live:
                    self._mark(uid, "gone", at)


# ---- the drills ----------------------------------------------------------------------------


@dataclass
class Result:
    drill: str
    ok: bool
    node: str
    freeze_to_qemu: float | None = None
    """Fault to the replacement's QEMU process start (boot-time clock)."""
    freeze_to_ready: float | None = None
    """Fault to the replacement pod Ready (its guest printed the marker)."""
    old_gone_after_fault: float | None = None
    after_thaw_running: float | None = None
    """Freeze-thaw: the widest span the old guest was seen running after its SIGCONT."""
    after_thaw_cpu: float | None = None
    replacements: int = 0
    running_overlaps: int = 0
    may_run_overlaps: int = 0
    leader_killed: str | None = None
    leader_kill_at: float | None = None
    overlaps: list[tuple[float, float, bool]] = field(default_factory=list)
    """Each moment with two guests: (start after the fault, seconds, all running)."""
    runner_log: list[str] = field(default_factory=list)
    """Partition: the runner's log lines that say it fenced itself."""
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        def f(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}s"
        return (f"{self.drill} on {self.node}: {'PASS' if self.ok else 'FAIL'}; fault -> "
                f"replacement QEMU {f(self.freeze_to_qemu)}, Ready {f(self.freeze_to_ready)}; "
                f"old guest gone {f(self.old_gone_after_fault)} after the fault; "
                f"after thaw ran {f(self.after_thaw_running)} (cpu {f(self.after_thaw_cpu)}); "
                f"replacements {self.replacements}; moments with two guests: "
                f"{self.running_overlaps} running, {self.may_run_overlaps} may-run; "
                f"leader {self.leader_killed or '-'} killed at "
                f"{f(self.leader_kill_at)}; overlaps (start, s, running) {self.overlaps}"
                + (f"; {'; '.join(self.notes)}" if self.notes else ""))


def runner_log(node: RealNode, pod_uid: str, needle: str) -> list[str]:
    """Lines with ``needle`` in the runner container's log on the node (the kubelet's
    ``podLogsDir``), while the pod's directory is still there."""
    lines: list[str] = []
    for path in (node.dir / "pod-logs").glob(f"*_{pod_uid}/neonvm-runner/*.log"):
        with contextlib.suppress(OSError):
            lines += [line for line in path.read_text(errors="replace").splitlines()
                      if needle in line]
    return lines


def run_drill(rig: Rig, drill: str, vm: str, *, rng: random.Random,
              timeline: Timeline | None = None, kill_leader: bool = True,
              timeout: float = 240.0) -> Result:
    """One drill on the node that runs ``vm``'s guest (module docstring)."""
    if drill not in DRILLS:
        raise ValueError(f"unknown drill {drill!r}; one of {', '.join(DRILLS)}")
    pod = wait_for(lambda: ready_pod(rig, vm), timeout, f"VM {vm} Ready")
    node = next(n for n in rig.nodes if n.name == pod.spec.node_name)
    roots = {n.cgroup_root: n.name for n in rig.nodes}
    full = f"{rig.namespace}/{vm}"
    counter = guests.GuestCounter(lambda g: g.node in roots and g.vm == full)
    offset = guests.boottime() - time.monotonic()
    fault = NodeFault(node)
    result = Result(drill, ok=True, node=node.name)
    bound = rig.right_seconds * 1.05 + 2.0
    with counter, PodWatch(rig) as watch:
        old = wait_for(lambda: [g for g in counter.running(full) if g.pod_uid ==
                                pod.metadata.uid], 30, "the old guest seen by the counter")
        old_guest = old[0]
        if timeline is not None:
            timeline.origin = time.monotonic() - 2.0
            timeline.leaders.append((timeline.origin, *rig.lease()))

            def on_change(at: float, h: guests.History, state: str | None) -> None:
                mono = at - offset
                if state is None and h.guest.key == old_guest.key:
                    timeline.event("old guest gone", f"pid {h.guest.pid}", mono)
                elif h.guest.key != old_guest.key and state and state not in "Tt" \
                        and len(h.seen) == 1:
                    timeline.event("guest running", f"pid {h.guest.pid} on {h.guest.node}",
                                   h.guest.start - offset)
            counter.on_change(on_change)
        time.sleep(1.0)
        fault_at = guests.boottime()
        if drill == "kubelet-crash":
            kubelet = fault.daemons()[0]
            os.kill(kubelet, signal.SIGKILL)
        elif drill == "partition":
            fault.cut()
            fault.freeze(kubelet_only=True)
        else:
            fault.cut()
            fault.freeze()
        if timeline is not None:
            timeline.fault_begins({"power-off": "node frozen (power-off)",
                                   "partition": "node partitioned",
                                   "kubelet-crash": "kubelet killed",
                                   "freeze-thaw": "node frozen"}[drill])
            timeline.event("freeze", drill, fault_at - offset)
            timeline.event("deadline bound", "fault + D: the old guest's right is over",
                           fault_at + rig.right_seconds - offset)
        try:
            kill_at = rng.uniform(0.0, bound + 20.0) if kill_leader else None
            deadline = time.monotonic() + (timeout if drill != "kubelet-crash" else
                                           max(45.0, 20.0 + bound + 10.0))
            replacement: guests.Guest | None = None
            samples_every = time.monotonic()
            while time.monotonic() < deadline:
                now = guests.boottime()
                if kill_at is not None and now - fault_at >= kill_at:
                    result.leader_killed = rig.kill_leader()
                    result.leader_kill_at = now - fault_at
                    if timeline is not None and result.leader_killed:
                        timeline.event("leader killed", result.leader_killed, now - offset)
                    kill_at = None
                if timeline is not None and time.monotonic() >= samples_every:
                    running = len(counter.running(full))
                    timeline.samples.append(Sample(time.monotonic(), 0, 0, running))
                    samples_every = time.monotonic() + 0.5
                    holder, epoch = rig.lease()
                    if not timeline.leaders or timeline.leaders[-1][1] != holder:
                        timeline.leaders.append((time.monotonic(), holder, epoch))
                new = [g for g in counter.running(full) if g.pod_uid != old_guest.pod_uid]
                if new:
                    # The latest: a replacement that died (e.g. fenced) was replaced too.
                    replacement = max(new, key=lambda g: g.start)
                    result.freeze_to_qemu = replacement.start - fault_at
                if replacement is not None and replacement.pod_uid in watch.seen and \
                        "ready" in watch.seen[replacement.pod_uid]:
                    result.freeze_to_ready = watch.seen[replacement.pod_uid]["ready"] - fault_at
                    break
                time.sleep(0.1)
            if drill == "partition":
                # The kubelet is stopped, so the pod's log is still on the node: the runner's
                # own word that it killed its guest.
                with contextlib.suppress(TimeoutError):
                    wait_for(lambda: [h for h in counter.histories() if h.guest.key ==
                                      old_guest.key and h.gone_at is not None], 60,
                             "the old guest killed by its runner")
                result.runner_log = runner_log(node, pod.metadata.uid, "self-fenced")
        finally:
            # The fault ends, whatever happened meanwhile.
            if drill == "kubelet-crash":
                node.start(rig.say)
            elif drill == "partition":
                fault.heal()
                fault.thaw()
            elif drill == "power-off":
                fault.kill_pods()
                fault.heal()
                fault.thaw()
            else:
                fault.heal()
                thaw_at = fault.thaw()
                if timeline is not None:
                    timeline.event("freeze", "SIGCONT (QEMU first)", thaw_at - offset)
        if timeline is not None:
            timeline.fault_ends()
        end_fault = guests.boottime()
        # The old guest must be gone (killed by its runner, or with the node) and the
        # node Ready again, before the next drill.
        try:
            wait_for(lambda: not [h for h in counter.histories()
                                  if h.guest.key == old_guest.key and h.gone_at is None]
                     or drill == "kubelet-crash", 120, "the old guest gone")
        except TimeoutError as exc:
            result.ok = False
            result.notes.append(str(exc))
        from neonvm.dev.realnode import node_ready
        wait_for(lambda: node_ready(rig.cluster, node.name), 180, f"{node.name} Ready again",
                 interval=1.0)
        if drill != "kubelet-crash":
            wait_for(lambda: ready_pod(rig, vm), timeout, f"VM {vm} Ready again")
        time.sleep(1.0)
        report = counter.report()
    for uid, marks in watch.seen.items():
        if uid != pod.metadata.uid and "created" in marks and timeline is not None:
            timeline.event("pod created", uid[:8], marks["created"] - offset)
            if "ungated" in marks:
                timeline.event("pod ungated", uid[:8], marks["ungated"] - offset)
    result.replacements = len([u for u in watch.seen if u != pod.metadata.uid])
    result.overlaps = [(round(o.start - fault_at, 3), round(o.seconds, 3), o.running)
                       for o in report.overlaps]
    result.running_overlaps = len(report.running_overlaps)
    result.may_run_overlaps = len(report.overlaps) - len(report.running_overlaps)
    [old_h] = [h for h in report.guests if h.guest.key == old_guest.key]
    if old_h.gone_at is not None:
        result.old_gone_after_fault = old_h.gone_at - fault_at
    if drill == "freeze-thaw":
        spans = [iv for iv in guests.classify(old_h, guests.boottime())
                 if iv.running and iv.end > end_fault - 1.0 and iv.start > fault_at]
        result.after_thaw_running = sum(iv.end - iv.start for iv in spans)
        cpus = [c for at, _s, c in old_h.seen if at >= fault_at]
        frozen_cpu = [c for at, s, c in old_h.seen if at >= fault_at and s in "Tt"]
        if cpus and frozen_cpu:
            result.after_thaw_cpu = max(cpus) - frozen_cpu[0]
    if drill == "kubelet-crash":
        result.ok = result.ok and result.replacements == 0 and old_h.gone_at is None
    else:
        result.ok = result.ok and result.freeze_to_ready is not None \
            and result.running_overlaps == (0 if drill != "freeze-thaw" else
                                            result.running_overlaps)
    if drill != "freeze-thaw" and result.running_overlaps:
        result.ok = False
    if timeline is not None:
        timeline.end = time.monotonic()
    result.notes.append(report.summary())
    return result


# ---- the command ----------------------------------------------------------------------------


def summary(results: list[Result]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for drill in DRILLS:
        mine = [r for r in results if r.drill == drill]
        if not mine:
            continue
        qemu = [r.freeze_to_qemu for r in mine if r.freeze_to_qemu is not None]
        ready = [r.freeze_to_ready for r in mine if r.freeze_to_ready is not None]
        thaw = [r.after_thaw_running for r in mine if r.after_thaw_running is not None]
        out[drill] = {
            "runs": len(mine), "passed": sum(r.ok for r in mine),
            "fault_to_replacement_qemu_p50_max": _p50_max(qemu),
            "fault_to_replacement_ready_p50_max": _p50_max(ready),
            "moments_two_running": sum(r.running_overlaps for r in mine),
            "moments_two_may_run": sum(r.may_run_overlaps for r in mine),
            "replacements": sum(r.replacements for r in mine),
            "after_thaw_running_s": [round(t, 3) for t in thaw],
            "leader_kills": sum(1 for r in mine if r.leader_killed),
        }
    return out


def _p50_max(values: list[float]) -> list[float] | None:
    return [round(statistics.median(values), 2), round(max(values), 2)] if values else None


@contextlib.contextmanager
def rig_for(state_dir: Path, right_seconds: float, replicas: int, say: Say,
            reuse_images: bool = False) -> Iterator[Rig]:
    from neonvm.dev.cluster import LocalCluster

    cluster = LocalCluster(state_dir)
    api = kube.api_client(cluster.kubeconfig)
    rig = prepare(cluster, api, right_seconds=right_seconds, replicas=replicas, say=say,
                  reuse_images=reuse_images)
    try:
        yield rig
    finally:
        with contextlib.suppress(Exception):
            fleet.delete_vms(api, rig.namespace)
            fleet.wait_gone(api, rig.namespace, 120, lambda _m: None)
        rig.close()
        for node in rig.nodes:
            NodeFault(node).heal()
        api.close()


@dataclass
class Options:
    """What :func:`run_drills` runs (the command-line flags of ``neonvm drill power-off``
    and its siblings, and of ``python -m neonvm.drills.fencing``)."""

    drills: list[str]
    repeat: int = 1
    right_seconds: float = 30.0
    replicas: int = 3
    seed: int | None = None
    leader_kill: bool = True
    fresh_vm: bool = False
    reuse_images: bool = False
    timeline: Path | None = None
    json_path: Path | None = None
    max_minutes: float | None = None
    """Start no drill once this many minutes have passed since the first (the runs so
    far are the result; a shorter series with honest numbers, not one cut mid-drill)."""


def _write_json(path: Path, seed: int, results: list[Result], proxy: dict[str, Any],
                *, complete: bool) -> None:
    path.write_text(json.dumps({"seed": seed, "complete": complete,
                                "summary": summary(results), "rights_proxy": proxy,
                                "runs": [r.__dict__ for r in results]}, indent=2))


def run_drills(state_dir: Path, opts: Options, say: Say) -> tuple[list[Result], dict[str, Any]]:
    """Run ``opts.drills`` ``opts.repeat`` times on the two real nodes of ``state_dir``'s
    cluster; the results and their :func:`summary` (also written to ``opts.json_path``)."""
    seed = opts.seed if opts.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    say(f"seed {seed}")
    results: list[Result] = []
    with rig_for(state_dir, opts.right_seconds, opts.replicas, say,
                 opts.reuse_images) as rig:
        wait_for(rig.leader, 120, "a leader")
        vm = "fence-0"
        create_vm(rig, vm)
        wait_for(lambda: ready_pod(rig, vm), 300, f"VM {vm} Ready", interval=1.0)
        say(f"VM {vm} Ready; rights URL {rig.rights_url}")
        started = time.monotonic()
        for i, drill in ((i, d) for i in range(opts.repeat) for d in opts.drills):
            if opts.max_minutes is not None and results and \
                    time.monotonic() - started >= opts.max_minutes * 60:
                say(f"stopping after {len(results)} drills: --max-minutes "
                    f"{opts.max_minutes:g} reached")
                break
            if opts.fresh_vm and results:
                # A new VM per drill: no restart streak (and its backoff) carried
                # over from the drills before.
                fleet.delete_vms(rig.api, rig.namespace, [vm])
                vm = f"fence-{len(results)}"
                create_vm(rig, vm)
                wait_for(functools.partial(ready_pod, rig, vm), 300, f"VM {vm} Ready",
                         interval=1.0)
            tl = None
            if opts.timeline is not None and not results:
                tl = Timeline(f"self-fencing drill: {drill}, D = {opts.right_seconds:g} s",
                              1, lanes=LANES)
            r = run_drill(rig, drill, vm, rng=rng, timeline=tl,
                          kill_leader=opts.leader_kill)
            results.append(r)
            say(f"[{i + 1}/{opts.repeat}] {r.line()}")
            if opts.json_path is not None:  # kept if the series is stopped
                _write_json(opts.json_path, seed, results, rig.proxy.tally(),
                            complete=False)
            if tl is not None and opts.timeline is not None:
                opts.timeline.write_text(render_svg(tl))
                say(f"timeline written to {opts.timeline}")
        proxy = rig.proxy.tally()
        say(f"rights proxy: {proxy['forwarded']} connections forwarded, "
            f"{proxy['refused']} refused; asks by bearer {proxy['asks_by_bearer']}, "
            f"answers by code {proxy['answers_by_code']}")
    if opts.json_path is not None:
        _write_json(opts.json_path, seed, results, proxy, complete=True)
    return results, summary(results)


def main(argv: list[str] | None = None) -> int:
    """``python -m neonvm.drills.fencing``: the same drills as ``neonvm drill power-off``
    and its siblings (neonvm/cli/drill.py), several in one run."""
    parser = argparse.ArgumentParser(
        prog="python -m neonvm.drills.fencing",
        description="Self-fencing drills on two real nodes (docs/drills.md).")
    parser.add_argument("--state-dir", type=Path, required=True,
                        help="a local cluster started with --real-nodes 2")
    parser.add_argument("--drill", action="append", choices=DRILLS, required=True)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--right-seconds", type=float, default=30.0)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-leader-kill", action="store_true")
    parser.add_argument("--fresh-vm", action="store_true",
                        help="a new VM for each drill (no restart backoff carried over)")
    parser.add_argument("--reuse-images", action="store_true",
                        help="keep the runner image the nodes have (re-runs)")
    parser.add_argument("--timeline", type=Path, default=None,
                        help="write the first drill's timeline SVG here")
    parser.add_argument("--json", type=Path, default=None,
                        help="write results here (after each drill, and at the end)")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="start no drill after this many minutes (a shorter series)")
    args = parser.parse_args(argv)
    install_sigterm()

    def say(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    results, out = run_drills(args.state_dir, Options(
        drills=args.drill, repeat=args.repeat, right_seconds=args.right_seconds,
        replicas=args.replicas, seed=args.seed, leader_kill=not args.no_leader_kill,
        fresh_vm=args.fresh_vm, reuse_images=args.reuse_images, timeline=args.timeline,
        json_path=args.json, max_minutes=args.max_minutes), say)
    print(json.dumps(out, indent=2))
    return 0 if all(r.ok for r in results) else 1


def install_sigterm() -> None:
    """Started in the background, SIGINT is ignored: SIGTERM cleans up as Ctrl-C does."""
    def interrupted(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupted)


if __name__ == "__main__":
    sys.exit(main())
