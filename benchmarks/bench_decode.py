"""Decoding a VirtualMachine object: ``VirtualMachine.from_object`` per call.

    python -m benchmarks.bench_decode              # 2,000 decodes per row
    python -m benchmarks.bench_decode --runs 200   # quicker
    python -m benchmarks.bench_decode --docs       # also write the table into docs/benchmarks.md

The controller decodes a VM several times per step (informer events, direct reads, the
fresh copy of every conditional write), so this cost is paid thousands of times a second
at scale. The baseline, measured in the same run on the same objects, clears the per-class
decoding plan before every decode: that is what each decode paid before the plan was
cached (``typing.get_type_hints`` re-evaluates every annotation of every nested class).

Objects: NeonVM's full example (``examples/neonvm/vm-example-full.yaml``, every spec
field set) and a minimal VM (the smallest spec the CRD accepts).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neonvm.api import schema  # noqa: E402
from neonvm.api.types import VirtualMachine  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench_decode: begin -->", "<!-- bench_decode: end -->"


def example_objects() -> dict[str, dict[str, Any]]:
    full: dict[str, Any] = next(d for d in yaml.safe_load_all(
        (ROOT / "examples" / "neonvm" / "vm-example-full.yaml").read_text())
        if d and d.get("kind") == "VirtualMachine")
    minimal: dict[str, Any] = {"apiVersion": "vm.neon.tech/v1", "kind": "VirtualMachine",
               "metadata": {"name": "small", "namespace": "default"},
               "spec": {"guest": {"rootDisk": {"image": "vm-postgres:15-bullseye"}}}}
    for obj in (full, minimal):
        obj["metadata"].update(uid="0b9d1c0e", resourceVersion="1", generation=1)
    return {"NeonVM full example": full, "minimal VM": minimal}


def percentile(values: list[float], q: float) -> float:
    """Nearest rank, ``q`` in [0, 1]."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def timings(decode: Callable[[], object], runs: int) -> list[float]:
    for _ in range(min(runs, 50)):  # warm up: imports, allocator, branch caches
        decode()
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        decode()
        out.append(time.perf_counter() - start)
    return out


def cold(obj: dict[str, Any]) -> Callable[[], object]:
    def decode() -> object:
        schema._decoding_plan.cache_clear()
        return VirtualMachine.from_object(obj)
    return decode


def warm(obj: dict[str, Any]) -> Callable[[], object]:
    return lambda: VirtualMachine.from_object(obj)


def describe(values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    return (f"p50 {percentile(ms, 0.50):.3f} ms, p99 {percentile(ms, 0.99):.3f} ms "
            f"(mean {statistics.fmean(ms):.3f})")


def table(runs: int) -> str:
    lines = ["| decode (`VirtualMachine.from_object`) | runs | cached plan (shipped) "
             "| baseline: plan rebuilt per decode | speed-up (p50) |",
             "|---|---|---|---|---|"]
    for name, obj in example_objects().items():
        base = timings(cold(obj), runs)
        fast = timings(warm(obj), runs)
        gain = percentile(base, 0.5) / percentile(fast, 0.5)
        lines.append(f"| {name} | {runs} | {describe(fast)} | {describe(base)} | {gain:.1f}x |")
    return "\n".join(lines)


def section(runs: int) -> str:
    """The docs' "Decoding" section, between markers that ``--docs`` replaces."""
    return ("## Decoding\n\n`python -m benchmarks.bench_decode --docs` (also part of "
            "`python -m benchmarks`); see its docstring for the baseline.\n\n"
            f"{BEGIN}\n{table(runs)}\n{END}\n")


def write_docs(text: str) -> None:
    doc = DOC.read_text()
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN not in doc:
        raise SystemExit(f"{DOC.name} has no decoding section: run python -m benchmarks")
    DOC.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, doc,
                          flags=re.S))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000, help="decodes per row [2000]")
    parser.add_argument("--docs", action="store_true", help="write into docs/benchmarks.md")
    args = parser.parse_args(argv)
    text = table(args.runs)
    print(text)
    if args.docs:
        write_docs(text)


if __name__ == "__main__":
    main()
