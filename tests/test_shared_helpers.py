"""The small helpers several modules share: the one-line error summary and the RFC 3339
time formats."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from neonvm.api import times
from neonvm.kube import short_error
from neonvm.leader import election
from neonvm.leader.etcd import EtcdConfig

pytestmark = pytest.mark.unit


def test_short_error_of_an_api_error_is_status_and_reason() -> None:
    assert short_error(ApiException(status=409, reason="Conflict")) == "409 Conflict"


def test_short_error_keeps_the_first_line_and_at_most_300_characters() -> None:
    assert short_error(ValueError("first\nsecond")) == "ValueError: first"
    assert short_error(RuntimeError()) == "RuntimeError: "
    long = short_error(OSError("x" * 1000))
    assert len(long) == 300 and long.startswith("OSError: xxx")


def test_times_are_rfc3339_in_utc() -> None:
    aware = dt.datetime(2026, 1, 2, 4, 4, 5, 123456, tzinfo=dt.timezone(dt.timedelta(hours=1)))
    assert times.format_microtime(aware) == "2026-01-02T03:04:05.123456Z"
    assert times.format_time(aware) == "2026-01-02T03:04:05Z"
    naive = dt.datetime(2026, 1, 2, 3, 4, 5)
    assert times.format_microtime(naive) == "2026-01-02T03:04:05.000000Z"


def test_the_lease_and_the_vm_status_use_the_same_format() -> None:
    at = dt.datetime(2026, 5, 6, 7, 8, 9, 10, tzinfo=dt.UTC)
    assert election.format_microtime(at) == times.format_microtime(at) \
        == "2026-05-06T07:08:09.000010Z"
    assert times.parse(times.format_microtime(at)) == at


def _parsed(argv: list[str]) -> dict[str, object]:
    """What ``neonvm controller run`` makes of a launcher's command line (parsed by the
    real command, not run)."""
    from neonvm.cli.controller import run

    assert argv[1:8] == ["-m", "neonvm", "--log-format", "json", "controller", "run",
                         "--kubeconfig"]
    ctx = run.make_context("run", argv[7:])
    return dict(ctx.params)


def test_the_launcher_writes_a_command_line_the_controller_accepts() -> None:
    from neonvm.dev.replica import DEMO_TIMINGS, controller_argv, local_replica_argv

    full = _parsed(controller_argv(
        kubeconfig="/k", etcd_endpoints="http://127.0.0.1:1", identity="r-1",
        lease_namespace="ns", watch_namespace="ns", etcd_prefix="/p", health_host="127.0.0.1",
        runner_image="img:1", faults="conflict=0.5", extra=("--lease-duration", "4")))
    assert (full["identity"], full["lease_namespace"], full["etcd_prefix"],
            full["health_port"], full["lease_duration"]) == ("r-1", "ns", "/p", 0, 4.0)
    assert "--fault" not in controller_argv(kubeconfig="/k", etcd_endpoints="e",
                                            identity="i")

    class Cluster:
        def locks_etcd_config(self) -> EtcdConfig:
            return EtcdConfig(endpoints=("https://127.0.0.1:2",), ca=Path("/ca"),
                              cert=Path("/c"), key=Path("/k"))

        def kubeconfig_for(self, user: str) -> str:
            return f"/state/{user}.kubeconfig"

    argv = local_replica_argv(Cluster(), 3, faults="stale_reads=0.2")  # type: ignore[arg-type]
    local = _parsed(argv)
    assert str(local["kubeconfig"]) == "/state/controller.kubeconfig"
    # The local cluster's locks etcd wants TLS and a client certificate: all of it passed.
    assert (local["etcd_endpoints"], local["etcd_ca"], local["etcd_cert"], local["etcd_key"],
            local["etcd_prefix"]) == ("https://127.0.0.1:2", "/ca", "/c", "/k", "/neonvm")
    assert str(local["identity"]).startswith("replica-3-")
    assert argv[-2:] == ["--fault", "stale_reads=0.2"]
    assert list(DEMO_TIMINGS) == argv[argv.index("--lease-duration"):][:len(DEMO_TIMINGS)]
