"""The invariant, checked against any cluster: what ``neonvm check`` and every drill end with.

One *pass* reads, in this order: the locks (when the locks' etcd is configured), the
runner pods, the VMs, the runner pods again. Every read is a quorum read (no
``resourceVersion``), so each list is one consistent snapshot, and the order makes each
judgement sound:

* **duplicate** (strict and loose): a VM with more than one live runner pod in *one* pod
  list. Strict: ungated and not gone (a terminating pod counts: its guest may still run).
  Loose: terminating pods ignored. One list is one etcd revision, so this is always a real
  violation, never an artefact of timing.
* **pod-missing**: a VM names ``status.podName`` (and ``podUID``) that is absent from the
  pod list taken *after* the VM was read. Pod names are never reused, so the pod is gone.
* **orphan-pod**: a pod labelled for a VM (name and uid) that is absent from the VM list
  taken *after* the pod list, and that is not terminating within its grace period.
* **orphan-lock**: a lock naming a VM uid that is absent from the VM list taken *after*
  the locks were read.
* **stuck**: a plan pending, a VM not planned, or a deletion unfinished, for provably
  longer than ``max_pending_seconds``. "Provably": the age used is a lower bound taken
  from the API server's own clock: a plan is at least as old as the VM's last status write
  and as its pod; an unplanned VM at least as old as its last status write and its
  creation; a deletion as old as its ``deletionTimestamp``.

What is guaranteed: every *duplicate* reported was real at the revision of the list it
came from. The other findings can be transient (a pod deleted a moment ago, a lock the
leader sweeps every so often): :func:`check` with ``settle > 0`` takes a second pass that
long after the first and reports only findings present in both (same pod uid, lock
token, plan name). What is not guaranteed: that a duplicate lasting less than the time
between two lists is seen; the drills watch every revision for that
(:mod:`neonvm.drills.observer`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import email.utils
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kubernetes import client

from neonvm.api import types
from neonvm.invariant import live_pods_by_vm

if TYPE_CHECKING:
    from neonvm.leader.etcd import EtcdConfig

DUPLICATE = "duplicate"
DUPLICATE_LOOSE = "duplicate-loose"
POD_MISSING = "pod-missing"
ORPHAN_POD = "orphan-pod"
ORPHAN_LOCK = "orphan-lock"
STUCK = "stuck"
SAFETY_KINDS = (DUPLICATE, DUPLICATE_LOOSE)
"""Findings that break the promise itself; the rest are about convergence and clean-up."""


@dataclass(frozen=True)
class Finding:
    """One violation: what kind, which VM, which objects, in words."""

    kind: str
    vm: str
    """``namespace/name``."""
    objects: tuple[str, ...]
    detail: str
    identity: str
    """What must be the same in two passes for the finding to be confirmed."""

    @property
    def safety(self) -> bool:
        return self.kind in SAFETY_KINDS


@dataclass(frozen=True)
class LockView:
    """A lock as the checker needs it (read from the locks' etcd)."""

    namespace: str
    name: str
    vm_uid: str | None
    holder: str | None
    token: int


@dataclass
class ClusterSnapshot:
    """One pass: locks, pods, VMs, pods again, and the API server's clock."""

    pods_before: list[Any]
    vms: list[dict[str, Any]]
    pods_after: list[Any]
    locks: list[LockView] | None
    """None: the locks' etcd was not configured, locks were not checked."""
    server_now: dt.datetime


@dataclass
class CheckReport:
    """The outcome of :func:`check`: counts, findings, and what was not checked."""

    vms: int = 0
    pods: int = 0
    locks: int | None = None
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    passes: int = 1

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def duplicates(self) -> list[Finding]:
        return [f for f in self.findings if f.kind == DUPLICATE]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        out["findings"] = [{**asdict(f), "objects": list(f.objects), "safety": f.safety}
                           for f in self.findings]
        return out


# ---- reading -----------------------------------------------------------------------------


LockReader = Callable[[], list[LockView]]


def etcd_lock_reader(endpoints: str | EtcdConfig | None = None) -> LockReader | None:
    """Reads locks from ``endpoints`` (or a whole config) or ``$NEONVM_ETCD_*``; None when
    no endpoints are set."""
    import os

    from neonvm.leader.etcd import Etcd, EtcdConfig
    from neonvm.leader.lock import LockTable

    if not endpoints and not os.environ.get("NEONVM_ETCD_ENDPOINTS", "").strip():
        return None
    config = EtcdConfig.from_env()
    if isinstance(endpoints, EtcdConfig):
        config = endpoints
    elif endpoints:
        config = config.with_overrides(endpoints=endpoints)
    config.validate()

    def read() -> list[LockView]:
        with Etcd(config) as etcd:
            return [LockView(i.namespace, i.name, i.record.vm_uid if i.record else None,
                             i.record.holder if i.record else None, i.token)
                    for i in LockTable(etcd, config.prefix).list()]

    return read


def _list_pods(core: client.CoreV1Api, namespace: str | None) -> list[Any]:
    if namespace:
        resp = core.list_namespaced_pod(namespace, label_selector=types.LABEL_VM_NAME,
                                        _request_timeout=30)
    else:
        resp = core.list_pod_for_all_namespaces(label_selector=types.LABEL_VM_NAME,
                                                _request_timeout=30)
    items: list[Any] = resp.items
    return items


def _list_vms(api: client.ApiClient, namespace: str | None
              ) -> tuple[list[dict[str, Any]], dt.datetime]:
    """VMs (raw) and the API server's clock from the response's Date header."""
    custom = client.CustomObjectsApi(api)
    if namespace:
        resp = custom.list_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL,
            _preload_content=False, _request_timeout=30)
    else:
        resp = custom.list_cluster_custom_object(
            types.GROUP, types.VERSION, types.PLURAL, _preload_content=False,
            _request_timeout=30)
    try:
        body = json.loads(resp.data)
        date = resp.headers.get("Date") if resp.headers else None
    finally:
        resp.release_conn()
    now = dt.datetime.now(dt.UTC)
    if date:
        with contextlib.suppress(TypeError, ValueError):
            now = email.utils.parsedate_to_datetime(date)
    items: list[dict[str, Any]] = body.get("items") or []
    return items, now


def take_snapshot(api: client.ApiClient, namespace: str | None = None,
                  locks: LockReader | None = None) -> ClusterSnapshot:
    """One pass, in the order the module docstring explains."""
    core = client.CoreV1Api(api)
    lock_views = locks() if locks is not None else None
    if lock_views is not None and namespace:
        lock_views = [lk for lk in lock_views if lk.namespace == namespace]
    before = _list_pods(core, namespace)
    vms, now = _list_vms(api, namespace)
    after = _list_pods(core, namespace)
    return ClusterSnapshot(before, vms, after, lock_views, now)


# ---- judging (pure) ----------------------------------------------------------------------


def _parse_time(value: Any) -> dt.datetime | None:
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.UTC)
    if not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def last_status_write(vm: dict[str, Any]) -> dt.datetime | None:
    """The latest ``managedFields`` time of a ``status`` write (server clock)."""
    times = [_parse_time(m.get("time")) for m in (vm.get("metadata") or {}).get(
        "managedFields") or [] if m.get("subresource") == "status"]
    known = [t for t in times if t is not None]
    return max(known) if known else None


def duplicate_findings(pods: Iterable[Any], revision_note: str = "") -> list[Finding]:
    """VMs with more than one live runner pod in one pod list (strict and loose)."""
    items = list(pods)
    out = []
    for strict, kind in ((True, DUPLICATE), (False, DUPLICATE_LOOSE)):
        for vm, names in sorted(live_pods_by_vm(items, strict).items()):
            if len(names) > 1:
                form = "ungated and not gone" if strict else "ungated, not terminating"
                out.append(Finding(kind, vm, tuple(sorted(names)),
                                   f"{len(names)} live runner pods ({form}){revision_note}",
                                   f"{kind}:{vm}:{','.join(sorted(names))}"))
    return out


def evaluate(snap: ClusterSnapshot, max_pending_seconds: float) -> list[Finding]:
    """Every finding of one pass (see the module docstring for each kind)."""
    findings = duplicate_findings(snap.pods_before)
    seen = {f.identity for f in findings}
    findings += [f for f in duplicate_findings(snap.pods_after) if f.identity not in seen]
    now = snap.server_now
    vms_by_key = {f"{v['metadata']['namespace']}/{v['metadata']['name']}": v for v in snap.vms}
    vm_uids = {str(v["metadata"].get("uid")) for v in snap.vms}
    pods_after = {(p.metadata.namespace, p.metadata.name): p for p in snap.pods_after}

    for key, vm in sorted(vms_by_key.items()):
        meta, status = vm["metadata"], vm.get("status") or {}
        namespace = meta["namespace"]
        phase = status.get("phase")
        deleting = _parse_time(meta.get("deletionTimestamp"))
        last_write = last_status_write(vm)
        if deleting is not None:
            age = (now - deleting).total_seconds()
            if age > max_pending_seconds:
                findings.append(Finding(
                    STUCK, key, (), f"deletion unfinished for at least {age:.0f}s "
                    f"(finalizers {meta.get('finalizers')})", f"{STUCK}:{meta.get('uid')}:delete"))
            continue
        pod_name = status.get("podName") or None
        if pod_name and phase not in ("Succeeded", "Failed"):
            pod = pods_after.get((namespace, pod_name))
            pod_uid = status.get("podUID")
            if pod is None:
                findings.append(Finding(
                    POD_MISSING, key, (pod_name,),
                    f"status.podName {pod_name} does not exist (pod list read after the VM)",
                    f"{POD_MISSING}:{meta.get('uid')}:{pod_name}"))
            elif pod_uid and pod.metadata.uid != pod_uid:
                findings.append(Finding(
                    POD_MISSING, key, (pod_name,),
                    f"status.podUID {pod_uid} but pod {pod_name} has uid {pod.metadata.uid}",
                    f"{POD_MISSING}:{meta.get('uid')}:{pod_name}:{pod.metadata.uid}"))
        pending = status.get("pendingPod") or None
        if pending:
            bounds = [t for t in (last_write,) if t is not None]
            pod = pods_after.get((namespace, pending.get("name")))
            if pod is not None and pod.metadata.creation_timestamp is not None:
                bounds.append(_parse_time(pod.metadata.creation_timestamp) or now)
            if bounds:
                age = (now - min(bounds)).total_seconds()
                if age > max_pending_seconds:
                    findings.append(Finding(
                        STUCK, key, (str(pending.get("name")),),
                        f"plan {pending.get('name')} pending for at least {age:.0f}s",
                        f"{STUCK}:{meta.get('uid')}:pending:{pending.get('name')}"))
        elif not pod_name and phase not in ("Succeeded", "Failed"):
            created = _parse_time(meta.get("creationTimestamp"))
            bounds = [t for t in (last_write, created) if t is not None]
            if bounds:
                age = (now - max(bounds)).total_seconds()
                if age > max_pending_seconds:
                    findings.append(Finding(
                        STUCK, key, (), f"no runner pod planned for at least {age:.0f}s",
                        f"{STUCK}:{meta.get('uid')}:unplanned:{status.get('planSeq', 0)}"))

    for pod in snap.pods_before:
        labels = pod.metadata.labels or {}
        vm_name = labels.get(types.LABEL_VM_NAME)
        vm_uid = labels.get(types.LABEL_VM_UID)
        key = f"{pod.metadata.namespace}/{vm_name}"
        owner = vms_by_key.get(key)
        if owner is not None and (vm_uid is None
                                  or str(owner["metadata"].get("uid")) == vm_uid):
            continue
        deadline = _parse_time(pod.metadata.deletion_timestamp)
        if deadline is not None and deadline > now:
            continue  # on its way out, within its grace period
        why = "no such VM" if owner is None else f"the VM {key} has another uid"
        findings.append(Finding(
            ORPHAN_POD, key, (pod.metadata.name,),
            f"runner pod {pod.metadata.name} ({why}; labelled uid {vm_uid})"
            + (" still terminating past its grace period" if deadline else ""),
            f"{ORPHAN_POD}:{pod.metadata.uid}"))

    for lock in snap.locks or []:
        if lock.vm_uid is None or lock.vm_uid in vm_uids:
            continue
        findings.append(Finding(
            ORPHAN_LOCK, f"{lock.namespace}/{lock.name}", (f"token {lock.token}",),
            f"lock held by {lock.holder} for VM uid {lock.vm_uid}, which does not exist",
            f"{ORPHAN_LOCK}:{lock.namespace}/{lock.name}:{lock.token}"))
    return findings


# ---- the check -------------------------------------------------------------------------


def check(api: client.ApiClient, *, namespace: str | None = None,
          locks: LockReader | None = None, max_pending_seconds: float = 120.0,
          settle: float = 0.0, sleep: Callable[[float], None] = time.sleep) -> CheckReport:
    """Judge the cluster (or one namespace); see the module docstring for ``settle``."""
    snap = take_snapshot(api, namespace, locks)
    findings = evaluate(snap, max_pending_seconds)
    report = CheckReport(vms=len(snap.vms), pods=len(snap.pods_after),
                         locks=None if snap.locks is None else len(snap.locks))
    if snap.locks is None:
        report.notes.append("locks not checked (set NEONVM_ETCD_ENDPOINTS or "
                            "--etcd-endpoints)")
    if settle > 0 and any(not f.safety for f in findings):
        sleep(settle)
        second = evaluate(take_snapshot(api, namespace, locks), max_pending_seconds)
        report.passes = 2
        again = {f.identity for f in second}
        confirmed = [f for f in findings if f.safety or f.identity in again]
        dropped = sum(1 for f in findings if not f.safety and f.identity not in again)
        known = {f.identity for f in confirmed}
        confirmed += [f for f in second if f.safety and f.identity not in known]
        if dropped:
            report.notes.append(f"{dropped} transient finding(s) resolved within {settle:g}s")
        findings = confirmed
    report.findings = findings
    return report
