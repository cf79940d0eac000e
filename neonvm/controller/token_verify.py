"""Local verification of a runner's projected ServiceAccount token, against the API
server's own service-account issuer keys: what a TokenReview says of such a token's
signature, issuer, audience, lifetime and pod, without a request per token.

The keys come from the API server itself, over the controller's authenticated client:
its OIDC discovery document (``/.well-known/openid-configuration``: the issuer and the
signing algorithms) and its JWKS (``/openid/v1/jwks``). Kubernetes lets every
ServiceAccount read both (the default ``system:service-account-issuer-discovery``
binding); another identity needs ``get`` on those two non-resource URLs.

:meth:`TokenVerifier.verify` answers in three ways: the pod the token is bound to (a
:class:`~neonvm.controller.rights.ReviewedPod`, as :func:`~neonvm.controller.rights.reviewed_pod`
gives for a TokenReview), None (refused: the API server would refuse it too), or
:class:`Unverifiable` (this verifier cannot decide: no keys, a key it does not know, an
issuer or algorithm it does not handle; ask the API server by a TokenReview).

What a review checks and this does not: that the token's pod and ServiceAccount still
exist with its uids and were not deleted more than 60 s ago. The rights endpoint's
current-pod test (the pod's uid is the VM's current pod in the leader's cache) covers a
pod gone or replaced, not a pod shutting down (it grants those), and nothing here covers
a deleted ServiceAccount. The rights endpoint's :class:`~neonvm.controller.rights.TokenReviewer`
asks :meth:`TokenVerifier.decide` before any review, and decides a shutting-down pod's
token by a review alone (docs/security.md, "Rights endpoint"; docs/protocol.md, "Which
credential").
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from kubernetes import client
from loguru import logger

from neonvm import kube
from neonvm.controller.rights import ReviewedPod, _canonical_part, claim_number

DISCOVERY_PATH = "/.well-known/openid-configuration"
JWKS_PATH = "/openid/v1/jwks"
JWKS_TYPE = "application/jwk-set+json"
"""The API server answers the JWKS only to this ``Accept`` (406 to application/json)."""

MAX_TOKEN = 8192
"""The longest token looked at (a projected token is about 1 KiB)."""
MIN_RSA_BITS = 2048

_HASHES: dict[str, Callable[[], hashes.HashAlgorithm]] = {
    "256": hashes.SHA256, "384": hashes.SHA384, "512": hashes.SHA512}
_CURVES: dict[str, tuple[str, type[ec.EllipticCurve], int]] = {
    # JWK crv -> (its JWS alg, the curve, bytes per coordinate)
    "P-256": ("ES256", ec.SECP256R1, 32),
    "P-384": ("ES384", ec.SECP384R1, 48),
    "P-521": ("ES512", ec.SECP521R1, 66),
}
ALGORITHMS = frozenset({"RS256", "RS384", "RS512", "ES256", "ES384", "ES512"})
"""The asymmetric algorithms a Kubernetes API server signs ServiceAccount tokens with
(RS256 for an RSA key, ES256/384/512 for an ECDSA key); the discovery document narrows
them further. ``none`` and HMAC (``HS*``) are refused outright."""
_HEADER_FIELDS = frozenset({"alg", "kid", "typ"})
"""The header fields the API server writes. Any other (``jwk``, ``jku``, ``x5c``,
``crit``...) makes the token :class:`Unverifiable` here: keys come from the JWKS alone."""

Clock = Callable[[], float]
Fetch = Callable[[str, str], dict[str, Any]]
"""(path, Accept) -> the API server's JSON answer (any JSON value); raises when there is
none (any exception: the keys stay as they were)."""


class Unverifiable(Exception):
    """The token cannot be judged locally (no keys, an unknown ``kid``, another issuer or
    algorithm): not a refusal; a TokenReview decides."""


@dataclass(frozen=True)
class _Key:
    alg: str
    key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey
    size: int = 0
    """An ECDSA key's bytes per coordinate (a JWS signature is r and s, each this long)."""


@dataclass(frozen=True)
class KeySet:
    """The API server's issuer and signing keys (by ``kid``), as last fetched."""

    issuer: str
    keys: Mapping[str, _Key]
    fetched: float
    """When, on the verifier's monotonic clock."""


def _json_object(raw: bytes) -> dict[str, Any] | None:
    """``raw`` as a JSON object with no repeated key, else None."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(items)
        if len(out) != len(items):
            raise ValueError("a repeated key")
        return out

    try:
        value = json.loads(raw, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _uint(text: Any) -> int | None:
    """A JWK's base64url big-endian unsigned integer, canonical only."""
    raw = _canonical_part(text) if isinstance(text, str) else None
    return int.from_bytes(raw, "big") if raw else None


def _jwk(jwk: Any, algorithms: frozenset[str]) -> tuple[str, _Key] | None:
    """One JWK as (kid, key) if it is a signing key of an algorithm in ``algorithms``
    that this module verifies; else None (the key is left out: a token naming it is
    :class:`Unverifiable`, never accepted)."""
    if not isinstance(jwk, dict) or not isinstance(jwk.get("kid"), str) or not jwk["kid"]:
        return None
    if jwk.get("use", "sig") != "sig":
        return None
    size = 0
    try:
        if jwk.get("kty") == "RSA":
            alg = jwk.get("alg", "RS256")
            n, e = _uint(jwk.get("n")), _uint(jwk.get("e"))
            if alg not in ("RS256", "RS384", "RS512") or n is None or e is None:
                return None
            key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey = (
                rsa.RSAPublicNumbers(e, n).public_key())
            if key.key_size < MIN_RSA_BITS:
                return None
        elif jwk.get("kty") == "EC" and jwk.get("crv") in _CURVES:
            alg, curve, size = _CURVES[jwk["crv"]]
            x, y = _uint(jwk.get("x")), _uint(jwk.get("y"))
            if jwk.get("alg", alg) != alg or x is None or y is None:
                return None
            key = ec.EllipticCurvePublicNumbers(x, y, curve()).public_key()
        else:
            return None
    except ValueError:  # not a valid key (e.g. a point off the curve)
        return None
    if alg not in algorithms:
        return None
    return jwk["kid"], _Key(alg, key, size)


def parse_keys(discovery: dict[str, Any], jwks: dict[str, Any], fetched: float) -> KeySet:
    """The key set from the API server's discovery document and JWKS. Raises ValueError
    if either is not a JSON object or the discovery document names no issuer. A ``kid``
    that two keys share is left out (a token naming it is :class:`Unverifiable`)."""
    if not isinstance(discovery, dict) or not isinstance(jwks, dict):
        raise ValueError("the discovery document or the JWKS is not a JSON object")
    issuer = discovery.get("issuer")
    if not isinstance(issuer, str) or not issuer:
        raise ValueError("the discovery document names no issuer")
    listed = discovery.get("id_token_signing_alg_values_supported")
    algorithms = (ALGORITHMS & frozenset(a for a in listed if isinstance(a, str))
                  if isinstance(listed, list) else ALGORITHMS)
    keys: dict[str, _Key] = {}
    shared: set[str] = set()
    listed_keys = jwks.get("keys")
    for jwk in listed_keys if isinstance(listed_keys, list) else []:
        parsed = _jwk(jwk, algorithms)
        if parsed is None:
            continue
        kid, key = parsed
        if kid in keys:
            shared.add(kid)
        keys[kid] = key
    return KeySet(issuer, {k: v for k, v in keys.items() if k not in shared}, fetched)


def _signature_ok(key: _Key, signed: bytes, signature: bytes) -> bool:
    digest = _HASHES[key.alg[2:]]()
    try:
        if isinstance(key.key, rsa.RSAPublicKey):
            key.key.verify(signature, signed, padding.PKCS1v15(), digest)
        else:
            if len(signature) != 2 * key.size:
                return False
            r = int.from_bytes(signature[:key.size], "big")
            s = int.from_bytes(signature[key.size:], "big")
            key.key.verify(encode_dss_signature(r, s), signed, ec.ECDSA(digest))
    except InvalidSignature:
        return False
    return True


def _ref(value: Any) -> tuple[str, str] | None:
    """A ``kubernetes.io`` object reference's (name, uid), both non-empty strings."""
    if not isinstance(value, dict):
        return None
    name, uid = value.get("name"), value.get("uid")
    if isinstance(name, str) and name and isinstance(uid, str) and uid:
        return name, uid
    return None


def bound_pod(claims: dict[str, Any], audience: str, issuer: str, now: float,
              skew: float) -> ReviewedPod | None:
    """The pod verified ``claims`` bind the token to, or None: ``audience`` not among
    ``aud``, no number as ``exp`` (or ``nbf``, ``iat`` when present), not a
    ServiceAccount's, or not bound to exactly one pod. Raises :class:`Unverifiable` for
    another issuer (an API server may accept several), and for a token expired or not
    yet valid at the leader's wall time ``now`` beyond ``skew``: the API server judges
    that by its own clock, so a leader whose clock is off must not refuse good tokens
    for it (a review decides; only a signed token gets this far)."""
    if claims.get("iss") != issuer:
        raise Unverifiable("the token names another issuer")
    aud = claims.get("aud")
    auds = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
    if audience not in [a for a in auds if isinstance(a, str)]:
        return None
    exp = claim_number(claims.get("exp"))
    if exp is None:
        return None
    if now > exp + skew:
        raise Unverifiable("expired by the leader's clock")
    for field in ("nbf", "iat"):  # optional, as at the API server; checked when present
        if field in claims:
            at = claim_number(claims[field])
            if at is None:
                return None
            if at > now + skew:
                raise Unverifiable(f"{field} is ahead of the leader's clock")
    k8s = claims.get("kubernetes.io")
    if not isinstance(k8s, dict) or "secret" in k8s:
        return None
    namespace, account, pod = k8s.get("namespace"), _ref(k8s.get("serviceaccount")), \
        _ref(k8s.get("pod"))
    if not isinstance(namespace, str) or not namespace or account is None or pod is None:
        return None
    if claims.get("sub") != f"system:serviceaccount:{namespace}:{account[0]}":
        return None
    return ReviewedPod(namespace=namespace, name=pod[0], uid=pod[1])


class TokenVerifier:
    """Verifies projected ServiceAccount tokens of ``audience`` with the API server's
    issuer keys, fetched through ``api`` (docs/security.md, "Rights endpoint").

    Keys are fetched on first use (or by :meth:`load`), again once ``refresh_after``
    seconds old, and again when a token names a ``kid`` not among them; never more than
    once per ``refetch_interval`` seconds, whatever the tokens (a forger's random kids
    cost at most one fetch per interval: two GETs, each of which the client's retries
    may send up to 4 times, ``kube.client_retries``), and one fetch at a time: a verify
    that would wait for one is :class:`Unverifiable` instead (only the one fetching
    waits). A failed fetch, whatever the failure (an error, an answer of another
    shape), keeps the keys fetched before (none at start-up: every token goes to a
    review). ``skew``: seconds of clock difference
    allowed on ``exp``, ``nbf`` and ``iat``, as the API server allows (60 s)."""

    def __init__(self, api: client.ApiClient | None, audience: str, *,
                 refresh_after: float = 300.0, refetch_interval: float = 10.0,
                 skew: float = 60.0, clock: Clock = time.monotonic, wall: Clock = time.time,
                 fetch: Fetch | None = None) -> None:
        if not audience:
            raise ValueError("a rights audience is needed")
        self.audience = audience
        self._api = api
        self._refresh_after = refresh_after
        self._refetch_interval = refetch_interval
        self._skew = skew
        self._clock = clock
        self._wall = wall
        self._fetch = fetch or self._api_fetch
        self._fetching = threading.Lock()
        self._last_attempt = -math.inf
        self._keys: KeySet | None = None
        self.fetches = 0
        """Key fetches attempted (each a discovery GET and a JWKS GET)."""

    def _api_fetch(self, path: str, accept: str) -> dict[str, Any]:
        if self._api is None:
            raise OSError("no API client")
        return kube.request(self._api, "GET", path, accept=accept, timeout=5)

    @property
    def keys(self) -> KeySet | None:
        """The keys last fetched, if any fetch succeeded."""
        return self._keys

    def load(self) -> bool:
        """Fetch the keys now (within the refetch limit); whether any are held. Never
        raises: a fetch that fails in any way leaves the keys as they were (at start-up,
        none: every token goes to a review)."""
        self._refresh()
        return self._keys is not None

    def _refresh(self) -> None:
        if not self._fetching.acquire(blocking=False):
            return  # another thread fetches; this one goes on with the keys it has
        try:
            now = self._clock()
            if now - self._last_attempt < self._refetch_interval:
                return
            self._last_attempt = now
            self.fetches += 1
            try:
                discovery = self._fetch(DISCOVERY_PATH, "application/json")
                jwks = self._fetch(JWKS_PATH, JWKS_TYPE)
                self._keys = parse_keys(discovery, jwks, self._clock())
            except Exception as exc:  # any failure: no new keys; reviews decide meanwhile
                logger.warning("token verify: cannot fetch the service-account keys "
                               "({err}); {what}", err=f"{type(exc).__name__}: {exc}"[:200],
                               what="keeping those fetched before" if self._keys
                               else "tokens go to TokenReviews")
        finally:
            self._fetching.release()

    def _key(self, kid: str) -> tuple[KeySet, _Key]:
        held = self._keys
        if held is None or kid not in held.keys or (
                self._clock() - held.fetched >= self._refresh_after):
            self._refresh()
            held = self._keys
        if held is None:
            raise Unverifiable("no service-account keys fetched")
        key = held.keys.get(kid)
        if key is None:
            raise Unverifiable("the token names a key the API server does not list")
        return held, key

    def verify(self, token: str) -> ReviewedPod | None:
        """The pod ``token`` is bound to if it is a valid token of this verifier's
        audience, signed by the API server, for a ServiceAccount and exactly one pod;
        None if it is not (the API server would refuse it too). Raises
        :class:`Unverifiable` when only a TokenReview can tell."""
        parts = token.split(".") if len(token) <= MAX_TOKEN else []
        if len(parts) != 3:
            return None
        decoded = [_canonical_part(part) for part in parts]
        header_raw, payload_raw, signature = decoded
        if header_raw is None or payload_raw is None or signature is None:
            return None  # one signed token has one spelling (docs/security.md)
        header = _json_object(header_raw)
        if header is None:
            return None
        alg, kid = header.get("alg"), header.get("kid")
        if not isinstance(alg, str) or alg.lower() == "none" or alg.upper().startswith("HS"):
            return None
        if alg not in ALGORITHMS or not set(header) <= _HEADER_FIELDS \
                or header.get("typ", "JWT") != "JWT":
            raise Unverifiable(f"a token header this verifier does not handle ({alg})")
        if not isinstance(kid, str) or not kid:
            raise Unverifiable("the token names no key")
        held, key = self._key(kid)
        if key.alg != alg:
            return None  # the key it names signs with another algorithm
        if not _signature_ok(key, f"{parts[0]}.{parts[1]}".encode(), signature):
            return None
        claims = _json_object(payload_raw)
        if claims is None:
            return None
        return bound_pod(claims, self.audience, held.issuer, self._wall(), self._skew)

    def decide(self, token: str) -> tuple[bool, ReviewedPod | None]:
        """:meth:`verify` as (decided, pod): (True, pod) verified, (True, None) refused,
        (False, None) only a TokenReview can tell (:class:`Unverifiable`). This shape
        needs no import of this module by its caller (the rights endpoint). Any other
        error (a discovery document or JWKS of an unexpected shape) is (False, None) too:
        a review decides, never an exception out of an ask."""
        try:
            return True, self.verify(token)
        except Unverifiable:
            return False, None
        except (TypeError, ValueError, AttributeError, KeyError, ArithmeticError) as exc:
            logger.warning("token verify: left to a review: {err}",
                           err=f"{type(exc).__name__}: {exc}"[:200])
            return False, None
