"""A VM too large to cache: left alone, and said so (Degraded ``ObjectTooLarge``).

The VM informer caches a VM whose JSON is above :data:`~neonvm.controller.informer.
MAX_CACHED_VM_BYTES` as a stub (its metadata and small status, no spec:
:func:`~neonvm.controller.informer.too_large`), so that the rights endpoint still grants
its running pod. The reconciler decides nothing from a stub, and nothing from a direct
read of such a VM either, except its deletion (which needs no spec): it writes Degraded
True ``ObjectTooLarge`` and ends Done. So its pod is neither restarted, nor deleted, nor
scaled while the VM stays too large; once it is smaller, the informer caches it whole and
the next reconcile goes on as usual (and turns Degraded False, ``Recovered``).
docs/reconciler.md, "A VM too large to cache".
"""

from __future__ import annotations

import json
from typing import Any

from neonvm.api.types import VirtualMachine
from neonvm.controller.informer import MAX_CACHED_VM_BYTES, too_large
from neonvm.controller.observe import Snapshot
from neonvm.controller.reasons import DEGRADED, OBJECT_TOO_LARGE

READ_DIRECTLY = "read directly"
""":func:`verdict`: decide nothing from this snapshot; read the VM directly first."""


def measured_size(raw: dict[str, Any]) -> int:
    """The length of ``raw``'s JSON as the API server writes it, or a little less (the
    server also escapes ``<``, ``>`` and ``&``): a VM measured above the bound here is
    above it in the informer too, so it is cached as a stub."""
    return len(json.dumps(raw, separators=(",", ":"), ensure_ascii=False))


def marked(vm: VirtualMachine) -> bool:
    """The VM's status already says Degraded True, ``ObjectTooLarge``."""
    return any(c.type == DEGRADED and c.status == "True" and c.reason == OBJECT_TOO_LARGE
               for c in vm.status.conditions)


def verdict(snap: Snapshot, bound: int = MAX_CACHED_VM_BYTES) -> int | str | None:
    """What the reconciler does with ``snap`` before :func:`~neonvm.controller.decide.
    decide`: None, decide as usual (a VM within the bound, or a direct read of one being
    deleted); :data:`READ_DIRECTLY` (a stub not yet marked, or one being deleted); else
    the VM's JSON length: leave it alone (a direct read, or a stub already marked)."""
    record = snap.record
    if record is None:
        return None
    deleting = record.vm.deletion_timestamp is not None
    stub = too_large(record.raw)
    if stub is not None:  # from the cache
        return READ_DIRECTLY if deleting or not marked(record.vm) else stub
    if not snap.obs.direct:
        return None  # the cache holds only VMs within the bound whole
    size = measured_size(record.raw)
    return None if size <= bound or deleting else size


def message(size: int, bound: int = MAX_CACHED_VM_BYTES) -> str:
    """The Degraded message."""
    return (f"the VM's JSON is {size:,} bytes, more than the {bound:,} the controller "
            "caches (docs/security.md, \"Exhaustion\"): its runner pod keeps running and "
            "keeps its right to run, but nothing is done to it (no restart, no scaling, "
            "no new pod) until the VM is smaller")
