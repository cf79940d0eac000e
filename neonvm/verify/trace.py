"""Counterexamples as readable traces: actor, action, resulting state, one step a line."""

from __future__ import annotations

from typing import Any

from neonvm.verify.explore import Counterexample, Report
from neonvm.verify.invariants import ALL_INVARIANTS
from neonvm.verify.model import Pod, World


def pod_summary(p: Pod) -> str:
    flags = ["gated" if p.gated else ("Running" if p.phase == "Running" else p.phase)]
    if not p.gated and p.phase == "Pending":
        flags = ["ungated"]
    if p.terminating:
        flags.append("terminating")
    return f"{p.name}/{p.uid}[{','.join(flags)}]"


def world_summary(w: World) -> str:
    """One line: VM status, pods, lock, workers."""
    if w.vm is None:
        vm = "VM gone"
    else:
        s = w.vm.status
        parts = [f"podName={s.pod_name or '-'}/{s.pod_uid or '-'}"]
        if s.pending:
            parts.append(f"pending={s.pending.name}")
        parts.append(f"planSeq={s.plan_seq}")
        if s.phase:
            parts.append(f"phase={s.phase}")
        if s.fence:
            parts.append(f"fence=e{s.fence.epoch}/t{s.fence.token}")
        if w.vm.deleting:
            parts.append("DELETING")
        if not w.vm.finalizer:
            parts.append("no-finalizer")
        vm = "VM{" + " ".join(parts) + "}"
    pods = "pods{" + " ".join(pod_summary(p) for p in w.pods) + "}"
    lock = f"lock=e{w.lock.epoch}/t{w.lock.token}" if w.lock else "lock=-"
    workers = " ".join(f"c{i}:{x.role[0]}{x.epoch}:{x.pc}" for i, x in enumerate(w.workers)
                       if x.role != "standby")
    return f"{vm} {pods} {lock} [{workers}]"


def format_counterexample(cx: Counterexample) -> str:
    lines = [
        f"VIOLATION {cx.invariant}: {cx.message}",
        f"  ({ALL_INVARIANTS.get(cx.invariant, '')})",
        f"  0. initial: {world_summary(cx.initial)}",
    ]
    for n, (step, w) in enumerate(cx.trace, 1):
        lines.append(f"  {n}. {step.text}")
        lines.append(f"       ⇒ {world_summary(w)}")
    if cx.continuation:
        lines.append("  -- faults stop; the calm run from here:")
        for n, (step, w) in enumerate(cx.continuation, 1):
            lines.append(f"  +{n}. {step.text}")
            lines.append(f"       ⇒ {world_summary(w)}")
    return "\n".join(lines)


def counterexample_json(cx: Counterexample) -> dict[str, Any]:
    return {
        "invariant": cx.invariant,
        "message": cx.message,
        "initial": world_summary(cx.initial),
        "trace": [{"actor": s.actor, "kind": s.kind, "step": s.text, "state": world_summary(w)}
                  for s, w in cx.trace],
        "continuation": [{"actor": s.actor, "kind": s.kind, "step": s.text,
                          "state": world_summary(w)} for s, w in cx.continuation],
    }


def report_row(r: Report) -> dict[str, Any]:
    return {
        "scenario": r.scenario,
        "states": r.states,
        "transitions": r.transitions,
        "depth": r.depth,
        "seconds": round(r.seconds, 1),
        "complete": r.complete,
        "calm_states": r.calm_states,
        "violations": ", ".join(c.invariant for c in r.counterexamples) or "none",
    }
