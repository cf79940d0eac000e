"""Run every benchmark and write ``docs/benchmarks.md``: ``python -m benchmarks``.

    python -m benchmarks                  # 100 VMs; a private control plane, torn down after
    python -m benchmarks --large          # also 1,000 and 5,000 VMs (about 40 min)
    python -m benchmarks --sizes 100,2000 # exactly these convergence runs
    python -m benchmarks --state-dir D    # use a running local cluster (neonvm dev up)
    python -m benchmarks --no-docs        # print the table only

It starts a private local control plane with simulated nodes (free ports, temporary
state directory) unless ``--state-dir`` names a running one, runs the controller
benchmarks (``benchmarks/controller_bench.py``) and the locks benchmark
(``benchmarks/bench_locks.py``, against the same locks' etcd), prints one table and writes
it into ``docs/benchmarks.md``. Each figure sits next to a baseline measured in the same
run; no figure is hard-coded anywhere.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import bench_decode  # noqa: E402
from benchmarks import controller_bench as cb  # noqa: E402
from neonvm.drills.observer import percentile  # noqa: E402
from neonvm.leader.etcd import EtcdConfig  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
FAILOVER_SECTION = "## Leader failover at the chart's defaults"


def say(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


@contextmanager
def local_cluster(state_dir: Path | None, nodes: int, pods: int = 0) -> Iterator[Any]:
    """A private control plane with ``nodes`` simulated nodes taking ``pods`` runner pods
    in all (spread evenly; at least Kubernetes' default 110 each), or the running
    cluster in ``state_dir``."""
    from neonvm.dev.binaries import install_binaries
    from neonvm.dev.cluster import ClusterSpec, LocalCluster

    if state_dir is not None:
        cluster = LocalCluster(state_dir)
        if not all(s.healthy for s in cluster.status()):
            raise SystemExit(f"the cluster in {state_dir} is not running (neonvm dev up)")
        yield cluster
        return
    install_binaries(with_nodes=True)
    tmp = Path(tempfile.mkdtemp(prefix="neonvm-bench-"))
    spec = ClusterSpec.with_free_ports(nodes=nodes)
    spec.pods_per_node = max(spec.pods_per_node, -(-pods // max(1, nodes)))
    cluster = LocalCluster(tmp, spec)
    try:
        say(f"starting a private control plane in {tmp}")
        cluster.up(progress=say)
        yield cluster
    finally:
        cluster.down()
        shutil.rmtree(tmp, ignore_errors=True)


def sizes_arg(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of VM counts: {text!r}") from None
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"VM counts must be positive: {text!r}")
    return sizes


def fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def pct(values: list[float], q: float) -> float | None:
    return percentile(values, q)


def controller_rows(conv: list[dict[str, Any]], rep: dict[str, Any], fo: dict[str, Any]
                    ) -> list[tuple[str, str, str]]:
    """(measure, value, baseline measured in the same run)."""
    rows = convergence_rows(conv)
    rows += replacement_rows(rep, fo)
    return rows


def convergence_rows(conv: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """The convergence runs' rows: VMs/s and the leader's RSS."""
    rows = []
    for c in conv:
        raw = c["raw"]
        writes = c["writes_per_vm"]
        # From the first create, the controller's time includes the creates' (it works
        # while they go on); the floor's VMs exist before its clock starts.
        whole = c["seconds"] + c["create_seconds"]
        rows.append((
            f"converge {c['vms']} VMs (3 replicas, {cb.WORKERS} workers)",
            f"{c['seconds']:.1f} s after the last create = **{c['vms_per_s']:.1f} VMs/s** "
            f"({whole:.1f} s from the first = {c['vms'] / whole:.1f} VMs/s)"
            + (f"; {writes:.1f} writes/VM" if writes else ""),
            f"floor: {raw['writes_per_s']:.0f} writes/s with {raw['threads']} threads = "
            f"{raw['vms_per_s']:.1f} VMs/s at the {raw['writes_per_vm']}-write floor "
            f"(controller at {100 * c['vms_per_s'] / raw['vms_per_s']:.0f}% of it; "
            f"{100 * c['vms'] / whole / raw['vms_per_s']:.0f}% from the first create)"))
        per_vm = (c["leader_rss_mib"] - c["standby_rss_mib"]) * 1024 / c["vms"]
        rows.append((f"controller RSS at {c['vms']} VMs",
                     f"leader {c['leader_rss_mib']:.0f} MiB (peak {c['leader_peak_mib']:.0f}"
                     f" MiB); {per_vm:.0f} KiB per VM over the standby",
                     f"standby (no VMs cached) {c['standby_rss_mib']:.0f} MiB"))
    return rows


def replacement_rows(rep: dict[str, Any], fo: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The replacement-latency and failover rows."""
    rows = []
    rows.append((
        f"pod deleted -> replacement created (gated), {rep['deletions']} deletions",
        f"p50 {fmt_s(pct(rep['created'], 0.5))}, p99 {fmt_s(pct(rep['created'], 0.99))}",
        "-"))
    rows.append((
        "old pod gone -> replacement ungated",
        f"p50 {fmt_s(pct(rep['started'], 0.5))}, p99 {fmt_s(pct(rep['started'], 0.99))}",
        "VM's terminationGracePeriodSeconds = 1 s (kwok ends the old pod then)"))
    rows.append((
        "pod deleted -> VM converged again",
        f"p50 {fmt_s(pct(rep['converged'], 0.5))}, p99 {fmt_s(pct(rep['converged'], 0.99))}",
        "includes the old pod's 1 s grace period (deletionTimestamp is rounded to the second)"))
    for sig in ("SIGKILL", "SIGTERM"):
        values = fo[sig]
        rows.append((
            f"leader failover after {sig} ({len(values)} runs)",
            f"p50 {fmt_s(pct(values, 0.5))}, max {fmt_s(max(values) if values else None)}",
            f"lease duration {fo['lease_duration_s']:.0f} s (renew deadline "
            f"{fo['renew_deadline_s']:.0f} s, retry period {fo['retry_period_s']:.0f} s)"))
    return rows


def markdown_table(rows: list[tuple[str, str, str]]) -> str:
    lines = ["| measure | value | baseline in the same run |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def run_locks(etcd: EtcdConfig, ops: int) -> str:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_locks.py"), "--endpoints",
           ",".join(etcd.endpoints), "--ops", str(ops)]
    say("locks: " + " ".join(cmd[1:]))
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800,
                         check=False, env={**os.environ, **etcd.env()})
    if out.returncode != 0:
        return f"(the locks benchmark failed: {out.stderr.strip().splitlines()[-1:]})"
    return out.stdout.strip()


DOC_HEAD = """# Benchmarks

Generated by `python -m benchmarks` (or `bash benchmarks/run.sh`); `--large` adds 1,000
and 5,000 VMs. Every figure is measured in the run below, next to a baseline measured in the same
run on the same machine; nothing here is typed in by hand. Re-run it to get your own.

What each row means:

* **converge N VMs**: N VMs created at once, until every one has exactly one runner pod,
  ungated, named `status.podName`: the time from the last create's answer to the last
  ungate, as this script's own watches see them (one direct check confirms the end;
  nothing polls lists of the fleet, which took CPU from the controller measured). The
  baseline (the *floor*, like for like) is a bare client doing the four writes a VM needs
  at the least, exactly as the controller sends them: the plan (status PUT with the
  controller's own status mutation), the pod (the controller's template, raw JSON), the
  commit (status PUT) and the ungate (the controller's JSON patch with its
  preconditions); as the controller's identity and RBAC, with as many threads as the
  controller has workers (and an HTTP pool as large as the controller's), on VMs that
  no controller watches, timed by the same watch from its first write to the last pod
  seen ungated. Its pods are then scheduled and run by the simulated nodes, as the
  controller's are. The controller also adds the finalizer, reads directly before the
  ungate, holds the etcd lock, records Events and syncs the phase, so it cannot reach
  the floor; *writes/VM* is what it actually wrote (its
  `neonvm_controller_actions_total` that took effect).
* **controller RSS**: resident memory of the leader once N VMs converged, with the VMs
  and their pods cached, and its peak (`VmHWM`: the relists and the burst of work), next
  to a standby replica of the same run (which caches nothing). *KiB per VM* is the
  leader's RSS above the standby's, divided by N. The caches drop `managedFields` and
  keep no older versions (those exist only under fault injection).
* **pod deleted -> replacement created**: a runner pod is deleted; the replacement is
  planned and created (gated) as soon as the leader has confirmed the deletion by a
  direct read, without waiting for the old pod to go. **Old pod gone -> replacement
  ungated**: the replacement starts only once the old pod is gone (a direct list must
  show it as the VM's only pod). With the 1 s grace period used here the old pod is
  often gone before the replacement exists, so the two overlap rather than add up.
  Single deletions, one after another, each on a different VM of a fleet as large as
  the number of deletions: a VM whose pod was just replaced would wait out its restart
  backoff, which is the policy's delay, not the controller's.
* **leader failover**: the leader process is killed (SIGKILL: no clean-up, the standby
  waits for the Lease to expire) or stopped (SIGTERM: it releases the Lease and a standby
  takes it within about one retry period); time until another replica holds the Lease.
* **locks**: `benchmarks/bench_locks.py` (see `docs/locks.md`) against the same locks'
  etcd, with raw etcd transactions as its baseline.
* **the benchmarks' VMs** are small (1 CPU, one 256Mi memory slot, fixed size) and ask
  for no acceleration (`enableAcceleration: false`): the simulated nodes have no KVM and
  the benchmark's controller runs without `--kvm-resource`, so a VM asking for KVM
  (NeonVM's default) would get an `AccelerationUnavailable` condition write and a
  Warning event per VM, which neither a production controller (run with
  `--kvm-resource`) nor the raw floor makes. Without it the comparison stays like for
  like.

Why the controller is below the raw floor: it reads directly (a quorum read) where the
protocol needs a fresh copy (before ungate, restart, delete and finalizer removal), it
holds the VM's etcd lock, it records Kubernetes Events (asynchronously, aggregated), and
it performs more than the floor's four writes per VM (the finalizer and status syncs
besides plan, create, commit and ungate); the section "API calls per VM by verb"
counts them. The floor is what no controller can beat on this API server, not a target.

Figures from a shared 2-core machine are noisy: the load average is printed with them.
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-dir", type=Path, default=None,
                   help="Use this running local cluster instead of a private one.")
    p.add_argument("--vms", type=int, default=100, help="VMs of the convergence run.")
    p.add_argument("--large", action="store_true", help="Also converge 1,000 and 5,000 VMs.")
    p.add_argument("--sizes", type=sizes_arg, default=None,
                   help="Comma-separated VM counts of the convergence runs (replaces "
                        "--vms and --large).")
    p.add_argument("--deletions", type=int, default=30, help="Pod deletions timed.")
    p.add_argument("--kills", type=int, default=3, help="Leader kills per signal.")
    p.add_argument("--lock-ops", type=int, default=400, help="Operations per lock scenario.")
    p.add_argument("--nodes", type=int, default=3, help="Simulated nodes (private cluster).")
    p.add_argument("--no-docs", action="store_true", help=f"Do not write {DOC.name}.")
    p.add_argument("--converge-only", action="store_true",
                   help="Run the convergence runs only (leader RSS and VMs/s) and print "
                        "their rows; implies --no-docs.")
    args = p.parse_args()
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    sizes = args.sizes or [args.vms] + ([1000, 5000] if args.large else [])
    # Room for the floor's pods and the controller's at once (the floor's namespace goes
    # at the end of each run), so no pod waits unschedulable in either.
    with local_cluster(args.state_dir, args.nodes, pods=2 * max(sizes) + 50) as cluster:
        conv = []
        for i, n in enumerate(sizes):
            say(f"== convergence of {n} VMs")
            # A private cluster's last convergence is left to the teardown when nothing
            # else is measured on it after.
            last = i == len(sizes) - 1 and args.converge_only and args.state_dir is None
            conv.append(cb.convergence(cluster, n, say, clean_up=not last))
        if args.converge_only:
            print(markdown_table(convergence_rows(conv)))
            return 0
        say(f"== replacement latency ({args.deletions} deletions)")
        rep = cb.replacement(cluster, args.deletions, args.deletions, say)
        say(f"== failover ({args.kills} x SIGKILL, {args.kills} x SIGTERM)")
        fo = cb.failover(cluster, args.kills, say)
        say("== locks")
        locks = run_locks(cluster.locks_etcd_config(), args.lock_ops)
    say("== decoding")
    decoding = bench_decode.section(2000)
    rows = controller_rows(conv, rep, fo)
    env = (f"Run {time.strftime('%Y-%m-%d %H:%M')} on {platform.node() or 'a machine'}: "
           f"Python {platform.python_version()}, {os.cpu_count()} CPUs shared with other "
           f"work (load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after), a "
           f"local control plane (etcd, kube-apiserver, scheduler, controller-manager, "
           f"kwok nodes) on the same machine; {time.monotonic() - started:.0f} s in all.")
    text = (f"## Controller\n\n{markdown_table(rows)}\n\n{env}\n\n"
            f"## Locks\n\n{locks}\n\n{decoding}")
    print(markdown_table(rows))
    print()
    print(env)
    print()
    print(locks)
    print()
    print(decoding)
    if not args.no_docs:
        # Keep the opt-in failover section (benchmarks/bench_failover.py writes it).
        kept = ""
        if DOC.exists() and (at := DOC.read_text().find(FAILOVER_SECTION)) >= 0:
            kept = "\n" + DOC.read_text()[at:]
        DOC.write_text(DOC_HEAD + "\n" + text + kept)
        print(f"\nwrote {DOC.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
