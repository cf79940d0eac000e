"""The heap trimmer: glibc's malloc_trim on a period, in its own thread."""

from __future__ import annotations

import threading

import pytest

from neonvm.controller.heap import HeapTrimmer, libc_malloc_trim

pytestmark = pytest.mark.unit


def test_the_trimmer_trims_once_per_period_until_stopped() -> None:
    calls: list[int] = []
    seen: list[tuple[float, int]] = []
    third = threading.Event()
    stop = threading.Event()

    def trim() -> int:
        calls.append(1)
        if len(calls) == 3:
            third.set()
        return 1

    trimmer = HeapTrimmer(0.01, trim=trim, on_trim=lambda s, r: seen.append((s, r)))
    thread = trimmer.start(stop)
    assert thread is not None
    assert third.wait(30)
    stop.set()
    thread.join(30)
    assert not thread.is_alive()
    assert trimmer.trims == len(calls) >= 3
    assert [r for _, r in seen] == [1] * len(calls)
    assert all(s >= 0 for s, _ in seen)


def test_a_period_of_zero_starts_nothing() -> None:
    trimmer = HeapTrimmer(0.0, trim=lambda: 1)
    assert not trimmer.enabled
    assert trimmer.start(threading.Event()) is None


def test_without_malloc_trim_nothing_starts() -> None:
    trimmer = HeapTrimmer(1.0)
    trimmer._trim = None  # a C library without malloc_trim (musl)
    assert not trimmer.enabled
    assert trimmer.start(threading.Event()) is None


def test_this_machines_c_library_trims_the_heap() -> None:
    trim = libc_malloc_trim()
    assert trim is not None, "glibc has malloc_trim; the controller image runs on glibc"
    assert trim() in (0, 1)
