"""A VirtualMachine object at a given size, as the autoscaler-agent's view of it reads
it (``spec.guest.cpus``, memory slots, ``spec.targetRevision``): for the pure tests of
``tests/test_autoscaler_view.py`` and ``tests/test_neonvm_pod_shape.py``.
docs/neonvm-compat.md.
"""

from __future__ import annotations

from typing import Any

from neonvm.api import types

AGENT_STAMP = "2020-01-01T00:00:00Z"
"""The updatedAt an autoscaler-agent sends in spec.targetRevision (its own clock)."""


def vm_of(cpus: dict[str, Any], slots: int = 1, revision: int | None = None,
          status: dict[str, Any] | None = None) -> types.VirtualMachine:
    spec: dict[str, Any] = {"guest": {
        "cpus": cpus, "memorySlots": {"min": 1, "max": 2, "use": slots},
        "memorySlotSize": "1Gi", "rootDisk": {"image": "/x.raw"}}}
    if revision is not None:
        spec["targetRevision"] = {"revision": {"value": revision, "flags": 0},
                                  "updatedAt": AGENT_STAMP}
    return types.VirtualMachine.from_object({
        "apiVersion": types.API_VERSION, "kind": types.KIND,
        "metadata": {"name": "v", "namespace": "ns", "uid": "u", "generation": 1,
                     "resourceVersion": "1", "finalizers": [types.FINALIZER]},
        "spec": spec, "status": status or {}})
