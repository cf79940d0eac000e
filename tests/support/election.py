"""A fake Lease store and clock for the leader elector's unit tests."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from neonvm.api.times import format_microtime
from neonvm.leader.election import (
    STEP_DOWN_ANNOTATION,
    LeaseRecord,
)
from neonvm.leader.lease_store import LeaseConflict, LeaseNamespaceNotFound, LeaseNotFound


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeLeaseStore:
    """The :class:`~neonvm.leader.lease_store.LeaseStore` contract, in memory.

    ``before_write`` runs before each create/update is applied (a racing writer);
    ``fail`` holds exceptions raised by the next calls instead of answering.
    """

    obj: dict[str, Any] | None = None
    version: int = 0
    namespace_exists: bool = True
    fail: list[Exception] = field(default_factory=list)
    before_write: Callable[[], None] | None = None
    on_fail: Callable[[], None] | None = None
    calls: list[str] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def _maybe_fail(self) -> None:
        if self.fail:
            if self.on_fail is not None:
                self.on_fail()
            raise self.fail.pop(0)

    def _store(self, obj: dict[str, Any]) -> LeaseRecord:
        with self.changed:
            self.version += 1
            obj["metadata"]["resourceVersion"] = str(self.version)
            self.obj = obj
            self.changed.notify_all()
        return LeaseRecord.from_object(copy.deepcopy(obj))

    def put(self, spec: dict[str, Any], annotations: dict[str, str] | None = None) -> LeaseRecord:
        """Another writer sets the Lease (no precondition)."""
        return self._store({"metadata": {"name": "l", "annotations": annotations},
                            "spec": dict(spec)})

    def get(self, timeout: float) -> LeaseRecord | None:
        self.calls.append("get")
        self._maybe_fail()
        return None if self.obj is None else LeaseRecord.from_object(copy.deepcopy(self.obj))

    def create(self, spec: dict[str, Any], timeout: float) -> LeaseRecord:
        self.calls.append("create")
        self._maybe_fail()
        if not self.namespace_exists:
            raise LeaseNamespaceNotFound("ns")
        if self.before_write is not None:
            self.before_write()
        if self.obj is not None:
            raise LeaseConflict("exists")
        return self._store({"metadata": {"name": "l"}, "spec": dict(spec)})

    def update(self, base: LeaseRecord, spec: dict[str, Any], timeout: float, *,
               drop_step_down: bool = False) -> LeaseRecord:
        self.calls.append("update")
        self._maybe_fail()
        if not self.namespace_exists:
            raise LeaseNamespaceNotFound("ns")
        if self.before_write is not None:
            self.before_write()
        if self.obj is None:
            raise LeaseNotFound("gone")
        if self.obj["metadata"]["resourceVersion"] != base.resource_version:
            raise LeaseConflict("changed")
        obj = copy.deepcopy(self.obj)
        obj["spec"] = {**obj["spec"], **spec}
        if drop_step_down and obj["metadata"].get("annotations"):
            obj["metadata"]["annotations"].pop(STEP_DOWN_ANNOTATION, None)
        return self._store(obj)

    def renew(self, base: LeaseRecord, spec: dict[str, Any], timeout: float, *,
              drop_step_down: bool = False) -> LeaseRecord:
        """Conditional on the holder, epoch and uid of ``base``, not its version."""
        self.calls.append("renew")
        self._maybe_fail()
        if self.before_write is not None:
            self.before_write()
        if self.obj is None:
            raise LeaseNotFound("gone")
        spec_now, meta = self.obj["spec"], self.obj["metadata"]
        if (spec_now.get("holderIdentity") or "") != base.holder or \
                int(spec_now.get("leaseTransitions") or 0) != base.transitions or \
                (base.uid is not None and meta.get("uid") != base.uid):
            raise LeaseConflict("not held")
        obj = copy.deepcopy(self.obj)
        obj["spec"] = {**obj["spec"], **spec}
        if drop_step_down and obj["metadata"].get("annotations"):
            obj["metadata"]["annotations"].pop(STEP_DOWN_ANNOTATION, None)
        return self._store(obj)

    def watch(self, timeout: float) -> Iterator[LeaseRecord | None]:
        """Like a Kubernetes watch from "now": the current object first, then changes."""
        with self.changed:
            seen = self.version
            first = copy.deepcopy(self.obj)
        if first is not None:
            yield LeaseRecord.from_object(first)
        while True:
            with self.changed:
                since = seen

                def moved(since: int = since) -> bool:
                    return self.version != since

                if not self.changed.wait_for(moved, timeout):
                    return
                seen = self.version
                current = copy.deepcopy(self.obj)
            yield None if current is None else LeaseRecord.from_object(current)

    @property
    def annotations(self) -> dict[str, str]:
        assert self.obj is not None
        return dict(self.obj["metadata"].get("annotations") or {})

    @property
    def spec(self) -> dict[str, Any]:
        assert self.obj is not None
        return dict(self.obj["spec"])


def held_by(holder: str, *, transitions: int = 3, duration: int = 4,
            renewed: datetime | None = None) -> dict[str, Any]:
    t = format_microtime(renewed or datetime.now(UTC))
    return {"holderIdentity": holder, "leaseDurationSeconds": duration, "acquireTime": t,
            "renewTime": t, "leaseTransitions": transitions}
