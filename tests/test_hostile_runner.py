"""The controller's runner client against hostile runners (issue 28, item 1).

A VM's owner chooses its runner image, so the "runner" the controller calls for live
scaling may answer anything. Each attack here is a real server on loopback
(:mod:`tests.support.hostile_runners`): a body of 1 GiB, an answer that trickles in a byte at a
time, a redirect to another server, answers that are not what a runner says. Each must
fail without costing the controller more than one bounded exchange: the body is not read
past 64 KiB (the process does not grow), the exchange ends at its deadline however the
bytes trickle, a redirect is never followed, and a malformed answer is an error, never
a crash. On the local cluster, a controller with two workers keeps converging an honest
VM while four VMs' runners attack it, and each of those VMs says why in its Degraded
condition. docs/security.md, "The runner as seen by the controller".
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from neonvm.controller.observe import Snapshot
from neonvm.controller.scaling import RunnerScaling, ScalingError
from tests.support import wait_for
from tests.support.hostile_runner import _pod_running, condition, scalable_vm
from tests.support.hostile_runners import GIB, HonestRunner, HostileRunner, RecordingServer
from tests.support.scaling_decide import obs, scale_plan, vm

REPO = Path(__file__).resolve().parent.parent


def _scaling(url: str, look_timeout: float = 3.0) -> RunnerScaling:
    return RunnerScaling(client.ApiClient(), look_timeout=look_timeout,
                         address=lambda vm, pod: url)


def _look(scaling: RunnerScaling) -> Any:
    """One observation of a VM with a scaling plan recorded: asks the runner GET /scale."""
    v = vm(cpus_use=2, pending=scale_plan(), phase="Scaling")
    return scaling.observe(Snapshot(obs=obs(v), record=None)).obs


@pytest.fixture
def recorder() -> Iterator[RecordingServer]:
    server = RecordingServer()
    yield server
    server.close()


def hostile(attack: str, **kwargs: Any) -> HostileRunner:
    return HostileRunner(attack, **kwargs).start()


# ---- a body far over the limit -----------------------------------------------------------

RSS_PROBE = """
import json, sys
sys.path.insert(0, {repo!r})
from kubernetes import client
from neonvm.controller.observe import Snapshot
from neonvm.controller.scaling import RunnerScaling
from tests.support.scaling_decide import obs, scale_plan, vm

def hwm_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

scaling = RunnerScaling(client.ApiClient(), look_timeout=120.0,
                        address=lambda vm, pod: {url!r})
snap = Snapshot(obs=obs(vm(cpus_use=2, pending=scale_plan(), phase="Scaling")), record=None)
before = hwm_kib()
try:
    error = scaling.observe(snap).obs.runner_error
except Exception as exc:  # what the client did before it had limits, say
    error = f"raised {{type(exc).__name__}}: {{str(exc)[:200]}}"
print(json.dumps({{"before_kib": before, "after_kib": hwm_kib(), "error": str(error),
                  "misbehaving": getattr(error, "misbehaving", None)}}))
"""


@pytest.mark.unit
@pytest.mark.parametrize("attack", ["big_body", "big_body_unannounced"])
def test_a_1_gib_answer_is_not_read_past_the_limit_and_the_process_does_not_grow(
        attack: str) -> None:
    # The probe runs in a process of its own, so that its peak RSS (VmHWM) says what this
    # one exchange cost. Before the limit, the whole GiB was read (and decoded again).
    runner = hostile(attack, body_bytes=GIB)
    try:
        probe = subprocess.run(
            [sys.executable, "-c", RSS_PROBE.format(repo=str(REPO), url=runner.url)],
            capture_output=True, text=True, timeout=600, cwd=REPO)
        assert probe.returncode == 0, probe.stderr[-3000:]
        result = json.loads(probe.stdout.strip().splitlines()[-1])
        grew = (result["after_kib"] - result["before_kib"]) / 1024
        wait_for(lambda: runner.sent, 30, what="the server's count")
        print(f"{attack}: peak RSS {result['before_kib'] / 1024:.1f} MiB before the "
              f"exchange, {result['after_kib'] / 1024:.1f} MiB after (+{grew:.1f} MiB); "
              f"the server got {runner.sent[0] / (1 << 20):.1f} MiB out of 1024 before the "
              f"controller hung up; error: {result['error']}")
        assert result["misbehaving"] is True, result
        assert "over 65536" in result["error"], result
        assert runner.hung_up == [True] and runner.sent[0] < 64 << 20, runner.sent
        assert grew < 32, result
    finally:
        runner.close()


@pytest.mark.unit
def test_an_answer_of_exactly_the_limit_is_read_and_one_byte_more_is_not() -> None:
    from neonvm.controller.runner_client import RUNNER_BODY_LIMIT, runner_exchange

    for size, fits in ((RUNNER_BODY_LIMIT, True), (RUNNER_BODY_LIMIT + 1, False)):
        runner = hostile("big_body", body_bytes=size)
        try:
            if fits:
                code, body = runner_exchange("GET", f"{runner.url}/scale", None, {}, 30.0)
                assert (code, len(body)) == (200, size)
            else:
                with pytest.raises(ScalingError, match="over 65536") as raised:
                    runner_exchange("GET", f"{runner.url}/scale", None, {}, 30.0)
                assert raised.value.misbehaving
        finally:
            runner.close()


# ---- an answer that trickles in ----------------------------------------------------------


@pytest.mark.unit
def test_an_answer_that_trickles_in_ends_at_the_deadline_not_at_a_read_timeout() -> None:
    # A byte every 0.1 s never trips a per-read timeout of 1 s; the deadline is for the
    # whole exchange. The server would go on for 30 s: the controller hangs up long
    # before (the server sees its writes fail).
    runner = hostile("trickle", trickle_interval=0.1, trickle_bytes=300)
    try:
        seen = _look(_scaling(runner.url, look_timeout=1.0))
        assert seen.runner is None and seen.runner_error is not None
        assert seen.runner_error.misbehaving, seen.runner_error
        assert "not complete after 1 s" in seen.runner_error, seen.runner_error
        wait_for(lambda: runner.hung_up, 40, what="the trickle to notice the hang-up")
        assert runner.hung_up == [True] and runner.sent[0] < 300, runner.sent
    finally:
        runner.close()


# ---- a redirect --------------------------------------------------------------------------


@pytest.mark.unit
def test_a_redirect_is_an_error_and_its_target_is_never_asked(
        recorder: RecordingServer) -> None:
    # Followed, the controller would fetch any URL the VM's owner names from inside the
    # cluster and put what it learnt into the owner's own VM status.
    runner = hostile("redirect", redirect_to=recorder.url)
    try:
        seen = _look(_scaling(runner.url))
        assert seen.runner is None and seen.runner_error is not None
        assert seen.runner_error.misbehaving and "redirect (302)" in seen.runner_error
        with pytest.raises(ScalingError, match="redirect") as raised:
            _scaling(runner.url)._call("PUT", f"{runner.url}/scale", {"cpus": 2}, "t", 5.0)
        assert raised.value.misbehaving
        assert [a.method for a in runner.asked] == ["GET", "PUT"]
        assert recorder.asked == []
    finally:
        runner.close()


# ---- wrong answers -----------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("attack", ["garbage_json", "not_an_object", "wrong_types"])
def test_an_answer_that_is_not_a_runners_report_is_an_error_not_a_crash(attack: str) -> None:
    runner = hostile(attack)
    try:
        seen = _look(_scaling(runner.url))
        assert seen.runner is None and seen.runner_error is not None
        assert seen.runner_error.misbehaving, seen.runner_error
        if attack != "wrong_types":
            with pytest.raises(ScalingError, match="not a JSON object"):
                _scaling(runner.url)._call("PUT", f"{runner.url}/scale", {}, "t", 5.0)
    finally:
        runner.close()


@pytest.mark.unit
def test_an_honest_runner_is_read_as_before() -> None:
    runner = HonestRunner()
    try:
        runner.fence = {"epoch": 3, "token": 40, "seq": 1}
        runner.size = {"vcpus": 2, "memorySlots": 1, "memoryBytes": GIB}
        seen = _look(_scaling(runner.url))
        assert seen.runner_error is None and seen.runner is not None
        assert (seen.runner.fence, seen.runner.vcpus, seen.runner.memory_bytes) == (
            (3, 40, 1), 2, GIB)
    finally:
        runner.close()


@pytest.mark.unit
def test_a_runner_nobody_listens_for_is_unreachable_not_misbehaving() -> None:
    seen = _look(_scaling("http://127.0.0.1:1"))
    assert seen.runner_error is not None and not seen.runner_error.misbehaving


# ---- on the local cluster: the attacks against a running controller --------------------


@pytest.mark.cluster
def test_a_put_answered_with_a_redirect_ends_the_reconcile_degraded_after_one_put(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        recorder: RecordingServer) -> None:
    # GET /scale answers as a runner does; PUT /scale answers 307 elsewhere.
    from tests.support.authority import StaticAuthority
    from tests.support.scaling_controller import _running_on, set_use, status_of

    runner = HonestRunner(put_redirect=recorder.url)
    try:
        reconciler = _running_on(runner, api, controller_api, namespace, "sly",
                                 token_sync_seconds=3600.0)
        set_use(api, namespace, "sly", 2, 2)
        result = reconciler.reconcile(f"{namespace}/sly", StaticAuthority(epoch=1, token=10),
                                      direct_first=True)
        assert result.stuck == "RunnerMisbehaving" and runner.puts == 1, (result, runner.puts)
        assert recorder.asked == []
        status = status_of(api, namespace, "sly")
        assert status["pendingScale"]["seq"] == 1, status
        degraded = condition(api, namespace, "sly", "Degraded")
        assert degraded is not None and degraded["reason"] == "RunnerMisbehaving", degraded
        assert "redirect (307)" in degraded["message"], degraded
    finally:
        runner.close()


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.cluster
def test_hostile_runners_fail_while_an_honest_vm_keeps_converging(
        cluster: Any, api: client.ApiClient, namespace: str, tmp_path: Path,
        recorder: RecordingServer) -> None:
    from tests.support import replica_group
    from tests.support.scaling_controller import set_use, status_of

    attacks = {
        "big": hostile("big_body", body_bytes=GIB),
        "trickle": hostile("trickle", trickle_interval=0.5, trickle_bytes=1_000_000),
        "redirect": hostile("redirect", redirect_to=recorder.url),
        "garbage": hostile("wrong_types"),
    }
    honest = HonestRunner()
    names = [*attacks, "honest"]
    try:
        with replica_group(cluster, api, namespace, tmp_path / "replicas",
                           workers=2) as replicas:
            replica = replicas.start("r0")
            for name, runner in attacks.items():
                scalable_vm(api, namespace, name, runner.port)
            scalable_vm(api, namespace, "honest", honest.port)
            for name in names:
                wait_for(lambda n=name: _pod_running(api, namespace, n), 180,  # type: ignore[misc]
                         what=f"{name}'s pod started")
                wait_for(lambda n=name: status_of(api, namespace, n).get("phase") == "Running",
                         120, what=f"{name} Running")
            for name in names:
                set_use(api, namespace, name, 2, 2)
            for name in attacks:
                wait_for(lambda n=name: (c := condition(api, namespace, n, "Degraded"))
                         is not None and c["status"] == "True"
                         and c["reason"] == "RunnerMisbehaving", 240,
                         what=f"{name} Degraded: RunnerMisbehaving")
            wait_for(lambda: (s := status_of(api, namespace, "honest")).get("cpus") == 2
                     and s.get("memorySize") == "2Gi" and "pendingScale" not in s, 240,
                     what="the honest VM at 2 vCPUs, 2Gi")
            # The attacks go on; the honest VM keeps converging.
            set_use(api, namespace, "honest", 1, 1)
            wait_for(lambda: (s := status_of(api, namespace, "honest")).get("cpus") == 1
                     and s.get("memorySize") == "1Gi" and "pendingScale" not in s, 240,
                     what="the honest VM back at 1 vCPU, 1Gi")
            rss = peak_rss_mib(replica.pid)
            asked = {name: len(r.asked) for name, r in attacks.items()}
            for name in attacks:
                degraded = condition(api, namespace, name, "Degraded")
                print(f"{name}: {asked[name]} requests; Degraded: {degraded}")
                status = status_of(api, namespace, name)
                assert status["pendingScale"]["seq"] == 1, status  # kept, asked with backoff
            print(f"controller replica peak RSS {rss:.1f} MiB; the redirect's target was "
                  f"asked {len(recorder.asked)} times")
            assert recorder.asked == []
            assert max(attacks["big"].sent) < 64 << 20, attacks["big"].sent
            assert replica.running()
            assert rss < 512, rss  # the chart's memory limit for the controller
    finally:
        for runner in attacks.values():
            runner.close()
        honest.close()
