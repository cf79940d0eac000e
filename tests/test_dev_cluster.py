"""`neonvm dev`: a real local control plane that starts, reports and stops cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from neonvm.dev.cluster import ClusterSpec, LocalCluster, free_port

pytestmark = pytest.mark.cluster


def neonvm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "neonvm", *args],
        capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300,
    )


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_up_is_idempotent_status_is_healthy_and_down_leaves_no_process(tmp_path: Path) -> None:
    state = str(tmp_path / "dev")
    first = neonvm("dev", "up", "--state-dir", state, "--nodes", "0", "--ports", "free")
    assert first.returncode == 0, first.stderr
    assert f"export KUBECONFIG={tmp_path / 'dev' / 'kubeconfig'}" in first.stdout
    try:
        again = neonvm("dev", "up", "--state-dir", state)
        assert again.returncode == 0, again.stderr
        assert "kube-apiserver: already running" in again.stderr
        status = neonvm("dev", "status", "--state-dir", state, "-o", "json")
        assert status.returncode == 0, status.stdout
        rows = json.loads(status.stdout)
        assert {r["component"] for r in rows} == {"etcd", "locks-etcd", "kube-apiserver"}
        assert all(r["healthy"] for r in rows)
        pids = [r["pid"] for r in rows]
    finally:
        down = neonvm("dev", "down", "--state-dir", state)
    assert down.returncode == 0, down.stderr
    assert not [p for p in pids if _alive(p)]
    after = neonvm("dev", "status", "--state-dir", state)
    assert after.returncode == 1
    assert "not running" in after.stdout


def test_a_port_in_use_is_a_one_line_error(tmp_path: Path) -> None:
    state = tmp_path / "dev"
    spec = ClusterSpec.with_free_ports(nodes=0)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", spec.ports["etcd"]))
        squatter.listen()
        LocalCluster(state, spec)  # nothing started yet
        state.mkdir()
        (state / "cluster.json").write_text(json.dumps({"nodes": 0, "ports": spec.ports}))
        result = neonvm("dev", "up", "--state-dir", str(state))
    assert result.returncode == 1
    assert f"port {spec.ports['etcd']} on 127.0.0.1 is already in use" in result.stderr
    assert "Traceback" not in result.stderr
    assert LocalCluster(state).down() == []


def test_a_missing_binary_is_a_one_line_error(tmp_path: Path) -> None:
    result = neonvm(
        "dev", "up", "--state-dir", str(tmp_path / "dev"), "--nodes", "0", "--ports", "free",
        env={"NEONVM_BIN_ETCD": str(tmp_path / "no-such-etcd")},
    )
    assert result.returncode == 1
    assert "NEONVM_BIN_ETCD points at" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unknown_flag_is_rejected_with_usage() -> None:
    result = neonvm("dev", "up", "--bogus")
    assert result.returncode == 2
    assert "No such option '--bogus'" in result.stderr


def test_status_reports_a_dead_etcd_and_exits_non_zero(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "dev", ClusterSpec.with_free_ports(nodes=0))
    cluster.up()
    try:
        cluster.stop_component("etcd", sig=signal.SIGKILL)  # dead, as a crash leaves it
        result = neonvm("dev", "status", "--state-dir", str(cluster.state_dir))
        assert result.returncode == 1
        etcd_line = next(line for line in result.stdout.splitlines() if line.startswith("etcd "))
        assert "not running" in etcd_line
    finally:
        # An API server without its etcd never finishes a graceful stop; do not wait the
        # default 20 s for it before the kill.
        cluster.down(timeout=2.0)


@pytest.mark.unit
def test_free_ports_are_distinct_unused_and_below_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = list(ClusterSpec.with_free_ports(nodes=3).ports.values())
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports), ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nobody listens there
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports[0]))
        held.listen()
        assert ports[0] not in {free_port() for _ in range(200)}


@pytest.mark.unit
def test_a_process_without_argv_counts_as_alive_until_it_is_a_zombie() -> None:
    """An exiting multi-threaded process (a kubelet on SIGTERM) shows an empty argv
    before it is a zombie. Stopping it must wait that out: the real node restores the
    kubelet's host directory only when no kubelet runs. kthreadd (pid 2) has no argv
    and never exits, so it stands in for the exiting process."""
    from neonvm.dev.cluster import _pid_alive

    assert Path("/proc/2/cmdline").read_bytes() == b""
    assert _pid_alive(2, "")
    assert _pid_alive(2, "kthreadd")
    assert not _pid_alive(2, "kubelet")
