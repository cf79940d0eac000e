"""Hand the C heap's free pages back to the kernel, periodically (``malloc_trim``).

A leader's memory is mostly what a burst of work left behind: glibc keeps freed chunks and
returns only the top of its heap, so pages freed in the middle stay resident until a trim
hands them back; pymalloc's arenas (objects up to 512 bytes) are out of a trim's reach.
One trim per ``period`` seconds in its own thread; on a C library without ``malloc_trim``
nothing is done, once logged. A trim returns only whole free pages, and does not lower a
burst's peak. What it was measured to save, and why the chart keeps pymalloc:
docs/benchmarks.md ("At scale", the heap trimmer).
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
