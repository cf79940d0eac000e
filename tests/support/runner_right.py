"""The VM, namespace and token a runner's right tests use."""

from __future__ import annotations

UID = "5d0c1f7e-2b1a-4c3d-8e9f-0a1b2c3d4e5f"


TOKEN = b"the-vms-scaling-token"


NAMESPACE, VM = "tests", "fenced"
