"""One Event for a reconcile's progress, instead of one per step.

The Normal events of a VM's way to a running pod (:data:`PROGRESS_EVENTS`) recorded
during one reconcile are held per worker thread and written as one Event when the
reconcile ends: a new VM's plan, create, commit and ungate are one ``Started`` Event, not
four POSTs (docs/reconciler.md, "Echoes of our own writes").
"""

from __future__ import annotations

import threading

from neonvm.api import types
from neonvm.controller import reasons
from neonvm.controller.events import EventRecorder

PROGRESS_EVENTS = frozenset({reasons.PLANNED, reasons.CREATED, reasons.COMMITTED,
                             reasons.STARTED})
"""Normal events of a VM's way to a running pod: those of one reconcile are written as
one Event when it ends (:meth:`ProgressEvents.flush`)."""


class ProgressEvents:
    """Records events through ``events``, holding a reconcile's progress events back until
    :meth:`flush`. Shared by a reconciler's workers: each thread has its own batch."""

    def __init__(self, events: EventRecorder) -> None:
        self.events = events
        self._local = threading.local()

    def begin(self) -> None:
        """A reconcile starts on this thread: hold its progress events back."""
        self._local.batch = []

    def record(self, vm: types.VirtualMachine, reason: str, message: str,
               warning: bool = False) -> None:
        """Record an event. A progress event (:data:`PROGRESS_EVENTS`) inside a reconcile
        waits for the reconcile's end (:meth:`flush`)."""
        batch: list[tuple[types.VirtualMachine, str, str]] | None = getattr(
            self._local, "batch", None)
        if batch is not None and reason in PROGRESS_EVENTS and not warning:
            batch.append((vm, reason, message))
            return
        self.events.record(vm, reason, message, warning=warning)

    def flush(self) -> None:
        """One Event for the progress of the reconcile that ends (however it ends): the
        last step's reason, every step's message in order."""
        batch: list[tuple[types.VirtualMachine, str, str]] | None = getattr(
            self._local, "batch", None)
        self._local.batch = None
        if not batch:
            return
        vm, reason, _ = batch[-1]
        self.events.record(vm, reason, "; ".join(message for _, _, message in batch))
