"""The controller's ``GET /status`` (the AccelerationUnavailable report) against hostile runners.

The runner is the VM owner's to choose, so the ``/status`` it answers may be an attack.
The GET has the bounds of the controller's runner client (docs/security.md, "The runner
as seen by the controller"): one deadline for the whole exchange however the bytes
trickle in, a body cap, and no redirects. A fetch runs in the background
(:class:`~neonvm.controller.acceleration.RunnerReports`), one of a few at once: a
trickling runner must free its slot at the deadline, not hold it for as long as it
likes. Real servers on loopback (:mod:`tests.support.hostile_runners`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from neonvm.controller.acceleration import HTTPRunnerStatus, RunnerReports
from neonvm.controller.actions import PodView
from neonvm.controller.runner_client import RUNNER_BODY_LIMIT, ScalingError
from tests.support import wait_for
from tests.support.hostile_runners import GIB, HostileRunner, RecordingServer

SOCKET_BUFFERS = 16 * 1024 * 1024
"""An upper bound on what loopback send and receive buffers hold between the two ends."""


def hostile(attack: str, **kwargs: Any) -> HostileRunner:
    return HostileRunner(attack, **kwargs).start()


@pytest.fixture
def recorder() -> Iterator[RecordingServer]:
    server = RecordingServer()
    yield server
    server.close()


def _running_pod(uid: str = "uid-1") -> PodView:
    return PodView(name="runner-pod", uid=uid, owner_uid=None, gated=False, terminating=False,
                   phase="Running", ip="127.0.0.1")


@pytest.mark.unit
def test_a_status_that_trickles_in_ends_at_the_deadline_and_frees_the_fetch() -> None:
    # A byte every 0.1 s never trips a per-read timeout of 1 s; the deadline is for the
    # whole exchange. The runner would go on for 30 s: the controller hangs up long
    # before (the runner sees its writes fail), and the fetch's slot is free again.
    runner = hostile("trickle", trickle_interval=0.1, trickle_bytes=300)
    try:
        reports = RunnerReports(HTTPRunnerStatus(), timeout=1.0, max_in_flight=1)
        assert reports.lookup(_running_pod(), runner.port) is None  # the fetch starts
        assert reports.wait_idle(60)
        wait_for(lambda: runner.hung_up, 40, what="the trickle to notice the hang-up")
        assert runner.hung_up == [True] and runner.sent[0] < 300, runner.sent
        assert reports.lookup(_running_pod(), runner.port) is None  # no report from it

        with pytest.raises(ScalingError, match="not complete after 1 s") as raised:
            HTTPRunnerStatus().get_status("127.0.0.1", runner.port, 1.0)
        assert raised.value.misbehaving
    finally:
        runner.close()


@pytest.mark.unit
@pytest.mark.parametrize("attack", ["big_body", "big_body_unannounced"])
def test_a_status_far_over_the_cap_is_not_read_past_it(attack: str) -> None:
    # 1 GiB, with its length announced (refused at the head) or not (read up to the cap).
    runner = hostile(attack, body_bytes=GIB)
    try:
        with pytest.raises(ScalingError, match=f"over {RUNNER_BODY_LIMIT}") as raised:
            HTTPRunnerStatus().get_status("127.0.0.1", runner.port, 30.0)
        assert raised.value.misbehaving
        wait_for(lambda: runner.hung_up, 40, what="the runner to notice the hang-up")
        # Nothing is read past the cap: what the runner got out is the cap plus what the
        # two sockets' buffers hold, far below the 1 GiB it meant to send.
        assert runner.hung_up == [True] and runner.sent[0] < RUNNER_BODY_LIMIT + SOCKET_BUFFERS, \
            runner.sent
    finally:
        runner.close()


@pytest.mark.unit
def test_a_status_redirect_is_an_error_and_its_target_is_never_asked(
        recorder: RecordingServer) -> None:
    runner = hostile("redirect", redirect_to=recorder.url)
    try:
        with pytest.raises(ScalingError, match="redirect") as raised:
            HTTPRunnerStatus().get_status("127.0.0.1", runner.port, 5.0)
        assert raised.value.misbehaving
        assert [(a.method, a.path) for a in runner.asked] == [("GET", "/status")]
        assert recorder.asked == []
    finally:
        runner.close()
