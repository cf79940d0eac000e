"""A fixed authority for driving a reconcile directly in tests (no leader term, no lock)."""

from __future__ import annotations

from dataclasses import dataclass

from neonvm.api.types import Fence


@dataclass(frozen=True)
class StaticAuthority:
    """A fixed (epoch, token), never lost: satisfies
    :class:`neonvm.controller.authority.Authority`."""

    epoch: int = 1
    token: int = 1
    vm_uid: str | None = None

    @property
    def lease(self) -> Fence:
        return Fence(epoch=self.epoch, token=self.token)

    def check(self) -> None:
        return None
