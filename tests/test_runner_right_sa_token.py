"""The runner's side of asking with a projected ServiceAccount token (neonvm/runner/right.py,
``--rights-token-file``): the file is sent as the bearer as it is, re-read at every ask
(the kubelet rotates it), and a real runner whose pod has no scaling token starts QEMU on
the leader's grant. Tokens are minted for a real pod on the session's API server and
reviewed by the shipped endpoint (tests/support/rights_sa_token.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from neonvm.api.rights import RIGHTS_TOKEN_FILE_ENV
from neonvm.dev.cluster import free_port
from neonvm.runner.right import RightKeeper, boottime, http_post, right_config
from tests.guest.build import GuestImage
from tests.support import wait_for
from tests.support.rights_sa_token import ReviewingLeader, mint, pod, service_account
from tests.support.runner_right import qemu_of, tiny_guest_spec

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def leader(controller_api: client.ApiClient) -> Iterator[ReviewingLeader]:
    served = ReviewingLeader(controller_api)
    yield served
    served.close()


def test_each_ask_sends_the_token_file_as_it_is_now(
        api: client.ApiClient, namespace: str, leader: ReviewingLeader, tmp_path: Path) -> None:
    """Rotated between asks, the new token is sent (and reviewed); a missing file sends
    nothing and grants nothing."""
    service_account(api, namespace)
    uid = pod(api, namespace, "vm-p")
    leader.show(namespace, "vm", "vm-p", uid)
    token_file = tmp_path / "token"
    token_file.write_text(mint(api, namespace, "vm-p", uid))
    keeper = RightKeeper(right_config(f"http://127.0.0.1:{leader.server.port}", 30.0,
                                      namespace, "vm", uid, None, token_file),
                         boottime, http_post)
    keeper.ask_once()
    first = keeper.deadline
    assert first is not None and leader.reviewer.reviews == 1
    token_file.write_text(mint(api, namespace, "vm-p", uid) + "\n")  # the kubelet's rotation
    keeper.ask_once()
    assert keeper.deadline is not None and keeper.deadline > first
    assert leader.reviewer.reviews == 2 and leader.answered(200) == 2
    token_file.unlink()
    before = keeper.deadline
    keeper.ask_once()
    assert keeper.deadline == before and leader.answered(200) + leader.answered(401) == 2


def test_a_runner_with_only_a_projected_token_starts_qemu_on_its_grant(
        api: client.ApiClient, namespace: str, leader: ReviewingLeader, tmp_path: Path,
        test_guest: GuestImage) -> None:
    """The chart's default install: no scaling token Secret, the runner asks with
    ``NEONVM_RIGHTS_TOKEN_FILE`` (as the pod sets it) and QEMU starts once granted."""
    service_account(api, namespace)
    uid = pod(api, namespace, "vm-p")
    leader.show(namespace, "vm", "vm-p", uid)
    token_file = tmp_path / "token"
    token_file.write_text(mint(api, namespace, "vm-p", uid))
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(tiny_guest_spec(test_guest)))
    work_dir = tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
    env.update({"NEONVM_VM_NAME": "vm", "NEONVM_VM_NAMESPACE": namespace,
                RIGHTS_TOKEN_FILE_ENV: str(token_file)})
    args = [sys.executable, "-m", "neonvm.runner.main", "--spec-file", str(spec_file),
            "--port", str(free_port()), "--listen-address", "127.0.0.1",
            "--work-dir", str(work_dir), "--disks-dir", str(tmp_path / "disks"),
            "--termination-log", str(tmp_path / "termination-log"), "--pod-uid", uid,
            "--rights-url", f"http://127.0.0.1:{leader.server.port}", "--right-seconds", "30"]
    log = tmp_path / "runner.log"
    with (tmp_path / "console.log").open("wb") as out, log.open("wb") as err:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=err, cwd=REPO)
    try:
        wait_for(lambda: "QEMU started" in log.read_text(errors="replace")
                 or proc.poll() is not None, timeout=120, what="QEMU to start")
        assert proc.poll() is None, log.read_text(errors="replace")
        assert leader.answered(200) >= 1 and leader.answered(401) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        for pid in qemu_of(work_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
