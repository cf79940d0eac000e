"""A runner asks for its right with the pod's projected ServiceAccount token: the leader
grants it only if a TokenReview with the controller's rights audience binds the token to
exactly the VM's current runner pod (namespace, name, uid), and never reads a Secret for
it (docs/security.md, "Rights endpoint"; docs/protocol.md, "Self-fencing").

Real tokens from the session's API server (the TokenRequest API, bound to real pods, as
the kubelet mints a projected token), reviewed by the shipped endpoint as the controller's
identity (whose RBAC comes from neonvm/manifests.py)."""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm import kube
from neonvm.api.rights import UNAUTHORIZED
from neonvm.controller.rights import (
    POD_NAME_EXTRA,
    POD_UID_EXTRA,
    REVIEW_BUDGET_SPENT,
    REVIEW_UNAVAILABLE,
    ReviewBudgetSpent,
    ReviewedPod,
    TokenReviewer,
    reviewed_pod,
    unverified_claims,
)
from neonvm.dev.cluster import LocalCluster
from tests.support import wait_for
from tests.support.rights_sa_token import (
    ACCOUNT,
    AUDIENCE,
    ISSUER,
    NO_SCHEDULER,
    ReviewingLeader,
    delete_pod,
    forged,
    mint,
    pod,
    service_account,
)


@pytest.fixture
def leader(controller_api: client.ApiClient) -> Iterator[ReviewingLeader]:
    served = ReviewingLeader(controller_api)
    yield served
    served.close()


@pytest.fixture
def other_namespace(api: client.ApiClient) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    kube.request(api, "POST", "/api/v1/namespaces", body={"metadata": {"name": name}})
    yield name
    kube.request(api, "DELETE", f"/api/v1/namespaces/{name}")


# ---- granted ------------------------------------------------------------------------------


def test_a_token_bound_to_the_current_runner_pod_is_granted_and_reviewed_once(
        api: client.ApiClient, namespace: str, leader: ReviewingLeader) -> None:
    """Steady state: the runner asks every D/3 with the same token; one TokenReview."""
    service_account(api, namespace)
    uid = pod(api, namespace, "vm-p")
    leader.show(namespace, "vm", "vm-p", uid)
    token = mint(api, namespace, "vm-p", uid)
    for _ in range(3):
        status, body = leader.ask(namespace, "vm", uid, token)
        assert status == 200, body
        assert body == {"seconds": 30.0} or body.get("seconds") == 30
    assert leader.reviewer.reviews == 1


# ---- refused ------------------------------------------------------------------------------


def test_a_token_bound_to_another_pod_is_refused(
        api: client.ApiClient, namespace: str, leader: ReviewingLeader) -> None:
    """A tenant who may mint tokens in its namespace mints one for its own pod: it is no
    credential for the VM's runner pod."""
    service_account(api, namespace)
    uid = pod(api, namespace, "vm-p")
    other = pod(api, namespace, "other")
    leader.show(namespace, "vm", "vm-p", uid)
    status, body = leader.ask(namespace, "vm", uid, mint(api, namespace, "other", other))
    assert (status, body["reason"]) == (401, UNAUTHORIZED)
    assert leader.ask(namespace, "vm", uid, mint(api, namespace, "vm-p", uid))[0] == 200


@pytest.mark.parametrize("audience", ["other-controller", ISSUER])
def test_a_token_of_another_audience_is_refused(
        api: client.ApiClient, namespace: str, leader: ReviewingLeader, audience: str) -> None:
    """Bound to the right pod, but for another release's rights or for the API server."""
    service_account(api, namespace)
    uid = pod(api, namespace, "vm-p")
    leader.show(namespace, "vm", "vm-p", uid)
    token = mint(api, namespace, "vm-p", uid, audience=audience)
    status, body = leader.ask(namespace, "vm", uid, token)
    assert (status, body["reason"]) == (401, UNAUTHORIZED)
    # And the API server agrees: reviewed for our audience, it is not authenticated.
    assert TokenReviewer(api, AUDIENCE, wall=lambda: 0.0).pod_of(token, uid) is None


def test_a_token_bound_to_a_pod_of_another_namespace_is_refused(
        api: client.ApiClient, namespace: str, other_namespace: str,
        leader: ReviewingLeader) -> None:
    """The leader's cache names a pod of that uid and name in the VM's namespace; the token
    is bound to a pod of the same name and uid in another namespace (the cache is made to
    say so: uids do not repeat). The review is made, and its namespace refuses it."""
    service_account(api, other_namespace)
    uid = pod(api, other_namespace, "vm-p")
    leader.show(namespace, "vm", "vm-p", uid)
    status, body = leader.ask(namespace, "vm", uid, mint(api, other_namespace, "vm-p", uid))
    assert (status, body["reason"]) == (401, UNAUTHORIZED)
    assert leader.reviewer.reviews == 1
    leader.show(other_namespace, "vm", "vm-p", uid)
    assert leader.ask(other_namespace, "vm", uid, mint(api, other_namespace, "vm-p", uid))[0] \
        == 200


def test_an_expired_or_garbage_token_is_refused(
        api: client.ApiClient, cluster: LocalCluster, namespace: str,
        leader: ReviewingLeader) -> None:
    """Signed with the cluster's own key, the same claims pass while unexpired and are
    refused once expired: by the leader's filter, and by the API server's review."""
    account = service_account(api, namespace)
    uid = pod(api, namespace, "vm-p")
    leader.show(namespace, "vm", "vm-p", uid)
    key = cluster.state_dir / "pki" / "sa.key"
    live = forged(key, namespace, "vm-p", uid, account, expires=time.time() + 600)
    assert leader.ask(namespace, "vm", uid, live)[0] == 200
    # Expired 90 s ago: the leader's clock may run ahead of the API server's, so it asks
    # the API server, which refuses it (it allows 60 s of skew itself).
    expired = forged(key, namespace, "vm-p", uid, account, expires=time.time() - 90)
    reviews = leader.reviewer.reviews
    assert leader.ask(namespace, "vm", uid, expired)[1]["reason"] == UNAUTHORIZED
    assert leader.reviewer.reviews == reviews + 1
    # Long expired (beyond any clock's leeway): refused with no review.
    stale = forged(key, namespace, "vm-p", uid, account, expires=time.time() - 600)
    assert leader.ask(namespace, "vm", uid, stale)[1]["reason"] == UNAUTHORIZED
    assert leader.reviewer.reviews == reviews + 1, "a long-expired token costs no review"
    for garbage in ("a.b.c", f"{live[:-8]}AAAAAAAA", "x" * 100, ".."):
        status, body = leader.ask(namespace, "vm", uid, garbage)
        assert (status, body["reason"]) == (401, UNAUTHORIZED), garbage


_BASE64URL = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


def respelled(token: str) -> list[str]:
    """Other spellings of one signed token that the API server accepts as that token: the
    signature's last character with other unused low bits, and ``\\r`` or ``\\n``
    inserted (Go's base64 skips them)."""
    header, payload, signature = token.split(".")
    unused = {2: 4, 3: 2}[len(signature) % 4]
    last = _BASE64URL.index(signature[-1])
    spellings = [f"{header}.{payload}.{signature[:-1]}{_BASE64URL[last ^ bit]}"
                 for bit in (1, 1 << (unused - 1))]
    spellings += [f"{header}.{payload[:10]}\n{payload[10:]}.{signature}",
                  f"{header}.{payload}.{signature[:10]}\r{signature[10:]}"]
    return spellings


def raw_ask(port: int, namespace: str, vm: str, pod_uid: str, token: str,
            source: str = "127.0.0.1") -> int:
    """One ``POST /v1/rights`` from address ``source`` whose Authorization header carries
    ``token`` byte for byte (http.client refuses a header with a line break in it); the
    answer's status."""
    body = json.dumps({"namespace": namespace, "vm": vm, "podUID": pod_uid}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10,
                                  source_address=(source, 0)) as conn:
        conn.sendall(b"POST /v1/rights HTTP/1.1\r\nHost: rights\r\nAuthorization: Bearer "
                     + token.encode("latin-1") + b"\r\nContent-Type: application/json\r\n"
                     + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def test_another_spelling_of_a_granted_token_is_refused_without_a_review(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        leader: ReviewingLeader) -> None:
    """The API server authenticates each of these spellings as the token itself; the
    leader refuses them before its cache and before any review, so one signed token
    costs one review and one cache entry however it is spelled."""
    service_account(api, namespace)
    uid = pod(api, namespace, "vm-p")
    leader.show(namespace, "vm", "vm-p", uid)
    token = mint(api, namespace, "vm-p", uid)
    assert leader.ask(namespace, "vm", uid, token)[0] == 200
    assert leader.reviewer.reviews == 1
    for spelling in respelled(token):
        accepted = kube.request(controller_api, "POST", "/apis/authentication.k8s.io/v1/"
                                "tokenreviews", body={"spec": {"token": spelling,
                                                               "audiences": [AUDIENCE]}})
        assert accepted["status"].get("authenticated") is True, repr(spelling[-4:])
        # A bare CR or LF in the head is a 400 from the listener; the rest, a 401.
        expected = 400 if "\r" in spelling or "\n" in spelling else 401
        assert raw_ask(leader.server.port, namespace, "vm", uid, spelling) == expected
        assert leader.reviewer.pod_of(spelling, uid, namespace) is None
    assert leader.reviewer.reviews == 1
    assert raw_ask(leader.server.port, namespace, "vm", uid, token) == 200


def test_a_pods_reviews_are_bounded_per_window_whatever_the_tokens(
        api: client.ApiClient, namespace: str, leader: ReviewingLeader) -> None:
    """Whoever may mint tokens for its own pod mints many distinct good ones: each costs
    a review only within the pod's budget (4 per 60 s), then 429 with no review; another
    pod's budget is its own, and the tokens already reviewed are still granted."""
    service_account(api, namespace)
    uid = pod(api, namespace, "vm-p")
    other = pod(api, namespace, "vm-q")
    leader.show(namespace, "vm", "vm-p", uid)
    tokens = [mint(api, namespace, "vm-p", uid) for _ in range(5)]
    assert [leader.ask(namespace, "vm", uid, t)[0] for t in tokens[:4]] == [200] * 4
    status, body = leader.ask(namespace, "vm", uid, tokens[4])
    assert (status, body["reason"]) == (429, REVIEW_BUDGET_SPENT)
    assert leader.reviewer.reviews == 4
    assert leader.ask(namespace, "vm", uid, tokens[0])[0] == 200  # cached: no review
    leader.show(namespace, "vm", "vm-q", other)
    assert leader.ask(namespace, "vm", other, mint(api, namespace, "vm-q", other))[0] == 200
    assert leader.reviewer.reviews == 5


def test_asks_from_elsewhere_cannot_spend_the_review_budget_of_the_pods_own_runner(
        api: client.ApiClient, namespace: str, leader: ReviewingLeader) -> None:
    """Whoever knows a current pod's uid can send forged tokens naming it, each a review
    the API server refuses: they spend the budget of asks from other addresses, not that
    of the pod's own IP (the cache's ``status.podIP``), whose runner's token is still
    reviewed and granted."""
    service_account(api, namespace)
    uid = pod(api, namespace, "vm-p")
    leader.show(namespace, "vm", "vm-p", uid, ip="127.0.0.2")
    port = leader.server.port
    forgeries = [_token(f"forged-{i}", exp=time.time() + 600, uid=uid) for i in range(5)]
    assert [raw_ask(port, namespace, "vm", uid, t) for t in forgeries] == [401] * 4 + [429]
    assert leader.reviewer.reviews == 4
    token = mint(api, namespace, "vm-p", uid)
    assert raw_ask(port, namespace, "vm", uid, token, source="127.0.0.2") == 200
    assert leader.reviewer.reviews == 5


def vouches(api: client.ApiClient, token: str) -> bool:
    """Whether the API server authenticates ``token`` for :data:`AUDIENCE` (a
    TokenReview; one it authenticated is remembered 10 s, a refusal not at all)."""
    answer = kube.request(api, "POST", "/apis/authentication.k8s.io/v1/tokenreviews",
                          body={"spec": {"token": token, "audiences": [AUDIENCE]}})
    return answer["status"].get("authenticated") is True


def test_the_token_of_a_replaced_pod_is_refused(
        api: client.ApiClient, namespace: str, leader: ReviewingLeader) -> None:
    """The pod is deleted and a new one made under its name (another uid). The old pod's
    token is no credential for the new pod; and even while the leader's cache still shows
    the old uid, the API server, once its own view has caught up, no longer vouches for a
    token whose pod is gone."""
    service_account(api, namespace)
    old = pod(api, namespace, "vm-p")
    leader.show(namespace, "vm", "vm-p", old)
    old_token = mint(api, namespace, "vm-p", old)
    lagging_token = mint(api, namespace, "vm-p", old)  # never asked with: not cached
    assert leader.ask(namespace, "vm", old, old_token)[0] == 200
    # The name is reused at once: these pods are on no node, so no kubelet (kwok) has a
    # late delete of the old pod by name to send (test below).
    delete_pod(api, namespace, "vm-p")
    new = pod(api, namespace, "vm-p")
    assert new != old
    # The API server looks a token's pod up in its informer cache first, which may hold
    # the old pod a moment longer (and would then vouch for the old pod's tokens). Once
    # it vouches for a token of the new pod, that cache holds the old pod no more.
    wait_for(lambda: vouches(api, mint(api, namespace, "vm-p", new)), timeout=30,
             what="the API server to vouch for a token of the new pod")

    status, body = leader.ask(namespace, "vm", old, lagging_token)  # cache not caught up
    assert (status, body["reason"]) == (401, UNAUTHORIZED)
    leader.show(namespace, "vm", "vm-p", new)
    assert leader.ask(namespace, "vm", new, old_token)[1]["reason"] == UNAUTHORIZED
    assert leader.ask(namespace, "vm", old, old_token)[0] == 403  # not the current pod
    assert leader.ask(namespace, "vm", new, mint(api, namespace, "vm-p", new))[0] == 200


def test_the_pods_of_these_tests_are_on_no_node(
        api: client.ApiClient, cluster: LocalCluster, namespace: str) -> None:
    """What lets the test above make a pod under a deleted pod's name at once: nothing but
    the test writes or deletes these pods. One bound to a simulated node would be kwok's,
    which deletes a pod it saw terminating by name with no uid precondition; after a
    force delete, that late delete removed the new pod of the same name (about 1 run in
    20). A pod the scheduler serves, made after ours, is bound and started; ours is not."""
    if cluster.spec.nodes == 0:
        pytest.skip("no scheduler and no nodes (NEONVM_TEST_NODES=0)")
    service_account(api, namespace)
    pod(api, namespace, "vm-p")
    pods = f"/api/v1/namespaces/{namespace}/pods"
    kube.request(api, "POST", pods, body={
        "metadata": {"name": "scheduled"},
        "spec": {"serviceAccountName": ACCOUNT, "automountServiceAccountToken": False,
                 "containers": [{"name": "runner", "image": "neonvm-runner:test"}]}})
    wait_for(lambda: kube.request(api, "GET", f"{pods}/scheduled").get("status", {})
             .get("podIP"), timeout=60, what="the scheduled pod bound and started")
    ours = kube.request(api, "GET", f"{pods}/vm-p")
    assert (ours["spec"].get("nodeName"), ours["status"].get("podIP")) == (None, None)
    assert ours["spec"]["schedulerName"] == NO_SCHEDULER


def test_the_rights_token_is_no_credential_to_the_api_server(
        api: client.ApiClient, namespace: str) -> None:
    """Its audience is not the API server's: a runner (or a guest that escaped QEMU)
    holding it cannot act as the pod's ServiceAccount (401), where a token of the API
    server's audience for the same pod authenticates (403: RBAC grants it nothing)."""
    service_account(api, namespace)
    uid = pod(api, namespace, "vm-p")

    def status_as(token: str) -> int:
        configuration = client.Configuration()
        configuration.host = api.configuration.host
        configuration.ssl_ca_cert = api.configuration.ssl_ca_cert
        configuration.api_key = {"authorization": f"Bearer {token}"}
        with client.ApiClient(configuration) as as_runner, \
                pytest.raises(client.ApiException) as refused:
            kube.request(as_runner, "GET", f"/api/v1/namespaces/{namespace}/pods")
        return int(refused.value.status)

    assert status_as(mint(api, namespace, "vm-p", uid)) == 401
    assert status_as(mint(api, namespace, "vm-p", uid, audience=ISSUER)) == 403


def test_a_review_that_fails_grants_nothing_and_is_not_cached() -> None:
    calls: list[str] = []

    def failing(token: str, audience: str) -> dict[str, Any]:
        calls.append(token)
        raise OSError("connection refused")

    reviewer = TokenReviewer(None, AUDIENCE, review=failing, retry_after=0.0)
    token = _unsigned({"aud": [AUDIENCE], "exp": time.time() + 600,
                       "kubernetes.io": {"pod": {"uid": "u1"}}})
    for _ in range(2):
        with pytest.raises(OSError):
            reviewer.pod_of(token, "u1")
    assert len(calls) == 2


# ---- the review's answer, and the cache (pure logic) ------------------------------------


def _unsigned(claims: dict[str, Any]) -> str:
    import base64
    import json

    def part(doc: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()
    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2ln"


def _answer(**status: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "authenticated": True, "audiences": [AUDIENCE],
        "user": {"username": "system:serviceaccount:ns:runner",
                 "extra": {POD_NAME_EXTRA: ["vm-p"], POD_UID_EXTRA: ["u1"]}}}
    base.update(status)
    return {"status": base}


@pytest.mark.unit
@pytest.mark.parametrize(("answer", "pod_bound"), [
    (_answer(), ReviewedPod("ns", "vm-p", "u1")),
    (_answer(authenticated=False), None),
    (_answer(audiences=[]), None),  # an API server that ignores audiences
    (_answer(audiences=["other"]), None),
    (_answer(error="token expired"), None),
    (_answer(user={"username": "alice", "extra": {POD_NAME_EXTRA: ["vm-p"],
                                                  POD_UID_EXTRA: ["u1"]}}), None),
    (_answer(user={"username": "system:serviceaccount:ns:runner", "extra": {}}), None),
    (_answer(user={"username": "system:serviceaccount:ns:runner",
                   "extra": {POD_NAME_EXTRA: ["a", "b"], POD_UID_EXTRA: ["u1"]}}), None),
    ({}, None),
])
def test_only_an_authenticated_review_for_the_audience_binding_one_pod_names_it(
        answer: dict[str, Any], pod_bound: ReviewedPod | None) -> None:
    assert reviewed_pod(answer, AUDIENCE) == pod_bound


@pytest.mark.unit
def test_reviews_are_cached_per_token_for_a_bounded_time_and_number() -> None:
    now = [0.0]
    reviewed: list[str] = []

    def review(token: str, audience: str) -> dict[str, Any]:
        reviewed.append(token)
        good = str((unverified_claims(token) or {}).get("tag", "")).startswith("good")
        return _answer() if good else _answer(authenticated=False)

    reviewer = TokenReviewer(None, AUDIENCE, ttl=60.0, refused_ttl=10.0, max_entries=2,
                             budget=100, clock=lambda: now[0], wall=lambda: 1000.0 + now[0],
                             review=review)

    def token(tag: str, exp: float = 1000.0 + 600) -> str:
        return _unsigned({"aud": [AUDIENCE], "exp": exp, "tag": tag,
                          "kubernetes.io": {"pod": {"uid": "u1"}}})

    good = token("good")
    assert reviewer.pod_of(good, "u1") == ReviewedPod("ns", "vm-p", "u1")
    assert reviewer.pod_of(good, "u2") is None  # its claims name another pod: no review
    now[0] = 59.0
    assert reviewer.pod_of(good, "u1") is not None and len(reviewed) == 1
    now[0] = 60.0
    assert reviewer.pod_of(good, "u1") is not None and len(reviewed) == 2  # ttl over
    bad = token("bad")
    assert reviewer.pod_of(bad, "u1") is None and reviewer.pod_of(bad, "u1") is None
    assert len(reviewed) == 3
    now[0] = 70.0
    assert reviewer.pod_of(bad, "u1") is None and len(reviewed) == 4  # refused_ttl over
    # Never cached past half the token's remaining life.
    short = token("good-short", exp=1000.0 + now[0] + 20)
    reviewer.pod_of(short, "u1")
    now[0] = 79.0
    reviewer.pod_of(short, "u1")
    assert reviewed.count(short) == 1
    now[0] = 80.0
    reviewer.pod_of(short, "u1")
    assert reviewed.count(short) == 2
    # At most max_entries kept: the oldest goes first.
    for i in range(3):
        reviewer.pod_of(token(f"good-{i}"), "u1")
    reviewer.pod_of(token("good-0"), "u1")
    assert reviewed.count(token("good-0")) == 2


def _reviewer(now: list[float], answers: list[dict[str, Any] | Exception],
              **kwargs: Any) -> TokenReviewer:
    """A reviewer on a fake clock (wall = 1000 + monotonic) answering ``answers`` in turn."""
    def review(token: str, audience: str) -> dict[str, Any]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer
    return TokenReviewer(None, AUDIENCE, clock=lambda: now[0], wall=lambda: 1000.0 + now[0],
                         review=review, **kwargs)


def _token(tag: str = "", exp: float = 1600.0, uid: str = "u1") -> str:
    return _unsigned({"aud": [AUDIENCE], "exp": exp, "tag": tag,
                      "kubernetes.io": {"pod": {"uid": uid}}})


@pytest.mark.unit
def test_a_failed_review_falls_back_on_the_tokens_earlier_good_review_until_it_expires() -> None:
    """An API server outage longer than the cache's freshness does not end the rights of
    pods whose tokens were reviewed: the answer is kept, for the token it vouched for,
    until that token's verified expiry (docs/protocol.md, "Which credential")."""
    now = [0.0]
    token = _token()  # expires at wall 1600, 600 s from now
    outage = OSError("connection refused")
    reviewer = _reviewer(now, [_answer(), outage, outage, outage, outage], retry_after=0.0)
    assert reviewer.pod_of(token, "u1") == ReviewedPod("ns", "vm-p", "u1")
    now[0] = 250.0  # past the 240 s freshness: reviewed again, which fails
    assert reviewer.pod_of(token, "u1") == ReviewedPod("ns", "vm-p", "u1")
    now[0] = 599.0
    assert reviewer.pod_of(token, "u1") == ReviewedPod("ns", "vm-p", "u1")
    now[0] = 600.0  # the token's exp: nothing to fall back on
    with pytest.raises(OSError):
        reviewer.pod_of(token, "u1")
    with pytest.raises(OSError):
        reviewer.pod_of(_token(exp=1800.0), "u1")  # a token never reviewed has none
    assert reviewer.reviews == 5


@pytest.mark.unit
def test_after_a_review_gets_no_answer_none_is_sent_for_a_while() -> None:
    """An outage whose reviews time out must not hold every rights worker: for
    ``retry_after`` seconds no review is sent, a reviewed token is still granted, any
    other is refused at once. An error answer (it came back at once) pauses nothing."""
    now = [0.0]
    reviewer = _reviewer(now, [_answer(), OSError("timed out"), _answer(),
                               ApiException(status=429), _answer()], retry_after=5.0)
    reviewed = _token("reviewed")
    assert reviewer.pod_of(reviewed, "u1", "ns") is not None
    now[0] = 241.0
    assert reviewer.pod_of(reviewed, "u1", "ns") is not None  # the timeout: its old review
    with pytest.raises(OSError):
        reviewer.pod_of(_token("new"), "u1", "ns")  # sent for no review
    assert reviewer.reviews == 2
    now[0] = 246.0
    assert reviewer.pod_of(_token("new"), "u1", "ns") is not None
    with pytest.raises(ApiException):
        reviewer.pod_of(_token("odd"), "u1", "ns")
    assert reviewer.pod_of(_token("next", uid="u2"), "u2", "ns") is not None
    assert reviewer.reviews == 5


@pytest.mark.cluster
def test_a_review_outage_keeps_reviewed_tokens_granted_and_refuses_others_503(
        api: client.ApiClient, cluster: LocalCluster, namespace: str) -> None:
    """The leader keeps its term, its reviews get no answer (here: its client pointed at a
    closed port). A token it reviewed before is still granted; one it never reviewed
    gets 503, not a grant and not a 500 (docs/security.md, "A review outage")."""
    service_account(api, namespace)
    uid = pod(api, namespace, "vm-p")
    with kube.api_client(cluster.kubeconfig_for("controller")) as reviewing:
        # ttl 0: every ask is reviewed afresh; no pause after a failure.
        leader = ReviewingLeader(reviewing, reviewer=TokenReviewer(
            reviewing, AUDIENCE, ttl=0.0, retry_after=0.0))
        try:
            leader.show(namespace, "vm", "vm-p", uid)
            token = mint(api, namespace, "vm-p", uid)
            assert leader.ask(namespace, "vm", uid, token)[0] == 200
            with socket.socket() as closed:
                closed.bind(("127.0.0.1", 0))
                reviewing.configuration.host = f"https://127.0.0.1:{closed.getsockname()[1]}"
                assert leader.ask(namespace, "vm", uid, token)[0] == 200
                status, body = leader.ask(namespace, "vm", uid,
                                          mint(api, namespace, "vm-p", uid))
            assert (status, body["reason"]) == (503, REVIEW_UNAVAILABLE)
            assert leader.reviewer.reviews == 3
        finally:
            leader.close()


@pytest.mark.unit
def test_a_refusal_ends_the_fallback_and_a_spent_budget_uses_it() -> None:
    now = [0.0]
    token = _token()
    reviewer = _reviewer(now, [_answer(), _answer(authenticated=False), OSError("down")],
                         budget=2, window=60.0)
    assert reviewer.pod_of(token, "u1", "ns") is not None
    now[0] = 250.0
    assert reviewer.pod_of(token, "u1", "ns") is None  # the API server no longer vouches
    now[0] = 261.0  # the refusal's 10 s are over; the outage finds no good review to use
    with pytest.raises(OSError):
        reviewer.pod_of(token, "u1", "ns")



@pytest.mark.unit
def test_a_token_of_a_pod_shutting_down_is_decided_by_a_review_alone() -> None:
    """The API server voids a token 60 s past its pod's deletionTimestamp, which the
    issuer keys cannot tell: for such a pod (``locally=False``) a verdict of the keys,
    fresh or kept, answers nothing, not even in an outage; a review's does, cached and
    as the outage fallback (docs/protocol.md, "Which credential")."""
    now = [0.0]
    pod_bound = ReviewedPod("ns", "vm-p", "u1")
    token = _token()
    reviewer = _reviewer(now, [OSError("down"), _answer(), OSError("down")], retry_after=0.0,
                         verify=lambda _token: (True, pod_bound))
    assert reviewer.pod_of(token, "u1", "ns") == pod_bound  # running: the keys decide
    assert (reviewer.reviews, reviewer.verified) == (0, 1)
    with pytest.raises(OSError):  # shutting down: reviewed, and the review fails
        reviewer.pod_of(token, "u1", "ns", locally=False)
    assert reviewer.pod_of(token, "u1", "ns", locally=False) == pod_bound  # reviewed
    assert reviewer.pod_of(token, "u1", "ns", locally=False) == pod_bound  # cached
    now[0] = 250.0  # past the review's freshness; the review fails: the review holds
    assert reviewer.pod_of(token, "u1", "ns", locally=False) == pod_bound
    assert (reviewer.reviews, reviewer.verified) == (3, 1)


@pytest.mark.unit
def test_each_pod_has_a_review_budget_per_window_and_a_spent_one_uses_earlier_reviews() -> None:
    now = [0.0]
    reviewer = _reviewer(now, [_answer() for _ in range(5)], budget=2, window=60.0)
    kept = _token("kept")
    assert reviewer.pod_of(kept, "u1", "ns") is not None
    assert reviewer.pod_of(_token("second"), "u1", "ns") is not None
    with pytest.raises(ReviewBudgetSpent):
        reviewer.pod_of(_token("third"), "u1", "ns")
    assert reviewer.pod_of(_token("other pod", uid="u2"), "u2", "ns") is not None
    now[0] = 250.0  # a new window, spent on two new tokens
    assert reviewer.pod_of(_token("fourth"), "u1", "ns") is not None
    assert reviewer.pod_of(_token("fifth"), "u1", "ns") is not None
    # kept's answer is no longer fresh, and no review is left: its earlier review holds.
    assert reviewer.pod_of(kept, "u1", "ns") == ReviewedPod("ns", "vm-p", "u1")
    with pytest.raises(ReviewBudgetSpent):
        reviewer.pod_of(_token("sixth"), "u1", "ns")
    assert reviewer.reviews == 5


@pytest.mark.unit
def test_non_canonical_base64url_is_no_token() -> None:
    good = _token()
    header, payload, signature = good.split(".")
    assert unverified_claims(good) is not None
    for bad in (f"{header}.{payload}.{signature}=", f"{header}.{payload}=.{signature}",
                f"{header}.{payload}.c2m",  # its last character's unused low bits set
                f"{header}.{payload[:4]}\n{payload[4:]}.{signature}",
                f"{header}.{payload} .{signature}", f"{header}.{payload}.",
                f"{header}+.{payload}.{signature}", f"{header}.{payload}.c2ln/"):
        assert unverified_claims(bad) is None, bad


@pytest.mark.unit
def test_a_review_error_answers_503_not_a_grant() -> None:
    from neonvm.controller.rights import RightsLedger, RightsService, TokenCache
    from tests.support.rights_sa_token import vm_caches

    def failing(token: str, audience: str) -> dict[str, Any]:
        raise OSError("connection refused")

    ledger = RightsLedger()
    ledger.begin_term(lambda: True)
    service = RightsService(ledger, lambda: vm_caches("ns", "vm", "vm-p", "u1"),
                            TokenCache(None, read=lambda *_: None), lambda *_: True,
                            reviewer=TokenReviewer(None, AUDIENCE, review=failing))
    token = _unsigned({"aud": [AUDIENCE], "exp": time.time() + 600,
                       "kubernetes.io": {"pod": {"uid": "u1"}}})
    status, body = service.answer("POST", "/v1/rights", f"Bearer {token}",
                                  b'{"namespace":"ns","vm":"vm","podUID":"u1"}')
    assert (status, body["reason"]) == (503, REVIEW_UNAVAILABLE)
    assert not ledger.granted_this_term("u1")


@pytest.mark.unit
def test_reviews_that_fail_do_not_spend_the_pods_budget() -> None:
    """A burst of review errors (a new leader's first second under a struggling API
    server, the runner asking again within it) leaves the pod's budget whole: once the
    API server answers, the next ask is reviewed and granted, not refused 429 for the
    rest of the window, which outlasts the right (review-fixes M1)."""
    from neonvm.controller.rights import RightsLedger, RightsService, TokenCache
    from tests.support.rights_sa_token import vm_caches

    failing = [True]

    def review(token: str, audience: str) -> dict[str, Any]:
        if failing[0]:
            raise ApiException(status=500, reason="etcdserver: request timed out")
        return _answer()

    ledger = RightsLedger()
    ledger.begin_term(lambda: True)
    service = RightsService(ledger, lambda: vm_caches("ns", "vm", "vm-p", "u1"),
                            TokenCache(None, read=lambda *_: None), lambda *_: True,
                            reviewer=TokenReviewer(None, AUDIENCE, review=review, budget=4))
    token = _unsigned({"aud": [AUDIENCE], "exp": time.time() + 600,
                       "kubernetes.io": {"pod": {"uid": "u1"}}})

    def ask() -> tuple[int, str]:
        status, body = service.answer("POST", "/v1/rights", f"Bearer {token}",
                                      b'{"namespace":"ns","vm":"vm","podUID":"u1"}')
        return status, str(body.get("reason", ""))

    assert [ask() for _ in range(10)] == [(503, REVIEW_UNAVAILABLE)] * 10
    failing[0] = False
    assert ask()[0] == 200


@pytest.mark.unit
def test_no_answer_to_the_term_mark_or_the_token_read_is_a_503_not_a_500() -> None:
    """urllib3's errors for a request that got no answer are not OSErrors: the pod PATCH
    of the term mark and the HMAC path's Secret read answer 503 (ask again) for them, as
    for an error answer, instead of a 500 and a traceback per ask."""
    from urllib3.exceptions import MaxRetryError

    from neonvm.api.rights import authorization_header
    from neonvm.controller.rights import RightsLedger, RightsService, TokenCache
    from tests.support.rights import caches
    from tests.support.rights_sa_token import vm_caches

    def unreachable(*_: Any) -> Any:
        raise MaxRetryError(None, "/", "connection refused")  # type: ignore[arg-type]

    ledger = RightsLedger()
    ledger.begin_term(lambda: True)
    body = b'{"namespace":"ns","vm":"vm","podUID":"u1"}'
    hmac = authorization_header(b"tok", "u1")
    no_read = RightsService(ledger, lambda: caches(pod_uid="u1"),
                            TokenCache(None, read=unreachable), lambda *_: True)
    assert no_read.answer("POST", "/v1/rights", hmac, body)[0] == 503
    token = _unsigned({"aud": [AUDIENCE], "exp": time.time() + 600,
                       "kubernetes.io": {"pod": {"uid": "u1"}}})
    reviewer = TokenReviewer(None, AUDIENCE, review=lambda *_: _answer())
    no_mark = RightsService(ledger, lambda: vm_caches("ns", "vm", "vm-p", "u1"),
                            TokenCache(None, read=unreachable), unreachable,
                            reviewer=reviewer)
    assert no_mark.answer("POST", "/v1/rights", f"Bearer {token}", body)[0] == 503
    assert not ledger.granted_this_term("u1")


@pytest.mark.unit
def test_a_pod_built_before_the_audience_is_still_granted_by_its_scaling_tokens_hmac() -> None:
    """Accepting both credentials is what lets an upgrade keep its guests: a pod built by an
    earlier release asks with the HMAC, which is checked as before and never reviewed."""
    from neonvm.api.rights import authorization_header
    from neonvm.controller.rights import RightsLedger, RightsService, TokenCache
    from tests.support.rights import caches, secret

    def no_review(token: str, audience: str) -> dict[str, Any]:
        raise AssertionError("an HMAC bearer was sent for review")

    ledger = RightsLedger()
    ledger.begin_term(lambda: True)
    service = RightsService(ledger, lambda: caches(pod_uid="u1"),
                            TokenCache(None, read=lambda *_: secret(b"tok")), lambda *_: True,
                            reviewer=TokenReviewer(None, AUDIENCE, review=no_review))
    body = b'{"namespace":"ns","vm":"vm","podUID":"u1"}'
    assert service.answer("POST", "/v1/rights", authorization_header(b"tok", "u1"),
                          body)[0] == 200
    status, refused = service.answer("POST", "/v1/rights",
                                     authorization_header(b"other", "u1"), body)
    assert (status, refused["reason"]) == (401, UNAUTHORIZED)
