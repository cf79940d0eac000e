"""A work queue of VM keys with client-go's guarantees: deduplicated, one worker per key.

Semantics (the same as client-go's ``workqueue``):

* ``add(key)``: a key already waiting is not queued twice;
* a key is handed to at most one worker at a time: adding a key that is being processed
  marks it *dirty*, and it is queued again only when that worker calls ``done(key)``;
* ``add_after(key, delay)`` queues the key later (the earliest pending time wins);
* ``add_rate_limited(key)`` queues it after a per-key exponential backoff that grows with
  each call until ``forget(key)`` resets it;
* ``add(key, direct=True)`` (and the same flag on ``add_after`` and ``add_rate_limited``)
  also asks that the key's next processing start with a direct (quorum) read instead of
  the cache: the flag is set at once (even for a delayed add), sticks to the key until a
  worker takes it, and :meth:`WorkQueue.take` hands it out with the key and clears it
  (so a watch event that brings the key back earlier consumes it); with
  ``direct_when_due=True`` instead, a delayed add sets the flag only when its time comes
  (a watch event that brings the key back earlier starts from the cache, and the delayed
  turn still reads directly);
* ``shut_down()`` wakes every waiting ``get`` (which then returns None) and drops
  everything still queued.

Two priorities (this is beyond client-go's plain queue): a key added with
``periodic=True`` (the periodic re-checks of converged VMs, the scans) waits in a second
line that workers serve only when no event-driven key is ready, so a burst of periodic
work never delays a VM that a watch event or an error retry brought up. A key waiting as
periodic that is added again without the flag moves up to the first line; a key added
both ways (also while delayed, or while a worker holds it) counts as event-driven.

Not guaranteed: ordering between different keys beyond first-in first-out, and
persistence (the queue is memory only; the controller re-lists on start).

Instrumented as client-go's queue is (a :class:`QueueObserver`; docs/metrics.md): adds
that queue a key (not those deduplicated), delayed adds (counted as retries), each key's
wait once ready and its processing time, and the depth of both lines at scrape time.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol


@dataclass(frozen=True)
class Backoff:
    """Per-key exponential backoff: ``base * 2**failures``, capped at ``cap`` seconds."""

    base: float = 0.05
    cap: float = 30.0

    def delay(self, failures: int) -> float:
        return float(min(self.cap, self.base * (2 ** max(0, failures))))


class Taken(NamedTuple):
    """A key handed to a worker, and whether its processing must start with a direct read."""

    key: str
    direct: bool


class QueueObserver(Protocol):
    """What a :class:`WorkQueue` tells its metrics (called under the queue's lock: it
    must not call the queue back, but ``depth`` at scrape time)."""

    def attach(self, depth: Callable[[], tuple[int, int]]) -> None:
        """A new queue; ``depth()`` answers its ready keys (event line, periodic line)."""

    def detach(self, depth: Callable[[], tuple[int, int]]) -> None:
        """The queue shut down."""

    def added(self) -> None:
        """A key was queued (not an add deduplicated with a key already waiting)."""

    def delayed(self) -> None:
        """A key was added with a delay (a backoff, a requeue-after)."""

    def taken(self, key: str, waited: float | None) -> None:
        """A worker took ``key`` after it waited ``waited`` seconds ready (None: unknown)."""

    def done(self, key: str) -> None:
        """The worker is done with ``key``."""


class WorkQueue:
    """Deduplicating, delaying, rate-limiting queue of string keys (thread-safe)."""

    def __init__(self, backoff: Backoff | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_wait: Callable[[float, bool], None] | None = None,
                 metrics: QueueObserver | None = None) -> None:
        """``on_wait(seconds, periodic)`` is told, for each key a worker takes, how long
        it waited ready in its line (not its delay before it was due); ``metrics``
        everything the work queue metrics count."""
        self._backoff = backoff or Backoff()
        self._clock = clock
        self._on_wait = on_wait
        self._metrics = metrics
        self._ready_at: dict[str, float] = {}
        """When each key in a line became ready (first time since it was last taken)."""
        self._cond = threading.Condition()
        self._queue: deque[str] = deque()
        self._periodic: deque[str] = deque()
        """The second line; may hold stale entries (keys since moved up or taken), which
        :meth:`take` skips: only keys in ``_periodic_keys`` count."""
        self._periodic_keys: set[str] = set()
        """Dirty keys whose only pending adds are periodic."""
        self._dirty: set[str] = set()
        self._processing: set[str] = set()
        self._waiting: list[tuple[float, int, str]] = []  # heap of (due, seq, key)
        self._due: dict[str, float] = {}  # earliest due time per delayed key
        self._due_periodic: set[str] = set()  # delayed keys whose every add was periodic
        self._seq = itertools.count()
        self._failures: dict[str, int] = {}
        self._direct: set[str] = set()
        self._direct_due: set[str] = set()
        """Delayed keys whose turn, once due, starts with a direct read."""
        self._shutting_down = False
        if metrics is not None:
            metrics.attach(self.depths)

    # ---- adding ----------------------------------------------------------------------

    def add(self, key: str, direct: bool = False, *, periodic: bool = False) -> None:
        with self._cond:
            self._mark_locked(key, direct)
            self._add_locked(key, periodic)

    def _mark_locked(self, key: str, direct: bool) -> None:
        if direct and not self._shutting_down:
            self._direct.add(key)

    def _add_locked(self, key: str, periodic: bool = False) -> None:
        if self._shutting_down:
            return
        if key in self._dirty:
            if not periodic and key in self._periodic_keys:
                # Moves up: its entry in the second line goes stale.
                self._periodic_keys.discard(key)
                if key not in self._processing:
                    self._queue.append(key)
                    self._cond.notify()
            return
        self._dirty.add(key)
        if self._metrics is not None:
            self._metrics.added()
        if periodic:
            self._periodic_keys.add(key)
        if key not in self._processing:
            self._ready_at.setdefault(key, self._clock())
            (self._periodic if periodic else self._queue).append(key)
            self._cond.notify()

    def queued(self, key: str) -> bool:
        """``key`` waits in the queue for a worker (not delayed, not being processed
        only): it gets a turn soon whatever else is added."""
        with self._cond:
            return key in self._dirty

    def add_after(self, key: str, delay: float, direct: bool = False, *,
                  periodic: bool = False, direct_when_due: bool = False) -> None:
        """Queue ``key`` after ``delay`` seconds. ``direct`` marks the key's next
        processing direct at once (an earlier watch event takes the flag);
        ``direct_when_due`` only once the delay is up: a watch event that brings the key
        back earlier starts from the cache, and the delayed turn still reads directly."""
        if delay <= 0:
            self.add(key, direct or direct_when_due, periodic=periodic)
            return
        with self._cond:
            if self._shutting_down:
                return
            if self._metrics is not None:
                self._metrics.delayed()
            self._mark_locked(key, direct)
            if direct_when_due:
                self._direct_due.add(key)
            due = self._clock() + delay
            earlier = self._due.get(key)
            if earlier is not None and not periodic:
                self._due_periodic.discard(key)
            if earlier is not None and earlier <= due:
                return
            if earlier is None and periodic:
                self._due_periodic.add(key)
            self._due[key] = due
            heapq.heappush(self._waiting, (due, next(self._seq), key))
            self._cond.notify()

    def add_rate_limited(self, key: str, direct: bool = False) -> float:
        """Queue ``key`` after its backoff; returns the delay chosen."""
        with self._cond:
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
        delay = self._backoff.delay(failures)
        self.add_after(key, delay, direct)
        return delay

    def forget(self, key: str) -> None:
        """The key succeeded: reset its backoff."""
        with self._cond:
            self._failures.pop(key, None)

    def failures(self, key: str) -> int:
        with self._cond:
            return self._failures.get(key, 0)

    # ---- taking ----------------------------------------------------------------------

    def _promote_due_locked(self) -> float | None:
        """Move due delayed keys into the queue; return seconds until the next one."""
        now = self._clock()
        while self._waiting:
            due, _, key = self._waiting[0]
            if self._due.get(key) != due:
                heapq.heappop(self._waiting)  # superseded by an earlier add_after
                continue
            if due > now:
                return due - now
            heapq.heappop(self._waiting)
            del self._due[key]
            periodic = key in self._due_periodic
            self._due_periodic.discard(key)
            if key in self._direct_due:
                self._direct_due.discard(key)
                self._mark_locked(key, True)
            if key not in self._processing and key not in self._dirty:
                self._ready_at.setdefault(key, due)  # ready since it was due
            self._add_locked(key, periodic)
        return None

    def get(self, timeout: float | None = None) -> str | None:
        """The next key to process (the caller must call ``done``); None on shutdown/timeout.

        Takes the key's direct flag too (see :meth:`take` to learn it)."""
        taken = self.take(timeout)
        return None if taken is None else taken.key

    def take(self, timeout: float | None = None) -> Taken | None:
        """The next key and its direct flag (cleared); the caller must call ``done``."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                if self._shutting_down:
                    return None
                wait = self._promote_due_locked()
                nxt = self._next_locked()
                if nxt is not None:
                    key, periodic = nxt
                    self._processing.add(key)
                    self._dirty.discard(key)
                    direct = key in self._direct
                    self._direct.discard(key)
                    ready = self._ready_at.pop(key, None)
                    waited = None if ready is None else max(0.0, self._clock() - ready)
                    if self._on_wait is not None and waited is not None:
                        self._on_wait(waited, periodic)
                    if self._metrics is not None:
                        self._metrics.taken(key, waited)
                    return Taken(key, direct)
                if deadline is not None:
                    left = deadline - self._clock()
                    if left <= 0:
                        return None
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)

    def _next_locked(self) -> tuple[str, bool] | None:
        """The next ready key and whether it came from the second line: the first line
        before the second (whose stale entries, keys moved up or already taken, are
        dropped on the way)."""
        if self._queue:
            return self._queue.popleft(), False
        while self._periodic:
            key = self._periodic.popleft()
            if key in self._periodic_keys and key not in self._processing:
                self._periodic_keys.discard(key)
                return key, True
        return None

    def done(self, key: str) -> None:
        """Processing of ``key`` finished; if it was added meanwhile, queue it again."""
        with self._cond:
            if self._metrics is not None and key in self._processing:
                self._metrics.done(key)
            self._processing.discard(key)
            if key in self._dirty and not self._shutting_down:
                self._ready_at[key] = self._clock()
                (self._periodic if key in self._periodic_keys else self._queue).append(key)
                self._cond.notify()

    # ---- lifecycle and introspection --------------------------------------------------

    def shut_down(self) -> None:
        with self._cond:
            self._shutting_down = True
            self._queue.clear()
            self._periodic.clear()
            self._periodic_keys.clear()
            self._due_periodic.clear()
            self._dirty.clear()
            self._waiting.clear()
            self._due.clear()
            self._direct.clear()
            self._direct_due.clear()
            self._ready_at.clear()
            self._cond.notify_all()
        if self._metrics is not None:
            self._metrics.detach(self.depths)

    @property
    def shutting_down(self) -> bool:
        with self._cond:
            return self._shutting_down

    def __len__(self) -> int:
        """Keys ready to be processed now, both lines (the queue depth metric)."""
        with self._cond:
            return len(self._queue) + len(self._periodic_keys - self._processing)

    def depths(self) -> tuple[int, int]:
        """Keys ready now in the first (event) line and in the second (periodic) line."""
        with self._cond:
            periodic = len(self._periodic_keys - self._processing)
            return len(self._queue), periodic

    def periodic_waiting(self) -> int:
        """Keys ready in the second (periodic) line."""
        with self._cond:
            return len(self._periodic_keys - self._processing)

    def delayed(self) -> int:
        with self._cond:
            return len(self._due)

