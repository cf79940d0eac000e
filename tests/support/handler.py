"""A world the handler's unit tests drive: a fake reconciler, cache and clock."""

from __future__ import annotations

from typing import Any

from loguru import logger

from neonvm.controller.handler import Handler, Outcome
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.reconciler import ReconcileResult
from neonvm.controller.timers import VMTimers
from neonvm.controller.workqueue import Backoff, WorkQueue
from tests.support.authority import StaticAuthority

KEY = "ns/vm"


VM = {"metadata": {"name": "vm", "namespace": "ns", "uid": "u1"}}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeCache:
    def __init__(self, raw: dict[str, Any] | None) -> None:
        self.raw = raw

    def get(self, key: str) -> dict[str, Any] | None:
        return self.raw

    def discard(self, key: str, uid: str) -> bool:
        self.raw = None
        return True


class FakeReconciler:
    def __init__(self, *results: ReconcileResult | Exception) -> None:
        self.results = list(results)
        self.direct_first: list[bool] = []

    def reconcile(self, key: str, authority: Any, *,
                  direct_first: bool = False) -> ReconcileResult:
        self.direct_first.append(direct_first)
        result = self.results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result


class World:
    """A handler over fakes, and what it did to them."""

    def __init__(self, *results: ReconcileResult | Exception, cached: bool = True,
                 on_server: bool = True, acquire_error: Exception | None = None) -> None:
        self.clock = FakeClock()
        self.queue = WorkQueue(Backoff(base=1.0, cap=8.0), clock=self.clock)
        self.timers = VMTimers(Backoff(base=10.0, cap=100.0), clock=self.clock)
        self.cache = FakeCache(dict(VM) if cached else None)
        self.reconciler = FakeReconciler(*results)
        self.released: list[str] = []
        self.ended = False
        self.ending = False
        self.acquire_error = acquire_error
        self.metrics = ControllerMetrics()
        on_server_vm = dict(VM) if on_server else None
        self.handler = Handler(
            queue=self.queue, vms=self.cache, reconciler=self.reconciler,
            read_vm=lambda namespace, name: on_server_vm,
            acquire=self._acquire, authority=lambda guard: StaticAuthority(),
            release_lock=self.released.append, timers=self.timers,
            term_ending=lambda: self.ending, end_term=self._end, metrics=self.metrics,
            log=logger)

    def _acquire(self, namespace: str, name: str, uid: str) -> Any:
        if self.acquire_error is not None:
            raise self.acquire_error
        return object()

    def _end(self) -> None:
        self.ended = True

    def turn(self, direct: bool = False) -> Outcome:
        taken = self.queue.take(0)
        if taken is not None:
            direct = taken.direct
        try:
            return self.handler.process(KEY, direct)
        finally:
            if taken is not None:
                self.queue.done(KEY)

    def next_turn_at(self) -> tuple[float, bool] | None:
        """In how many seconds the key comes back, and whether read directly (advances
        the fake clock to then; the key is taken, ready for :meth:`turn`'s ``direct``)."""
        start = self.clock.now
        for step in range(0, 1000):
            self.clock.now = start + step / 4
            taken = self.queue.take(0)
            if taken is not None:
                self.queue.done(taken.key)
                return self.clock.now - start, taken.direct
        return None
