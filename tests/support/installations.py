"""Two controller installations side by side on one locks etcd and ONE key prefix.

Each installation has its own namespace, which it watches (``--watch-namespace``) and
where its Lease lives, and its own Lease name; both pass the same ``--etcd-prefix``. For
``duration`` seconds VMs are created (and some deleted) in both namespaces while sweeps
run every few seconds. Measured:

* **locks removed by the other installation**, from the replicas' own logs: a replica
  logs every lock it sweeps with the VM's ``namespace/name``; a swept VM outside the
  replica's watch namespace belongs to the other installation. Must be 0.
* **live locks deleted**, from a watch on the locks etcd: a lock key deleted while its VM
  (same uid) still existed and was not being deleted, whatever deleted it. Must be 0 in
  this run (no replica dies, so no lease expires).
* each installation's **convergence** at the end (every VM it should have: one ungated
  pod named in status), and its **epoch** (its own floor key and its Lease's
  transitions).

Used by the real-server test (a short run) and by ``python -m benchmarks.side_by_side``
(the 5-minute run). Nothing here is used by the controller itself.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from neonvm.drills import fleet
from neonvm.leader.epoch import EpochFloor
from neonvm.leader.etcd import Etcd, EtcdConfig, EtcdError
from neonvm.leader.lock import Installation, LockRecord, parse_lock_key
from tests.support.harness import Replicas, get_vm

Progress = Callable[[str], None]

ARGS = ["--lease-duration", "6", "--renew-deadline", "4", "--retry-period", "1",
        "--plan-requeue", "1", "--resync", "10", "--sweep", "3", "--workers", "2"]
"""Sweeps every 3 s: about 100 sweeps per installation in 5 minutes."""

SWEPT = "swept the lock of a VM that no longer exists"


@dataclass
class InstallationResult:
    installation: str
    namespace: str
    vms: int = 0
    converged: int = 0
    waiting: dict[str, str] = field(default_factory=dict)
    created: int = 0
    deleted: int = 0
    own_sweeps: int = 0
    removed_by_other: list[str] = field(default_factory=list)
    """This installation's locks that the other installation's replicas swept."""
    live_locks_deleted: list[str] = field(default_factory=list)
    """Its locks deleted while their VM existed (any cause)."""
    lease_transitions: int | None = None
    floor_epoch: int | None = None


@dataclass
class SideBySideReport:
    duration: float
    prefix: str
    results: list[InstallationResult]

    @property
    def ok(self) -> bool:
        return all(not r.removed_by_other and not r.live_locks_deleted and not r.waiting
                   and r.converged == r.vms for r in self.results)

    def text(self) -> str:
        lines = [f"two installations, one locks etcd, one prefix {self.prefix}, "
                 f"{self.duration:.0f} s side by side"]
        for r in self.results:
            lines.append(
                f"  {r.installation} (watches {r.namespace}): "
                f"VMs converged {r.converged}/{r.vms} (created {r.created}, deleted "
                f"{r.deleted}); locks removed by the other installation: "
                f"{len(r.removed_by_other)}; live locks deleted: "
                f"{len(r.live_locks_deleted)}; own sweeps of deleted VMs' locks: "
                f"{r.own_sweeps}; Lease transitions {r.lease_transitions}, "
                f"epoch floor {r.floor_epoch}")
            for what in (*r.removed_by_other[:5], *r.live_locks_deleted[:5]):
                lines.append(f"    {what}")
            for name, why in list(r.waiting.items())[:5]:
                lines.append(f"    not converged: {name}: {why}")
        lines.append("verdict: " + ("PASS" if self.ok else "FAIL"))
        return "\n".join(lines)


class _LockWatcher:
    """Every lock deletion under the prefix whose VM was alive when it happened."""

    def __init__(self, etcd: Etcd, prefix: str, api: client.ApiClient) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.api = api
        self.live_deleted: dict[str, list[str]] = {}
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="lock-watch")

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        revision = self.etcd.get_prefix(self.prefix + "/").revision
        while not self.stop.is_set():
            try:
                stream = self.etcd.watch(self.prefix + "/", prefix=True,
                                         start_revision=revision + 1, timeout=2.0)
                try:
                    for event in stream:
                        revision = max(revision, event.revision)
                        if event.kind == "delete":
                            self._deleted(event.prev or event.kv, event.revision)
                finally:
                    stream.close()
            except EtcdError:
                time.sleep(0.5)

    def _deleted(self, kv: Any, revision: int) -> None:
        parsed = parse_lock_key(kv.key, self.prefix)
        if parsed is None or not kv.value:
            return
        installation, namespace, name = parsed
        try:
            uid = LockRecord.decode(kv.value).vm_uid
        except ValueError:
            return
        vm = fleet.retrying(lambda: get_vm(self.api, namespace, name), timeout=30)
        meta = (vm or {}).get("metadata") or {}
        if meta.get("uid") == uid and not meta.get("deletionTimestamp"):
            self.live_deleted.setdefault(str(installation), []).append(
                f"revision {revision}: lock of live VM {namespace}/{name} deleted")


def _swept(log_path: Path) -> Iterator[str]:
    """The ``namespace/name`` of every lock a replica's JSON log says it swept."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return
    for line in text.splitlines():
        if SWEPT not in line:
            continue
        with contextlib.suppress(ValueError):
            yield str(json.loads(line).get("vm", ""))


def run_side_by_side(api: client.ApiClient, kubeconfig: Path,
                     locks_etcd: str | Callable[[str], EtcdConfig],
                     log_dir: Path, *, duration: float, vms: int = 4,
                     churn_every: float = 20.0, replicas_each: int = 1,
                     converge_timeout: float = 180.0, prefix: str | None = None,
                     replica_env: dict[str, str] | None = None,
                     progress: Progress = lambda _m: None) -> SideBySideReport:
    """Run the scenario of the module doc; always stops its replicas and drops its
    namespaces. ``kubeconfig`` is the controller's identity; ``replica_env`` is added to
    the replicas' environment (say, a ``PYTHONPATH`` to run another version of them).
    ``locks_etcd`` is the endpoints, or a function giving the whole config for a prefix
    (``LocalCluster.locks_etcd_config``: its etcd wants a client certificate)."""
    tag = uuid.uuid4().hex[:6]
    prefix = prefix or f"/side-by-side-{tag}"
    sides = [(f"sbs-a-{tag}", "controller-a"), (f"sbs-b-{tag}", "controller-b")]
    results = [InstallationResult(str(Installation(ns, lease)), ns) for ns, lease in sides]
    config = (EtcdConfig.from_env({}).with_overrides(endpoints=locks_etcd, prefix=prefix)
              if isinstance(locks_etcd, str) else locks_etcd(prefix))
    etcd = Etcd(config)
    groups: list[Replicas] = []
    watcher = _LockWatcher(etcd, prefix, api)
    names: dict[str, list[str]] = {ns: [] for ns, _ in sides}
    counter = 0
    try:
        for ns, lease in sides:
            fleet.ensure_namespace(api, ns)
            group = Replicas(api=api, kubeconfig=kubeconfig, etcd_endpoints=config,
                             lease_namespace=ns, lease_name=lease, log_dir=log_dir / ns,
                             extra_args=[*ARGS, "--lease-name", lease, "--watch-namespace",
                                         ns, "--etcd-prefix", prefix])
            groups.append(group)
            for i in range(replicas_each):
                group.start(f"{lease}-{i}", env=replica_env)
        watcher.start()
        for ns, _ in sides:
            batch = [f"vm-{counter + i}" for i in range(vms)]
            fleet.create_vms(api, ns, batch)
            names[ns] += batch
        counter += vms
        for r in results:
            r.created = vms
        progress(f"{len(sides)} installations under prefix {prefix}, {vms} VMs each; "
                 f"running {duration:.0f} s")
        started = time.monotonic()
        next_churn = started + churn_every
        while (now := time.monotonic()) - started < duration:
            for group in groups:
                for replica in group:
                    if not replica.running():
                        raise RuntimeError(f"replica {replica.name} exited "
                                           f"({replica.exit_code()}):\n{replica.log()[-3000:]}")
            if now >= next_churn:
                next_churn += churn_every
                # Each side gets a new VM and loses its oldest: locks are taken and
                # released all along, while the other side sweeps.
                for (ns, _), r in zip(sides, results, strict=True):
                    new = f"vm-{counter}"
                    fleet.create_vms(api, ns, [new])
                    names[ns].append(new)
                    old = names[ns].pop(0)
                    fleet.delete_vms(api, ns, [old])
                    r.created += 1
                    r.deleted += 1
                counter += 1
                progress(f"{now - started:.0f}s: churn (one VM created and one deleted "
                         f"per installation)")
            time.sleep(1.0)
        progress("waiting for each installation to converge its VMs")
        for (ns, _), r in zip(sides, results, strict=True):
            _done, _secs, state = fleet.wait_converged(api, ns, names[ns], converge_timeout,
                                                       progress)
            r.vms, r.converged, r.waiting = state.total, len(state.converged), state.waiting
        watcher.close()
        for (ns, lease), r, group in zip(sides, results, groups, strict=True):
            for replica in group:
                for vm in _swept(replica.log_path):
                    if vm.partition("/")[0] == ns:
                        r.own_sweeps += 1
                    else:
                        other = next(o for o in results if o.namespace != ns)
                        other.removed_by_other.append(
                            f"{replica.name} ({r.installation}) swept the lock of {vm}")
            r.live_locks_deleted = watcher.live_deleted.get(r.installation, [])
            floor = EpochFloor(etcd, prefix, Installation(ns, lease)).current()
            r.floor_epoch = floor.epoch if floor else None
            with contextlib.suppress(Exception):
                lease_obj = client.CoordinationV1Api(api).read_namespaced_lease(lease, ns)
                r.lease_transitions = lease_obj.spec.lease_transitions
        return SideBySideReport(duration, prefix, results)
    finally:
        watcher.stop.set()
        for group in groups:
            for replica in group:
                replica.terminate(timeout=20)
        for ns, _ in sides:
            with contextlib.suppress(Exception):
                fleet.drop_namespace(api, ns)
        with contextlib.suppress(EtcdError):
            for kv in etcd.get_prefix(prefix + "/").kvs:
                etcd.delete(kv.key)
        etcd.close()
