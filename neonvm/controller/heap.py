"""Hand the C heap's free pages back to the kernel, periodically.

A leader's memory is mostly what a burst of work left behind, not what it still uses:
tracing the leader over a 2,000-VM burst found the live Python objects grew by about
12 MiB while its resident memory grew by 146 MiB (docs/benchmarks.md, "At scale"). glibc
keeps freed chunks for later allocations and returns the top of its heap only; pages
freed in the middle stay resident until ``malloc_trim`` hands them back
(``MADV_DONTNEED``). Python's own allocator (pymalloc) serves objects of up to 512 bytes
from 256 KiB arenas that go back only when wholly empty, which a trim does not reach;
larger objects (the caches' serialized copies, response bodies, strings) are glibc's.

Measured at 5,000 VMs (docs/benchmarks.md), with two malloc arenas:

- pymalloc, no trim: 289 MiB after the burst, peak 289 MiB;
- pymalloc and this trimmer: 265 MiB, peak 277 MiB, the leader's CPU unchanged;
- ``PYTHONMALLOC=malloc`` (every object glibc's, so a trim reaches all of it) and this
  trimmer: 186 MiB after the burst, but the same peak (296 MiB) and 55% more CPU in the
  leader. The chart keeps pymalloc: its memory limit has to hold the peak either way.

Guarantees:

- One trim per ``period`` seconds while :meth:`HeapTrimmer.run` runs, in its own thread;
  a trim holds each malloc arena's lock only while it walks that arena.
- On a C library without ``malloc_trim`` (musl, macOS) nothing is done, once logged.

Not guaranteed:

- That memory goes down: a trim returns only whole free pages; live objects, and pages
  shared by a live chunk, stay.
- That the peak goes down as much: memory that one burst needs at once is resident at
  that moment whatever is trimmed after it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections.abc import Callable

from loguru import logger

Trim = Callable[[], int]
"""Returns 1 when memory was released to the kernel, 0 otherwise (``malloc_trim``'s
contract)."""


def libc_malloc_trim() -> Trim | None:
    """glibc's ``malloc_trim(0)`` (0: keep no padding at the top of the heap), or None
    where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: int(trim(0))


class HeapTrimmer:
    """Calls ``trim`` every ``period`` seconds until stopped (see module doc)."""

    def __init__(self, period: float, trim: Trim | None = None,
                 on_trim: Callable[[float, int], None] | None = None) -> None:
        """``period`` <= 0 disables it; ``trim`` defaults to glibc's; ``on_trim`` gets
        each trim's duration (seconds) and result (for metrics)."""
        self.period = period
        self._trim = trim if trim is not None else libc_malloc_trim()
        self._on_trim = on_trim
        self.trims = 0

    @property
    def enabled(self) -> bool:
        return self.period > 0 and self._trim is not None

    def trim_once(self) -> int:
        assert self._trim is not None
        started = time.monotonic()
        released = self._trim()
        self.trims += 1
        if self._on_trim is not None:
            self._on_trim(time.monotonic() - started, released)
        return released

    def run(self, stop: threading.Event) -> None:
        """Trim every ``period`` seconds until ``stop`` is set."""
        if self.period <= 0:
            return
        if self._trim is None:
            logger.info("no malloc_trim in this C library: the heap is not trimmed")
            return
        while not stop.wait(self.period):
            self.trim_once()

    def start(self, stop: threading.Event) -> threading.Thread | None:
        """:meth:`run` in a daemon thread; None when disabled."""
        if not self.enabled:
            return None
        thread = threading.Thread(target=self.run, args=(stop,), name="heap-trim",
                                  daemon=True)
        thread.start()
        return thread
