"""Conditional updates that re-run the *intent* on a conflict, never the stale object.

The seed's bug was a retry loop that, on 409 Conflict, re-read the VM and wrote back
what it had just read: the change it meant to make was silently lost, and the caller
went on as if it had been made. :func:`conditional_update` is the replacement.

How it works. The caller hands over the object its decision was made from (``current``),
a *mutation* (a pure function from an object to the change to write, or None when there
is nothing left to do), a *writer* (performs one conditional write of a change, carrying
the given object's ``resourceVersion``) and a *re-reader* (a direct, quorum read of the
same object). The helper:

1. asks the mutation for the change against the object in hand;
2. writes it conditionally, with that object's ``resourceVersion``;
3. on a conflict, re-reads the object and goes back to 1 with the fresh copy; the
   mutation re-checks that what it is about to change is still what the decision saw,
   and may answer None (someone else did it, or the world moved on);
4. gives up after ``RetryPolicy.attempts`` conflicts (:class:`ConflictRetriesExhausted`).

What is guaranteed:

* every write carries the resourceVersion of the exact object the change was computed
  from, so a write is never applied to a version the mutation did not see;
* the helper itself never writes anything it read: whatever goes out is what the
  mutation returned for that version;
* a None from the mutation, or the object disappearing, ends the update with
  ``written=False``: the caller learns the truth and re-observes.

What is not guaranteed: that the change is written at all (the caller must look at
``UpdateOutcome.written``), or that the mutation is correct; mutations live in
:mod:`neonvm.controller.mutations` and are unit-tested on their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kubernetes.client.exceptions import ApiException

Obj = TypeVar("Obj")
"""The object type (for the controller: a VM as read from the API server)."""
C = TypeVar("C")
"""The change a mutation produces (for the controller: a new status or finalizer list)."""


class ConflictRetriesExhausted(RuntimeError):
    """Every attempt hit a conflict; the caller should back off and re-observe."""


@dataclass(frozen=True)
class RetryPolicy:
    """How many conflicts to absorb and how long to pause before each re-read."""

    attempts: int = 8
    initial_backoff: float = 0.01
    max_backoff: float = 0.5

    def backoff(self, conflicts: int) -> float:
        """Exponential pause after the ``conflicts``-th conflict (1-based)."""
        return float(min(self.max_backoff, self.initial_backoff * (2 ** (conflicts - 1))))


@dataclass(frozen=True)
class UpdateOutcome(Generic[Obj]):
    """What happened: written or not, and the freshest object the helper holds."""

    written: bool
    obj: Obj | None
    """The server's answer to the write; or the copy the mutation declined; None: gone."""
    attempts: int
    """Mutation calls made (1 + number of re-reads)."""
    conflicts: int


def is_conflict(exc: BaseException) -> bool:
    """409 Conflict from the API server (resourceVersion precondition failed)."""
    return isinstance(exc, ApiException) and exc.status == 409


def conditional_update(
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
    """Apply ``mutate``'s change to the object by conditional writes, re-running it on 409.

    ``write(obj, change)`` must make the write conditional on ``obj``'s resourceVersion
    and return the object as stored. ``reread()`` must be a direct read and return None
    when the object no longer exists. Errors other than conflicts propagate unchanged.
    """
    policy = policy or RetryPolicy()
    obj: Obj = current
    conflicts = 0
    attempts = 0
    while True:
        attempts += 1
        change = mutate(obj)
        if change is None:
            return UpdateOutcome(written=False, obj=obj, attempts=attempts, conflicts=conflicts)
        try:
            stored = write(obj, change)
        except Exception as exc:
            if not conflict(exc):
                raise
            conflicts += 1
            if on_conflict is not None:
                on_conflict(conflicts)
            if conflicts >= policy.attempts:
                raise ConflictRetriesExhausted(
                    f"gave up after {conflicts} conflicting writes"
                ) from exc
            sleep(policy.backoff(conflicts))
            fresh = reread()
            if fresh is None:
                return UpdateOutcome(written=False, obj=None, attempts=attempts,
                                     conflicts=conflicts)
            obj = fresh
            continue
        return UpdateOutcome(written=True, obj=stored, attempts=attempts, conflicts=conflicts)


UpdateFunction = Callable[..., UpdateOutcome[Obj]]
"""Signature of :func:`conditional_update`; a test may inject another update helper
(tests/support/seed_bug.py holds the seed's broken one)."""
