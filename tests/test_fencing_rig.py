"""The self-fencing drills' rig (neonvm/drills/fencing.py; docs/drills.md, "Self-fencing
drills on two real nodes"), the parts that need no real node: the rights forwarder's
tally of what the runners asked with, and the replicas' environment.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import neonvm
from neonvm.api.rights import authorization_header
from neonvm.dev.replica import replica_env
from neonvm.drills import fencing, fleet
from tests.support import wait_for

pytestmark = pytest.mark.unit

JWT = "eyJhbGciOiJSUzI1NiJ9.eyJhdWQiOlsidm0ubmVvbi50ZWNoL3JpZ2h0cyJdfQ.c2lnbmF0dXJl"


def ask(authorization: str | None) -> bytes:
    headers = f"Authorization: {authorization}\r\n" if authorization is not None else ""
    return (f"POST /v1/rights HTTP/1.1\r\nHost: 10.0.0.1:80\r\n{headers}"
            "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}").encode()


class TestBearerKind:
    def test_a_projected_token_is_a_jwt(self) -> None:
        assert fencing.bearer_kind(ask(f"Bearer {JWT}")) == "jwt"

    def test_the_scaling_tokens_hmac_is_another_bearer(self) -> None:
        assert fencing.bearer_kind(ask(authorization_header(b"s3cret", "uid-1"))) == "other"

    def test_an_ask_without_authorization_says_none(self) -> None:
        assert fencing.bearer_kind(ask(None)) == "none"

    def test_a_header_name_in_any_case_counts(self) -> None:
        chunk = ask(f"Bearer {JWT}").replace(b"Authorization", b"aUTHORIZATION")
        assert fencing.bearer_kind(chunk) == "jwt"

    def test_a_chunk_that_starts_no_request_is_not_an_ask(self) -> None:
        assert fencing.bearer_kind(b'{"podUID": "x"}') is None
        assert fencing.bearer_kind(b"Authorization: Bearer a.b.c\r\n\r\n") is None

    def test_a_bearer_in_the_body_is_not_the_asks(self) -> None:
        chunk = ask(None) + b"\r\nAuthorization: Bearer a.b.c\r\n"
        assert fencing.bearer_kind(chunk) == "none"


def test_answer_code_reads_the_status_line_only() -> None:
    assert fencing.answer_code(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}") == "200"
    assert fencing.answer_code(b"HTTP/1.0 503 Service Unavailable\r\n\r\n") == "503"
    assert fencing.answer_code(b'{"seconds": 30}') is None


class Grants(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"seconds": 30}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[tuple[str, int]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Grants)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield "127.0.0.1", server.server_address[1]
    server.shutdown()
    server.server_close()


def test_the_forwarder_tallies_each_ask_by_bearer_and_each_answer_by_code(
        upstream: tuple[str, int]) -> None:
    # No API client: the forwarder keeps the target it has (set here, as the
    # EndpointSlice would).
    proxy = fencing.RightsProxy(None, "127.0.0.1")
    proxy.target = upstream
    with proxy:
        for authorization in (f"Bearer {JWT}", f"Bearer {JWT}",
                              authorization_header(b"s3cret", "uid-1")):
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
            conn.request("POST", "/v1/rights", body=b"{}",
                         headers={"Authorization": authorization})
            assert conn.getresponse().status == 200
            conn.close()
        wait_for(lambda: sum(proxy.tally()["answers_by_code"].values()) == 3, interval=0.02,
                 what="the forwarder tallied three answers")
        tally = proxy.tally()
    assert tally["asks_by_bearer"] == {"jwt": 2, "other": 1}
    assert tally["answers_by_code"] == {"200": 3}
    assert (tally["forwarded"], tally["refused"]) == (3, 0)


def test_replicas_import_the_neonvm_package_the_drill_runs_with_the_charts_allocator(
        tmp_path: Path) -> None:
    env = replica_env()
    assert env["MALLOC_ARENA_MAX"] == "2"  # as the chart's Deployment sets it
    # As the local cluster starts a replica: that environment only, another directory.
    found = subprocess.run(
        [sys.executable, "-c", "import neonvm; print(neonvm.__file__)"],
        env={**env, "PATH": os.environ.get("PATH", "")}, cwd=tmp_path,
        capture_output=True, text=True, check=True).stdout.strip()
    assert Path(found).resolve() == Path(neonvm.__file__).resolve()
    assert env["PYTHONPATH"] == str(Path(neonvm.__file__).resolve().parent.parent)


class Recording:
    """Stands in for the local cluster: records the processes it is asked to start."""

    def __init__(self) -> None:
        self.started: list[tuple[str, list[str], dict[str, str]]] = []

    def kubeconfig_for(self, who: str) -> Path:
        return Path(f"/nowhere/{who}.kubeconfig")

    def locks_etcd_config(self) -> str:
        return "http://127.0.0.1:1"

    def start_process(self, name: str, argv: list[str], env: dict[str, str]) -> int:
        self.started.append((name, argv, env))
        return 1


def test_a_replica_starts_with_that_environment_and_the_rights_audience() -> None:
    cluster = Recording()
    node = type("Node", (), {"node_ip": "10.251.1.1"})()
    rig = fencing.Rig(cluster, None, [node, node], 30.0, 1,  # type: ignore[arg-type]
                      fencing.RightsProxy(None, "127.0.0.1"), "fence-x",
                      lambda _m: None, [4321])
    try:
        rig.start_replica(0)
    finally:
        rig.proxy.sock.close()
    [(name, argv, env)] = cluster.started
    assert name == "fence-controller-0"
    assert env == replica_env()
    assert argv[argv.index("--rights-audience") + 1] == "vm.neon.tech/rights/fence-x/drill"


class StubRig:
    """What :func:`fencing.run_drills` uses of a rig, without a cluster."""

    api = None
    namespace = "fence-x"
    rights_url = "http://10.251.1.1:1"

    def __init__(self) -> None:
        self.proxy = fencing.RightsProxy(None, "127.0.0.1")

    def leader(self) -> str:
        return "fence-0-1"


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """run_drills with every cluster step replaced; returns the drills run, in order."""
    ran: list[str] = []

    @contextlib.contextmanager
    def rig_for(*_args: Any) -> Iterator[StubRig]:
        rig = StubRig()
        yield rig
        rig.proxy.sock.close()

    def run_drill(_rig: Any, drill: str, _vm: str, **_kw: Any) -> fencing.Result:
        ran.append(drill)
        if len(ran) == 2:
            raise KeyboardInterrupt  # the series stopped by hand during its second drill
        return fencing.Result(drill, ok=True, node="neonvm-real-0", freeze_to_qemu=40.0)

    monkeypatch.setattr(fencing, "rig_for", rig_for)
    monkeypatch.setattr(fencing, "run_drill", run_drill)
    monkeypatch.setattr(fencing, "create_vm", lambda *_a: None)
    monkeypatch.setattr(fencing, "ready_pod", lambda *_a: object())
    monkeypatch.setattr(fleet, "delete_vms", lambda *_a: None)
    return ran


def test_a_series_stopped_midway_keeps_the_drills_it_finished(
        no_cluster: list[str], tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    with pytest.raises(KeyboardInterrupt):
        fencing.run_drills(tmp_path, fencing.Options(["power-off"], repeat=5, seed=1,
                                                     json_path=out), lambda _m: None)
    doc = json.loads(out.read_text())
    assert (doc["complete"], len(doc["runs"])) == (False, 1)
    assert doc["summary"]["power-off"]["runs"] == 1


def test_max_minutes_starts_no_drill_once_spent(no_cluster: list[str], tmp_path: Path
                                                ) -> None:
    out = tmp_path / "r.json"
    results, summary = fencing.run_drills(
        tmp_path, fencing.Options(["power-off", "freeze-thaw"], repeat=5, seed=1,
                                  json_path=out, max_minutes=0), lambda _m: None)
    assert no_cluster == ["power-off"]
    assert [r.drill for r in results] == ["power-off"]
    assert json.loads(out.read_text())["complete"] is True
    assert summary["power-off"]["runs"] == 1
