"""The independent guest counter (neonvm/drills/guests.py): which host processes are a
VM's guests, when each ran or may have run, and the moments with two guests of one VM.

Pure logic on fixture /proc trees and histories; the counter is used for real by the
real-node self-fencing drills (tests/test_real_node_fencing.py, docs/drills.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from neonvm.drills import guests
from neonvm.drills.guests import Guest, GuestCounter, History, Interval

pytestmark = pytest.mark.unit

TCK = guests.CLK_TCK
NODE_A = "/neonvm-aaaa1111"
NODE_B = "/neonvm-bbbb2222"


def write_proc(root: Path, pid: int, *, comm: str = "qemu-system-x86", state: str = "S",
               start: float = 100.0, cpu: float = 1.0, vm: str | None = "vm-0",
               namespace: str = "ns", name_arg: str | None = None, pod_uid: str = "uid-1",
               right: str | None = "10", node: str = NODE_A) -> None:
    """One process directory as /proc has it: stat, environ, cmdline, cgroup."""
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    ticks = int(cpu * TCK)
    fields = [state, "1", str(pid), str(pid), "0", "-1", "4194560", "0", "0", "0", "0",
              str(ticks), "0", "0", "0", "20", "0", "3", "0", str(int(start * TCK))]
    fields += ["0"] * 30
    (d / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)}\n")
    env = {"PATH": "/usr/bin"}
    if vm is not None:
        env |= {"NEONVM_VM_NAME": vm, "NEONVM_VM_NAMESPACE": namespace,
                "NEONVM_POD_UID": pod_uid}
    if right is not None:
        env |= {"NEONVM_RIGHTS_URL": "http://10.0.0.1:8443", "NEONVM_RIGHT_SECONDS": right}
    (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
    guest_name = name_arg if name_arg is not None else f"guest={vm or 'x'}"
    (d / "cmdline").write_bytes(b"\0".join(
        a.encode() for a in ["/usr/bin/qemu-system-x86_64", "-name", guest_name,
                             "-machine", "q35"]) + b"\0")
    (d / "cgroup").write_text(f"12:freezer:{node}/kubepods/pod{pod_uid}/abc\n"
                              f"11:memory:{node}/kubepods/pod{pod_uid}/abc\n")


def set_state(root: Path, pid: int, state: str) -> None:
    stat = root / str(pid) / "stat"
    raw = stat.read_text()
    head, rest = raw[:raw.rindex(")") + 2], raw[raw.rindex(")") + 2:].split(" ", 1)
    stat.write_text(head + state + " " + rest[1])


def guest(pid: int = 1, start: float = 0.0, vm: str = "ns/vm-0",
          right: float | None = 10.0) -> Guest:
    return Guest(pid=pid, start=start, vm=vm, pod_uid=f"uid-{pid}", node=NODE_A,
                 right_seconds=right)


def history(g: Guest, *seen: tuple[float, str], gone_at: float | None = None) -> History:
    h = History(g)
    for at, state in seen:
        h.observe(at, state)
    if gone_at is not None:
        h.observe(gone_at, None)
    return h


# ---- which processes are guests ------------------------------------------------------------


def test_a_runners_qemu_is_a_guest_of_its_vm_on_its_node_with_its_right(tmp_path: Path
                                                                        ) -> None:
    write_proc(tmp_path, 41, start=123.5, pod_uid="p-41", node=NODE_B)
    proc = guests.read_stat(tmp_path, 41)
    assert proc is not None and proc.state == "S" and proc.start == pytest.approx(123.5)
    g = guests.identify(tmp_path, proc)
    assert g == Guest(pid=41, start=proc.start, vm="ns/vm-0", pod_uid="p-41", node=NODE_B,
                      right_seconds=10.0)


def test_processes_that_are_not_a_runners_qemu_are_not_guests(tmp_path: Path) -> None:
    write_proc(tmp_path, 1, comm="python3")                   # the runner itself
    write_proc(tmp_path, 2, vm=None)                          # a QEMU started by hand
    write_proc(tmp_path, 3, name_arg="guest=someone-else")    # env and argv disagree
    for pid in (1, 2, 3):
        proc = guests.read_stat(tmp_path, pid)
        assert proc is not None
        assert guests.identify(tmp_path, proc) is None


def test_a_guest_without_a_rights_url_has_no_deadline(tmp_path: Path) -> None:
    write_proc(tmp_path, 5, right=None)
    proc = guests.read_stat(tmp_path, 5)
    assert proc is not None
    g = guests.identify(tmp_path, proc)
    assert g is not None and g.right_seconds is None


def test_a_qemu_that_is_dying_is_gone_not_running(tmp_path: Path) -> None:
    """A stopped QEMU that is SIGKILLed shows R (or D) for a moment on its way out: with
    SIGKILL pending, or in exit() (PF_EXITING), it runs no guest code and counts as gone."""
    write_proc(tmp_path, 8, state="R")
    (tmp_path / "8" / "status").write_text("Name:\tqemu\nSigPnd:\t0000000000000000\n"
                                           "ShdPnd:\t0000000000000100\n")
    proc = guests.read_stat(tmp_path, 8)
    assert proc is not None and proc.state == "X"
    (tmp_path / "8" / "status").write_text("SigPnd:\t0000000000000000\n"
                                           "ShdPnd:\t0000000000004000\n")  # SIGTERM only
    proc = guests.read_stat(tmp_path, 8)
    assert proc is not None and proc.state == "R"
    exiting = guests.parse_stat(9, "9 (qemu-system-x86) R 1 9 9 0 -1 4194564 "
                                + " ".join(["0"] * 12) + " 500 0 0\n")
    assert exiting is not None and exiting.state == "X"
    h = History(guest(9))
    h.observe(1.0, "T")
    h.observe(2.0, "X")
    assert guests.classify(h, now=3.0) == [Interval(0.0, 1.0, True),
                                          Interval(1.0, 2.0, False)]


def test_a_command_name_with_spaces_and_parentheses_is_parsed() -> None:
    proc = guests.parse_stat(7, "7 (a) b (c) R " + " ".join(["0"] * 18) + " 500 0 0\n")
    assert proc is not None and proc.comm == "a) b (c" and proc.state == "R"
    assert proc.start == pytest.approx(500 / TCK)
    assert guests.parse_stat(7, "garbage") is None


# ---- when a guest ran or may have run ------------------------------------------------------


def test_a_running_guest_runs_from_its_start_until_it_is_seen_gone() -> None:
    h = history(guest(start=1.0), (2.0, "S"), (3.0, "R"), gone_at=5.0)
    assert guests.classify(h, now=9.0) == [Interval(1.0, 5.0, True)]


def test_a_frozen_guest_may_run_until_first_seen_stopped_plus_its_right() -> None:
    h = history(guest(start=0.0, right=10.0), (1.0, "S"), (2.0, "T"), (30.0, "T"))
    assert guests.classify(h, now=40.0) == [Interval(0.0, 2.0, True),
                                           Interval(2.0, 12.0, False)]


def test_a_frozen_guest_without_a_right_may_run_while_it_exists() -> None:
    h = history(guest(right=None), (1.0, "T"), gone_at=50.0)
    assert guests.classify(h, now=60.0) == [Interval(0.0, 1.0, True),
                                           Interval(1.0, 50.0, False)]


def test_a_thawed_guest_runs_again_from_the_last_sample_that_saw_it_stopped() -> None:
    h = history(guest(right=10.0), (1.0, "T"), (25.0, "T"), (25.01, "R"), gone_at=25.02)
    assert guests.classify(h, now=30.0) == [
        Interval(0.0, 1.0, True), Interval(1.0, 11.0, False), Interval(25.0, 25.02, True)]


def test_many_samples_in_one_state_keep_the_first_and_the_latest() -> None:
    h = history(guest(), *[(float(t), "S") for t in range(1, 100)])
    assert [s[0] for s in h.seen] == [1.0, 99.0]


# ---- two guests of one VM --------------------------------------------------------------------


def test_a_replacement_after_the_frozen_guests_deadline_is_no_overlap() -> None:
    old = history(guest(1, right=10.0), (1.0, "S"), (2.0, "T"), (40.0, "T"))
    new = history(guest(2, start=13.0), (14.0, "S"), (40.0, "S"))
    assert guests.overlaps([old, new], now=41.0) == []


def test_a_replacement_within_the_frozen_guests_right_may_overlap() -> None:
    old = history(guest(1, right=10.0), (2.0, "T"))
    new = history(guest(2, start=8.0), (9.0, "S"))
    [o] = guests.overlaps([old, new], now=20.0)
    assert (o.vm, o.start, o.end, o.pids, o.running) == ("ns/vm-0", 8.0, 12.0, (1, 2), False)


def test_an_old_guest_that_runs_after_the_thaw_beside_the_replacement_is_a_running_overlap(
) -> None:
    old = history(guest(1, right=10.0), (2.0, "T"), (30.0, "T"), (30.02, "R"), gone_at=30.03)
    new = history(guest(2, start=14.0), (15.0, "S"), (31.0, "S"))
    [o] = guests.overlaps([old, new], now=32.0)
    assert o.running and o.pids == (1, 2)
    assert (o.start, o.end) == (30.0, 30.03)
    assert o.seconds == pytest.approx(0.03)


def test_guests_of_different_vms_never_overlap() -> None:
    a = history(guest(1, vm="ns/a"), (1.0, "S"))
    b = history(guest(2, vm="ns/b"), (1.0, "S"))
    assert guests.overlaps([a, b], now=5.0) == []


# ---- the sampler on a fixture /proc -----------------------------------------------------------


def test_the_counter_finds_guests_in_scope_and_reports_two_running_at_once(tmp_path: Path
                                                                        ) -> None:
    clock = [1000.0]
    write_proc(tmp_path, 10, start=900.0, node=NODE_A)
    write_proc(tmp_path, 11, start=900.0, vm="other", node="/elsewhere")  # out of scope
    write_proc(tmp_path, 12, comm="bash")
    counter = GuestCounter(guests.in_cgroup_roots({NODE_A: "a", NODE_B: "b"}),
                           proc_root=tmp_path, clock=lambda: clock[0])
    changes: list[tuple[float, int, str | None]] = []
    counter.on_change(lambda at, h, state: changes.append((at, h.guest.pid, state)))
    counter.scan_now()
    assert [g.pid for g in counter.running()] == [10]
    clock[0] = 1001.0
    set_state(tmp_path, 10, "T")                     # frozen
    counter.sample_known()
    assert counter.running() == []
    clock[0] = 1005.0
    write_proc(tmp_path, 20, start=1004.0, node=NODE_B, pod_uid="uid-2")  # the replacement
    counter.scan_now()
    clock[0] = 1019.99
    counter.sample_known()                           # still frozen
    clock[0] = 1020.0
    set_state(tmp_path, 10, "R")                     # thawed, 19 s after the freeze
    counter.sample_known()
    clock[0] = 1020.05
    (tmp_path / "10" / "stat").unlink()             # killed by its runner
    counter.sample_known()
    report = counter.report(now=1021.0)
    assert changes == [(1000.0, 10, "S"), (1001.0, 10, "T"), (1005.0, 20, "S"),
                       (1020.0, 10, "R"), (1020.05, 10, None)]
    assert sorted(g.guest.pid for g in report.guests) == [10, 20]
    assert [(o.start, o.end, o.running) for o in report.overlaps] == [
        (1004.0, 1011.0, False), (1019.99, 1020.05, True)]
    assert len(report.running_overlaps) == 1
    assert "1 running" in report.summary()


def test_a_pid_reused_by_another_process_is_the_guest_gone(tmp_path: Path) -> None:
    clock = [10.0]
    write_proc(tmp_path, 10, start=5.0)
    counter = GuestCounter(proc_root=tmp_path, clock=lambda: clock[0])
    counter.scan_now()
    write_proc(tmp_path, 10, start=9.0, comm="sh")
    clock[0] = 11.0
    counter.sample_known()
    [h] = counter.histories()
    assert h.gone_at == 11.0
