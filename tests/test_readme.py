"""The README's "Using it" block runs as written.

The commands are read from the README itself, so the two cannot drift apart: each line of
the block's ``sh`` fence runs in order, in one bash session, from the ``neonvm`` entry
point on ``PATH`` (the block's own ``source .venv/bin/activate``), against a cluster from
``neonvm dev up`` in a private state directory. Every command must exit 0, as the README's
exit-code table says for success. A line whose comment says Ctrl-C stops it runs until it
has led a term (``neonvm leader show`` names it), then gets SIGINT, as a user would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BLOCK = re.compile(r"^## Using it\n.*?```sh\n(?P<body>.*?)```", re.S | re.M)
MARK = "__neonvm_readme_rc__"
EVAL = re.compile(r'eval "\$\((.*)\)"')


@dataclass(frozen=True)
class Step:
    command: str
    interrupted: bool
    """The README says Ctrl-C stops it: run until it leads, then SIGINT."""


def readme_steps(text: str) -> list[Step]:
    """The commands of the first ``sh`` block under "## Using it", comments stripped."""
    found = BLOCK.search(text)
    if found is None:
        raise AssertionError('README.md has no ```sh block under "## Using it"')
    steps = []
    for line in found["body"].splitlines():
        command, _, comment = line.partition("  #")
        if command.strip():
            steps.append(Step(command.strip(), "Ctrl-C" in comment))
    return steps


def _script(steps: list[Step]) -> str:
    """One bash script: each step, then a marker line with its exit status. A step that
    runs until Ctrl-C goes to the background; once ``neonvm leader show`` names a
    holder, it gets SIGINT and its exit status is the step's. ``eval "$(X)"`` fails when
    X does."""
    out = ["set -u"]
    for i, step in enumerate(steps):
        if step.interrupted:
            out += [
                f'{step.command} > "$NEONVM_STATE_DIR/readme-step-{i}.log" 2>&1 &',
                "pid=$!",
                "for _ in $(seq 120); do",
                "  neonvm leader show -o json 2>/dev/null | grep -Eq '\"holder\": ?\"' "
                "&& break",
                "  sleep 1",
                "done",
                "kill -INT $pid; wait $pid",
            ]
            out.append(f'echo "{MARK} {i} $?"')
        elif (inner := EVAL.fullmatch(step.command)) is not None:
            # eval's own status hides a failing $(...): take the inner command's first.
            out += [f'__out="$({inner[1]})"; __rc=$?', 'eval "$__out" || __rc=$?',
                    f'echo "{MARK} {i} $__rc"']
        else:
            out += [step.command, f'echo "{MARK} {i} $?"']
    return "\n".join(out) + "\n"


def run_block(steps: list[Step], state_dir: Path, timeout: float) -> dict[int, int]:
    """Run the steps in one bash from the repository root; their exit statuses by index
    (a step whose marker never printed is absent: the session died before it)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "KUBECONFIG") and not k.startswith("NEONVM_")}
    env["NEONVM_STATE_DIR"] = str(state_dir)
    done = subprocess.run(["bash", "-c", _script(steps)], cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    sys.stdout.write(done.stdout[-6000:])
    codes = {}
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            _, index, code = line.split()
            codes[int(index)] = int(code)
    return codes


@pytest.mark.unit
def test_the_block_is_read_from_the_readme() -> None:
    steps = readme_steps(README.read_text())
    commands = [s.command for s in steps]
    assert commands[0] == "source .venv/bin/activate"
    assert 'eval "$(neonvm dev env)"' in commands
    assert [s.command for s in steps if s.interrupted] == ["neonvm controller run"]
    assert commands[-1] == "neonvm dev down"


@pytest.mark.unit
def test_a_misspelled_command_is_a_failing_step(tmp_path: Path) -> None:
    """What the real run below relies on: a misspelled line of the block fails its step
    (``neonvm lock list`` is a usage error, exit 2), read from an edited README."""
    text = README.read_text().replace("neonvm locks list", "neonvm lock list", 1)
    steps = [s for s in readme_steps(text)
             if s.command in ("source .venv/bin/activate", "neonvm lock list")]
    if not (REPO / ".venv" / "bin" / "activate").is_file():
        pytest.skip("no .venv in the repository (bootstrap with NEONVM_VENV elsewhere)")
    assert run_block(steps, tmp_path / "state", timeout=120) == {0: 0, 1: 2}


@pytest.mark.nodes
def test_every_command_of_the_using_it_block_exits_as_the_readme_says(tmp_path: Path
                                                                       ) -> None:
    if not (REPO / ".venv" / "bin" / "activate").is_file():
        pytest.skip("no .venv in the repository (bootstrap with NEONVM_VENV elsewhere)")
    state = tmp_path / "state"
    neonvm = str(Path(sys.executable).with_name("neonvm"))
    env = {**os.environ, "NEONVM_STATE_DIR": str(state)}
    up = subprocess.run([neonvm, "dev", "up", "--ports", "free"], env=env, text=True,
                        capture_output=True, timeout=600)
    assert up.returncode == 0, up.stderr[-3000:]
    steps = readme_steps(README.read_text())
    try:
        codes = run_block(steps, state, timeout=1500)
    finally:
        subprocess.run([neonvm, "dev", "down"], env=env, capture_output=True, timeout=300)
    failed = {steps[i].command: codes.get(i) for i in range(len(steps)) if codes.get(i) != 0}
    assert failed == {}, f"steps that did not exit 0 (None: never reached): {failed}"
