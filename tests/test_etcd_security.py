"""The locks' etcd as an attacker meets it, and leadership after its keys were tampered with.

The session's cluster runs its locks etcd as the chart asks production to
(docs/local-cluster.md, "The locks' etcd"): TLS, client certificates of its own CA only,
auth on, and each client an etcd user whose role reads and writes one prefix. Every
attack below is a real request to that etcd, and each must be refused while the
controller's own keys stay as they were.

The second half is what an attacker who *did* get write access could do to leader
election (docs/locks.md, "The epoch floor"): a garbage epoch floor or a deleted prefix
must neither stop leadership nor let an epoch be used twice.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from kubernetes import client
from prometheus_client import CollectorRegistry

from neonvm.cli import main as cli_main
from neonvm.dev.cluster import LocalCluster
from neonvm.dev.pki import LocalPKI
from neonvm.leader.election import ElectionConfig, LeaderElector, Leadership
from neonvm.leader.epoch import EpochFloor, floor_key
from neonvm.leader.etcd import (
    Etcd,
    EtcdConfig,
    EtcdError,
    EtcdRequestFailed,
    EtcdUnavailable,
)
from neonvm.leader.lease_store import KubernetesLeaseStore
from neonvm.leader.lock import Installation
from tests.support import wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture
def prefix() -> str:
    return f"/t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def victim(cluster: LocalCluster, prefix: str) -> Iterator[tuple[Etcd, str, bytes]]:
    """The controller's etcd client for ``prefix``, with a floor it wrote: (etcd, key, value)."""
    with Etcd(cluster.locks_etcd_config(prefix)) as etcd:
        floor = EpochFloor(etcd, prefix, registry=CollectorRegistry())
        assert floor.claim(5, "leader")
        kv = etcd.get(floor.key)
        assert kv is not None
        yield etcd, floor.key, kv.value


def _attack(config: EtcdConfig, key: str) -> list[str]:
    """Try to read, overwrite and delete ``key`` and everything under its prefix; return
    what succeeded (nothing, for a refused client).

    Each attempt must end in a refusal: etcd answering no (permission denied, no such
    user), or the connection itself failing (a refused TLS handshake, a plain client
    on a TLS port). An attempt that merely runs out of time proves nothing: it is made
    again (the deadline can fall on a reconnection in flight), and after three such
    ends reported as not refused. A refused connection is retried until the deadline,
    so the deadline is short: a second holds many attempts on loopback.
    """
    reached = []
    attacks: list[tuple[str, Callable[[Etcd], object]]] = [
        ("read", lambda e: e.get(key)),
        ("list the prefix", lambda e: e.get_prefix(config.prefix + "/")),
        ("write garbage", lambda e: e.put(key, b"garbage")),
        ("delete", lambda e: e.delete(key)),
    ]
    with Etcd(dataclasses.replace(config, timeout=1.0)) as etcd:
        for name, action in attacks:
            for _attempt in range(3):
                try:
                    action(etcd)
                except EtcdRequestFailed:
                    break
                except EtcdUnavailable as exc:
                    if "failed to connect" in str(exc):
                        break
                    timed_out = f"{name}: no verdict, only a timeout ({exc})"
                    continue
                reached.append(name)
                break
            else:
                reached.append(timed_out)
    return reached


def _unchanged(victim: tuple[Etcd, str, bytes]) -> bool:
    etcd, key, value = victim
    kv = etcd.get(key)
    return kv is not None and kv.value == value


# ---- who gets in ------------------------------------------------------------------------


def test_a_plain_connection_cannot_touch_the_prefix(
        cluster: LocalCluster, prefix: str, victim: tuple[Etcd, str, bytes]) -> None:
    plain = EtcdConfig(endpoints=(cluster.locks_etcd_url.replace("https://", "http://"),),
                       prefix=prefix)
    assert _attack(plain, victim[1]) == []
    assert _unchanged(victim)


def test_tls_without_a_client_certificate_cannot_touch_the_prefix(
        cluster: LocalCluster, prefix: str, victim: tuple[Etcd, str, bytes]) -> None:
    no_cert = EtcdConfig(endpoints=(cluster.locks_etcd_url,), prefix=prefix,
                         ca=cluster.locks_pki.ca.cert)
    assert _attack(no_cert, victim[1]) == []
    assert _unchanged(victim)


def test_a_certificate_of_another_ca_cannot_touch_the_prefix(
        cluster: LocalCluster, prefix: str, victim: tuple[Etcd, str, bytes],
        tmp_path: Path) -> None:
    """Both the API server's CA (a real CA of this cluster) and a CA of the attacker's
    own, with the controller's user and root as the CN: the handshake fails."""
    api_ca = LocalPKI(cluster.state_dir / "pki")
    own_ca = LocalPKI(tmp_path / "attacker", ca_name="attacker-ca")
    for pki in (api_ca, own_ca):
        for cn in ("neonvm-controller", "root"):
            pair = pki.issue(f"etcd-attack-{cn}", cn)
            config = EtcdConfig(endpoints=(cluster.locks_etcd_url,), prefix=prefix,
                                ca=cluster.locks_pki.ca.cert, cert=pair.cert, key=pair.key)
            assert _attack(config, victim[1]) == [], (pki.ca_name, cn)
    assert _unchanged(victim)


def test_a_valid_certificate_for_another_prefix_or_no_user_cannot_touch_the_prefix(
        cluster: LocalCluster, prefix: str, victim: tuple[Etcd, str, bytes]) -> None:
    """The locks CA's own certificates: one whose user's role is another prefix (a
    second installation's, say), and one whose CN names no etcd user."""
    other = cluster.locks_etcd_config(f"{prefix}-other")
    with Etcd(other) as etcd:  # it works where its role allows
        etcd.put(f"{prefix}-other/k", b"mine")
    assert _attack(dataclasses.replace(other, prefix=prefix), victim[1]) == []

    stranger = cluster.locks_pki.issue("client-stranger", "stranger")
    config = EtcdConfig(endpoints=(cluster.locks_etcd_url,), prefix=prefix,
                        ca=cluster.locks_pki.ca.cert, cert=stranger.cert, key=stranger.key)
    assert _attack(config, victim[1]) == []
    assert _unchanged(victim)


def test_the_controllers_own_user_reaches_its_prefix_and_nothing_else(
        cluster: LocalCluster) -> None:
    """What ``neonvm dev env`` exports: the controller's user, the default prefix only;
    ``neonvm locks`` works with it as is."""
    env = cluster.env()
    config = EtcdConfig.from_env(env)
    assert config.endpoints[0].startswith("https://") and config.cert and config.key
    with Etcd(config) as etcd:
        etcd.put(f"{config.prefix}/probe", b"ok")
        with pytest.raises(EtcdError, match="permission denied"):
            etcd.get("/elsewhere/probe")
        with pytest.raises(EtcdError, match="permission denied"):
            etcd.put(f"{config.prefix}-sibling/probe", b"no")  # a string prefix, not a path
    listed = CliRunner().invoke(cli_main, ["locks", "list", "-A", "-o", "json"], env=env)
    assert listed.exit_code == 0, listed.output
    assert isinstance(json.loads(listed.output), list)


# ---- leadership after tampering ---------------------------------------------------------

LEASE = "neonvm-controller"


@pytest.fixture
def elect(api: client.ApiClient, namespace: str) -> Iterator[Callable[[EpochFloor], int]]:
    """Run one elector on ``namespace``'s Lease with the given floor until it leads;
    return its epoch (it is stopped again, releasing the Lease)."""
    stops: list[tuple[threading.Event, threading.Thread]] = []

    def run(floor: EpochFloor) -> int:
        terms: list[Leadership] = []
        config = ElectionConfig(namespace=namespace, name=LEASE, lease_duration=3.0,
                                renew_deadline=2.0, retry_period=0.5)
        store = KubernetesLeaseStore(api, config.namespace, config.name)
        elector = LeaderElector(store, config, terms.append, lambda: None, epoch_floor=floor,
                                registry=CollectorRegistry())
        stop = threading.Event()
        thread = threading.Thread(target=elector.run, args=(stop,), daemon=True)
        thread.start()
        stops.append((stop, thread))
        wait_for(lambda: terms, 60, what="the elector leading")
        stop.set()
        thread.join(30)
        assert not thread.is_alive()
        return terms[0].epoch

    yield run
    for stop, thread in stops:
        stop.set()
        thread.join(30)


def _floor(etcd: Etcd, prefix: str, namespace: str,
           registry: CollectorRegistry | None = None) -> EpochFloor:
    return EpochFloor(etcd, prefix, Installation(namespace, LEASE),
                      registry=registry or CollectorRegistry())


@pytest.mark.parametrize("garbage", [b"\x00not json", b'{"epoch": -1}',
                                     b'{"epoch": 99999999999}'])
def test_a_garbage_epoch_floor_does_not_stop_leadership_and_epochs_still_grow(
        cluster: LocalCluster, prefix: str, namespace: str,
        elect: Callable[[EpochFloor], int], garbage: bytes) -> None:
    with Etcd(cluster.locks_etcd_config(prefix)) as etcd:
        first = elect(_floor(etcd, prefix, namespace))
        key = floor_key(prefix, Installation(namespace, LEASE))
        etcd.put(key, garbage)  # an attacker with write access to the prefix

        registry = CollectorRegistry()
        floor = _floor(etcd, prefix, namespace, registry)
        second = elect(floor)
        assert second > first
        repaired = floor.current()
        assert repaired is not None and repaired.epoch == second
        assert registry.get_sample_value("neonvm_epoch_floor_repairs_total") == 1


def test_deleting_the_prefix_does_not_let_an_epoch_be_used_again(
        cluster: LocalCluster, prefix: str, namespace: str,
        elect: Callable[[EpochFloor], int]) -> None:
    """The Lease's leaseTransitions carries every epoch used under it: the floor only
    matters once the Lease itself is gone (docs/locks.md, "The epoch floor")."""
    with Etcd(cluster.locks_etcd_config(prefix)) as etcd:
        used = [elect(_floor(etcd, prefix, namespace)) for _ in range(2)]
        deleted = sum(etcd.delete(kv.key) for kv in etcd.get_prefix(prefix + "/").kvs)
        assert deleted >= 1 and not etcd.get_prefix(prefix + "/").kvs
        after = elect(_floor(etcd, prefix, namespace))
        assert after > max(used), (used, after)
