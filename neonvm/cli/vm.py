"""``neonvm vm list|get|describe|plan``: VirtualMachines as kubectl shows them, what the
controller recorded for each, and what it would do next.

All reads are direct (quorum) reads of the API server. ``-n`` defaults to the kubeconfig
context's namespace, as in kubectl. ``list`` and ``get`` print the API objects with ``-o
json|yaml`` (one object, or a ``kind: List``), and take kubectl's ``-o name``, ``-o wide``,
``-o jsonpath=``, ``--no-headers``, ``-w/--watch``; ``list`` takes ``-l/--selector`` and
``-A``. ``describe`` prints what the controller recorded (plan, fence, conditions, every
pod of the VM) and ``plan`` runs the controller's own pure decision function on a fresh
observation and prints the action it would take now (it writes nothing). See
docs/cli.md.
"""

from __future__ import annotations

import datetime as dt
import json
import signal
import sys
from pathlib import Path
from typing import Any

import click
from click.shell_completion import CompletionItem
from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from neonvm import kube
from neonvm.api import types
from neonvm.cli.exits import CliFailure, ExitCode
from neonvm.cli.kubeflags import (
    COMPLETION_TIMEOUT,
    cluster_client,
    kube_options,
    namespace_of,
    namespace_option,
)
from neonvm.cli.output import (
    JSONPATH,
    NO_HEADERS_OPTION,
    SHOW_MANAGED_FIELDS_OPTION,
    as_list,
    column_widths,
    emit,
    emit_objects,
    kube_json,
    kube_yaml,
    no_resources,
    object_name,
    output_option,
    render_jsonpath,
    table_lines,
    without_managed_fields,
)
from neonvm.controller import actions as act
from neonvm.controller import decide as d
from neonvm.controller.cluster import KubeCluster
from neonvm.controller.observe import DirectReader, Snapshot, pod_view

WATCH_SECONDS = 300
"""How long the server keeps one watch open (then it is re-opened where it left off)."""
WATCH_CONNECT_SECONDS = 30.0

LIST_COLUMNS = ["name", "phase", "podName", "pendingPod", "restarts", "planSeq",
                "fence", "available", "age"]
WIDE_COLUMNS = [*LIST_COLUMNS, "node", "podIP", "image"]

_NAMESPACE = namespace_option()


@click.group("vm")
def vm() -> None:
    """Inspect VirtualMachines: the objects, their recorded plan, committed pod, fence and
    conditions, and the controller's next action."""


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
    available = next((c for c in status.get("conditions") or []
                      if c.get("type") == "Available"), None)
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
        "available": available.get("status") if available else None,
        "age": _age(meta.get("creationTimestamp"), now),
    }


def wide_summary(raw: dict[str, Any], now: dt.datetime | None = None) -> dict[str, Any]:
    """One row of ``vm list -o wide``: the summary plus node, pod IP and disk image."""
    status = raw.get("status") or {}
    disk = ((raw.get("spec") or {}).get("guest") or {}).get("rootDisk") or {}
    return {**summary(raw, now), "node": status.get("node"), "podIP": status.get("podIP"),
            "image": disk.get("image")}


def _collection(namespace: str | None) -> str:
    base = f"/apis/{types.GROUP}/{types.VERSION}"
    return (f"{base}/namespaces/{namespace}/{types.PLURAL}" if namespace
            else f"{base}/{types.PLURAL}")


def _typed(obj: dict[str, Any]) -> dict[str, Any]:
    """The object with its apiVersion and kind (as kubectl prints list items)."""
    obj.setdefault("apiVersion", f"{types.GROUP}/{types.VERSION}")
    obj.setdefault("kind", types.KIND)
    return obj


def _list(api: client.ApiClient, namespace: str | None, selector: str | None = None,
          field_selector: str | None = None) -> tuple[list[dict[str, Any]], str]:
    """The VMs (typed) and the list's resourceVersion (where a watch starts)."""
    query = [(k, v) for k, v in (("labelSelector", selector),
                                 ("fieldSelector", field_selector)) if v]
    body = kube.request(api, "GET", _collection(namespace), query=query)
    items = [_typed(i) for i in body.get("items") or []]
    return items, str((body.get("metadata") or {}).get("resourceVersion") or "")


def _complete_vm(ctx: click.Context, _param: click.Parameter,
                 incomplete: str) -> list[CompletionItem]:
    """VM names of the namespace the flags typed so far select (nothing on any error)."""
    params = ctx.params
    try:
        api = kube.api_client(params.get("kubeconfig"), params.get("context"))
        try:
            ns = namespace_of(params.get("namespace"), params.get("kubeconfig"),
                              params.get("context"))
            body = kube.request(api, "GET", _collection(ns), timeout=COMPLETION_TIMEOUT)
        finally:
            api.close()
    except Exception:
        return []
    names = sorted((i.get("metadata") or {}).get("name", "") for i in body.get("items") or [])
    taken = set(params.get("names") or ())
    return [CompletionItem(n) for n in names
            if n and n.startswith(incomplete) and n not in taken]


_SELECTOR = click.option("-l", "--selector", default=None, metavar="SELECTOR",
                         help="Label selector, sent to the API server (e.g. app=db, "
                              "'tier in (a,b)', '!legacy').")
_WATCH = click.option("-w", "--watch", is_flag=True,
                      help="After listing, print each change as it happens until Ctrl-C.")
_WATCH_ONLY = click.option("--watch-only", is_flag=True,
                           help="Print only the changes, not the objects at the start.")
_WATCH_EVENTS = click.option("--output-watch-events", is_flag=True,
                             help="With --watch: print the event type (ADDED, MODIFIED, "
                                  "DELETED) with each object.")


class _Printer:
    """Prints VMs in one ``-o`` format: a listing at once, or one watch event at a time
    (a table keeps its first widths and prints its header once, as kubectl)."""

    def __init__(self, output: str, namespace: str | None, *, all_namespaces: bool,
                 no_headers: bool, events: bool, managed_fields: bool) -> None:
        self.output = output
        self.managed_fields = managed_fields
        self.namespace = namespace
        self.events = events
        self.no_headers = no_headers
        base = WIDE_COLUMNS if output == "wide" else LIST_COLUMNS
        self.columns = [*(["event"] if events else []),
                        *(["namespace"] if all_namespaces else []), *base]
        self.widths: list[int] | None = None
        self.printed = 0

    def _row(self, obj: dict[str, Any], event: str | None) -> dict[str, Any]:
        row = wide_summary(obj) if self.output == "wide" else summary(obj)
        return {"event": event, **row}

    def _shown(self, obj: dict[str, Any]) -> dict[str, Any]:
        return obj if self.managed_fields else without_managed_fields(obj)

    def listing(self, items: list[dict[str, Any]], *, single: bool = False) -> None:
        """What ``list`` and ``get`` print without ``--watch``."""
        if self.output in ("json", "yaml") or self.output.startswith(JSONPATH):
            shown = [self._shown(i) for i in items]
            emit_objects(shown[0] if single and len(shown) == 1 else as_list(shown),
                         self.output)
            return
        if self.output == "name":
            for item in items:
                click.echo(vm_object_name((item.get("metadata") or {}).get("name", "")))
            return
        if not items:
            no_resources(self.namespace)
            return
        for line in table_lines([self._row(i, None) for i in items], self.columns,
                                no_headers=self.no_headers):
            click.echo(line)

    def event(self, kind: str, obj: dict[str, Any]) -> None:
        """One object of a watch (the initial ones are ADDED)."""
        obj = self._shown(obj)
        if self.output == "json":
            click.echo(kube_json({"type": kind, "object": obj} if self.events else obj))
        elif self.output == "yaml":
            if self.printed:
                click.echo("---")
            click.echo(kube_yaml({"type": kind, "object": obj} if self.events else obj),
                       nl=False)
        elif self.output.startswith(JSONPATH):
            click.echo(render_jsonpath(self.output, obj), nl=False)
        elif self.output == "name":
            name = vm_object_name((obj.get("metadata") or {}).get("name", ""))
            click.echo(f"{kind} {name}" if self.events else name)
        else:
            row = self._row(obj, kind)
            if self.widths is None:
                self.widths = self._widths([row])
                lines = table_lines([row], self.columns, no_headers=self.no_headers,
                                    widths=self.widths)
            else:
                lines = table_lines([row], self.columns, no_headers=True, widths=self.widths)
            for line in lines:
                click.echo(line)
        self.printed += 1

    def _widths(self, rows: list[dict[str, Any]]) -> list[int]:
        """The widths of the first rows; the EVENT column fits every event type."""
        widths = column_widths(rows, self.columns)
        if self.events:
            widths[0] = max(widths[0], len("MODIFIED"))
        return widths

    def start(self, items: list[dict[str, Any]]) -> None:
        """The objects a watch starts from, as one table (widths fit them all)."""
        if self.output not in ("table", "wide"):
            for item in items:
                self.event("ADDED", item)
            return
        rows = [self._row(i, "ADDED") for i in items]
        if not rows:
            return
        self.widths = self._widths(rows)
        for line in table_lines(rows, self.columns, no_headers=self.no_headers,
                                widths=self.widths):
            click.echo(line)
        self.printed += len(rows)


def _watch(api: client.ApiClient, namespace: str | None, selector: str | None,
           field_selector: str | None, resource_version: str, printer: _Printer) -> None:
    """Stream changes from ``resource_version`` until Ctrl-C. The server ends each watch
    after a while: it is re-opened from the last version seen; if that version is too
    old (410), the VMs are listed again and printed as MODIFIED, then watched from there."""
    lister = kube.Lister(api, _collection(namespace), label_selector=selector,
                         field_selector=field_selector)
    rv = resource_version
    while True:
        resp = lister(watch=True, resource_version=rv, allow_watch_bookmarks=True,
                      timeout_seconds=WATCH_SECONDS,
                      _request_timeout=(WATCH_CONNECT_SECONDS, WATCH_SECONDS + 30))
        try:
            for line in iter_resp_lines(resp):
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") != 410:
                        raise CliFailure(f"watch failed: {obj.get('message')}",
                                         ExitCode.FAILED)
                    items, rv = _list(api, namespace, selector, field_selector)
                    for item in items:
                        printer.event("MODIFIED", item)
                    break
                rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                if kind != "BOOKMARK":
                    printer.event(str(kind), _typed(obj))
        finally:
            kube.release_stream(resp)


def _until_interrupted(run: Any) -> None:
    """Run a watch; Ctrl-C ends it quietly with exit 0 (the stream is closed by the
    watch's own cleanup). SIGINT is taken explicitly, as kubectl does: a process started
    in the background by a non-interactive shell inherits it ignored, and Python then
    never raises KeyboardInterrupt, so ``kill -INT`` from a script would not end it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run()
    except KeyboardInterrupt:
        return
    finally:
        signal.signal(signal.SIGINT, previous)


@vm.command("list")
@_NAMESPACE
@click.option("-A", "--all-namespaces", is_flag=True, help="VMs of every namespace.")
@_SELECTOR
@_WATCH
@_WATCH_ONLY
@_WATCH_EVENTS
@NO_HEADERS_OPTION
@SHOW_MANAGED_FIELDS_OPTION
@kube_options
@output_option("wide", "name", objects=True)
def list_(namespace: str | None, all_namespaces: bool, selector: str | None, watch: bool,
          watch_only: bool, output_watch_events: bool, no_headers: bool,
          show_managed_fields: bool, kubeconfig: Path | None, context: str | None,
          request_timeout: float | None, output: str) -> None:
    """List VMs: phase, committed pod, recorded plan, restarts, fence (epoch/token).

    -o json|yaml prints a List of the VirtualMachine objects, as kubectl get does.
    """
    scope = None if all_namespaces else namespace_of(namespace, kubeconfig, context)
    printer = _Printer(output, scope, all_namespaces=all_namespaces, no_headers=no_headers,
                       events=output_watch_events, managed_fields=show_managed_fields)
    api = cluster_client(kubeconfig, context, request_timeout)
    try:
        items, rv = _list(api, scope, selector)
        if not (watch or watch_only):
            printer.listing(items)
            return
        if not watch_only:
            printer.start(items)
        _until_interrupted(lambda: _watch(api, scope, selector, None, rv, printer))
    finally:
        api.close()


def _observe(api: client.ApiClient, namespace: str, name: str, lease: act.Fence | None
             ) -> Snapshot:
    reader = DirectReader(KubeCluster(api))
    snap = reader.observe(f"{namespace}/{name}", lease or act.Fence(0, 0))
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
            for c in [*(status.get("conditions") or []), *(status.get("extraConditions") or [])]
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
@click.argument("names", metavar="NAME...", nargs=-1, required=True,
                shell_complete=_complete_vm)
@_NAMESPACE
@_WATCH
@_WATCH_ONLY
@_WATCH_EVENTS
@NO_HEADERS_OPTION
@SHOW_MANAGED_FIELDS_OPTION
@kube_options
@output_option("wide", "name", objects=True)
def get(names: tuple[str, ...], namespace: str | None, watch: bool, watch_only: bool,
        output_watch_events: bool, no_headers: bool, show_managed_fields: bool,
        kubeconfig: Path | None, context: str | None, request_timeout: float | None,
        output: str) -> None:
    """VMs by name, as kubectl get: a row each, or the objects with -o json|yaml (the
    object for one name, a List for several).

    A missing VM prints kubectl's NotFound line on stderr and exits 1, after the others
    are printed. `neonvm vm describe` shows the controller's view of one VM.
    """
    if (watch or watch_only) and len(names) > 1:
        raise click.UsageError("--watch takes one NAME (use `vm list -w -l SELECTOR` for "
                               "several)")
    ns = namespace_of(namespace, kubeconfig, context)
    printer = _Printer(output, ns, all_namespaces=False, no_headers=no_headers,
                       events=output_watch_events, managed_fields=show_managed_fields)
    api = cluster_client(kubeconfig, context, request_timeout)
    try:
        found: list[dict[str, Any]] = []
        missing: list[str] = []
        for name in names:
            obj = kube.get_or_none(api, f"{_collection(ns)}/{name}")
            if obj is None:
                missing.append(name)
            else:
                found.append(_typed(obj))
        if watch or watch_only:
            if missing:
                _not_found(missing)
            rv = str((found[0].get("metadata") or {}).get("resourceVersion") or "")
            if not watch_only:
                printer.start(found)
            _until_interrupted(lambda: _watch(api, ns, None, f"metadata.name={names[0]}",
                                              rv, printer))
            return
    finally:
        api.close()
    if found:
        printer.listing(found, single=len(names) == 1)
    if missing:
        _not_found(missing)


def _not_found(names: list[str]) -> None:
    for name in names:
        click.echo(f"Error from server (NotFound): {types.PLURAL}.{types.GROUP} "
                   f'"{name}" not found', err=True)
    sys.exit(int(ExitCode.FAILED))


@vm.command("describe")
@click.argument("name", shell_complete=_complete_vm)
@_NAMESPACE
@kube_options
@output_option()
def describe(name: str, namespace: str | None, kubeconfig: Path | None, context: str | None,
             request_timeout: float | None, output: str) -> None:
    """One VM as the controller sees it: recorded plan, fence, conditions and every pod
    labelled for it."""
    namespace = namespace_of(namespace, kubeconfig, context)
    api = cluster_client(kubeconfig, context, request_timeout)
    try:
        info = detail(_observe(api, namespace, name, None))
    finally:
        api.close()
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


def describe_action(action: act.Action) -> dict[str, Any]:
    fields = {k: v for k, v in action.__dict__.items() if k != "reason"}
    if isinstance(action, act.RecordPlan | act.CreatePod):
        fields["plan"] = action.plan.__dict__
    return {"action": type(action).__name__, "reason": action.reason, **fields}


@vm.command("plan")
@click.argument("name", shell_complete=_complete_vm)
@_NAMESPACE
@click.option("--epoch", type=int, default=None,
              help="Leader epoch to decide as (default: the VM's fence epoch).")
@click.option("--token", type=int, default=None,
              help="Lock token to decide as (default: the VM's fence token).")
@kube_options
@output_option()
def plan(name: str, namespace: str | None, epoch: int | None, token: int | None,
         kubeconfig: Path | None, context: str | None, request_timeout: float | None,
         output: str) -> None:
    """The controller's next action for this VM, from a fresh quorum read (writes nothing)."""
    namespace = namespace_of(namespace, kubeconfig, context)
    api = cluster_client(kubeconfig, context, request_timeout)
    try:
        snap = _observe(api, namespace, name, None)
        assert snap.record is not None
        fence = snap.record.vm.status.fence
        lease = act.Fence(epoch=epoch if epoch is not None else (fence.epoch if fence else 0),
                        token=token if token is not None else (fence.token if fence else 0))
        snap = Snapshot(obs=act.Observation(
            vm=snap.obs.vm, pods=snap.obs.pods, lease=lease, direct=True,
            create_failed_generation=snap.obs.create_failed_generation),
            record=snap.record, pods=snap.pods)
        action = d.decide(snap.obs)
    finally:
        api.close()
    row = describe_action(action)
    row["as"] = f"epoch {lease.epoch}, token {lease.token}"
    emit(row, output, ["action", "reason", "as"] if output == "table" else None)

