"""The one door to etcd: every etcd call in neonvm goes through :class:`Etcd`.

The rest of the package speaks in this module's own small vocabulary (:class:`KeyValue`,
:class:`Compare`, :class:`Put`, :class:`Get`, :class:`Delete`, :class:`TxnResult`,
:class:`WatchEvent`), never in the client library's types, so the client can be swapped
by rewriting this file alone.

The client is ``etcd-sdk-python`` (module ``pyetcd``), a maintained fork of ``etcd3``
that imports with current protobuf. We use its generated gRPC bindings
(``pyetcd.etcdrpc``) and drive the stubs ourselves, because its convenience layer hides
what we need (the response header's revision, which is the fencing token) and its
endpoint failover parks a failed endpoint for ``time_retry`` (300 s by default): with a
single endpoint, one ``UNAVAILABLE`` makes every later call fail for five minutes, even
after etcd is back. docs/locks.md, "Client choice", has the details.

What is guaranteed:

* Every call is bounded in time: it returns or raises within ``timeout`` seconds
  (:attr:`EtcdConfig.timeout`, or the per-call override). Watches are the exception by
  nature; they end when closed, when their own ``timeout`` passes, or when the stream
  breaks.
* Every failure to get an answer raises :class:`EtcdUnavailable` with a one-line message
  naming the endpoints; every request etcd refused raises :class:`EtcdRequestFailed`.
  No ``grpc`` or ``pyetcd`` exception escapes this module.
* Reads and lease calls (idempotent) are retried across endpoints until the deadline;
  so is any call that gRPC failed before sending it (no connection to that endpoint).

What is not guaranteed:

* A transaction that was sent is never retried here: one that timed out may or may not
  have been applied. Callers make their writes safe to repeat (the lock adopts a key its own
  lease wrote; fenced writes compare revisions).
* No client-side caching: every read is a quorum read (``serializable=False``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import grpc
from loguru import logger
from pyetcd import etcdrpc

T = TypeVar("T")

DEFAULT_ENDPOINT = "http://127.0.0.1:2479"
"""The locks etcd of ``neonvm dev up`` (see neonvm.dev.cluster.DEFAULT_PORTS)."""

DEFAULT_PREFIX = "/neonvm"
DEFAULT_TIMEOUT = 5.0


class EtcdError(RuntimeError):
    """Base of everything this module raises; the message is one line, fit for a user."""


class EtcdUnavailable(EtcdError):
    """etcd did not answer in time (down, unreachable, partitioned, or too slow)."""


class EtcdRequestFailed(EtcdError):
    """etcd answered and refused the request (bad credentials, permission, compaction)."""


class EtcdAccessDenied(EtcdRequestFailed):
    """etcd refused this client's identity the keys it asked for (PERMISSION_DENIED: its
    user has no role for them, or no such user): a configuration, never an outage, and
    it does not pass by retrying (docs/locks.md, "Failure behaviour")."""


class EtcdConfigError(EtcdError):
    """The endpoints or TLS/auth settings are unusable as given."""


# ---- configuration ----------------------------------------------------------------------


@dataclass(frozen=True)
class EtcdConfig:
    """Where the locks' etcd is and how to talk to it.

    Endpoints are ``http://host:port`` or ``https://host:port``; all must use the same
    scheme. ``https`` verifies the server against ``ca`` (or the system roots when
    ``ca`` is unset); ``cert``/``key`` add a client certificate. ``user``/``password``
    enable etcd's own authentication, over either scheme.
    """

    endpoints: tuple[str, ...] = (DEFAULT_ENDPOINT,)
    prefix: str = DEFAULT_PREFIX
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str | None = None
    password: str | None = None
    timeout: float = DEFAULT_TIMEOUT

    ENV = {
        "endpoints": "NEONVM_ETCD_ENDPOINTS",
        "prefix": "NEONVM_ETCD_PREFIX",
        "ca": "NEONVM_ETCD_CA",
        "cert": "NEONVM_ETCD_CERT",
        "key": "NEONVM_ETCD_KEY",
        "user": "NEONVM_ETCD_USER",
        "password": "NEONVM_ETCD_PASSWORD",
    }

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EtcdConfig:
        """Build from ``NEONVM_ETCD_*`` variables; unset or empty ones keep the defaults."""
        env = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            value = env.get(cls.ENV[name], "").strip()
            return value or None

        endpoints = get("endpoints")
        return cls(
            endpoints=parse_endpoints(endpoints) if endpoints else (DEFAULT_ENDPOINT,),
            prefix=normalize_prefix(get("prefix") or DEFAULT_PREFIX),
            ca=_path(get("ca")),
            cert=_path(get("cert")),
            key=_path(get("key")),
            user=get("user"),
            password=get("password"),
        )

    def env(self) -> dict[str, str]:
        """The ``NEONVM_ETCD_*`` variables that :meth:`from_env` turns back into this
        config (the deadline aside): for a child process."""
        env = {self.ENV["endpoints"]: ",".join(self.endpoints), self.ENV["prefix"]: self.prefix}
        for name in ("ca", "cert", "key", "user", "password"):
            value = getattr(self, name)
            if value is not None:
                env[self.ENV[name]] = str(value)
        return env

    def with_overrides(self, **changes: Any) -> EtcdConfig:
        """A copy with the given fields replaced; ``None`` means "keep what is there"."""
        kept = {k: v for k, v in changes.items() if v is not None}
        if isinstance(kept.get("endpoints"), str):
            kept["endpoints"] = parse_endpoints(kept["endpoints"])
        if "prefix" in kept:
            kept["prefix"] = normalize_prefix(kept["prefix"])
        for name in ("ca", "cert", "key"):
            if name in kept:
                kept[name] = Path(kept[name])
        return replace(self, **kept)

    @property
    def secure(self) -> bool:
        return urlsplit(self.endpoints[0]).scheme == "https"

    def validate(self) -> None:
        """Raise :class:`EtcdConfigError` for settings that cannot work."""
        if not self.endpoints:
            raise EtcdConfigError("no etcd endpoints given (set NEONVM_ETCD_ENDPOINTS)")
        schemes = {urlsplit(e).scheme for e in self.endpoints}
        if len(schemes) > 1:
            raise EtcdConfigError(f"etcd endpoints mix schemes {sorted(schemes)}; use one")
        if not self.secure and (self.ca or self.cert or self.key):
            raise EtcdConfigError("etcd TLS files given but the endpoints are http://; "
                                  "use https:// endpoints")
        if bool(self.cert) != bool(self.key):
            raise EtcdConfigError("etcd client TLS needs both a certificate and a key")
        if bool(self.user) != bool(self.password):
            raise EtcdConfigError("etcd authentication needs both a user and a password")
        for name in ("ca", "cert", "key"):
            path: Path | None = getattr(self, name)
            if path is not None and not path.is_file():
                raise EtcdConfigError(f"etcd {name} file not found: {path}")
        if self.timeout <= 0:
            raise EtcdConfigError(f"etcd timeout must be positive, got {self.timeout}")


def parse_endpoints(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"http://a:2379,http://b:2379"`` → a tuple of validated ``scheme://host:port``."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for raw in (i.strip() for i in items):
        if not raw:
            continue
        url = raw if "://" in raw else f"http://{raw}"
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EtcdConfigError(f"bad etcd endpoint {raw!r}: want http(s)://host:port")
        try:
            port = parts.port
        except ValueError:
            port = None
        if port is None:
            raise EtcdConfigError(f"bad etcd endpoint {raw!r}: no port")
        out.append(f"{parts.scheme}://{parts.hostname}:{port}")
    if not out:
        raise EtcdConfigError("no etcd endpoints given")
    return tuple(out)


def normalize_prefix(prefix: str) -> str:
    """``neonvm/`` → ``/neonvm``: one leading slash, no trailing one."""
    cleaned = "/" + prefix.strip().strip("/")
    if cleaned == "/":
        raise EtcdConfigError("etcd key prefix must not be empty")
    return cleaned


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


# ---- the vocabulary ---------------------------------------------------------------------


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd stored it. ``lease`` is 0 when the key has no lease."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


CompareTarget = Literal["create", "mod", "version", "value", "lease"]
CompareOp = Literal["==", "!=", "<", ">"]


@dataclass(frozen=True)
class Compare:
    """One condition of a transaction, e.g. ``Compare(key, "mod", "==", 42)``.

    On a missing key, etcd compares create/mod revision and version as 0.
    """

    key: str
    target: CompareTarget
    op: CompareOp
    operand: int | bytes


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class Get:
    key: str
    prefix: bool = False


@dataclass(frozen=True)
class Delete:
    key: str


Op = Put | Get | Delete


@dataclass(frozen=True)
class OpResult:
    """The result of one operation of a transaction: ``kvs`` for a Get, ``deleted`` for a
    Delete, nothing for a Put."""

    kvs: tuple[KeyValue, ...] = ()
    deleted: int = 0


@dataclass(frozen=True)
class TxnResult:
    """``revision`` is the store's revision after the transaction: the revision of the
    writes it made, when it made any."""

    succeeded: bool
    revision: int
    results: tuple[OpResult, ...]


@dataclass(frozen=True)
class Range:
    kvs: tuple[KeyValue, ...]
    revision: int


@dataclass(frozen=True)
class LeaseGrant:
    id: int
    ttl: int


@dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    kv: KeyValue
    prev: KeyValue | None
    revision: int


def prefix_end(prefix: str) -> bytes:
    """The exclusive end of the key range that starts with ``prefix``."""
    raw = bytearray(prefix.encode())
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] < 0xFF:
            raw[i] += 1
            return bytes(raw[: i + 1])
    return b"\0"


# ---- the client -------------------------------------------------------------------------

_NO_ANSWER = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.CANCELLED}
_RESET_DETAILS = ("RST_STREAM", "Stream removed")


def went_away(exc: grpc.RpcError) -> bool:
    """The one mapping from a gRPC failure to ours, for every call (unary and watch):
    True when etcd gave no answer (EtcdUnavailable: down, unreachable, too slow, or the
    connection or stream was cut), False when it answered and refused (EtcdRequestFailed).

    A stream reset counts as no answer whatever its code: etcd over TLS ends the streams
    still open when it stops with RST_STREAM, which gRPC reports as INTERNAL "Stream
    removed ... RST_STREAM" (docs/locks.md, "When etcd stops")."""
    code = _code(exc)
    return code in _NO_ANSWER or (code == grpc.StatusCode.INTERNAL and _reset(exc))


def _retryable(exc: grpc.RpcError) -> bool:
    """An idempotent call that failed so may be sent again (to the next endpoint)."""
    return _code(exc) == grpc.StatusCode.UNAVAILABLE or _reset(exc)


_CHANNEL_OPTIONS = [
    # After etcd restarts, reconnect within a second rather than grpc's 120 s backoff cap.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Notice a silently dead server on long-lived streams (watches). etcd's default
    # --grpc-keepalive-min-time is 5 s; 10 s stays above it.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]

_COMPARE_TARGET = {
    "create": etcdrpc.Compare.CREATE,
    "mod": etcdrpc.Compare.MOD,
    "version": etcdrpc.Compare.VERSION,
    "value": etcdrpc.Compare.VALUE,
    "lease": etcdrpc.Compare.LEASE,
}
_COMPARE_FIELD = {"create": "create_revision", "mod": "mod_revision", "version": "version",
                  "value": "value", "lease": "lease"}
_COMPARE_OP = {
    "==": etcdrpc.Compare.EQUAL,
    "!=": etcdrpc.Compare.NOT_EQUAL,
    "<": etcdrpc.Compare.LESS,
    ">": etcdrpc.Compare.GREATER,
}


@dataclass
class _Endpoint:
    url: str
    channel: Any
    kv: Any
    lease: Any
    watch: Any
    auth: Any
    maintenance: Any


@dataclass
class _CallState:
    """Which endpoint to use next and the auth token; guarded by ``lock``."""

    current: int = 0
    token: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class Etcd:
    """A connection to the locks' etcd (one or more endpoints of one cluster).

    Thread-safe: gRPC channels are, and the little state kept here is locked. Cheap to
    create; nothing is sent until the first call.
    """

    def __init__(self, config: EtcdConfig) -> None:
        config.validate()
        self.config = config
        credentials = self._credentials(config) if config.secure else None
        self._endpoints = [self._endpoint(url, credentials) for url in config.endpoints]
        self._state = _CallState()
        self._closed = False

    # ---- KV ----

    def get(self, key: str, *, timeout: float | None = None) -> KeyValue | None:
        result = self.range(key, timeout=timeout)
        return result.kvs[0] if result.kvs else None

    def range(self, key: str, *, prefix: bool = False, timeout: float | None = None) -> Range:
        request = _range_request(Get(key, prefix))
        response = self._call(f"read {key}", lambda ep, t, md: ep.kv.Range(
            request, timeout=t, metadata=md), timeout=timeout, idempotent=True)
        return Range(tuple(_kv(kv) for kv in response.kvs), response.header.revision)

    def get_prefix(self, prefix: str, *, timeout: float | None = None) -> Range:
        return self.range(prefix, prefix=True, timeout=timeout)

    def put(self, key: str, value: bytes, *, lease: int = 0,
            timeout: float | None = None) -> int:
        """Unconditional put; returns its revision. Sent at most once, like :meth:`txn`."""
        return self.txn((), [Put(key, value, lease)], timeout=timeout).revision

    def delete(self, key: str, *, timeout: float | None = None) -> int:
        """Unconditional delete; returns how many keys went (0 or 1). Sent at most once."""
        return self.txn((), [Delete(key)], timeout=timeout).results[0].deleted

    def txn(self, compare: Sequence[Compare], success: Sequence[Op] = (),
            failure: Sequence[Op] = (), *, timeout: float | None = None) -> TxnResult:
        """One transaction. Sent at most once (tried on another endpoint only if it could
        not be sent at all): on EtcdUnavailable its outcome is unknown."""
        request = etcdrpc.TxnRequest(
            compare=[_compare(c) for c in compare],
            success=[_request_op(op) for op in success],
            failure=[_request_op(op) for op in failure],
        )
        response = self._call("transaction", lambda ep, t, md: ep.kv.Txn(
            request, timeout=t, metadata=md), timeout=timeout, idempotent=False)
        return TxnResult(bool(response.succeeded), response.header.revision,
                         tuple(_op_result(r) for r in response.responses))

    def check_access(self, prefix: str, *, read: Sequence[str] = (),
                     timeout: float | None = None) -> None:
        """Raise :class:`EtcdRequestFailed` unless this client may read and write every
        key that starts with ``prefix`` and read each key of ``read``
        (:class:`EtcdUnavailable` when etcd does not answer).

        One transaction that writes nothing: its condition never holds (no key has a
        negative version), so only its failure branch runs, reads of at most one key
        each; but etcd checks the permissions of both branches before it runs either.

        A ``PERMISSION_DENIED`` is :class:`EtcdAccessDenied` only once every endpoint
        has answered it: one member can refuse a valid user by itself (etcd bugs after a
        member restart or join), and the client then moves to a member that admits it,
        for this call and the next ones.
        """
        end = prefix_end(prefix)

        def scan(key: bytes, range_end: bytes = b"") -> Any:
            return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(
                key=key, range_end=range_end, limit=1, keys_only=True))

        request = etcdrpc.TxnRequest(
            compare=[_compare(Compare(prefix, "version", "<", 0))],
            success=[etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(
                key=prefix.encode(), range_end=end))],
            failure=[scan(prefix.encode(), end), *(scan(k.encode()) for k in read)],
        )
        response = self._call(f"read and write the keys under {prefix}",
                              lambda ep, t, md: ep.kv.Txn(request, timeout=t, metadata=md),
                              timeout=timeout, idempotent=True, ask_every_endpoint=True)
        if response.succeeded:  # pragma: no cover - etcd broke its own compare
            raise EtcdError(f"etcd applied an access check that cannot apply ({prefix})")

    # ---- leases ----

    def grant_lease(self, ttl: int, *, timeout: float | None = None) -> LeaseGrant:
        # Sent at most once: a retry after a lost answer would leak a lease (harmless:
        # it expires after ttl with nothing attached), so the caller decides.
        request = etcdrpc.LeaseGrantRequest(TTL=ttl, ID=0)
        response = self._call("grant a lease", lambda ep, t, md: ep.lease.LeaseGrant(
            request, timeout=t, metadata=md), timeout=timeout, idempotent=False)
        if response.error:
            raise EtcdRequestFailed(f"etcd refused a lease: {response.error}")
        return LeaseGrant(response.ID, response.TTL)

    def keepalive_once(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Refresh the lease once; return its new TTL, or 0 when the lease is gone."""
        request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)

        def call(ep: _Endpoint, t: float, md: Any) -> Any:
            stream = ep.lease.LeaseKeepAlive(iter([request]), timeout=t, metadata=md)
            try:
                for response in stream:
                    return response
            finally:
                stream.cancel()
            raise EtcdUnavailable("etcd closed the lease keepalive stream without answering")

        response = self._call("keep a lease alive", call, timeout=timeout, idempotent=True)
        return int(response.TTL)

    def lease_ttl(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Seconds the lease has left, or -1 when it does not exist."""
        request = etcdrpc.LeaseTimeToLiveRequest(ID=lease_id, keys=False)
        response = self._call("read a lease", lambda ep, t, md: ep.lease.LeaseTimeToLive(
            request, timeout=t, metadata=md), timeout=timeout, idempotent=True)
        return int(response.TTL)

    def revoke_lease(self, lease_id: int, *, timeout: float | None = None) -> bool:
        """Revoke the lease (deleting its keys); False if it did not exist."""
        request = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        try:
            self._call("revoke a lease", lambda ep, t, md: ep.lease.LeaseRevoke(
                request, timeout=t, metadata=md), timeout=timeout, idempotent=True)
        except EtcdRequestFailed as exc:
            if "lease not found" in str(exc):
                return False
            raise
        return True

    # ---- watches ----

    def watch(self, key: str, *, prefix: bool = False, start_revision: int = 0,
              timeout: float | None = None) -> WatchStream:
        """Stream the changes of ``key`` (or every key under it) from ``start_revision``
        (0: from now). Close the stream when done; ``timeout`` ends it quietly."""
        create = etcdrpc.WatchCreateRequest(key=key.encode(), prev_kv=True,
                                            start_revision=start_revision)
        if prefix:
            create.range_end = prefix_end(key)
        # Authenticate (when configured) under the usual deadline and error mapping.
        metadata = self._call("authenticate", lambda ep, t, md: md, timeout=None,
                              idempotent=True)
        with self._state.lock:
            index = self._state.current
        return WatchStream(self._endpoints[index], etcdrpc.WatchRequest(create_request=create),
                           metadata, timeout, on_unavailable=lambda: self._advance(index))

    def wait_for_change(self, key: str, after_revision: int, timeout: float) -> bool:
        """Block until ``key`` changes after ``after_revision``; False when ``timeout``
        passes first. Used to wait for a held lock without polling."""
        if timeout <= 0:
            return False
        stream = self.watch(key, start_revision=after_revision + 1, timeout=timeout)
        try:
            for _event in stream:
                return True
        except EtcdRequestFailed as exc:
            if "compacted" in str(exc):
                return True  # history is gone, so the key may have changed: look again
            raise
        finally:
            stream.close()
        return False

    # ---- administration ----

    def enable_auth(self, root_password: str, user: str, password: str, prefix: str) -> None:
        """Turn on etcd authentication: a ``root`` user, and ``user`` allowed to read and
        write under ``prefix`` only (all that neonvm needs). What an operator does with
        etcdctl; here for development clusters and tests. Run once, before auth is on."""
        perm = etcdrpc.Permission(permType=etcdrpc.Permission.READWRITE,
                                  key=prefix.encode(), range_end=prefix_end(prefix))
        role = f"{user}-role"
        steps: list[tuple[str, str, Any]] = [
            ("add the root role", "RoleAdd", etcdrpc.AuthRoleAddRequest(name="root")),
            ("add the root user", "UserAdd",
             etcdrpc.AuthUserAddRequest(name="root", password=root_password)),
            ("grant root", "UserGrantRole",
             etcdrpc.AuthUserGrantRoleRequest(user="root", role="root")),
            (f"add role {role}", "RoleAdd", etcdrpc.AuthRoleAddRequest(name=role)),
            (f"grant {prefix} to {role}", "RoleGrantPermission",
             etcdrpc.AuthRoleGrantPermissionRequest(name=role, perm=perm)),
            (f"add user {user}", "UserAdd",
             etcdrpc.AuthUserAddRequest(name=user, password=password)),
            (f"grant {role} to {user}", "UserGrantRole",
             etcdrpc.AuthUserGrantRoleRequest(user=user, role=role)),
            ("enable authentication", "AuthEnable", etcdrpc.AuthEnableRequest()),
        ]
        self._admin(steps, tolerate_existing=False)

    def ensure_auth(self, root_password: str) -> None:
        """Idempotently: a ``root`` user with the root role, and authentication on.

        For a client that is ``root`` once auth is on: with client-certificate auth
        (etcd's ``--client-cert-auth``) a certificate whose CN is ``root``. The password
        only matters to clients that log in by password; an existing one is kept."""
        self._admin([
            ("add the root role", "RoleAdd", etcdrpc.AuthRoleAddRequest(name="root")),
            ("add the root user", "UserAdd",
             etcdrpc.AuthUserAddRequest(name="root", password=root_password)),
            ("grant root", "UserGrantRole",
             etcdrpc.AuthUserGrantRoleRequest(user="root", role="root")),
            ("enable authentication", "AuthEnable", etcdrpc.AuthEnableRequest()),
        ], tolerate_existing=True)

    def grant_prefix(self, user: str, password: str, prefix: str) -> None:
        """Idempotently: role ``user`` may read and write the keys under ``prefix + "/"``
        (every key neonvm writes for that prefix, and nothing else), and user ``user``
        holds it. With client-certificate auth, a certificate whose CN is ``user`` acts
        as that user. Needs root (see :meth:`ensure_auth`)."""
        base = prefix.rstrip("/") + "/"
        perm = etcdrpc.Permission(permType=etcdrpc.Permission.READWRITE,
                                  key=base.encode(), range_end=prefix_end(base))
        self._admin([
            (f"add role {user}", "RoleAdd", etcdrpc.AuthRoleAddRequest(name=user)),
            (f"grant {base} to role {user}", "RoleGrantPermission",
             etcdrpc.AuthRoleGrantPermissionRequest(name=user, perm=perm)),
            (f"add user {user}", "UserAdd",
             etcdrpc.AuthUserAddRequest(name=user, password=password)),
            (f"grant role {user} to user {user}", "UserGrantRole",
             etcdrpc.AuthUserGrantRoleRequest(user=user, role=user)),
        ], tolerate_existing=True)

    def revoke_prefix(self, user: str) -> None:
        """Undo :meth:`grant_prefix`'s grant: user ``user`` no longer holds role ``user``
        (the user and the role stay). What an operator does with ``etcdctl user
        revoke-role``; here for tests. Needs root."""
        self._admin([(f"revoke role {user} from user {user}", "UserRevokeRole",
                      etcdrpc.AuthUserRevokeRoleRequest(name=user, role=user))],
                    tolerate_existing=False)

    def _admin(self, steps: Sequence[tuple[str, str, Any]], *, tolerate_existing: bool
               ) -> None:
        """Run auth administration calls in order; with ``tolerate_existing``, a role or
        user that already exists counts as done."""
        for what, method, request in steps:
            def step(ep: _Endpoint, t: float, md: Any, m: str = method, r: Any = request
                     ) -> Any:
                return getattr(ep.auth, m)(r, timeout=t, metadata=md)

            try:
                self._call(what, step, timeout=None, idempotent=False)
            except EtcdRequestFailed as exc:
                if not (tolerate_existing and "already exists" in str(exc)):
                    raise

    # ---- misc ----

    def describe(self) -> str:
        return ", ".join(self.config.endpoints)

    def close(self) -> None:
        self._closed = True
        for ep in self._endpoints:
            ep.channel.close()

    def __enter__(self) -> Etcd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----

    @staticmethod
    def _credentials(config: EtcdConfig) -> Any:
        def read(p: Path | None) -> bytes | None:
            return p.read_bytes() if p else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(config.ca),
            private_key=read(config.key),
            certificate_chain=read(config.cert),
        )

    @staticmethod
    def _endpoint(url: str, credentials: Any) -> _Endpoint:
        target = urlsplit(url).netloc
        if credentials is None:
            channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
        else:
            channel = grpc.secure_channel(target, credentials, options=_CHANNEL_OPTIONS)
        return _Endpoint(
            url=url, channel=channel, kv=etcdrpc.KVStub(channel),
            lease=etcdrpc.LeaseStub(channel), watch=etcdrpc.WatchStub(channel),
            auth=etcdrpc.AuthStub(channel), maintenance=etcdrpc.MaintenanceStub(channel),
        )

    def _metadata(self, ep: _Endpoint, timeout: float) -> Any:
        """The auth token as call metadata; authenticates on first use."""
        if not self.config.user:
            return None
        with self._state.lock:
            token = self._state.token
        if token is None:
            request = etcdrpc.AuthenticateRequest(name=self.config.user,
                                                  password=self.config.password or "")
            token = ep.auth.Authenticate(request, timeout=timeout).token
            with self._state.lock:
                self._state.token = token
        return (("token", token),)

    def _call(self, what: str, fn: Callable[[_Endpoint, float, Any], T], *,
              timeout: float | None, idempotent: bool,
              ask_every_endpoint: bool = False) -> T:
        """Run ``fn`` against an endpoint within the deadline, mapping errors.

        Idempotent calls move on to the next endpoint when one does not answer and keep
        trying until the deadline. Others do so only while the request provably never
        left this process (no connection); otherwise they fail at once, since the
        outcome is unknown, and the next call goes to the next endpoint. With
        ``ask_every_endpoint`` (a call that writes nothing), ``PERMISSION_DENIED`` moves
        on to the next endpoint too, and is raised only once each endpoint refused.
        """
        if self._closed:
            raise EtcdError("etcd client used after close")
        budget = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        reauthenticated = False
        denied = 0
        last: grpc.RpcError | None = None
        backoff = 0.05
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            with self._state.lock:
                index = self._state.current
            ep = self._endpoints[index]
            try:
                return fn(ep, remaining, self._metadata(ep, remaining))
            except grpc.RpcError as exc:
                last = exc
                code = exc.code()
                if not reauthenticated and _stale_token(exc):
                    # Simple tokens expire after idling, and a JWT carries the auth
                    # store's revision at its issue, which any auth change makes "old":
                    # get a fresh token and retry once (as etcd's Go client does).
                    reauthenticated = True
                    with self._state.lock:
                        self._state.token = None
                    continue
                if (code == grpc.StatusCode.PERMISSION_DENIED and ask_every_endpoint
                        and denied + 1 < len(self._endpoints)):
                    denied += 1
                    self._advance(index, "refused this client (PERMISSION_DENIED)")
                    continue
                if not went_away(exc):
                    refused = (EtcdAccessDenied if code == grpc.StatusCode.PERMISSION_DENIED
                               else EtcdRequestFailed)
                    raise refused(
                        f"etcd at {ep.url} refused to {what}: {_detail(exc)}") from None
                self._advance(index)
                if not _retryable(exc) or not (idempotent or _never_sent(exc)):
                    break
            # Every endpoint refused the connection: back off a little, then go again.
            time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
            backoff = min(backoff * 2, 0.5)
        detail = _detail(last) if last is not None else "no time left"
        raise EtcdUnavailable(
            f"etcd unreachable at {self.describe()}: could not {what} within "
            f"{budget:.1f}s ({detail})"
        )

    def _advance(self, failed_index: int, why: str = "did not answer") -> None:
        with self._state.lock:
            if self._state.current == failed_index and len(self._endpoints) > 1:
                self._state.current = (failed_index + 1) % len(self._endpoints)
                logger.bind(endpoint=self._endpoints[failed_index].url).debug(
                    "etcd endpoint {why}; moving to the next one", why=why)


class WatchStream:
    """An open watch: iterate for :class:`WatchEvent`; :meth:`close` ends it.

    Iteration ends quietly when the stream is closed or its timeout passes, and raises
    :class:`EtcdUnavailable` when the server goes away, or :class:`EtcdRequestFailed`
    when etcd cancels the watch (for example because ``start_revision`` was compacted).

    "Goes away" includes a stop in progress: a stopping etcd sends GOAWAY at once but
    keeps open streams until its hard stop (its request timeout, 7 s by default), so the
    watch ends as soon as its connection leaves READY rather than then (docs/locks.md,
    "When etcd stops").
    """

    def __init__(self, endpoint: _Endpoint, create: Any, metadata: Any, timeout: float | None,
                 on_unavailable: Callable[[], None]) -> None:
        self._stop = threading.Event()
        self._draining = threading.Event()
        self._ready_seen = False
        self._endpoint = endpoint
        self._on_unavailable = on_unavailable

        def requests() -> Iterator[Any]:
            yield create
            self._stop.wait()

        self._call = self._endpoint.watch.Watch(requests(), timeout=timeout, metadata=metadata)
        self._endpoint.channel.subscribe(self._on_channel_state, try_to_connect=False)

    def __iter__(self) -> Iterator[WatchEvent]:
        try:
            for response in self._call:
                if response.canceled:
                    reason = response.cancel_reason or (
                        f"revision compacted to {response.compact_revision}"
                        if response.compact_revision else "canceled by server")
                    raise EtcdRequestFailed(f"etcd ended the watch: {reason}")
                for event in response.events:
                    yield WatchEvent(
                        kind="delete" if event.type == 1 else "put",
                        kv=_kv(event.kv),
                        prev=_kv(event.prev_kv) if event.HasField("prev_kv") else None,
                        revision=response.header.revision,
                    )
        except grpc.RpcError as exc:
            if self._stop.is_set():
                return
            if self._draining.is_set() or (
                    _code(exc) not in (grpc.StatusCode.CANCELLED,
                                       grpc.StatusCode.DEADLINE_EXCEEDED)
                    and went_away(exc)):
                self._on_unavailable()
                detail = ("its connection is closing or closed (a stopping etcd sends GOAWAY)"
                          if self._draining.is_set() else _detail(exc))
                raise EtcdUnavailable(
                    f"etcd at {self._endpoint.url} went away during a watch: {detail}"
                ) from None
            if _code(exc) in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                return  # the watch's own timeout
            raise EtcdRequestFailed(
                f"etcd at {self._endpoint.url} refused a watch: {_detail(exc)}") from None
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        self._endpoint.channel.unsubscribe(self._on_channel_state)
        self._call.cancel()

    def _on_channel_state(self, state: grpc.ChannelConnectivity) -> None:
        """Once the channel was READY under this watch, any other state means the
        connection that carries it is closing (GOAWAY) or gone: end the watch now."""
        if state == grpc.ChannelConnectivity.READY:
            self._ready_seen = True
        elif self._ready_seen and not self._stop.is_set():
            self._draining.set()
            self._call.cancel()


# ---- conversions --------------------------------------------------------------------------


def _code(exc: grpc.RpcError) -> grpc.StatusCode | None:
    try:
        code: grpc.StatusCode = exc.code()
    except Exception:  # pragma: no cover - an RpcError that is not a Call
        return None
    return code


def _reset(exc: grpc.RpcError) -> bool:
    """The server reset the stream (HTTP/2 RST_STREAM, or the stream cut with its socket)."""
    try:
        details = exc.details() or ""
    except Exception:  # pragma: no cover - an RpcError that is not a Call
        return False
    return any(marker in details for marker in _RESET_DETAILS)


_STALE_TOKEN_DETAILS = ("revision of auth store is old", "invalid auth token")
"""etcd's ErrAuthOldRevision (INVALID_ARGUMENT) and ErrInvalidAuthToken: the token, not
the request, is what etcd refused."""


def _stale_token(exc: grpc.RpcError) -> bool:
    """etcd refused the call's auth token as expired, unknown or issued before the last
    auth change (clientv3's ``shouldRefreshToken``): a fresh token may be admitted."""
    if _code(exc) == grpc.StatusCode.UNAUTHENTICATED:
        return True
    try:
        details = exc.details() or ""
    except Exception:  # pragma: no cover - an RpcError that is not a Call
        return False
    return any(marker in details for marker in _STALE_TOKEN_DETAILS)


def _never_sent(exc: grpc.RpcError) -> bool:
    """gRPC fails a call fast, before sending anything, while it has no connection."""
    try:
        return "failed to connect" in (exc.details() or "")
    except Exception:  # pragma: no cover - an RpcError that is not a Call
        return False


def _detail(exc: grpc.RpcError) -> str:
    try:
        return f"{exc.code().name}: {exc.details()}"
    except Exception:  # pragma: no cover - an RpcError that is not a Call
        return str(exc)


def _kv(kv: Any) -> KeyValue:
    return KeyValue(
        key=kv.key.decode(errors="replace"),
        value=bytes(kv.value),
        create_revision=kv.create_revision,
        mod_revision=kv.mod_revision,
        version=kv.version,
        lease=kv.lease,
    )


def _range_request(op: Get) -> Any:
    request = etcdrpc.RangeRequest(key=op.key.encode(), serializable=False)
    if op.prefix:
        request.range_end = prefix_end(op.key)
    return request


def _compare(c: Compare) -> Any:
    message = etcdrpc.Compare(key=c.key.encode(), target=_COMPARE_TARGET[c.target],
                              result=_COMPARE_OP[c.op])
    operand = c.operand if c.target != "value" or isinstance(c.operand, bytes) \
        else str(c.operand).encode()
    setattr(message, _COMPARE_FIELD[c.target], operand)
    return message


def _request_op(op: Op) -> Any:
    if isinstance(op, Put):
        return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(
            key=op.key.encode(), value=op.value, lease=op.lease))
    if isinstance(op, Get):
        return etcdrpc.RequestOp(request_range=_range_request(op))
    return etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(
        key=op.key.encode()))


def _op_result(response: Any) -> OpResult:
    kind = response.WhichOneof("response")
    if kind == "response_range":
        return OpResult(kvs=tuple(_kv(kv) for kv in response.response_range.kvs))
    if kind == "response_delete_range":
        return OpResult(deleted=response.response_delete_range.deleted)
    return OpResult()
