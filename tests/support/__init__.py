"""Helpers the tests share, by subject; never imported by ``neonvm/``.

This module: waits, ports, private etcds, replica groups, the shipped reconciler built
over a client. Beside it: the controller harness (``harness``: VM helpers, replicas as
processes), the one in-memory API server (``fake_cluster``), a fixed authority
(``authority``), the model trace replayer (``replay``), the chart (``chart``,
``chartdefaults``), the runner (``runner``, ``runner_scaling``, ``runner_right``), the
reconciler (``reconcile``, ``reconcile_observe``, ``failover``), scaling
(``scaling_controller``, ``scaling_decide``, ``scaling_token``) and others. Fixtures two or
more test files use are defined in these modules and registered in ``tests/conftest.py``.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kubernetes import client

if TYPE_CHECKING:
    from neonvm.api.types import Fence
    from neonvm.controller.reconciler import Reconciler
    from neonvm.dev.cluster import LocalCluster
    from neonvm.dev.pki import LocalPKI
    from neonvm.leader.etcd import EtcdConfig
    from tests.support.harness import Replicas

T = TypeVar("T")

FAST = ["--lease-duration", "4", "--renew-deadline", "3", "--retry-period", "0.5",
        "--session-ttl", "4", "--plan-requeue", "1", "--resync", "10", "--sweep", "3"]
"""Replica flags for tests: short leases, requeues and sweeps, so failovers and retries
happen within a test's patience."""


def wait_for(
    condition: Callable[[], T], timeout: float = 60.0, interval: float = 0.1, what: str = ""
) -> T:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds.

    Tests wait on conditions with generous bounds, never on sleeps.
    """
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what or condition!r}; last={last!r}"
    )



def shipped_reconciler(api: client.ApiClient, **kw: Any) -> Reconciler:
    """The shipped reconciler with its clients built over ``api``, as the controller's
    composition root builds them (``cluster=``, ``scaling=`` or ``runner_reports=`` given
    in ``kw`` replace them); every other keyword is the reconciler's."""
    from neonvm.controller.acceleration import HTTPRunnerStatus, RunnerReports
    from neonvm.controller.cluster import KubeCluster
    from neonvm.controller.reconciler import Reconciler
    from neonvm.controller.scaling import RunnerScaling

    cluster = kw.pop("cluster", None) or KubeCluster(api)
    scaling = kw.pop("scaling", None) or RunnerScaling(api)
    kw.setdefault("runner_reports", RunnerReports(HTTPRunnerStatus()))
    return Reconciler(cluster, scaling, **kw)

def restart_api_server(cluster: LocalCluster, api: client.ApiClient) -> None:
    """Start the session's stopped kube-apiserver and wait until it serves
    VirtualMachines again: ready (``/readyz``) comes a moment before a CRD's own handler,
    which answers 503 meanwhile, and the next test must not meet that."""
    cluster.start_component("kube-apiserver")
    custom = client.CustomObjectsApi(api)

    def served() -> bool:
        try:
            custom.list_cluster_custom_object("vm.neon.tech", "v1", "virtualmachines", limit=1)
        except client.ApiException:
            return False
        return True

    wait_for(served, 60, interval=0.2, what="VirtualMachines served after the restart")


def create_pull_secret(api: client.ApiClient, namespace: str, name: str) -> None:
    """An (empty) registry credential, as a VM's ``imagePullSecrets`` would name."""
    client.CoreV1Api(api).create_namespaced_secret(namespace, {
        "metadata": {"name": name}, "type": "kubernetes.io/dockerconfigjson",
        "stringData": {".dockerconfigjson": json.dumps({"auths": {}})}})


def health_port(replica: Any) -> int | None:
    """The port a replica (``tests.support.harness.Replica``) serves /healthz and
    /metrics on, from its JSON log; None until it says."""
    for line in replica.log().splitlines():
        if "serving /healthz" in line:
            return int(json.loads(line)["port"])
    return None


def metrics_of(port: int) -> dict[str, float]:
    """One scrape of a replica's neonvm_* metrics: sample (with labels) to value."""
    found: dict[str, float] = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("neonvm_") and " " in line:
                name, value = line.rsplit(" ", 1)
                found[name] = float(value)
    return found


@contextmanager
def replica_group(cluster: LocalCluster, api: client.ApiClient, namespace: str,
                  log_dir: Path, *, prefix: str | None = None, workers: int | None = None,
                  log_tail: int = 20000) -> Iterator[Replicas]:
    """Controller replicas with the test flags (FAST), watching ``namespace`` under their
    own etcd prefix; stopped at the end, their logs printed (pytest shows them only when
    the test failed)."""
    from tests.support.harness import Replicas

    prefix = prefix or f"/t-{uuid.uuid4().hex[:8]}"
    args = [*FAST, "--watch-namespace", namespace, "--etcd-prefix", prefix]
    if workers is not None:
        args += ["--workers", str(workers)]
    group = Replicas(api=api, kubeconfig=cluster.kubeconfig_for("controller"),
                     etcd_endpoints=cluster.locks_etcd_config(prefix), lease_namespace=namespace,
                     log_dir=log_dir, extra_args=args)
    with group:
        yield group
        for r in group:
            print(f"---- {r.name} (exit {r.exit_code()}) ----\n{r.log()[-log_tail:]}")


class CountingAuthority:
    """A fixed authority that counts its checks (each one an etcd read in the manager),
    lost from the ``lose_at``-th check on (None: never)."""

    def __init__(self, epoch: int = 1, token: int = 10, lose_at: int | None = None) -> None:
        from tests.support.authority import StaticAuthority

        self._fixed = StaticAuthority(epoch=epoch, token=token)
        self.lose_at = lose_at
        self.checks = 0

    @property
    def lease(self) -> Fence:
        return self._fixed.lease

    @property
    def vm_uid(self) -> str | None:
        return None

    def check(self) -> None:
        from neonvm.controller.authority import AuthorityLost

        self.checks += 1
        if self.lose_at is not None and self.checks >= self.lose_at:
            raise AuthorityLost("the lock is gone (test)")


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed ``sock`` (EOF or reset); False while it is open."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class Clock:
    """A fake monotonic clock: returns ``now``, which the test moves."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---- an etcd of a test's own ---------------------------------------------------------------


@dataclass
class PrivateEtcd:
    """One etcd process of a test's own: over TLS with client certificates, or plain
    http. The test may stop it (:meth:`terminate`, :meth:`wait`) and start it again."""

    state: Path
    url: str
    pki: LocalPKI
    argv: list[str]
    tls: bool
    proc: subprocess.Popen[bytes] | None = None

    def config(self, prefix: str) -> EtcdConfig:
        """A client's config under ``prefix`` (with a client certificate over TLS)."""
        from neonvm.leader.etcd import EtcdConfig

        if not self.tls:
            return EtcdConfig(endpoints=(self.url,), prefix=prefix)
        holder = self.pki.issue("etcd-client", "neonvm")
        return EtcdConfig(endpoints=(self.url,), prefix=prefix, ca=self.pki.ca.cert,
                          cert=holder.cert, key=holder.key)

    def start(self) -> None:
        with (self.state / "etcd.log").open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)

    def terminate(self) -> None:
        """Begin its graceful stop (SIGTERM, which etcd handles: it sends GOAWAY at once,
        keeps the open streams until its request timeout, 7 s here, then resets them)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60) -> None:
        assert self.proc is not None
        self.proc.wait(timeout)

    def kill(self) -> None:
        """At the end: SIGKILL (its data dir is the test's, thrown away)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def etcd_answers(config: EtcdConfig) -> bool:
    """Whether etcd answers a read under ``config``'s prefix now."""
    from neonvm.leader.etcd import Etcd, EtcdError

    try:
        with Etcd(config) as client_:
            client_.get(f"{config.prefix}/probe", timeout=2)
    except EtcdError:
        return False
    return True


@contextmanager
def private_etcd(state: Path, tls: bool = True,
                 extra_args: Sequence[str] = ()) -> Iterator[PrivateEtcd]:
    """A :class:`PrivateEtcd` under ``state`` (with ``extra_args`` on its command line),
    yielded once it answers, stopped after."""
    from neonvm.dev import binaries
    from neonvm.dev.cluster import free_port
    from neonvm.dev.pki import LocalPKI

    pki = LocalPKI(state / "pki")
    client_port, peer = free_port(), free_port()
    url = f"{'https' if tls else 'http'}://127.0.0.1:{client_port}"
    argv = [str(binaries.require("etcd")), "--name=private", f"--data-dir={state / 'data'}",
            f"--listen-client-urls={url}", f"--advertise-client-urls={url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=private=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync", "--log-level=warn"]
    if tls:
        server = pki.issue("etcd-server", "etcd", server=True)
        argv += [f"--cert-file={server.cert}", f"--key-file={server.key}",
                 "--client-cert-auth", f"--trusted-ca-file={pki.ca.cert}"]
    argv += extra_args
    etcd = PrivateEtcd(state, url, pki, argv, tls)
    etcd.start()
    try:
        probe = etcd.config("/probe")
        wait_for(lambda: etcd_answers(probe), 60, what="the private etcd answering")
        yield etcd
    finally:
        etcd.kill()
