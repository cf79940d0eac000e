"""The Warning event that goes with the ``FieldsNotImplemented`` condition.

Recorded once per change: when a status write turns the condition True, or changes the
list of fields it names. See :mod:`neonvm.api.compat`.
"""

from __future__ import annotations

from neonvm.api import compat
from neonvm.api.types import Condition, VirtualMachine
from neonvm.controller.events import EventRecorder


def _condition(vm: VirtualMachine) -> Condition | None:
    return next((c for c in vm.status.conditions if c.type == compat.CONDITION), None)


def warn_unimplemented(events: EventRecorder, before: VirtualMachine,
                       after: VirtualMachine) -> bool:
    """Record the Warning if ``after``'s condition newly names fields; True if recorded."""
    now = _condition(after)
    if now is None or now.status != "True":
        return False
    was = _condition(before)
    if was is not None and was.status == "True" and was.message == now.message:
        return False
    events.record(after, compat.REASON_USED, now.message or "", warning=True)
    return True
