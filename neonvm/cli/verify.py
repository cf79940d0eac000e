"""``neonvm verify``: explore every interleaving of the protocol, print counterexamples.

``neonvm verify explore`` runs the CI scenarios (``--deep``: the deep set) against the
shipped decide() and mutations and exits 1 if any invariant fails, printing each
counterexample as a trace. ``scenarios``, ``breakages`` and ``invariants`` list what can
be chosen. See docs/verification.md.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import click

from neonvm.cli.output import OUTPUT_OPTION, emit
from neonvm.verify.actors import BREAKAGES, Config
from neonvm.verify.explore import Bounds, Report, Scenario, explore
from neonvm.verify.invariants import ALL_INVARIANTS
from neonvm.verify.scenarios import ci_scenarios, deep_scenarios
from neonvm.verify.trace import counterexample_json, format_counterexample, report_row


def _scenarios(deep: bool, base: Config) -> list[Scenario]:
    return deep_scenarios(base) if deep else ci_scenarios(base)


@click.group()
def verify() -> None:
    """Exhaustive exploration of interleavings, crashes and stale reads."""


@verify.command("explore")
@click.option("--deep", is_flag=True, help="The deep scenario set (much longer).")
@click.option("--scenario", "names", multiple=True, metavar="NAME",
              help="Only these scenarios (repeatable; see `neonvm verify scenarios`).")
@click.option("--break", "breakages", multiple=True, type=click.Choice(sorted(BREAKAGES)),
              help="Deliberately break the model driver (repeatable).")
@click.option("--without-committed-pod-read", is_flag=True,
              help="Model the driver before eabc9e7: no GET of the committed pod after the "
                   "VM read (shows the list-before-GET race, docs/verification.md).")
@click.option("--max-states", type=int, default=None, help="Stop a scenario after N states.")
@click.option("--max-depth", type=int, default=None, help="Stop a scenario after N steps.")
@click.option("--no-liveness", is_flag=True, help="Safety only (faster).")
@click.option("--invariant", "invariants", multiple=True, type=click.Choice(sorted(ALL_INVARIANTS)),
              help="Check only these invariants (repeatable; default: all).")
@click.option("--keep-going", is_flag=True,
              help="Do not stop a scenario at its first counterexample.")
@OUTPUT_OPTION
def explore_cmd(deep: bool, names: tuple[str, ...], breakages: tuple[str, ...],
                without_committed_pod_read: bool, max_states: int | None, max_depth: int | None,
                no_liveness: bool, invariants: tuple[str, ...], keep_going: bool,
                output: str) -> None:
    """Explore the scenarios; exit 1 if any invariant fails."""
    base = Config(breakages=frozenset(breakages),
                  read_committed_pod=not without_committed_pod_read)
    chosen = _scenarios(deep, base)
    known = {s.name for s in chosen}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise click.BadParameter(f"unknown scenario {unknown[0]!r}; known: {', '.join(known)}",
                                 param_hint="--scenario")
    if names:
        chosen = [s for s in chosen if s.name in names]
    bounds = dataclasses.replace(Bounds(), liveness=not no_liveness, max_depth=max_depth)
    if max_states is not None:
        bounds = dataclasses.replace(bounds, max_states=max_states)
    started = time.monotonic()
    reports: list[Report] = []
    for sc in chosen:
        click.echo(f"[{sc.name}] {sc.description}", err=True)

        def progress(r: Report, name: str = sc.name) -> None:
            click.echo(f"[{name}] depth {r.depth}: {r.states:,} states, "
                       f"{r.transitions:,} transitions, {r.seconds:.1f}s", err=True)

        reports.append(explore(sc, bounds, invariants=frozenset(invariants) or None,
                               stop_at_first=not keep_going, progress=progress))
    total = time.monotonic() - started
    rows = [report_row(r) for r in reports]
    found = [c for r in reports for c in r.counterexamples]
    if output == "table":
        emit(rows, output)
        click.echo(f"total: {sum(r.states for r in reports):,} states, "
                   f"{sum(r.transitions for r in reports):,} transitions in {total:.1f}s")
        for r in reports:
            for c in r.counterexamples:
                click.echo(f"\n[{r.scenario}] " + format_counterexample(c))
    else:
        doc: dict[str, Any] = {
            "scenarios": rows,
            "total_states": sum(r.states for r in reports),
            "total_seconds": round(total, 1),
            "counterexamples": [{"scenario": r.scenario, **counterexample_json(c)}
                                for r in reports for c in r.counterexamples],
        }
        emit(doc, output)
    if found:
        raise SystemExit(1)


@verify.command("scenarios")
@click.option("--deep", is_flag=True, help="The deep set.")
@OUTPUT_OPTION
def scenarios_cmd(deep: bool, output: str) -> None:
    """List the scenarios: lock mode, cache history, fault budgets."""
    rows = []
    for sc in _scenarios(deep, Config()):
        budget = ", ".join(f"{k}={v}" for k, v in sc.world.budget._asdict().items() if v)
        workers = sum(1 for w in sc.world.workers if w.role != "standby")
        rows.append({"name": sc.name, "locks": sc.config.locks, "history": sc.config.history,
                     "replicas": len(sc.world.workers), "active": workers,
                     "budget": budget, "description": sc.description})
    emit(rows, output, columns=["name", "locks", "history", "replicas", "budget"]
         if output == "table" else None)


@verify.command("breakages")
@OUTPUT_OPTION
def breakages_cmd(output: str) -> None:
    """List the deliberate breakages of the model driver (mutation testing)."""
    emit([{"name": k, "description": v} for k, v in BREAKAGES.items()], output)


@verify.command("invariants")
@OUTPUT_OPTION
def invariants_cmd(output: str) -> None:
    """List the invariants checked in every state, step, and calm run."""
    emit([{"name": k, "description": v} for k, v in ALL_INVARIANTS.items()], output)
