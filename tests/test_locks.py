"""Per-VM locks in etcd with fencing tokens: the behaviour, against a real etcd.

Every test but the ``unit`` ones talks to the session's locks etcd
(``cluster.locks_etcd_config``: TLS, a client certificate whose etcd user may touch
only that prefix) under a key prefix of its own. Helper programs in
``tests/programs/lock_*.py`` are the other processes (contenders, a holder to SIGKILL).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from neonvm.cli import main as cli_main
from neonvm.dev.cluster import LocalCluster
from neonvm.leader.epoch import EpochFloor, EpochFloorCorrupt, floor_key, legacy_floor_key
from neonvm.leader.etcd import (
    Compare,
    Etcd,
    EtcdConfig,
    EtcdConfigError,
    EtcdError,
    EtcdRequestFailed,
    EtcdUnavailable,
    Put,
    TxnResult,
    parse_endpoints,
    prefix_end,
)
from neonvm.leader.lock import (
    DEFAULT_INSTALLATION,
    Installation,
    LockError,
    LockGuard,
    LockHeld,
    LockInfo,
    LockLost,
    LockManager,
    LockRecord,
    LockTable,
    SessionLost,
    decide,
    lock_key,
    parse_lock_key,
)
from neonvm.leader.session import Session
from tests.support import private_etcd, wait_for

PROGRAMS = Path(__file__).parent / "programs"
NEONVM = [sys.executable, "-m", "neonvm"]


# ---- fixtures ---------------------------------------------------------------------------


@pytest.fixture
def prefix() -> str:
    return f"/t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def config(cluster: LocalCluster, prefix: str) -> EtcdConfig:
    return cluster.locks_etcd_config(prefix)


@pytest.fixture
def etcd(config: EtcdConfig) -> Iterator[Etcd]:
    client = Etcd(config)
    yield client
    client.close()


SessionFactory = Callable[..., Session]


@pytest.fixture
def new_session(etcd: Etcd) -> Iterator[SessionFactory]:
    """Sessions closed at the end of the test, whatever happened."""
    made: list[Session] = []

    def make(ttl: int = 10, name: str = "s") -> Session:
        s = Session(etcd, ttl=ttl, name=name)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close(timeout=2)


def manager(etcd: Etcd, session: Session, identity: str, prefix: str) -> LockManager:
    return LockManager(etcd, session, identity, prefix)


class CountingEtcd(Etcd):
    """The real client, counting the round trips made through it."""

    def __init__(self, config: EtcdConfig) -> None:
        super().__init__(config)
        self.calls = 0

    def txn(self, *args: Any, **kwargs: Any) -> TxnResult:
        self.calls += 1
        return super().txn(*args, **kwargs)

    def range(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().range(*args, **kwargs)


def info(kv_record: LockRecord, token: int = 5, lease: int = 1) -> LockInfo:
    return LockInfo("ns", "vm", "/p/locks/ns/vm", token, token, lease, kv_record, None, b"")


# ---- pure logic -------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    ("held", "lease", "ours", "expected"),
    [
        # someone else, same VM: the epoch decides
        (("b", 3, "u1"), 2, (4, "u1"), "takeover"),
        (("b", 3, "u1"), 2, (3, "u1"), "held"),
        (("b", 3, "u1"), 2, (2, "u1"), "held"),
        # a lock left by a deleted VM of the same name
        (("b", 3, "old"), 2, (3, "new"), "takeover"),
        (("b", 3, "old"), 2, (2, "new"), "held"),  # a deposed leader cannot steal it
        # our own key: exactly what we would write (a lost answer) vs an old session's
        (("a", 3, "u1"), 1, (3, "u1"), "adopt"),
        (("a", 3, "u1"), 2, (3, "u1"), "takeover"),
        (("a", 3, "u1"), 1, (4, "u1"), "takeover"),
        (("a", 3, "u1"), 1, (2, "u1"), "held"),  # never lower the recorded epoch
    ],
)
def test_acquire_decision_on_an_existing_lock(
    held: tuple[str, int, str], lease: int, ours: tuple[int, str], expected: str
) -> None:
    current = info(LockRecord(held[0], held[1], held[2], 0.0), lease=lease)
    assert decide(current, identity="a", lease=1, epoch=ours[0], vm_uid=ours[1]) == expected


@pytest.mark.unit
def test_a_malformed_lock_is_taken_over_since_no_holder_of_ours_wrote_it() -> None:
    current = LockInfo("ns", "vm", "/p/locks/ns/vm", 5, 5, 0, None, "not JSON", b"{")
    assert decide(current, identity="a", lease=1, epoch=0, vm_uid="u") == "takeover"


@pytest.mark.unit
def test_lock_record_round_trips_and_malformed_values_say_what_is_wrong() -> None:
    record = LockRecord("host-1", 7, "uid-1", 1_700_000_000.5)
    assert LockRecord.decode(record.encode()) == record
    for raw, problem in [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"holder": "h", "epoch": "7", "vmUID": "u", "acquiredAt": "2024-01-01T00:00:00"}',
         "bad epoch"),
        (b'{"holder": "h", "epoch": 7, "acquiredAt": "2024-01-01T00:00:00"}', "no vmUID"),
        (b'{"holder": "h", "epoch": 7, "vmUID": "u", "acquiredAt": "yesterday"}',
         "bad acquiredAt"),
        (b"\xff\xfe", "not JSON"),
    ]:
        with pytest.raises(ValueError, match=problem):
            LockRecord.decode(raw)


@pytest.mark.unit
def test_config_comes_from_env_and_flags_override_it(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    env = {"NEONVM_ETCD_ENDPOINTS": "https://a:2379, https://b:2380",
           "NEONVM_ETCD_PREFIX": "team/", "NEONVM_ETCD_CA": str(ca),
           "NEONVM_ETCD_USER": "u", "NEONVM_ETCD_PASSWORD": "p"}
    config = EtcdConfig.from_env(env)
    assert config.endpoints == ("https://a:2379", "https://b:2380")
    assert config.prefix == "/team"
    assert config.ca == ca and config.user == "u" and config.secure
    config.validate()
    flagged = config.with_overrides(endpoints="https://c:1", prefix=None, timeout=2.0)
    assert flagged.endpoints == ("https://c:1",) and flagged.prefix == "/team"
    assert flagged.timeout == 2.0
    assert EtcdConfig.from_env({}).endpoints == ("http://127.0.0.1:2479",)
    assert EtcdConfig.from_env({}).prefix == "/neonvm"


@pytest.mark.unit
def test_unusable_settings_are_refused_with_a_reason(tmp_path: Path) -> None:
    with pytest.raises(EtcdConfigError, match="no port"):
        parse_endpoints("http://a")
    with pytest.raises(EtcdConfigError, match="want http"):
        parse_endpoints("ftp://a:1")
    with pytest.raises(EtcdConfigError, match="mix schemes"):
        EtcdConfig(endpoints=("http://a:1", "https://b:2")).validate()
    with pytest.raises(EtcdConfigError, match="http://"):
        EtcdConfig(ca=tmp_path / "ca.pem").validate()
    with pytest.raises(EtcdConfigError, match="both a user and a password"):
        EtcdConfig(user="u").validate()
    with pytest.raises(EtcdConfigError, match="not found"):
        EtcdConfig(endpoints=("https://a:1",), ca=tmp_path / "missing.pem").validate()


@pytest.mark.unit
def test_prefix_range_end_covers_exactly_the_prefix() -> None:
    assert prefix_end("/neonvm/locks/") == b"/neonvm/locks0"
    assert prefix_end("a\xff") > "a\xff".encode()


@pytest.mark.unit
def test_lock_keys_reject_names_that_would_escape_their_slot() -> None:
    inst = Installation("neonvm-system", "ctl")
    assert lock_key("/p", inst, "ns", "vm") == "/p/neonvm-system/ctl/locks/ns/vm"
    for ns, name in [("", "vm"), ("ns", ""), ("a/b", "vm"), ("ns", "x/y")]:
        with pytest.raises(ValueError):
            lock_key("/p", inst, ns, name)
    for lease_ns, lease in [("", "ctl"), ("a/b", "ctl"), ("ns", ""), ("ns", "x/y")]:
        with pytest.raises(ValueError):
            Installation(lease_ns, lease)


@pytest.mark.unit
def test_lock_keys_are_scoped_by_installation_and_parse_back() -> None:
    a, b = Installation("ns-a", "ctl"), Installation("ns-b", "ctl")
    assert lock_key("/p", a, "ns", "vm") != lock_key("/p", b, "ns", "vm")
    assert parse_lock_key(lock_key("/p", b, "ns", "vm"), "/p") == (b, "ns", "vm")
    assert floor_key("/p", a) == "/p/ns-a/ctl/leader/epoch-floor" != floor_key("/p", b)
    # Not lock keys: a floor, the unscoped layout of earlier versions, another prefix.
    for key in (floor_key("/p", a), "/p/locks/ns/vm", "/q/ns-a/ctl/locks/ns/vm",
                "/p/ns-a/ctl/locks/ns"):
        assert parse_lock_key(key, "/p") is None


# ---- taking and holding a lock ----------------------------------------------------------


@pytest.mark.cluster
def test_an_uncontended_acquire_is_one_round_trip_and_its_token_is_the_write_revision(
    config: EtcdConfig, new_session: SessionFactory, prefix: str
) -> None:
    counting = CountingEtcd(config)
    try:
        session = Session(counting, ttl=10)
        try:
            m = manager(counting, session, "replica-a", prefix)
            counting.calls = 0
            guard = m.acquire("default", "vm-1", "uid-1", epoch=3)
            assert counting.calls == 1
            kv = counting.get(lock_key(prefix, DEFAULT_INSTALLATION, "default", "vm-1"))
            assert kv is not None
            assert guard.token == kv.mod_revision == kv.create_revision
            assert kv.lease == session.lease_id
            assert LockRecord.decode(kv.value).holder == "replica-a"
            assert (guard.epoch, guard.vm_uid) == (3, "uid-1")

            counting.calls = 0
            assert m.acquire("default", "vm-1", "uid-1", epoch=3) is guard
            assert counting.calls == 0
        finally:
            session.close()
    finally:
        counting.close()


@pytest.mark.cluster
def test_a_lock_held_under_an_equal_or_higher_epoch_is_refused_naming_its_holder(
    etcd: Etcd, new_session: SessionFactory, prefix: str
) -> None:
    a = manager(etcd, new_session(name="a"), "replica-a", prefix)
    b = manager(etcd, new_session(name="b"), "replica-b", prefix)
    guard = a.acquire("default", "vm-1", "uid-1", epoch=5)
    for epoch in (5, 4):
        with pytest.raises(LockHeld) as caught:
            b.acquire("default", "vm-1", "uid-1", epoch=epoch)
        assert caught.value.info.record is not None
        assert caught.value.info.record.holder == "replica-a"
        assert caught.value.info.token == guard.token
        assert "replica-a" in str(caught.value)
    assert guard.check()


@pytest.mark.cluster
def test_a_newer_epoch_takes_over_at_once_and_the_stale_holders_fenced_write_is_rejected(
    etcd: Etcd, new_session: SessionFactory, prefix: str
) -> None:
    old = manager(etcd, new_session(name="old"), "replica-old", prefix)
    new = manager(etcd, new_session(name="new"), "replica-new", prefix)
    stale = old.acquire("default", "vm-1", "uid-1", epoch=1)
    data = f"{prefix}/data"
    stale.fenced_put(data, b"from epoch 1")

    fresh = new.acquire("default", "vm-1", "uid-1", epoch=2)
    assert fresh.token > stale.token
    # The stale holder has not been told yet; etcd refuses its write all the same.
    assert stale.held
    with pytest.raises(LockLost, match="taken over by replica-new"):
        stale.fenced_put(data, b"late write from epoch 1")
    assert stale.lost.is_set()
    assert etcd.get(data).value == b"from epoch 1"  # type: ignore[union-attr]

    fresh.fenced_put(data, b"from epoch 2")
    assert etcd.get(data).value == b"from epoch 2"  # type: ignore[union-attr]
    # The stale holder's release must not delete the new holder's lock.
    assert stale.release() is False
    assert fresh.check()


@pytest.mark.cluster
def test_callers_put_the_owner_compare_into_their_own_transactions(
    etcd: Etcd, new_session: SessionFactory, prefix: str
) -> None:
    a = manager(etcd, new_session(name="a"), "replica-a", prefix)
    b = manager(etcd, new_session(name="b"), "replica-b", prefix)
    guard = a.acquire("default", "vm-1", "uid-1", epoch=1)
    key = f"{prefix}/plan"
    assert etcd.txn([guard.owner_compare()], [Put(key, b"1")]).succeeded
    b.acquire("default", "vm-1", "uid-1", epoch=2)
    assert not etcd.txn([guard.owner_compare()], [Put(key, b"2")]).succeeded
    assert etcd.get(key).value == b"1"  # type: ignore[union-attr]


@pytest.mark.cluster
def test_a_fenced_txn_reports_the_callers_own_failed_compare_without_losing_the_lock(
    etcd: Etcd, new_session: SessionFactory, prefix: str
) -> None:
    guard = manager(etcd, new_session(), "replica-a", prefix).acquire(
        "default", "vm-1", "uid-1", epoch=1)
    key = f"{prefix}/cas"
    result = guard.fenced_txn([Compare(key, "version", ">", 0)], [Put(key, b"x")])
    assert not result.succeeded
    assert guard.held and etcd.get(key) is None


@pytest.mark.cluster
def test_a_lock_left_by_a_deleted_vm_never_blocks_the_recreated_vm(
    etcd: Etcd, new_session: SessionFactory, prefix: str
) -> None:
    old_leader = manager(etcd, new_session(name="old"), "replica-old", prefix)
    leader = manager(etcd, new_session(name="new"), "replica-new", prefix)
    leftover = old_leader.acquire("default", "vm-1", "uid-deleted", epoch=4)
    recreated = leader.acquire("default", "vm-1", "uid-recreated", epoch=4)
    assert recreated.token > leftover.token
    assert leader.get("default", "vm-1").record.vm_uid == "uid-recreated"  # type: ignore[union-attr]
    # ...but a deposed leader (lower epoch) that still sees the old uid cannot steal it.
    with pytest.raises(LockHeld):
        old_leader.acquire("default", "vm-1", "uid-deleted", epoch=3)


@pytest.mark.cluster
def test_release_deletes_the_lock_and_a_new_holder_gets_a_higher_token(
    etcd: Etcd, new_session: SessionFactory, prefix: str
) -> None:
    a = manager(etcd, new_session(name="a"), "replica-a", prefix)
    b = manager(etcd, new_session(name="b"), "replica-b", prefix)
    first = a.acquire("default", "vm-1", "uid-1", epoch=1)
    assert first.release() is True
    assert first.lost.is_set() and a.get("default", "vm-1") is None
    second = b.acquire("default", "vm-1", "uid-1", epoch=1)
    assert second.token > first.token
    with pytest.raises(LockLost):
        first.fenced_put(f"{prefix}/x", b"after release")


@pytest.mark.cluster
def test_a_manager_keeps_nothing_per_vm_once_no_acquire_of_its_lock_is_under_way(
    etcd: Etcd, new_session: SessionFactory, prefix: str
) -> None:
    # VMs come and go under churn: the per-key state that serializes acquires must go
    # with them, whether the acquire got the lock (then released) or was refused.
    a = manager(etcd, new_session(name="a"), "replica-a", prefix)
    b = manager(etcd, new_session(name="b"), "replica-b", prefix)
    for i in range(20):
        guard = a.acquire("default", f"vm-{i}", f"uid-{i}", epoch=1)
        with pytest.raises(LockHeld):
            b.acquire("default", f"vm-{i}", f"uid-{i}", epoch=1)
        assert guard.release() is True
    assert a._key_mutexes == {} and b._key_mutexes == {}
    assert a.held() == [] and b.held() == []


@pytest.mark.cluster
def test_a_waiting_acquire_gets_the_lock_when_the_holders_lease_ends(
    etcd: Etcd, new_session: SessionFactory, prefix: str
) -> None:
    holder_session = new_session(ttl=10, name="holder")
    holder = manager(etcd, holder_session, "replica-a", prefix)
    waiter = manager(etcd, new_session(name="waiter"), "replica-b", prefix)
    held = holder.acquire("default", "vm-1", "uid-1", epoch=1)
    with pytest.raises(LockHeld):
        waiter.acquire("default", "vm-1", "uid-1", epoch=1)
    got: list[LockGuard] = []
    thread = threading.Thread(target=lambda: got.append(
        waiter.acquire("default", "vm-1", "uid-1", epoch=1, wait=60)))
    thread.start()
    holder_session.close()  # revokes the lease: the key goes
    thread.join(90)
    assert got and got[0].token > held.token
    assert held.lost.is_set()


@pytest.mark.cluster
def test_when_the_lease_is_gone_every_guard_of_the_session_is_told_and_acquire_refuses(
    etcd: Etcd, new_session: SessionFactory, prefix: str
) -> None:
    session = new_session(ttl=3, name="doomed")
    m = manager(etcd, session, "replica-a", prefix)
    guards = [m.acquire("default", f"vm-{i}", f"uid-{i}", epoch=1) for i in range(3)]
    etcd.revoke_lease(session.lease_id)  # as if etcd expired it
    wait_for(session.lost.is_set, 30, what="session lost")
    assert "gone" in (session.lost_reason or "")
    assert all(g.lost.is_set() for g in guards)
    with pytest.raises(SessionLost):
        m.acquire("default", "vm-9", "uid-9", epoch=1)
    with pytest.raises(LockLost):
        guards[0].fenced_put(f"{prefix}/x", b"no")


@pytest.mark.cluster
def test_sweep_removes_the_locks_of_vms_that_no_longer_exist_and_nothing_else(
    etcd: Etcd, new_session: SessionFactory, prefix: str
) -> None:
    leader = manager(etcd, new_session(name="leader"), "replica-leader", prefix)
    other = manager(etcd, new_session(name="other"), "replica-other", prefix)
    leader.acquire("default", "live", "uid-live", epoch=2)
    mine_but_gone = leader.acquire("default", "mine", "uid-mine", epoch=2)
    other.acquire("default", "gone", "uid-gone", epoch=1)
    other.acquire("team", "gone-too", "uid-gone-too", epoch=1)
    etcd.put(lock_key(prefix, DEFAULT_INSTALLATION, "default", "garbage"), b"not json")

    removed = leader.sweep(lambda: {"uid-live"})
    assert sorted(i.name for i in removed) == ["gone", "gone-too"]
    remaining = sorted(i.name for i in leader.list())
    assert remaining == ["garbage", "live", "mine"]  # our own held lock is spared
    assert mine_but_gone.check()


# ---- installations sharing one etcd and one prefix -----------------------------------------

INST_A = Installation("team-a-system", "controller-a")
INST_B = Installation("team-b-system", "controller-b")


@pytest.mark.cluster
def test_an_installations_sweep_never_removes_another_installations_live_lock(
    etcd: Etcd, new_session: SessionFactory, prefix: str
) -> None:
    # Same etcd, same prefix; A watches namespace "a", B watches "b" (as with
    # --watch-namespace): A's list of live VMs knows nothing of B's.
    a = LockManager(etcd, new_session(name="a"), "replica-a", prefix, INST_A)
    b = LockManager(etcd, new_session(name="b"), "replica-b", prefix, INST_B)
    a.acquire("a", "vm", "uid-a", epoch=1)
    b_guard = b.acquire("b", "vm", "uid-b", epoch=1)
    b_gone = b.acquire("b", "deleted", "uid-b-deleted", epoch=1)
    b_gone.release()
    b.acquire("b", "stale", "uid-b-stale", epoch=1)

    removed_by_a = a.sweep(lambda: {"uid-a"})
    assert removed_by_a == [], f"A swept B's locks: {[i.key for i in removed_by_a]}"
    assert b_guard.check(), f"B's live lock is gone: {b_guard.lost_reason}"
    # B's own sweep still removes B's stale lock, and only that.
    b_stale_holder = LockManager(etcd, new_session(name="b2"), "replica-b2", prefix, INST_B)
    assert [i.name for i in b_stale_holder.sweep(lambda: {"uid-b"})] == ["stale"]
    assert b_guard.check()
    assert [i.name for i in a.list()] == ["vm"]
    # A table of every installation sees both, and will not sweep.
    everything = LockTable(etcd, prefix)
    assert sorted((str(i.installation), i.name) for i in everything.list()) == [
        (str(INST_A), "vm"), (str(INST_B), "vm")]
    with pytest.raises(ValueError, match="installation"):
        everything.sweep(lambda: set())
    assert a.overlaps() == [] and b.overlaps() == []
    # Misconfigured: B watches A's namespace too, so both lock A's VM. Each sees the
    # other's lock (the sweep logs it as an error), and "which one?" is asked.
    b.acquire("a", "vm", "uid-a", epoch=1)
    assert [(i.installation, i.key) for i in a.overlaps()] == [
        (INST_B, lock_key(prefix, INST_B, "a", "vm"))]
    assert [i.installation for i in b.overlaps()] == [INST_A]
    with pytest.raises(LockError, match="several installations"):
        everything.get("a", "vm")
    assert LockTable(etcd, prefix, INST_B).get("a", "vm") is not None
    # A VM locked in one installation only is found, and broken, without naming it.
    broken = everything.break_lock("b", "vm")
    assert broken is not None and broken.installation == INST_B
    assert not b_guard.check()


@pytest.mark.cluster
def test_installations_sharing_a_prefix_have_independent_epoch_floors(
    etcd: Etcd, prefix: str
) -> None:
    a, b = EpochFloor(etcd, prefix, INST_A), EpochFloor(etcd, prefix, INST_B)
    assert a.claim(40, "leader-a")
    # B's Lease has seen three transitions: its epoch 3 is its own business.
    assert b.claim(3, "leader-b"), "A's floor pushed B's epoch up"
    assert not a.claim(4, "leader-a") and not b.claim(3, "leader-b")
    assert (a.current().epoch, b.current().epoch) == (40, 3)  # type: ignore[union-attr]


@pytest.mark.cluster
def test_the_shared_floor_of_earlier_versions_bounds_an_installations_first_claim(
    etcd: Etcd, prefix: str
) -> None:
    # An upgrade: the unscoped floor an earlier version wrote is still there.
    etcd.put(legacy_floor_key(prefix), b'{"epoch": 9, "identity": "old", "claimedAt": ""}')
    floor = EpochFloor(etcd, prefix, INST_A)
    assert not floor.claim(9, "leader-a")
    assert floor.claim(10, "leader-a")
    assert floor.current().epoch == 10  # type: ignore[union-attr]


@pytest.mark.cluster
@pytest.mark.slow
def test_two_installations_on_one_etcd_and_prefix_run_side_by_side(
    cluster: LocalCluster, api: Any, tmp_path: Path
) -> None:
    # The short version of `python -m benchmarks.side_by_side` (5 minutes): real replicas,
    # each installation with --watch-namespace, its own Lease, the SAME --etcd-prefix,
    # sweeping every 3 s while VMs come and go on both sides.
    from tests.support.installations import run_side_by_side

    report = run_side_by_side(api, cluster.kubeconfig_for("controller"),
                              cluster.locks_etcd_config, tmp_path, duration=30, vms=3,
                              churn_every=10)
    print(report.text())
    for r in report.results:
        assert r.removed_by_other == [], report.text()
        assert r.live_locks_deleted == [], report.text()
        assert (r.converged, r.waiting) == (r.vms, {}), report.text()
        # Each claimed its epoch in its own floor: nobody pushed it past its Lease.
        assert r.floor_epoch is not None and r.floor_epoch == r.lease_transitions, (
            report.text())


# ---- other processes ----------------------------------------------------------------------


def _spawn(program: str, config: EtcdConfig, *args: str) -> subprocess.Popen[str]:
    """``program`` reaching etcd as ``config`` says (``NEONVM_ETCD_*``: TLS files too)."""
    return subprocess.Popen(
        [sys.executable, str(PROGRAMS / program), *args],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent,
        env={**os.environ, **config.env(), "PYTHONPATH": str(Path(__file__).parent.parent)},
    )


def _read_event(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"program exited early (rc={proc.poll()})"
    event: dict[str, Any] = json.loads(line)
    return event


@pytest.mark.cluster
def test_processes_contending_for_one_lock_lose_no_update(
    etcd: Etcd, config: EtcdConfig, prefix: str
) -> None:
    contenders, rounds = 4, 12
    procs = [_spawn("lock_counter.py", config, "--endpoint", config.endpoints[0],
                    "--prefix", prefix, "--identity", f"contender-{i}", "--rounds", str(rounds))
             for i in range(contenders)]
    try:
        for p in procs:
            assert _read_event(p)["event"] == "ready"
        etcd.put(f"{prefix}/go", b"1")
        results = [_read_event(p) for p in procs]
        for p in procs:
            assert p.wait(120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(r["event"] == "done" for r in results), results
    increments = sum(r["increments"] for r in results)
    assert increments == contenders * rounds
    assert int(etcd.get(f"{prefix}/counter").value) == increments  # type: ignore[union-attr]
    tokens = [t for r in results for t in r["tokens"]]
    assert len(set(tokens)) == len(tokens), "a fencing token was handed out twice"
    for r in results:
        assert r["tokens"] == sorted(r["tokens"])


@pytest.mark.cluster
def test_a_sigkilled_holders_lock_frees_when_its_lease_expires(
    etcd: Etcd, config: EtcdConfig, new_session: SessionFactory, prefix: str
) -> None:
    holder = _spawn("lock_holder.py", config, "--endpoint", config.endpoints[0], "--prefix", prefix,
                    "--identity", "victim", "--ttl", "3", "default/vm-1")
    try:
        held = _read_event(holder)
        contender = manager(etcd, new_session(name="c"), "contender", prefix)
        with pytest.raises(LockHeld):
            contender.acquire("default", "vm-1", "uid-vm-1", epoch=1)
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        guard = contender.acquire("default", "vm-1", "uid-vm-1", epoch=1, wait=60)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert guard.token > held["tokens"]["default/vm-1"]
    assert etcd.lease_ttl(held["lease"]) == -1  # it went because the lease expired


@pytest.mark.cluster
def test_a_sigkilled_holders_lock_is_taken_at_once_by_a_newer_epoch(
    etcd: Etcd, config: EtcdConfig, new_session: SessionFactory, prefix: str
) -> None:
    holder = _spawn("lock_holder.py", config, "--endpoint", config.endpoints[0], "--prefix", prefix,
                    "--identity", "victim", "--ttl", "120", "--epoch", "1",
                    "default/vm-1", "default/vm-2")
    try:
        held = _read_event(holder)
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        leader = manager(etcd, new_session(name="leader"), "new-leader", prefix)
        guards = [leader.acquire("default", n, f"uid-{n}", epoch=2) for n in ("vm-1", "vm-2")]
        # No waiting happened: the dead holder's lease is still there.
        assert etcd.lease_ttl(held["lease"]) > 0
        for g in guards:
            assert g.token > held["tokens"][f"default/{g.name}"]
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        etcd.revoke_lease(held["lease"])


# ---- etcd itself failing --------------------------------------------------------------


@pytest.mark.cluster
def test_etcd_restart_holders_notice_and_recover_and_nothing_is_held_twice(
    cluster: LocalCluster, etcd: Etcd, new_session: SessionFactory, prefix: str
) -> None:
    a_session = new_session(ttl=3, name="a")
    b_session = new_session(ttl=3, name="b")
    a = manager(etcd, a_session, "replica-a", prefix)
    b = manager(etcd, b_session, "replica-b", prefix)
    a_guard = a.acquire("default", "vm-a", "uid-a", epoch=1)
    b_guard = b.acquire("default", "vm-b", "uid-b", epoch=1)
    watcher = subprocess.Popen(
        [*NEONVM, "locks", "watch", "-o", "json"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, **cluster.locks_etcd_env(prefix)})
    try:
        assert _read_event(watcher)["event"] == "EXISTING"  # the watch is up

        # Killed, as a crash (a graceful stop, which ends the watch at its GOAWAY, is
        # tests/test_etcd_faults.py's).
        cluster.stop_component("locks-etcd", sig=signal.SIGKILL)
        try:
            wait_for(lambda: a_guard.lost.is_set() and b_guard.lost.is_set(), 60,
                     what="holders told their locks are lost")
            assert a_session.lost.is_set() and b_session.lost.is_set()
            with pytest.raises(SessionLost):
                a.acquire("default", "vm-a", "uid-a", epoch=1)
            # A watch whose etcd went away ends with one line and exit code 3 (cannot
            # reach; see the README's exit codes).
            code = watcher.wait(60)
            assert watcher.stderr is not None
            errors = watcher.stderr.read().strip().splitlines()
            assert code == 3, errors
            assert len(errors) == 1 and errors[0].startswith("error: etcd"), errors
        finally:
            cluster.start_component("locks-etcd")
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()

    # Recover: a new session and manager per replica; each gets its VM back.
    a2 = manager(etcd, new_session(ttl=3, name="a2"), "replica-a", prefix)
    b2 = manager(etcd, new_session(ttl=3, name="b2"), "replica-b", prefix)
    a_new = a2.acquire("default", "vm-a", "uid-a", epoch=1, wait=60)
    b_new = b2.acquire("default", "vm-b", "uid-b", epoch=1, wait=60)
    assert a_new.token > a_guard.token and b_new.token > b_guard.token
    # Nothing held twice: each key has one holder, the other replica is refused, and the
    # holders from before the restart are fenced out on the server.
    locks = {(i.name, i.record.holder) for i in a2.list() if i.record}
    assert locks == {("vm-a", "replica-a"), ("vm-b", "replica-b")}
    with pytest.raises(LockHeld):
        b2.acquire("default", "vm-a", "uid-a", epoch=1)
    assert not etcd.txn([a_guard.owner_compare()], [Put(f"{prefix}/x", b"stale")]).succeeded
    with pytest.raises(LockLost):
        a_guard.fenced_put(f"{prefix}/x", b"stale")


@pytest.mark.cluster
def test_several_endpoints_survive_one_that_does_not_answer(
    cluster: LocalCluster, prefix: str
) -> None:
    live = cluster.locks_etcd_config(prefix)
    config = live.with_overrides(endpoints=("https://127.0.0.1:1", *live.endpoints))
    with Etcd(config) as client:
        # Whichever endpoint comes first, writes and reads reach the live one: a request
        # that could not even connect is safe to send elsewhere.
        for i in range(4):
            client.put(f"{prefix}/k", str(i).encode())
            assert client.get(f"{prefix}/k").value == str(i).encode()  # type: ignore[union-attr]


@pytest.mark.unit
def test_an_unreachable_etcd_gives_a_clear_error_naming_it() -> None:
    config = EtcdConfig(endpoints=("http://127.0.0.1:1",), timeout=1.0)
    with Etcd(config) as client, pytest.raises(EtcdUnavailable) as caught:
        client.get("/x")
    message = str(caught.value)
    assert "etcd unreachable at http://127.0.0.1:1" in message and "\n" not in message


# ---- TLS and authentication (private etcd processes) ---------------------------------


@pytest.mark.cluster
def test_locks_work_over_tls_with_a_client_certificate_and_not_without(
    tmp_path: Path, prefix: str
) -> None:
    with private_etcd(tmp_path, tls=True) as private:
        url, pki = private.url, private.pki
        config = private.config(prefix)
        with Etcd(config) as client, Session(client, ttl=5) as session:
            guard = LockManager(client, session, "replica-a", prefix).acquire(
                "default", "vm-1", "uid-1", epoch=1)
            assert guard.fenced_put(f"{prefix}/data", b"over TLS") > guard.token
        without_cert = EtcdConfig(endpoints=(url,), prefix=prefix, ca=pki.ca.cert,
                                  timeout=2)
        with Etcd(without_cert) as client, pytest.raises(EtcdError):
            client.get(f"{prefix}/data")


@pytest.mark.cluster
def test_locks_work_with_etcd_authentication_confined_to_the_prefix(
    tmp_path: Path, prefix: str
) -> None:
    with private_etcd(tmp_path, tls=False) as private:
        url, admin = private.url, private.config(prefix)
        with Etcd(admin) as client:
            client.enable_auth("root-secret", "neonvm", "s3cret", prefix)
        with Etcd(admin) as anonymous, pytest.raises(EtcdRequestFailed):
            anonymous.get(f"{prefix}/x")
        wrong = admin.with_overrides(user="neonvm", password="wrong")
        with Etcd(wrong) as client, pytest.raises(EtcdRequestFailed, match="authentication"):
            client.get(f"{prefix}/x")

        config = admin.with_overrides(user="neonvm", password="s3cret")
        with Etcd(config) as client, Session(client, ttl=5) as session:
            guard = LockManager(client, session, "replica-a", prefix).acquire(
                "default", "vm-1", "uid-1", epoch=2)
            assert EpochFloor(client, prefix).claim(2, "replica-a")
            with pytest.raises(EtcdRequestFailed, match="permission denied"):
                client.get("/elsewhere")
            listed = CliRunner().invoke(cli_main, [
                "locks", "--endpoints", url, "--prefix", prefix, "--user", "neonvm",
                "--password", "s3cret", "list", "-o", "json"])
            assert listed.exit_code == 0, listed.output
            assert json.loads(listed.output)[0]["token"] == guard.token


# ---- the epoch floor ----------------------------------------------------------------------


@pytest.mark.cluster
def test_the_epoch_floor_accepts_only_epochs_above_it(etcd: Etcd, prefix: str) -> None:
    floor = EpochFloor(etcd, prefix)
    assert floor.current() is None
    assert floor.claim(3, "leader-1")
    assert not floor.claim(3, "leader-2")
    assert not floor.claim(2, "leader-2")
    assert not floor.claim(3, "leader-1")  # never granted twice, not even to its winner
    assert floor.claim(4, "leader-2")
    assert floor.current().epoch == 4  # type: ignore[union-attr]


@pytest.mark.cluster
def test_racing_claims_of_one_epoch_have_exactly_one_winner(etcd: Etcd, prefix: str) -> None:
    floor = EpochFloor(etcd, prefix)
    floor.claim(1, "seed")
    results: dict[str, bool] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        f"c{i}", floor.claim(7, f"c{i}"))) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(results.values()) == 1
    winner = next(k for k, v in results.items() if v)
    assert floor.current().identity == winner  # type: ignore[union-attr]


@pytest.mark.cluster
@pytest.mark.parametrize("garbage", [b"seven", b'{"epoch": "8"}', b'{"epoch": 2147483648}'])
def test_a_malformed_epoch_floor_is_replaced_by_the_next_claim_loudly(
        etcd: Etcd, prefix: str, garbage: bytes) -> None:
    """Not JSON, no integer epoch, or an epoch no Lease can carry (leaseTransitions is an
    int32): nothing this code wrote. It counts as no floor (the claimed epoch is the
    Lease's, above every epoch used under it; docs/locks.md), and is counted."""
    etcd.put(floor_key(prefix, DEFAULT_INSTALLATION), garbage)
    registry = CollectorRegistry()
    floor = EpochFloor(etcd, prefix, registry=registry)
    with pytest.raises(EpochFloorCorrupt, match="epoch-floor is malformed"):
        floor.current()
    assert floor.claim(8, "leader")
    stored = floor.current()
    assert stored is not None and (stored.epoch, stored.identity) == (8, "leader")
    assert registry.get_sample_value("neonvm_epoch_floor_repairs_total") == 1
    assert not floor.claim(8, "other")  # from here on, an ordinary floor


# ---- the CLI ------------------------------------------------------------------------------


def _cli(config: EtcdConfig, *args: str) -> Any:
    return CliRunner().invoke(cli_main, ["locks", *args], env=config.env())


@pytest.mark.cluster
def test_cli_lists_and_shows_locks_with_holder_epoch_token_and_lease(
    etcd: Etcd, config: EtcdConfig, new_session: SessionFactory, prefix: str
) -> None:
    session = new_session(ttl=30)
    guard = manager(etcd, session, "replica-a", prefix).acquire(
        "default", "vm-1", "uid-1", epoch=6)
    result = _cli(config, "list", "-o", "json")
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)
    assert (row["holder"], row["epoch"], row["token"], row["vmUID"]) == (
        "replica-a", 6, guard.token, "uid-1")
    assert 0 < row["ttl"] <= 30 and row["status"] == "held"

    table = _cli(config, "list")
    assert "replica-a" in table.output and "NAMESPACE" in table.output
    shown = _cli(config, "show", "default/vm-1", "-o", "yaml")
    assert shown.exit_code == 0 and f"token: {guard.token}" in shown.output
    assert _cli(config, "list", "-n", "elsewhere", "-o", "json").output.strip() == "[]"
    missing = _cli(config, "show", "default/nope")
    assert missing.exit_code != 0 and "no lock for default/nope" in missing.output


@pytest.mark.cluster
def test_cli_lists_one_installation_by_its_lease_and_all_of_them_on_request(
    etcd: Etcd, config: EtcdConfig, new_session: SessionFactory, prefix: str
) -> None:
    LockManager(etcd, new_session(), "replica-a", prefix, INST_A).acquire("a", "vm", "u1", 1)
    LockManager(etcd, new_session(), "replica-b", prefix, INST_B).acquire("b", "vm", "u2", 1)
    LockManager(etcd, new_session(), "replica-d", prefix).acquire("d", "vm", "u3", 1)

    def holders(*args: str, env: dict[str, str] | None = None) -> list[str]:
        result = CliRunner().invoke(cli_main, ["locks", *args, "-o", "json"], env={
            **config.env(), **(env or {})})
        assert result.exit_code == 0, result.output
        return sorted(r["holder"] for r in json.loads(result.output))

    assert holders("list") == ["replica-d"]  # the controller's default Lease
    assert holders("--lease-namespace", INST_A.lease_namespace,
                   "--lease-name", INST_A.lease_name, "list") == ["replica-a"]
    # The controller's own variables name the installation too.
    assert holders("list", env={
        "NEONVM_CONTROLLER_RUN_LEASE_NAMESPACE": INST_B.lease_namespace,
        "NEONVM_CONTROLLER_RUN_LEASE_NAME": INST_B.lease_name}) == ["replica-b"]
    assert holders("list", "--all-installations") == ["replica-a", "replica-b", "replica-d"]
    table = _cli(config, "list", "--all-installations")  # -A: all namespaces, as kubectl
    assert str(INST_A) in table.output and "INSTALLATION" in table.output


@pytest.mark.cluster
def test_cli_shows_a_malformed_lock_value_as_malformed(
    etcd: Etcd, config: EtcdConfig, prefix: str
) -> None:
    etcd.put(lock_key(prefix, DEFAULT_INSTALLATION, "default", "vm-bad"), b"\x00garbage{")
    listed = _cli(config, "list")
    assert listed.exit_code == 0, listed.output
    assert "malformed" in listed.output
    shown = _cli(config, "show", "default/vm-bad", "-o", "json")
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.output)
    assert data["status"] == "malformed" and data["problem"].startswith("not JSON")
    assert "garbage" in data["raw"]


@pytest.mark.cluster
def test_cli_break_needs_force_and_the_broken_holder_is_fenced_out(
    etcd: Etcd, config: EtcdConfig, new_session: SessionFactory, prefix: str
) -> None:
    guard = manager(etcd, new_session(), "replica-a", prefix).acquire(
        "default", "vm-1", "uid-1", epoch=1)
    refused = _cli(config, "break", "default/vm-1")
    assert refused.exit_code != 0 and "--force" in refused.output
    assert guard.check()
    helped = _cli(config, "break", "--help")
    assert "fenced" in helped.output
    broke = _cli(config, "break", "default/vm-1", "--force")
    assert broke.exit_code == 0, broke.output
    assert "replica-a" in broke.output
    with pytest.raises(LockLost, match="gone"):
        guard.fenced_put(f"{prefix}/x", b"after break")


@pytest.mark.cluster
def test_cli_watch_streams_lock_changes_until_interrupted(
    etcd: Etcd, config: EtcdConfig, new_session: SessionFactory, prefix: str
) -> None:
    m = manager(etcd, new_session(), "replica-a", prefix)
    m.acquire("default", "before", "uid-0", epoch=1)
    env = {**os.environ, **config.env()}
    watcher = subprocess.Popen([*NEONVM, "locks", "watch", "-o", "json"], env=env,
                               stdout=subprocess.PIPE, text=True)
    try:
        first = _read_event(watcher)
        assert (first["event"], first["name"]) == ("EXISTING", "before")
        guard = m.acquire("default", "vm-1", "uid-1", epoch=1)
        taken = _read_event(watcher)
        assert (taken["event"], taken["name"], taken["token"]) == ("PUT", "vm-1", guard.token)
        guard.release()
        gone = _read_event(watcher)
        assert (gone["event"], gone["name"], gone["holder"]) == ("DELETE", "vm-1", "replica-a")
        watcher.send_signal(signal.SIGINT)
        assert watcher.wait(30) == 0
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()


@pytest.mark.unit
def test_cli_fails_with_one_line_and_nonzero_exit_when_etcd_is_unreachable() -> None:
    # The subprocess timeout is the bound: the command must give up on its own well before.
    result = subprocess.run(
        [*NEONVM, "locks", "--endpoints", "http://127.0.0.1:1", "--timeout", "2", "list"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 3  # cannot reach the locks' etcd
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: etcd unreachable at http://127.0.0.1:1")
