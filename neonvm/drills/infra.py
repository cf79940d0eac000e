"""Infrastructure drills: the locks' etcd out for a while, a slow API server, partitions.

Each runs like every drill (:mod:`neonvm.drills.drills`: fleet, judges, fault,
convergence, clean-up) on the local control plane, and keeps the fleet under **churn**
for the whole fault: every ``churn_interval`` seconds the runner pods of a share of the
VMs are deleted, and one short-lived VM is created and the previous one deleted.

* ``etcd-outage``: the locks' etcd stopped (SIGTERM) for ``outage_seconds``, then
  started again;
* ``slow-api``: every replica reaches the API server through its own
  :class:`~neonvm.drills.proxy.FaultProxy` (the drill restarts them with a kubeconfig
  naming it); for ``slow_seconds`` every request is delayed by ``latency``;
* ``partition-etcd`` / ``partition-api``: every replica reaches both servers through
  proxies of its own; the ``victim``'s (the leader's, by default) path to the locks'
  etcd, or to the API server, is cut (a black hole) for ``partition_seconds``;
* ``etcd-member-kill``: the replicas' locks live on a private **3-member** etcd (plain
  HTTP on loopback, every member named to every replica; the checker reads the locks
  there too); the member every replica names first is killed (SIGKILL) for
  ``outage_seconds`` and then started again on its data. Two members keep quorum, so the
  term should go on (docs/locks.md, "A 3-member etcd").

The fault window is recorded on the drill (``fault_started``, ``fault_ended``); the
verdict's recovery time runs from its end to every VM converged. See docs/drills.md,
"Infrastructure drills".
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm.api import types
from neonvm.drills import fleet
from neonvm.drills.check import etcd_lock_reader
from neonvm.drills.proxy import FaultProxy
from neonvm.drills.target import DrillError, LeaderLog, LocalTarget, Route
from neonvm.leader.etcd import Etcd, EtcdConfig, EtcdError

if TYPE_CHECKING:
    from neonvm.drills.drills import Drill

INFRA = ("etcd-outage", "slow-api", "partition-etcd", "partition-api", "etcd-member-kill")
RECORDED = ("etcd-outage", "apiserver-restart", "slow-api", "partition-etcd", "partition-api",
            "etcd-member-kill")
"""Drills whose verdicts ``--write-docs`` records in docs/drills.md, in the table's order."""
ROUTED = ("slow-api", "partition-etcd", "partition-api", "etcd-member-kill")
"""Drills whose replicas reach the servers through the drill's proxies (etcd-member-kill:
the locks' etcd is the drill's own 3-member cluster)."""


# ---- proxies in front of every replica --------------------------------------------------------


@dataclass
class Proxies:
    """Replica index -> its proxy to the API server and to the locks' etcd; and the
    members of the drill's own 3-member etcd, if it has one."""

    api: dict[int, FaultProxy] = field(default_factory=dict)
    etcd: dict[int, FaultProxy] = field(default_factory=dict)
    members: list[EtcdMember] = field(default_factory=list)


@dataclass
class EtcdMember:
    """One member of the drill's private 3-member etcd (plain HTTP on loopback)."""

    name: str
    url: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)

    def kill(self) -> None:
        """A crash (SIGKILL): no goodbye to its peers or its clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def three_members(folder: Path) -> list[EtcdMember]:
    """Start a 3-member etcd under ``folder`` (free loopback ports) and wait for quorum."""
    from neonvm.dev import binaries
    from neonvm.dev.common import free_port

    folder.mkdir(parents=True, exist_ok=True)
    taken: set[int] = set()
    for _ in range(6):
        taken.add(free_port(taken=taken))
    ports = sorted(taken)
    clients, peers = ports[:3], ports[3:]
    initial = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(peers))
    members = []
    for i in range(3):
        url = f"http://127.0.0.1:{clients[i]}"
        argv = [str(binaries.require("etcd")), f"--name=m{i}",
                f"--data-dir={folder / f'm{i}'}", f"--listen-client-urls={url}",
                f"--advertise-client-urls={url}",
                f"--listen-peer-urls=http://127.0.0.1:{peers[i]}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peers[i]}",
                f"--initial-cluster={initial}", "--initial-cluster-state=new",
                "--initial-cluster-token=drill", "--unsafe-no-fsync", "--log-level=warn"]
        members.append(EtcdMember(f"m{i}", url, argv, folder / f"m{i}.log"))
    for m in members:
        m.start()
    config = EtcdConfig(endpoints=tuple(m.url for m in members), timeout=2)
    deadline = time.monotonic() + 60
    while not quorum(config):
        if time.monotonic() > deadline:
            for m in members:
                m.kill()
            raise DrillError(f"the drill's 3-member etcd did not answer within 60s "
                             f"(logs in {folder})")
        time.sleep(0.3)
    return members


def quorum(config: EtcdConfig) -> bool:
    """A linearizable read answered: a majority of the members is up."""
    try:
        with Etcd(config) as etcd:
            etcd.get("/probe", timeout=2)
    except EtcdError:
        return False
    return True


def _local(d: Drill) -> LocalTarget:
    if not isinstance(d.target, LocalTarget):
        raise DrillError(f"{d.name} runs only against the local control plane (--state-dir)")
    return d.target


@contextlib.contextmanager
def routed(d: Drill) -> Iterator[Proxies]:
    """Start a pair of proxies per replica and restart each replica through its pair;
    at the end restart them direct and close the proxies."""
    target = _local(d)
    cluster = target.cluster
    ports = cluster.spec.ports
    proxies = Proxies()
    folder = cluster.state_dir / "drills"
    folder.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(cluster.kubeconfig_for("controller").read_text())
    etcd = cluster.locks_etcd_config()
    try:
        members: EtcdConfig | None = None
        if d.name == "etcd-member-kill":
            proxies.members = three_members(folder / f"{d.namespace}-etcd")
            members = EtcdConfig(endpoints=tuple(m.url for m in proxies.members),
                                 prefix=etcd.prefix)
            # The checker reads the locks where the replicas keep them (this target
            # only, for this drill: removed again below).
            target.__dict__["lock_reader"] = lambda: etcd_lock_reader(members)
            d.say(f"a 3-member etcd for the locks: {', '.join(members.endpoints)}")
        for i in range(target.replicas):
            proxies.api[i] = FaultProxy(("127.0.0.1", ports["kube-apiserver"])).__enter__()
            config = yaml.safe_load(yaml.safe_dump(base))
            config["clusters"][0]["cluster"]["server"] = (
                f"https://127.0.0.1:{proxies.api[i].port}")
            path = folder / f"{d.namespace}-replica-{i}.kubeconfig"
            path.write_text(yaml.safe_dump(config))
            if members is not None:
                target.routes[i] = Route(path, members)
                continue
            proxies.etcd[i] = FaultProxy(("127.0.0.1", ports["locks-etcd"])).__enter__()
            target.routes[i] = Route(path, etcd.with_overrides(
                endpoints=(f"https://127.0.0.1:{proxies.etcd[i].port}",)))
        d.say(f"restarting the {target.replicas} replicas through proxies of their own "
              f"(API server; locks' etcd: "
              f"{'the 3 members' if members is not None else 'a proxy'})")
        for i in range(target.replicas):
            target.restart_replica(i)
        d.wait_leader()
        yield proxies
    finally:
        target.routes.clear()
        d.say("restarting the replicas direct (no proxies)")
        for i in range(target.replicas):
            with contextlib.suppress(Exception):
                target.restart_replica(i)
        for p in [*proxies.api.values(), *proxies.etcd.values()]:
            p.close()
        for m in proxies.members:
            m.kill()
        target.__dict__.pop("lock_reader", None)
        for path in folder.glob(f"{d.namespace}-replica-*.kubeconfig"):
            path.unlink(missing_ok=True)


# ---- churn --------------------------------------------------------------------------------------


@contextlib.contextmanager
def churn(d: Drill) -> Iterator[dict[str, int]]:
    """Pod deletions and a VM created/deleted every ``churn_interval`` s (module docstring).
    Yields the counts; failures (a server down) are counted and skipped."""
    counts = {"churn pod deletions": 0, "churn VMs created": 0, "churn VMs deleted": 0,
              "churn errors": 0}
    stop = threading.Event()
    custom = client.CustomObjectsApi(d.api)
    previous: dict[str, Any] | None = None

    def tick(n: int) -> None:
        nonlocal previous
        counts["churn pod deletions"] += len(d.disturb(d.options.churn_share, quiet=True))
        name = f"churn-{n:04d}"
        created = custom.create_namespaced_custom_object(
            types.GROUP, types.VERSION, d.namespace, types.PLURAL,
            fleet.vm_body(name, d.options.grace_seconds), _request_timeout=10)
        counts["churn VMs created"] += 1
        if previous is not None:
            if d.dog is not None:
                d.dog.watcher.expect_vm_deletion(previous["metadata"]["uid"])
            with contextlib.suppress(ApiException):
                custom.delete_namespaced_custom_object(
                    types.GROUP, types.VERSION, d.namespace, types.PLURAL,
                    previous["metadata"]["name"], _request_timeout=10)
                counts["churn VMs deleted"] += 1
        previous = created

    def run() -> None:
        n = 0
        while not stop.wait(d.options.churn_interval):
            try:
                tick(n)
            except Exception:  # a server is down: that is the drill
                counts["churn errors"] += 1
            n += 1

    thread = threading.Thread(target=run, name="churn", daemon=True)
    thread.start()
    try:
        yield counts
    finally:
        stop.set()
        thread.join(timeout=60)
        d.fault.update(counts)


def _hold(d: Drill, seconds: float, what: str) -> None:
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(10.0, left))
        d.say(f"{what}: {min(seconds, seconds - left + min(10.0, left)):.0f}/{seconds:.0f}s")


# ---- the drills ---------------------------------------------------------------------------------


def etcd_outage(d: Drill, log: LeaderLog) -> float:
    target = _local(d)
    d.wait_leader()
    d.disturb()
    seconds = d.options.outage_seconds
    d.say(f"stopping the locks' etcd for {seconds:.0f}s")
    t0 = d.begin_fault(f"locks' etcd stopped {seconds:g}s")
    target.cluster.stop_component("locks-etcd", signal.SIGTERM)
    with churn(d):
        _hold(d, seconds - (time.monotonic() - t0), "locks' etcd down")
    d.say("starting the locks' etcd again")
    target.cluster.start_component("locks-etcd", timeout=120)
    d.end_fault()
    d.fault["locks-etcd down_s"] = round(d.fault_seconds(), 1)
    return t0


def slow_api(d: Drill, log: LeaderLog) -> float:
    proxies = d.proxies
    assert proxies is not None
    d.wait_leader()
    latency, seconds = d.options.latency, d.options.slow_seconds
    d.say(f"every request of every replica to the API server now takes {latency:g}s "
          f"longer, for {seconds:.0f}s")
    t0 = d.begin_fault(f"API server +{latency:g}s per request, {seconds:g}s")
    for p in proxies.api.values():
        p.delay = latency
    try:
        with churn(d):
            _hold(d, seconds, "slow API server")
    finally:
        for p in proxies.api.values():
            p.delay = 0.0
        d.end_fault()
    d.fault["latency_s"] = latency
    d.fault["slow_s"] = round(d.fault_seconds(), 1)
    return t0


def _partition(d: Drill, which: str) -> float:
    proxies = d.proxies
    assert proxies is not None
    leader, epoch = d.wait_leader()
    index = LocalTarget.index_of(leader)
    if index is None:
        raise DrillError(f"the leader {leader} is not one of this drill's replicas")
    if d.options.victim == "standby":
        index = next(i for i in sorted(proxies.api) if i != index)
    victim = proxies.etcd[index] if which == "etcd" else proxies.api[index]
    other = "the API server" if which == "etcd" else "the locks' etcd"
    server = "the locks' etcd" if which == "etcd" else "the API server"
    seconds = d.options.partition_seconds
    d.disturb()
    d.say(f"cutting replica {index} ({d.options.victim}; leader {leader}, epoch {epoch}) "
          f"off {server} for {seconds:.0f}s; it still reaches {other}")
    t0 = d.begin_fault(f"replica {index} ({d.options.victim}) cut off {server} "
                       f"{seconds:g}s")
    victim.cut()
    try:
        with churn(d):
            _hold(d, seconds, "partition")
    finally:
        victim.heal()
        d.end_fault()
    d.fault["victim"] = f"replica {index} ({d.options.victim})"
    d.fault["cut_s"] = round(d.fault_seconds(), 1)
    return t0


def partition_etcd(d: Drill, log: LeaderLog) -> float:
    return _partition(d, "etcd")


def partition_api(d: Drill, log: LeaderLog) -> float:
    return _partition(d, "api")


def etcd_member_kill(d: Drill, log: LeaderLog) -> float:
    proxies = d.proxies
    assert proxies is not None and proxies.members
    d.wait_leader()
    d.disturb()
    victim = proxies.members[0]  # every replica names it first
    seconds = d.options.outage_seconds
    d.say(f"killing etcd member {victim.name} ({victim.url}, the endpoint every replica "
          f"names first) for {seconds:.0f}s; two members keep quorum")
    t0 = d.begin_fault(f"etcd member {victim.name} of 3 killed {seconds:g}s")
    victim.kill()
    try:
        with churn(d):
            _hold(d, seconds - (time.monotonic() - t0), "one etcd member down")
    finally:
        d.say(f"starting {victim.name} again on its data")
        victim.start()
        d.end_fault()
    config = EtcdConfig(endpoints=(victim.url,), timeout=2)
    deadline = time.monotonic() + 60
    while not quorum(config) and time.monotonic() < deadline:
        time.sleep(0.3)
    d.fault["member killed"] = f"{victim.name} (first endpoint)"
    d.fault["member down_s"] = round(d.fault_seconds(), 1)
    d.fault["member answering again"] = quorum(config)
    return t0


FAULTS = {
    "etcd-outage": etcd_outage,
    "slow-api": slow_api,
    "partition-etcd": partition_etcd,
    "partition-api": partition_api,
    "etcd-member-kill": etcd_member_kill,
}
