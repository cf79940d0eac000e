"""The rights endpoint's token caches hold about what live pods use, not every token and
pod ever seen: under churn (every restart is a new pod uid, the kubelet rotates each
token) they would otherwise fill up with what can no longer answer an ask. A deleted
pod's answers and budgets are forgotten when the leader's informer reports it deleted;
expired answers, refusals, budget windows and token Secret reads are dropped at later
inserts. Their sizes are served as ``neonvm_controller_remembered_entries``
(docs/metrics.md).

Pure logic: a fake TokenReview, a fake clock (the wall clock 1000 s ahead of it), a fake
Secret read; the term's pod handler is fed the informer's deletion directly.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client

from neonvm.controller.config import ControllerConfig
from neonvm.controller.events import EventRecorder
from neonvm.controller.manager import LeaderTerm
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.rights import (
    POD_NAME_EXTRA,
    POD_UID_EXTRA,
    ReviewBudgetSpent,
    RightsLedger,
    TokenCache,
    TokenReviewer,
)
from neonvm.controller.wiring import Wiring
from neonvm.leader.election import Leadership
from tests.support import Clock
from tests.support.rights import secret

pytestmark = pytest.mark.unit

AUDIENCE = "vm.neon.tech/rights/ops/neonvm"
WALL = 1000.0
"""The wall clock runs this far ahead of the fake monotonic clock."""


def token(uid: str, tag: str = "", life: float = 600.0, now: float = 0.0) -> str:
    """An (unsigned) projected token of pod ``uid`` expiring ``life`` s after ``now``."""
    def part(doc: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()
    claims = {"aud": [AUDIENCE], "exp": WALL + now + life, "tag": tag,
              "kubernetes.io": {"pod": {"uid": uid}}}
    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2ln"


class Reviews:
    """The API server's TokenReviews: a token binds to the pod its claims name, unless
    its tag says ``bad``. Counts the reviews."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, token_: str, audience: str) -> dict[str, Any]:
        self.count += 1
        payload = token_.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        uid = claims["kubernetes.io"]["pod"]["uid"]
        return {"status": {
            "authenticated": claims["tag"] != "bad", "audiences": [AUDIENCE],
            "user": {"username": "system:serviceaccount:ns:runner",
                     "extra": {POD_NAME_EXTRA: [f"pod-{uid}"], POD_UID_EXTRA: [uid]}}}}


def reviewer(clock: Clock, reviews: Reviews, budget: int = 100) -> TokenReviewer:
    return TokenReviewer(None, AUDIENCE, clock=clock, wall=lambda: WALL + clock.now,
                         review=reviews, budget=budget, window=60.0)


# ---- a deleted pod ----------------------------------------------------------------------


def test_a_deleted_pods_answers_and_budgets_are_forgotten_and_only_its() -> None:
    clock, reviews = Clock(0.0), Reviews()
    tokens = reviewer(clock, reviews)
    # The pod "gone" with its token and the one the kubelet rotated it to; "kept".
    for uid, tag in [("gone", "1"), ("gone", "2"), ("kept", "")]:
        assert tokens.pod_of(token(uid, tag), uid, "ns") is not None
    assert (tokens.remembered_tokens(), tokens.remembered_budgets()) == (3, 2)
    tokens.forget_pod("ns", "gone")
    tokens.forget_pod("ns", "never-seen")
    assert (tokens.remembered_tokens(), tokens.remembered_budgets()) == (1, 1)
    assert tokens.pod_of(token("kept"), "kept", "ns") is not None
    assert reviews.count == 3  # the kept pod's answer still comes from the cache


def test_the_terms_pod_deletion_makes_the_reviewer_forget_the_pod() -> None:
    clock, reviews = Clock(0.0), Reviews()
    tokens = reviewer(clock, reviews)
    for uid in ("gone", "kept"):
        tokens.pod_of(token(uid), uid, "ns")
    term = a_term(tokens)
    term._on_pod("ns/pod-gone", pod("gone"), pod("gone"))  # an update: kept
    assert tokens.remembered_tokens() == 2
    term._on_pod("ns/pod-gone", pod("gone"), None)  # the informer's deletion
    assert (tokens.remembered_tokens(), tokens.remembered_budgets()) == (1, 1)


def pod(uid: str) -> dict[str, Any]:
    return {"metadata": {"name": f"pod-{uid}", "namespace": "ns", "uid": uid,
                         "labels": {"vm.neon.tech/name": "vm"}}}


def a_term(tokens: TokenReviewer) -> LeaderTerm:
    process = SimpleNamespace(
        config=ControllerConfig(workers=1), metrics=ControllerMetrics(),
        api=client.ApiClient(), wiring=Wiring(), events=EventRecorder(None), etcd=None,
        etcd_config=SimpleNamespace(prefix="/t"), old_crd_warned=threading.Event(),
        rights=RightsLedger(), fencing=None, rights_endpoint=None, rights_reviewer=tokens)
    leadership = Leadership(epoch=1, identity="me", valid_until=time.monotonic() + 3600)
    return LeaderTerm(process, leadership)  # type: ignore[arg-type]


# ---- what can no longer answer ----------------------------------------------------------


def test_answers_of_expired_tokens_are_dropped_by_a_later_insert() -> None:
    """Swept when the cache has doubled since the last sweep (64 entries at least), so
    each insert costs one entry looked at, on average."""
    clock, reviews = Clock(0.0), Reviews()
    tokens = reviewer(clock, reviews)
    lasting = token("lasting", life=7200.0)
    tokens.pod_of(lasting, "lasting", "ns")
    for i in range(63):
        tokens.pod_of(token(f"short-{i}", life=100.0), f"short-{i}", "ns")
    assert tokens.remembered_tokens() == 64
    clock.now = 200.0  # the short tokens have expired: no ask can use their answers
    tokens.pod_of(token("new", now=clock.now), "new", "ns")
    assert tokens.remembered_tokens() == 2
    before = reviews.count
    assert tokens.pod_of(lasting, "lasting", "ns") is not None
    assert reviews.count == before  # still answered from the cache


def test_refusals_are_dropped_once_over_at_the_next_refusal() -> None:
    clock, reviews = Clock(0.0), Reviews()
    tokens = reviewer(clock, reviews)
    for i in range(5):
        assert tokens.pod_of(token(f"p{i}", "bad"), f"p{i}", "ns") is None
    assert tokens.remembered_tokens() == 5
    clock.now = 10.0  # refused_ttl: none of them is refused from the cache any more
    assert tokens.pod_of(token("p5", "bad", now=clock.now), "p5", "ns") is None
    assert tokens.remembered_tokens() == 1


def test_review_budgets_whose_window_is_over_are_dropped_and_running_ones_still_count(
        ) -> None:
    clock, reviews = Clock(0.0), Reviews()
    tokens = reviewer(clock, reviews, budget=2)
    tokens.pod_of(token("early", "1"), "early", "ns")
    tokens.pod_of(token("early", "2"), "early", "ns")
    clock.now = 30.0
    tokens.pod_of(token("later", "1", now=clock.now), "later", "ns")
    clock.now = 61.0  # early's window is over, later's runs until 90
    tokens.pod_of(token("last", now=clock.now), "last", "ns")
    assert tokens.remembered_budgets() == 2
    tokens.pod_of(token("later", "2", now=clock.now), "later", "ns")
    with pytest.raises(ReviewBudgetSpent):
        tokens.pod_of(token("later", "3", now=clock.now), "later", "ns")
    assert tokens.pod_of(token("early", "3", now=clock.now), "early", "ns") is not None
    clock.now = 90.0
    assert tokens.pod_of(token("later", "4", now=clock.now), "later", "ns") is not None


def test_token_secrets_read_longer_ago_than_their_ttl_are_dropped_at_a_later_read() -> None:
    clock = Clock(0.0)
    secrets = TokenCache(None, ttl=600.0, refresh_after=10.0, clock=clock,
                         read=lambda _ns, _name: secret(b"tok"))
    for vm in ("a", "b", "c"):
        assert secrets.token("ns", f"tok-{vm}", "sec-uid") == b"tok"
    clock.now = 300.0
    assert secrets.token("ns", "tok-d", "sec-uid") == b"tok"
    clock.now = 600.0  # a, b and c were read 600 s ago: no ask can use them
    assert secrets.token("ns", "tok-e", "sec-uid") == b"tok"
    assert secrets.remembered() == 2


# ---- what a cached answer keeps of its token ---------------------------------------------


def test_a_cached_answer_keeps_no_part_of_the_token_its_minter_chose_in_bulk() -> None:
    """review7: whoever mints a runner's token (a tenant may, for its own pod) chooses its
    ``aud`` list; a cached answer that kept it cost 60 KB per token of a thousand
    audiences, so a few thousand such tokens, each asked once, would fill the leader's
    memory. Kept: two scalars (exp, pod uid). Measured with tracemalloc."""
    import gc
    import tracemalloc

    def fat(uid: str, tag: int) -> str:
        claims = {"aud": [AUDIENCE] + [f"a{n:03d}" for n in range(700)],
                  "exp": WALL + 600.0, "tag": str(tag),
                  "kubernetes.io": {"pod": {"uid": uid}}}
        def part(doc: dict[str, Any]) -> str:
            return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()
        return f"{part({'alg': 'RS256'})}.{part(claims)}.c2ln"

    clock, reviews = Clock(0.0), Reviews()
    tokens = reviewer(clock, reviews, budget=1000)
    fats = [fat("tenant", i) for i in range(50)]
    assert all(len(t) < 8192 for t in fats)  # fits in a request head
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for t in fats:
            assert tokens.pod_of(t, "tenant", "ns") is not None
        gc.collect()
        per_token = (tracemalloc.get_traced_memory()[0] - before) / len(fats)
    finally:
        tracemalloc.stop()
    assert per_token < 2048, f"{per_token:,.0f} bytes kept per cached token"
    # And the kept claims still decide a renewal as the token's own would.
    assert tokens.pod_of(fats[0], "tenant", "ns") is not None
    assert tokens.pod_of(fats[0], "other", "ns") is None
    clock.now = 600.0 + 121.0  # past exp plus the leeway
    assert tokens.pod_of(fats[0], "tenant", "ns") is None
