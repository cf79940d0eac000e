"""Writing a drill's verdict into docs/drills.md (``neonvm drill <name> --write-docs``).

The infrastructure drills' table sits between ``<!-- infra-drills:begin -->`` and
``<!-- infra-drills:end -->``; one row per drill name, replaced by the next run of that
drill, so the table only ever holds figures of real runs.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from neonvm.drills.drills import Verdict

BEGIN = "<!-- infra-drills:begin -->"
END = "<!-- infra-drills:end -->"
HEADER = (
    "| drill | run | verdict | fault lasted s | recovery s | leader changes in fault | "
    "duplicates (strict/loose) | lost work | churn during the fault | timeline |",
    "|---|---|---|---:|---:|---:|---:|---:|---|---|",
)


def docs_path() -> Path:
    """docs/drills.md of the source tree this package runs from."""
    return Path(__file__).resolve().parents[2] / "docs" / "drills.md"


def row(verdict: Verdict, command: str, timeline_link: str | None) -> str:
    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    f = verdict.fault
    churn = (f"{f.get('churn pod deletions', 0)} pods deleted, "
             f"{f.get('churn VMs created', 0)} VMs created / "
             f"{f.get('churn VMs deleted', 0)} deleted")
    lost = len(verdict.watch.get("unexpected_deletions") or [])
    changes = ("-" if verdict.leader_changes_in_fault is None
               else str(verdict.leader_changes_in_fault))
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    run = f"`{command}` ({verdict.vms} VMs, {when})"
    link = f"[svg]({timeline_link})" if timeline_link else "-"
    return (f"| {verdict.drill} | {run} | {'PASS' if verdict.ok else 'FAIL'} | "
            f"{sec(verdict.fault_seconds)} | {sec(verdict.recovery_seconds)} | {changes} | "
            f"{verdict.duplicates}/{verdict.duplicates_loose} | {lost} | {churn} | {link} |")


def write(text: str, drill: str, new_row: str) -> str:
    """``text`` with the row of ``drill`` replaced by ``new_row`` (added if absent)."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"no {BEGIN} ... {END} block in docs/drills.md")
    head, rest = text.split(BEGIN, 1)
    block, tail = rest.split(END, 1)
    rows = [line for line in block.splitlines()
            if line.startswith("| ") and line not in HEADER]
    rows = [r for r in rows if r.split("|")[1].strip() != drill] + [new_row]
    from neonvm.drills.infra import RECORDED

    order = {name: i for i, name in enumerate(RECORDED)}
    rows.sort(key=lambda r: order.get(r.split("|")[1].strip(), 99))
    return head + BEGIN + "\n" + "\n".join([*HEADER, *rows]) + "\n" + END + tail


def write_docs(verdict: Verdict, command: str, path: Path | None = None) -> Path:
    """Record ``verdict`` in docs/drills.md; the timeline link is relative to docs/."""
    path = path or docs_path()
    link = None
    if verdict.timeline_svg:
        svg = Path(verdict.timeline_svg).resolve()
        try:
            link = str(svg.relative_to(path.parent.resolve()))
        except ValueError:
            link = None
    path.write_text(write(path.read_text(), verdict.drill, row(verdict, command, link)))
    return path
