"""A runner's projected ServiceAccount token verified locally, with the API server's own
issuer keys (neonvm/controller/token_verify.py; docs/security.md, "Rights endpoint"):
the same pod a TokenReview gives for a good token, a refusal (None) for what the API
server would refuse, and :class:`Unverifiable` (a review decides) for what it cannot judge.

Real tokens from the session's API server (the TokenRequest API, bound to real pods, as
the kubelet mints a projected token), keys fetched from that API server as a
ServiceAccount (the chart's controller identity is one); forgeries signed with the
cluster's own service-account key where the API server would not issue the claims."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from kubernetes import client

from neonvm import kube
from neonvm.api.rights import UNAUTHORIZED
from neonvm.controller.rights import TokenReviewer, reviewed_pod
from neonvm.controller.token_verify import (
    DISCOVERY_PATH,
    JWKS_PATH,
    TokenVerifier,
    Unverifiable,
)
from neonvm.dev.cluster import LocalCluster
from tests.support.rights_sa_token import (
    ACCOUNT,
    AUDIENCE,
    ISSUER,
    ReviewingLeader,
    mint,
    pod,
    service_account,
)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def parts(token: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """A token's header and claims (decoded, unverified) and its signature part."""
    head, body, sig = token.split(".")
    return (json.loads(base64.urlsafe_b64decode(head + "==")),
            json.loads(base64.urlsafe_b64decode(body + "==")), sig)


def signed(key: rsa.RSAPrivateKey, header: dict[str, Any], claims: dict[str, Any]) -> str:
    """``header`` and ``claims`` signed RS256 with ``key``."""
    signing = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
    signature = key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
    return f"{signing}.{b64(signature)}"


@dataclass(frozen=True)
class Bound:
    """A real runner-like pod in a namespace of its own, and a token minted for it."""

    namespace: str
    pod: str
    uid: str
    token: str


@pytest.fixture(scope="module")
def bound(api: client.ApiClient) -> Iterator[Bound]:
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    kube.request(api, "POST", "/api/v1/namespaces", body={"metadata": {"name": namespace}})
    service_account(api, namespace)
    uid = pod(api, namespace, "vm-p")
    yield Bound(namespace, "vm-p", uid, mint(api, namespace, "vm-p", uid))
    kube.request(api, "DELETE", f"/api/v1/namespaces/{namespace}")


@pytest.fixture(scope="module")
def account_api(api: client.ApiClient, cluster: LocalCluster,
                bound: Bound) -> Iterator[client.ApiClient]:
    """A client as a ServiceAccount with no RBAC of its own, as the chart's controller
    runs: only Kubernetes' default bindings apply to it."""
    token = mint_api_token(api, bound.namespace)
    cfg = client.Configuration(host=cluster.api_url)
    cfg.ssl_ca_cert = str(cluster.state_dir / "pki" / "ca.crt")
    cfg.api_key = {"authorization": token}
    cfg.api_key_prefix = {"authorization": "Bearer"}
    account = client.ApiClient(cfg)
    yield account
    account.close()


def mint_api_token(api: client.ApiClient, namespace: str) -> str:
    """A token of the API server's own audience for a ServiceAccount of ``namespace``."""
    service_account(api, namespace, "controller")
    answer = kube.request(
        api, "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/controller/token",
        body={"spec": {"audiences": [ISSUER], "expirationSeconds": 600}})
    return str(answer["status"]["token"])


@pytest.fixture(scope="module")
def verifier(account_api: client.ApiClient) -> TokenVerifier:
    verifier = TokenVerifier(account_api, AUDIENCE)
    assert verifier.load()
    return verifier


@pytest.fixture(scope="module")
def sa_key(cluster: LocalCluster) -> rsa.RSAPrivateKey:
    """The cluster's service-account signing key (to forge what it would not issue)."""
    key = serialization.load_pem_private_key(
        (cluster.state_dir / "pki" / "sa.key").read_bytes(), password=None)
    assert isinstance(key, rsa.RSAPrivateKey)
    return key


# ---- the keys ------------------------------------------------------------------------------


def test_a_service_account_reads_the_issuer_keys_through_the_default_binding(
        api: client.ApiClient, account_api: client.ApiClient) -> None:
    """The chart's controller is a ServiceAccount: Kubernetes' own
    ``system:service-account-issuer-discovery`` binding lets it read the discovery document
    and the JWKS, with no rule of the chart's."""
    discovery = kube.request(account_api, "GET", DISCOVERY_PATH)
    assert discovery["issuer"] == ISSUER
    jwks = kube.request(account_api, "GET", JWKS_PATH, accept="application/jwk-set+json")
    assert [k["alg"] for k in jwks["keys"]] == ["RS256"]
    binding = kube.request(api, "GET", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/"
                           "system:service-account-issuer-discovery")
    assert binding["subjects"] == [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group",
                                    "name": "system:serviceaccounts"}]


def test_the_local_controller_identity_reads_the_keys_by_its_own_rule(
        controller_api: client.ApiClient, bound: Bound) -> None:
    """The local cluster's controller is a certificate user, outside that binding: its
    ClusterRole names the two URLs (neonvm/manifests.py, ``self_fencing_rules``)."""
    assert TokenVerifier(controller_api, AUDIENCE).verify(bound.token) is not None


def test_an_identity_refused_the_keys_leaves_every_token_to_a_review(
        account_api: client.ApiClient, bound: Bound) -> None:
    """No keys (every fetch fails): a good token is Unverifiable, not refused."""

    def refused(_path: str, _accept: str) -> dict[str, Any]:
        raise OSError("403")

    verifier = TokenVerifier(account_api, AUDIENCE, fetch=refused)
    assert not verifier.load()
    with pytest.raises(Unverifiable):
        verifier.verify(bound.token)
    assert verifier.decide(bound.token) == (False, None)


# ---- verified --------------------------------------------------------------------------------


def test_a_minted_token_verifies_to_the_pod_a_review_binds_it_to(
        controller_api: client.ApiClient, verifier: TokenVerifier, bound: Bound) -> None:
    review = TokenReviewer(controller_api, AUDIENCE)._api_review(bound.token, AUDIENCE)
    by_review = reviewed_pod(review, AUDIENCE)
    assert by_review is not None
    assert verifier.verify(bound.token) == by_review
    assert verifier.decide(bound.token) == (True, by_review)
    assert (by_review.namespace, by_review.name, by_review.uid) == (
        bound.namespace, bound.pod, bound.uid)


def test_lifetime_is_judged_with_the_api_servers_60_s_of_skew_and_beyond_it_by_a_review(
        account_api: client.ApiClient, bound: Bound) -> None:
    """Beyond the skew the token is left to a review, not refused: the API server judges
    lifetimes by its own clock, and a leader whose clock is off must not refuse every
    fresh token for it."""
    _, claims, _ = parts(bound.token)

    def at(wall: float) -> Any:
        return TokenVerifier(account_api, AUDIENCE, wall=lambda: wall).decide(bound.token)

    assert at(claims["exp"] + 59)[1] is not None
    assert at(claims["exp"] + 61) == (False, None)  # expired by this clock: a review decides
    assert at(claims["nbf"] - 59)[1] is not None
    assert at(claims["nbf"] - 61) == (False, None)  # not yet valid by this clock: likewise


# ---- refused ---------------------------------------------------------------------------------


@pytest.mark.parametrize("audience", ["vm.neon.tech/rights/other/nvm-neonvm-controller", ISSUER])
def test_a_token_of_another_audience_is_refused(
        api: client.ApiClient, verifier: TokenVerifier, bound: Bound, audience: str) -> None:
    """Another release's rights audience, or the API server's own."""
    token = mint(api, bound.namespace, bound.pod, bound.uid, audience=audience)
    assert verifier.verify(token) is None


def test_a_token_not_bound_to_a_pod_is_refused(
        api: client.ApiClient, verifier: TokenVerifier, bound: Bound) -> None:
    answer = kube.request(
        api, "POST", f"/api/v1/namespaces/{bound.namespace}/serviceaccounts/{ACCOUNT}/token",
        body={"spec": {"audiences": [AUDIENCE], "expirationSeconds": 600}})
    assert verifier.verify(answer["status"]["token"]) is None


def test_a_tampered_payload_is_refused(verifier: TokenVerifier, bound: Bound) -> None:
    """Another pod's uid put in the claims, the API server's signature kept."""
    _, claims, sig = parts(bound.token)
    claims["kubernetes.io"]["pod"]["uid"] = str(uuid.uuid4())
    assert verifier.verify(f"{bound.token.split('.')[0]}.{b64(json.dumps(claims).encode())}."
                           f"{sig}") is None


def test_a_tampered_signature_is_refused(verifier: TokenVerifier, bound: Bound) -> None:
    head, body, sig = bound.token.split(".")
    raw = bytearray(base64.urlsafe_b64decode(sig + "=="))
    raw[len(raw) // 2] ^= 1
    assert verifier.verify(f"{head}.{body}.{b64(bytes(raw))}") is None
    assert verifier.decide(f"{head}.{body}.{b64(bytes(raw))}") == (True, None)


def test_alg_none_and_hs256_keyed_with_the_public_key_are_refused(
        verifier: TokenVerifier, bound: Bound) -> None:
    """The classic confusions: no signature, or an HMAC whose secret is the public key
    (PEM, and the JWK as served), each with the key's own kid."""
    header, _, _ = parts(bound.token)
    _, body, _ = bound.token.split(".")
    held = verifier.keys
    assert held is not None
    public = held.keys[header["kid"]].key
    pem = public.public_bytes(serialization.Encoding.PEM,
                              serialization.PublicFormat.SubjectPublicKeyInfo)
    for alg in ("none", "None", "NONE"):
        head = b64(json.dumps({"alg": alg, "kid": header["kid"]}).encode())
        assert verifier.verify(f"{head}.{body}.") is None
        assert verifier.verify(f"{head}.{body}.AAAA") is None
    for secret in (pem, pem.strip(), json.dumps(header).encode()):
        head = b64(json.dumps({"alg": "HS256", "kid": header["kid"]}).encode())
        mac = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
        assert verifier.verify(f"{head}.{body}.{b64(mac)}") is None


def test_an_unlisted_key_is_never_trusted_and_refetched_at_most_once_per_interval(
        account_api: client.ApiClient, bound: Bound) -> None:
    """A forger's own key under a kid of its choice: Unverifiable (a review decides), and
    however many such tokens come, the JWKS is fetched again at most once per 10 s."""
    now = [1000.0]
    verifier = TokenVerifier(account_api, AUDIENCE, clock=lambda: now[0])
    assert verifier.load() and verifier.fetches == 1
    _, claims, _ = parts(bound.token)
    own = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    forgeries = [signed(own, {"alg": "RS256", "kid": f"kid-{i}"}, claims) for i in range(20)]
    for token in forgeries:
        with pytest.raises(Unverifiable):
            verifier.verify(token)
    assert verifier.fetches == 1  # within 10 s of the load
    now[0] += 10.0
    for token in forgeries:
        with pytest.raises(Unverifiable):
            verifier.verify(token)
    assert verifier.fetches == 2
    # Under the API server's own kid, the forger's key signs nothing that verifies.
    header, _, _ = parts(bound.token)
    assert verifier.verify(signed(own, header, claims)) is None
    assert verifier.verify(bound.token) is not None
    assert verifier.fetches == 2


def test_claims_the_api_server_signed_otherwise_are_refused_or_left_to_a_review(
        verifier: TokenVerifier, bound: Bound, sa_key: rsa.RSAPrivateKey) -> None:
    """Signed with the cluster's own key (so only the claims are wrong): bound to a Secret,
    to no ServiceAccount, a subject that is not the ServiceAccount's: refused; another
    issuer (an API server may accept several): a review decides."""
    header, claims, _ = parts(bound.token)
    assert verifier.verify(signed(sa_key, header, claims)) is not None  # the control

    def variant(**change: Any) -> str:
        k8s = dict(claims["kubernetes.io"], **change.pop("k8s", {}))
        return signed(sa_key, header, dict(claims, **change, **{"kubernetes.io": k8s}))

    assert verifier.verify(variant(k8s={"secret": {"name": "s", "uid": "u"}})) is None
    assert verifier.verify(variant(k8s={"serviceaccount": {}})) is None
    assert verifier.verify(variant(k8s={"pod": {"name": "vm-p"}})) is None
    assert verifier.verify(variant(sub="system:serviceaccount:kube-system:admin")) is None
    assert verifier.verify(variant(exp="9999999999")) is None
    assert verifier.verify(variant(exp=True)) is None
    with pytest.raises(Unverifiable):
        verifier.verify(variant(iss="https://issuer.example"))
    with pytest.raises(Unverifiable):  # a header naming a key of its own
        verifier.verify(signed(sa_key, dict(header, jwk={"kty": "RSA"}), claims))
    with pytest.raises(Unverifiable):
        verifier.verify(signed(sa_key, {"alg": "RS256"}, claims))  # no kid


def test_only_the_canonical_spelling_of_a_token_verifies(
        verifier: TokenVerifier, bound: Bound) -> None:
    """The API server accepts re-spellings of one token (unused low bits of the
    signature's last character, padding, line breaks); here only the canonical one."""
    head, body, sig = bound.token.split(".")
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    low_bits = alphabet[alphabet.index(sig[-1]) ^ 1]
    for respelt in (f"{head}.{body}.{sig[:-1]}{low_bits}", f"{head}.{body}.{sig}==",
                    f"{head}.{body}\n.{sig}", f"{head}.{body[:10]}\r{body[10:]}.{sig}",
                    f"{head}=.{body}.{sig}", f"{head}.{body}.{sig}.", f" {bound.token}"):
        assert verifier.verify(respelt) is None, respelt
    assert verifier.verify(bound.token) is not None


# ---- the keys' shapes (no server) -------------------------------------------------------------


@pytest.mark.unit
def test_an_es256_key_verifies_its_tokens_and_no_other_shape() -> None:
    """An API server with an ECDSA P-256 key signs ES256: r and s of 32 bytes each."""
    key = ec.generate_private_key(ec.SECP256R1())
    numbers = key.public_key().public_numbers()
    jwk = {"kty": "EC", "crv": "P-256", "kid": "ec", "alg": "ES256", "use": "sig",
           "x": b64(numbers.x.to_bytes(32, "big")), "y": b64(numbers.y.to_bytes(32, "big"))}
    answers: dict[str, dict[str, Any]] = {DISCOVERY_PATH: {"issuer": ISSUER,
                                "id_token_signing_alg_values_supported": ["ES256"]},
               JWKS_PATH: {"keys": [jwk]}}
    verifier = TokenVerifier(None, AUDIENCE, fetch=lambda path, _accept: answers[path])
    now = time.time()
    claims = {"aud": [AUDIENCE], "exp": now + 600, "nbf": now, "iat": now, "iss": ISSUER,
              "sub": "system:serviceaccount:ns:runner",
              "kubernetes.io": {"namespace": "ns", "pod": {"name": "p", "uid": "u"},
                                "serviceaccount": {"name": "runner", "uid": "sa"}}}
    signing = f"{b64(json.dumps({'alg': 'ES256', 'kid': 'ec'}).encode())}." \
              f"{b64(json.dumps(claims).encode())}"
    r, s = decode_dss_signature(key.sign(signing.encode(), ec.ECDSA(hashes.SHA256())))
    raw = r.to_bytes(32, "big") + s.to_bytes(32, "big")
    good = verifier.verify(f"{signing}.{b64(raw)}")
    assert good is not None and (good.namespace, good.name, good.uid) == ("ns", "p", "u")
    der = key.sign(signing.encode(), ec.ECDSA(hashes.SHA256()))
    assert verifier.verify(f"{signing}.{b64(der)}") is None  # DER is not the JWS form
    assert verifier.verify(f"{signing}.{b64(raw[:-1])}") is None
    # Signed by that key, but the header names another algorithm than the key's.
    rs256 = signing.replace(signing.split(".")[0],
                            b64(json.dumps({"alg": "RS256", "kid": "ec"}).encode()))
    r, s = decode_dss_signature(key.sign(rs256.encode(), ec.ECDSA(hashes.SHA256())))
    assert verifier.verify(f"{rs256}.{b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}") \
        is None


@pytest.mark.unit
def test_no_keys_fetched_means_unverifiable_and_a_failed_refresh_keeps_the_last_keys() -> None:
    now = [0.0]
    answers: dict[str, Any] = {}

    def fetch(path: str, _accept: str) -> dict[str, Any]:
        if not answers:
            raise OSError("connection refused")
        return dict(answers[path])

    verifier = TokenVerifier(None, AUDIENCE, clock=lambda: now[0], fetch=fetch)
    assert not verifier.load()
    header = b64(json.dumps({"alg": "RS256", "kid": "k"}).encode())
    with pytest.raises(Unverifiable):
        verifier.verify(f"{header}.e30.AAAA")
    own = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    numbers = own.public_key().public_numbers()
    answers.update({DISCOVERY_PATH: {"issuer": ISSUER}, JWKS_PATH: {"keys": [
        {"kty": "RSA", "kid": "k", "alg": "RS256", "use": "sig",
         "n": b64(numbers.n.to_bytes(256, "big")), "e": b64(numbers.e.to_bytes(3, "big"))}]}})
    now[0] += 10
    assert verifier.load() and verifier.keys is not None
    answers.clear()
    now[0] += 300  # stale: a refresh is tried, fails, and the keys fetched before stay
    assert verifier.load() and verifier.fetches == 3
    assert verifier.keys is not None and "k" in verifier.keys.keys


@pytest.mark.unit
def test_a_signed_huge_exp_and_a_jwks_of_another_shape_are_left_to_a_review() -> None:
    """Neither raises out of ``decide``: an exception there would be a 500 and a
    traceback per ask; a review decides instead."""
    key = ec.generate_private_key(ec.SECP256R1())
    numbers = key.public_key().public_numbers()
    jwk = {"kty": "EC", "crv": "P-256", "kid": "ec", "alg": "ES256", "use": "sig",
           "x": b64(numbers.x.to_bytes(32, "big")), "y": b64(numbers.y.to_bytes(32, "big"))}
    answers: dict[str, Any] = {DISCOVERY_PATH: {"issuer": ISSUER,
                               "id_token_signing_alg_values_supported": ["ES256"]},
                               JWKS_PATH: {"keys": [jwk]}}
    verifier = TokenVerifier(None, AUDIENCE, fetch=lambda path, _accept: answers[path])
    claims = {"aud": [AUDIENCE], "exp": 10**400, "iss": ISSUER,
              "sub": "system:serviceaccount:ns:runner",
              "kubernetes.io": {"namespace": "ns", "pod": {"name": "p", "uid": "u"},
                                "serviceaccount": {"name": "runner", "uid": "sa"}}}
    signing = f"{b64(json.dumps({'alg': 'ES256', 'kid': 'ec'}).encode())}." \
              f"{b64(json.dumps(claims).encode())}"
    r, s = decode_dss_signature(key.sign(signing.encode(), ec.ECDSA(hashes.SHA256())))
    token = f"{signing}.{b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"
    assert verifier.decide(token) == (True, None)  # signed, but no usable exp: refused
    shapes: dict[str, Any] = {DISCOVERY_PATH: ["not", "a", "document"],
                              JWKS_PATH: {"keys": [{"crv": []}]}}
    odd = TokenVerifier(None, AUDIENCE, fetch=lambda path, _accept: shapes[path])
    assert odd.decide(token) == (False, None)


@pytest.mark.unit
@pytest.mark.parametrize("answers", [
    {DISCOVERY_PATH: ["not", "a", "document"], JWKS_PATH: {"keys": []}},
    {DISCOVERY_PATH: {"issuer": ISSUER}, JWKS_PATH: "keys"},
    {DISCOVERY_PATH: {"issuer": ISSUER},
     JWKS_PATH: {"keys": [{"kid": "k", "kty": "EC", "crv": []}]}},
    {DISCOVERY_PATH: {"issuer": ISSUER}},  # the fetch itself raises an unexpected KeyError
], ids=["discovery-a-list", "jwks-a-string", "jwk-unhashable-curve", "fetch-raises"])
def test_load_at_start_up_never_raises_an_odd_answer_leaves_no_keys(
        answers: dict[str, Any]) -> None:
    """The controller loads the keys at start-up outside any handler
    (neonvm/cli/controller.py): an answer of another shape must leave the verifier
    without keys (every token then goes to a review), not stop the process."""
    verifier = TokenVerifier(None, AUDIENCE, fetch=lambda path, _accept: answers[path])
    assert not verifier.load()
    assert verifier.keys is None and verifier.fetches == 1
    header = b64(json.dumps({"alg": "RS256", "kid": "k"}).encode())
    assert verifier.decide(f"{header}.e30.AAAA") == (False, None)


# ---- wired into the rights endpoint ----------------------------------------------------------


@pytest.fixture
def wired(controller_api: client.ApiClient,
          account_api: client.ApiClient) -> Iterator[ReviewingLeader]:
    reviewer = TokenReviewer(controller_api, AUDIENCE,
                             verify=TokenVerifier(account_api, AUDIENCE).decide)
    served = ReviewingLeader(controller_api, reviewer)
    yield served
    served.close()


def test_a_term_s_first_ask_with_a_good_token_is_granted_with_no_review(
        wired: ReviewingLeader, bound: Bound) -> None:
    """Verified locally once, then served from the cache as a good review would be."""
    wired.show(bound.namespace, "vm", bound.pod, bound.uid)
    for _ in range(3):
        assert wired.ask(bound.namespace, "vm", bound.uid, bound.token)[0] == 200
    assert (wired.reviewer.reviews, wired.reviewer.verified) == (0, 1)


def test_a_token_refused_locally_costs_no_review(wired: ReviewingLeader, bound: Bound) -> None:
    wired.show(bound.namespace, "vm", bound.pod, bound.uid)
    head, body, sig = bound.token.split(".")
    raw = bytearray(base64.urlsafe_b64decode(sig + "=="))
    raw[0] ^= 1
    status, answer = wired.ask(bound.namespace, "vm", bound.uid, f"{head}.{body}.{b64(bytes(raw))}")
    assert (status, answer["reason"]) == (401, UNAUTHORIZED)
    assert (wired.reviewer.reviews, wired.reviewer.verified) == (0, 1)


def test_a_forged_token_with_an_exp_beyond_a_float_is_refused_not_an_error(
        wired: ReviewingLeader, bound: Bound) -> None:
    """Nothing is computed from a refused token's unverified claims: a forger's
    ``exp`` of 10**400 (under the key's real kid, the signature garbage) is a 401, not a
    500 and a traceback per ask."""
    wired.show(bound.namespace, "vm", bound.pod, bound.uid)
    head, _body, sig = bound.token.split(".")
    claims = parts(bound.token)[1] | {"exp": 10**400}
    forged = f"{head}.{b64(json.dumps(claims).encode())}.{sig}"
    for _ in range(2):
        status, answer = wired.ask(bound.namespace, "vm", bound.uid, forged)
        assert (status, answer["reason"]) == (401, UNAUTHORIZED)
    assert wired.answered(500) == 0 and wired.reviewer.reviews == 0


def test_a_pod_shutting_down_has_its_token_reviewed(wired: ReviewingLeader, bound: Bound) -> None:
    """The API server voids a pod's token 60 s past its deletionTimestamp; the local keys
    cannot see that, so such a pod's asks go to a review, even for a token the keys
    verified (and the leader cached) while the pod ran."""
    wired.show(bound.namespace, "vm", bound.pod, bound.uid)
    assert wired.ask(bound.namespace, "vm", bound.uid, bound.token)[0] == 200
    assert (wired.reviewer.reviews, wired.reviewer.verified) == (0, 1)
    assert wired.caches is not None
    pod_cache = wired.caches[1][f"{bound.namespace}/{bound.pod}"]
    pod_cache["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    for _ in range(2):  # reviewed once, then its review's answer is cached
        assert wired.ask(bound.namespace, "vm", bound.uid, bound.token)[0] == 200
    assert (wired.reviewer.reviews, wired.reviewer.verified) == (1, 1)


def _granted_once(api: client.ApiClient, verifier: TokenVerifier,
                  bound: Bound) -> tuple[int, int]:
    """Ask once for ``bound``'s pod from a leader whose reviewer verifies with
    ``verifier`` first; granted (200), and the reviewer's (reviews, verified) after it."""
    reviewer = TokenReviewer(api, AUDIENCE, verify=verifier.decide)
    served = ReviewingLeader(api, reviewer)
    try:
        served.show(bound.namespace, "vm", bound.pod, bound.uid)
        assert served.ask(bound.namespace, "vm", bound.uid, bound.token)[0] == 200
        return reviewer.reviews, reviewer.verified
    finally:
        served.close()


def test_without_keys_every_token_is_reviewed(
        controller_api: client.ApiClient, bound: Bound) -> None:
    def refused(_path: str, _accept: str) -> dict[str, Any]:
        raise OSError("no route")

    verifier = TokenVerifier(None, AUDIENCE, fetch=refused)
    assert _granted_once(controller_api, verifier, bound) == (1, 0)  # (reviews, verified)


def test_a_leader_clock_far_behind_sends_a_good_token_to_a_review_not_a_refusal(
        controller_api: client.ApiClient, account_api: client.ApiClient, bound: Bound) -> None:
    """The API server sets ``nbf`` and ``iat`` by its own clock: a leader whose wall clock
    is behind by more than the 60 s skew (here an hour, so the token, minted within the
    module's run, is surely ahead of it) cannot judge the token, so a review does."""
    slow = TokenVerifier(account_api, AUDIENCE, wall=lambda: time.time() - 3600)
    assert _granted_once(controller_api, slow, bound) == (1, 0)  # (reviews, verified)
