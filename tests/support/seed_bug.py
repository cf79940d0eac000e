"""The seed's broken update helper, kept here (outside the product) so tests can show
what it did. Never use it anywhere else.

Same signature as :func:`neonvm.controller.update.conditional_update`, so a test can hand
it to a :class:`~neonvm.controller.reconciler.Reconciler` (``update=``) in its place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from neonvm.controller.update import (
    ConflictRetriesExhausted,
    RetryPolicy,
    UpdateOutcome,
    is_conflict,
)

Obj = TypeVar("Obj")
C = TypeVar("C")


def stale_writeback_update(
    current: Obj,
    mutate: Callable[[Obj], C | None],
    write: Callable[[Obj, C], Obj],
    reread: Callable[[], Obj | None],
    *,
    policy: RetryPolicy | None = None,
    conflict: Callable[[BaseException], bool] = is_conflict,
    sleep: Callable[[float], None] = time.sleep,
    on_conflict: Callable[[int], None] | None = None,
) -> UpdateOutcome[Obj]:
    """THE SEED'S BUG, kept only so tests can show what it does. Never use it.

    On a conflict it re-reads the object only to learn the new resourceVersion, then
    writes the change it computed from the *stale* copy over the fresh one: a blind
    write. Whatever happened in between is overwritten, and the caller is told
    "written". Same signature as :func:`conditional_update`, so a test can swap it in.
    """
    policy = policy or RetryPolicy()
    change = mutate(current)
    if change is None:
        return UpdateOutcome(written=False, obj=current, attempts=1, conflicts=0)
    obj: Obj = current
    conflicts = 0
    while True:
        try:
            stored = write(obj, change)
        except Exception as exc:
            if not conflict(exc):
                raise
            conflicts += 1
            if on_conflict is not None:
                on_conflict(conflicts)
            if conflicts >= policy.attempts:
                raise ConflictRetriesExhausted("gave up") from exc
            fresh = reread()
            if fresh is None:
                return UpdateOutcome(written=False, obj=None, attempts=1, conflicts=conflicts)
            obj = fresh  # only its resourceVersion is used: the change stays the stale one
            continue
        return UpdateOutcome(written=True, obj=stored, attempts=1, conflicts=conflicts)
