"""The Go client of benchmarks/bench_rights_failover.py keeps the shipped keeper's schedule.

``benchmarks/rightsload`` ports :class:`~neonvm.runner.right.RightKeeper` (its asks'
times and timeouts, the quick asks, the NotLeader resends, the last chance, the
first-grant backoff, the deadline rule) to Go so that 5,000 simulated runners do not
starve the leader of the CPU. Here both run over the same fake clock and the same
scripted answers (the Go one in its ``script`` mode, no network): every ask's send time,
deadline after it, last granted ask, next ask, condemned flag, and every send's time,
timeout, target, body and Authorization must agree. An answer takes its latency of the
clock unless that is past the send's timeout (then no answer, at the timeout; an answer
at the timeout itself still counts); ``timeout``: no answer after the whole timeout;
``refused``: none, after its latency.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from neonvm.api.rights import CONDEMNED, NOT_LEADER
from neonvm.runner.right import RightConfig, RightKeeper
from tests.support import Clock

D = 30.0
TOKEN = "header.payload.signature"

Scenario = dict[str, Any]


def ok(seconds: float = D, latency: float = 0.05) -> dict[str, Any]:
    return {"latency": latency, "status": 200, "body": json.dumps({"seconds": seconds})}


def answer(status: int, body: str, latency: float = 0.05) -> dict[str, Any]:
    return {"latency": latency, "status": status, "body": body}


NOT_LEADER_503 = answer(503, json.dumps({"reason": NOT_LEADER, "message": "standby"}))
REFUSED_401 = answer(401, json.dumps({"reason": "Unauthorized"}))
CONDEMNED_403 = answer(403, json.dumps({"reason": CONDEMNED, "message": "dead"}))
TIMEOUT: dict[str, Any] = {"error": "timeout"}
REFUSED: dict[str, Any] = {"latency": 0.001, "error": "refused"}
JITTER = [0.0, 0.999, 0.5, 0.25, 0.75, 0.1, 0.9, 0.6, 0.3] * 12


def scenario(answers: list[dict[str, Any]], seconds: float = D, started: bool = False,
             start_on_grant: bool = True, **more: Any) -> Scenario:
    return {"seconds": seconds, "started": started, "start": 1000.0, "token": TOKEN + "\n",
            "jitter": JITTER, "answers": answers, "start_on_grant": start_on_grant, **more}


def random_scenario(seed: int, seconds: float) -> Scenario:
    """A long run of answers of every kind, latencies up to beyond a quick ask's bound."""
    rng = random.Random(seed)
    kinds = [lambda: ok(rng.choice([D, 5.0, 3600.0]), rng.uniform(0, 3)),
             lambda: NOT_LEADER_503 | {"latency": rng.uniform(0, 3)},
             lambda: answer(rng.choice([500, 502, 503]), "oops", rng.uniform(0, 1)),
             lambda: REFUSED_401 | {"latency": rng.uniform(0, 1)},
             lambda: CONDEMNED_403, lambda: TIMEOUT,
             lambda: REFUSED | {"latency": rng.uniform(0, 0.01)},
             lambda: answer(200, "garbage", rng.uniform(0, 1))]
    answers = [ok()] + [rng.choice(kinds)() for _ in range(80)] + [ok()]  # ends an ask
    return scenario(answers, seconds=seconds, started=seed % 2 == 0,
                    jitter=[rng.random() for _ in range(200)])


SCENARIOS: dict[str, Scenario] = {
    "steady-renewals": scenario([ok() for _ in range(8)]),
    "failover": scenario(
        [ok(), ok(), TIMEOUT, TIMEOUT, REFUSED, REFUSED, NOT_LEADER_503, NOT_LEADER_503,
         NOT_LEADER_503, NOT_LEADER_503 | {"latency": 0.7}, ok(latency=0.3), ok(), ok()]),
    "failover-started": scenario(
        [ok(), ok(), TIMEOUT, TIMEOUT, REFUSED, REFUSED, NOT_LEADER_503, NOT_LEADER_503,
         NOT_LEADER_503, NOT_LEADER_503 | {"latency": 0.7}, ok(latency=0.3), ok(), ok()],
        started=True),
    "failover-no-start-on-grant": scenario(
        [ok(), TIMEOUT, NOT_LEADER_503, ok(), ok()], start_on_grant=False),
    "5xx": scenario([ok(), answer(500, "oops"), answer(502, ""), answer(503, "{}"),
                     answer(504, json.dumps({"reason": "Gateway"})), ok(), ok()]),
    "two-refusals-last-chance": scenario([ok(), REFUSED_401, REFUSED_401, REFUSED_401,
                                          REFUSED_401, ok(), ok()]),
    "refusals-before-first-grant": scenario([REFUSED_401] * 9 + [ok(), ok()]),
    "no-answer-before-first-grant": scenario([TIMEOUT, REFUSED] * 4 + [ok(), ok()]),
    "condemned-before-first-grant": scenario([REFUSED_401, CONDEMNED_403, REFUSED_401, ok()]),
    "condemned-after-a-grant": scenario([ok(), CONDEMNED_403, REFUSED_401, ok()]),
    "200-not-a-grant": scenario(
        [ok(), answer(200, "garbage"), answer(200, '{"seconds": 0}'),
         answer(200, '{"seconds": -30}'), answer(200, '{"seconds": "30"}'),
         answer(200, '{"seconds": true}'), answer(200, '{"seconds": 30, "more": 1}'),
         answer(200, "[30]"), answer(200, '{"seconds": 1e400}'), answer(200, ""),
         answer(200, '{"seconds": 30}' + " " * (64 * 1024)), answer(200, '{"seconds": 7.5}'),
         ok()]),
    "200-not-a-grant-before-the-first": scenario(
        [answer(200, '{"seconds": 0}'), answer(200, "garbage"), answer(200, '{"seconds": -1}'),
         answer(200, '{"seconds": null}'), answer(200, "{}"), ok()]),
    "grant-longer-than-d": scenario([ok(3600.0), ok(3600.0, latency=1.0), ok(5.0), ok()]),
    "not-leader-resends-within-the-asks-deadline": scenario(
        [ok(), NOT_LEADER_503 | {"latency": 2.0}, NOT_LEADER_503 | {"latency": 2.0}, ok(),
         NOT_LEADER_503 | {"latency": 3.0}, NOT_LEADER_503 | {"latency": 3.0},
         TIMEOUT, NOT_LEADER_503 | {"latency": 1.5}, ok(latency=1.0), ok(),
         NOT_LEADER_503 | {"latency": 5.0}, ok(), ok()]),  # a NotLeader at the deadline
    "slow-answers-time-out": scenario([ok(latency=4.9), ok(latency=5.0), TIMEOUT,
                                       ok(latency=1.99), ok(latency=2.5), ok()]),
    "short-d": scenario([ok(6.0), TIMEOUT, NOT_LEADER_503, REFUSED_401, REFUSED_401,
                         ok(6.0), ok(6.0)], seconds=6.0),
    "empty-token": scenario([ok()], token="\n", max_asks=4),
    **{f"random-{seed}": random_scenario(seed, [D, 9.0, 60.0][seed % 3]) for seed in range(6)},
}


def python_records(sc: Scenario, tmp_path: Path) -> list[dict[str, Any]]:
    """The shipped keeper over the scenario, driven as the benchmark's Fleet drives it."""
    clock = Clock(sc["start"])
    answers = list(sc["answers"])
    sends: list[dict[str, Any]] = []

    def post(url: str, body: bytes, headers: Mapping[str, str],
             timeout: float) -> tuple[int, bytes]:
        if not answers:
            raise AssertionError("the scenario ran out of answers within an ask")
        a = answers.pop(0)
        parts = urllib.parse.urlsplit(url)
        sends.append({"at": clock.now, "timeout": timeout,
                      "target": parts.path + (f"?{parts.query}" if parts.query else ""),
                      "body": body.decode(), "auth": headers["Authorization"]})
        wait = max(0.0, timeout)
        if a.get("error") == "timeout" or a.get("latency", 0.0) > wait:
            clock.now += wait
            raise TimeoutError("timed out")
        clock.now += a.get("latency", 0.0)
        if a.get("error") == "refused":
            raise ConnectionRefusedError("refused")
        return a["status"], a["body"].encode()

    jitters = list(sc["jitter"])
    token = tmp_path / "token"
    token.write_text(sc["token"])
    keeper = RightKeeper(
        RightConfig(url="http://rights:0", seconds=sc["seconds"], namespace="ns", vm="vm",
                    pod_uid="uid-1", token_file=None, rights_token_file=token),
        clock, post, jitter=lambda low, high: low + (high - low) * jitters.pop(0))
    if sc["started"]:
        keeper.guest_started()
    records: list[dict[str, Any]] = []
    while answers and len(records) < (sc.get("max_asks") or math.inf):
        sends = []
        t0 = keeper.ask_once()
        if sc["start_on_grant"] and keeper.last_grant == t0:
            keeper.guest_started()
        at = keeper.next_ask(t0)
        records.append({"t0": t0, "deadline": keeper.deadline, "last_grant": keeper.last_grant,
                        "next": at,
                        "condemned": keeper.condemned(), "sends": sends})
        clock.now = max(clock.now, at)
    return records


def go_records(binary: Path, sc: Scenario) -> list[dict[str, Any]]:
    done = subprocess.run([str(binary), "script"], input=json.dumps(sc), text=True,
                          capture_output=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def same(python: Any, go: Any, where: str = "") -> None:
    """Equal, floats within 1e-9."""
    if isinstance(python, float) or isinstance(go, float):
        assert isinstance(python, (int, float)) and isinstance(go, (int, float)), where
        assert math.isclose(python, go, rel_tol=0, abs_tol=1e-9), \
            f"{where}: Python {python!r}, Go {go!r}"
    elif isinstance(python, dict):
        assert isinstance(go, dict) and set(python) == set(go), f"{where}: {python} / {go}"
        for key in python:
            same(python[key], go[key], f"{where}.{key}")
    elif isinstance(python, list):
        assert isinstance(go, list) and len(python) == len(go), \
            f"{where}: {len(python)} Python items, Go {go if not isinstance(go, list) else len(go)}"
        for i, (p, g) in enumerate(zip(python, go, strict=True)):
            same(p, g, f"{where}[{i}]")
    else:
        assert python == go, f"{where}: Python {python!r}, Go {go!r}"


@pytest.fixture(scope="module")
def rightsload() -> Path:
    if shutil.which("go") is None:
        pytest.skip("no go toolchain on PATH: the Go client of "
                    "benchmarks/bench_rights_failover.py cannot be built")
    from benchmarks.go_rightsload import build_rightsload

    return build_rightsload()


@pytest.mark.unit
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_go_keeper_asks_and_extends_as_the_shipped_one(rightsload: Path, name: str,
                                                             tmp_path: Path) -> None:
    sc = SCENARIOS[name]
    python = python_records(sc, tmp_path)
    assert python, "a scenario makes at least one ask"
    same(python, go_records(rightsload, sc), name)
