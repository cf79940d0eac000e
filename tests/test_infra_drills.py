"""The infrastructure drills, as specifications (docs/drills.md, "Infrastructure drills").

First the tools they are built from: the fault proxy (a cut is a black hole, a heal
closes what lived through it), the docs writer (one row per drill, replaced by its next
run), the timeline picture and the leader-change count. Then one short run of each
drill against the session's control plane with three real replicas under churn: no
duplicate, no lost work, every VM converged after the fault, a recovery time measured,
a timeline written. The long versions (60 s outage, 5 minutes of slow API) run from the
CLI; their figures are in docs/drills.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from neonvm.cli import main
from neonvm.dev.cluster import LocalCluster
from neonvm.drills.drills import Verdict, _changes_between
from neonvm.drills.proxy import FaultProxy
from neonvm.drills.record import BEGIN, END, write
from neonvm.drills.target import LeaderLog, LocalTarget
from neonvm.drills.timeline import Timeline, render_svg

# ---- the fault proxy (real sockets on loopback) ----------------------------------------------


@pytest.fixture
def echo_server() -> Iterator[tuple[str, int]]:
    """A TCP server that sends back whatever it receives."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:
                pass

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()
    stop.set()
    listener.close()


def exchange(sock: socket.socket, data: bytes, wait: float = 5.0) -> bytes:
    """Send ``data`` and read what comes back within ``wait`` s (b"" if nothing)."""
    sock.settimeout(wait)
    sock.sendall(data)
    try:
        return sock.recv(65536)
    except TimeoutError:
        return b""


@pytest.mark.unit
def test_a_cut_proxy_answers_nothing_and_the_heal_closes_what_lived_through_the_cut(
        echo_server: tuple[str, int]) -> None:
    with FaultProxy(echo_server) as proxy:
        before = socket.create_connection(("127.0.0.1", proxy.port))
        assert exchange(before, b"ping") == b"ping"
        proxy.cut()
        assert exchange(before, b"lost", wait=0.5) == b""
        during = socket.create_connection(("127.0.0.1", proxy.port))  # accepted, not refused
        assert exchange(during, b"lost too", wait=0.5) == b""
        proxy.heal()
        for old in (before, during):
            old.settimeout(5)
            with contextlib.suppress(ConnectionResetError):  # closed either way
                assert old.recv(1) == b""
        after = socket.create_connection(("127.0.0.1", proxy.port))
        assert exchange(after, b"pong") == b"pong"
        for s in (before, during, after):
            s.close()


@pytest.mark.unit
def test_a_delayed_proxy_holds_the_request_back_and_keeps_the_order(
        echo_server: tuple[str, int]) -> None:
    with FaultProxy(echo_server, delay=1.0) as proxy:
        conn = socket.create_connection(("127.0.0.1", proxy.port))
        sent = time.monotonic()
        conn.sendall(b"a")
        conn.sendall(b"b")
        received = b""
        conn.settimeout(10)
        while len(received) < 2:
            received += conn.recv(16)
        assert received == b"ab"
        assert time.monotonic() - sent >= 1.0  # a lower bound: the proxy held it back
        proxy.delay = 0.0
        assert exchange(conn, b"c") == b"c"
        conn.close()


# ---- the docs writer, the picture, the count ----------------------------------------------------


def verdict(drill: str, recovery: float) -> Verdict:
    return Verdict(drill=drill, target="local", vms=5, ok=True, fault_seconds=10.0,
                   recovery_seconds=recovery, leader_changes_in_fault=0,
                   fault={"churn pod deletions": 3, "churn VMs created": 2,
                          "churn VMs deleted": 1})


@pytest.mark.unit
def test_the_docs_table_keeps_one_row_per_drill_the_newest() -> None:
    from neonvm.drills.record import row

    text = f"intro\n{BEGIN}\n{END}\noutro\n"
    text = write(text, "slow-api", row(verdict("slow-api", 2.0), "neonvm drill slow-api", None))
    text = write(text, "etcd-outage", row(verdict("etcd-outage", 4.0), "neonvm drill etcd-outage",
                                          "drill-etcd-outage.svg"))
    text = write(text, "slow-api", row(verdict("slow-api", 3.5), "neonvm drill slow-api", None))
    rows = [line for line in text.splitlines() if line.startswith("| ") and "PASS" in line]
    assert [r.split("|")[1].strip() for r in rows] == ["etcd-outage", "slow-api"]
    assert "| 3.5 |" in rows[1] and "| 2.0 |" not in text
    assert "[svg](drill-etcd-outage.svg)" in rows[0]
    assert text.startswith("intro\n") and text.endswith(f"{END}\noutro\n")
    with pytest.raises(ValueError):
        write("no block here", "slow-api", rows[0])


@pytest.mark.unit
def test_the_timeline_picture_shows_the_fault_the_leaders_and_every_event() -> None:
    tl = Timeline("neonvm drill test", vms=3, origin=100.0)
    tl.faults.append((102.0, 110.0, "locks' etcd stopped"))
    tl.leaders = [(100.0, "replica-0", 1), (105.0, None, None), (106.0, "replica-1", 2)]
    tl.events += [(103.0, "termination", "vm-0-a"), (104.0, "plan", "vm-0: vm-0-b"),
                  (104.5, "pod created", "vm-0-b"), (111.0, "gate lifted", "vm-0-b"),
                  (107.0, "lock hand-off", "ns/vm-0: replica-0 -> replica-1")]
    tl.end = 115.0
    svg = render_svg(tl)
    root = ET.fromstring(svg)  # well-formed
    texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "fault: locks' etcd stopped" in texts
    assert "1 leader change(s)" in texts
    for lane in ("plan (1)", "pod created (1)", "gate lifted (1)", "termination (1)",
                 "lock hand-off (1)"):
        assert lane in texts
    titles = [t.text for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert "no leader" in titles and "replica-1 (epoch 2)" in titles


@pytest.mark.unit
def test_leader_changes_in_the_fault_count_new_holders_and_new_epochs_only_inside_it() -> None:
    log = LeaderLog(changes=[(0.0, "a", 1), (5.0, None, None), (6.0, "a", 1), (7.0, "a", 2),
                             (8.0, "b", 3), (20.0, "c", 4)])
    assert _changes_between(log, 4.0, 10.0) == 2  # a/1 -> a/2 -> b/3; the gap is not one
    assert _changes_between(log, 0.0, 30.0) == 3
    assert _changes_between(log, 9.0, 19.0) == 0
    assert LocalTarget.index_of("replica-2-12345") == 2
    assert LocalTarget.index_of("neonvm-controller-abc_x") is None


@pytest.mark.unit
def test_write_docs_is_refused_for_drills_outside_the_infrastructure_table(
        tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["drill", "kill-leader", "--state-dir",
                                       str(tmp_path), "--write-docs"])
    assert result.exit_code == 2 and "infrastructure drills only" in result.output


# ---- the drills, short, against the session's control plane -----------------------------------


@pytest.fixture
def drill_replicas(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """Replicas a drill starts in the session cluster are stopped afterwards."""
    yield cluster
    for i in range(3):
        cluster.stop_component(f"controller-{i}")


def run_drill_cli(cluster: LocalCluster, tmp_path: Path, *args: str, churned: bool = True
                  ) -> dict[str, Any]:
    """Run one drill by its CLI; it passes, and the churn went on during the fault
    (``churned``; not while the API server itself is down)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_FAULTS")}
    svg = tmp_path / "timeline.svg"
    result = CliRunner().invoke(main, ["drill", *args, "--state-dir", str(cluster.state_dir),
                                       "--vms", "5", "--replicas", "3", "--timeout", "180",
                                       "--churn-interval", "2", "--timeline", str(svg),
                                       "-o", "json"], env=env, catch_exceptions=False)
    out: dict[str, Any] = json.loads(result.stdout)
    assert result.exit_code == 0, out["failures"]
    assert out["ok"] and out["duplicates"] == 0 and out["duplicates_loose"] == 0
    assert out["watch"]["unexpected_deletions"] == []
    assert out["recovery_seconds"] is not None, "not every VM converged after the fault"
    if churned:
        assert out["fault"]["churn VMs created"] > 0
        assert out["fault"]["churn pod deletions"] > 0
    assert out["check"]["ok"]
    root = ET.fromstring(svg.read_text())
    texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "fault: " in texts
    return out


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.long
def test_the_locks_etcd_stopped_for_a_while_under_churn_then_every_vm_converges(
        drill_replicas: LocalCluster, tmp_path: Path) -> None:
    out = run_drill_cli(drill_replicas, tmp_path, "etcd-outage", "--outage-seconds", "10")
    assert out["fault"]["locks-etcd down_s"] >= 10


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.long
def test_a_slow_api_server_changes_no_leader_and_every_vm_converges(
        drill_replicas: LocalCluster, tmp_path: Path) -> None:
    out = run_drill_cli(drill_replicas, tmp_path, "slow-api", "--slow-seconds", "30")
    assert out["fault"]["latency_s"] == 1.5
    assert out["leader_changes_in_fault"] == 0


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("drill", ["partition-etcd", "partition-api"])
def test_the_leader_cut_off_one_server_but_not_the_other_does_no_harm_and_all_converge(
        drill_replicas: LocalCluster, tmp_path: Path, drill: str) -> None:
    out = run_drill_cli(drill_replicas, tmp_path, drill, "--partition-seconds", "10")
    assert out["fault"]["victim"].endswith("(leader)")
    assert out["fault"]["cut_s"] >= 10


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.long
def test_the_api_server_restarted_under_churn_then_every_vm_converges(
        drill_replicas: LocalCluster, tmp_path: Path) -> None:
    out = run_drill_cli(drill_replicas, tmp_path, "apiserver-restart", churned=False)
    assert out["fault"]["kube-apiserver down_s"] > 0
    assert out["fault"]["pods deleted to disturb"] > 0


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.long
def test_one_member_of_a_3_member_locks_etcd_killed_keeps_the_term_and_all_converge(
        drill_replicas: LocalCluster, tmp_path: Path) -> None:
    """Two members keep quorum: the same term goes on through the kill (no leader
    change), and the locks the checker reads are the 3-member etcd's."""
    out = run_drill_cli(drill_replicas, tmp_path, "etcd-member-kill", "--outage-seconds", "10")
    assert out["fault"]["member killed"].startswith("m0")
    assert out["fault"]["member down_s"] >= 10
    assert out["fault"]["member answering again"] is True
    assert out["leader_changes_in_fault"] == 0
