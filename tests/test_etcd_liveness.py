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
import threading
import types
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from kubernetes import client
from prometheus_client import CollectorRegistry

from neonvm.dev.cluster import LOCKS_ETCD_ROOT, LocalCluster
from neonvm.dev.replica import controller_argv
from neonvm.drills.infra import EtcdMember, three_members
from neonvm.drills.proxy import FaultProxy
from neonvm.leader.election import (
    STEP_DOWN_ANNOTATION,
    AccessRefused,
    ElectionConfig,
    LeaderElector,
    Leadership,
    LeaseRecord,
    StepDownRequest,
)
from neonvm.leader.epoch import EpochFloor
from neonvm.leader.etcd import (
    Etcd,
    EtcdAccessDenied,
    EtcdConfig,
    EtcdUnavailable,
)
from neonvm.leader.lease_store import KubernetesLeaseStore, LeaseConflict
from neonvm.leader.lock import Installation
from tests.support import FAST, PrivateEtcd, private_etcd, wait_for
from tests.support.election import FakeClock, FakeLeaseStore, held_by
from tests.support.etcd_faults import _Failure
from tests.support.harness import converged, create_vm, runner_pods

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


# ---- the elector's rules, over the in-memory Lease store -------------------------------------

STEADY = {"namespace": "ns", "name": "l"}
"""The default timings (4 s lease, 2.5 s renew deadline): for the tests of refusals, in
which a term must not end by its deadline on a loaded machine."""

CONFIRM = 0.3
"""Seconds a refusal must last before it ends an elector, in the unit tests."""

QUICK = {"lease_duration": 0.6, "renew_deadline": 0.3, "retry_period": 0.1,
         "namespace": "ns", "name": "l"}
"""Short timings for the unit tests: the presence count is then 1.2 s, read every 0.3 s."""


class AskableStore(FakeLeaseStore):
    """The in-memory store with the step-down request a standby writes (conditional on
    the named term's holder and epoch, like the Kubernetes store's JSON patch)."""

    def request_step_down(self, base: LeaseRecord, request: StepDownRequest,
                          timeout: float) -> LeaseRecord:
        assert self.obj is not None
        spec = self.obj["spec"]
        if (spec.get("holderIdentity"), spec.get("leaseTransitions")) != (
                base.holder, base.transitions):
            raise LeaseConflict("that term is over")
        self.calls.append("request_step_down")
        annotations = {**(self.obj["metadata"].get("annotations") or {}),
                       STEP_DOWN_ANNOTATION: request.to_annotation()}
        return self.put(spec, annotations)


class Floor:
    """An epoch floor that grants every claim and passes every access check unless told
    to refuse (``refuse``; ``refuse_claims`` refuses claims only; ``claims_to_refuse``
    and ``checks_to_refuse`` the next so many), and a presence store whose reads answer
    ``shows`` (or raise it, if an exception)."""

    def __init__(self, shows: bool | Exception = True) -> None:
        self.refuse = threading.Event()
        self.refuse_claims = False
        self.claims_to_refuse = 0
        self.checks_to_refuse = 0
        self.claims = self.checks = 0
        self.shows = shows
        self.reads = 0

    def claim(self, epoch: int, identity: str) -> bool:
        self.claims += 1
        if self.refuse.is_set() or self.refuse_claims or self.claims_to_refuse:
            self.claims_to_refuse = max(0, self.claims_to_refuse - 1)
            raise AccessRefused("etcd at x refused: PERMISSION_DENIED")
        return True

    def check_access(self) -> None:
        self.checks += 1
        if self.refuse.is_set() or self.checks_to_refuse:
            self.checks_to_refuse = max(0, self.checks_to_refuse - 1)
            raise AccessRefused("etcd at x refused: PERMISSION_DENIED")

    def keep_presence(self, identity: str, epoch: int, ttl: int,
                      stop: threading.Event) -> None:
        stop.wait()

    def shows_presence(self, identity: str, epoch: int) -> bool:
        self.reads += 1
        if isinstance(self.shows, Exception):
            raise self.shows
        return self.shows


def _run(elector: LeaderElector) -> tuple[threading.Event, threading.Thread,
                                          list[BaseException]]:
    stop, raised = threading.Event(), []

    def run() -> None:
        try:
            elector.run(stop)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return stop, thread, raised


@pytest.mark.unit
def test_a_refused_epoch_claim_releases_the_lease_and_ends_the_elector() -> None:
    store, floor, started = AskableStore(), Floor(), []
    floor.refuse_claims = True  # the access check passed a moment before
    elector = LeaderElector(store, ElectionConfig(identity="me", **STEADY), started.append,
                            lambda: None, epoch_floor=floor, watch=False,
                            access_period=3600, access_confirm=CONFIRM)
    stop, thread, raised = _run(elector)
    thread.join(30)
    stop.set()
    assert not thread.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], AccessRefused), raised
    assert started == [], "no work under an epoch the floor refused"
    assert store.spec["holderIdentity"] == "", "released for a standby"


@pytest.mark.unit
def test_a_refusal_while_leading_stops_the_work_then_releases_and_ends_the_elector() -> None:
    store, floor = AskableStore(), Floor()
    stopped_at: list[str] = []

    def work(leadership: Leadership) -> None:
        leadership.lost.wait()
        stopped_at.append(store.spec["holderIdentity"])  # the Lease when the work ended

    elector = LeaderElector(store, ElectionConfig(identity="me", **STEADY), work,
                            lambda: None, epoch_floor=floor, watch=False,
                            access_period=0.05, access_confirm=CONFIRM)
    stop, thread, raised = _run(elector)
    wait_for(lambda: elector.is_leader(), 30, what="leading")
    floor.refuse.set()
    thread.join(30)
    stop.set()
    assert not thread.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], AccessRefused), raised
    assert stopped_at == ["me"], "the work stopped while the Lease was still ours"
    assert store.spec["holderIdentity"] == "", "then released for a standby"


@pytest.mark.unit
def test_a_standby_refused_stops_campaigning_and_ends_the_elector() -> None:
    store, floor = AskableStore(), Floor()
    store.put(held_by("other", transitions=3, duration=600))
    elector = LeaderElector(store, ElectionConfig(identity="me", **STEADY), lambda _: None,
                            lambda: None, epoch_floor=floor, watch=False,
                            access_period=0.05, access_confirm=CONFIRM)
    stop, thread, raised = _run(elector)
    wait_for(lambda: "get" in store.calls, 30, what="campaigning")
    floor.refuse.set()
    thread.join(30)
    stop.set()
    assert not thread.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], AccessRefused), raised
    assert store.spec["holderIdentity"] == "other"


@pytest.mark.unit
def test_a_refusal_while_the_acquisition_is_in_flight_releases_what_it_took() -> None:
    """The replica is refused (confirmed) while its acquisition is on its way, and the
    acquisition then lands: the elector takes its answer and releases the Lease before
    it ends, rather than leave it held until it expires. (Long renew deadline: the
    acquisition's window outlasts the confirmation.)"""
    store, floor, gate, started = AskableStore(), Floor(), threading.Event(), []

    def refused_then_lands() -> None:
        floor.refuse.set()
        gate.wait(60)

    store.before_write = refused_then_lands
    elector = LeaderElector(
        store, ElectionConfig(identity="me", namespace="ns", name="l", lease_duration=20.0,
                             renew_deadline=10.0, retry_period=0.5),
        started.append, lambda: None, epoch_floor=floor, watch=False,
        access_period=0.05, access_confirm=CONFIRM)
    stop, thread, raised = _run(elector)
    try:
        wait_for(lambda: elector._refused is not None, 30, what="the refusal confirmed")
        gate.set()
        thread.join(30)
    finally:
        gate.set()
        stop.set()
        thread.join(30)
    assert len(raised) == 1 and isinstance(raised[0], AccessRefused), raised
    assert started == []
    assert store.calls.count("create") == 1
    wait_for(lambda: store.obj is not None, 30, what="the acquisition landed")
    assert store.spec["holderIdentity"] == "", "released"


@pytest.mark.unit
def test_a_standby_refused_once_does_not_take_the_lease_until_the_refusal_is_settled(
        ) -> None:
    """While a refusal waits for its confirmation, the replica does not take even a
    released Lease: a revoked standby must not grab the Lease a revoked leader just
    released, ahead of a standby that etcd admits."""
    store, floor = AskableStore(), Floor()
    store.put(held_by("other", transitions=3, duration=600))
    floor.checks_to_refuse = 1
    elector = LeaderElector(store, ElectionConfig(identity="me", **STEADY), lambda _: None,
                            lambda: None, epoch_floor=floor, watch=False,
                            access_period=3600, access_confirm=3600)
    stop, thread, raised = _run(elector)
    try:
        wait_for(lambda: floor.checks >= 1 and elector._refusal_pending(), 30,
                 what="a refusal pending")
        store.put({**held_by(""), "leaseDurationSeconds": 1})  # released by its holder
        ticks: set[float] = set()

        def turned(n: int) -> bool:
            ticks.add(elector._last_tick)
            return len(ticks) >= n

        wait_for(lambda: turned(5), 30, what="the campaign turning")
        assert store.spec["holderIdentity"] == "" and "update" not in store.calls
        assert raised == [] and thread.is_alive()
    finally:
        stop.set()
        thread.join(30)


@pytest.mark.unit
@pytest.mark.parametrize("source", ["check", "claim"])
def test_a_refusal_that_passes_does_not_end_the_elector(source: str) -> None:
    """One refused access check (or epoch claim), then admitted again: a refusal that
    passes (a role rewritten, one etcd member refusing a moment) is not confirmed, and
    the replica goes on leading."""
    store, floor = AskableStore(), Floor()
    if source == "claim":
        floor.claims_to_refuse = 1
    elector = LeaderElector(store, ElectionConfig(identity="me", **STEADY), lambda _: None,
                            lambda: None, epoch_floor=floor, watch=False,
                            access_period=0.05, access_confirm=CONFIRM)
    stop, thread, raised = _run(elector)
    try:
        if source == "check":
            wait_for(lambda: elector.is_leader(), 30, what="leading")
            checks = floor.checks
            floor.checks_to_refuse = 1
            # the refused check, then checks well past the confirmation time (0.3 s)
            wait_for(lambda: floor.checks >= checks + 12, 30, what="checks after it")
        else:
            wait_for(lambda: floor.claims >= 2, 30, what="the claim retried")
            wait_for(lambda: elector.is_leader(), 30, what="leading")
            checks = floor.checks
            wait_for(lambda: floor.checks >= checks + 8, 30, what="checks after it")
        assert raised == [] and thread.is_alive() and elector._refused is None
        assert store.spec["holderIdentity"] == "me"
    finally:
        stop.set()
        thread.join(30)


@pytest.mark.unit
def test_a_standby_asks_a_holder_whose_term_etcd_does_not_show_to_step_down() -> None:
    store, floor = AskableStore(), Floor(shows=False)
    store.put(held_by("other", transitions=3, duration=600))  # renewed, for all it knows
    elector = LeaderElector(store, ElectionConfig(identity="me", **QUICK), lambda _: None,
                            lambda: None, epoch_floor=floor, watch=False)
    stop, thread, _raised = _run(elector)
    try:
        wait_for(lambda: STEP_DOWN_ANNOTATION in store.annotations, 30,
                 what="a step-down request")
    finally:
        stop.set()
        thread.join(30)
    request = StepDownRequest.parse(store.annotations[STEP_DOWN_ANNOTATION])
    assert request is not None and request.names("other", 3), request
    assert store.spec["holderIdentity"] == "other", "asked, never taken"


@pytest.mark.unit
@pytest.mark.parametrize("shows", [True, EtcdUnavailable("etcd unreachable")],
                         ids=["present", "etcd-away-from-the-standby"])
def test_a_standby_never_asks_a_holder_etcd_shows_or_when_etcd_does_not_answer_it(
        shows: bool | Exception) -> None:
    store, floor = AskableStore(), Floor(shows=shows)
    store.put(held_by("other", transitions=3, duration=600))
    elector = LeaderElector(store, ElectionConfig(identity="me", **QUICK), lambda _: None,
                            lambda: None, epoch_floor=floor, watch=False)
    stop, thread, _raised = _run(elector)
    try:
        # Twice the reads a missing presence takes to be asked about (1.2 s, 0.3 s apart).
        wait_for(lambda: floor.reads >= 8, 30, what="the standby reading etcd")
    finally:
        stop.set()
        thread.join(30)
    assert STEP_DOWN_ANNOTATION not in store.annotations


class ScriptedStop(threading.Event):
    """The presence loop's stop event, scripted: each wait moves the fake clock by its
    timeout plus the next pause of ``pauses`` (the process did not run meanwhile), then
    runs ``between`` (what the rest of the replica did meanwhile); once the script is
    over, the loop stops."""

    def __init__(self, clock: FakeClock, pauses: list[float],
                 between: Callable[[], None]) -> None:
        super().__init__()
        self.clock, self.pauses, self.between = clock, list(pauses), between

    def wait(self, timeout: float | None = None) -> bool:
        if not self.pauses:
            self.set()
            return True
        self.clock.advance((timeout or 0.0) + self.pauses.pop(0))
        self.between()
        return False


def _standby_reading_presence(pauses: list[float], *, renewing: bool
                              ) -> tuple[AskableStore, LeaderElector]:
    """A standby (4 s lease: presence read every 1 s, asked after 8 s of absence) whose
    campaign reads the Lease between two presence reads; the holder "other" (epoch 3)
    is absent from etcd and renews its Lease every second or not at all. Runs the
    presence loop over ``pauses`` and returns the store."""
    store, clock = AskableStore(), FakeClock()
    store.put(held_by("other", transitions=3, duration=4))
    elector = LeaderElector(store, ElectionConfig(identity="me", namespace="ns", name="l"),
                            lambda _: None, lambda: None, epoch_floor=Floor(shows=False),
                            clock=clock, watch=False)
    elector._observe(store.get(1.0))

    def between() -> None:
        if renewing:
            store.put(held_by("other", transitions=3, duration=4), store.annotations)
        elector._observe(store.get(1.0))  # the campaign's read (it does not acquire here)

    elector._presence_loop(ScriptedStop(clock, pauses, between))
    return store, elector


@pytest.mark.unit
@pytest.mark.parametrize(("pauses", "asked"), [
    ([0.0] * 9, True),
    ([0.0, 9.0], False),
    ([0.0, 9.0] + [0.0] * 8, True),
], ids=["8s-of-answers-a-second-apart", "two-answers-9s-apart", "a-gap-then-8s-of-answers"])
def test_absence_counts_only_over_answers_without_gaps(pauses: list[float],
                                                       asked: bool) -> None:
    """Two absent answers around a pause of the standby are no evidence for the pause:
    the count restarts when two answers are more than two read periods apart."""
    store, _ = _standby_reading_presence(pauses, renewing=True)
    assert ("request_step_down" in store.calls) is asked, store.calls


@pytest.mark.unit
def test_a_standby_does_not_ask_again_while_its_request_is_on_the_lease() -> None:
    """The request stays on the Lease until the term ends; asking again only rewrites
    it (every write a new resourceVersion for every replica to read)."""
    store, _ = _standby_reading_presence([0.0] * 30, renewing=True)
    assert store.calls.count("request_step_down") == 1, store.calls
    request = StepDownRequest.parse(store.annotations[STEP_DOWN_ANNOTATION])
    assert request is not None and request.names("other", 3)


@pytest.mark.unit
def test_a_standby_does_not_ask_a_holder_that_stopped_renewing() -> None:
    """A holder whose record has not changed for a lease duration is not renewing: the
    Lease's expiry hands it over, no request is needed."""
    store, elector = _standby_reading_presence([0.0] * 12, renewing=False)
    assert "request_step_down" not in store.calls, store.calls
    assert elector._expired()


class _Member:
    """One etcd member's KV service as the client calls it: answers an access check,
    or refuses it (PERMISSION_DENIED), counting the calls."""

    def __init__(self, refuses: bool) -> None:
        self.refuses, self.calls = refuses, 0

    def Txn(self, request: Any, timeout: float, metadata: Any) -> Any:
        self.calls += 1
        if self.refuses:
            raise _Failure(grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied")
        return types.SimpleNamespace(succeeded=False)


def _members(*refuses: bool) -> tuple[Etcd, list[_Member]]:
    """A client of one member per entry of ``refuses`` (never dialled: the members'
    KV services are the stand-ins)."""
    etcd = Etcd(EtcdConfig(endpoints=tuple(f"http://127.0.0.1:{1 + i}"
                                           for i in range(len(refuses))), timeout=5.0))
    members = [_Member(r) for r in refuses]
    for endpoint, member in zip(etcd._endpoints, members, strict=True):
        endpoint.kv = member
    return etcd, members


@pytest.mark.unit
def test_an_access_check_one_member_refuses_moves_to_a_member_that_admits() -> None:
    """One member refusing a valid user by itself (etcd bugs after a member restart or
    join) is not a refusal of the replica: the check asks the next member, and the
    client stays there for its next calls."""
    etcd, members = _members(True, False, False)
    with etcd:
        etcd.check_access("/p/ns/l/")
        etcd.check_access("/p/ns/l/")
    assert [m.calls for m in members] == [1, 2, 0]


@pytest.mark.unit
def test_an_access_check_every_member_refuses_is_access_denied_after_one_ask_each() -> None:
    etcd, members = _members(True, True, True)
    with etcd, pytest.raises(EtcdAccessDenied, match="permission denied"):
        etcd.check_access("/p/ns/l/")
    assert [m.calls for m in members] == [1, 1, 1]


# ---- real servers ----------------------------------------------------------------------------


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
def test_a_leader_whose_etcd_role_is_revoked_releases_and_a_standby_that_keeps_its_leads(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, prefix: str,
        root: Etcd) -> None:
    """Electors in this process, on the real API server and the real locks etcd with
    auth on: the leader's etcd user loses its role; its term ends, the Lease is released
    after its work returned, and its ``run`` raises AccessRefused; the standby, whose
    user keeps its role, leads under a higher epoch. (The whole replica, exit code and
    log line included, is the opt-in test below.)"""
    revoked_user = f"revoked-{prefix[3:]}"
    configs = {"revoked": _user(cluster, root, revoked_user, prefix),
               "kept": _user(cluster, root, f"kept-{prefix[3:]}", prefix)}
    started: dict[str, list[int]] = {"revoked": [], "kept": []}
    terms: dict[str, list[tuple[int, str]]] = {"revoked": [], "kept": []}
    runs: dict[str, tuple[threading.Event, threading.Thread, list[BaseException]]] = {}
    clients = {name: Etcd(config) for name, config in configs.items()}
    try:
        for name in ("revoked", "kept"):
            def work(leadership: Leadership, name: str = name) -> None:
                started[name].append(leadership.epoch)
                leadership.lost.wait()
                holder = _holder(api, namespace)  # the Lease as the work ends
                terms[name].append((leadership.epoch, holder[0] if holder else "?"))

            floor = EpochFloor(clients[name], prefix, Installation(namespace, LEASE),
                               registry=CollectorRegistry())
            elector = LeaderElector(
                KubernetesLeaseStore(api, namespace, LEASE),
                ElectionConfig(namespace=namespace, name=LEASE, identity=name,
                               lease_duration=3.0, renew_deadline=2.0,
                               retry_period=0.5),
                work, lambda: None, epoch_floor=floor, registry=CollectorRegistry(),
                access_period=0.2, access_confirm=0.5)
            runs[name] = _run(elector)
            if name == "revoked":
                wait_for(lambda: started["revoked"], 60, what="the first elector leading")

        root.revoke_prefix(revoked_user)
        runs["revoked"][1].join(60)
        # Its run returned after the release: the Lease is free, or the standby's already.
        released = _holder(api, namespace)
        wait_for(lambda: started["kept"], 60, what="the kept elector leading")
    finally:
        for stop, thread, _raised in runs.values():
            stop.set()
            thread.join(30)
        for etcd in clients.values():
            etcd.close()
    raised = runs["revoked"][2]
    assert len(raised) == 1 and isinstance(raised[0], AccessRefused), raised
    assert "permission denied" in str(raised[0]), raised
    assert started["revoked"] == [0] and terms["revoked"] == [(0, "revoked")], \
        "its work ended while the Lease was still its own, before the release"
    assert released is not None and released[0] in ("", "kept"), released
    assert started["kept"] and started["kept"][0] > 0, started


@contextmanager
def jwt_etcd(state: Path) -> Iterator[PrivateEtcd]:
    """A private etcd (plain http) whose auth tokens are JWTs (``--auth-token jwt``, an
    RSA key made here): a JWT carries the auth store's revision at its issue."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    state.mkdir(parents=True, exist_ok=True)
    (state / "jwt.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    (state / "jwt.pub").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    with private_etcd(state, tls=False, extra_args=[
            f"--auth-token=jwt,pub-key={state / 'jwt.pub'},priv-key={state / 'jwt.key'},"
            "sign-method=RS256,ttl=10m"]) as etcd:
        yield etcd


@pytest.mark.cluster
def test_a_password_client_refreshes_a_jwt_that_an_auth_change_made_old(
        tmp_path: Path) -> None:
    """With JWT tokens, any auth change (here: another release's user added) makes
    every token issued before it "old" (etcd: "revision of auth store is old",
    INVALID_ARGUMENT). A password client gets a fresh token and goes on, as etcd's Go
    client does; before, every call failed until the token expired (minutes)."""
    with jwt_etcd(tmp_path / "etcd") as server:
        with Etcd(EtcdConfig(endpoints=(server.url,), timeout=5.0)) as admin:
            admin.enable_auth("root-pw", "alice", "alice-pw", "/p/")
        alice_config = EtcdConfig(endpoints=(server.url,), prefix="/p", user="alice",
                                  password="alice-pw", timeout=5.0)
        root_config = EtcdConfig(endpoints=(server.url,), user="root", password="root-pw",
                                 timeout=5.0)
        with Etcd(alice_config) as alice, Etcd(root_config) as root:
            assert alice.get("/p/x") is None  # alice's token, at this auth revision
            root.grant_prefix("bob", "bob-pw", "/q")  # an auth change
            assert alice.get("/p/x") is None
            alice.put("/p/x", b"1")
            written = alice.get("/p/x")
            assert written is not None and written.value == b"1"


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.long  # about 20 s (three replicas as processes): opt-in, NEONVM_TEST_LONG=1
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


@pytest.mark.cluster
def test_the_presence_key_lives_while_its_writer_reaches_etcd_and_goes_when_it_is_cut(
        cluster: LocalCluster, namespace: str, prefix: str) -> None:
    """``EpochFloor.keep_presence`` on the real locks etcd, through a proxy: the key
    names the term while the keeper reaches etcd, goes by itself once the proxy is cut
    (its lease expires, 2 s), comes back after the heal, and is never written over a
    higher epoch's record; the end of the term removes it at once."""
    etcd = cluster.locks_etcd_config(prefix)
    host, port = etcd.endpoints[0].removeprefix("https://").rsplit(":", 1)
    installation = Installation(namespace, LEASE)
    with FaultProxy((host, int(port))) as proxy, \
            Etcd(dataclasses.replace(etcd, endpoints=(f"https://127.0.0.1:{proxy.port}",),
                                     timeout=1)) as through, Etcd(etcd) as direct:
        keeper = EpochFloor(through, prefix, installation, registry=CollectorRegistry())
        reader = EpochFloor(direct, prefix, installation, registry=CollectorRegistry())
        stop = threading.Event()
        thread = threading.Thread(target=keeper.keep_presence, args=("leader", 4, 2, stop),
                                  daemon=True)
        thread.start()
        try:
            wait_for(lambda: reader.shows_presence("leader", 4), 30, what="the presence key")
            proxy.cut()
            wait_for(lambda: not reader.shows_presence("leader", 4), 30,
                     what="the key gone with its lease")
            proxy.heal()
            wait_for(lambda: reader.shows_presence("leader", 4), 30, what="the key back")
        finally:
            stop.set()
            thread.join(30)
        assert not thread.is_alive()
        assert direct.get(reader.presence_key) is None, "revoked at the end of the term"

        # A later term's record is never overwritten by an earlier term's keeper.
        direct.put(reader.presence_key, b'{"identity":"next","epoch":5}')
        stale = threading.Event()
        keeper.keep_presence("leader", 4, 2, stale)  # returns at once: a later term's
        assert reader.shows_presence("next", 5)


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.long  # about 35 s (two replicas, a 16 s handover): opt-in, NEONVM_TEST_LONG=1
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
            etcd, endpoints=(f"https://127.0.0.1:{proxy.port}",)))
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


# ---- a 3-member etcd losing members -------------------------------------------------------


@contextmanager
def three_member_etcd(state: Path) -> Iterator[list[EtcdMember]]:
    """The drill's 3-member etcd (``neonvm.drills.infra.three_members``), killed after."""
    members = three_members(state)
    try:
        yield members
    finally:
        for m in members:
            m.kill()


@pytest.mark.cluster
@pytest.mark.nodes
@pytest.mark.slow
@pytest.mark.long  # about a minute (an etcd cluster, a replica, three phases): opt-in
def test_a_3_member_etcd_keeps_the_leader_converging_with_2_and_stops_it_without_quorum(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, prefix: str,
        tmp_path: Path) -> None:
    """One member killed: the same term goes on and VMs converge (a pod deleted is
    replaced, a new VM gets its pod). Two killed: no quorum, so nothing is planned (a
    deleted pod is not replaced, and the controller says etcd is unreachable); one
    member back: the same term converges every VM."""
    with three_member_etcd(tmp_path / "etcd") as members:
        etcd = EtcdConfig(endpoints=tuple(m.url for m in members), prefix=prefix)
        with replicas(cluster, namespace, tmp_path) as group:
            replica = group["start"]("replica", etcd)
            wait_for(lambda: replica.said("started leading"), 60, what="the replica leading")
            term = _holder(api, namespace)
            create_vm(api, namespace, "vm-1")
            wait_for(lambda: converged(api, namespace, ["vm-1"]), 90, what="vm-1 converged")

            members[0].kill()  # the endpoint the client uses first
            _delete_pods(api, namespace, "vm-1")
            create_vm(api, namespace, "vm-2")
            wait_for(lambda: converged(api, namespace, ["vm-1", "vm-2"]), 90,
                     what="both VMs converged with 2 of 3 members")
            assert _holder(api, namespace) == term

            members[1].kill()  # no quorum
            said_before = len(replica.messages())
            _delete_pods(api, namespace, "vm-1")
            wait_for(lambda: any("etcd unreachable" in m and "vm-1" in json.dumps(line)
                                 for line in replica.lines()[said_before:]
                                 for m in [str(line.get("msg", ""))]), 60,
                     what="the controller meeting etcd without quorum for vm-1")
            assert runner_pods(api, namespace, "vm-1") == []  # it did not act

            members[1].start()
            wait_for(lambda: converged(api, namespace, ["vm-1", "vm-2"]), 90,
                     what="both VMs converged with quorum back")
            assert _holder(api, namespace) == term
            assert not replica.said("stopped leading"), replica.messages()


def _delete_pods(api: client.ApiClient, namespace: str, vm: str) -> None:
    """Delete the VM's runner pods and wait until they are gone (a replacement may
    come meanwhile)."""
    core = client.CoreV1Api(api)
    deleted = {pod.metadata.uid for pod in runner_pods(api, namespace, vm)}
    for pod in runner_pods(api, namespace, vm):
        core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
    wait_for(lambda: not deleted & {p.metadata.uid for p in runner_pods(api, namespace, vm)},
             60, what=f"{vm}'s pods gone")
