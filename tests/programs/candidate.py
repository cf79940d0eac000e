"""A leader-election candidate, run by tests as its own process (``sys.executable``).

It campaigns for a Lease with :class:`neonvm.leader.election.LeaderElector` and reports
what it believes on stdout, one JSON object per line (``event`` says which):

* ``ready``: identity, pid, health port;
* ``started`` / ``stopped``: a term began / ended, with its epoch, the local monotonic
  time (``mono``; CLOCK_MONOTONIC is shared by all processes of one machine, so tests
  can order events of different candidates) and, on ``stopped``, ``valid_until``: the
  instant after which ``Leadership.check()`` refused anyway;
* ``write``: a fenced write of the stand-in for leader work (below) and its result;
* ``late_write`` (with ``--late-write``): after losing a term, one more write under the
  old epoch that deliberately skips ``check()``, as a paused process would send it;
* ``exit``.

Leader work is a *fenced write*: the ConfigMap ``--fence-configmap`` carries the epoch of
the last writer; a write reads it (direct GET) and replaces it with its ``resourceVersion``
only if the stored epoch is not higher than the writer's, so a deposed leader's write is
refused once a newer leader has written, whatever the writer believes.

SIGTERM stops the candidate gracefully (the elector releases the Lease).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm import kube, logs
from neonvm.leader.election import (
    ElectionConfig,
    EpochFloor,
    LeaderElector,
    Leadership,
    LeadershipLost,
    new_identity,
)
from neonvm.leader.health import HealthServer
from neonvm.leader.lease_store import KubernetesLeaseStore

_print_lock = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    line = json.dumps({"event": event, "mono": time.monotonic(), "wall": time.time(), **fields})
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class FileEpochFloor:
    """An epoch floor in a file, atomic across the processes of one machine (flock)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def claim(self, epoch: int, identity: str) -> bool:
        with open(self.path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            text = f.read().strip()
            stored = json.loads(text)["epoch"] if text else None
            if stored is not None and epoch <= stored:
                return False
            f.seek(0)
            f.truncate()
            f.write(json.dumps({"epoch": epoch, "identity": identity}))
            f.flush()
            os.fsync(f.fileno())
            return True


class FencedConfigMap:
    """The stand-in for leader work: a write refused once a higher epoch was recorded."""

    def __init__(self, api: client.ApiClient, namespace: str, name: str, identity: str) -> None:
        self._core: Any = client.CoreV1Api(api)
        self.namespace = namespace
        self.name = name
        self.identity = identity

    def write(self, epoch: int) -> tuple[str, int | None]:
        """("accepted" | "refused" | "error: ...", epoch stored after the attempt)."""
        for _ in range(5):
            try:
                cm = self._core.read_namespaced_config_map(self.name, self.namespace,
                                                           _request_timeout=5)
            except Exception as exc:
                return f"error: {type(exc).__name__}", None
            data = dict(cm.data or {})
            stored = int(data.get("epoch", "-1"))
            if stored > epoch:
                return "refused", stored
            data.update(epoch=str(epoch), writer=self.identity,
                        writes=str(int(data.get("writes", "0")) + 1))
            cm.data = data  # cm.metadata.resource_version is the version we decided from
            try:
                self._core.replace_namespaced_config_map(self.name, self.namespace, cm,
                                                         _request_timeout=5)
            except ApiException as exc:
                if exc.status == 409:
                    continue  # changed since we read it: decide again on the fresh copy
                return f"error: {exc.status}", stored
            except Exception as exc:
                return f"error: {type(exc).__name__}", stored
            return "accepted", epoch
        return "conflict", None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kubeconfig", required=True, help="for the election")
    parser.add_argument("--fence-kubeconfig", help="for the fenced ConfigMap writes")
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--name", default="neonvm-controller")
    parser.add_argument("--identity", default=None)
    parser.add_argument("--lease-duration", type=float, default=3.0)
    parser.add_argument("--renew-deadline", type=float, default=2.0)
    parser.add_argument("--retry-period", type=float, default=0.5)
    parser.add_argument("--fence-configmap", default=None)
    parser.add_argument("--write-interval", type=float, default=0.2)
    parser.add_argument("--floor-file", type=Path, default=None)
    parser.add_argument("--late-write", action="store_true")
    parser.add_argument("--log-file", type=Path, default=None)
    args = parser.parse_args(argv)

    logs.configure("DEBUG" if args.log_file else "INFO", "json")
    if args.log_file is not None:
        from loguru import logger

        logger.remove()
        logger.add(str(args.log_file), level="DEBUG", serialize=True)

    identity = args.identity or new_identity()
    config = ElectionConfig(namespace=args.namespace, name=args.name, identity=identity,
                            lease_duration=args.lease_duration,
                            renew_deadline=args.renew_deadline,
                            retry_period=args.retry_period)
    api = kube.api_client(args.kubeconfig)
    fence = None
    if args.fence_configmap:
        fence = FencedConfigMap(kube.api_client(args.fence_kubeconfig or args.kubeconfig),
                                args.namespace, args.fence_configmap, identity)
    floor: EpochFloor | None = FileEpochFloor(args.floor_file) if args.floor_file else None
    current: list[Leadership] = []

    def on_started(leadership: Leadership) -> None:
        current.append(leadership)
        emit("started", identity=identity, epoch=leadership.epoch)
        while True:
            try:
                leadership.check()
            except LeadershipLost:
                return
            if fence is not None:
                result, stored = fence.write(leadership.epoch)
                emit("write", identity=identity, epoch=leadership.epoch, result=result,
                     stored=stored)
            if leadership.lost.wait(args.write_interval):
                return

    def on_stopped() -> None:
        leadership = current[-1] if current else None
        if leadership is None:
            return
        emit("stopped", identity=identity, epoch=leadership.epoch,
             valid_until=leadership.valid_until)
        if args.late_write and fence is not None:
            result, stored = fence.write(leadership.epoch)
            emit("late_write", identity=identity, epoch=leadership.epoch, result=result,
                 stored=stored)

    store = KubernetesLeaseStore(api, config.namespace, config.name)
    elector = LeaderElector(store, config, on_started, on_stopped, epoch_floor=floor)
    health = HealthServer(0, elector.registry, host="127.0.0.1")
    health.add_check("leader-election", elector.health_check)
    health.start()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    emit("ready", identity=identity, pid=os.getpid(), health_port=health.port)
    runner = threading.Thread(target=elector.run, args=(stop,), name="elector")
    runner.start()
    while runner.is_alive():
        runner.join(0.2)
    health.stop()
    emit("exit", identity=identity)
    return 0


if __name__ == "__main__":
    sys.exit(main())
