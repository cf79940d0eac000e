"""Self-fencing's renewals on a real leader: its CPU for one ask per VM per ``D/3``.

    python -m benchmarks.bench_rights_leader                  # 5,000 VMs, D = 30 s
    python -m benchmarks.bench_rights_leader --vms 500 --windows 2 --seconds 20

Opt-in: not part of the test command. A private local control plane with simulated
(kwok) nodes, one real ``neonvm controller run`` replica (the leader) with self-fencing
on (``--right-seconds``, ``--rights-url``, ``--rights-bind``), and ``--vms`` VMs
converged under it: each VM has its scaling token Secret and a self-fencing runner pod.
The simulated nodes run no runner, so client processes of this benchmark ask for every
VM's pod once per ``D/3`` (spread evenly), each ask on a new connection with the VM's
real bearer (the HMAC of the pod uid under the VM's token, read from its Secret), from a
source address of its own per VM (as runners ask from their pods' addresses), as
:mod:`neonvm.runner.right` does.

Once converged, it waits until the leader has taken no action for ``--settle`` seconds
(the simulated kubelets' pod statuses synced into the VMs). Then the term's first asks,
apart: every VM asked until each is granted once (a term's first grant to a pod costs a
pod PATCH, its token a Secret GET). Then ``--windows`` pairs of windows of ``--seconds``
each on the same leader and fleet: one without asks (the baseline), one with them. Per
window: asks/s, answers that were not 200, latency p50/p99, the leader process's CPU
(user + system, from /proc over the window) and RSS, its actions (reconcile writes),
the API server's requests/s (its ``apiserver_request_total``, every client) and CPU.
The windows stay within the token cache's ten minutes, so none re-reads a Secret.
docs/protocol.md, "Self-fencing"; figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import controller_bench as cb  # noqa: E402
from benchmarks.api_calls import request_totals  # noqa: E402
from neonvm.api.rights import ask_target, authorization_header  # noqa: E402
from neonvm.drills.observer import percentile  # noqa: E402

Ask = tuple[str, str, str, str, str]
"""(namespace, VM, pod uid, Authorization header, source address) of one VM's ask."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class FencingReplicas(cb.ReplicaSet):
    """:class:`~benchmarks.controller_bench.ReplicaSet` with self-fencing on: rights
    served on ``127.0.0.1:rights_port``, pods built to ask there for ``right_seconds``."""

    right_seconds: float = 30.0
    rights_port: int = 0

    def _argv(self, identity: str) -> list[str]:
        return [*super()._argv(identity), "--right-seconds", f"{self.right_seconds:g}",
                "--rights-url", f"http://127.0.0.1:{self.rights_port}",
                "--rights-bind", f"127.0.0.1:{self.rights_port}"]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def source_address(i: int) -> str:
    """A loopback address of VM ``i``'s own (the server bounds connections per source)."""
    return f"127.1.{i // 250 % 250}.{i % 250 + 1}"


def fleet_asks(api: Any, namespace: str) -> list[Ask]:
    """Every converged VM's ask: its committed pod's uid and the bearer from its token
    Secret (the recorded one, by uid)."""
    from kubernetes import client

    from neonvm.api import types
    from neonvm.controller.scaling_token import recorded_token

    vms = client.CustomObjectsApi(api).list_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, _request_timeout=120)["items"]
    secrets = {s["metadata"]["name"]: s for s in api.sanitize_for_serialization(
        client.CoreV1Api(api).list_namespaced_secret(namespace, _request_timeout=120).items)}
    asks: list[Ask] = []
    for i, vm in enumerate(sorted(vms, key=lambda v: v["metadata"]["name"])):
        status = vm.get("status") or {}
        name = status.get("scalingTokenSecret") or ""
        token = recorded_token(secrets.get(name), name, status.get("scalingTokenSecretUID") or "")
        if isinstance(token, str) or not status.get("podUID"):
            why = token if isinstance(token, str) else "no status.podUID"
            raise RuntimeError(f"VM {vm['metadata']['name']}: {why}")
        uid = status["podUID"]
        asks.append((namespace, vm["metadata"]["name"], uid, authorization_header(token, uid),
                     source_address(i)))
    return asks


def ask(port: int, one: Ask, started: bool = False,
        timeout: float = 5.0) -> tuple[float, int]:
    """One ask on a new connection, as a runner's (saying its guest has started if
    ``started``): (seconds, status; 0 for none)."""
    namespace, vm, uid, bearer, source = one
    body = json.dumps({"namespace": namespace, "vm": vm, "podUID": uid})
    t0 = time.monotonic()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout,
                                          source_address=(source, 0))
        conn.request("POST", ask_target(started), body=body,
                     headers={"Authorization": bearer})
        status = conn.getresponse().status
        conn.close()
    except OSError:
        status = 0
    return time.monotonic() - t0, status


def client_proc(port: int, asks: list[Ask], interval: float, until: float, out: Any) -> None:
    """Ask for each of ``asks`` once per ``interval``, spread evenly, until ``until``
    (monotonic), each on a thread of a pool (a slow answer delays no other VM's ask, as
    each runner asks on its own); put (asks, not 200, latencies) on ``out``."""
    step = interval / max(1, len(asks))
    start = time.monotonic()
    futures = []
    with ThreadPoolExecutor(max_workers=64) as pool:
        i = 0
        while True:
            at = start + i * step
            if at >= until:
                break
            delay = at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(ask, port, asks[i % len(asks)]))
            i += 1
    done = [f.result() for f in futures]
    out.put((len(done), sum(1 for _, status in done if status != 200),
             [seconds for seconds, _ in done]))


def first_asks(port: int, asks: list[Ask], threads: int = 16, timeout: float = 600.0, *,
               started: bool = False,
               ask_timeout: float = 5.0) -> tuple[int, int, list[float]]:
    """Ask for every VM until each has been granted once in this term (the term's first
    ask per pod costs a Secret GET, and a pod PATCH unless ``started``); (asks, not 200,
    latencies)."""
    left = list(asks)
    sent, refused, latencies = 0, 0, []
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            answers = list(pool.map(lambda one: ask(port, one, started, ask_timeout), left))
        sent += len(answers)
        refused += sum(1 for _, status in answers if status != 200)
        latencies += [seconds for seconds, _ in answers]
        left = [one for one, (_, status) in zip(left, answers, strict=True) if status != 200]
    if left:
        raise RuntimeError(f"{len(left)} VMs not granted within {timeout:.0f}s")
    return sent, refused, latencies


def renewals(port: int, asks: list[Ask], interval: float, seconds: float,
             clients: int) -> tuple[int, int, list[float]]:
    """``clients`` processes ask for every VM once per ``interval`` for ``seconds``."""
    out: Any = multiprocessing.Queue()
    until = time.monotonic() + seconds
    procs = [multiprocessing.Process(target=client_proc,
                                     args=(port, asks[k::clients], interval, until, out))
             for k in range(clients)]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    time.sleep(max(0.0, until - time.monotonic()))  # the window is ``seconds`` long
    return (sum(r[0] for r in results), sum(r[1] for r in results),
            [x for r in results for x in r[2]])


@dataclass
class Window:
    kind: str
    seconds: float
    leader_cpu: float
    leader_rss_mib: float
    api_requests: int
    api_marks: int
    """PATCH pods + GET secrets + POST tokenreviews seen by the API server (a term's
    first asks, a bearer's check)."""
    api_cpu: float
    actions: float
    """The leader's actions that took effect (its reconciles' writes)."""
    asks: int = 0
    refused: int = 0
    p50_ms: float | None = None
    p99_ms: float | None = None


def api_counts(api: Any) -> tuple[int, int]:
    totals = request_totals(api)
    marks = sum(v for (verb, res, sub, _), v in totals.items()
                if (verb, res, sub) in (("PATCH", "pods", ""), ("GET", "secrets", ""),
                                        ("POST", "tokenreviews", "")))
    return sum(totals.values()), marks


@dataclass
class Leader:
    pid: int
    metrics_port: int
    api_pid: int

    def actions(self) -> float:
        return sum(cb.scrape_actions(self.metrics_port).values())


def window(kind: str, leader: Leader, api: Any,
           load: Callable[[], tuple[int, int, list[float]]] | None,
           seconds: float = 0.0) -> Window:
    """One measured window: ``load()`` (the asks), or ``seconds`` without asks."""
    requests0, marks0 = api_counts(api)
    actions0 = leader.actions()
    cpu0, api_cpu0 = cpu_seconds(leader.pid), cpu_seconds(leader.api_pid)
    t0 = time.monotonic()
    sent, refused, latencies = load() if load is not None else (0, 0, [])
    if load is None:
        time.sleep(seconds)
    elapsed = time.monotonic() - t0
    cpu, api_cpu = cpu_seconds(leader.pid) - cpu0, cpu_seconds(leader.api_pid) - api_cpu0
    requests1, marks1 = api_counts(api)
    w = Window(kind, elapsed, cpu, cb.rss_mib(leader.pid), requests1 - requests0,
               marks1 - marks0, api_cpu, leader.actions() - actions0, asks=sent,
               refused=refused)
    if latencies:
        w.p50_ms = (percentile(latencies, 0.5) or 0) * 1000
        w.p99_ms = (percentile(latencies, 0.99) or 0) * 1000
    return w


def settle(leader: Leader, quiet: float, timeout: float, progress: Callable[[str], None]
           ) -> float:
    """Wait until the leader's action count has not moved for ``quiet`` seconds (the
    simulated kubelets' last pod statuses synced); the seconds waited."""
    started = last_change = time.monotonic()
    seen = leader.actions()
    while time.monotonic() - last_change < quiet:
        if time.monotonic() - started > timeout:
            progress(f"not settled after {timeout:.0f}s; measuring anyway")
            break
        time.sleep(5.0)
        now = leader.actions()
        if now != seen:
            progress(f"settling: {now - seen:.0f} more actions")
            seen, last_change = now, time.monotonic()
    return time.monotonic() - started


def describe(w: Window) -> str:
    line = (f"{w.kind:9} {w.seconds:5.1f} s: leader CPU {100 * w.leader_cpu / w.seconds:5.1f} % "
            f"of a core, RSS {w.leader_rss_mib:.0f} MiB; API server "
            f"{w.api_requests / w.seconds:.1f} req/s ({w.api_marks} pod PATCH + Secret GET + "
            f"TokenReview), "
            f"CPU {100 * w.api_cpu / w.seconds:.1f} %; leader actions {w.actions:.0f}")
    if w.asks:
        line += (f"; asks/s {w.asks / w.seconds:.0f}, not 200: {w.refused}, latency p50 "
                 f"{w.p50_ms:.1f} ms, p99 {w.p99_ms:.1f} ms")
    return line


def measure(args: Any, api: Any, namespace: str, leader: Leader, rights_port: int,
            load: list[tuple[float, float, float]]) -> None:
    """Settle, the term's first asks, then ``args.windows`` pairs of windows; prints
    them."""
    from benchmarks.__main__ import say

    interval = args.right_seconds / 3
    waited = settle(leader, args.settle, args.settle_timeout, say)
    say(f"settled after {waited:.0f}s")
    asks = fleet_asks(api, namespace)
    load.append(os.getloadavg())
    first = window("first", leader, api, lambda: first_asks(rights_port, asks))
    say(describe(first))
    windows: list[Window] = []
    for _ in range(args.windows):
        windows.append(window("baseline", leader, api, None, args.seconds))
        say(describe(windows[-1]))
        windows.append(window("renewals", leader, api, lambda: renewals(
            rights_port, asks, interval, args.seconds, args.clients)))
        say(describe(windows[-1]))
    load.append(os.getloadavg())
    print(f"{len(asks)} VMs, D = {args.right_seconds:g} s (one ask per VM per {interval:g} s), "
          f"1 leader, {args.clients} client processes, {os.cpu_count()} CPUs; load average "
          + ", ".join(f"{x[0]:.1f}" for x in load) + " (start, after settling, end)")
    print(describe(first))
    for w in windows:
        print(describe(w))


def add_window_args(parser: argparse.ArgumentParser, *, windows: int,
                    settle_timeout: float) -> None:
    """The fleet's and the windows' options (also :mod:`benchmarks.bench_rights_failover`'s)."""
    parser.add_argument("--nodes", type=int, default=3, help="simulated nodes")
    parser.add_argument("--right-seconds", type=float, default=30.0)
    parser.add_argument("--seconds", type=float, default=30.0, help="each measured window")
    parser.add_argument("--windows", type=int, default=windows, help="pairs of windows")
    parser.add_argument("--settle", type=float, default=15.0,
                        help="seconds without a leader action that count as settled")
    parser.add_argument("--settle-timeout", type=float, default=settle_timeout)
    parser.add_argument("--clients", type=int, default=2, help="client processes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--vms", type=int, default=5000)
    add_window_args(parser, windows=3, settle_timeout=900.0)
    args = parser.parse_args()

    from loguru import logger

    from benchmarks.__main__ import local_cluster, say
    from neonvm import kube
    from neonvm.controller.config import http_pool_size
    from neonvm.drills import fleet

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    load = [os.getloadavg()]
    with local_cluster(None, args.nodes, pods=args.vms + 50) as cluster:
        api = kube.api_client(cluster.kubeconfig, pool_size=http_pool_size(cb.WORKERS))
        namespace = f"bench-rights-{uuid.uuid4().hex[:5]}"
        fleet.ensure_namespace(api, namespace)
        rights_port = free_port()
        with FencingReplicas(cluster, namespace, count=1, right_seconds=args.right_seconds,
                             rights_port=rights_port) as replicas:
            identity, _ = cb.wait_for_leader(api, namespace)
            lead = replicas.by_identity(identity)
            assert lead is not None
            cb.wait_metrics(replicas, lead)
            port = replicas.metrics_port(lead)
            assert port is not None
            leader = Leader(replicas.pid(lead), port,
                            int((cluster.state_dir / "run" / "kube-apiserver.pid").read_text()))
            names = [f"vm-{i:05d}" for i in range(args.vms)]
            say(f"converging {args.vms} self-fencing VMs")
            converged, created = cb.converge_watched(api, namespace, names, say)
            say(f"converged {converged:.0f} s after the last create (creates {created:.0f} s)")
            measure(args, api, namespace, leader, rights_port, load)
        api.close()


if __name__ == "__main__":
    main()
