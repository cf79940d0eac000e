"""The API client's transport against a loopback HTTP server: what urllib3 may send
again by itself, and what happens to the connection of a watch that is left early.

The server here is a real HTTP/1.1 server on 127.0.0.1 that counts the requests it
reads and the connection each came on; the client is built by ``kube.api_client`` from a
kubeconfig, as every client of the project is.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines
from urllib3.exceptions import HTTPError

from neonvm import kube
from neonvm.controller.informer import Informer, Store
from tests.support import wait_for

pytestmark = pytest.mark.unit


@dataclass
class Seen:
    """One request the server read: method, path, query and the client's port."""

    method: str
    path: str
    query: dict[str, list[str]]
    port: int


@dataclass
class Loopback:
    """A keep-alive HTTP/1.1 server whose answer to each request is ``answer``'s.

    ``answer(handler, seen)`` writes the whole answer (or none: it may drop the
    connection). ``seen`` lists every request read, in order; ``closed`` the client
    port of every connection the server is done with (nothing more is read from it).
    """

    answer: Callable[[BaseHTTPRequestHandler, Seen], None]
    seen: list[Seen] = field(default_factory=list)
    closed: list[int] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    """Set at the end of the test: answers that wait on it return."""
    server: ThreadingHTTPServer | None = None

    def start(self) -> Loopback:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                url = urlsplit(self.path)
                seen = Seen(self.command, url.path, parse_qs(url.query),
                            int(self.client_address[1]))
                owner.seen.append(seen)
                owner.answer(self, seen)

            def handle(self) -> None:
                try:
                    super().handle()
                except OSError:
                    pass  # the client reset the connection
                finally:
                    owner.closed.append(int(self.client_address[1]))

            do_GET = do_PUT = do_POST = do_PATCH = do_DELETE = _any

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.release.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def kubeconfig(self, directory: Path) -> Path:
        assert self.server is not None
        path = directory / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "loop",
            "clusters": [{"name": "loop", "cluster": {
                "server": f"http://127.0.0.1:{self.server.server_address[1]}"}}],
            "users": [{"name": "loop", "user": {"token": "t"}}],
            "contexts": [{"name": "loop", "context": {"cluster": "loop", "user": "loop"}}]}))
        return path

    def requests(self, method: str) -> list[Seen]:
        return [s for s in self.seen if s.method == method]


@pytest.fixture
def loopback_api(tmp_path: Path) -> Iterator[Callable[..., tuple[Loopback, client.ApiClient]]]:
    """Start a :class:`Loopback` with the given answer and a client for it."""
    made: list[tuple[Loopback, client.ApiClient]] = []

    def make(answer: Callable[[BaseHTTPRequestHandler, Seen], None]
             ) -> tuple[Loopback, client.ApiClient]:
        server = Loopback(answer).start()
        api = kube.api_client(server.kubeconfig(tmp_path))
        made.append((server, api))
        return server, api

    yield make
    for server, api in made:
        server.stop()
        api.close()


def send_json(handler: BaseHTTPRequestHandler, status: int, body: Any) -> None:
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def send_chunk(handler: BaseHTTPRequestHandler, line: bytes) -> None:
    handler.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
    handler.wfile.flush()


def stream_then_wait(handler: BaseHTTPRequestHandler, release: threading.Event) -> None:
    """A watch answer: one ADDED event, then the stream stays open until ``release``."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    event = {"type": "ADDED", "object": {"metadata": {
        "name": "a", "namespace": "ns", "uid": "u", "resourceVersion": "2"}}}
    send_chunk(handler, json.dumps(event).encode() + b"\n")
    release.wait(60)
    handler.wfile.write(b"0\r\n\r\n")  # the end of the stream, as at its timeoutSeconds
    handler.wfile.flush()


EMPTY_LIST = {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": "1"},
              "items": []}


# ---- what urllib3 sends again ------------------------------------------------------------


@pytest.mark.parametrize("method", ["PUT", "DELETE", "POST", "PATCH"])
def test_a_write_whose_connection_drops_before_the_answer_is_not_sent_again(
        loopback_api: Any, method: str) -> None:
    """The server read the write (and may have applied it), then the connection broke:
    the caller gets the error, and the server saw the write once."""
    def drop(handler: BaseHTTPRequestHandler, seen: Seen) -> None:
        handler.close_connection = True  # no answer at all

    server, api = loopback_api(drop)
    with pytest.raises((HTTPError, OSError)):
        kube.request(api, method, "/api/v1/namespaces/ns/pods/p", body={}, timeout=10)
    assert len(server.requests(method)) == 1


@pytest.mark.parametrize("method", ["PUT", "DELETE"])
def test_a_write_that_timed_out_is_not_sent_again(loopback_api: Any, method: str) -> None:
    """urllib3's default retries re-sent a PUT or DELETE after a read timeout."""
    def never(handler: BaseHTTPRequestHandler, seen: Seen) -> None:
        server.release.wait(60)  # answers only once the test is over
        handler.close_connection = True

    server, api = loopback_api(never)
    with pytest.raises((HTTPError, OSError)):
        kube.request(api, method, "/api/v1/namespaces/ns/pods/p", body={}, timeout=0.5)
    wait_for(lambda: server.requests(method), 10, what="the write reached the server")
    assert len(server.requests(method)) == 1


def test_a_read_whose_connection_drops_is_sent_again(loopback_api: Any) -> None:
    """Reads keep their retries: a GET has no effect to apply twice."""
    def drop_first(handler: BaseHTTPRequestHandler, seen: Seen) -> None:
        if len(server.requests("GET")) == 1:
            handler.close_connection = True
            return
        send_json(handler, 200, {"metadata": {"name": "p"}})

    server, api = loopback_api(drop_first)
    assert kube.request(api, "GET", "/api/v1/namespaces/ns/pods/p") == {
        "metadata": {"name": "p"}}
    assert len(server.requests("GET")) == 2


# ---- a watch left before its end -----------------------------------------------------------


def watch_or_put(server_ref: list[Loopback]) -> Callable[[BaseHTTPRequestHandler, Seen], None]:
    def answer(handler: BaseHTTPRequestHandler, seen: Seen) -> None:
        if seen.query.get("watch") == ["true"]:
            stream_then_wait(handler, server_ref[0].release)
        elif seen.method == "GET":
            send_json(handler, 200, EMPTY_LIST)
        else:
            send_json(handler, 200, {"metadata": {"name": "p"}})
    return answer


def test_a_released_unfinished_stream_is_never_reused_for_another_request(
        loopback_api: Any) -> None:
    """After ``release_stream`` of a watch still streaming, the next request goes out on
    a connection of its own, once, and is answered."""
    ref: list[Loopback] = []
    server, api = loopback_api(watch_or_put(ref))
    ref.append(server)
    resp = kube.Lister(api, "/api/v1/pods")(watch=True, _request_timeout=(5, 30))
    lines = iter_resp_lines(resp)
    assert json.loads(next(lines))["type"] == "ADDED"
    kube.release_stream(resp)  # left early; ``lines`` still refers to the stream
    assert kube.request(api, "PUT", "/api/v1/namespaces/ns/pods/p", body={}) == {
        "metadata": {"name": "p"}}
    (watch,) = server.requests("GET")
    server.release.set()  # the watch ends; its connection is read for a next request
    wait_for(lambda: watch.port in server.closed, 10, what="the watch's connection to end")
    assert [put.port for put in server.requests("PUT")] != [watch.port]
    assert len(server.requests("PUT")) == 1
    del lines


def test_a_watch_broken_by_its_handler_leaves_no_streaming_connection_in_the_pool(
        loopback_api: Any) -> None:
    """The informer's watch ends with an exception while the server still streams; a
    write by another caller of the same client must neither be sent behind that stream
    nor fail for it."""
    ref: list[Loopback] = []
    server, api = loopback_api(watch_or_put(ref))
    ref.append(server)

    def broken(key: str, old: Any, new: Any) -> None:
        raise RuntimeError("a handler bug")

    informer = Informer("pods", kube.Lister(api, "/api/v1/pods"), Store(), broken)
    with pytest.raises(RuntimeError, match="a handler bug"):
        informer._watch("1")  # the traceback, kept here, still holds the stream
    assert kube.request(api, "PUT", "/api/v1/namespaces/ns/pods/p", body={}) == {
        "metadata": {"name": "p"}}
    (watch,) = server.requests("GET")
    server.release.set()
    wait_for(lambda: watch.port in server.closed, 10, what="the watch's connection to end")
    assert len(server.requests("PUT")) == 1


def test_a_410_answered_on_the_watch_request_itself_relists(loopback_api: Any) -> None:
    """A proxy or an API server may refuse the watch with an HTTP 410 instead of a 200
    carrying an ERROR event; both mean Gone: re-list at once (not a failure to back off
    from)."""
    gone = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
            "reason": "Expired", "message": "too old resource version: 1 (40)"}

    def answer(handler: BaseHTTPRequestHandler, seen: Seen) -> None:
        if seen.query.get("watch") == ["true"]:
            if len(server.requests("GET")) <= 2:  # the first watch
                send_json(handler, 410, gone)
            else:
                stream_then_wait(handler, server.release)
        else:
            send_json(handler, 200, EMPTY_LIST)

    server, api = loopback_api(answer)
    relists: list[str] = []
    informer = Informer("pods", kube.Lister(api, "/api/v1/pods"), Store(),
                        lambda *_: None, on_relist=relists.append,
                        retry_backoff=600.0, max_backoff=600.0)  # a failure: 10 minutes
    informer.start()
    try:
        wait_for(lambda: len(relists) >= 2, 30, what="a re-list after the 410")
    finally:
        server.release.set()
        informer.stop()
    kinds = ["watch" if s.query.get("watch") == ["true"] else "list"
             for s in server.requests("GET")]
    assert kinds[:3] == ["list", "watch", "list"]


def test_a_410_on_the_watch_request_is_gone_and_other_refusals_are_not(
        loopback_api: Any) -> None:
    """Only a 410 turns into a re-list; a 403 on the watch stays an error."""
    def forbidden(handler: BaseHTTPRequestHandler, seen: Seen) -> None:
        send_json(handler, 403, {"kind": "Status", "code": 403, "reason": "Forbidden"})

    _, api = loopback_api(forbidden)
    informer = Informer("pods", kube.Lister(api, "/api/v1/pods"), Store(), lambda *_: None)
    with pytest.raises(ApiException) as err:
        informer._watch("1")
    assert err.value.status == 403
