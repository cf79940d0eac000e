"""Leader election on a Lease: one leader at a time, epochs, handover, and no harm when paused.

Candidates run as separate processes (``tests/programs/candidate.py``) against the real
API server; each prints JSON lines of what it believes, stamped with CLOCK_MONOTONIC,
which all processes of one machine share, so the test can order beliefs across them.
A checker reads the Lease many times a second for the whole scenario.

The only timing figures asserted are lower bounds that slowness cannot break (a takeover
never comes *earlier* than the lease allows) and generous upper bounds; the measured
failover and handover times are printed (``pytest -s``) and recorded in
docs/leader-election.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from click.testing import CliRunner
from kubernetes import client
from prometheus_client import CollectorRegistry

from neonvm import kube
from neonvm.cli import main
from neonvm.cli.leader import describe
from neonvm.dev.cluster import LocalCluster
from neonvm.leader.election import (
    ElectionConfig,
    EpochFloor,
    LeaderElector,
    Leadership,
    LeadershipLost,
    LeaseClient,
    LeaseRecord,
    StepDownRequest,
    format_microtime,
    new_identity,
)
from neonvm.leader.health import HealthServer
from neonvm.leader.lease_store import KubernetesLeaseStore, LeaseConflict, LeaseNamespaceNotFound
from tests.support import restart_api_server, wait_for

CANDIDATE = Path(__file__).parent / "programs" / "candidate.py"
LEASE = "neonvm-controller"
FENCE = "fence"
LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD = 3.0, 2.0, 0.5  # short, to keep tests quick
MICROTIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
STARTUP = 180.0  # a candidate imports the kubernetes client: slow on a loaded machine


# ---- helpers ----------------------------------------------------------------------------

T = TypeVar("T")


def fast_config(**overrides: Any) -> ElectionConfig:
    settings: dict[str, Any] = {"lease_duration": LEASE_DURATION,
                                "renew_deadline": RENEW_DEADLINE,
                                "retry_period": RETRY_PERIOD, **overrides}
    return ElectionConfig(**settings)


def wait_until(condition: Callable[[], T | None], timeout: float, what: str) -> T:
    """``wait_for`` for conditions that return the thing waited for, or None."""
    found = wait_for(condition, timeout, what=what)
    assert found is not None
    return found


class InMemoryEpochFloor:
    """The EpochFloor protocol for one process: enough to test the elector's use of it."""

    def __init__(self, floor: int | None = None) -> None:
        self.floor = floor
        self.claims: list[int] = []
        self._lock = threading.Lock()

    def claim(self, epoch: int, identity: str) -> bool:
        with self._lock:
            self.claims.append(epoch)
            if self.floor is not None and epoch <= self.floor:
                return False
            self.floor = epoch
            return True


class Candidate:
    """One candidate process and the events it printed."""

    def __init__(self, label: str, argv: list[str], log: Path) -> None:
        self.label = label
        self.log = log
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.killed_at: float | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                self.events.append(json.loads(line))

    def of(self, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.events if e["event"] == kind]

    def first(self, kind: str, **match: Any) -> dict[str, Any] | None:
        for e in self.of(kind):
            if all(e.get(k) == v for k, v in match.items()):
                return e
        return None

    @property
    def identity(self) -> str:
        ready = wait_until(lambda: self.first("ready"), STARTUP, what=f"{self.label} ready")
        return str(ready["identity"])

    def send(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            self.killed_at = time.monotonic()
        self.proc.send_signal(sig)

    def leading_epoch(self) -> int | None:
        """The epoch of a term this candidate started and has not reported ending."""
        stopped = {e["epoch"] for e in self.of("stopped")}
        open_terms = [e["epoch"] for e in self.of("started") if e["epoch"] not in stopped]
        return open_terms[-1] if open_terms and self.killed_at is None else None

    def log_tail(self) -> str:
        try:
            return "\n".join(self.log.read_text().splitlines()[-15:])
        except OSError:
            return ""


@dataclass(frozen=True)
class Term:
    identity: str
    epoch: int
    start: float
    end: float  # monotonic; inf while still leading


def terms_of(candidates: list[Candidate]) -> list[Term]:
    """Every term a candidate believed in, from its ``started`` to the moment its belief
    ended: the earlier of its ``stopped`` report and the deadline after which
    ``Leadership.check()`` refused; for a SIGKILLed candidate, the kill."""
    terms = []
    for c in candidates:
        for started in c.of("started"):
            stopped = c.first("stopped", epoch=started["epoch"])
            if stopped is not None:
                end = min(stopped["mono"], stopped["valid_until"])
            elif c.killed_at is not None:
                end = c.killed_at
            else:
                end = float("inf")
            terms.append(Term(started["identity"], started["epoch"], started["mono"], end))
    return sorted(terms, key=lambda t: t.start)


def assert_one_leader_at_a_time(terms: list[Term]) -> None:
    assert terms, "nobody ever led"
    for before, after in pairwise(terms):
        assert before.end <= after.start, f"terms overlap: {before} and {after}"
        assert after.epoch > before.epoch, f"epoch did not increase: {before} then {after}"


@dataclass
class Sample:
    before: float  # monotonic, just before the read was sent
    after: float  # monotonic, once the answer arrived
    holder: str
    transitions: int
    resource_version: str
    fence_epoch: int | None


@dataclass
class Checker:
    """Reads the Lease (and the fenced ConfigMap) many times a second, in a thread."""

    kubeconfig: Path
    namespace: str
    interval: float = 0.05
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Checker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with kube.api_client(self.kubeconfig) as api:  # its own connections
            self._poll(api)

    def _poll(self, api: client.ApiClient) -> None:
        leases = LeaseClient(api, self.namespace, LEASE)
        core = client.CoreV1Api(api)
        while not self._stop.is_set():
            before = time.monotonic()
            try:
                record = leases.get(5)
                cm = core.read_namespaced_config_map(FENCE, self.namespace, _request_timeout=5)
            except Exception:
                self.errors += 1
            else:
                data = cm.data or {}
                fenced = int(data["epoch"]) if "epoch" in data else None
                if record is None:  # not created yet: an "earlier version" all the same
                    self.samples.append(Sample(before, time.monotonic(), "", -1, "", fenced))
                else:
                    self.samples.append(Sample(
                        before, time.monotonic(), record.holder, record.transitions,
                        record.resource_version, fenced))
            self._stop.wait(self.interval)

    def rate(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        return len(self.samples) / (self.samples[-1].after - self.samples[0].before)

    def assert_consistent(self) -> None:
        """Epochs only grow, a new holder always comes with a new epoch, and the fenced
        ConfigMap's epoch never goes back."""
        assert self.samples, "the checker never read the Lease"
        for prev, cur in pairwise(self.samples):
            assert cur.transitions >= prev.transitions, (prev, cur)
            if cur.holder and cur.holder != prev.holder:
                assert cur.transitions > prev.transitions, (prev, cur)
            if prev.fence_epoch is not None and cur.fence_epoch is not None:
                assert cur.fence_epoch >= prev.fence_epoch, (prev, cur)

    def versions_held_by(self, identity: str) -> int:
        return len({s.resource_version for s in self.samples if s.holder == identity})

    def saw_term(self, identity: str, epoch: int) -> bool:
        return any(s.holder == identity and s.transitions == epoch for s in self.samples)

    def last_renewal_bound(self, identity: str) -> float:
        """A monotonic instant before ``identity``'s last Lease write: the start of the
        last read that still returned an earlier version."""
        own = [s for s in self.samples if s.holder == identity]
        assert own, f"the checker never saw {identity} hold the Lease"
        last_version = own[-1].resource_version
        first_of_last = next(i for i, s in enumerate(self.samples)
                             if s.resource_version == last_version)
        assert first_of_last > 0, "no read before the last version"
        return self.samples[first_of_last - 1].before


@pytest.fixture
def fence_configmap(api: client.ApiClient, namespace: str) -> str:
    client.CoreV1Api(api).create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name=FENCE),
                                      data={"epoch": "-1"}))
    return FENCE


@pytest.fixture
def start_candidate(cluster: LocalCluster, namespace: str, fence_configmap: str,
                    tmp_path: Path) -> Iterator[Callable[..., Candidate]]:
    """Start candidate processes; every one is stopped (and reaped) afterwards."""
    started: list[Candidate] = []
    floor = tmp_path / "epoch-floor.json"

    def start(label: str, *extra: str) -> Candidate:
        log = tmp_path / f"candidate-{label}.log"
        argv = [
            sys.executable, str(CANDIDATE),
            "--kubeconfig", str(cluster.kubeconfig_for("controller")),
            "--fence-kubeconfig", str(cluster.kubeconfig),
            "--namespace", namespace, "--name", LEASE,
            "--lease-duration", str(LEASE_DURATION),
            "--renew-deadline", str(RENEW_DEADLINE),
            "--retry-period", str(RETRY_PERIOD),
            "--fence-configmap", fence_configmap,
            "--floor-file", str(floor), "--log-file", str(log), *extra,
        ]
        c = Candidate(label, argv, log)
        started.append(c)
        return c

    yield start
    for c in started:
        if c.proc.poll() is None:
            os.killpg(c.proc.pid, signal.SIGCONT)
            c.proc.kill()
        c.proc.wait(timeout=30)


def leader_among(candidates: list[Candidate], above: int = -1) -> Candidate | None:
    """The candidate currently leading with an epoch above ``above``, if exactly one is."""
    leading = [c for c in candidates
               if (e := c.leading_epoch()) is not None and e > above]
    return leading[0] if len(leading) == 1 else None


def read_lease(api: client.ApiClient, namespace: str) -> LeaseRecord:
    record = LeaseClient(api, namespace, LEASE).get(10)
    assert record is not None
    return record


def fence_epoch(api: client.ApiClient, namespace: str) -> int:
    cm = client.CoreV1Api(api).read_namespaced_config_map(FENCE, namespace)
    return int(cm.data["epoch"])


@dataclass
class InProcess:
    """An elector run in a thread of the test process, with what its callbacks saw."""

    elector: LeaderElector
    stop: threading.Event
    thread: threading.Thread
    terms: list[Leadership]
    stopped_calls: list[float]

    def wait_leading(self, above: int = -1, timeout: float = 60) -> Leadership:
        def current() -> Leadership | None:
            t = self.elector.leadership
            return t if t is not None and t.epoch > above else None

        return wait_until(current, timeout, what="in-process elector leading")

    def shutdown(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


@pytest.fixture
def run_elector(api: client.ApiClient) -> Iterator[Callable[..., InProcess]]:
    running: list[InProcess] = []

    def run(namespace: str, *, on_started: Callable[[Leadership], None] | None = None,
            floor: InMemoryEpochFloor | None = None, name: str = LEASE,
            extra_stopped: Callable[[], None] | None = None) -> InProcess:
        terms: list[Leadership] = []
        stopped_calls: list[float] = []

        def started(leadership: Leadership) -> None:
            terms.append(leadership)
            if on_started is not None:
                on_started(leadership)

        def stopped() -> None:
            stopped_calls.append(time.monotonic())
            if extra_stopped is not None:
                extra_stopped()

        config = fast_config(namespace=namespace, name=name)
        store = KubernetesLeaseStore(api, config.namespace, config.name)
        elector = LeaderElector(store, config, started, stopped, epoch_floor=floor)
        stop = threading.Event()
        thread = threading.Thread(target=elector.run, args=(stop,), daemon=True)
        thread.start()
        handle = InProcess(elector, stop, thread, terms, stopped_calls)
        running.append(handle)
        return handle

    yield run
    for handle in running:
        handle.stop.set()
        handle.thread.join(timeout=30)


# ---- pure logic -------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(("settings", "message"), [
    ({"lease_duration": 2, "renew_deadline": 2, "retry_period": 0.5},
     "lease_duration (2s) must be greater than renew_deadline (2s)"),
    ({"lease_duration": 15, "renew_deadline": 10, "retry_period": 9},
     "renew_deadline (10s) must be greater than retry_period * 1.2"),
    ({"lease_duration": 3, "renew_deadline": 2, "retry_period": 0},
     "retry_period must be a positive number"),
    ({"lease_duration": float("nan"), "renew_deadline": 2, "retry_period": 0.5},
     "lease_duration must be a positive number"),
    ({"identity": ""}, "identity must not be empty"),
    ({"namespace": ""}, "namespace must not be empty"),
])
def test_a_bad_election_config_is_refused_with_the_reason(settings: dict[str, Any],
                                                          message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ElectionConfig(**settings)


@pytest.mark.unit
def test_defaults_are_valid_and_the_lease_never_advertises_less_than_configured() -> None:
    config = ElectionConfig()
    assert (config.namespace, config.name) == ("neonvm-system", "neonvm-controller")
    assert config.lease_duration > config.renew_deadline + config.retry_period
    assert fast_config(lease_duration=2.6).lease_duration_seconds == 3


@pytest.mark.unit
def test_identities_are_hostname_and_random_hex_unique_per_start() -> None:
    first, second = new_identity(), new_identity()
    assert re.fullmatch(r".+_[0-9a-f]{12}", first)
    assert first != second
    assert ElectionConfig().identity != ElectionConfig().identity


@pytest.mark.unit
def test_check_refuses_from_the_renew_deadline_on_even_if_nobody_set_lost() -> None:
    now = [100.0]
    term = Leadership(epoch=7, identity="me", valid_until=102.0, clock=lambda: now[0])
    term.check()
    assert term.remaining() == 2.0
    now[0] = 102.0
    with pytest.raises(LeadershipLost, match="epoch 7"):
        term.check()
    assert term.lost.is_set()
    assert term.remaining() == 0.0


@pytest.mark.unit
def test_a_step_down_request_names_one_term_only() -> None:
    request = StepDownRequest.parse(StepDownRequest("a_1", 4).to_annotation())
    assert request is not None
    assert request.names("a_1", 4)
    assert not request.names("a_1", 5)  # a later term of the same process
    assert not request.names("b_2", 4)
    assert StepDownRequest.parse("not json") is None
    assert StepDownRequest.parse('{"epoch": 4}') is None


@pytest.mark.unit
def test_times_are_written_as_kubernetes_microtime() -> None:
    moment = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert format_microtime(moment) == "2026-01-02T03:04:05.000000Z"


def _record(holder: str, renewed: datetime, step_down: str | None = None) -> LeaseRecord:
    obj: dict[str, Any] = {
        "metadata": {"name": LEASE, "namespace": "ns", "resourceVersion": "1",
                     "annotations": {"leader.vm.neon.tech/step-down": step_down}
                     if step_down else {}},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, "leaseTransitions": 4,
                 "acquireTime": format_microtime(renewed), "renewTime": format_microtime(renewed)},
    }
    return LeaseRecord.from_object(obj)


@pytest.mark.unit
def test_show_describes_held_expired_released_and_requested_leases() -> None:
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    held = describe(_record("a_1", now - timedelta(seconds=5)), now)
    assert (held["state"], held["epoch"], held["expiresIn"]) == ("held", 4, 10.0)
    assert describe(_record("a_1", now - timedelta(seconds=20)), now)["state"] == "expired"
    released = describe(_record("", now), now)
    assert (released["state"], released["holder"]) == ("released", None)
    asked = _record("a_1", now, StepDownRequest("a_1", 4).to_annotation())
    assert describe(asked, now)["state"] == "held, step-down requested"
    stale = _record("a_1", now, StepDownRequest("old_9", 3).to_annotation())
    assert describe(stale, now)["state"] == "held"


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.mark.unit
def test_healthz_fails_when_the_elector_loop_is_wedged_and_metrics_are_per_registry() -> None:
    now = [1000.0]
    registry = CollectorRegistry()
    unused = client.ApiClient()  # never called: the loop is not run
    elector = LeaderElector(KubernetesLeaseStore(unused, "ns", "l"), fast_config(),
                            lambda _t: None, lambda: None, registry=registry, clock=lambda: now[0])
    server = HealthServer(0, registry, host="127.0.0.1")
    server.add_check("leader-election", elector.health_check)
    server.add_check("cache-synced", lambda: None, liveness=False)
    with pytest.raises(ValueError, match="already registered"):
        server.add_check("leader-election", lambda: None)
    with server:
        base = f"http://127.0.0.1:{server.port}"
        assert _get(f"{base}/healthz") == (200, "ok\n")
        status, body = _get(f"{base}/readyz?verbose")
        assert status == 200 and "[+]cache-synced ok" in body
        now[0] += LEASE_DURATION + 1  # the loop has not turned for a lease duration
        status, body = _get(f"{base}/healthz")
        assert status == 500
        assert "[-]leader-election failed: leader election loop has not run" in body
        assert _get(f"{base}/healthz/leader-election")[0] == 500
        assert _get(f"{base}/healthz/nope")[0] == 404
        status, metrics = _get(f"{base}/metrics")
        assert status == 200
        assert "neonvm_leader_is_leader 0.0" in metrics
        assert "neonvm_leader_renew_failures_total 0.0" in metrics
        assert "python_gc_objects_collected_total" not in metrics  # not the global registry
    unused.close()


# ---- one process, real API server -------------------------------------------------------


@pytest.mark.cluster
def test_the_lease_reads_normally_for_other_tools_and_is_released_after_work_stopped(
        api: client.ApiClient, namespace: str, run_elector: Callable[..., InProcess]) -> None:
    holder_when_stopping: list[str] = []
    run = run_elector(namespace, extra_stopped=lambda: holder_when_stopping.append(
        read_lease(api, namespace).holder))
    term = run.wait_leading()
    identity = run.elector.config.identity

    typed = client.CoordinationV1Api(api).read_namespaced_lease(LEASE, namespace)
    assert typed.spec.holder_identity == identity
    assert typed.spec.lease_duration_seconds == 3
    assert typed.spec.lease_transitions == term.epoch
    assert isinstance(typed.spec.renew_time, datetime)
    raw = read_lease(api, namespace)
    assert MICROTIME.match(raw.renew_time or "") and MICROTIME.match(raw.acquire_time or "")
    assert run.elector.is_leader()

    run.shutdown()
    assert term.lost.is_set()
    assert holder_when_stopping == [identity], "work must stop while the Lease is still held"
    released = read_lease(api, namespace)
    assert released.holder == ""
    assert released.lease_duration_seconds == 1
    assert released.transitions == term.epoch
    assert run.elector.registry.get_sample_value("neonvm_leader_is_leader") == 0.0


@pytest.mark.cluster
def test_the_kubernetes_store_keeps_the_store_contract_and_its_watch_hears_changes(
        controller_api: client.ApiClient, namespace: str) -> None:
    """The contract the table tests' in-memory store (tests/support/election.py) keeps,
    checked on the real API server as the controller's identity (whose RBAC must allow
    the watch)."""
    store = KubernetesLeaseStore(controller_api, namespace, LEASE)
    assert store.get(10) is None
    spec = {"holderIdentity": "a_1", "leaseDurationSeconds": 3, "leaseTransitions": 0}
    first = store.create(spec, 10)
    with pytest.raises(LeaseConflict):
        store.create(spec, 10)
    second = store.update(first, {"holderIdentity": "b_1", "leaseTransitions": 1}, 10)
    assert second.resource_version != first.resource_version
    with pytest.raises(LeaseConflict):
        store.update(first, {"holderIdentity": "c_1"}, 10)  # stale base: refused
    now = store.get(10)
    assert now is not None and (now.holder, now.resource_version) == ("b_1",
                                                                   second.resource_version)
    with pytest.raises(LeaseNamespaceNotFound):
        KubernetesLeaseStore(controller_api, f"{namespace}-gone", LEASE).create(spec, 10)

    heard: list[LeaseRecord | None] = []

    def watch() -> None:
        for record in store.watch(timeout=60):
            heard.append(record)
            if record is not None and record.holder == "d_1":
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    wait_for(lambda: heard, 60, what="the watch's first event (the current object)")
    assert heard[0] is not None and heard[0].holder == "b_1"
    third = store.update(second, {"holderIdentity": "d_1"}, 10)
    watcher.join(timeout=60)
    assert not watcher.is_alive(), f"the watch did not hear the change: {heard}"
    last = heard[-1]
    assert last is not None and last.resource_version == third.resource_version


class CountingFloor:
    """Wraps an EpochFloor and records every epoch claimed through it."""

    def __init__(self, inner: EpochFloor) -> None:
        self.inner = inner
        self.claims: list[int] = []

    def claim(self, epoch: int, identity: str) -> bool:
        self.claims.append(epoch)
        return self.inner.claim(epoch, identity)


@pytest.fixture(params=["in-memory", "etcd"])
def epoch_floor(request: pytest.FixtureRequest, cluster: LocalCluster,
                namespace: str) -> Iterator[CountingFloor]:
    """The in-memory floor above, and the real one in the locks' etcd."""
    if request.param == "in-memory":
        yield CountingFloor(InMemoryEpochFloor())
        return
    from neonvm.leader.epoch import EpochFloor as EtcdEpochFloor
    from neonvm.leader.etcd import Etcd

    prefix = f"/neonvm-test/{namespace}"
    etcd = Etcd(cluster.locks_etcd_config(prefix))
    try:
        yield CountingFloor(EtcdEpochFloor(etcd, prefix=prefix))
    finally:
        etcd.close()


@pytest.mark.cluster
def test_epochs_keep_increasing_when_the_lease_is_deleted(
        api: client.ApiClient, namespace: str, run_elector: Callable[..., InProcess],
        epoch_floor: CountingFloor) -> None:
    leases = client.CoordinationV1Api(api)
    first = run_elector(namespace, floor=epoch_floor)
    first_epoch = first.wait_leading().epoch
    first.shutdown()
    leases.delete_namespaced_lease(LEASE, namespace)

    second = run_elector(namespace, floor=epoch_floor)
    term = second.wait_leading()
    assert term.epoch > first_epoch  # the re-created Lease started again at 0
    assert read_lease(api, namespace).transitions == term.epoch
    second.shutdown()

    # An epoch far ahead (a Lease deleted after a long history): reached by galloping.
    assert epoch_floor.claim(1000, "earlier-history")
    leases.delete_namespaced_lease(LEASE, namespace)
    epoch_floor.claims.clear()
    third = run_elector(namespace, floor=epoch_floor)
    term = third.wait_leading()
    assert term.epoch > 1000
    assert read_lease(api, namespace).transitions == term.epoch
    assert len(epoch_floor.claims) <= 12, f"one step at a time: {epoch_floor.claims}"
    assert epoch_floor.claims[-1] == term.epoch


@pytest.mark.cluster
def test_leader_show_in_all_formats_and_errors_in_one_line(
        api: client.ApiClient, cluster: LocalCluster, namespace: str, tmp_path: Path,
        run_elector: Callable[..., InProcess]) -> None:
    runner = CliRunner()
    base = ["leader", "show", "-n", namespace, "--name", LEASE,
            "--kubeconfig", str(cluster.kubeconfig)]
    missing = runner.invoke(main, base)
    assert missing.exit_code == 1
    assert missing.output.strip().count("\n") == 0 and "no Lease" in missing.output

    run = run_elector(namespace)
    term = run.wait_leading()
    identity = run.elector.config.identity

    as_json = runner.invoke(main, [*base, "-o", "json"])
    assert as_json.exit_code == 0, as_json.output
    shown = json.loads(as_json.output)
    assert (shown["holder"], shown["epoch"], shown["state"]) == (identity, term.epoch, "held")
    assert shown["leaseDurationSeconds"] == 3 and shown["leaseTransitions"] == term.epoch
    assert MICROTIME.match(shown["acquired"]) and MICROTIME.match(shown["renewed"])
    assert shown["expiresIn"] is not None

    as_yaml = runner.invoke(main, [*base, "-o", "yaml"])
    assert as_yaml.exit_code == 0
    assert yaml.safe_load(as_yaml.output)["holder"] == identity

    table = runner.invoke(main, base)
    assert table.exit_code == 0
    header, row = table.output.splitlines()
    assert header.split() == ["LEASE", "HOLDER", "EPOCH", "STATE", "ACQUIRED", "RENEWED",
                              "EXPIRESIN", "LEASETRANSITIONS"]
    assert row.split()[:3] == [f"{namespace}/{LEASE}", identity, str(term.epoch)]

    run.shutdown()
    released = json.loads(runner.invoke(main, [*base, "-o", "json"]).output)
    assert (released["state"], released["holder"]) == ("released", None)

    unreachable = tmp_path / "unreachable.kubeconfig"
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    config["clusters"][0]["cluster"]["server"] = "https://127.0.0.1:1"
    unreachable.write_text(yaml.safe_dump(config))
    down = runner.invoke(main, ["leader", "show", "--kubeconfig", str(unreachable)])
    assert down.exit_code == 3  # cannot reach the cluster
    assert down.output.startswith("error: API server unreachable")
    assert down.output.strip().count("\n") == 0
    no_file = runner.invoke(main, ["leader", "show", "--kubeconfig", str(tmp_path / "nope")])
    assert no_file.exit_code != 0 and no_file.output.strip().count("\n") == 0


@pytest.mark.cluster
def test_step_down_refuses_a_wrong_holder_and_a_lone_leader_returns_under_a_new_epoch(
        api: client.ApiClient, cluster: LocalCluster, namespace: str,
        run_elector: Callable[..., InProcess]) -> None:
    runner = CliRunner()
    base = ["leader", "step-down", "-n", namespace, "--name", LEASE,
            "--kubeconfig", str(cluster.kubeconfig)]
    run = run_elector(namespace)
    term = run.wait_leading()

    wrong = runner.invoke(main, [*base, "--holder", "someone-else"])
    assert wrong.exit_code == 1 and wrong.output.strip().count("\n") == 0
    assert "not someone-else" in wrong.output
    assert read_lease(api, namespace).step_down is None

    alone = runner.invoke(main, [*base, "--timeout", "60"])
    assert alone.exit_code == 0, alone.output
    assert "no other candidate took over" in alone.output
    again = run.wait_leading(above=term.epoch)
    assert term.lost.is_set() and run.stopped_calls
    assert read_lease(api, namespace).transitions == again.epoch

    run.shutdown()
    released = runner.invoke(main, base)
    assert released.exit_code == 1 and "there is no leader" in released.output


# ---- separate processes -----------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.slow
def test_three_candidates_one_leader_at_a_time_through_kill_and_graceful_stop(
        api: client.ApiClient, cluster: LocalCluster, namespace: str,
        start_candidate: Callable[..., Candidate]) -> None:
    lease_duration, retry = LEASE_DURATION, RETRY_PERIOD
    with Checker(cluster.kubeconfig, namespace) as checker:
        everyone = [start_candidate(label) for label in ("a", "b", "c")]
        for c in everyone:
            assert c.identity
        first = wait_until(lambda: leader_among(everyone), STARTUP, what="a first leader")
        first_epoch = first.leading_epoch()
        assert first_epoch is not None
        wait_for(lambda: first.first("write", result="accepted"), 30, what="leader work")
        wait_for(lambda: checker.versions_held_by(first.identity) >= 3, 30,
                 what="the leader renewing")

        first.send(signal.SIGKILL)
        assert first.killed_at is not None
        others = [c for c in everyone if c is not first]
        second = wait_until(lambda: leader_among(others, above=first_epoch), 60,
                          what="a leader after SIGKILL")
        second_epoch = second.leading_epoch()
        assert second_epoch is not None
        took_over = second.first("started", epoch=second_epoch)
        assert took_over is not None
        failover = took_over["mono"] - first.killed_at
        not_before = took_over["mono"] - checker.last_renewal_bound(first.identity)

        # The checker polls the Lease: let it see this term before ending it (a term cut
        # short by the signal at once can fall between two reads on a loaded machine).
        wait_for(lambda: checker.saw_term(second.identity, second_epoch), 30,
                 what="the checker to see the second leader's term")
        term_sent = time.monotonic()
        second.send(signal.SIGTERM)
        last = next(c for c in others if c is not second)
        third = wait_until(lambda: leader_among([last], above=second_epoch), 60,
                         what="a leader after SIGTERM")
        third_epoch = third.leading_epoch()
        stepped_down = wait_until(lambda: second.first("stopped", epoch=second_epoch), 30,
                                what="the stopped leader's report")
        handed_to = third.first("started", epoch=third_epoch)
        assert handed_to is not None
        assert second.proc.wait(timeout=60) == 0
        handover = handed_to["mono"] - stepped_down["mono"]
        wait_for(lambda: third.first("write", result="accepted", epoch=third_epoch), 30,
                 what="the last leader's work")
        # Same as for the second term: the checker must see it before the signal ends it.
        wait_for(lambda: checker.saw_term(third.identity, third_epoch), 30,
                 what="the checker to see the last leader's term")
        third.send(signal.SIGTERM)
        assert third.proc.wait(timeout=60) == 0

    print(f"\nchecker: {len(checker.samples)} reads of the Lease at {checker.rate():.0f}/s, "
          f"{checker.errors} errors")
    print(f"SIGKILL failover: {failover:.2f}s after the kill, {not_before:.2f}s after the "
          f"killed leader's last renewal (lease {lease_duration:g}s, retry {retry:g}s)")
    print(f"SIGTERM handover: {handover:.2f}s from release to the next leader's start "
          f"({handed_to['mono'] - term_sent:.2f}s after the signal)")

    assert checker.rate() >= 5, "the checker must read many times a second"
    checker.assert_consistent()
    terms = terms_of(everyone)
    assert_one_leader_at_a_time(terms)
    assert [t.epoch for t in terms] == [first_epoch, second_epoch, third_epoch]
    for t in terms:
        assert checker.saw_term(t.identity, t.epoch), f"Lease never showed {t}"
    # Safety: the takeover waited out the killed leader's lease, measured from a read that
    # preceded its last renewal. Liveness, generously: it did not wait much longer.
    assert not_before >= lease_duration
    assert failover < 10 * (lease_duration + retry)
    assert handover < 10 * retry * 1.2 + 5
    assert fence_epoch(api, namespace) == third_epoch


@pytest.mark.cluster
@pytest.mark.slow
def test_a_paused_leader_stops_on_waking_and_its_late_write_is_refused(
        api: client.ApiClient, cluster: LocalCluster, namespace: str,
        start_candidate: Callable[..., Candidate]) -> None:
    with Checker(cluster.kubeconfig, namespace) as checker:
        pair = [start_candidate("a", "--late-write"), start_candidate("b", "--late-write")]
        for c in pair:
            assert c.identity
        old = wait_until(lambda: leader_among(pair), STARTUP, what="a first leader")
        old_epoch = old.leading_epoch()
        assert old_epoch is not None
        wait_for(lambda: old.first("write", result="accepted"), 30, what="leader work")
        other = next(c for c in pair if c is not old)

        paused_at = time.monotonic()
        os.killpg(old.proc.pid, signal.SIGSTOP)
        new = wait_until(lambda: leader_among([other], above=old_epoch), 60,
                       what="a new leader while the old one is paused")
        new_epoch = new.leading_epoch()
        assert new_epoch is not None
        wait_for(lambda: fence_epoch(api, namespace) == new_epoch, 30,
                 what="the new leader's first fenced write")
        resumed_at = time.monotonic()
        os.killpg(old.proc.pid, signal.SIGCONT)

        stopped = wait_until(lambda: old.first("stopped", epoch=old_epoch), 60,
                           what="the woken leader to notice")
        late = wait_until(lambda: old.first("late_write", epoch=old_epoch), 60,
                        what="the late write")
        new_start = new.first("started", epoch=new_epoch)
        assert new_start is not None
        assert new.leading_epoch() == new_epoch, "the new leader keeps leading"
        assert read_lease(api, namespace).holder == new.identity

    print(f"\npaused for {resumed_at - paused_at:.2f}s; new leader after "
          f"{new_start['mono'] - paused_at:.2f}s; the woken leader reported the loss "
          f"{stopped['mono'] - resumed_at:.3f}s after SIGCONT; late write: {late['result']}")
    assert late["result"] == "refused"
    assert late["stored"] == new_epoch
    assert fence_epoch(api, namespace) == new_epoch
    # Its belief ended (check() refused) before the new term began ...
    assert stopped["valid_until"] <= new_start["mono"]
    # ... and nothing it wrote was accepted once the new leader had started.
    accepted = [w for w in old.of("write") if w["result"] == "accepted"]
    assert accepted and all(w["mono"] < new_start["mono"] for w in accepted)
    assert all(w["epoch"] == old_epoch for w in accepted)
    assert_one_leader_at_a_time(terms_of(pair))
    checker.assert_consistent()


@pytest.mark.cluster
@pytest.mark.slow
def test_step_down_hands_over_and_a_request_for_an_old_term_is_ignored(
        api: client.ApiClient, cluster: LocalCluster, namespace: str,
        start_candidate: Callable[..., Candidate]) -> None:
    pair = [start_candidate("a"), start_candidate("b")]
    for c in pair:
        assert c.identity
    old = wait_until(lambda: leader_among(pair), STARTUP, what="a first leader")
    old_epoch = old.leading_epoch()
    other = next(c for c in pair if c is not old)

    result = CliRunner().invoke(main, [
        "leader", "step-down", "-n", namespace, "--name", LEASE,
        "--kubeconfig", str(cluster.kubeconfig), "--timeout", "60"])
    assert result.exit_code == 0, result.output
    assert f"asked {old.identity} (epoch {old_epoch}) to step down" in result.output
    assert f"{other.identity} leads now" in result.output

    new_start = wait_until(lambda: other.first("started"), 30, what="the new leader's report")
    new_epoch = new_start["epoch"]
    assert old_epoch is not None and new_epoch > old_epoch
    stopped = wait_until(lambda: old.first("stopped", epoch=old_epoch), 30,
                         what="the old leader's report")
    print(f"\nstep-down handover: {new_start['mono'] - stopped['mono']:.2f}s from the old "
          "leader stopping to the new one starting")
    assert_one_leader_at_a_time(terms_of(pair))

    # A request naming the previous term, written now, must not depose the new leader.
    leases = LeaseClient(api, namespace, LEASE)

    def write_stale_request() -> LeaseRecord | None:
        current = read_lease(api, namespace)
        try:
            return leases.replace(current, {}, 10,
                                  step_down=StepDownRequest(old.identity, old_epoch))
        except client.ApiException as exc:
            if exc.status == 409:
                return None  # the leader renewed in between: try again
            raise

    written = wait_until(write_stale_request, 30, what="writing a stale step-down request")
    renewals_seen: set[str] = set()

    def renewed_three_times_since() -> bool:
        now = read_lease(api, namespace)
        assert now.holder == other.identity and now.transitions == new_epoch
        if now.renew_time != written.renew_time:
            renewals_seen.add(now.renew_time or "")
        return len(renewals_seen) >= 3

    wait_for(renewed_three_times_since, 60, what="the leader renewing past a stale request")
    assert other.leading_epoch() == new_epoch
    assert other.first("stopped", epoch=new_epoch) is None


# ---- API server down (restarts the session's kube-apiserver: keep last) -----------------


@pytest.mark.cluster
@pytest.mark.slow
def test_a_leader_that_cannot_renew_stops_its_work_before_the_lease_can_expire(
        cluster: LocalCluster, api: client.ApiClient, namespace: str,
        run_elector: Callable[..., InProcess]) -> None:
    last_passed_check: list[float] = []

    def work(leadership: Leadership) -> None:
        while True:
            try:
                leadership.check()
            except LeadershipLost:
                return
            last_passed_check.append(time.monotonic())
            leadership.lost.wait(0.05)

    run = run_elector(namespace, on_started=work)
    term = run.wait_leading()
    wait_for(lambda: last_passed_check, 30, what="leader work running")
    # SIGTERM, and the kill 3 s later: the server stops answering at once, and its
    # process would take some 20 s more to exit, which this test need not wait for.
    cluster.stop_component("kube-apiserver", timeout=3.0)
    try:
        down_at = time.monotonic()
        wait_for(lambda: term.lost.is_set(), 60, what="leadership to be given up")
        lost_seen = time.monotonic()
        wait_for(lambda: run.stopped_calls, 30, what="on_stopped")
        last_renewal_sent = term.valid_until - RENEW_DEADLINE
        print(f"\nAPI server stopped; leadership given up {lost_seen - down_at:.2f}s later, "
              f"{run.stopped_calls[0] - last_renewal_sent:.2f}s after the last successful "
              f"renewal was sent (renew deadline {RENEW_DEADLINE:g}s, "
              f"lease {LEASE_DURATION:g}s)")
        # check() refused from the renew deadline on, which is before the Lease's expiry
        # for any follower (renew_deadline < lease_duration, both from the send time).
        assert last_passed_check[-1] < term.valid_until
        assert run.elector.registry.get_sample_value("neonvm_leader_renew_failures_total")
    finally:
        restart_api_server(cluster, api)
    again = run.wait_leading(above=term.epoch, timeout=120)
    assert again.epoch > term.epoch
    run.shutdown()
