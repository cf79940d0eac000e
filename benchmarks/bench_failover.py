"""Leader failover at the chart's default timings, next to the old defaults, in one run.

    python -m benchmarks.bench_failover                 # 50 kills at the defaults, 10 per baseline
    python -m benchmarks.bench_failover --kills 20 --baseline-kills 5 --terms 10
    python -m benchmarks.bench_failover --state-dir D   # use a running local cluster
    python -m benchmarks.bench_failover --write-docs    # also update docs/benchmarks.md

Opt-in: not part of the test command. Three candidates (``tests/programs/candidate.py``,
the election tests' candidate process: a real ``LeaderElector`` with a file epoch floor)
campaign for one Lease on a local API server (loopback). The benchmark SIGKILLs whichever
holds it, and measures from the kill to the moment another candidate *started leading*
(its own ``started`` line, stamped with CLOCK_MONOTONIC, which every process of one machine
shares), then restarts the killed one and waits until all three are up again. ``--terms``
does the same with SIGTERM (graceful: the leader releases the Lease).

Rows, all measured in the same run on the same API server:

* **this code, chart defaults** (``charts/neonvm-controller/values.yaml``, read from the
  file): what the issue asks for.
* **this code, old defaults** (lease 15 s, renew deadline 10 s, retry 2 s): the same code,
  only the timings differ.
* **before (git ref), old defaults**: the election code as it was before the Lease watch
  and the expiry timer (the parent of the commit that added ``neonvm/leader/lease_store.py``,
  or ``--baseline-ref``), extracted with ``git archive`` and put first on the candidates'
  ``PYTHONPATH``: what the chart gave before this change.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import replace_section  # noqa: E402
from neonvm import kube  # noqa: E402
from neonvm.drills.observer import percentile  # noqa: E402

CANDIDATE = ROOT / "tests" / "programs" / "candidate.py"
VALUES = ROOT / "charts" / "neonvm-controller" / "values.yaml"
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Leader failover at the chart's defaults"
OLD = {"lease": 15.0, "renew": 10.0, "retry": 2.0}
STARTUP = 180.0


def say(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def chart_defaults() -> dict[str, float]:
    values = yaml.safe_load(VALUES.read_text())["leaderElection"]
    return {"lease": float(values["leaseDurationSeconds"]),
            "renew": float(values["renewDeadlineSeconds"]),
            "retry": float(values["retryPeriodSeconds"])}


class Candidate:
    """One candidate process and the JSON lines it printed."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, start_new_session=True, env=env)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                self.events.append(event)

    def first(self, kind: str, after: float = 0.0) -> dict[str, Any] | None:
        with self._lock:
            return next((e for e in self.events if e["event"] == kind and e["mono"] >= after),
                        None)

    def leading(self) -> bool:
        with self._lock:
            kinds = [e["event"] for e in self.events if e["event"] in ("started", "stopped")]
        return bool(kinds) and kinds[-1] == "started" and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def wait_until(what: str, timeout: float, check: Any) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.02)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


def leader_of(candidates: list[Candidate]) -> Candidate | None:
    return next((c for c in candidates if c.leading()), None)


def started_after(candidates: list[Candidate], since: float) -> dict[str, Any] | None:
    return next((e for c in candidates if (e := c.first("started", since))), None)


@dataclass
class Scenario:
    label: str
    timings: dict[str, float]
    pythonpath: str | None = None
    kills: list[float] = field(default_factory=list)
    terms: list[float] = field(default_factory=list)


def run_scenario(cluster: Any, scenario: Scenario, kills: int, terms: int,
                 workdir: Path) -> None:
    from kubernetes import client

    api = kube.api_client(cluster.kubeconfig)
    namespace = f"bench-election-{uuid.uuid4().hex[:6]}"
    client.CoreV1Api(api).create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    env = dict(os.environ)
    if scenario.pythonpath:
        env["PYTHONPATH"] = scenario.pythonpath
    t = scenario.timings
    floor = workdir / f"{namespace}-floor.json"
    # A baseline runs the candidate program of its own tree (extract() put it there).
    candidate = CANDIDATE
    if scenario.pythonpath:
        old = Path(scenario.pythonpath) / "tests" / "programs" / "candidate.py"
        candidate = old if old.exists() else CANDIDATE

    def start() -> Candidate:
        return Candidate([
            sys.executable, str(candidate),
            "--kubeconfig", str(cluster.kubeconfig_for("controller")),
            "--namespace", namespace, "--floor-file", str(floor),
            "--lease-duration", str(t["lease"]), "--renew-deadline", str(t["renew"]),
            "--retry-period", str(t["retry"])], env)

    candidates = [start() for _ in range(3)]
    try:
        for c in candidates:
            wait_until("a candidate ready", STARTUP, lambda c=c: c.first("ready"))
        plan = [signal.SIGKILL] * kills + [signal.SIGTERM] * terms
        for n, sig in enumerate(plan, 1):
            leader = wait_until("a leader", STARTUP + 3 * t["lease"],
                                lambda now=candidates: leader_of(now))
            # Kill at a random phase of the renewal cycle, with every standby campaigning.
            time.sleep(2 * t["retry"] + random.uniform(0, t["retry"]))
            killed_at = time.monotonic()
            leader.proc.send_signal(sig)
            others = [c for c in candidates if c is not leader]
            started = wait_until(f"a new leader after {sig.name}", STARTUP + 3 * t["lease"],
                                 lambda o=others, k=killed_at: started_after(o, k))
            seconds = started["mono"] - killed_at
            (scenario.kills if sig == signal.SIGKILL else scenario.terms).append(seconds)
            say(f"{scenario.label}: {sig.name} {n}/{len(plan)}: new leader started "
                f"{seconds:.2f}s after the signal")
            leader.stop()
            fresh = start()
            candidates = [*others, fresh]
            wait_until("the restarted candidate ready", STARTUP,
                       lambda f=fresh: f.first("ready"))
    finally:
        for c in candidates:
            c.stop()
        try:
            client.CoreV1Api(api).delete_namespace(namespace)
        except Exception as exc:  # the private cluster goes anyway
            say(f"could not delete {namespace}: {exc}")
        api.close()


def baseline_ref() -> str:
    added = subprocess.run(
        ["git", "log", "--format=%H", "--diff-filter=A", "--", "neonvm/leader/lease_store.py"],
        cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()
    if not added:
        raise SystemExit("cannot find the commit that added neonvm/leader/lease_store.py; "
                         "pass --baseline-ref")
    return f"{added[-1]}^"


def extract(ref: str, into: Path) -> str:
    """``neonvm/`` at ``ref`` into ``into``; returns the directory for PYTHONPATH."""
    archive = into / "old.tar"
    # Its own candidate program too: today's builds today's elector (store first).
    subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), ref, "neonvm",
                    "tests/programs/candidate.py"], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "old", filter="data")
    commit = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    return f"{into / 'old'}|{commit}"


@contextmanager
def local_cluster(state_dir: Path | None) -> Iterator[Any]:
    from neonvm.dev.binaries import install_binaries
    from neonvm.dev.cluster import ClusterSpec, LocalCluster

    if state_dir is not None:
        yield LocalCluster(state_dir)
        return
    install_binaries(with_nodes=False)
    tmp = Path(tempfile.mkdtemp(prefix="neonvm-bench-election-"))
    cluster = LocalCluster(tmp, ClusterSpec.with_free_ports(nodes=0))
    try:
        say(f"starting a private control plane in {tmp}")
        cluster.up(progress=say)
        yield cluster
    finally:
        cluster.down()
        shutil.rmtree(tmp, ignore_errors=True)


def fmt(values: list[float]) -> str:
    if not values:
        return "-"
    p = {q: percentile(values, q) for q in (0.5, 0.9, 0.99)}
    return (f"{len(values)} | {p[0.5]:.2f} | {p[0.9]:.2f} | {p[0.99]:.2f} | "
            f"{max(values):.2f} | {sum(values) / len(values):.2f}")


def table(scenarios: list[Scenario]) -> str:
    rows = ["| code, timings (lease / renew deadline / retry) | signal | runs | p50 s | "
            "p90 s | p99 s | max s | mean s |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for s in scenarios:
        t = s.timings
        timing = f"{t['lease']:g} / {t['renew']:g} / {t['retry']:g} s"
        for sig, values in (("SIGKILL", s.kills), ("SIGTERM", s.terms)):
            if values:
                rows.append(f"| {s.label}, {timing} | {sig} | {fmt(values)} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-dir", type=Path, default=None,
                   help="Use this running local cluster instead of a private one.")
    p.add_argument("--kills", type=int, default=50, help="SIGKILLs at the chart's defaults.")
    p.add_argument("--terms", type=int, default=20, help="SIGTERMs at the chart's defaults.")
    p.add_argument("--baseline-kills", type=int, default=10,
                   help="SIGKILLs (and a quarter as many SIGTERMs) per old-defaults baseline.")
    p.add_argument("--baseline-ref", default=None,
                   help="Git ref of the code before the change (default: the parent of the "
                        "commit that added neonvm/leader/lease_store.py).")
    p.add_argument("--no-old-code", action="store_true", help="Skip the old-code baseline.")
    p.add_argument("--write-docs", action="store_true", help=f"Update {DOC.name}.")
    args = p.parse_args()
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="neonvm-bench-failover-"))
    defaults = chart_defaults()
    bk, bt = args.baseline_kills, max(1, args.baseline_kills // 4)
    scenarios = [(Scenario("this code, chart defaults", defaults), args.kills, args.terms),
                 (Scenario("this code, old defaults", OLD), bk, bt)]
    if not args.no_old_code:
        path, commit = extract(args.baseline_ref or baseline_ref(), work).split("|")
        scenarios.append((Scenario(f"before ({commit}), old defaults", OLD, path), bk, bt))
    try:
        with local_cluster(args.state_dir) as cluster:
            for scenario, kills, terms in scenarios:
                say(f"== {scenario.label}: {kills} x SIGKILL, {terms} x SIGTERM")
                run_scenario(cluster, scenario, kills, terms, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    env = (f"Run {time.strftime('%Y-%m-%d %H:%M')} on {platform.node() or 'a machine'}: "
           f"Python {platform.python_version()}, {os.cpu_count()} CPUs shared with other "
           f"work (load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after), "
           f"etcd and kube-apiserver on loopback; {time.monotonic() - started:.0f} s in all. "
           "Failover: from the signal to the moment another candidate started leading "
           "(after its epoch claim).")
    text = (f"{SECTION}\n\nGenerated by `python -m benchmarks.bench_failover --write-docs` "
            "(opt-in; see its docstring).\n\n"
            f"{table([s for s, _, _ in scenarios])}\n\n{env}\n")
    print(text)
    if args.write_docs:
        replace_section(DOC, SECTION, text)
        say(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
