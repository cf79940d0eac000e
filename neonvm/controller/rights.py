"""The leader's side of self-fencing: the rights ledger and the ``POST /v1/rights`` server.

A self-fencing runner keeps its guest only while it holds a right to run, granted by the
leader (the wire contract: :mod:`neonvm.api.rights`; the argument: docs/protocol.md,
"Self-fencing"). This module keeps, on the controller's monotonic clock:

* ``issued[pod uid]``: when this process last granted the pod a right (and for how many
  seconds), recorded *before* the answer is sent;
* ``term_start``: when the current term began; every grant by an earlier leader (or an
  earlier term of this process) was issued before it, because a term stops all work,
  grants included, before it can end, and it ends before the next begins;
* ``condemned``: pods whose right is surely over; never granted again *in this term*.
  :meth:`RightsLedger.begin_term` forgets them: a leader of another process may have
  granted such a pod since (its grant to a runner that has not started its guest writes
  the pod first, so this term's DELETE, whose ``resourceVersion`` was read after the
  condemn, could not land after it; a runner that has started its guest was dead at the
  condemn and never starts another), and a mark kept across terms would condemn that pod
  again at once, killing a guest that holds a right (docs/protocol.md, "Self-fencing");
* ``marked``: pods this term has written (the term mark, :class:`RightsService`), so
  that their next asks in the term need no write. Only a write counts, never a grant: a
  grant to an ask that said its guest had started wrote nothing.

:meth:`RightsLedger.grant` and :meth:`RightsLedger.condemn` each run as one step under one
lock: a grant cannot slip in between condemn's test and its mark. The test and the mark
are made together (the mark only when the test passes), so a pod that still renews (a
crashed kubelet, a runner that still reaches the leader) is never condemned.

The server (:class:`RightsServer`) is bounded like the health server (one selector
thread reads requests within ``read_timeout``, heads up to 8 KiB and bodies up to
:data:`MAX_BODY`, a fixed pool of workers answers). It answers 503 ``NotLeader`` unless
this replica's term is active, 403 unless the cache shows the pod as the VM's current pod
and not condemned, and 401 unless the bearer vouches for that pod: a projected
ServiceAccount token that a TokenReview with this controller's rights audience binds to
exactly that pod (:class:`TokenReviewer`; no Secret rights needed), or else the HMAC of
the VM's scaling token (read as live scaling reads it: the Secret recorded in status, only
with the recorded uid; pods built without an audience ask so).
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from loguru import logger
from prometheus_client import CollectorRegistry, Counter
from urllib3.exceptions import HTTPError

from neonvm import kube
from neonvm.api.rights import (
    BAD_REQUEST,
    CONDEMNED,
    DEFAULT_EPSILON,
    DEFAULT_RHO,
    NOT_CURRENT_POD,
    NOT_LEADER,
    RETRY_TIMEOUT,
    RIGHT_SECONDS_ANNOTATION,
    RIGHTS_PATH,
    UNAUTHORIZED,
    RightGrant,
    RightRefusal,
    RightRequest,
    RightsContractError,
    bearer_matches,
    dead_for_sure_after,
    parse_annotation,
    says_guest_started,
)
from neonvm.controller.scaling_token import recorded_token, secret_path
from neonvm.leader import health

Clock = Callable[[], float]

MAX_BODY = 4096
"""The largest request body read; a larger one is refused (413)."""
MAX_LENGTH_DIGITS = 9
"""The most digits a ``Content-Length`` may have (far above :data:`MAX_BODY`); a longer
one is refused (400) unparsed."""
PRUNE_EVERY = 60.0
"""Seconds between prunes of ``issued`` entries that can no longer matter."""
STALE_AFTER = RETRY_TIMEOUT / 2
"""Seconds an ask may wait for a worker, from its connection's accept, before it is
closed unanswered with no work done: an ask taken later than this leaves its work less
than half of its runner's wait (:data:`~neonvm.api.rights.RETRY_TIMEOUT`).
docs/protocol.md, "Stale asks dropped, oldest first"."""


class RightsLedger:
    """issued / condemned / term_start, each change one step under one lock (module doc).

    ``clock`` is the controller's monotonic clock (tests pass a fake). Thread-safe.
    """

    def __init__(self, clock: Clock = time.monotonic, *, rho: float = DEFAULT_RHO,
                 epsilon: float = DEFAULT_EPSILON) -> None:
        self._clock = clock
        self.rho = rho
        self.epsilon = epsilon
        self._lock = threading.Lock()
        self._issued: dict[str, tuple[float, float]] = {}
        """pod uid -> (issue time, seconds granted then)."""
        self._condemned: set[str] = set()
        self._marked: set[str] = set()
        """Pods written (the term mark) in the current term."""
        self._term = 0
        """The current term's serial number in this process (0: none has begun)."""
        self._term_start: float | None = None
        self._active: Callable[[], bool] | None = None
        self._pruned = clock()

    def begin_term(self, active: Callable[[], bool]) -> float:
        """A term starts now (after its Lease was acquired); ``active()`` says whether it
        still is (checked inside every grant). Returns ``term_start``. Earlier terms'
        condemn marks are dropped (module doc): each term condemns afresh, and writes
        each pod afresh."""
        with self._lock:
            self._term += 1
            self._term_start = self._clock()
            self._condemned.clear()
            self._marked.clear()
            self._active = active
            return self._term_start

    def end_term(self) -> None:
        """No more grants until the next :meth:`begin_term`."""
        with self._lock:
            self._active = None

    def active(self) -> bool:
        """A term is running and says it is still active."""
        with self._lock:
            return self._is_active()

    def _is_active(self) -> bool:
        try:
            return self._active is not None and bool(self._active())
        except Exception:
            return False

    def term(self) -> int:
        """The current term's serial number in this process (0 before the first): read
        before an ask's work, passed to :meth:`grant`, which refuses if it changed."""
        with self._lock:
            return self._term

    def term_if_active(self) -> tuple[int, bool]:
        """:meth:`term`, then :meth:`active`, read in one hold of the lock (an ask's
        first step: one lock round-trip, not two)."""
        with self._lock:
            return self._term, self._is_active()

    def grant(self, pod_uid: str, seconds: float, *, term: int | None = None,
              marked: bool = False) -> str | None:
        """Record a grant of ``seconds`` to ``pod_uid`` now; None when granted, else the
        refusal reason (:data:`NOT_LEADER`, :data:`CONDEMNED`). The caller answers only
        after this returned, so the runner's send time precedes the recorded issue.

        ``term``: the :meth:`term` the caller read before its work (its term mark among
        it); another term now is :data:`NOT_LEADER`, so a write made in one term never
        counts as the mark of the next (which may follow a condemn and a DELETE in
        between). ``marked``: the caller wrote the pod for this grant
        (:meth:`marked_this_term` then holds)."""
        with self._lock:
            if not self._is_active() or (term is not None and term != self._term):
                return NOT_LEADER
            if pod_uid in self._condemned:
                return CONDEMNED
            if marked:
                self._marked.add(pod_uid)
            now = self._clock()
            _, before = self._issued.get(pod_uid, (now, 0.0))
            self._issued[pod_uid] = (now, max(seconds, before))
            if now - self._pruned >= PRUNE_EVERY:
                self._prune(now)
            return None

    def remaining(self, pod_uid: str, seconds: float) -> float:
        """What :meth:`condemn` would answer now, without marking anything."""
        with self._lock:
            if pod_uid in self._condemned:
                return 0.0
            return self._left(pod_uid, seconds)

    def _left(self, pod_uid: str, seconds: float) -> float:
        if self._term_start is None:
            return math.inf
        issued, granted = self._issued.get(pod_uid, (-math.inf, 0.0))
        after = dead_for_sure_after(issued, self._term_start, max(seconds, granted),
                                    self.rho, self.epsilon)
        return max(0.0, after - self._clock())

    def condemn(self, pod_uid: str, seconds: float) -> float:
        """Condemn ``pod_uid`` if its right is surely over; 0.0 when it is (or already
        was) condemned, else the seconds until it will be (``inf`` outside a term).

        ``seconds`` is the pod's right (its annotation); a larger one granted by this
        process counts instead. Surely over: now >= max(issued, term_start) + D(1+rho) +
        epsilon (:func:`~neonvm.api.rights.dead_for_sure_after`)."""
        with self._lock:
            if pod_uid in self._condemned:
                return 0.0
            left = self._left(pod_uid, seconds)
            if left == 0.0:
                self._condemned.add(pod_uid)
                self._issued.pop(pod_uid, None)
                self._marked.discard(pod_uid)
            return left

    def marked_this_term(self, pod_uid: str, term: int) -> bool:
        """Term ``term`` is the current one and has written ``pod_uid`` (its term mark)
        before a grant it recorded (:class:`RightsService`)."""
        with self._lock:
            return term == self._term and pod_uid in self._marked

    def granted_this_term(self, pod_uid: str) -> bool:
        """This term has granted ``pod_uid`` before (with or without writing it)."""
        with self._lock:
            at = self._issued.get(pod_uid)
            return (at is not None and self._term_start is not None
                    and at[0] >= self._term_start)

    def is_condemned(self, pod_uid: str) -> bool:
        with self._lock:
            return pod_uid in self._condemned

    def _prune(self, now: float) -> None:
        """Drop grants that no longer move any deadline: once ``issued + D(1+rho) +
        epsilon`` has passed, ``condemn`` answers the same with or without the entry
        (``term_start`` alone is then at most as late)."""
        self._pruned = now
        for uid, (at, seconds) in list(self._issued.items()):
            if now >= dead_for_sure_after(at, at, seconds, self.rho, self.epsilon):
                del self._issued[uid]
                self._marked.discard(uid)  # its next ask writes it again: safe, rare


# ---- who may ask ------------------------------------------------------------------------


@dataclass(frozen=True)
class CurrentPod:
    """The VM's current pod as the cache shows it, and what a grant needs of it."""

    uid: str
    name: str
    seconds: float
    """The pod's right (its :data:`RIGHT_SECONDS_ANNOTATION`)."""
    secret_name: str
    secret_uid: str
    ip: str = ""
    """The pod's IP (``status.podIP``) as the cache shows it; "" if none."""
    deleting: bool = False
    """The pod is shutting down (``deletionTimestamp`` set): its token is reviewed, never
    verified locally (the API server voids it 60 s past that time; docs/security.md)."""


class Caches(Protocol):
    """The term's VM and pod caches (``namespace/name`` keys; pods also by VM key)."""

    def get(self, key: str) -> dict[str, Any] | None: ...

    def by_index(self, value: str) -> list[dict[str, Any]]: ...


def current_pod(vms: Caches, pods: Caches, namespace: str, vm_name: str,
                pod_uid: str) -> CurrentPod | str:
    """``pod_uid`` if the cache shows it as the VM's current pod (committed, or the
    pending plan's pod once created) or as one of the VM's pods shutting down,
    self-fencing and owned by the VM; else why not.

    A pod shutting down (``deletionTimestamp`` set) keeps its right although the VM has
    moved on: its guest may be in the middle of a graceful shutdown, and a right lapsing
    then would kill it. That costs no safety (the replacement waits, gated, for the pod
    to be gone; a grant only moves the pod's condemnation later) and no liveness on a
    lost node (its runner cannot ask)."""
    vm = vms.get(f"{namespace}/{vm_name}")
    if vm is None:
        return "no such VM in the leader's cache"
    meta = vm.get("metadata") or {}
    status = vm.get("status") or {}
    names = [status.get("podName")]
    if status.get("podUID") and status.get("podUID") != pod_uid:
        names = []
    names.append((status.get("pendingPod") or {}).get("name"))
    named = [pods.get(f"{namespace}/{name}") for name in names if name]

    def shutting_down() -> Iterator[dict[str, Any]]:  # looked up only if none is named
        for p in pods.by_index(f"{namespace}/{vm_name}"):
            if (p.get("metadata") or {}).get("deletionTimestamp") is not None:
                yield p

    for pod in itertools.chain(named, shutting_down()):
        pod_meta = (pod or {}).get("metadata") or {}
        name = pod_meta.get("name")
        if pod is None or pod_meta.get("uid") != pod_uid:
            continue
        owner = next((r.get("uid") for r in pod_meta.get("ownerReferences") or []
                      if r.get("controller")), None)
        if owner != meta.get("uid"):
            continue
        seconds = parse_annotation((pod_meta.get("annotations") or {}).get(
            RIGHT_SECONDS_ANNOTATION))
        if seconds is None:
            return f"pod {name} does not self-fence"
        return CurrentPod(uid=pod_uid, name=str(name), seconds=seconds,
                          secret_name=str(status.get("scalingTokenSecret") or ""),
                          secret_uid=str(status.get("scalingTokenSecretUID") or ""),
                          ip=str((pod.get("status") or {}).get("podIP") or ""),
                          deleting=pod_meta.get("deletionTimestamp") is not None)
    return "not the VM's current pod"


class TokenCache:
    """The VMs' scaling tokens, read as live scaling reads them
    (:func:`~neonvm.controller.scaling_token.recorded_token`: the Secret recorded in
    status, only with the recorded uid). Kept ``ttl`` seconds; a bearer that does not
    match re-reads a token older than ``refresh_after``.

    A read that finds no token (Secret gone, not the recorded uid, no ``token`` key) is
    kept too, for ``refresh_after``; and reads are single-flight per key (one lock
    stripe per key). So asks, however many and whatever their bearer, cost at most one
    Secret GET per key per ``refresh_after`` (docs/security.md, "Rights endpoint").
    A read no ask can use any more is dropped at a later insert (oldest first), so a
    deleted VM's token is held no longer than ``ttl`` after its last read."""

    _STRIPES = 64

    def __init__(self, api: client.ApiClient | None, *, ttl: float = 600.0,
                 refresh_after: float = 10.0, clock: Clock = time.monotonic,
                 read: Callable[[str, str], dict[str, Any] | None] | None = None) -> None:
        self._api = api
        self._ttl = ttl
        self._refresh_after = refresh_after
        self._clock = clock
        self._read = read or self._get_secret
        self._lock = threading.Lock()
        self._reads = [threading.Lock() for _ in range(self._STRIPES)]
        self._tokens: OrderedDict[tuple[str, str, str], tuple[bytes | None, float]] = \
            OrderedDict()
        """(namespace, Secret name, Secret uid) -> (its token or None, when read); in
        the order stored, near enough the order read (:meth:`_forget_old`)."""

    def _get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        return kube.get_or_none(self._api, secret_path(namespace, name), timeout=5)

    def _cached(self, key: tuple[str, str, str], fresh: bool) -> tuple[bool, bytes | None]:
        with self._lock:
            cached = self._tokens.get(key)
        if cached is None:
            return False, None
        value, at = cached
        age = self._clock() - at
        if age < self._refresh_after:
            return True, value
        if value is not None and age < self._ttl and not fresh:
            return True, value
        return False, None

    def token(self, namespace: str, name: str, uid: str, *, fresh: bool = False) -> bytes | None:
        """The token, or None (no Secret recorded, gone, not the recorded one)."""
        if not name or not uid:
            return None
        key = (namespace, name, uid)
        hit, value = self._cached(key, fresh)
        if hit:
            return value
        with self._reads[hash(key) % self._STRIPES]:
            hit, value = self._cached(key, fresh)  # another ask read it meanwhile
            if hit:
                return value
            now = self._clock()
            token = recorded_token(self._read(namespace, name), name, uid)
            value = None if isinstance(token, str) else token
            with self._lock:
                self._forget_old(self._clock())
                self._tokens[key] = (value, now)
                self._tokens.move_to_end(key)
                if len(self._tokens) > 100_000:
                    self._tokens.clear()
        return value

    def _forget_old(self, now: float) -> None:
        """Drop reads that no ask can use any more (older than ``ttl`` and
        ``refresh_after``), oldest first (under the lock): a deleted VM's token goes
        within ``ttl`` of its last read."""
        keep = max(self._ttl, self._refresh_after)
        while self._tokens:
            _, at = next(iter(self._tokens.values()))
            if now - at < keep:
                return
            self._tokens.popitem(last=False)

    def remembered(self) -> int:
        """Tokens (or their absence) read and kept (a gauge's size)."""
        with self._lock:
            return len(self._tokens)


POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
"""The keys of a TokenReview's ``user.extra`` naming the pod a token is bound to."""
TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"


@dataclass(frozen=True)
class ReviewedPod:
    """The pod a reviewed token is bound to, as the API server vouches for it."""

    namespace: str
    name: str
    uid: str


def is_jwt(bearer: str) -> bool:
    """Whether a bearer has a JWT's shape (three dot-separated parts): a ServiceAccount
    token, not the hex HMAC of a scaling token (which has no dot)."""
    return bearer.count(".") == 2


_BASE64URL = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def _canonical_part(part: str) -> bytes | None:
    """The bytes of one JWT part if it is canonical unpadded base64url (only the
    alphabet, no padding, the unused low bits of its last character zero), else None."""
    if not part or not set(part) <= _BASE64URL or len(part) % 4 == 1:
        return None
    try:
        raw = base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
    except ValueError:
        return None
    return raw if base64.urlsafe_b64encode(raw).rstrip(b"=").decode() == part else None


def unverified_claims(token: str) -> dict[str, Any] | None:
    """A JWT's payload as JSON, NOT verified: only a filter before the review (a token
    whose claims cannot match costs no API call). None if it is not one, or if any of
    its three parts is not canonical base64url: the API server accepts one signed token
    in many spellings (the signature's last character has unused bits, and ``\\r`` or
    ``\\n`` anywhere are skipped), and each spelling would cost a review and a cache
    entry of its own (docs/security.md, "Rights endpoint")."""
    parts = token.split(".")
    if len(parts) != 3 or len(token) > 8192:
        return None
    decoded = [_canonical_part(part) for part in parts]
    if decoded[0] is None or decoded[1] is None or decoded[2] is None:
        return None
    try:
        claims = json.loads(decoded[1])
    except (ValueError, RecursionError):
        return None
    return claims if isinstance(claims, dict) else None


CLOCK_LEEWAY = 120.0
"""Seconds past its ``exp`` (by the leader's wall clock) a token is still sent for review:
the API server judges expiry by its own clock, and a leader's clock ahead of it must not
refuse tokens the kubelet has not rotated yet (it rotates at 80 % of their life)."""


BoundClaims = tuple[int | float, str]
"""``(exp, pod uid)`` of a token whose unverified claims name the audience asked for
(:func:`bound_claims`): all :func:`bound_claims_match` reads of them after that."""


def bound_claims(claims: dict[str, Any], audience: str) -> BoundClaims | None:
    """``(exp, pod uid)`` if the unverified claims hold ``audience`` among ``aud``, a pod
    uid and a numeric ``exp``, else None. Kept with a good cached answer, so a renewal
    with the same token (its key, the SHA-256, names one token) is not decoded again:
    two scalars, never what the token's minter chose in bulk (review7: a kept ``aud``
    list of a thousand audiences cost 60 KB per cached token)."""
    aud = claims.get("aud")
    auds = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
    k8s = claims.get("kubernetes.io")
    pod = k8s.get("pod") if isinstance(k8s, dict) else None
    uid = pod.get("uid") if isinstance(pod, dict) else None
    exp = claims.get("exp")
    if (audience in auds and isinstance(uid, str) and isinstance(exp, int | float)
            and not isinstance(exp, bool)):
        return exp, uid
    return None


def bound_claims_match(bound: BoundClaims, pod_uid: str, now: float) -> bool:
    """The token is bound to a pod of uid ``pod_uid`` and not expired
    :data:`CLOCK_LEEWAY` before wall time ``now``."""
    exp, uid = bound
    return uid == pod_uid and exp > now - CLOCK_LEEWAY


def reviewed_pod(review: dict[str, Any], audience: str) -> ReviewedPod | None:
    """The pod a TokenReview's answer binds the token to, or None: not authenticated,
    ``audience`` not among the audiences it was valid for (an API server that ignores
    audiences answers none: refused), not a ServiceAccount, or not bound to exactly one
    pod."""
    status = review.get("status") or {}
    if status.get("authenticated") is not True or status.get("error"):
        return None
    if audience not in (status.get("audiences") or []):
        return None
    user = status.get("user") or {}
    prefix, _, rest = str(user.get("username") or "").partition("system:serviceaccount:")
    namespace, sep, account = rest.partition(":")
    if prefix or not namespace or not sep or not account:
        return None
    extra = user.get("extra") or {}
    names, uids = extra.get(POD_NAME_EXTRA), extra.get(POD_UID_EXTRA)
    if not (isinstance(names, list) and isinstance(uids, list)
            and len(names) == 1 and len(uids) == 1 and names[0] and uids[0]):
        return None
    return ReviewedPod(namespace=namespace, name=str(names[0]), uid=str(uids[0]))


Review = Callable[[str, str], dict[str, Any]]
"""(token, audience) -> the TokenReview's answer; raises on a failed call."""
LocalVerify = Callable[[str], tuple[bool, "ReviewedPod | None"]]
"""token -> (decided, its pod) by the API server's issuer keys, with no API call:
(True, pod) verified, (True, None) refused, (False, None) only a review can tell
(:meth:`neonvm.controller.token_verify.TokenVerifier.decide`)."""


def claim_number(value: Any) -> float | None:
    """A JWT claim's number (``exp``, ``nbf``, ``iat``) as a finite float, else None
    (never raises: a bool is no number, and 10**400 is no float)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None

API_ERRORS = (ApiException, OSError, HTTPError)
"""What a failed API call raises (a review, the term mark, a token Secret read): an error
answer, or none (urllib3's connection and timeout errors are not OSErrors)."""


class ReviewBudgetSpent(Exception):
    """The pod has had its reviews for this window (:class:`TokenReviewer`); ask again
    later. Not a refusal of the token."""


REVIEW_BUDGET_SPENT = "ReviewBudgetSpent"
"""Refusal reason (429): the pod's token reviews for this window are spent
(:class:`TokenReviewer`); the runner asks again at its next retry."""
REVIEW_UNAVAILABLE = "ReviewUnavailable"
"""Refusal reason (503): the token could not be reviewed now (no answer, 429, 5xx)."""


class TokenReviewer:
    """Who a runner's projected ServiceAccount token is bound to, by a TokenReview with
    the controller's rights ``audience`` (docs/security.md, "Rights endpoint").

    A token that is not canonical base64url, or whose unverified claims cannot match
    (:func:`unverified_claims`, :func:`bound_claims`, :func:`bound_claims_match`), is
    refused with no API call.
    Reviews are cached per token (its SHA-256; one RSA-signed token has one canonical
    spelling, an ECDSA-signed one two: docs/security.md): an answer binding it to a pod
    is fresh for ``ttl`` seconds (and never past half the token's remaining life), a
    refusal for ``refused_ttl``; each cache keeps at
    most ``max_entries`` (the least recently used go first) and drops what can no longer
    answer: an expired refusal or token (at inserts, amortized), and a deleted pod's
    answers and budgets (:meth:`forget_pod`, called by the leader's pod informer), so it
    holds about what live pods use. Reviews are single-flight per token. A runner
    renewing every D/3 with the 7,200 s token the kubelet rotates after 5,760 s thus
    costs one review per 240 s. Each pod (namespace, uid) gets at
    most ``budget`` reviews per ``window`` seconds for asks from its own IP, and as many
    for asks from anywhere else, whatever the tokens: the caller asks only for current
    pods, so reviews are bounded by live pods; over it, :class:`ReviewBudgetSpent`. Asks
    from elsewhere (a forger who knows the pod's uid) cannot spend the budget of the
    pod's own runner. What a cached answer can miss is the pod's deletion (the
    leader's pod cache, checked at every ask, does not), or its ServiceAccount's.

    A review that fails (the call raises, or the budget is spent) falls back on an
    earlier good review (or local verification) of the same token until the token's
    expiry (its ``exp``, which that review verified, by this process's wall clock): an
    API server outage does not end the rights of pods whose tokens were reviewed. Else
    it raises (the ask is refused, nothing is cached). After a review that got no
    answer (a timeout, a refused connection), none is sent for ``retry_after``
    seconds: an outage must not hold every rights worker in a review's timeout while
    asks that need none wait. An error answer (a 429, a 5xx) comes back at once and
    pauses nothing.

    With ``verify`` (the API server's issuer keys, :mod:`neonvm.controller.token_verify`),
    a token not in the cache is first verified locally: a verified one is cached as a
    good review would be, a refused one is refused (neither costs an API call or the
    pod's budget); only one it cannot decide (no keys, an unknown ``kid``, another
    issuer, a lifetime the leader's clock disputes) goes to a review. A token of a pod
    shutting down (``locally=False``) is decided by a review alone: neither a local
    verification nor a cached one answers for it, nor is one the outage fallback; a
    review's cached answer does."""

    _STRIPES = 64
    _SWEEP_FLOOR = 64
    """``_bound`` is swept for expired entries when it reaches twice its size after the
    last sweep, and never below this: amortized, one entry looked at per insert."""

    def __init__(self, api: client.ApiClient | None, audience: str, *, ttl: float = 240.0,
                 refused_ttl: float = 10.0, max_entries: int = 50_000,
                 budget: int = 4, window: float = 60.0, retry_after: float = 5.0,
                 clock: Clock = time.monotonic, wall: Clock = time.time,
                 review: Review | None = None, verify: LocalVerify | None = None) -> None:
        if not audience:
            raise ValueError("a rights audience is needed")
        self.audience = audience
        self._api = api
        self._verify = verify
        self.verified = 0
        """Tokens decided locally, with no review (for tests and the benchmark)."""
        self._ttl = ttl
        self._refused_ttl = refused_ttl
        self._max = max_entries
        self._budget = budget
        self._window = window
        self._retry_after = retry_after
        self._failing_until = -math.inf
        self._clock = clock
        self._wall = wall
        self._review = review or self._api_review
        self._lock = threading.Lock()
        self._reads = [threading.Lock() for _ in range(self._STRIPES)]
        self._bound: OrderedDict[bytes, tuple[ReviewedPod, float, float, bool,
                                              BoundClaims]] = OrderedDict()
        """token key -> (its pod, fresh until, its expiry, on the monotonic clock; whether
        a review gave it, not local verification; the token's :func:`bound_claims`).
        Least recently used first."""
        self._keys_of: dict[str, set[bytes]] = {}
        """pod uid -> its keys in ``_bound`` (:meth:`forget_pod`)."""
        self._sweep_at = self._SWEEP_FLOOR
        """``_bound``'s size at which the next insert drops its expired entries."""
        self._refused: OrderedDict[bytes, float] = OrderedDict()
        """token key -> refused until; in that order (one ``refused_ttl`` for all)."""
        self._spent: OrderedDict[tuple[str, str, bool], tuple[float, int]] = OrderedDict()
        """(namespace, pod uid, from its own IP) -> (its window's start, reviews in it);
        in the order of the windows' starts."""
        self.reviews = 0
        """TokenReviews sent (for tests and the benchmark)."""

    def _api_review(self, token: str, audience: str) -> dict[str, Any]:
        return kube.request(self._api, "POST", TOKEN_REVIEWS, body={
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
            "spec": {"token": token, "audiences": [audience]}}, timeout=5)

    def _cached(self, key: bytes, reviewed: bool) -> tuple[bool, ReviewedPod | None]:
        """A fresh cached answer for ``key``; only a review's if ``reviewed``."""
        now = self._clock()
        with self._lock:
            bound = self._bound.get(key)
            if bound is not None:
                if now < bound[1] and (bound[3] or not reviewed):
                    self._bound.move_to_end(key)
                    return True, bound[0]
                if now >= bound[2]:
                    self._drop_bound(key)
            refused = self._refused.get(key)
            if refused is not None:
                if now < refused:
                    return True, None
                del self._refused[key]
        return False, None

    def _known_claims(self, key: bytes) -> BoundClaims | None:
        """The :func:`bound_claims` kept with a good answer for ``key``, if one is
        cached, fresh or not."""
        with self._lock:
            bound = self._bound.get(key)
            return None if bound is None else bound[4]

    def _stale(self, key: bytes, reviewed: bool) -> ReviewedPod | None:
        """The pod of an earlier good answer for this token (a review's only if
        ``reviewed``), while the token lives."""
        now = self._clock()
        with self._lock:
            bound = self._bound.get(key)
            return bound[0] if bound is not None and now < bound[2] and (
                bound[3] or not reviewed) else None

    def _charge(self, budget: tuple[str, str, bool]) -> bool:
        """Count one review against ``budget``; False if it is spent."""
        now = self._clock()
        with self._lock:
            # Windows over, oldest first: they count nothing any more. A window starts
            # only for a pod not held (its last one was dropped here), at the end: so
            # the order held is that of the windows' starts.
            while self._spent:
                oldest, (start, _) = next(iter(self._spent.items()))
                if now - start < self._window:
                    break
                del self._spent[oldest]
            start, spent = self._spent.get(budget, (now, 0))
            if spent >= self._budget:
                return False
            self._spent[budget] = (start, spent + 1)
            self.reviews += 1
            return True

    def _refund(self, budget: tuple[str, str, bool]) -> None:
        """Give back one charge of ``budget`` (a review that got no answer or an error)."""
        with self._lock:
            start, spent = self._spent.get(budget, (self._clock(), 0))
            if spent > 0:
                self._spent[budget] = (start, spent - 1)

    def pod_of(self, token: str, pod_uid: str, namespace: str = "", *,
               from_pod: bool = False, locally: bool = True) -> ReviewedPod | None:
        """The pod ``token`` is bound to, if it may be ``pod_uid``'s (else None), asked
        for a pod of ``namespace`` (whose review budget it spends: that of asks from the
        pod's own IP if ``from_pod``, else the other one); verified locally first if
        ``locally`` and this reviewer has ``verify`` (else only a review's answer, cached
        or new, counts: a pod shutting down). Raises
        :class:`ReviewBudgetSpent`, or the review's error, when there is no answer and no
        earlier good review of this token to fall back on."""
        key = hashlib.sha256(token.encode()).digest()
        # The claims of a token with a good cached answer are its own (the key names
        # one token): the same test below, without decoding the token again.
        claims = self._known_claims(key)
        if claims is None:
            unverified = unverified_claims(token)
            claims = None if unverified is None else bound_claims(unverified, self.audience)
        if claims is None or not bound_claims_match(claims, pod_uid, self._wall()):
            return None
        reviewed = not locally  # a verdict of the keys does not count for this ask
        hit, pod = self._cached(key, reviewed)
        if hit:
            return pod
        if self._verify is not None and locally:
            decided, pod = self._verify(token)
            if decided:
                with self._lock:
                    self.verified += 1
                if pod is not None:
                    # The claims are those just verified (the same payload), so their
                    # exp is the API server's; never computed for a refused token.
                    self._keep(key, pod, claims, reviewed=False)
                return pod
        with self._reads[key[0] % self._STRIPES]:
            hit, pod = self._cached(key, reviewed)  # another ask reviewed it meanwhile
            if hit:
                return pod
            failing = self._clock() < self._failing_until
            if failing or not self._charge((namespace, pod_uid, from_pod)):
                stale = self._stale(key, reviewed)
                if stale is not None:
                    return stale
                if failing:
                    raise OSError(f"TokenReviews failed in the last {self._retry_after:g} s")
                raise ReviewBudgetSpent(
                    f"{self._budget} reviews per {self._window:g} s for this pod")
            try:
                pod = reviewed_pod(self._review(token, self.audience), self.audience)
            except API_ERRORS as exc:
                # No review took place: the charge goes back, or a second of errors at
                # a new leader (the runner asks again within one) would spend the
                # pod's budget for a whole window, longer than its right.
                self._refund((namespace, pod_uid, from_pod))
                if not isinstance(exc, ApiException) or not exc.status:  # no answer
                    with self._lock:
                        self._failing_until = self._clock() + self._retry_after
                stale = self._stale(key, reviewed)
                if stale is None:
                    raise
                logger.warning("rights: cannot review a token of pod {uid} now ({err}); its "
                               "earlier review holds until the token expires",
                               uid=pod_uid[:64], err=str(exc)[:200])
                return stale
            if pod is None:
                with self._lock:
                    self._drop_bound(key)
                    now = self._clock()
                    while self._refused and next(iter(self._refused.values())) <= now:
                        self._refused.popitem(last=False)  # no longer refused
                    self._put(self._refused, key, now + self._refused_ttl)
            else:
                self._keep(key, pod, claims, reviewed=True)
        return pod

    def _keep(self, key: bytes, pod: ReviewedPod, claims: BoundClaims, *,
              reviewed: bool) -> None:
        """Cache a good answer for ``key`` (of a review if ``reviewed``, else of local
        verification): fresh for ``ttl`` and never past half the token's remaining life,
        kept (for an outage) until its ``exp``."""
        exp = claim_number(claims[0])
        if exp is None:
            return
        life = exp - self._wall()
        if life > 0:
            now = self._clock()
            with self._lock:
                self._keep_bound(key, (pod, now + min(self._ttl, life / 2), now + life,
                                       reviewed, claims), now)

    def _keep_bound(self, key: bytes,
                    value: tuple[ReviewedPod, float, float, bool, BoundClaims],
                    now: float) -> None:
        """Put ``value`` in ``_bound`` (under the lock), indexed by its pod; first, if it
        has doubled since the last sweep, drop its entries whose token has expired
        (neither fresh nor a fallback any more; least recently used is not expiry order)."""
        if len(self._bound) >= self._sweep_at:
            for old in [k for k, v in self._bound.items() if now >= v[2]]:
                self._drop_bound(old)
            self._sweep_at = max(self._SWEEP_FLOOR, 2 * len(self._bound))
        self._drop_bound(key)
        self._bound[key] = value
        self._keys_of.setdefault(value[0].uid, set()).add(key)
        while len(self._bound) > self._max:
            self._drop_bound(next(iter(self._bound)))

    def _drop_bound(self, key: bytes) -> None:
        """Forget ``key``'s good answer (under the lock), and its place in the index."""
        bound = self._bound.pop(key, None)
        if bound is None:
            return
        keys = self._keys_of.get(bound[0].uid)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._keys_of[bound[0].uid]

    def forget_pod(self, namespace: str, uid: str) -> None:
        """The pod ``namespace``/``uid`` is deleted: forget its tokens' answers and its
        review budgets. Nothing of it can be granted any more (every ask checks the
        leader's pod cache first), so no answer is lost that could still matter."""
        with self._lock:
            for key in list(self._keys_of.get(uid, ())):
                self._drop_bound(key)
            for from_pod in (True, False):
                self._spent.pop((namespace, uid, from_pod), None)

    def remembered_tokens(self) -> int:
        """Tokens whose answer is cached, good or refused (a gauge's size)."""
        with self._lock:
            return len(self._bound) + len(self._refused)

    def remembered_budgets(self) -> int:
        """Pods' review budgets held (a gauge's size)."""
        with self._lock:
            return len(self._spent)

    def _put(self, cache: OrderedDict[bytes, Any], key: bytes, value: Any) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self._max:
            cache.popitem(last=False)


# ---- the endpoint -----------------------------------------------------------------------


Answer = tuple[int, dict[str, Any]]


TERM_ANNOTATION = "vm.neon.tech/right-term"
"""Pod annotation written before a term's first grant to the pod (module doc of
:class:`RightsService`): the term's epoch and a nonce (:func:`term_mark`)."""


def term_mark(epoch: str) -> str:
    """A value of :data:`TERM_ANNOTATION` for one write: ``<epoch>.<nonce>``, the nonce
    128 random bits drawn for this write. Whoever may patch pods (a tenant with ``edit``)
    may preset the annotation, to the next epoch too, but not to a value drawn after it
    did: so the write always changes the pod, and its ``resourceVersion`` with it
    (docs/protocol.md, "A deposed leader's delete still in flight")."""
    return f"{epoch}.{secrets.token_hex(16)}"

_ANSWER_KINDS = 64
"""The most (status, reason) children of ``answers`` a service keeps at hand (there are
about a dozen)."""

MarkPod = Callable[[str, str, str], bool]
"""(namespace, name, uid) -> whether the pod was written (False: gone, or another uid)."""


class RightsService:
    """Answers one ``POST /v1/rights`` (transport-free; :class:`RightsServer` serves it).

    ``caches()`` returns the term's (VM, pod) caches, or None while there is no term or
    its caches have not synced.

    **Leadership is checked twice per ask.** Once inside :meth:`RightsLedger.grant`,
    under the ledger's lock with the record: the check safety needs (a grant is recorded,
    and answered, only while the term holds, so it precedes the term's end and the next
    term's ``term_start``). And once before anything else (:meth:`RightsLedger.active`,
    cheap): not for safety, but so that a standby or a deposed term answers 503 without
    reading a token Secret or writing the pod.

    **A term's first grant to a runner that has not started its guest writes the pod
    first** (``mark_pod``: a patch of :data:`TERM_ANNOTATION` with a uid precondition;
    no grant if the pod is gone). The force-delete of a condemned pod reads the pod after
    the condemn, checks its authority, then deletes with the uid and that
    ``resourceVersion`` as preconditions
    (:func:`~neonvm.controller.fencing.force_delete_dead_pod`). So a deposed leader's
    DELETE still in flight and the next term's grant that lets a runner start its guest
    cannot both land: the read precedes the old term's end, which precedes the new
    term's write; either the write comes first (the DELETE fails on the
    resourceVersion) or the DELETE does (the write fails: no grant). An ask whose target
    says the guest has started (:func:`~neonvm.api.rights.says_guest_started`) is
    granted without the write: that runner started its only QEMU before it asked, so no
    grant to it starts a guest, and if a term condemned it, its guest was dead then
    (docs/protocol.md, "A deposed leader's delete still in flight"). Cost: one pod write
    per pod per term, on the first ask of a runner still waiting for its first grant;
    none for running guests, so a leader change writes no pod of a running fleet, and
    none for a pod the term condemned (refused before the write: it is never granted
    again in the term, and a write would only fail the term's own DELETE). The
    write counts for the term that made it only (:meth:`RightsLedger.grant`'s
    ``term``)."""

    def __init__(self, ledger: RightsLedger, caches: Callable[[], tuple[Caches, Caches] | None],
                 tokens: TokenCache, mark_pod: MarkPod,
                 registry: CollectorRegistry | None = None, *,
                 reviewer: TokenReviewer | None = None) -> None:
        self.ledger = ledger
        self._caches = caches
        self._tokens = tokens
        self._reviewer = reviewer
        self._mark_pod = mark_pod
        registry = registry or CollectorRegistry()
        self.answers = Counter(
            "neonvm_controller_rights_answers_total",
            "POST /v1/rights answers, by status code and reason (\"\" for a grant).",
            ["code", "reason"], registry=registry)
        self.dropped = Counter(
            "neonvm_controller_rights_asks_dropped_total",
            "POST /v1/rights asks closed unanswered, with no work done, because they "
            "waited for a worker for half of a runner's wait for an answer.",
            registry=registry)
        self.failed = Counter(
            "neonvm_controller_rights_request_errors_total",
            "POST /v1/rights requests whose handling raised (a bug): the connection was "
            "answered 500 or closed, and the listener went on.",
            registry=registry)
        self._answered: dict[tuple[int, str], Any] = {}
        """(status, reason) -> its child of ``answers`` (looked up once, not per ask)."""

    def answer(self, method: str, path: str, authorization: str | None,
               body: bytes, source: str | None = None) -> Answer:
        """The answer to one request (counted in ``answers``) from address ``source``."""
        status, doc = self._answer(method, path, authorization, body, source)
        reason = str(doc.get("reason", ""))
        child = self._answered.get((status, reason))
        if child is None:
            child = self.answers.labels(code=str(status), reason=reason)
            if len(self._answered) < _ANSWER_KINDS:
                self._answered[(status, reason)] = child
        child.inc()
        return status, doc

    def _answer(self, method: str, path: str, authorization: str | None,
                body: bytes, source: str | None) -> Answer:
        if path.split("?", 1)[0] != RIGHTS_PATH:
            return _refuse(404, BAD_REQUEST, f"only {RIGHTS_PATH}")
        if method != "POST":
            return _refuse(405, BAD_REQUEST, "only POST")
        try:
            request = RightRequest.from_dict(json.loads(body or b"null"))
        except (ValueError, RecursionError, RightsContractError) as exc:
            # ValueError covers UnicodeError; RecursionError: nested JSON. One short line,
            # no traceback: a client's bad body must not cost the leader its log.
            logger.info("rights: bad body: {err}", err=f"{type(exc).__name__}: {exc}"[:200])
            return _refuse(400, BAD_REQUEST, str(exc)[:200])
        term, active = self.ledger.term_if_active()
        caches = self._caches() if active else None
        if caches is None:
            return _refuse(503, NOT_LEADER, "this replica holds no active term")
        found = current_pod(*caches, request.namespace, request.vm, request.pod_uid)
        if isinstance(found, str):
            return _not_current(request, found)
        refused = self._authenticate(request, found, authorization,
                                     from_pod=bool(found.ip) and source == found.ip)
        if refused is not None:
            return refused
        if self.ledger.is_condemned(request.pod_uid):
            # Before the write, not only in grant (which checks again under its lock):
            # a pod never granted again in the term must not cost a pod write per ask.
            return _condemned()
        write = (not says_guest_started(path)
                 and not self.ledger.marked_this_term(request.pod_uid, term))
        if write:
            try:
                written = self._mark_pod(request.namespace, found.name, request.pod_uid)
            except API_ERRORS as exc:
                return _refuse(503, NOT_LEADER, f"cannot mark the pod now: {exc}"[:200])
            if not written:
                return _not_current(request, "the pod is gone")
        refused_as = self.ledger.grant(request.pod_uid, found.seconds, term=term,
                                       marked=write)
        if refused_as == CONDEMNED:
            return _condemned()
        if refused_as is not None:
            return _refuse(503, refused_as, "this replica holds no active term")
        return 200, RightGrant(seconds=found.seconds).to_dict()

    def _authenticate(self, request: RightRequest, found: CurrentPod,
                      authorization: str | None, *, from_pod: bool = False) -> Answer | None:
        """None if the bearer vouches for ``found`` (the VM's current pod), else the
        refusal. Two credentials (docs/security.md, "Rights endpoint"): a JWT is a
        projected ServiceAccount token, good only if a TokenReview with this
        controller's audience binds it to exactly that pod (namespace, name, uid); any
        other bearer must be the HMAC of the VM's scaling token and the pod uid (pods
        built before the audience was set, or without one, ask so)."""
        scheme, _, bearer = (authorization or "").partition(" ")
        bearer = bearer.strip()
        if self._reviewer is not None and scheme.lower() == "bearer" and is_jwt(bearer):
            try:
                pod = self._reviewer.pod_of(bearer, request.pod_uid, request.namespace,
                                            from_pod=from_pod, locally=not found.deleting)
            except ReviewBudgetSpent as exc:
                return _refuse(429, REVIEW_BUDGET_SPENT,
                               f"too many token reviews for this pod now: {exc}"[:200])
            except API_ERRORS as exc:
                # Not NotLeader: the runner sends that again at once; another 503 it
                # asks again within a second (neonvm/runner/right.py).
                return _refuse(503, REVIEW_UNAVAILABLE,
                               f"cannot review the token now: {exc}"[:200])
            if pod != ReviewedPod(request.namespace, found.name, request.pod_uid):
                logger.info("rights: refused {ns}/{vm} pod {uid}: the token is bound to {pod}",
                            ns=request.namespace[:253], vm=request.vm[:253],
                            uid=request.pod_uid[:64], pod=pod)
                return _refuse(401, UNAUTHORIZED,
                               "the token is not bound to this pod for this audience")
            return None
        try:
            token = self._tokens.token(request.namespace, found.secret_name, found.secret_uid)
            if token is not None and not bearer_matches(authorization, token, request.pod_uid):
                token = self._tokens.token(request.namespace, found.secret_name,
                                           found.secret_uid, fresh=True)
        except API_ERRORS as exc:
            return _refuse(503, NOT_LEADER, f"cannot read the VM's token now: {exc}"[:200])
        if token is None or not bearer_matches(authorization, token, request.pod_uid):
            return _refuse(401, UNAUTHORIZED, "the bearer does not match the VM's token")
        return None


def _refuse(status: int, reason: str, message: str) -> Answer:
    return status, RightRefusal(reason=reason, message=message).to_dict()


def _condemned() -> Answer:
    return _refuse(403, CONDEMNED, "this pod was condemned; it is never granted again")


NOT_CURRENT_MESSAGE = "not a current self-fencing pod of that VM"
"""The one text of every 403 ``NotCurrentPod``: whether the VM exists, or which of its
pods is current, is not told to the caller (a name oracle across namespaces,
docs/security.md, "Rights endpoint"); the detail goes to the server's log."""


def _not_current(request: RightRequest, why: str) -> Answer:
    logger.info("rights: refused {ns}/{vm} pod {uid}: {why}", ns=request.namespace[:253],
                vm=request.vm[:253], uid=request.pod_uid[:64], why=why[:200])
    return _refuse(403, NOT_CURRENT_POD, NOT_CURRENT_MESSAGE)


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
            404: "Not Found", 405: "Method Not Allowed", 413: "Content Too Large",
            429: "Too Many Requests", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 503: "Service Unavailable"}


def _bare_line_break(head: bytes) -> bool:
    """A ``\\r`` or ``\\n`` in the head that is not part of a ``\\r\\n`` line end: refused
    (RFC 9112 section 2.2), not kept inside a header value."""
    rest = head.replace(b"\r\n", b"")
    return b"\r" in rest or b"\n" in rest


def _headers(head: bytes) -> tuple[list[str], dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return lines[0].split(), headers


def _peer(sock: Any) -> str | None:
    """The client's IP address (an IPv4-mapped IPv6 address as IPv4), or None."""
    try:
        address = str(sock.getpeername()[0])
    except (OSError, IndexError, TypeError):
        return None
    return address.removeprefix("::ffff:")


def _content_length(headers: dict[str, str]) -> int | None:
    """The announced body length (0 if none), or None (answered 400) unless it is 1 to
    :data:`MAX_LENGTH_DIGITS` ASCII digits: the head is read as latin-1, where ``str.isdigit``
    also takes ``²``, ``³`` and ``¹``, which ``int`` refuses, and ``int`` refuses more than
    4,300 digits; either raised in the listener's selector thread."""
    raw = headers.get("content-length", "0")
    if raw.isascii() and raw.isdigit() and len(raw) <= MAX_LENGTH_DIGITS:
        return int(raw)
    return None


MAX_HEADER_LINES = 100
"""The most lines a rights request's head may have (a runner's ask has a few)."""
MAX_READS = 64
"""The most ``recv`` calls a rights request may take to arrive whole (a runner's ask
arrives in one or two segments); a trickle beyond is answered 400."""
_REFUSED = b"\r\n\r\n"
"""What the listener hands to a worker for a request it refuses unread: an empty head,
answered 400."""


class _Listener(health._Listener):
    """The health server's listener, with at most ``per_source`` connections open per
    source address (one pod's flood, or a guest's through its runner pod, takes its own
    share only), reading a body (up to :data:`MAX_BODY`) after the head, within the same
    ``read_timeout``. Complete asks are answered oldest first, and one that has waited
    ``stale_after`` seconds since its connection was accepted is closed unanswered
    before any work (no grant recorded), counted in ``service.dropped``
    (:class:`RightsServer`)."""

    def __init__(self, address: tuple[str, int], service: RightsService, read_timeout: float,
                 workers: int, max_connections: int, per_source: int, *,
                 stale_after: float | None, clock: Clock) -> None:
        super().__init__(address, lambda _m, _t: (500, b"", "text/plain"), read_timeout,
                         workers, max_connections, per_source,
                         stale_after=stale_after, on_stale=service.dropped.inc,
                         on_error=service.failed.inc, clock=clock, name="rights")
        self._service = service

    def _request_of(self, reading: health._Reading) -> bytes | None:
        """The head, its blank line and the body its Content-Length announces. The head
        is parsed once, when its blank line arrives (``reading.end``), so a body trickled
        in byte by byte costs a length comparison per ``recv``, not a parse. A head of
        :data:`MAX_HEADER_LINES` lines or more, or a request not whole after
        :data:`MAX_READS` reads, is answered 400 (:data:`_REFUSED`)."""
        if reading.end is None:
            head = super()._request_of(reading)
            if head is None:
                return _REFUSED if reading.reads >= MAX_READS else None
            if not head:
                return head  # a head over the cap: 431
            if head.count(b"\r\n") >= MAX_HEADER_LINES:
                return _REFUSED
            length = _content_length(_headers(head)[1])
            body = length if length is not None and length <= MAX_BODY else 0  # else 400/413
            reading.end = len(head) + 4 + body
        if len(reading.head) < reading.end:
            return _REFUSED if reading.reads >= MAX_READS else None  # the body still arriving
        return bytes(reading.head[:reading.end])

    def _answer(self, sock: Any, request: bytes) -> None:
        end = request.find(b"\r\n\r\n")
        if not request or end < 0:
            status, doc = _refuse(431, BAD_REQUEST, "request head too large")
        else:
            line, headers = _headers(request[:end])
            length = _content_length(headers)
            if (len(line) != 3 or not line[2].startswith("HTTP/") or length is None
                    or _bare_line_break(request[:end])):
                status, doc = _refuse(400, BAD_REQUEST, "bad request")
            elif length > MAX_BODY:
                status, doc = _refuse(413, BAD_REQUEST, f"body over {MAX_BODY} bytes")
            else:
                try:
                    status, doc = self._service.answer(line[0], line[1],
                                                       headers.get("authorization"),
                                                       request[end + 4:], _peer(sock))
                except Exception:
                    logger.exception("rights: request failed")
                    self._service.failed.inc()
                    status, doc = _refuse(500, "InternalError", "internal error")
        body = json.dumps(doc, separators=(",", ":")).encode()
        sock.setblocking(True)
        sock.settimeout(self._read_timeout)
        sock.sendall(
            f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode("latin-1") + body)


RIGHTS_WORKERS = 32
"""Threads answering asks (``--rights-workers``). A term's first ask of a pod waits on the
API server (a review or a Secret read; for a runner not started, the pod's write), so
after a leader change the fleet's first grants go about as fast as threads wait at once:
on a loaded 2-core machine, 500 pods whose guests had started were granted at 34 to 52
per second by 8 threads and 114 to 134 by 32 (docs/protocol.md, "A term's first grants
are the tighter limit")."""


class RightsServer:
    """Serves :class:`RightsService` on ``host:port`` (``port=0``: a free one).

    **Oldest first, and no work for an ask whose runner may be gone.** After a leader
    change the whole fleet asks at once, each runner waiting
    :data:`~neonvm.api.rights.RETRY_TIMEOUT` for its answer before it asks again on a new
    connection. Answered in arrival order with nothing dropped, such a burst keeps every
    worker busy with asks whose runners have left, and hardly any grant arrives in time.
    So an ask that has waited ``stale_after`` (default :data:`STALE_AFTER`) since its
    connection was accepted (the runner's timer starts before its connect) is closed
    unanswered before any work: no grant is recorded for it, and to its runner it is a
    lost answer, which it asks again for (counted in ``service.dropped``). Every worker
    then works only on asks whose runners still wait, in arrival order, so no source's
    asks can be put ahead of an earlier ask of another (newest first allowed that: a
    flood of fresh asks buried everyone else's). ``stale_after=None`` drops nothing.
    docs/protocol.md, "Stale asks dropped, oldest first"."""

    def __init__(self, service: RightsService, host: str, port: int, *,
                 read_timeout: float = 5.0, workers: int = RIGHTS_WORKERS,
                 max_connections: int = 1024, per_source: int = 32,
                 stale_after: float | None = STALE_AFTER,
                 clock: Clock = time.monotonic) -> None:
        self.service = service
        self._per_source = per_source
        self._stale_after = stale_after
        self._clock = clock
        self._address = (host, port)
        self._read_timeout = read_timeout
        self._workers = workers
        self._max_connections = max_connections
        self._listener: _Listener | None = None

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("rights server not started")
        return self._listener.port

    def start(self) -> RightsServer:
        self._listener = _Listener(self._address, self.service, self._read_timeout,
                                   self._workers, self._max_connections, self._per_source,
                                   stale_after=self._stale_after, clock=self._clock)
        self._listener.start()
        logger.info("serving POST {path} on {host}:{port}", path=RIGHTS_PATH,
                    host=self._address[0], port=self.port)
        return self

    def waiting(self) -> int:
        """Complete asks waiting for a worker (0 when not started)."""
        return 0 if self._listener is None else self._listener.waiting()

    def health_check(self) -> None:
        """Liveness (a :data:`~neonvm.leader.health.HealthCheck`): raises if a thread of
        the started listener has ended, or its selector has made no whole turn for
        :data:`~neonvm.leader.health.STUCK_AFTER` seconds. No request ends one (each costs
        its own connection), but if one ever did, no ask would be answered again and every
        runner would self-fence: the replica is restarted instead."""
        listener = self._listener
        dead = listener.dead_threads() if listener is not None else []
        if dead:
            raise RuntimeError(f"rights listener thread(s) ended or stuck: {', '.join(dead)}")

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.stop()
        self._listener = None

    def __enter__(self) -> RightsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MarkNotWritten(OSError):
    """The API server answered a term mark with a pod that does not carry it: no write
    for the term to count (:func:`api_mark_pod`; one of :data:`API_ERRORS`, so 503)."""


def api_mark_pod(api: client.ApiClient, term: Callable[[], str]) -> MarkPod:
    """:data:`MarkPod` through the API server: a merge patch of :data:`TERM_ANNOTATION`
    to a fresh :func:`term_mark` of the epoch ``term()``, carrying the pod's uid (the API
    server refuses it for another uid: 422, the uid being immutable; 404 for a pod that
    is gone). Written only if the answer (the pod as stored after the patch) carries
    that value: no one held it before, so the stored pod changed, and with it its
    ``resourceVersion``. An answer without it (a mutating webhook that undid it) raises
    :class:`MarkNotWritten`: no grant."""
    def mark(namespace: str, name: str, uid: str) -> bool:
        value = term_mark(term())
        try:
            stored = kube.request(
                api, "PATCH", f"/api/v1/namespaces/{namespace}/pods/{kube.path_segment(name)}",
                body={"metadata": {"uid": uid, "annotations": {TERM_ANNOTATION: value}}},
                content_type="application/merge-patch+json", timeout=5)
        except ApiException as exc:
            if exc.status in (404, 409, 422):
                return False
            raise
        meta = (stored.get("metadata") or {}) if isinstance(stored, dict) else {}
        if (meta.get("uid") != uid
                or (meta.get("annotations") or {}).get(TERM_ANNOTATION) != value):
            raise MarkNotWritten(f"the pod as stored does not carry the term mark {value}")
        return True
    return mark


def parse_service(text: str) -> tuple[str, str]:
    """``namespace/name`` of ``--rights-service``."""
    namespace, sep, name = text.partition("/")
    if not sep or not namespace or not name:
        raise ValueError(f"{text!r}: expected namespace/name")
    return namespace, name


def parse_bind(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) of ``--rights-bind``."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r}: expected host:port")
    return host.strip("[]") or "0.0.0.0", int(port)

