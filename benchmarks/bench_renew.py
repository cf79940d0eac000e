"""Leader election under API latency: terms ended and leader changes, before and after.

    python -m benchmarks.bench_renew                    # 60 s per row, both codes
    python -m benchmarks.bench_renew --period 30        # quicker
    python -m benchmarks.bench_renew --write-docs       # also update docs/benchmarks.md

Opt-in: not part of the test command. Three real ``LeaderElector`` instances (watch on,
no epoch floor, the chart's timings read from ``charts/neonvm-controller/values.yaml``)
campaign for one Lease in an in-memory store that delays every request by the given
latency (half before the store applies it, half after: a symmetric network). For each
latency the run counts, over a fixed period:

* **terms ended**: ``on_stopped`` calls within the period (every term's end, whoever
  took over next; the stop at the end of the period is not counted);
* **leader changes**: acquisitions after the first (``leaseTransitions`` went up), which
  includes a replica taking its own Lease back after its term ended;
* **time led**: the share of the period in which some replica believed it led (sampled
  every 0.1 s), after the first acquisition.

**Before** is the election code at ``--baseline-ref`` (default: the parent of the commit
that made renewals independent of each other's answers), checked out in a separate git
worktree and put first on the child process's ``PYTHONPATH``; **after** is this tree.
Every row of both runs in the same invocation, side by side (all children at once: they
sleep, they do not compute). See docs/leader-election.md, "Renewals in flight".
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
VALUES = ROOT / "charts" / "neonvm-controller" / "values.yaml"
HEADING = "## Leader election under API latency"
LATENCIES = (0.5, 1.0, 1.5, 2.0, 2.4)
DEFAULT_BASELINE = "8a97b5e^"
"""The code before renewals went out on their own schedule (the parent of 8a97b5e)."""


# ---- the child: three electors over a slow in-memory store ------------------------------


class SlowLeaseStore:
    """The LeaseStore contract in memory, every call ``latency`` seconds long.

    Implements both the old contract (get, create, update, watch) and the new ``renew``
    (conditional on holder, epoch and uid), so one store serves both codes.
    """

    def __init__(self, latency: float, record_type: Any, conflict: Any, not_found: Any,
                 drop_key: str) -> None:
        self.latency = latency
        self._record = record_type
        self._conflict = conflict
        self._not_found = not_found
        self._drop_key = drop_key
        self.obj: dict[str, Any] | None = None
        self.version = 0
        self.changed = threading.Condition()
        self.acquisitions = 0

    def _there_and_back(self) -> None:
        time.sleep(self.latency / 2)

    def _answer(self, obj: dict[str, Any] | None) -> Any:
        time.sleep(self.latency / 2)
        return None if obj is None else self._record.from_object(obj)

    def _store(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        if self.obj is None or int(obj["spec"].get("leaseTransitions") or 0) != int(
                self.obj["spec"].get("leaseTransitions") or 0):
            self.acquisitions += 1
        self.obj = obj
        self.changed.notify_all()
        return copy.deepcopy(obj)

    def get(self, timeout: float) -> Any:
        self._there_and_back()
        with self.changed:
            obj = copy.deepcopy(self.obj)
        return self._answer(obj)

    def create(self, spec: dict[str, Any], timeout: float) -> Any:
        self._there_and_back()
        with self.changed:
            if self.obj is not None:
                raise self._conflict("exists")
            stored = self._store({"metadata": {"name": "l", "uid": str(uuid.uuid4())},
                                  "spec": dict(spec)})
        return self._answer(stored)

    def update(self, base: Any, spec: dict[str, Any], timeout: float, *,
               drop_step_down: bool = False) -> Any:
        self._there_and_back()
        with self.changed:
            if self.obj is None:
                raise self._not_found("gone")
            if self.obj["metadata"]["resourceVersion"] != base.resource_version:
                raise self._conflict("changed")
            stored = self._write(spec, drop_step_down)
        return self._answer(stored)

    def renew(self, base: Any, spec: dict[str, Any], timeout: float, *,
              drop_step_down: bool = False) -> Any:
        self._there_and_back()
        with self.changed:
            if self.obj is None:
                raise self._not_found("gone")
            now = self.obj["spec"]
            if (now.get("holderIdentity") or "") != base.holder or int(
                    now.get("leaseTransitions") or 0) != base.transitions or (
                    base.uid is not None and self.obj["metadata"]["uid"] != base.uid):
                raise self._conflict("not held")
            stored = self._write(spec, drop_step_down)
        return self._answer(stored)

    def _write(self, spec: dict[str, Any], drop_step_down: bool) -> dict[str, Any]:
        assert self.obj is not None
        obj = copy.deepcopy(self.obj)
        obj["spec"] = {**obj["spec"], **spec}
        if drop_step_down and obj["metadata"].get("annotations"):
            obj["metadata"]["annotations"].pop(self._drop_key, None)
        return self._store(obj)

    def watch(self, timeout: float) -> Iterator[Any]:
        with self.changed:
            seen = self.version
            first = copy.deepcopy(self.obj)
        if first is not None:
            yield self._record.from_object(first)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.changed:
                since = seen
                if not self.changed.wait_for(lambda: self.version != since,  # noqa: B023
                                             deadline - time.monotonic()):
                    return
                seen = self.version
                current = copy.deepcopy(self.obj)
            yield None if current is None else self._record.from_object(current)


def child(latency: float, period: float, timings: dict[str, float]) -> dict[str, Any]:
    """Run three electors for ``period`` seconds; what happened, as JSON-able numbers."""
    import logging

    from loguru import logger

    from neonvm.leader import election, lease_store

    logger.remove()
    logging.disable(logging.CRITICAL)
    store = SlowLeaseStore(latency, lease_store.LeaseRecord, lease_store.LeaseConflict,
                           getattr(lease_store, "LeaseNotFound", lease_store.LeaseConflict),
                           lease_store.STEP_DOWN_ANNOTATION)
    ended: list[float] = []
    started: list[float] = []
    electors = []
    stop = threading.Event()
    # The baseline's elector takes (api, config, ..., store=); today's takes the store first.
    store_first = next(iter(inspect.signature(election.LeaderElector).parameters)) == "store"
    for i in range(3):
        config = election.ElectionConfig(
            namespace="ns", name="l", identity=f"replica-{i}_{uuid.uuid4().hex[:6]}",
            lease_duration=timings["lease"], renew_deadline=timings["renew"],
            retry_period=timings["retry"])
        make: Any = election.LeaderElector  # either signature, checked above
        electors.append(
            make(store, config, lambda _lead: started.append(time.monotonic()),
                 lambda: ended.append(time.monotonic()), watch=True)
            if store_first else
            make(None, config, lambda _lead: started.append(time.monotonic()),
                 lambda: ended.append(time.monotonic()), store=store, watch=True))
    threads = [threading.Thread(target=e.run, args=(stop,), daemon=True) for e in electors]
    for t in threads:
        t.start()
    begin = time.monotonic()
    samples = led = 0
    while time.monotonic() - begin < period:
        time.sleep(0.1)
        if not started:
            continue
        samples += 1
        led += any(e.is_leader() for e in electors)
    stopped_at = time.monotonic()
    stop.set()
    for t in threads:
        t.join(10)
    return {
        "latency": latency,
        "code": election.__file__,
        "terms_started": len(started),
        "terms_ended": sum(1 for t in ended if t < stopped_at),
        "leader_changes": max(0, store.acquisitions - 1),
        "first_leader_after": None if not started else round(started[0] - begin, 2),
        "time_led": None if not samples else led / samples,
    }


# ---- the parent: both codes, every latency, one table ------------------------------------


def chart_timings() -> dict[str, float]:
    import yaml

    le = yaml.safe_load(VALUES.read_text())["leaderElection"]
    return {"lease": float(le["leaseDurationSeconds"]),
            "renew": float(le["renewDeadlineSeconds"]),
            "retry": float(le["retryPeriodSeconds"])}


def worktree(ref: str) -> tuple[Path, str]:
    """A detached git worktree of ``ref`` in a temporary directory, and its short hash."""
    path = Path(tempfile.mkdtemp(prefix="bench-renew-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), ref], cwd=ROOT,
                   check=True, capture_output=True)
    commit = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    return path, commit


def start_child(tree: Path, latency: float, period: float,
                timings: dict[str, float]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--child", str(latency),
         "--period", str(period), "--timings", json.dumps(timings)],
        env=env, cwd=tree, stdout=subprocess.PIPE, text=True)


def loadavg() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def table(rows: dict[str, list[dict[str, Any]]], labels: dict[str, str]) -> str:
    def led(r: dict[str, Any]) -> str:
        return "no leader" if r["time_led"] is None else f"{100 * r['time_led']:.0f}%"

    out = ["| latency per request | code | terms ended | leader changes | first leader after "
           "| time with a leader |", "|---:|---|---:|---:|---:|---:|"]
    for i, latency in enumerate(LATENCIES):
        for code in ("before", "after"):
            r = rows[code][i]
            first = "-" if r["first_leader_after"] is None else f"{r['first_leader_after']} s"
            out.append(f"| {latency:g} s | {labels[code]} | {r['terms_ended']} | "
                       f"{r['leader_changes']} | {first} | {led(r)} |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--timings", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--period", type=float, default=60.0,
                        help="Seconds per row (default 60).")
    parser.add_argument("--baseline-ref", default=DEFAULT_BASELINE,
                        help=f"The code before (default {DEFAULT_BASELINE}).")
    parser.add_argument("--write-docs", action="store_true",
                        help="Also write the table into docs/benchmarks.md.")
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.period, json.loads(args.timings))))
        return 0

    sys.path.insert(0, str(ROOT))
    from benchmarks.common import replace_section

    timings = chart_timings()
    began, load_before = time.monotonic(), loadavg()
    old_tree, old_commit = worktree(args.baseline_ref)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    try:
        procs = {code: [start_child(tree, latency, args.period, timings)
                        for latency in LATENCIES]
                 for code, tree in (("before", old_tree), ("after", ROOT))}
        rows = {code: [json.loads((p.communicate()[0] or "{}").strip().splitlines()[-1])
                       for p in ps] for code, ps in procs.items()}
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT,
                       check=False, capture_output=True)
    for code, tree in (("before", old_tree), ("after", ROOT)):
        assert all(r["code"].startswith(str(tree)) for r in rows[code]), rows[code]
    labels = {"before": f"before ({old_commit})", "after": f"after ({head})"}
    text = table(rows, labels)
    print(text)
    if args.write_docs:
        stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        section = (
            f"{HEADING}\n\nGenerated by `python -m benchmarks.bench_renew --period "
            f"{args.period:g} --write-docs` (opt-in; see its docstring). Three electors, "
            f"the chart's timings (lease {timings['lease']:g} s, renew deadline "
            f"{timings['renew']:g} s, retry {timings['retry']:g} s), one in-memory Lease "
            f"whose every request takes the latency below; {args.period:g} s per row, "
            "both codes in the same run. *Before*: each renewal waited for the previous "
            "answer plus a retry period, and the term ended renew deadline after the send "
            "of the last good one. *After*: one renewal every retry period by send time, "
            "conditional on holder and epoch; the term ends when none succeeded within "
            "retry period + renew deadline of the last good send "
            "(docs/leader-election.md, \"Renewals in flight\").\n\n"
            f"{text}\n\nRun {stamp} on {platform.node()}: Python "
            f"{platform.python_version()}, {os.cpu_count()} CPUs shared with other work "
            f"(load average {load_before} before, {loadavg()} after); "
            f"{time.monotonic() - began:.0f} s in all.\n\n")  # a blank line before the next
        replace_section(DOC, HEADING, section)
        print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
