"""One etcd lease per replica, kept alive by a thread (etcd's ``concurrency.Session``).

Every lock a replica takes is bound to its session's lease, so the locks of a replica
that dies (SIGKILL, partition, a paused process) disappear by themselves when the lease
expires, and only then: etcd deletes keys only when their lease expires or is revoked.

What is guaranteed:

* ``lost`` is set *before* the lease can have expired on the server, as long as the two
  clocks run at the same rate: it is set once ``granted TTL - margin`` seconds have
  passed since the *sending* of the last keepalive that etcd answered, and the server's
  expiry is at least ``TTL`` after it received that request.
* ``lost`` is set at once when etcd says the lease is gone (a keepalive answered with
  TTL 0: it expired, was revoked, or etcd lost it).
* ``lost`` is never cleared. A session is single-use: after a loss, start a new one.
* Callbacks registered with :meth:`Session.on_lost` run once, right after ``lost`` is
  set (in the keepalive thread, or in the registering thread if already lost).
* :meth:`Session.close` revokes the lease, so the session's keys go at once.

What is not guaranteed:

* ``lost`` does not mean the lease is gone. After an etcd restart, etcd restores leases
  with a full TTL, so the lease can outlive our giving up on it. A lost session therefore
  keeps trying, in the background, to revoke its lease as soon as etcd answers, which
  deletes the keys bound to it; until then they stay, held by nobody who acts on them.
* A process paused for longer than the TTL (GC, SIGSTOP) learns of the loss only when it
  runs again; whatever it does in between must be fenced (see ``lock.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from loguru import logger

from neonvm.leader.etcd import Etcd, EtcdError

DEFAULT_TTL = 10
"""Seconds. etcd's minimum is about 1.5 s with its default election timeout."""

LostCallback = Callable[[str], None]


class Session:
    """An etcd lease and the thread that keeps it alive.

    Create with a live etcd (the grant is one round trip and raises
    :class:`~neonvm.leader.etcd.EtcdUnavailable` when etcd is down); stop with
    :meth:`close`. Also a context manager.
    """

    def __init__(self, etcd: Etcd, ttl: int = DEFAULT_TTL, *, name: str = "session") -> None:
        if ttl < 2:
            raise ValueError(f"session TTL must be at least 2 s, got {ttl}")
        self.etcd = etcd
        self.name = name
        self.lost = threading.Event()
        self.lost_reason: str | None = None
        sent = time.monotonic()
        grant = etcd.grant_lease(ttl)
        self.lease_id: int = grant.id
        self.ttl: int = grant.ttl
        self._expires_at = sent + grant.ttl
        self._margin = min(1.0, grant.ttl * 0.2)
        self._interval = grant.ttl / 3
        self._closed = threading.Event()
        self._callbacks: list[LostCallback] = []
        self._mutex = threading.Lock()
        self._log = logger.bind(session=name, lease=f"{self.lease_id:x}")
        self._thread = threading.Thread(target=self._run, name=f"etcd-session-{name}",
                                        daemon=True)
        self._thread.start()
        self._log.debug("etcd session started", ttl=self.ttl)

    # ---- public ----

    def on_lost(self, callback: LostCallback) -> Callable[[], None]:
        """Call ``callback(reason)`` once when the session is lost; returns an unregister
        function. Runs at once if the session is already lost."""
        with self._mutex:
            if self.lost_reason is None:
                self._callbacks.append(callback)

                def unregister() -> None:
                    with self._mutex:
                        if callback in self._callbacks:
                            self._callbacks.remove(callback)

                return unregister
        callback(self.lost_reason or "session lost")
        return lambda: None

    def is_lost(self) -> bool:
        """True from the moment the loss is decided, already while callbacks run (``lost``
        is set after they ran, so that whoever waits on it finds every guard told)."""
        return self.lost_reason is not None

    def remaining(self) -> float:
        """Seconds until the lease may have expired, as far as this process can tell."""
        if self.is_lost():
            return 0.0
        return max(0.0, self._expires_at - self._margin - time.monotonic())

    def close(self, timeout: float | None = None) -> None:
        """Stop the keepalive and revoke the lease (best effort, bounded by ``timeout``).

        The session counts as lost afterwards: locks taken through it are released.
        """
        if self._closed.is_set():
            return
        self._closed.set()
        # A keepalive stuck on an unreachable etcd must not hold the stop up: the revoke
        # below is bounded, and a lease it cannot revoke expires within its TTL anyway.
        self._thread.join(timeout)
        if not self.is_lost():
            try:
                self.etcd.revoke_lease(self.lease_id, timeout=timeout)
            except EtcdError as exc:
                self._log.warning("could not revoke the lease on close; it expires "
                                  "within its TTL: {}", exc)
        self._lose("session closed")

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the keepalive thread ----

    def _run(self) -> None:
        next_at = time.monotonic() + self._interval
        while not self._closed.is_set():
            deadline = self._expires_at - self._margin
            if self._closed.wait(max(0.0, min(next_at, deadline) - time.monotonic())):
                return
            now = time.monotonic()
            if now >= deadline:
                self._lose(f"no keepalive answer from etcd for {self.ttl}s (lease TTL)")
                break
            try:
                ttl = self.etcd.keepalive_once(self.lease_id, timeout=max(0.1, deadline - now))
            except EtcdError as exc:
                self._log.warning("lease keepalive failed ({:.1f}s left): {}",
                                  deadline - time.monotonic(), exc)
                next_at = time.monotonic() + min(0.5, self._interval)
                continue
            if ttl <= 0:
                self._lose("etcd says the lease is gone (expired or revoked)")
                break
            self._expires_at = now + ttl
            next_at = now + self._interval
        self._revoke_after_loss()

    def _revoke_after_loss(self) -> None:
        """Keys of a lost session are held by nobody who acts on them: delete them as soon
        as etcd answers, instead of waiting for the lease (refreshed by a restart)."""
        while not self._closed.is_set():
            try:
                existed = self.etcd.revoke_lease(self.lease_id,
                                                 timeout=max(1.0, self._interval))
            except EtcdError:
                if self._closed.wait(1.0):
                    return
                continue
            self._log.info("lost lease revoked" if existed else "lost lease already gone")
            return

    def _lose(self, reason: str) -> None:
        with self._mutex:
            if self.lost_reason is not None:
                return
            self.lost_reason = reason
            callbacks, self._callbacks = self._callbacks, []
        if reason != "session closed":
            self._log.warning("etcd session lost: {}", reason)
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:
                self._log.exception("session-lost callback failed")
        self.lost.set()
