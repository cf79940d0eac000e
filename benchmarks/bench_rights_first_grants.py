"""A term's first grants on a real leader: how fast a new leader grants every pod once.

    python -m benchmarks.bench_rights_first_grants --vms 500
    python -m benchmarks.bench_rights_first_grants --vms 500 --rights-workers 8,32 --rounds 2

Opt-in: not part of the test command. The fleet and the leader are those of
:mod:`benchmarks.bench_rights_leader` (a private local control plane with simulated
nodes, one ``neonvm controller run`` replica with self-fencing on, ``--vms`` converged
VMs, each asked for with its real HMAC bearer from a source address of its own). Then,
for each round, each ``--rights-workers`` value and each kind of ask, the replica is
stopped (SIGTERM: it releases its Lease) and started again with that value, a new
process and term with empty caches, as after a leader change; once it grants one VM,
every other VM asks (``--threads`` at once, each ask on a new connection) until each is
granted once:

* ``not started``: the ask's target is the bare path, as a runner still waiting for its
  first grant (or of an earlier release) asks: the term writes the pod first (a PATCH)
  and checks the bearer (a Secret GET, the token cache being new);
* ``started``: the target says the guest has started (``?guest=started``), as every
  running guest's runner asks: no write, the Secret GET only.

Per run: the seconds to grant them all, grants per second, answers that were not 200,
latency p50/p99, the pod PATCHes and Secret GETs the API server counted, and the
leader's CPU. The new term's own start-up work (its informers' lists, its first
reconciles) runs meanwhile, as it does after a real leader change. docs/protocol.md,
"A term's first grants are the tighter limit".
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import bench_rights_leader as brl  # noqa: E402
from benchmarks import controller_bench as cb  # noqa: E402
from benchmarks.api_calls import request_totals  # noqa: E402
from neonvm.drills.observer import percentile  # noqa: E402

ASK_TIMEOUT = 10.0
"""Seconds one ask may take: a term's first asks wait on the API server."""


@dataclass
class Replicas(brl.FencingReplicas):
    """:class:`~benchmarks.bench_rights_leader.FencingReplicas` with ``--rights-workers``
    (not passed when None: the controller's default)."""

    rights_workers: int | None = None

    def _argv(self, identity: str) -> list[str]:
        extra = ([] if self.rights_workers is None
                 else ["--rights-workers", str(self.rights_workers)])
        return [*super()._argv(identity), *extra]


def api_marks(api: Any) -> tuple[int, int]:
    """(pod PATCHes, Secret GETs) the API server has served so far."""
    totals = request_totals(api)

    def count(verb: str, resource: str) -> int:
        return int(sum(v for (v_, res, sub, _), v in totals.items()
                       if (v_, res, sub) == (verb, resource, "")))
    return count("PATCH", "pods"), count("GET", "secrets")


@dataclass
class Run:
    workers: int | None
    started: bool
    vms: int
    seconds: float
    sent: int
    refused: int
    p50_ms: float
    p99_ms: float
    patches: int
    secret_gets: int
    leader_cpu: float
    wait_seconds: float
    """From the replica's start to its first grant (election, caches)."""

    def describe(self) -> str:
        kind = "started    " if self.started else "not started"
        workers = "default" if self.workers is None else str(self.workers)
        return (f"workers {workers:>7}, {kind}: {self.vms} VMs granted in "
                f"{self.seconds:5.2f} s = {self.vms / self.seconds:6.1f}/s; asks {self.sent}, "
                f"not 200 {self.refused}; latency p50 {self.p50_ms:.0f} ms, p99 "
                f"{self.p99_ms:.0f} ms; API: {self.patches} pod PATCH, {self.secret_gets} "
                f"Secret GET; leader CPU {100 * self.leader_cpu / self.seconds:.0f} % of a "
                f"core; first grant {self.wait_seconds:.1f} s after the start")


def new_term(replicas: Replicas, api: Any, namespace: str, workers: int | None) -> int:
    """Stop the replica (SIGTERM) and start it again with ``workers``; its pid."""
    for m in replicas.members:
        replicas.cluster.stop_component(m.name, signal.SIGTERM)
    replicas.rights_workers = workers
    replica = replicas.start(0)
    cb.wait_for_leader(api, namespace, timeout=120)
    return replicas.pid(replica)


def one_run(replicas: Replicas, api: Any, namespace: str, port: int, asks: list[brl.Ask],
            workers: int | None, started: bool, threads: int) -> Run:
    t_start = time.monotonic()
    pid = new_term(replicas, api, namespace, workers)
    # Until the caches synced and the term grants.
    while brl.ask(port, asks[0], started, ASK_TIMEOUT)[1] != 200:
        if time.monotonic() - t_start > 300:
            raise RuntimeError("the new term granted nothing within 300 s")
        time.sleep(0.05)
    waited = time.monotonic() - t_start
    patches0, gets0 = api_marks(api)
    cpu0 = brl.cpu_seconds(pid)
    t0 = time.monotonic()
    sent, refused, latencies = brl.first_asks(port, asks[1:], threads, started=started,
                                                   ask_timeout=ASK_TIMEOUT)
    elapsed = time.monotonic() - t0
    cpu = brl.cpu_seconds(pid) - cpu0
    patches1, gets1 = api_marks(api)
    return Run(workers, started, len(asks) - 1, elapsed, sent, refused,
               (percentile(latencies, 0.5) or 0) * 1000,
               (percentile(latencies, 0.99) or 0) * 1000, patches1 - patches0,
               gets1 - gets0, cpu, waited)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--vms", type=int, default=500)
    parser.add_argument("--nodes", type=int, default=3, help="simulated nodes")
    parser.add_argument("--right-seconds", type=float, default=30.0)
    parser.add_argument("--rights-workers", default="default",
                        help="comma-separated values of the leader's --rights-workers "
                             "('default': the flag not passed)")
    parser.add_argument("--kinds", default="not-started,started",
                        help="comma-separated: not-started, started")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=64, help="asks at once")
    parser.add_argument("--settle", type=float, default=15.0)
    parser.add_argument("--settle-timeout", type=float, default=900.0)
    args = parser.parse_args()

    from loguru import logger

    from benchmarks.__main__ import local_cluster, say
    from neonvm import kube
    from neonvm.controller.config import http_pool_size
    from neonvm.drills import fleet

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    workers = [None if w == "default" else int(w) for w in args.rights_workers.split(",")]
    kinds = [k == "started" for k in args.kinds.split(",")]
    load = [os.getloadavg()]
    runs: list[Run] = []
    with local_cluster(None, args.nodes, pods=args.vms + 50) as cluster:
        api = kube.api_client(cluster.kubeconfig, pool_size=http_pool_size(cb.WORKERS))
        namespace = f"bench-first-{uuid.uuid4().hex[:5]}"
        fleet.ensure_namespace(api, namespace)
        port = brl.free_port()
        replicas = Replicas(cluster, namespace, count=1, right_seconds=args.right_seconds,
                            rights_port=port, rights_workers=workers[0])
        with replicas:
            identity, _ = cb.wait_for_leader(api, namespace)
            lead = replicas.by_identity(identity)
            assert lead is not None
            cb.wait_metrics(replicas, lead)
            metrics = replicas.metrics_port(lead)
            assert metrics is not None
            leader = brl.Leader(replicas.pid(lead), metrics, int(
                (cluster.state_dir / "run" / "kube-apiserver.pid").read_text()))
            names = [f"vm-{i:05d}" for i in range(args.vms)]
            say(f"converging {args.vms} self-fencing VMs")
            converged, created = cb.converge_watched(api, namespace, names, say)
            say(f"converged {converged:.0f} s after the last create (creates {created:.0f} s)")
            waited = brl.settle(leader, args.settle, args.settle_timeout, say)
            say(f"settled after {waited:.0f}s")
            asks = brl.fleet_asks(api, namespace)
            load.append(os.getloadavg())
            for _ in range(args.rounds):
                for w in workers:
                    for started in kinds:
                        runs.append(one_run(replicas, api, namespace, port, asks, w,
                                            started, args.threads))
                        say(runs[-1].describe())
        api.close()
    load.append(os.getloadavg())
    print(f"{args.vms} VMs, {args.threads} asks at once, {os.cpu_count()} CPUs; load average "
          + ", ".join(f"{x[0]:.1f}" for x in load) + " (start, after settling, end)")
    for run in runs:
        print(run.describe())


if __name__ == "__main__":
    main()
