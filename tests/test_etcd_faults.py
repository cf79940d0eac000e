"""How the etcd client and the controller meet an etcd that stops, and one that refuses.

* **A stopping etcd is "went away", never "refused".** etcd stopped gracefully sends
  GOAWAY at once but keeps the streams still open until its hard stop, and over TLS it
  then resets them (gRPC INTERNAL "Stream removed ... RST_STREAM"). Every call, unary or
  watch, maps a reset to EtcdUnavailable through the one mapping (``went_away``); a watch
  ends as soon as its connection leaves READY. So ``neonvm locks watch`` exits 3, "etcd
  went away", and a lock waiter gets EtcdUnavailable (retried, like any outage), while
  the holder keeps its lock through the stop (docs/locks.md, "When etcd stops").
* **A replica whose certificate may not touch its prefix** says so once, in one line,
  and exits 3 instead of retrying a refusal forever (docs/locks.md, "Failure behaviour").

Real etcd processes: a private one per test for the stops (started and stopped here),
the session's locks etcd (TLS, client certificates, a role per prefix) for the refusal.
Fakes only for the mapping itself (which gRPC failure is which).
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from kubernetes import client

from neonvm.dev.cluster import LocalCluster
from neonvm.dev.replica import controller_argv
from neonvm.leader.etcd import (
    Etcd,
    EtcdConfig,
    EtcdUnavailable,
    WatchStream,
    went_away,
)
from neonvm.leader.lock import (
    DEFAULT_INSTALLATION,
    LockHeld,
    LockManager,
    LockRecord,
    lock_key,
)
from neonvm.leader.session import Session
from tests.support import etcd_answers, private_etcd, wait_for
from tests.support.etcd_faults import _Failure

NEONVM = [sys.executable, "-m", "neonvm"]
RESET = "Stream removed (Data frame with END_STREAM flag received) " \
        "(RST_STREAM (Received RST_STREAM with error code 0))"
"""What gRPC says of a stream etcd over TLS reset as it stopped (seen live)."""


# ---- the mapping (pure logic) -------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(("code", "details", "gone"), [
    (grpc.StatusCode.INTERNAL, RESET, True),
    (grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)", True),
    (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", True),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", True),
    (grpc.StatusCode.INTERNAL, "etcdserver: corrupt cluster", False),
    (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied", False),
    (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: requested lease not found", False),
])
def test_a_stream_reset_is_no_answer_and_a_refusal_stays_a_refusal(
        code: grpc.StatusCode, details: str, gone: bool) -> None:
    assert went_away(_Failure(code, details)) is gone


def _unanswered_client() -> Etcd:
    """A client whose endpoint is never dialled (the tests pass the call to make)."""
    return Etcd(EtcdConfig(endpoints=("http://127.0.0.1:1",), timeout=5.0))


@pytest.mark.unit
def test_a_read_whose_stream_was_reset_is_sent_again() -> None:
    answers: list[str] = []

    def read(_ep: Any, _timeout: float, _md: Any) -> str:
        answers.append("sent")
        if len(answers) == 1:
            raise _Failure(grpc.StatusCode.INTERNAL, RESET)
        return "value"

    with _unanswered_client() as etcd:
        assert etcd._call("read /k", read, timeout=None, idempotent=True) == "value"
    assert answers == ["sent", "sent"]


@pytest.mark.unit
def test_a_transaction_whose_stream_was_reset_is_unavailable_and_not_sent_again() -> None:
    """Its outcome is unknown (it may have been applied): "went away", never "refused",
    which would say it was not."""
    sent: list[str] = []

    def txn(_ep: Any, _timeout: float, _md: Any) -> str:
        sent.append("txn")
        raise _Failure(grpc.StatusCode.INTERNAL, RESET)

    with _unanswered_client() as etcd, pytest.raises(EtcdUnavailable, match="RST_STREAM"):
        etcd._call("transaction", txn, timeout=None, idempotent=False)
    assert sent == ["txn"]


@pytest.mark.unit
def test_a_watch_whose_stream_was_reset_went_away() -> None:
    class Call:
        def __iter__(self) -> Iterator[Any]:
            raise _Failure(grpc.StatusCode.INTERNAL, RESET)

        def cancel(self) -> None:
            pass

    channel = SimpleNamespace(subscribe=lambda *_a, **_k: None,
                              unsubscribe=lambda *_a: None)
    endpoint = SimpleNamespace(url="https://etcd:2379", channel=channel,
                               watch=SimpleNamespace(Watch=lambda *_a, **_k: Call()))
    told: list[str] = []
    stream = WatchStream(endpoint, object(), None, None,  # type: ignore[arg-type]
                         on_unavailable=lambda: told.append("advance"))
    with pytest.raises(EtcdUnavailable, match="went away during a watch"):
        list(stream)
    assert told == ["advance"]


# ---- a private etcd, stopped gracefully -----------------------------------------------------


@pytest.fixture
def prefix() -> str:
    return f"/t-{uuid.uuid4().hex[:10]}"


@pytest.mark.cluster
def test_a_lock_watch_exits_3_etcd_went_away_when_etcd_over_tls_stops_gracefully(
        tmp_path: Path, prefix: str) -> None:
    with private_etcd(tmp_path) as etcd:
        config = etcd.config(prefix)
        watcher = subprocess.Popen(
            [*NEONVM, "locks", "watch", "--no-existing", "-o", "json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **config.env(), "PYTHONFAULTHANDLER": "1"})
        try:
            assert watcher.stdout is not None and watcher.stderr is not None
            wait_for(lambda: _watch_streams(config) >= 1, 60, what="the watch open on etcd")
            with Etcd(config) as writer:  # a lock appears: the watch is up and streaming
                writer.put(lock_key(prefix, DEFAULT_INSTALLATION, "default", "vm-1"),
                           LockRecord("replica-a", 1, "uid-1", time.time()).encode())
            taken = json.loads(watcher.stdout.readline())
            assert (taken["event"], taken["name"]) == ("PUT", "vm-1")

            etcd.terminate()
            try:
                code = watcher.wait(60)
            except subprocess.TimeoutExpired:
                watcher.send_signal(signal.SIGABRT)  # its threads' stacks, for the failure
                watcher.wait()
                raise AssertionError(f"the watch did not end: {watcher.stderr.read()}") \
                    from None
            errors = watcher.stderr.read().strip().splitlines()
            etcd.wait()
        finally:
            if watcher.poll() is None:
                watcher.kill()
                watcher.wait()
    # Exit 3 (cannot reach; README, "Exit codes") with one line: the etcd went away, seen
    # by its GOAWAY (at once), not by the reset of the stream (at etcd's hard stop).
    assert code == 3, errors
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"error: etcd at {etcd.url} went away during a watch"), errors
    assert "GOAWAY" in errors[0], errors


@pytest.mark.cluster
def test_a_lock_waiter_is_told_unavailable_and_the_holders_fencing_survives_the_stop(
        tmp_path: Path, prefix: str) -> None:
    """The controller's reaction to "went away" (retry later) is right for a stop: the
    waiter gets EtcdUnavailable, not a refusal; the holder keeps its lock through the
    stop (its session's 60 s TTL outlasts the restart), its fenced write succeeds after
    etcd is back, and the waiter is still refused."""
    with private_etcd(tmp_path) as etcd:
        config = etcd.config(prefix)
        with Etcd(config) as holder_etcd, Etcd(config) as waiter_etcd:
            holder_session = Session(holder_etcd, ttl=60, name="holder")
            waiter_session = Session(waiter_etcd, ttl=60, name="waiter")
            try:
                holder = LockManager(holder_etcd, holder_session, "replica-a", prefix)
                waiter = LockManager(waiter_etcd, waiter_session, "replica-b", prefix)
                guard = holder.acquire("default", "vm-1", "uid-1", epoch=1)
                outcome: list[BaseException] = []

                def wait() -> None:
                    try:
                        waiter.acquire("default", "vm-1", "uid-1", epoch=1, wait=300)
                    except BaseException as exc:
                        outcome.append(exc)

                thread = threading.Thread(target=wait, daemon=True)
                thread.start()
                wait_for(lambda: _watch_streams(config) >= 1, 60,
                         what="the waiter watching the lock key")
                etcd.terminate()
                thread.join(60)
                etcd.wait()
                assert not thread.is_alive()
                assert len(outcome) == 1 and isinstance(outcome[0], EtcdUnavailable), outcome
                assert "went away" in str(outcome[0]), outcome

                etcd.start()
                wait_for(lambda: etcd_answers(config), 60, what="etcd back")
                assert guard.held, guard.lost_reason
                assert guard.fenced_put(f"{prefix}/data", b"after the stop") > guard.token
                with pytest.raises(LockHeld):
                    waiter.acquire("default", "vm-1", "uid-1", epoch=1)
            finally:
                waiter_session.close(timeout=5)
                holder_session.close(timeout=5)


def _watch_streams(config: EtcdConfig) -> int:
    """etcd's own count of open watch streams (its /metrics, read over TLS)."""
    context = ssl.create_default_context(cafile=str(config.ca))
    context.load_cert_chain(str(config.cert), str(config.key))
    url = f"{config.endpoints[0]}/metrics"
    with urllib.request.urlopen(url, context=context, timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("etcd_debugging_mvcc_watch_stream_total "):
                return int(float(line.split()[1]))
    return 0


# ---- a certificate for another prefix -------------------------------------------------------


@pytest.mark.cluster
def test_a_replica_whose_certificate_may_not_touch_its_prefix_exits_3_with_one_line(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, prefix: str,
        tmp_path: Path) -> None:
    """Its certificate's user has a role for another prefix (another installation's):
    the replica says so once and exits 3, instead of retrying the refusal forever; it
    never took the Lease, so a correctly configured replica is not held up."""
    other = cluster.locks_etcd_config(f"{prefix}-other")
    argv = controller_argv(kubeconfig=str(cluster.kubeconfig_for("controller")),
                           etcd_endpoints=other, etcd_prefix=prefix, identity="misconfigured",
                           lease_namespace=namespace, watch_namespace=namespace,
                           extra=("--retry-period", "0.5"))
    log_path = tmp_path / "replica.log"
    with log_path.open("wb") as log:
        replica = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    try:
        code = replica.wait(60)
    finally:
        if replica.poll() is None:
            replica.kill()
            replica.wait()
    lines = [json.loads(line) for line in log_path.read_text().splitlines()
             if line.startswith("{")]
    messages = [str(line.get("msg", "")) for line in lines]
    errors = [line for line in lines if line.get("level") in ("error", "critical")]
    assert code == 3, messages
    assert len(errors) == 1, messages
    message = str(errors[0]["msg"])
    assert prefix in message and "permission denied" in message, message
    assert "\n" not in message and "stacktrace" not in errors[0], errors[0]
    # It never campaigned: a replica that cannot keep its locks must not hold the Lease.
    assert not [m for m in messages if m == "campaigning" or "acquired the Lease" in m], \
        messages
