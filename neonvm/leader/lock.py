"""Per-VM locks in etcd, with fencing tokens (etcd's ``concurrency.Mutex``, reshaped).

Key layout: ``<prefix>/<lease namespace>/<lease name>/locks/<namespace>/<name>``: every
key belongs to one :class:`Installation` (the Lease its replicas campaign for), so
installations that share an etcd and a prefix never read, sweep or take over each other's
locks. The value is JSON naming the holder, its leader epoch, the VM's uid and when it
was taken (:class:`LockRecord`). The key is bound to the holder's session lease.

What is guaranteed:

* **One holder per key at a time.** A lock is created by a transaction that succeeds
  only if the key does not exist (``create_revision == 0``), and taken over only by a
  transaction that compares the ``mod_revision`` it read. Uncontended, an acquisition is
  one round trip.
* **Fencing token.** ``guard.token`` is the revision of the transaction that wrote the
  key (create or takeover). The key is never rewritten in place by anything else, so
  "the key's ``mod_revision`` equals my token" is true exactly while the lock is mine.
  :meth:`LockGuard.owner_compare` is that condition, for callers' own transactions, and
  :meth:`LockGuard.fenced_txn` runs a transaction guarded by it. Tokens only grow.
* **Takeover.** A holder with a higher leader epoch takes a lock held under a lower one
  at once (no wait for the old lease). A lock whose value names another VM uid (left by
  a deleted VM of the same name) is taken over by a holder of an equal or higher epoch.
  A lock we ourselves wrote from an earlier session is taken back. A malformed value
  (not written by this code) is taken over.
* **Loss is told.** ``guard.lost`` is set when the guard no longer holds the lock, as far
  as this process can know: released, its session lost (every guard of that session at
  once), replaced by a newer acquisition of ours, or found taken over by a fenced write
  or :meth:`LockGuard.check`.
* **Release** deletes the key only if it is still ours (compares the token).

What is not guaranteed:

* A holder whose lock was taken over learns it at its next fenced write or ``check()``,
  not at once (nothing watches each key). That is why every write that matters is
  fenced: a stale holder can do no harm, it can only be refused.
* Mutual exclusion between processes whose clocks run at very different rates: lease
  expiry is measured by etcd, loss by us. Fencing covers this too.
"""

from __future__ import annotations

import builtins
import json
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from loguru import logger

from neonvm.leader.election import DEFAULT_LEASE_NAME, DEFAULT_NAMESPACE
from neonvm.leader.etcd import (
    DEFAULT_PREFIX,
    Compare,
    Delete,
    Etcd,
    EtcdRequestFailed,
    Get,
    KeyValue,
    Op,
    Put,
    TxnResult,
)
from neonvm.leader.session import Session

_TAKEOVER_ATTEMPTS = 5


class LockError(Exception):
    """Base of the lock's own failures (etcd's are :class:`~neonvm.leader.etcd.EtcdError`)."""


class LockHeld(LockError):
    """Someone else holds the lock under an epoch at least ours."""

    def __init__(self, info: LockInfo) -> None:
        self.info = info
        r = info.record
        who = (f"{r.holder} (epoch {r.epoch}, vm uid {r.vm_uid})" if r
               else f"a malformed value ({info.malformed})")
        super().__init__(f"lock {info.namespace}/{info.name} is held by {who}, "
                         f"token {info.token}")


class LockLost(LockError):
    """The guard no longer holds its lock; nothing was written."""


class SessionLost(LockError):
    """The session to acquire through is lost; start a new session and a new manager."""


# ---- whose keys ------------------------------------------------------------------------


@dataclass(frozen=True)
class Installation:
    """One controller installation, named by the Lease its replicas campaign for.

    All of an installation's keys live under ``<prefix>/<lease namespace>/<lease name>/``
    (:meth:`root`): its locks and its epoch floor. Two installations sharing one etcd and
    one prefix therefore never see each other's keys. Their epochs are not comparable
    (each counts its own Lease's transitions), so they must not share keys.
    """

    lease_namespace: str
    lease_name: str

    def __post_init__(self) -> None:
        for what, part in (("Lease namespace", self.lease_namespace),
                           ("Lease name", self.lease_name)):
            if not part or "/" in part:
                raise ValueError(f"bad {what} {part!r}")

    def root(self, prefix: str) -> str:
        return f"{prefix}/{self.lease_namespace}/{self.lease_name}"

    def __str__(self) -> str:
        return f"{self.lease_namespace}/{self.lease_name}"


DEFAULT_INSTALLATION = Installation(DEFAULT_NAMESPACE, DEFAULT_LEASE_NAME)
"""The installation of ``neonvm controller run`` with its default Lease."""


# ---- what is stored -------------------------------------------------------------------


@dataclass(frozen=True)
class LockRecord:
    """The lock key's value."""

    holder: str
    epoch: int
    vm_uid: str
    acquired_at: float
    """Unix seconds, the holder's clock: for display only, never for decisions."""

    def encode(self) -> bytes:
        return json.dumps({
            "holder": self.holder,
            "epoch": self.epoch,
            "vmUID": self.vm_uid,
            "acquiredAt": datetime.fromtimestamp(self.acquired_at, UTC).isoformat(),
        }, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> LockRecord:
        """Parse a value; raise ValueError saying what is wrong with it."""
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not JSON ({exc.msg if hasattr(exc, 'msg') else exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"not a JSON object but {type(data).__name__}")
        holder, epoch, uid, at = (data.get(k) for k in ("holder", "epoch", "vmUID",
                                                        "acquiredAt"))
        if not isinstance(holder, str) or not holder:
            raise ValueError("no holder")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"bad epoch {epoch!r}")
        if not isinstance(uid, str) or not uid:
            raise ValueError("no vmUID")
        try:
            acquired = datetime.fromisoformat(at).timestamp() if isinstance(at, str) else None
        except ValueError:
            acquired = None
        if acquired is None:
            raise ValueError(f"bad acquiredAt {at!r}")
        return cls(holder, epoch, uid, acquired)


@dataclass(frozen=True)
class LockInfo:
    """A lock key as read from etcd: its record, or why the value is malformed."""

    namespace: str
    name: str
    key: str
    token: int
    """The key's mod revision: the fencing token of whoever holds it."""
    create_revision: int
    lease: int
    record: LockRecord | None
    malformed: str | None
    raw: bytes
    installation: Installation = DEFAULT_INSTALLATION

    @classmethod
    def from_kv(cls, kv: KeyValue, prefix: str) -> LockInfo:
        """``kv`` must be a lock key under ``prefix`` (see :func:`parse_lock_key`)."""
        parsed = parse_lock_key(kv.key, prefix)
        if parsed is None:
            raise ValueError(f"{kv.key!r} is not a lock key under {prefix!r}")
        installation, namespace, name = parsed
        try:
            record: LockRecord | None = LockRecord.decode(kv.value)
            malformed = None
        except ValueError as exc:
            record, malformed = None, str(exc)
        return cls(namespace, name, kv.key, kv.mod_revision, kv.create_revision, kv.lease,
                   record, malformed, kv.value, installation)

    def as_dict(self, now: float | None = None, lease_ttl: int | None = None
                ) -> dict[str, Any]:
        """For ``-o json|yaml|table``: everything an operator needs about one lock."""
        now = time.time() if now is None else now
        r = self.record
        return {
            "installation": str(self.installation),
            "namespace": self.namespace,
            "name": self.name,
            "status": "held" if r else "malformed",
            "holder": r.holder if r else None,
            "epoch": r.epoch if r else None,
            "token": self.token,
            "vmUID": r.vm_uid if r else None,
            "lease": f"{self.lease:x}" if self.lease else None,
            "ttl": lease_ttl if self.lease else None,
            "age": round(now - r.acquired_at, 1) if r else None,
            "acquiredAt": (datetime.fromtimestamp(r.acquired_at, UTC).isoformat()
                           if r else None),
            "createRevision": self.create_revision,
            "key": self.key,
            "problem": self.malformed,
            "raw": None if r else self.raw[:200].decode(errors="replace"),
        }


def lock_key(prefix: str, installation: Installation, namespace: str, name: str) -> str:
    """``<prefix>/<lease namespace>/<lease name>/locks/<namespace>/<name>``."""
    for what, part in (("namespace", namespace), ("name", name)):
        if not part or "/" in part:
            raise ValueError(f"bad VM {what} {part!r}")
    return f"{installation.root(prefix)}/locks/{namespace}/{name}"


def locks_prefix(prefix: str, installation: Installation, namespace: str | None = None
                 ) -> str:
    """The key prefix of an installation's locks (of one VM namespace, if given)."""
    base = f"{installation.root(prefix)}/locks/"
    return f"{base}{namespace}/" if namespace else base


def parse_lock_key(key: str, prefix: str) -> tuple[Installation, str, str] | None:
    """``(installation, namespace, name)`` of a lock key under ``prefix``; None for any
    other key (an epoch floor, or a key of the unscoped layout of earlier versions)."""
    if not key.startswith(prefix + "/"):
        return None
    parts = key[len(prefix) + 1:].split("/")
    if len(parts) != 5 or parts[2] != "locks" or not all(parts):
        return None
    return Installation(parts[0], parts[1]), parts[3], parts[4]


# ---- the pure decision ----------------------------------------------------------------

Decision = Literal["adopt", "takeover", "held"]


def decide(current: LockInfo, *, identity: str, lease: int, epoch: int, vm_uid: str
           ) -> Decision:
    """What an acquirer does about a lock key that already exists.

    * ``adopt``: the key is exactly what we would have written (our identity, lease,
      epoch and VM uid): an earlier attempt of ours succeeded but its answer was lost.
      The token is the key's mod revision.
    * ``takeover``: rewrite it with a transaction comparing its mod revision.
    * ``held``: someone with an epoch at least ours holds it for this VM.
    """
    r = current.record
    if r is None:
        return "takeover"  # nobody running this code wrote it
    if r.holder == identity:
        if current.lease == lease and r.epoch == epoch and r.vm_uid == vm_uid:
            return "adopt"
        # Ours from an earlier session, or under another epoch/uid: take it back,
        # unless that would lower the epoch recorded.
        return "takeover" if epoch >= r.epoch else "held"
    if epoch > r.epoch:
        return "takeover"
    if r.vm_uid != vm_uid and epoch >= r.epoch:
        return "takeover"  # left by a deleted VM of the same name
    return "held"


# ---- the guard ------------------------------------------------------------------------


class LockGuard:
    """Proof of ownership handed out by :meth:`LockManager.acquire` (etcd's ``IsOwner``).

    ``token`` and ``epoch`` go into the writes the holder makes (``status.fence``);
    ``lost`` tells it to stop.
    """

    def __init__(self, manager: LockManager, namespace: str, name: str, key: str,
                 record: LockRecord, token: int) -> None:
        self.namespace = namespace
        self.name = name
        self.key = key
        self.record = record
        self.token = token
        self.lost = threading.Event()
        self.lost_reason: str | None = None
        self._manager = manager

    @property
    def epoch(self) -> int:
        return self.record.epoch

    @property
    def vm_uid(self) -> str:
        return self.record.vm_uid

    @property
    def held(self) -> bool:
        return not self.lost.is_set()

    def owner_compare(self) -> Compare:
        """The condition "this lock is still mine", for the caller's own transactions."""
        return Compare(self.key, "mod", "==", self.token)

    def fenced_txn(self, compare: Sequence[Compare] = (), success: Sequence[Op] = (),
                   failure: Sequence[Op] = ()) -> TxnResult:
        """Run a transaction that applies ``success`` only if the lock is still ours and
        ``compare`` holds. Raises :class:`LockLost` (and sets ``lost``) when the lock was
        not ours; returns the result otherwise (``succeeded`` False: ``compare`` failed).
        """
        if self.lost.is_set():
            raise LockLost(f"lock {self.namespace}/{self.name} lost: {self.lost_reason}")
        result = self._manager.etcd.txn([self.owner_compare(), *compare], success,
                                        [*failure, Get(self.key)])
        if result.succeeded:
            return result
        now = result.results[-1].kvs
        if not now or now[0].mod_revision != self.token:
            reason = _why_not_ours(now[0] if now else None, self._manager.prefix)
            self._lose(reason)
            raise LockLost(f"lock {self.namespace}/{self.name} lost: {reason}")
        return TxnResult(False, result.revision, result.results[:-1])

    def fenced_put(self, key: str, value: bytes) -> int:
        """Put ``key`` only if the lock is still ours; return the write's revision."""
        return self.fenced_txn(success=[Put(key, value)]).revision

    def check(self) -> bool:
        """Read the key: is the lock still ours? Sets ``lost`` if not."""
        if self.lost.is_set():
            return False
        kv = self._manager.etcd.get(self.key)
        if kv is None or kv.mod_revision != self.token:
            self._lose(_why_not_ours(kv, self._manager.prefix))
            return False
        return True

    def release(self) -> bool:
        """Give the lock up: delete the key if it is still ours (True), else False.

        The guard counts as released even if etcd cannot be reached (the error is
        raised); the key then goes with the session's lease.
        """
        self._lose("released")
        self._manager._forget(self)
        result = self._manager.etcd.txn([self.owner_compare()], [Delete(self.key)])
        return result.succeeded

    def _lose(self, reason: str) -> None:
        if self.lost.is_set():
            return
        self.lost_reason = reason
        self.lost.set()
        if not reason.startswith("released"):
            logger.bind(vm=f"{self.namespace}/{self.name}", token=self.token).warning(
                "lock lost: {}", reason)

    def __enter__(self) -> LockGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.held:
            self.release()

    def __repr__(self) -> str:
        state = "held" if self.held else f"lost: {self.lost_reason}"
        return (f"LockGuard({self.namespace}/{self.name}, token={self.token}, "
                f"epoch={self.epoch}, {state})")


def _why_not_ours(kv: KeyValue | None, prefix: str) -> str:
    if kv is None:
        return "the lock key is gone (released, broken, swept or its lease expired)"
    info = LockInfo.from_kv(kv, prefix)
    if info.record is None:
        return f"the lock key was overwritten with a malformed value (token {info.token})"
    return (f"taken over by {info.record.holder} (epoch {info.record.epoch}, "
            f"token {info.token})")


# ---- reading and administering locks (no session needed) ------------------------------


@dataclass(frozen=True)
class LockEvent:
    kind: Literal["existing", "put", "delete"]
    info: LockInfo
    revision: int


class LockTable:
    """Locks under a prefix, for inspection and administration (CLI, sweeps).

    With an ``installation``, the table is that installation's locks only; without one
    (``None``), it reads the locks of every installation under the prefix, for people and
    checks that want them all. Only a table of one installation can sweep.
    """

    def __init__(self, etcd: Etcd, prefix: str = DEFAULT_PREFIX,
                 installation: Installation | None = None) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.installation = installation

    def list(self, namespace: str | None = None) -> list[LockInfo]:
        return self.snapshot(namespace)[0]

    def snapshot(self, namespace: str | None = None) -> tuple[builtins.list[LockInfo], int]:
        """The locks and the etcd revision they were read at."""
        result = self.etcd.get_prefix(self._range(namespace))
        return ([LockInfo.from_kv(kv, self.prefix) for kv in result.kvs
                 if self._wanted(kv.key, namespace)], result.revision)

    def get(self, namespace: str, name: str) -> LockInfo | None:
        """The VM's lock. Without an installation: the one installation that has a lock
        for it (:class:`LockError` if several have)."""
        if self.installation is not None:
            kv = self.etcd.get(lock_key(self.prefix, self.installation, namespace, name))
            return LockInfo.from_kv(kv, self.prefix) if kv else None
        found = [i for i in self.list(namespace) if i.name == name]
        if len(found) > 1:
            raise LockError(
                f"VM {namespace}/{name} has a lock in several installations "
                f"({', '.join(str(i.installation) for i in found)}); name one")
        return found[0] if found else None
    def lease_ttls(self, infos: Collection[LockInfo]) -> dict[int, int]:
        """Seconds left on each distinct lease of ``infos`` (-1: lease gone)."""
        return {lease: self.etcd.lease_ttl(lease) for lease in {i.lease for i in infos if i.lease}}

    def remove(self, info: LockInfo) -> bool:
        """Delete the lock if it is still exactly what ``info`` saw (same token)."""
        return self.etcd.txn([Compare(info.key, "mod", "==", info.token)],
                             [Delete(info.key)]).succeeded

    def break_lock(self, namespace: str, name: str) -> LockInfo | None:
        """Delete a lock whoever holds it; return what was deleted (None: no lock).

        Safe because every write a holder makes is fenced by its token: a holder whose
        lock was broken is refused at its next write, and a new acquisition gets a higher
        token.
        """
        for _ in range(_TAKEOVER_ATTEMPTS):
            info = self.get(namespace, name)
            if info is None:
                return None
            if self.remove(info):
                return info
        raise LockError(f"lock {namespace}/{name} keeps changing; try again")

    def sweep(self, existing_vm_uids: Collection[str] | Callable[[], Collection[str]],
              keep: Callable[[LockInfo], bool] = lambda _i: False
              ) -> builtins.list[LockInfo]:
        """Delete the locks of VMs that no longer exist; return what was deleted.

        Pass a *function* that lists the live VMs' uids: it is called after the locks are
        read, so a VM created (and locked) after the VM list cannot be swept by mistake.
        Malformed locks are left for an operator (``neonvm locks break``); they block
        nothing, since an acquirer takes them over.

        Only this table's installation is swept: another installation's VMs are not in
        ``existing_vm_uids`` (it watches other namespaces), so its live locks would look
        stale.
        """
        if self.installation is None:
            raise ValueError("a sweep needs the installation whose locks to sweep")
        locks = self.list()
        uids = set(existing_vm_uids() if callable(existing_vm_uids) else existing_vm_uids)
        removed = []
        for info in locks:
            if info.record is None or info.record.vm_uid in uids or keep(info):
                continue
            if self.remove(info):
                logger.bind(vm=f"{info.namespace}/{info.name}").info(
                    "swept the lock of a VM that no longer exists", vm_uid=info.record.vm_uid,
                    holder=info.record.holder, token=info.token)
                removed.append(info)
        return removed

    def watch(self, namespace: str | None = None, *, existing: bool = True
              ) -> Iterator[LockEvent]:
        """The current locks (as ``existing`` events), then every change, until the
        caller stops iterating or etcd goes away (EtcdUnavailable)."""
        infos, revision = self.snapshot(namespace)
        if existing:
            for info in infos:
                yield LockEvent("existing", info, revision)
        stream = self.etcd.watch(self._range(namespace), prefix=True,
                                 start_revision=revision + 1)
        try:
            for event in stream:
                if not self._wanted(event.kv.key, namespace):
                    continue
                # A delete event's own kv is empty; prev_kv has the lock that went.
                kv = event.kv if event.kind == "put" else (event.prev or event.kv)
                yield LockEvent(event.kind, LockInfo.from_kv(kv, self.prefix), event.revision)
        finally:
            stream.close()

    def _range(self, namespace: str | None) -> str:
        if self.installation is not None:
            return locks_prefix(self.prefix, self.installation, namespace)
        return self.prefix + "/"

    def _wanted(self, key: str, namespace: str | None) -> bool:
        parsed = parse_lock_key(key, self.prefix)
        if parsed is None:
            return False
        installation, ns, _name = parsed
        return ((self.installation is None or installation == self.installation)
                and (namespace is None or ns == namespace))


# ---- acquiring ------------------------------------------------------------------------


class LockManager:
    """Takes per-VM locks for one holder (one replica process) through one session.

    ``identity`` must be unique per process start (host plus a random id): a lock whose
    value names our identity is treated as ours. When the session is lost, every guard
    is told; make a new session and a new manager to go on.
    """

    def __init__(self, etcd: Etcd, session: Session, identity: str,
                 prefix: str = DEFAULT_PREFIX,
                 installation: Installation = DEFAULT_INSTALLATION) -> None:
        self.etcd = etcd
        self.session = session
        self.identity = identity
        self.prefix = prefix
        self.installation = installation
        self.table = LockTable(etcd, prefix, installation)
        self._guards: dict[str, LockGuard] = {}
        self._mutex = threading.Lock()
        self._key_mutexes: dict[str, tuple[threading.Lock, int]] = {}
        """Per lock key being acquired now: the mutex that serializes its acquires, and
        how many callers are using it (dropped at zero: a deleted VM's key is not kept)."""
        self._unregister = session.on_lost(self._session_lost)

    def acquire(self, namespace: str, name: str, vm_uid: str, epoch: int, *,
                wait: float = 0.0) -> LockGuard:
        """Take the VM's lock, or raise :class:`LockHeld` (after up to ``wait`` seconds
        of waiting for the holder to let go).

        Re-acquiring a lock this manager holds (same uid and epoch) returns the same
        guard without a round trip. May raise :class:`SessionLost` and
        :class:`~neonvm.leader.etcd.EtcdError`.
        """
        key = lock_key(self.prefix, self.installation, namespace, name)
        with self._mutex:
            key_mutex, users = self._key_mutexes.get(key, (threading.Lock(), 0))
            self._key_mutexes[key] = (key_mutex, users + 1)
        try:
            with key_mutex:
                return self._acquire_serialized(namespace, name, key, vm_uid, epoch, wait)
        finally:
            with self._mutex:
                key_mutex, users = self._key_mutexes[key]
                if users > 1:
                    self._key_mutexes[key] = (key_mutex, users - 1)
                else:
                    del self._key_mutexes[key]

    def _acquire_serialized(self, namespace: str, name: str, key: str, vm_uid: str,
                            epoch: int, wait: float) -> LockGuard:
        """:meth:`acquire` under ``key``'s mutex."""
        existing = self._guards.get(key)
        if (existing is not None and existing.held and existing.vm_uid == vm_uid
                and existing.epoch == epoch):
            return existing
        guard = self._acquire(namespace, name, key, vm_uid, epoch, wait)
        with self._mutex:
            previous = self._guards.get(key)
            self._guards[key] = guard
        if previous is not None and previous is not guard:
            previous._lose(f"replaced by a new acquisition (token {guard.token})")
        if self.session.is_lost():
            guard._lose(f"session lost: {self.session.lost_reason}")
        return guard

    def held(self) -> list[LockGuard]:
        with self._mutex:
            return [g for g in self._guards.values() if g.held]

    def list(self, namespace: str | None = None) -> list[LockInfo]:
        return self.table.list(namespace)

    def get(self, namespace: str, name: str) -> LockInfo | None:
        return self.table.get(namespace, name)

    def sweep(self, existing_vm_uids: Collection[str] | Callable[[], Collection[str]]
              ) -> builtins.list[LockInfo]:
        """:meth:`LockTable.sweep`, sparing the locks this manager holds; then
        :meth:`overlaps`, logged as an error when there are any."""
        def ours(info: LockInfo) -> bool:
            with self._mutex:
                guard = self._guards.get(info.key)
            return guard is not None and guard.held and guard.token == info.token

        removed = self.table.sweep(existing_vm_uids, keep=ours)
        try:
            shared = self.overlaps()
        except EtcdRequestFailed as exc:  # say, etcd auth confines us to our own keys
            logger.debug("could not look for overlapping installations: {}", exc)
            shared = []
        if shared:
            others = sorted({str(i.installation) for i in shared})
            logger.bind(installation=str(self.installation)).error(
                "{n} VM(s) we hold are also locked by other installation(s) {others} under "
                "the same etcd prefix: their watch namespaces overlap ours, and two "
                "controllers now act on one VM (fencing keeps it safe, but they fight); give "
                "each installation its own namespaces. First: {vms}", n=len(shared),
                others=", ".join(others),
                vms=", ".join(f"{i.namespace}/{i.name}" for i in shared[:5]))
        return removed

    def overlaps(self) -> builtins.list[LockInfo]:
        """Locks of *other* installations under the prefix for VMs (same namespace, name
        and uid) whose lock this manager holds: two installations manage those VMs,
        which happens only when their watch namespaces overlap (a misconfiguration)."""
        held = {(g.namespace, g.name, g.vm_uid) for g in self.held()}
        if not held:
            return []
        return [i for i in LockTable(self.etcd, self.prefix).list()
                if i.installation != self.installation and i.record is not None
                and (i.namespace, i.name, i.record.vm_uid) in held]

    def close(self) -> None:
        """Release every held lock (best effort) and stop listening to the session."""
        self._unregister()
        for guard in self.held():
            try:
                guard.release()
            except Exception as exc:
                logger.bind(vm=f"{guard.namespace}/{guard.name}").warning(
                    "could not release lock on close: {}", exc)

    # ---- internals ----

    def _acquire(self, namespace: str, name: str, key: str, vm_uid: str, epoch: int,
                 wait: float) -> LockGuard:
        if self.session.is_lost():
            raise SessionLost(f"etcd session lost: {self.session.lost_reason}")
        lease = self.session.lease_id
        record = LockRecord(self.identity, epoch, vm_uid, time.time())
        value = record.encode()
        log = logger.bind(vm=f"{namespace}/{name}", epoch=epoch)
        deadline = time.monotonic() + wait
        # The common case: the key does not exist. One round trip.
        result = self._txn([Compare(key, "create", "==", 0)], [Put(key, value, lease)],
                           [Get(key)])
        attempts = 0
        while True:
            if result.succeeded:
                return LockGuard(self, namespace, name, key, record, result.revision)
            kvs = result.results[-1].kvs
            if not kvs:  # deleted between our read and now (only after a wait)
                result = self._txn([Compare(key, "create", "==", 0)],
                                   [Put(key, value, lease)], [Get(key)])
                continue
            current = LockInfo.from_kv(kvs[0], self.prefix)
            decision = decide(current, identity=self.identity, lease=lease, epoch=epoch,
                              vm_uid=vm_uid)
            if decision == "adopt":
                log.debug("adopting the lock our own earlier attempt wrote")
                return LockGuard(self, namespace, name, key, record_of(current),
                                 current.token)
            if decision == "takeover":
                attempts += 1
                if attempts > _TAKEOVER_ATTEMPTS:
                    raise LockHeld(current)
                result = self._txn([Compare(key, "mod", "==", current.token)],
                                   [Put(key, value, lease)], [Get(key)])
                if result.succeeded:
                    log.info("lock taken over", previous=_describe(current),
                             token=result.revision)
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LockHeld(current)
            # Watch from the revision of the read, not the key's own: a watch that starts
            # in the past is caught up by etcd's background sync (every 100 ms), one that
            # starts at the head is live at once. Nothing after the read is missed.
            self.etcd.wait_for_change(key, result.revision, remaining)
            result = self._txn([Compare(key, "create", "==", 0)], [Put(key, value, lease)],
                               [Get(key)])

    def _txn(self, compare: Sequence[Compare], success: Sequence[Op],
             failure: Sequence[Op]) -> TxnResult:
        try:
            return self.etcd.txn(compare, success, failure)
        except EtcdRequestFailed as exc:
            if "lease not found" in str(exc):
                raise SessionLost(f"etcd session lost: its lease is gone ({exc})") from None
            raise

    def _forget(self, guard: LockGuard) -> None:
        with self._mutex:
            if self._guards.get(guard.key) is guard:
                del self._guards[guard.key]

    def _session_lost(self, reason: str) -> None:
        with self._mutex:
            guards = list(self._guards.values())
        closed = reason == "session closed"
        why = "released: session closed" if closed else f"session lost: {reason}"
        for guard in guards:
            guard._lose(why)


def record_of(info: LockInfo) -> LockRecord:
    if info.record is None:
        raise ValueError(f"lock {info.key} is malformed: {info.malformed}")
    return info.record


def _describe(info: LockInfo) -> str:
    r = info.record
    if r is None:
        return f"malformed ({info.malformed})"
    return f"{r.holder} epoch {r.epoch} token {info.token}"
