"""The right-to-run wire contract (neonvm.api.rights): the shapes both sides parse, the
bearer, and the leader's dead-for-sure time. The runner's use of it is in
``tests/test_runner_right.py``; the argument in docs/runner.md ("Self-fencing")."""

from __future__ import annotations

import math

import pytest

from neonvm.api import rights as r
from neonvm.api.scale_protocol import pod_token

pytestmark = pytest.mark.unit

UID = "0b8f3c1e-6a55-4d0c-9d0e-3f1c2b7a9e10"
TOKEN = b"secret-of-the-vm"


class TestBearer:
    def test_is_the_hmac_of_the_domain_and_the_uid(self) -> None:
        import hashlib
        import hmac
        expected = hmac.new(TOKEN, b"right:" + UID.encode(), hashlib.sha256).hexdigest()
        assert r.right_bearer(TOKEN, UID) == expected

    def test_differs_from_the_scale_bearer_of_the_same_pod(self) -> None:
        assert r.right_bearer(TOKEN, UID) != pod_token(TOKEN, UID)

    def test_a_scale_bearer_is_never_a_right_of_any_uid(self) -> None:
        # the only uid whose /scale bearer equals a right's is "right:<uid>", which no
        # request may name
        with pytest.raises(r.RightsContractError):
            r.RightRequest(namespace="ns", vm="vm", pod_uid="right:" + UID)
        assert not r.bearer_matches(f"Bearer {pod_token(TOKEN, UID)}", TOKEN, UID)

    def test_depends_on_token_and_uid(self) -> None:
        assert r.right_bearer(TOKEN, UID) != r.right_bearer(b"other", UID)
        assert r.right_bearer(TOKEN, UID) != r.right_bearer(TOKEN, UID + "x")

    @pytest.mark.parametrize("header, ok", [
        (f"Bearer {r.right_bearer(TOKEN, UID)}", True),
        (f"bearer  {r.right_bearer(TOKEN, UID)} ", True),
        (r.authorization_header(TOKEN, UID), True),
        (f"Basic {r.right_bearer(TOKEN, UID)}", False),
        (f"Bearer {r.right_bearer(TOKEN, UID)[::-1]}", False),
        (f"Bearer {r.right_bearer(b'other', UID)}", False),
        ("Bearer ", False),
        ("", False),
        (None, False),
    ])
    def test_matching_a_header(self, header: str | None, ok: bool) -> None:
        assert r.bearer_matches(header, TOKEN, UID) is ok


class TestRequest:
    def test_round_trips(self) -> None:
        req = r.RightRequest(namespace="ns", vm="vm", pod_uid=UID)
        assert req.to_dict() == {"namespace": "ns", "vm": "vm", "podUID": UID}
        assert r.RightRequest.from_dict(req.to_dict()) == req

    @pytest.mark.parametrize("doc", [
        None, [], "x",
        {"namespace": "ns", "vm": "vm"},
        {"namespace": "", "vm": "vm", "podUID": UID},
        {"namespace": "ns", "vm": 3, "podUID": UID},
        {"namespace": "ns", "vm": "vm", "podUID": ""},
        {"namespace": "ns", "vm": "vm", "podUID": "a:b"},
        {"namespace": "ns", "vm": "vm", "podUID": UID, "extra": 1},
    ])
    def test_refuses_a_malformed_body(self, doc: object) -> None:
        with pytest.raises(r.RightsContractError):
            r.RightRequest.from_dict(doc)


class TestGrant:
    @pytest.mark.parametrize("seconds", [30, 30.0, 0.5])
    def test_round_trips(self, seconds: float) -> None:
        grant = r.RightGrant.from_dict({"seconds": seconds})
        assert grant.seconds == float(seconds)
        assert r.RightGrant.from_dict(grant.to_dict()) == grant

    @pytest.mark.parametrize("doc", [
        None, {}, {"seconds": 0}, {"seconds": -1}, {"seconds": "30"}, {"seconds": True},
        {"seconds": math.inf}, {"seconds": math.nan}, {"seconds": 30, "until": 5},
        {"reason": "NotLeader"},
    ])
    def test_refuses_anything_but_positive_finite_seconds(self, doc: object) -> None:
        with pytest.raises(r.RightsContractError):
            r.RightGrant.from_dict(doc)


class TestRefusal:
    def test_round_trips(self) -> None:
        ref = r.RightRefusal(reason=r.NOT_LEADER, message="standby")
        assert r.RightRefusal.from_dict(ref.to_dict()) == ref
        assert r.RightRefusal.from_dict({"reason": r.NOT_LEADER}).message == ""

    @pytest.mark.parametrize("doc", [{}, {"reason": ""}, {"reason": "X", "message": 1},
                                     {"reason": "X", "extra": 1}])
    def test_refuses_a_malformed_body(self, doc: object) -> None:
        with pytest.raises(r.RightsContractError):
            r.RightRefusal.from_dict(doc)


class TestDeadForSure:
    def test_defaults(self) -> None:
        assert (r.DEFAULT_RIGHT_SECONDS, r.DEFAULT_RHO, r.DEFAULT_EPSILON) == (30.0, 0.05, 2.0)

    @pytest.mark.parametrize("issued, term_start, expected", [
        (100.0, 50.0, 100.0 + 31.5 + 2.0),   # this leader's own grant is the later
        (40.0, 50.0, 50.0 + 31.5 + 2.0),     # an earlier leader may have granted up to term start
    ])
    def test_counts_from_the_later_of_issue_and_term_start(
            self, issued: float, term_start: float, expected: float) -> None:
        assert r.dead_for_sure_after(issued, term_start, 30.0, 0.05, 2.0) == pytest.approx(
            expected)

    def test_is_after_the_runners_latest_possible_deadline(self) -> None:
        # the runner sent at t0 <= issued; its clock runs at least 1/(1+rho) of real time
        issued, seconds, rho = 10.0, 30.0, 0.05
        t0 = issued
        runner_deadline_real = t0 + seconds * (1 + rho)
        assert r.dead_for_sure_after(issued, 0.0, seconds, rho, 0.0) >= runner_deadline_real
        assert r.dead_for_sure_after(issued, 0.0, seconds, rho, 2.0) > runner_deadline_real

    @pytest.mark.parametrize("seconds, rho, eps", [(-1, 0.05, 2), (30, math.nan, 2),
                                                   (30, 0.05, math.inf)])
    def test_refuses_nonsense(self, seconds: float, rho: float, eps: float) -> None:
        with pytest.raises(r.RightsContractError):
            r.dead_for_sure_after(0.0, 0.0, seconds, rho, eps)


class TestTiming:
    def test_asks_three_times_per_right_each_within_a_sixth(self) -> None:
        assert r.renew_interval(30.0) == 10.0
        assert r.request_deadline(30.0) == 5.0

    @pytest.mark.parametrize("text, expected", [
        (None, None), ("30", 30.0), ("7.5", 7.5), ("0", None), ("-3", None), ("x", None),
        ("inf", None), ("nan", None)])
    def test_annotation(self, text: str | None, expected: float | None) -> None:
        assert r.parse_annotation(text) == expected

    def test_annotation_round_trips(self) -> None:
        assert r.annotation_value(30) == "30"
        assert r.parse_annotation(r.annotation_value(7.5)) == 7.5
        assert r.RIGHT_SECONDS_ANNOTATION == "vm.neon.tech/right-seconds"
        assert r.RIGHTS_PATH == "/v1/rights"


class TestGuestStarted:
    """An ask says its runner has started its guest in the request target's query, never
    in the body (a leader of the previous release refuses unknown body keys)."""

    def test_the_target_is_the_path_with_the_query_only_once_started(self) -> None:
        assert r.ask_target(False) == r.RIGHTS_PATH
        assert r.ask_target(True) == f"{r.RIGHTS_PATH}?{r.GUEST_STARTED_QUERY}"
        assert r.says_guest_started(r.ask_target(True))
        assert not r.says_guest_started(r.ask_target(False))

    @pytest.mark.parametrize(("target", "started"), [
        ("/v1/rights?guest=started", True),
        ("/v1/rights?x=1&guest=started", True),
        ("/v1/rights?guest=started#frag", True),
        ("/v1/rights", False),
        ("/v1/rights?", False),
        ("/v1/rights?guest=", False),
        ("/v1/rights?guest", False),
        ("/v1/rights?guest=Started", False),
        ("/v1/rights?guest=yes", False),
        ("/v1/rights?guest=started&guest=started", False),
        ("/v1/rights?guest=started&guest=no", False),
        ("/v1/rights?started", False),
        ("/v1/rights#guest=started", False),
    ])
    def test_anything_but_exactly_one_guest_started_says_not_started(
            self, target: str, started: bool) -> None:
        assert r.says_guest_started(target) is started

    def test_the_body_is_the_previous_releases_three_keys(self) -> None:
        # The query carries the news; the body a leader of any release parses is unchanged.
        doc = r.RightRequest(namespace="ns", vm="vm", pod_uid=UID).to_dict()
        assert set(doc) == {"namespace", "vm", "podUID"}
        with pytest.raises(r.RightsContractError, match="unknown fields"):
            r.RightRequest.from_dict({**doc, "guestStarted": True})
