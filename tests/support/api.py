"""The sample VirtualMachine (``examples/vm-deploy.yaml``) as a dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vm-deploy.yaml"


def sample_vm(name: str = "postgres14-disk-test") -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load(SAMPLE.read_text())
    obj["metadata"] = {"name": name}
    return obj
