"""Liveness of the controller replicas when the locks' etcd misbehaves while they run.

* **A permission revoked while a replica runs** (its etcd user loses the role on its
  prefix): the replica says so once, in one line, ends its term if it leads (releasing
  the Lease once its work returned), and exits 3, as the start-up check does; a
  correctly configured standby then leads (docs/leader-election.md, "A replica its etcd
  refuses"). Before, it retried its epoch claim, refused, every retry period while
  holding the Lease, so no standby could lead.
* **A leader cut off the locks' etcd but not the API server** cannot act (no lock, no
  epoch claim), yet its renewals keep the Lease. A standby that reaches etcd sees no
  presence of the leader's term there and asks it to step down (the step-down request
  of ``neonvm leader step-down``); the leader hands over and the standby leads
  (docs/leader-election.md, "A leader cut off the locks' etcd"). Before, the leader kept
  the Lease for as long as the partition lasted.

Real servers: the session's API server and its locks etcd (TLS, client certificates,
auth on, a role per user), replicas as their own processes.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from neonvm.dev.cluster import LOCKS_ETCD_ROOT, LocalCluster
from neonvm.dev.replica import controller_argv
from neonvm.drills.proxy import FaultProxy
from neonvm.leader.etcd import Etcd, EtcdConfig
from tests.support import FAST, wait_for

LEASE = "neonvm-controller"


@dataclass
class Replica:
    """One ``neonvm controller run`` process, logging JSON to its own file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines()
                if line.startswith("{")]

    def messages(self) -> list[str]:
        return [str(line.get("msg", "")) for line in self.lines()]

    def said(self, start: str) -> bool:
        return any(m.startswith(start) for m in self.messages())

    def errors(self) -> list[dict[str, Any]]:
        return [line for line in self.lines() if line.get("level") in ("error", "critical")]


@pytest.fixture
def prefix() -> str:
    return f"/t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def root(cluster: LocalCluster) -> Iterator[Etcd]:
    """The locks etcd as its root user (what an operator's etcdctl is)."""
    pair = cluster.locks_pki.issue(f"client-{LOCKS_ETCD_ROOT}", LOCKS_ETCD_ROOT)
    with Etcd(EtcdConfig(endpoints=(cluster.locks_etcd_url,), ca=cluster.locks_pki.ca.cert,
                         cert=pair.cert, key=pair.key)) as etcd:
        yield etcd


def _user(cluster: LocalCluster, root: Etcd, name: str, prefix: str) -> EtcdConfig:
    """A client of the locks etcd as user ``name``, whose role reads and writes
    ``prefix``/ (TLS, a client certificate whose CN is the user)."""
    root.grant_prefix(name, secrets.token_urlsafe(16), prefix)
    pair = cluster.locks_pki.issue(f"client-{name}", name)
    return EtcdConfig(endpoints=(cluster.locks_etcd_url,), prefix=prefix,
                      ca=cluster.locks_pki.ca.cert, cert=pair.cert, key=pair.key)


@contextmanager
def replicas(cluster: LocalCluster, namespace: str, tmp_path: Path
             ) -> Iterator[dict[str, Any]]:
    """Start replicas with ``start(name, etcd_config)``; all are stopped at the end and
    their logs printed (pytest shows them when the test failed)."""
    started: list[Replica] = []

    def start(name: str, etcd: EtcdConfig, *extra: str) -> Replica:
        argv = controller_argv(kubeconfig=str(cluster.kubeconfig_for("controller")),
                               etcd_endpoints=etcd, identity=name,
                               lease_namespace=namespace, watch_namespace=namespace,
                               extra=(*FAST, *extra))
        log_path = tmp_path / f"{name}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        replica = Replica(name, proc, log_path)
        started.append(replica)
        return replica

    try:
        yield {"start": start}
    finally:
        for r in started:
            if r.proc.poll() is None:
                r.proc.terminate()
        for r in started:
            try:
                r.proc.wait(30)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()
            print(f"---- {r.name} (exit {r.proc.returncode}) ----\n"
                  f"{r.log_path.read_text()[-20000:]}")


def _holder(api: client.ApiClient, namespace: str) -> tuple[str, int] | None:
    try:
        lease = client.CoordinationV1Api(api).read_namespaced_lease(LEASE, namespace)
    except client.ApiException:
        return None
    return lease.spec.holder_identity or "", lease.spec.lease_transitions or 0


def _exited(replica: Replica) -> int | None:
    return replica.proc.poll()


@pytest.mark.cluster
def test_a_role_revoked_while_running_ends_the_term_releases_and_exits_3_a_standby_leads(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, prefix: str,
        root: Etcd, tmp_path: Path) -> None:
    """Two etcd users on one prefix: ``revoked`` (the leader and one standby) and
    ``kept`` (another standby). The operator revokes ``revoked``'s role: the leader
    and its fellow standby each say so in one line and exit 3; the leader released the
    Lease first, and the standby that may still write its keys leads under a higher
    epoch."""
    revoked_user = f"revoked-{prefix[3:]}"
    revoked = _user(cluster, root, revoked_user, prefix)
    kept = _user(cluster, root, f"kept-{prefix[3:]}", prefix)
    with replicas(cluster, namespace, tmp_path) as group:
        leader = group["start"]("leader-revoked", revoked)
        wait_for(lambda: leader.said("started leading"), 60, what="the first replica leading")
        first = _holder(api, namespace)
        assert first is not None and first[0] == "leader-revoked", first
        standby = group["start"]("standby-revoked", revoked)
        good = group["start"]("standby-kept", kept)
        wait_for(lambda: standby.said("campaigning") and good.said("campaigning"), 60,
                 what="both standbys campaigning")

        root.revoke_prefix(revoked_user)

        for replica in (leader, standby):
            wait_for(lambda r=replica: _exited(r) is not None, 60,
                     what=f"{replica.name} exiting")
        wait_for(lambda: good.said("started leading"), 60, what="the kept standby leading")
        after = _holder(api, namespace)
        assert good.proc.poll() is None

    assert after is not None and after[0] == "standby-kept" and after[1] > first[1], after
    for replica in (leader, standby):
        messages = replica.messages()
        assert replica.proc.returncode == 3, messages
        errors = replica.errors()
        assert len(errors) == 1, messages
        message = str(errors[0]["msg"])
        assert prefix in message and "permission denied" in message, message
        assert "\n" not in message and "stacktrace" not in errors[0], errors[0]
        assert "claiming epoch" not in " ".join(messages), messages
        assert not replica.said("started leading") or replica is leader, messages
    # The leader handed over: its work stopped, then it released the Lease.
    assert leader.said("stopped leading") and leader.said("released the Lease"), \
        leader.messages()
    assert good.errors() == [], good.messages()


TEST_TIMINGS = ("--lease-duration", "3", "--renew-deadline", "2", "--retry-period", "0.5")
"""The test column of docs/leader-election.md's timings: the presence lease is then 6 s
and a standby asks after 6 s without presence, so the handover comes about 12 s after
the cut."""


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.long  # about 35 s (two replicas, a 12 s handover): opt-in, NEONVM_TEST_LONG=1
def test_a_leader_cut_off_the_locks_etcd_only_is_asked_to_step_down_and_a_standby_leads(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, prefix: str,
        tmp_path: Path) -> None:
    """Two replicas, each reaching the locks' etcd through a proxy of its own; the
    leader's is cut (a black hole, as a partition is). The standby, which still reads
    etcd, finds no presence of the leader's term there and asks it to step down; the
    leader (its renewals still reach the API server) ends its term and stands by, and
    the standby leads under a higher epoch."""
    etcd = cluster.locks_etcd_config(prefix)
    host, port = etcd.endpoints[0].removeprefix("https://").rsplit(":", 1)
    with FaultProxy((host, int(port))) as a, FaultProxy((host, int(port))) as b, \
            replicas(cluster, namespace, tmp_path) as group:
        proxies = {"replica-a": a, "replica-b": b}
        started = {name: group["start"](name, dataclasses.replace(
            etcd, endpoints=(f"https://127.0.0.1:{proxy.port}",)), *TEST_TIMINGS)
            for name, proxy in proxies.items()}
        wait_for(lambda: [r for r in started.values() if r.said("started leading")], 60,
                 what="one replica leading")
        first = _holder(api, namespace)
        assert first is not None and first[0] in started, first
        cut = started[first[0]]
        other = next(r for r in started.values() if r is not cut)
        wait_for(lambda: other.said("campaigning"), 60, what="the other replica campaigning")
        with Etcd(etcd) as reader:  # the leader shows its term where the standby looks
            key = f"{prefix}/{namespace}/{LEASE}/leader/presence"
            shown = wait_for(lambda: reader.get(key), 30, what="the leader's presence key")
            assert json.loads(shown.value) == {"identity": cut.name, "epoch": first[1]}

        proxies[cut.name].cut()
        wait_for(lambda: other.said("started leading"), 90, what="the standby leading")
        after = _holder(api, namespace)
        assert cut.proc.poll() is None, cut.messages()  # it stands by, it did not die
        proxies[cut.name].heal()  # a quick stop at the end

    assert after is not None and after[0] == other.name and after[1] > first[1], after
    assert other.said(f"asked {cut.name} (epoch {first[1]}) to step down"), other.messages()
    assert cut.said(f"step-down requested for epoch {first[1]}"), cut.messages()
    assert cut.said(f"stopped leading, epoch {first[1]}: step-down"), cut.messages()
