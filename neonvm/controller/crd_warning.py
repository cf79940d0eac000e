"""The once-per-process warning that the VirtualMachine CRD is older than the controller.

The API server prunes a status field its CRD does not know; a status write whose answer
lacks ``scaleLookPodUID`` (sent) says so. Nothing else changes: without it a dropped
scaling plan is looked at within the late-PUT window only (docs/protocol.md, "Live
scaling").
"""

from __future__ import annotations

import threading
from typing import Any


class OldCrdWarning:
    """Warns once per ``warned`` event: the process's, shared by its terms' reconcilers,
    so that a process warns once."""

    def __init__(self, warned: threading.Event | None = None) -> None:
        self.warned = warned or threading.Event()
        self._mutex = threading.Lock()

    def warn(self, log: Any) -> None:
        """Log the warning, unless it was logged already."""
        with self._mutex:
            if self.warned.is_set():
                return
            self.warned.set()
        log.warning("the API server dropped status.scaleLookPodUID from a status write: "
                    "the VirtualMachine CRD is older than this controller (Helm does not "
                    "upgrade crds/): apply the new one with `neonvm manifests crd | "
                    "kubectl apply -f -`. Until then a dropped scaling plan's runner is "
                    "looked at within the late-PUT window only")
