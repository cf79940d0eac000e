"""API calls per VM, by verb, from creation to Running: ``python -m benchmarks.api_calls``.

Starts a private local cluster (or uses ``--state-dir``), the benchmark's controller
replicas on a fresh namespace, creates ``--vms`` VMs at once and waits until every one
has converged (one ungated committed pod) and reports ``status.phase: Running``. The
figures are the API server's own ``apiserver_request_total`` before and after, by verb,
resource and subresource, divided by the VM count. The API server does not label its
counters by client, so the table shows every client's requests in the namespace; the
notes say which rows are this script's own (its VM creates and its polling, counted
here and subtracted) and which are the scheduler's and the nodes'.

    python -m benchmarks.api_calls --vms 100                      # this code
    python -m benchmarks.api_calls --vms 100 --baseline c1d4a96 --write-docs

``--baseline REV`` measures, in the same run and on the same cluster (each on a fresh
namespace, the baseline first), the controller as it was at git revision ``REV``: its
tree is extracted with ``git archive`` and put first on the replicas' ``PYTHONPATH``.
``--write-docs`` puts the table between the ``api_calls`` markers of
``docs/benchmarks.md``. Events are counted twice: as ``POST events`` in the API
server's counters (every component's), and as the Events in the namespace whose
reporting component is the controller's (``neonvm-controller``): aggregated repeats
(a PATCH) are one Event there.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kubernetes import client

from benchmarks.__main__ import local_cluster
from benchmarks.controller_bench import ReplicaSet, create_vms, wait_for_leader, wait_metrics
from neonvm import kube
from neonvm.api import types
from neonvm.controller.events import COMPONENT
from neonvm.drills import fleet

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
BEGIN, END = "<!-- api_calls: begin -->", "<!-- api_calls: end -->"
NOT_THE_CONTROLLERS = {
    ("PATCH", "pods", "status"): "kwok (the simulated kubelet)",
    ("POST", "pods", "binding"): "kube-scheduler",
    ("PUT", "leases", ""): "lease renewals (the run's length, not its VMs)",
    ("POST", "events", ""): "every component's Events (the controller's are counted apart)",
}
"""Rows that are not the controller's requests, or not per VM (left out of its total)."""

Key = tuple[str, str, str, str]
"""(verb, resource, subresource, scope)."""

SAMPLE = re.compile(r'^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$')


def request_totals(api: client.ApiClient) -> Counter[Key]:
    """``apiserver_request_total`` summed over codes, by verb/resource/subresource/scope."""
    method, url, headers, body, _ = api.param_serialize(
        "GET", "/metrics", auth_settings=["BearerToken"])
    resp = api.call_api(method, url, header_params=headers, body=body, _request_timeout=30)
    resp.read()
    text = resp.data.decode()
    out: Counter[Key] = Counter()
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels")))
        key = (labels.get("verb", ""), labels.get("resource", ""),
               labels.get("subresource", ""), labels.get("scope", ""))
        out[key] += int(float(m.group("value")))
    return out


@contextmanager
def revision_tree(rev: str | None) -> Iterator[str | None]:
    """The source tree of git revision ``rev`` in a temporary directory (None: none)."""
    if rev is None:
        yield None
        return
    root = Path(__file__).resolve().parent.parent
    tmp = tempfile.mkdtemp(prefix="neonvm-api-calls-")
    try:
        archive = subprocess.run(["git", "-C", str(root), "archive", rev],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def python_path_first(tree: str | None) -> Iterator[None]:
    """The replicas started meanwhile import neonvm from ``tree`` (None: this tree)."""
    if tree is None:
        yield
        return
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = tree + (os.pathsep + old if old else "")
    try:
        yield
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def controller_events(api: client.ApiClient, namespace: str) -> int:
    """Events in ``namespace`` that the controller reported (one per POST)."""
    items = client.CoreV1Api(api).list_namespaced_event(namespace, _request_timeout=30).items
    return sum(1 for e in items
               if COMPONENT in (e.reporting_component, (e.source.component if e.source else None)))


def run(cluster: Any, vms: int, replicas: int, keep_log: str | None = None,
        tree: str | None = None) -> dict[str, Any]:
    api = kube.api_client(cluster.kubeconfig)
    namespace = f"bench-calls-{uuid.uuid4().hex[:5]}"
    fleet.ensure_namespace(api, namespace)
    own: Counter[Key] = Counter()
    try:
        with python_path_first(tree), ReplicaSet(cluster, namespace, count=replicas) as rs:
            leader, _ = wait_for_leader(api, namespace)
            lead = rs.by_identity(leader)
            assert lead is not None
            wait_metrics(rs, lead)
            time.sleep(2.0)  # informers listed, the first scans done
            before = request_totals(api)
            names = [f"vm-{i:04d}" for i in range(vms)]
            started = time.monotonic()
            create_vms(api, namespace, names, threads=4)
            own[("POST", types.PLURAL, "", "resource")] += vms
            while True:
                pods = fleet.list_runner_pods(api, namespace)
                items = fleet.list_vms(api, namespace)
                own[("LIST", "pods", "", "namespace")] += 1
                own[(("LIST", types.PLURAL, "", "namespace"))] += 1
                ungated = {p.metadata.labels.get(types.LABEL_VM_NAME) for p in pods
                           if not any(g.name == types.SCHEDULING_GATE
                                      for g in p.spec.scheduling_gates or [])}
                running = [v for v in items if (v.get("status") or {}).get("phase") == "Running"
                           and v["metadata"]["name"] in ungated]
                if len(running) == vms and len(pods) == vms:
                    break
                if time.monotonic() - started > 60 + vms * 3.0:
                    raise RuntimeError(f"only {len(running)} of {vms} VMs Running")
                time.sleep(1.0)
            seconds = time.monotonic() - started
            time.sleep(3.0)  # the last steps' events and writes land
            after = request_totals(api)
            events = controller_events(api, namespace)
            if keep_log:
                shutil.copyfile(cluster.log_file(lead.name), keep_log)
        delta = Counter({k: after[k] - before[k] - own[k] for k in after
                         if after[k] - before[k] - own[k] > 0})
        return {"vms": vms, "seconds": seconds, "delta": delta, "own": own,
                "events": events}
    finally:
        fleet.drop_namespace(api, namespace)
        namespace_gone(api, namespace)
        api.close()


def namespace_gone(api: client.ApiClient, namespace: str, timeout: float = 180.0) -> None:
    """Wait until ``namespace`` is deleted: the namespace controller's requests for it
    must not fall into the next run's counts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            client.CoreV1Api(api).read_namespace(namespace, _request_timeout=30)
        except client.ApiException as exc:
            if exc.status == 404:
                return
            raise
        time.sleep(1.0)
    print(f"namespace {namespace} still there after {timeout:.0f} s", file=sys.stderr)


def controller_total(out: dict[str, Any]) -> float:
    """The controller's requests per VM, without Events: every row but WATCH and
    :data:`NOT_THE_CONTROLLERS`, and only the VM and pod resources."""
    total = sum(v for (verb, res, sub, _), v in out["delta"].items()
                if verb != "WATCH" and (verb, res, sub) not in NOT_THE_CONTROLLERS
                and res in (types.PLURAL, "pods"))
    return float(total) / int(out["vms"])


ROWS = [("POST", "events", ""), ("PUT", types.PLURAL, "status"), ("GET", types.PLURAL, ""),
        ("LIST", "pods", ""), ("LIST", types.PLURAL, ""), ("PUT", types.PLURAL, ""),
        ("POST", "pods", ""), ("PATCH", "pods", ""), ("PATCH", "pods", "status"),
        ("POST", "pods", "binding")]


def per_vm(out: dict[str, Any], verb: str, res: str, sub: str) -> float:
    return float(sum(v for (vb, r, sb, _), v in out["delta"].items()
                     if (vb, r, sb) == (verb, res, sub))) / int(out["vms"])


def table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """The per-VM table, one column per run."""
    head = "| verb | resource | " + " | ".join(name for name, _ in runs) + " | whose |"
    lines = [head, "|---|---|" + "---:|" * len(runs) + "---|"]
    for verb, res, sub in ROWS:
        whose = NOT_THE_CONTROLLERS.get((verb, res, sub), "controller")
        cells = " | ".join(f"{per_vm(out, verb, res, sub):.2f}" for _, out in runs)
        lines.append(f"| {verb} | {res}{'/' + sub if sub else ''} | {cells} | {whose} |")
    cells = " | ".join(f"{out['events'] / out['vms']:.2f}" for _, out in runs)
    lines.append(f"| | the controller's Events | {cells} | controller (one POST each) |")
    cells = " | ".join(f"**{controller_total(out):.2f}**" for _, out in runs)
    lines.append(f"| | **controller, without Events** | {cells} | |")
    cells = " | ".join(f"**{controller_total(out) + out['events'] / out['vms']:.2f}**"
                       for _, out in runs)
    lines.append(f"| | **controller, with its Events** | {cells} | |")
    return "\n".join(lines)


def load_average() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def write_docs(text: str) -> None:
    doc = DOC.read_text()
    if BEGIN not in doc:
        raise SystemExit(f"{DOC.name} has no {BEGIN} marker")
    block = f"{BEGIN}\n{text}\n{END}"
    DOC.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, doc,
                          flags=re.S))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-dir", default=None, help="Use this running local cluster.")
    p.add_argument("--vms", type=int, default=100)
    p.add_argument("--replicas", type=int, default=1, help="Controller replicas.")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--keep-log", default=None,
                   help="Copy the leader's log (JSON lines) to this file.")
    p.add_argument("--baseline", default=None, metavar="REV",
                   help="Also measure the controller at this git revision, first, in the "
                        "same run.")
    p.add_argument("--write-docs", action="store_true",
                   help="Write the table into docs/benchmarks.md (between its markers).")
    args = p.parse_args()
    from pathlib import Path

    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    load_before = load_average()
    started = time.monotonic()
    runs: list[tuple[str, dict[str, Any]]] = []
    with local_cluster(Path(args.state_dir) if args.state_dir else None, args.nodes) as c, \
            revision_tree(args.baseline) as tree:
        if tree is not None:
            runs.append((f"baseline ({args.baseline})", run(c, args.vms, args.replicas,
                                                             tree=tree)))
        out = run(c, args.vms, args.replicas, args.keep_log)
        runs.append(("this code", out))
    for name, o in runs:
        print(f"{name}: {o['vms']} VMs Running in {o['seconds']:.1f} s; the controller's "
              f"Events: {o['events']}")
    text = table(runs)
    print(text)
    if args.write_docs:
        when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        seconds = " and ".join(f"{o['seconds']:.0f} s ({name})" for name, o in runs)
        write_docs(f"{text}\n\nRun {when}: `python -m benchmarks.api_calls --vms {args.vms}"
                   f"{' --baseline ' + args.baseline if args.baseline else ''}`, "
                   f"{args.replicas} replica(s), {args.nodes} kwok nodes, 2 CPUs shared with "
                   f"other work (load average 1/5/15 min {load_before} before, "
                   f"{load_average()} after); {args.vms} VMs Running in {seconds}; "
                   f"{time.monotonic() - started:.0f} s in all.")
    n = out["vms"]
    print(f"{n} VMs Running in {out['seconds']:.1f} s; requests per VM (this script's "
          f"own {sum(out['own'].values())} subtracted):")
    print("| verb | resource | subresource | scope | total | per VM |")
    print("|---|---|---|---|---:|---:|")
    for (verb, res, sub, scope), v in sorted(out["delta"].items(), key=lambda kv: -kv[1]):
        if verb == "WATCH":
            continue
        print(f"| {verb} | {res} | {sub or '-'} | {scope} | {v} | {v / n:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
