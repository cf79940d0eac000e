"""Self-fencing's renewals at scale: the leader's CPU for one ask per VM per ``D/3``.

    python -m benchmarks.bench_rights                 # 5,000 VMs, D = 30 s, 30 s measured
    python -m benchmarks.bench_rights --vms 1000 --seconds 20

Opt-in: not part of the test command. A child process serves ``POST /v1/rights`` (the
shipped :class:`~neonvm.controller.rights.RightsServer` and
:class:`~neonvm.controller.rights.RightsService`, the ledger in an active term) over
in-memory caches of ``--vms`` VMs and their self-fencing pods, in the steady state:
every token already read (the token cache's hit) and every pod already marked in this
term (no API call per ask; those come once per pod per term, and once per VM per ten
minutes for the token). Client processes ask for every VM once per ``D/3`` (spread
evenly), each ask on a new connection with a real bearer, as runners do. The run reports
asks per second, answers that were not 200, the answers' p50/p99 latency, and the
server process's CPU (user + system, from /proc) over the measured period, beside the
same server idle for as long (the baseline: a leader without renewals).
docs/protocol.md, "Self-fencing"; figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neonvm.api.rights import RIGHT_SECONDS_ANNOTATION, RIGHTS_PATH, authorization_header  # noqa: E402
from neonvm.controller.observe import pod_index  # noqa: E402

TOKEN = b"bench-token"


def vm_names(n: int) -> list[str]:
    return [f"vm-{i:05d}" for i in range(n)]


class Cache(dict[str, Any]):
    """A store by ``namespace/name``, pods also by VM key (as the informer's store)."""

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.__dict__.setdefault("index", {}).setdefault(pod_index(value), []).append(value)

    def by_index(self, value: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.__dict__.get("index", {}).get(value, [])
        return found


def serve(n: int, seconds: float) -> None:
    """The child: the shipped server over ``n`` VMs; prints its port, runs until stdin
    closes."""
    from neonvm.controller.rights import RightsLedger, RightsServer, RightsService, TokenCache

    vms, pods = Cache(), Cache()
    for name in vm_names(n):
        vms[f"ns/{name}"] = {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}"},
                             "status": {"podName": f"{name}-p", "podUID": f"p-{name}",
                                        "scalingTokenSecret": "tok",
                                        "scalingTokenSecretUID": "s"}}
        pods[f"ns/{name}-p"] = {"metadata": {
            "name": f"{name}-p", "namespace": "ns", "uid": f"p-{name}",
            "labels": {"vm.neon.tech/name": name},
            "annotations": {RIGHT_SECONDS_ANNOTATION: f"{seconds:g}"},
            "ownerReferences": [{"uid": f"u-{name}", "controller": True}]}}
    secret = {"metadata": {"uid": "s"}, "data": {"token": base64.b64encode(TOKEN).decode()}}
    ledger = RightsLedger()
    ledger.begin_term(lambda: True)
    service = RightsService(ledger, lambda: (vms, pods),
                            TokenCache(None, read=lambda _ns, _name: secret),
                            lambda _ns, _name, _uid: True)
    with RightsServer(service, "127.0.0.1", 0, max_connections=4096) as server:
        print(server.port, flush=True)
        sys.stdin.read()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client(port: int, names: list[str], interval: float, until: float,
           out: Any) -> None:
    """Ask for each of ``names`` once per ``interval``, spread evenly, until ``until``."""
    step = interval / max(1, len(names))
    latencies: list[float] = []
    refused = 0
    start = time.monotonic()
    i = 0
    while True:
        at = start + i * step
        if at >= until:
            break
        delay = at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        name = names[i % len(names)]
        body = json.dumps({"namespace": "ns", "vm": name, "podUID": f"p-{name}"})
        t0 = time.monotonic()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("POST", RIGHTS_PATH, body=body, headers={
                "Authorization": authorization_header(TOKEN, f"p-{name}")})
            status = conn.getresponse().status
            conn.close()
        except OSError:
            status = 0
        latencies.append(time.monotonic() - t0)
        refused += status != 200
        i += 1
    out.put((len(latencies), refused, latencies))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--vms", type=int, default=5000)
    parser.add_argument("--right-seconds", type=float, default=30.0)
    parser.add_argument("--seconds", type=float, default=30.0, help="measured period")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.vms, args.right_seconds)
        return
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_rights", "--serve",
                              "--vms", str(args.vms), "--right-seconds",
                              str(args.right_seconds)],
                             cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        idle0 = cpu_seconds(child.pid)
        time.sleep(args.seconds)
        idle = cpu_seconds(child.pid) - idle0
        interval = args.right_seconds / 3
        names = vm_names(args.vms)
        out: Any = multiprocessing.Queue()
        until = time.monotonic() + args.seconds
        shards = [names[k::args.clients] for k in range(args.clients)]
        busy0 = cpu_seconds(child.pid)
        procs = [multiprocessing.Process(target=client, args=(port, s, interval, until, out))
                 for s in shards]
        for p in procs:
            p.start()
        results = [out.get() for _ in procs]
        busy = cpu_seconds(child.pid) - busy0
        for p in procs:
            p.join()
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(10)
    asked = sum(r[0] for r in results)
    refused = sum(r[1] for r in results)
    latencies = sorted(x for r in results for x in r[2])
    p50 = latencies[len(latencies) // 2] * 1000
    p99 = latencies[int(len(latencies) * 0.99)] * 1000
    print(f"{args.vms} VMs, D = {args.right_seconds:g} s (one ask per VM per "
          f"{interval:g} s), {args.seconds:g} s measured on {os.cpu_count()} CPUs:")
    print(f"  asks/s {asked / args.seconds:.0f}; not 200: {refused}; latency p50 "
          f"{p50:.1f} ms, p99 {p99:.1f} ms")
    print(f"  server CPU: {busy / args.seconds * 100:.1f} % of a core with renewals, "
          f"{idle / args.seconds * 100:.1f} % idle (the same server, no asks)")


if __name__ == "__main__":
    main()
