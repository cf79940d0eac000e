"""The once-per-process warning that the VirtualMachine CRD is older than the controller.

The API server prunes a status field its CRD does not know: a status write whose answer
lacks a field it sent says so (:func:`pruned_fields`). Two fields are checked, each
added to the CRD after the first release: ``scaleLookPodUID`` (without it a dropped
scaling plan is looked at within the late-PUT window only, docs/protocol.md, "Live
scaling") and ``extraConditions`` (without it every condition but NeonVM's is dropped on
each write: a refused scaling change is planned again at every turn, and the other
conditions are never shown; docs/neonvm-compat.md, "Conditions").
"""

from __future__ import annotations

import threading
from typing import Any

from neonvm.api.schema import encode
from neonvm.api.types import VirtualMachineStatus

EFFECTS = {
    "scaleLookPodUID": "a dropped scaling plan's runner is looked at within the late-PUT "
                       "window only",
    "extraConditions": "every condition but Available and a True Degraded is dropped at "
                       "each status write: a scaling change refused for the running pod "
                       "(ScalingNeedsRestart, ScalingDisabled) is planned and refused "
                       "again at every turn, and WaitingForOldPod, RestartBackoff, "
                       "Scaling, FieldsNotImplemented and a False Degraded are never shown",
}
"""Each checked field: what is lost while the CRD lacks it."""


def pruned_fields(sent: VirtualMachineStatus, answer: dict[str, Any]) -> list[str]:
    """The checked status fields (:data:`EFFECTS`) that ``sent`` carried and the API
    server's ``answer`` (the VM as written, raw) lacks: pruned by an older CRD."""
    wire = encode(sent)
    status = answer.get("status") or {}
    return [name for name in EFFECTS if wire.get(name) and not status.get(name)]


class OldCrdWarning:
    """Warns once per ``warned`` event: the process's, shared by its terms' reconcilers,
    so that a process warns once."""

    def __init__(self, warned: threading.Event | None = None) -> None:
        self.warned = warned or threading.Event()
        self._mutex = threading.Lock()

    def warn(self, log: Any, fields: list[str] | None = None) -> None:
        """Log the warning naming the pruned ``fields`` (default: ``scaleLookPodUID``),
        unless it was logged already."""
        with self._mutex:
            if self.warned.is_set():
                return
            self.warned.set()
        fields = fields or ["scaleLookPodUID"]
        log.warning("the API server dropped {fields} from a status write: the "
                    "VirtualMachine CRD is older than this controller (Helm does not "
                    "upgrade crds/): apply the new one with `neonvm manifests crd | "
                    "kubectl apply -f -`. Until then {effects}",
                    fields=", ".join(f"status.{f}" for f in fields),
                    effects="; and ".join(EFFECTS[f] for f in fields))
