"""API calls per VM, by verb, from creation to Running: ``python -m benchmarks.api_calls``.

Starts a private local cluster (or uses ``--state-dir``), the benchmark's controller
replicas on a fresh namespace, creates ``--vms`` VMs at once and waits until every one
has converged (one ungated committed pod) and reports ``status.phase: Running``. The
figures are the API server's own ``apiserver_request_total`` before and after, by verb,
resource and subresource, divided by the VM count. The API server does not label its
counters by client, so the table shows every client's requests in the namespace; the
notes say which rows are this script's own (its VM creates and its polling, counted
here and subtracted) and which are the scheduler's and the nodes'.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
import uuid
from collections import Counter
from typing import Any

from kubernetes import client

from benchmarks.__main__ import local_cluster
from benchmarks.controller_bench import ReplicaSet, create_vms, wait_for_leader, wait_metrics
from neonvm import kube
from neonvm.api import types
from neonvm.drills import fleet

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


def run(cluster: Any, vms: int, replicas: int, keep_log: str | None = None) -> dict[str, Any]:
    api = kube.api_client(cluster.kubeconfig)
    namespace = f"bench-calls-{uuid.uuid4().hex[:5]}"
    fleet.ensure_namespace(api, namespace)
    own: Counter[Key] = Counter()
    try:
        with ReplicaSet(cluster, namespace, count=replicas) as rs:
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
            if keep_log:
                shutil.copyfile(cluster.log_file(lead.name), keep_log)
        delta = Counter({k: after[k] - before[k] - own[k] for k in after
                         if after[k] - before[k] - own[k] > 0})
        return {"vms": vms, "seconds": seconds, "delta": delta, "own": own}
    finally:
        fleet.drop_namespace(api, namespace)
        api.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-dir", default=None, help="Use this running local cluster.")
    p.add_argument("--vms", type=int, default=100)
    p.add_argument("--replicas", type=int, default=1, help="Controller replicas.")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--keep-log", default=None,
                   help="Copy the leader's log (JSON lines) to this file.")
    args = p.parse_args()
    from pathlib import Path

    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    with local_cluster(Path(args.state_dir) if args.state_dir else None, args.nodes) as c:
        out = run(c, args.vms, args.replicas, args.keep_log)
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
