"""``neonvm drill power-off`` and its siblings: the self-fencing drills on two real nodes
as CLI commands (neonvm/cli/drill.py; the drills are neonvm/drills/fencing.py, run for
real by the opt-in tests/test_real_node_fencing.py; docs/drills.md).

Here only the command line: which drill each command runs, with which flags, and its exit
status; :func:`neonvm.drills.fencing.run_drills` is replaced by a recorder (pure logic).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from neonvm.cli import main
from neonvm.drills import fencing

pytestmark = pytest.mark.unit


class Recorder:
    """Stands in for :func:`fencing.run_drills`: records its arguments, returns ``ok``."""

    def __init__(self, ok: bool) -> None:
        self.ok = ok
        self.calls: list[tuple[Path, fencing.Options]] = []

    def __call__(self, state_dir: Path, opts: fencing.Options, say: Any
                 ) -> tuple[list[fencing.Result], dict[str, Any]]:
        self.calls.append((state_dir, opts))
        results = [fencing.Result(d, ok=self.ok, node="neonvm-real-0") for d in opts.drills]
        return results, fencing.summary(results)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder(ok=True)
    monkeypatch.setattr(fencing, "run_drills", rec)
    monkeypatch.setattr(fencing, "install_sigterm", lambda: None)
    return rec


@pytest.mark.parametrize(("command", "drill"), [
    ("power-off", "power-off"), ("partition-node", "partition"),
    ("kubelet-crash", "kubelet-crash"), ("freeze-thaw", "freeze-thaw")])
def test_each_command_runs_its_drill_at_the_default_deadline_with_three_replicas_and_leader_kills(
        recorder: Recorder, tmp_path: Path, command: str, drill: str) -> None:
    out = CliRunner().invoke(main, ["drill", command, "--state-dir", str(tmp_path),
                                    "--real-nodes", "2"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    [(state_dir, opts)] = recorder.calls
    assert state_dir == tmp_path
    assert opts.drills == [drill]
    assert (opts.right_seconds, opts.replicas, opts.leader_kill, opts.repeat) == (
        30.0, 3, True, 1)


def test_flags_reach_the_drill_and_json_output_carries_each_run(
        recorder: Recorder, tmp_path: Path) -> None:
    out = CliRunner().invoke(main, [
        "drill", "power-off", "--state-dir", str(tmp_path), "--repeat", "20",
        "--right-seconds", "20", "--replicas", "2", "--seed", "7", "--no-leader-kill",
        "--fresh-vm", "--reuse-images", "--timeline", str(tmp_path / "t.svg"), "-o", "json"],
        catch_exceptions=False)
    assert out.exit_code == 0, out.output
    [(_, opts)] = recorder.calls
    assert opts == fencing.Options(drills=["power-off"], repeat=20, right_seconds=20.0,
                                   replicas=2, seed=7, leader_kill=False, fresh_vm=True,
                                   reuse_images=True, timeline=tmp_path / "t.svg")
    assert '"drill": "power-off"' in out.output and '"runs"' in out.output


def test_a_failed_run_exits_1(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(fencing, "run_drills", Recorder(ok=False))
    monkeypatch.setattr(fencing, "install_sigterm", lambda: None)
    out = CliRunner().invoke(main, ["drill", "kubelet-crash", "--state-dir", str(tmp_path)],
                             catch_exceptions=False)
    assert out.exit_code == 1
    assert "kubelet-crash on neonvm-real-0: FAIL" in out.output


def test_only_two_real_nodes_are_drilled_and_the_list_names_the_commands(
        recorder: Recorder) -> None:
    out = CliRunner().invoke(main, ["drill", "power-off", "--real-nodes", "3"])
    assert out.exit_code == 2 and not recorder.calls
    listed = CliRunner().invoke(main, ["drill", "list"]).output
    for name in ("power-off", "partition-node", "kubelet-crash", "freeze-thaw"):
        assert f"{name}  (two real nodes)" in listed
