"""``neonvm vm list|get|plan``: what the controller recorded for each VM, and what it would
do next.

All reads are direct (quorum) reads of the API server. ``-n`` defaults to the kubeconfig
context's namespace, as in kubectl; ``list`` and ``get`` take ``-o name`` (prints
``virtualmachine.vm.neon.tech/<name>``) and ``list`` takes ``-o wide`` (adds the node, the
pod IP and the root disk image). ``plan`` runs the controller's own
pure decision function on a fresh observation and prints the action it would take now;
it writes nothing.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import click
from kubernetes import client

from neonvm import kube
from neonvm.api import types
from neonvm.cli.kubeflags import kube_options, namespace_of, namespace_option
from neonvm.cli.output import OUTPUT_OPTION, emit, object_name, output_option
from neonvm.controller import decide as d
from neonvm.controller.observe import DirectReader, Snapshot, pod_view

LIST_COLUMNS = ["namespace", "name", "phase", "podName", "pendingPod", "restarts", "planSeq",
                "fence", "ready", "age"]
WIDE_COLUMNS = [*LIST_COLUMNS, "node", "podIP", "image"]

_NAMESPACE = namespace_option()


@click.group("vm")
def vm() -> None:
    """Inspect VirtualMachines: recorded plan, committed pod, fence, conditions."""


def vm_object_name(name: str) -> str:
    """``virtualmachine.vm.neon.tech/<name>``, as ``kubectl get -o name`` prints it."""
    return object_name(types.KIND, types.GROUP, name)


def _age(created: str | None, now: dt.datetime) -> str | None:
    if not created:
        return None
    seconds = int((now - dt.datetime.fromisoformat(created.replace("Z", "+00:00")))
                  .total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(0, seconds)}s"


def summary(raw: dict[str, Any], now: dt.datetime | None = None) -> dict[str, Any]:
    """One row of ``vm list``."""
    now = now or dt.datetime.now(dt.UTC)
    meta = raw.get("metadata") or {}
    status = raw.get("status") or {}
    fence = status.get("fence")
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    pending = status.get("pendingPod")
    return {
        "namespace": meta.get("namespace"),
        "name": meta.get("name"),
        "phase": ("Deleting" if meta.get("deletionTimestamp") else status.get("phase")),
        "podName": status.get("podName") or None,
        "pendingPod": pending.get("name") if pending else None,
        "restarts": status.get("restartCount", 0),
        "planSeq": status.get("planSeq", 0),
        "fence": f"{fence.get('epoch', 0)}/{fence.get('token', 0)}" if fence else None,
        "ready": ready.get("status") if ready else None,
        "age": _age(meta.get("creationTimestamp"), now),
    }


def wide_summary(raw: dict[str, Any], now: dt.datetime | None = None) -> dict[str, Any]:
    """One row of ``vm list -o wide``: the summary plus node, pod IP and disk image."""
    status = raw.get("status") or {}
    disk = ((raw.get("spec") or {}).get("guest") or {}).get("rootDisk") or {}
    return {**summary(raw, now), "node": status.get("node"), "podIP": status.get("podIP"),
            "image": disk.get("image")}


def _list(api: client.ApiClient, namespace: str | None) -> list[dict[str, Any]]:
    custom = client.CustomObjectsApi(api)
    if namespace is None:
        body = custom.list_cluster_custom_object(types.GROUP, types.VERSION, types.PLURAL)
    else:
        body = custom.list_namespaced_custom_object(types.GROUP, types.VERSION, namespace,
                                                    types.PLURAL)
    items: list[dict[str, Any]] = body.get("items") or []
    return items


@vm.command("list")
@_NAMESPACE
@click.option("-A", "--all-namespaces", is_flag=True, help="VMs of every namespace.")
@kube_options
@output_option("wide", "name")
def list_(namespace: str | None, all_namespaces: bool, kubeconfig: Path | None,
          context: str | None, output: str) -> None:
    """List VMs: phase, committed pod, recorded plan, restarts, fence (epoch/token)."""
    scope = None if all_namespaces else namespace_of(namespace, kubeconfig, context)
    api = kube.api_client(kubeconfig, context)
    try:
        items = _list(api, scope)
    finally:
        api.close()
    if output == "name":
        for item in items:
            click.echo(vm_object_name((item.get("metadata") or {}).get("name", "")))
        return
    if output == "wide":
        emit([wide_summary(v) for v in items], "table", WIDE_COLUMNS)
        return
    emit([summary(v) for v in items], output, LIST_COLUMNS)


def _observe(api: client.ApiClient, namespace: str, name: str, lease: d.Fence | None
             ) -> Snapshot:
    reader = DirectReader(api)
    snap = reader.observe(f"{namespace}/{name}", lease or d.Fence(0, 0))
    if snap.record is None:
        raise click.ClickException(f"VirtualMachine {namespace}/{name} not found")
    return snap


def detail(snap: Snapshot) -> dict[str, Any]:
    """What ``vm get`` prints: the summary, conditions and the VM's pods."""
    assert snap.record is not None
    raw = snap.record.raw
    status = raw.get("status") or {}
    out = summary(raw)
    out.update({
        "uid": (raw.get("metadata") or {}).get("uid"),
        "generation": snap.record.vm.generation,
        "observedGeneration": status.get("observedGeneration"),
        "restartPolicy": snap.record.vm.spec.restart_policy,
        "pendingPlan": status.get("pendingPod"),
        "node": status.get("node"),
        "podIP": status.get("podIP"),
        "conditions": [
            {k: c.get(k) for k in ("type", "status", "reason", "message",
                                   "lastTransitionTime")}
            for c in status.get("conditions") or []
        ],
        "pods": [_pod_row(p) for p in snap.pods.values()],
    })
    return out


def _pod_row(pod: dict[str, Any]) -> dict[str, Any]:
    view = pod_view(pod)
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return {
        "name": view.name, "uid": view.uid, "phase": view.phase, "gated": view.gated,
        "terminating": view.terminating, "node": view.node,
        "planSeq": annotations.get(types.ANNOTATION_PLAN_SEQ),
        "fence": f"{annotations.get(types.ANNOTATION_EPOCH, '?')}/"
                 f"{annotations.get(types.ANNOTATION_TOKEN, '?')}",
    }


@vm.command("get")
@click.argument("name")
@_NAMESPACE
@kube_options
@output_option("name")
def get(name: str, namespace: str | None, kubeconfig: Path | None, context: str | None,
        output: str) -> None:
    """One VM in detail: recorded plan, fence, conditions and every pod labelled for it."""
    namespace = namespace_of(namespace, kubeconfig, context)
    api = kube.api_client(kubeconfig, context)
    try:
        info = detail(_observe(api, namespace, name, None))
    finally:
        api.close()
    if output == "name":
        click.echo(vm_object_name(info["name"]))
        return
    if output != "table":
        emit(info, output)
        return
    pods, conditions = info.pop("pods"), info.pop("conditions")
    info.pop("pendingPlan")
    emit([{"field": k, "value": v} for k, v in info.items()], output, ["field", "value"])
    click.echo()
    emit(conditions, output, ["type", "status", "reason", "lastTransitionTime", "message"])
    click.echo()
    emit(pods, output, ["name", "phase", "gated", "terminating", "node", "planSeq", "fence"])


def describe_action(action: d.Action) -> dict[str, Any]:
    fields = {k: v for k, v in action.__dict__.items() if k != "reason"}
    if isinstance(action, d.RecordPlan | d.CreatePod):
        fields["plan"] = action.plan.__dict__
    return {"action": type(action).__name__, "reason": action.reason, **fields}


@vm.command("plan")
@click.argument("name")
@_NAMESPACE
@click.option("--epoch", type=int, default=None,
              help="Leader epoch to decide as (default: the VM's fence epoch).")
@click.option("--token", type=int, default=None,
              help="Lock token to decide as (default: the VM's fence token).")
@kube_options
@OUTPUT_OPTION
def plan(name: str, namespace: str | None, epoch: int | None, token: int | None,
         kubeconfig: Path | None, context: str | None, output: str) -> None:
    """The controller's next action for this VM, from a fresh quorum read (writes nothing)."""
    namespace = namespace_of(namespace, kubeconfig, context)
    api = kube.api_client(kubeconfig, context)
    try:
        snap = _observe(api, namespace, name, None)
        assert snap.record is not None
        fence = snap.record.vm.status.fence
        lease = d.Fence(epoch=epoch if epoch is not None else (fence.epoch if fence else 0),
                        token=token if token is not None else (fence.token if fence else 0))
        snap = Snapshot(obs=d.Observation(
            vm=snap.obs.vm, pods=snap.obs.pods, lease=lease, direct=True,
            create_failed_generation=snap.obs.create_failed_generation),
            record=snap.record, pods=snap.pods)
        action = d.decide(snap.obs)
    finally:
        api.close()
    row = describe_action(action)
    row["as"] = f"epoch {lease.epoch}, token {lease.token}"
    emit(row, output, ["action", "reason", "as"] if output == "table" else None)

