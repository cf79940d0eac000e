"""Exhaustive breadth-first search over every interleaving of the model's actors.

Guarantees, for one :class:`Scenario` (an initial state, the model's configuration and
the fault budgets in the state):

* every state reachable within the bounds is visited once; BFS order, so the first
  counterexample found for an invariant is a shortest one;
* every state invariant is checked in every visited state and every step invariant on
  every explored transition (including transitions into states already visited);
* with ``Bounds.liveness``, from every visited state the faults and adversaries are
  switched off (:func:`~neonvm.verify.actors.calm`) and two fair schedules are run to
  quiescence (cluster first; leader first): each must end converged
  (:func:`~neonvm.verify.invariants.converged`) within ``Bounds.calm_steps``.

What is *not* guaranteed:

* completeness beyond the bounds: the fault budgets, ``Config.history`` and
  ``Bounds.max_states`` / ``max_depth`` bound the search (``Report.complete`` says
  whether the state space under the budgets was exhausted);
* freedom from hash collisions: states are stored as 64-bit hashes (as TLC's
  fingerprints); a collision could merge two distinct states and hide one, with
  probability about n²/2⁶⁵ for n states;
* liveness under *all* fair schedules: two deterministic fair schedules are checked
  per state, not every one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from neonvm.verify.actors import Actors, Config, Step, calm
from neonvm.verify.invariants import (
    ALL_INVARIANTS,
    LIVENESS_INVARIANTS,
    Violation,
    check_state,
    check_step,
    converged,
)
from neonvm.verify.model import World


@dataclass(frozen=True)
class Scenario:
    """Where the search starts and how the model behaves."""

    name: str
    description: str
    config: Config
    world: World


@dataclass(frozen=True)
class Bounds:
    max_states: int = 3_000_000
    max_depth: int | None = None
    liveness: bool = True
    calm_steps: int = 400
    """A calm run longer than this counts as not converging."""


@dataclass
class Counterexample:
    """A violated invariant, with the steps from the scenario's initial state."""

    invariant: str
    message: str
    initial: World
    trace: list[tuple[Step, World]]
    continuation: list[tuple[Step, World]] = field(default_factory=list)
    """For liveness: the calm run from the last state that never converges."""


@dataclass
class Report:
    scenario: str
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    complete: bool = False
    calm_states: int = 0
    counterexamples: list[Counterexample] = field(default_factory=list)


class Liveness:
    """Runs calm schedules from states and remembers each visited state's verdict."""

    SCHEDULES = ("cluster-first", "leader-first")

    def __init__(self, actors: Actors, max_steps: int) -> None:
        self.actors = actors
        self.max_steps = max_steps
        self.verdicts: dict[tuple[str, int], Violation | None] = {}

    def check(self, w: World) -> tuple[Violation, list[tuple[Step, World]]] | None:
        start = calm(w)
        for schedule in self.SCHEDULES:
            v = self._run(start, schedule, None)
            if v is not None:
                steps: list[tuple[Step, World]] = []
                self._run(start, schedule, steps)
                return v, steps
        return None

    def _run(self, s: World, schedule: str, record: list[tuple[Step, World]] | None
             ) -> Violation | None:
        """Follow ``schedule`` from ``s`` until quiescent; the verdict is remembered for
        every state on the way (``record``: do not use remembered verdicts, keep steps)."""
        actors = self.actors
        path: list[tuple[str, int]] = []
        seen: set[int] = set()
        result: Violation | None
        for _ in range(self.max_steps):
            h = hash(s)
            key = (schedule, h)
            if record is None and key in self.verdicts:
                result = self.verdicts[key]
                break
            path.append(key)
            env = actors.environment_steps(s)
            if env and (schedule == "cluster-first" or h in seen):
                step, s = env[0]
                seen.clear()
            elif h in seen:
                result = converged(s)
                break
            else:
                seen.add(h)
                nxt = actors.calm_leader_step(s)
                if nxt is None:
                    if env:
                        step, s = env[0]
                        seen.clear()
                    else:
                        result = converged(s)
                        break
                else:
                    step, s = nxt
            if record is not None:
                record.append((step, s))
        else:
            result = Violation("converges", f"no quiescent state after {self.max_steps} calm "
                               f"steps ({schedule})")
        if record is None:
            for key in path:
                self.verdicts[key] = result
        return result


def explore(scenario: Scenario, bounds: Bounds = Bounds(),
            invariants: frozenset[str] | None = None, stop_at_first: bool = True,
            progress: Callable[[Report], None] | None = None) -> Report:
    """Breadth-first search of ``scenario``; see the module docstring."""
    enabled = frozenset(ALL_INVARIANTS) if invariants is None else invariants
    unknown = enabled - set(ALL_INVARIANTS)
    if unknown:
        raise ValueError(f"unknown invariants: {', '.join(sorted(unknown))}")
    check_liveness = bounds.liveness and bool(enabled & set(LIVENESS_INVARIANTS))
    actors = Actors(scenario.config)
    liveness = Liveness(actors, bounds.calm_steps) if check_liveness else None
    report = Report(scenario=scenario.name)
    started = time.monotonic()
    root = scenario.world
    root_hash = hash(root)
    parents: dict[int, int] = {root_hash: root_hash}
    found: set[str] = set()

    def record(v: Violation, last: int, extra: list[tuple[Step, World]],
               continuation: list[tuple[Step, World]] | None = None) -> None:
        if v.invariant in found:
            return
        found.add(v.invariant)
        trace = _trace(actors, root, parents, last) + extra
        report.counterexamples.append(Counterexample(
            v.invariant, v.message, root, trace, continuation or []))

    def visit(s: World, h: int) -> None:
        v = check_state(s, enabled)
        if v is not None:
            record(v, h, [])
        if liveness is not None:
            lv = liveness.check(s)
            if lv is not None and lv[0].invariant in enabled:
                record(lv[0], h, [], lv[1])

    visit(root, root_hash)
    frontier = [(root, root_hash)]
    truncated = False
    while frontier and not (stop_at_first and report.counterexamples):
        if bounds.max_depth is not None and report.depth >= bounds.max_depth:
            truncated = True
            break
        nxt: list[tuple[World, int]] = []
        for s, sh in frontier:
            for step, t in actors.successors(s):
                report.transitions += 1
                v = check_step(s, t, enabled)
                if v is not None:
                    record(v, sh, [(step, t)])
                th = hash(t)
                if th in parents:
                    continue
                parents[th] = sh
                visit(t, th)
                nxt.append((t, th))
            if len(parents) >= bounds.max_states:
                truncated = True
                break
            if stop_at_first and report.counterexamples:
                break
        frontier = nxt if not truncated else []
        if nxt:
            report.depth += 1
        report.states = len(parents)
        report.seconds = time.monotonic() - started
        if progress is not None:
            progress(report)
    report.states = len(parents)
    report.complete = not truncated and not frontier
    report.seconds = time.monotonic() - started
    report.calm_states = len(liveness.verdicts) if liveness is not None else 0
    return report


def _trace(actors: Actors, root: World, parents: dict[int, int], last: int
           ) -> list[tuple[Step, World]]:
    """The steps from ``root`` to the state hashed ``last``, re-derived by search."""
    chain = [last]
    while parents[chain[-1]] != chain[-1]:
        chain.append(parents[chain[-1]])
    chain.reverse()
    steps: list[tuple[Step, World]] = []
    s = root
    for h in chain[1:]:
        for step, t in actors.successors(s):
            if hash(t) == h:
                steps.append((step, t))
                s = t
                break
        else:  # pragma: no cover - would mean a hash collision
            raise AssertionError("trace reconstruction failed")
    return steps
