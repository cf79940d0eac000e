"""Benchmark the per-VM locks against a baseline of raw etcd transactions, in one run.

    python benchmarks/bench_locks.py                      # starts its own etcd
    python benchmarks/bench_locks.py --endpoints http://127.0.0.1:2479
    python benchmarks/bench_locks.py --write-docs         # also updates docs/locks.md

Without ``--endpoints`` it starts a private etcd through ``neonvm.dev.cluster.LocalCluster``
(free loopback ports, a temporary state directory, no nodes, only the ``locks-etcd``
component) and stops it at the end. Every figure is measured in the same run with the
same client, so the lock's overhead reads directly off the baseline rows:

* baseline: the two raw transactions an acquire+release boils down to (put-if-absent,
  then compare-and-delete), with no lock logic, sequentially and from N threads on N keys;
* uncontended: ``acquire`` + ``release`` of one VM lock, sequentially;
* contended: N holders (threads, each with its own session and identity) competing for
  one VM lock with ``acquire(wait=...)``, each doing a fenced write while it holds it.

Loops are bounded by ``--ops``; the run stops by itself.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neonvm.leader.etcd import Compare, Delete, Etcd, EtcdConfig, Put  # noqa: E402
from neonvm.leader.lock import LockManager  # noqa: E402
from neonvm.leader.session import Session  # noqa: E402

DOC = ROOT / "docs" / "locks.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


@dataclass(frozen=True)
class Row:
    scenario: str
    ops: int
    seconds: float
    latencies_ms: list[float]

    @property
    def rate(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


# ---- scenarios ----------------------------------------------------------------------


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def baseline_pair(etcd: Etcd, key: str, lease: int = 0) -> None:
    """What acquire+release send, minus the lock: create-if-absent, compare-delete."""
    result = etcd.txn([Compare(key, "create", "==", 0)], [Put(key, b"x", lease)])
    etcd.txn([Compare(key, "mod", "==", result.revision)], [Delete(key)])


def run_baseline(etcd: Etcd, prefix: str, ops: int, threads: int,
                 leased: bool = False) -> Row:
    per_thread = ops // threads
    latencies: list[list[float]] = [[] for _ in range(threads)]
    lease = etcd.grant_lease(60).id if leased else 0

    def work(i: int) -> None:
        key = f"{prefix}/baseline/{i}"
        for _ in range(per_thread):
            latencies[i].append(timed(lambda: baseline_pair(etcd, key, lease)))

    try:
        seconds = _parallel(work, threads)
    finally:
        if lease:
            etcd.revoke_lease(lease)
    label = "baseline: raw txn pair" + (", key on a lease" if leased else "") + (
        ", sequential" if threads == 1 else f", {threads} threads on {threads} keys")
    return Row(label, per_thread * threads, seconds, [x for xs in latencies for x in xs])


def run_uncontended(etcd: Etcd, prefix: str, ops: int) -> Row:
    with Session(etcd, ttl=30, name="bench") as session:
        manager = LockManager(etcd, session, f"bench-{uuid.uuid4().hex[:6]}", prefix)
        latencies = []

        def acquire_release() -> None:
            manager.acquire("bench", "vm", "uid-1", 1).release()

        start = time.perf_counter()
        for _ in range(ops):
            latencies.append(timed(acquire_release))
        seconds = time.perf_counter() - start
    return Row("lock acquire+release, uncontended", ops, seconds, latencies)


def run_contended(etcd: Etcd, prefix: str, ops: int, holders: int) -> Row:
    per_holder = ops // holders
    latencies: list[list[float]] = [[] for _ in range(holders)]
    sessions = [Session(etcd, ttl=30, name=f"bench-{i}") for i in range(holders)]
    managers = [LockManager(etcd, s, f"holder-{i}-{uuid.uuid4().hex[:6]}", prefix)
                for i, s in enumerate(sessions)]

    def work(i: int) -> None:
        for _ in range(per_holder):
            start = time.perf_counter()
            guard = managers[i].acquire("bench", "contended", "uid-1", 1, wait=60)
            guard.fenced_put(f"{prefix}/contended-data", str(i).encode())
            guard.release()
            latencies[i].append((time.perf_counter() - start) * 1000)

    try:
        seconds = _parallel(work, holders)
    finally:
        for s in sessions:
            s.close()
    return Row(f"lock acquire+fenced put+release, {holders} holders on one lock",
               per_holder * holders, seconds, [x for xs in latencies for x in xs])


def merge(parts: list[Row]) -> Row:
    return Row(parts[0].scenario, sum(p.ops for p in parts), sum(p.seconds for p in parts),
               [x for p in parts for x in p.latencies_ms])


def _parallel(work: Callable[[int], None], n: int) -> float:
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


# ---- etcd to run against -----------------------------------------------------------


@contextmanager
def etcd_endpoints(given: str | None) -> Iterator[tuple[EtcdConfig, str]]:
    """(config, description); starts a private etcd when none is given. Given endpoints
    take TLS files and credentials from ``NEONVM_ETCD_*``."""
    if given:
        yield EtcdConfig.from_env().with_overrides(endpoints=given), f"given endpoints {given}"
        return
    from neonvm.dev import binaries
    from neonvm.dev.cluster import ClusterSpec, LocalCluster

    state = Path(tempfile.mkdtemp(prefix="neonvm-bench-"))
    cluster = LocalCluster(state, ClusterSpec.with_free_ports(nodes=0))
    try:
        cluster.start_component("locks-etcd")
        yield (cluster.locks_etcd_config(),
               f"private etcd {binaries.ETCD_VERSION} on loopback (LocalCluster: TLS with "
               "client certificates and auth on, as the controller uses it; "
               "--unsafe-no-fsync: no disk sync in the figures)")
    finally:
        cluster.down()
        shutil.rmtree(state, ignore_errors=True)


# ---- output ---------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    head = ("| scenario | ops | ops/s | p50 ms | p90 ms | p99 ms | max ms |\n"
            "|---|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r.scenario} | {r.ops} | {r.rate:.0f} | {r.pct(0.5):.2f} | "
                     f"{r.pct(0.9):.2f} | {r.pct(0.99):.2f} | {max(r.latencies_ms):.2f} |")
    return "\n".join(lines)


def write_docs(text: str) -> None:
    doc = DOC.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOC} has no {BEGIN} ... {END} section to update")
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    DOC.write_text(pattern.sub(lambda _m: f"{BEGIN}\n{text}\n{END}", doc))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoints", help="Use this etcd instead of starting one.")
    p.add_argument("--ops", type=int, default=800, help="Operations per scenario.")
    p.add_argument("--rounds", type=int, default=16,
                   help="Interleaved rounds the operations are split into.")
    p.add_argument("--holders", type=int, default=4, help="Threads in the contended runs.")
    p.add_argument("--write-docs", action="store_true", help=f"Update {DOC.name}.")
    args = p.parse_args()
    logger.remove()
    logger.add(sys.stderr, level="WARNING")

    load_before = os.getloadavg()[0]
    with etcd_endpoints(args.endpoints) as (given, where):
        # Under the configured prefix: an etcd user confined to it may run the benchmark.
        prefix = f"{given.prefix}/bench-{uuid.uuid4().hex[:8]}"
        config = given.with_overrides(prefix=prefix)
        with Etcd(config) as etcd:
            # Warm up connections and code paths; not measured.
            run_baseline(etcd, prefix, 50, 1)
            run_uncontended(etcd, prefix, 50)
            scenarios: list[Callable[[int], Row]] = [
                lambda n: run_baseline(etcd, prefix, n, 1),
                lambda n: run_baseline(etcd, prefix, n, 1, leased=True),
                lambda n: run_uncontended(etcd, prefix, n),
                lambda n: run_baseline(etcd, prefix, n, args.holders),
                lambda n: run_contended(etcd, prefix, n, args.holders),
            ]
            # Interleave the scenarios in rounds, so that load from elsewhere on the
            # machine falls on all of them alike rather than on whichever ran then.
            chunks: list[list[Row]] = [[] for _ in scenarios]
            for _ in range(args.rounds):
                for i, scenario in enumerate(scenarios):
                    chunks[i].append(scenario(args.ops // args.rounds))
            rows = [merge(parts) for parts in chunks]
            etcd.txn([], [Delete(f"{prefix}/contended-data")])
    base, leased, lock = rows[0], rows[1], rows[2]
    summary = (
        f"Run {time.strftime('%Y-%m-%d')} against {where}; Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs shared with other work "
        f"(load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after), one "
        f"client process, {args.ops} operations per row in {args.rounds} interleaved "
        f"rounds. At the median, an uncontended acquire+release takes "
        f"{lock.pct(0.5) / base.pct(0.5):.2f}x the raw transaction "
        f"pair and {lock.pct(0.5) / leased.pct(0.5):.2f}x the same pair with the key on a "
        f"lease ({lock.rate:.0f} vs {base.rate:.0f} and {leased.rate:.0f} pairs/s)."
    )
    text = f"{table(rows)}\n\n{summary}"
    print(text)
    if args.write_docs:
        write_docs(text)
        print(f"\nwrote the figures into {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
