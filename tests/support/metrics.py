"""The Grafana dashboard's queries and the series and labels they select."""

from __future__ import annotations

import json
import re
from pathlib import Path

CHART = Path(__file__).resolve().parents[2] / "charts" / "neonvm-controller"


DASHBOARD = CHART / "files" / "dashboard.json"


KEYWORDS = {"by", "without", "on", "ignoring", "and", "or", "unless", "bool", "offset",
            "group_left", "group_right"}


def selectors(query: str) -> list[tuple[str, set[str]]]:
    """The metric names a query selects, each with the label names it matches on or
    groups by (Prometheus's target labels job, namespace, pod, instance left out)."""
    text = re.sub(r'"[^"]*"', '""', query)
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors: [5m]
    grouped = {label.strip() for by in re.findall(r"by \(([^)]*)\)", text)
               for label in by.split(",")}
    text = re.sub(r"by \([^)]*\)", "", text)
    found = []
    for match in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?", text):
        if text[match.end():].lstrip().startswith("(") or match.group(1) in KEYWORDS:
            continue  # a function or an aggregation
        labels = set(re.findall(r"([a-z_]+)\s*=~?", match.group(2) or "")) | grouped
        found.append((match.group(1), labels - {"job", "namespace", "pod", "instance", "le"}))
    return found


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    found = []
    for row in board["panels"]:
        for panel in [row, *row.get("panels", [])]:
            found += [t["expr"] for t in panel.get("targets", [])]
    return found
