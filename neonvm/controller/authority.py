"""What a reconcile runs under (:class:`Authority`: the leader epoch and the VM lock's
token), and the exceptions that end a reconcile early. The handler sorts them into
outcomes (docs/architecture.md, "The handler's contract").
"""

from __future__ import annotations

from typing import Protocol

from neonvm.api.types import Fence
from neonvm.controller.mutations import FencedOut
from neonvm.controller.observe import Snapshot


class AuthorityLost(Exception):
    """Leadership or the VM's lock is gone, or the epoch changed: stop at once."""



class RetryableError(Exception):
    """A transient failure (quota, RBAC being set up): retry later with backoff."""



class FencedSnapshot(FencedOut):
    """``decide`` said Fenced: carries the observation it saw (reused when direct)."""

    def __init__(self, message: str, snap: Snapshot) -> None:
        super().__init__(message)
        self.snap = snap



class WrongVM(Exception):
    """The VM was re-created under the same name: the lock we hold names the old uid."""



class Authority(Protocol):
    """What a reconcile runs under: E and T, and a way to learn they no longer hold."""

    @property
    def lease(self) -> Fence: ...

    @property
    def vm_uid(self) -> str | None:
        """UID of the VM the lock was taken for (None: not bound to one)."""
        ...

    def check(self) -> None:
        """Raise :class:`AuthorityLost` if the reconcile must stop."""
        ...
