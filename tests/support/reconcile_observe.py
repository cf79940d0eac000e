"""Readers that record what a reconcile reads."""

from __future__ import annotations

from collections import Counter
from typing import Any

from kubernetes import client

from neonvm.controller import actions as act
from neonvm.controller.acceleration import HTTPRunnerStatus, RunnerReports
from neonvm.controller.cluster import KubeCluster, VMRecord
from neonvm.controller.observe import DirectReader, Snapshot
from neonvm.controller.reconciler import Reconciler
from neonvm.controller.scaling import RunnerScaling


class CountingReader(DirectReader):
    """The driver's direct reader, counting its quorum reads by kind."""

    def __init__(self, api: client.ApiClient) -> None:
        super().__init__(KubeCluster(api))
        self.reads: Counter[str] = Counter()

    def list_pods(self, namespace: str, vm_name: str) -> list[dict[str, Any]]:
        self.reads["list_pods"] += 1
        return super().list_pods(namespace, vm_name)

    def get_vm_raw(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads["get_vm"] += 1
        return super().get_vm_raw(namespace, name)

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads["get_pod"] += 1
        return super().get_pod(namespace, name)


class Recording(Reconciler):
    """Records, for every performed action, what the observation behind it was."""

    def __init__(self, api: client.ApiClient) -> None:
        super().__init__(KubeCluster(api), RunnerScaling(api),
                         runner_reports=RunnerReports(HTTPRunnerStatus()))
        self.counting = CountingReader(api)
        self.ctx.reader = self.counting
        self.vm_writes = 0
        put_status, put_main = self.writer.put_status, self.writer.put_main

        def counted_status(record: VMRecord, status: Any) -> VMRecord:
            self.vm_writes += 1
            return put_status(record, status)

        def counted_main(record: VMRecord, finalizers: list[str]) -> VMRecord:
            self.vm_writes += 1
            return put_main(record, finalizers)

        self.writer.put_status = counted_status  # type: ignore[method-assign]
        self.writer.put_main = counted_main  # type: ignore[method-assign]
        self.performed: list[tuple[str, bool, bool]] = []
        """(action, observation built from a write's answer, observation direct)."""

    def _perform(self, key: str, action: act.Action, snap: Snapshot, authority: Any,
                 log: Any) -> str:
        self.performed.append((type(action).__name__, getattr(snap, "from_write", False),
                               snap.obs.direct))
        return super()._perform(key, action, snap, authority, log)
