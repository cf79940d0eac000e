"""One snapshot of everything an SRE looks at: leader, VMs, their runner pods, locks.

Used by ``neonvm status`` (``-o json|yaml|table``) and the demo's live view. Reads go
straight to the API server (and the locks' etcd when configured); nothing is cached.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kubernetes import client

from neonvm.api import types


@dataclass
class LeaderRow:
    holder: str | None
    epoch: int
    renewed_ago_s: float | None


@dataclass
class VMRow:
    namespace: str
    name: str
    phase: str | None
    pod: str | None
    pending: str | None
    restarts: int
    live_pods: int
    """Pods labelled for the VM that are ungated and not gone (strict form)."""


@dataclass
class PodRow:
    namespace: str
    name: str
    vm: str
    phase: str
    gated: bool
    terminating: bool
    node: str | None


@dataclass
class Overview:
    leader: LeaderRow | None
    vms: list[VMRow] = field(default_factory=list)
    pods: list[PodRow] = field(default_factory=list)
    locks: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def duplicates(self) -> list[str]:
        """VMs with more than one live runner pod: must always be empty."""
        return [f"{v.namespace}/{v.name}" for v in self.vms if v.live_pods > 1]


def _gated(pod: client.V1Pod) -> bool:
    gates = pod.spec.scheduling_gates or []
    return any(g.name == types.SCHEDULING_GATE for g in gates)


def collect(
    api: client.ApiClient,
    lease_namespace: str = "neonvm-system",
    lease_name: str = "neonvm-controller",
    locks: Callable[[], list[dict[str, Any]]] | None = None,
) -> Overview:
    """Read the current state from the API server (and locks, if a reader is given)."""
    leader = None
    try:
        lease = client.CoordinationV1Api(api).read_namespaced_lease(lease_name, lease_namespace)
        renew = lease.spec.renew_time
        ago = (
            (datetime.datetime.now(datetime.UTC) - renew).total_seconds() if renew else None
        )
        leader = LeaderRow(lease.spec.holder_identity, lease.spec.lease_transitions or 0, ago)
    except client.ApiException as e:
        if e.status != 404:
            raise
    pods = client.CoreV1Api(api).list_pod_for_all_namespaces(
        label_selector=types.LABEL_VM_NAME
    ).items
    pod_rows = [
        PodRow(
            namespace=p.metadata.namespace,
            name=p.metadata.name,
            vm=p.metadata.labels.get(types.LABEL_VM_NAME, ""),
            phase=p.status.phase or "Pending",
            gated=_gated(p),
            terminating=p.metadata.deletion_timestamp is not None,
            node=p.spec.node_name,
        )
        for p in pods
    ]
    vm_objs = client.CustomObjectsApi(api).list_cluster_custom_object(
        types.GROUP, types.VERSION, types.PLURAL
    )["items"]
    vm_rows = []
    for obj in vm_objs:
        meta, status = obj["metadata"], obj.get("status") or {}
        live = [
            p for p in pod_rows
            if p.namespace == meta["namespace"] and p.vm == meta["name"] and not p.gated
            and p.phase not in ("Succeeded", "Failed")
        ]
        vm_rows.append(
            VMRow(
                namespace=meta["namespace"],
                name=meta["name"],
                phase=status.get("phase"),
                pod=status.get("podName") or None,
                pending=(status.get("pendingPod") or {}).get("name"),
                restarts=status.get("restartCount", 0),
                live_pods=len(live),
            )
        )
    return Overview(
        leader=leader, vms=vm_rows, pods=pod_rows, locks=locks() if locks is not None else []
    )


def render(ov: Overview) -> str:
    """A compact text view (the demo's screen)."""
    lines = []
    if ov.leader is None:
        lines.append("LEADER   (no lease yet)")
    else:
        ago = f"{ov.leader.renewed_ago_s:.1f}s ago" if ov.leader.renewed_ago_s is not None else "-"
        lines.append(f"LEADER   {ov.leader.holder or '(released)'}  epoch {ov.leader.epoch}  "
                     f"renewed {ago}")
    lines.append("")
    lines.append(f"{'VM':<34} {'PHASE':<10} {'POD':<44} {'PENDING':<20} RESTARTS  LIVE")
    for v in ov.vms:
        lines.append(f"{v.namespace + '/' + v.name:<34} {v.phase or '-':<10} {v.pod or '-':<44} "
                     f"{v.pending or '-':<20} {v.restarts:<9} {v.live_pods}")
    lines.append("")
    lines.append(f"{'POD':<50} {'PHASE':<10} {'GATED':<6} {'TERMINATING':<12} NODE")
    for p in ov.pods:
        lines.append(f"{p.namespace + '/' + p.name:<50} {p.phase:<10} {p.gated!s:<6} "
                     f"{p.terminating!s:<12} {p.node or '-'}")
    if ov.locks:
        lines.append("")
        lines.append(f"{'LOCK':<40} {'HOLDER':<36} EPOCH  TOKEN")
        for lk in ov.locks:
            lines.append(f"{lk.get('key', ''):<40} {lk.get('holder', ''):<36} "
                         f"{lk.get('epoch', ''):<6} {lk.get('token', '')}")
    dup = ov.duplicates
    lines.append("")
    lines.append(f"duplicates: {', '.join(dup) if dup else 'none'}")
    return "\n".join(lines)
