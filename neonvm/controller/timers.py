"""The per-VM clocks that outlive one reconcile, in one place.

Two things are remembered about a VM between its reconciles, in memory, by the leader:

* its *stuck streak*: how many reconciles in a row ended stuck (step budget used up, a
  step refused for good), and until when it waits out the stuck backoff that follows
  (the periodic scans leave it alone meanwhile; a reconcile that ends normally resets
  it);
* its *create failures*: transient pod-create failures in a row, and when the first one
  was (after a few lasting a minute, Degraded ``CreateFailing`` says so; a create that
  gets an answer resets it).

A third per-VM timer, the ``FenceAhead`` quiet period, is not kept here: it is the
condition's ``lastTransitionTime`` on the VM itself (see
:func:`~neonvm.controller.conditions.fence_ahead_mutation`), so it survives a new leader.

:meth:`VMTimers.forget` drops everything about a VM; the handler calls it when it finds
the VM gone, so the maps hold live VMs only. Thread-safe. Memory only: a new term starts
with none (a stuck VM is tried once more at once; a create failing for a while takes a
few more failures before the condition).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from neonvm.controller.workqueue import Backoff


class Jitter:
    """A period stretched by a random share of itself (client-go's ``wait.Jitter``):
    ``seconds * (1 + spread * u)``, ``u`` uniform in [0, 1). Periodic work spread this way
    does not come back in one lump: VMs that converged together are re-checked apart."""

    def __init__(self, seconds: float, spread: float = 0.25,
                 rng: random.Random | None = None) -> None:
        self.seconds = seconds
        self.spread = spread
        self._rng = rng or random.Random()
        self._mutex = threading.Lock()

    def __call__(self) -> float:
        with self._mutex:
            u = self._rng.random()
        return self.seconds * (1.0 + self.spread * u)


class VMTimers:
    """Stuck streaks and create failures per VM key (``namespace/name``)."""

    def __init__(self, stuck_backoff: Backoff | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._stuck_backoff = stuck_backoff or Backoff(base=1.0, cap=300.0)
        self._clock = clock
        self._mutex = threading.Lock()
        self._stuck: dict[str, tuple[int, float]] = {}
        """Per VM: (stuck reconciles in a row, clock time the backoff ends)."""
        self._create_failures: dict[str, tuple[int, float]] = {}
        """Per VM: (transient create failures in a row, clock time of the first)."""

    # ---- stuck backoff ---------------------------------------------------------------

    def stuck(self, key: str) -> float:
        """One more stuck reconcile of ``key``: the delay before it is looked at again."""
        with self._mutex:
            streak, _ = self._stuck.get(key, (0, 0.0))
            delay = self._stuck_backoff.delay(streak)
            self._stuck[key] = (streak + 1, self._clock() + delay)
        return delay

    def unstuck(self, key: str) -> None:
        """A reconcile of ``key`` ended normally: its streak starts again from zero."""
        with self._mutex:
            self._stuck.pop(key, None)

    def backing_off(self, key: str) -> bool:
        """``key`` is waiting out a stuck backoff: the periodic scans skip it."""
        with self._mutex:
            entry = self._stuck.get(key)
        return entry is not None and entry[1] > self._clock()

    # ---- create failures -------------------------------------------------------------

    def create_failed(self, key: str) -> tuple[int, float]:
        """One more transient create failure: (failures in a row, seconds since the first)."""
        now = self._clock()
        with self._mutex:
            failures, since = self._create_failures.get(key, (0, now))
            failures += 1
            self._create_failures[key] = (failures, since)
        return failures, now - since

    def create_answered(self, key: str) -> None:
        """A create of ``key`` got an answer (or was never sent): the run of failures ends."""
        with self._mutex:
            self._create_failures.pop(key, None)

    # ---- the VM is gone --------------------------------------------------------------

    def forget(self, key: str) -> None:
        """``key`` no longer exists: drop everything remembered about it."""
        with self._mutex:
            self._stuck.pop(key, None)
            self._create_failures.pop(key, None)

    def keys(self) -> set[str]:
        """Every VM something is remembered about (for tests and introspection)."""
        with self._mutex:
            return set(self._stuck) | set(self._create_failures)
