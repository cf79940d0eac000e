"""The leader epoch floor: the lowest epoch a new leader may still claim, kept in etcd.

A leader's epoch is the Lease's ``spec.leaseTransitions``. Deleting and re-creating the
Lease resets that counter, which would hand a new leader an epoch a deposed one already
used, and fencing by epoch would then let the deposed leader's late writes through. So at
election the new leader *claims* its epoch here, and refuses leadership if the claim
fails.

The floor is kept per installation (:func:`floor_key`): each installation's epochs count
the transitions of its own Lease, so one installation's floor says nothing about
another's, and a shared floor would let each push the other's epochs up.

What is guaranteed:

* :meth:`EpochFloor.claim` returns True only if it recorded ``epoch`` as the floor by a
  transaction that compared the floor it read (its mod revision), and the floor it read
  was below ``epoch``. Two claimants of epochs ``a < b`` can never both see their claim
  after the other's: the floor only grows.
* A claim is never granted twice for one epoch, not even to the same identity: a claim
  whose answer was lost and is repeated gets False, and the elector moves to a higher
  epoch. (Granting it again would let two terms of one process share an epoch, and a
  worker of the first term would not notice the second began.)

Why a bad floor does not stop leadership (docs/locks.md, "The epoch floor"):

* The floor is one of two durable records of the highest epoch. The other is the Lease
  itself: a term's epoch *is* the ``leaseTransitions`` its own compare-and-swap raised,
  and a successful claim leaves the floor equal to that value, which only grows while the
  Lease exists. So every epoch ever used is at most ``max(floor, Lease)``, and the
  elector claims only epochs above the Lease it holds.
* Hence a floor that holds something this code cannot have written (not JSON, no integer
  epoch, an epoch above :data:`MAX_EPOCH`, which no Lease can carry) counts as no floor,
  like a deleted one, and the claim replaces it: an ERROR names the key and what it held,
  and ``neonvm_epoch_floor_repairs`` counts it. Refusing instead would let one bad write
  stop every replica from ever leading, and would protect nothing: whoever can write a
  bad value can also delete the key, and the Lease already covers a deleted key.

What is not guaranteed:

* Epochs stay unique only while one of the two records survives: deleting (or lowering)
  the Lease *and* the floor before the next claim lets an epoch be reused. The Lease is
  guarded by Kubernetes RBAC, the floor by etcd's TLS client certificates and a role
  limited to the prefix (docs/security.md, "etcd").
* A well-formed floor far above the Lease (written by someone with write access to the
  prefix) is honoured: the elector gallops the Lease up to it, and a floor near
  :data:`MAX_EPOCH` leaves few terms. Only access control prevents that.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import UTC, datetime

from loguru import logger
from prometheus_client import CollectorRegistry, Counter

from neonvm.leader.election import AccessRefused
from neonvm.leader.etcd import (
    DEFAULT_PREFIX,
    Compare,
    Etcd,
    EtcdAccessDenied,
    EtcdError,
    Get,
    KeyValue,
    Put,
)
from neonvm.leader.lock import DEFAULT_INSTALLATION, Installation
from neonvm.leader.session import Session

MAX_EPOCH = 2**31 - 1
"""``leaseTransitions`` is an int32: no Lease, hence no term, can carry a higher epoch."""


class EpochFloorCorrupt(EtcdError):
    """The floor key holds something this code did not write."""


@dataclass(frozen=True)
class FloorRecord:
    epoch: int
    identity: str
    claimed_at: str

    def encode(self) -> bytes:
        return json.dumps({"epoch": self.epoch, "identity": self.identity,
                           "claimedAt": self.claimed_at}, separators=(",", ":")).encode()


def floor_key(prefix: str, installation: Installation) -> str:
    """``<prefix>/<lease namespace>/<lease name>/leader/epoch-floor``: one per
    installation, since each counts the transitions of its own Lease."""
    return f"{installation.root(prefix)}/leader/epoch-floor"


def presence_key(prefix: str, installation: Installation) -> str:
    """``<prefix>/<lease namespace>/<lease name>/leader/presence``: the leading term's
    sign that it reaches the locks' etcd (docs/leader-election.md, "A leader cut off
    the locks' etcd")."""
    return f"{installation.root(prefix)}/leader/presence"


def legacy_floor_key(prefix: str) -> str:
    """The floor of earlier versions, shared by every installation under the prefix."""
    return f"{prefix}/leader/epoch-floor"


class EpochFloor:
    """Implements ``neonvm.leader.election.EpochFloor`` (``claim(epoch, identity)``).

    Until the installation's own floor exists, the shared floor of earlier versions
    (if any) is honoured as a lower bound, so an upgrade never hands out an epoch that an
    earlier version's leader may have used.
    """

    def __init__(self, etcd: Etcd, prefix: str = DEFAULT_PREFIX,
                 installation: Installation = DEFAULT_INSTALLATION, *,
                 registry: CollectorRegistry | None = None) -> None:
        self.etcd = etcd
        self.root = installation.root(prefix) + "/"
        self.key = floor_key(prefix, installation)
        self.presence_key = presence_key(prefix, installation)
        self.legacy_key = legacy_floor_key(prefix)
        self.repairs = Counter(
            "neonvm_epoch_floor_repairs",
            "Malformed epoch floors this replica replaced by its claim (docs/locks.md)",
            registry=registry)
        self.presence_repairs = Counter(
            "neonvm_presence_repairs",
            "Presence records of an impossible term (above the epoch floor) this replica "
            "wrote over (docs/security.md)", registry=registry)

    def current(self) -> FloorRecord | None:
        """The recorded floor, or None when no leader has claimed one yet; raises
        :class:`EpochFloorCorrupt` for a value this code cannot have written."""
        return self._parse(self.etcd.get(self.key))

    def keep_presence(self, identity: str, epoch: int, ttl: int,
                      stop: threading.Event) -> None:
        """Until ``stop``: keep the presence key naming (``identity``, ``epoch``) on an
        etcd lease of ``ttl`` seconds, kept alive (a :class:`Session`). Cut off from
        etcd, the lease expires and the key goes with it, which standbys that reach etcd
        read as "this term cannot use the locks". A new lease and a new write follow
        once etcd answers again, and the key is read every ``ttl / 3`` seconds and
        written again if it went under a live lease. Never writes over a later term's
        record (a higher epoch, at most the floor: every term claims its epoch before
        keeping presence); a higher epoch *above* the floor no term can have written, so
        it is written over, with an ERROR. Revokes its lease on the way out (the key
        goes at once)."""
        session: Session | None = None
        failing = False
        try:
            while not stop.is_set():
                try:
                    if session is None or session.lost.is_set():
                        if session is not None:
                            session.close(timeout=1.0)
                            session = None
                        session = Session(self.etcd, ttl, name=f"presence-{epoch}")
                        if not self._write_presence(identity, epoch, session.lease_id):
                            return  # a later term's record: ours is over
                    elif (not self.shows_presence(identity, epoch)  # deleted under a
                          and not stop.is_set()  # live lease, and the term goes on
                          and not self._write_presence(identity, epoch, session.lease_id)):
                        return
                    failing = False
                except EtcdError as exc:  # standbys ask a term they do not see to go
                    logger.bind(epoch=epoch).log(
                        "DEBUG" if failing else "WARNING",
                        "could not keep the presence key: {err}", err=str(exc))
                    failing = True
                stop.wait(max(0.5, ttl / 3))
        finally:
            if session is not None:
                session.close(timeout=1.0)

    def _write_presence(self, identity: str, epoch: int, lease: int) -> bool:
        """Put our record unless the key names a higher epoch (False then)."""
        value = json.dumps({"identity": identity, "epoch": epoch},
                           separators=(",", ":")).encode()
        kv = self.etcd.get(self.presence_key)
        while True:
            shown = self._presence_of(kv)
            impossible: int | None = None
            if shown is not None and shown[1] > epoch:
                # The floor, read after the record: a real later term claimed it first.
                floor = self._parse_or_none(self.etcd.get(self.key), self.key)
                if floor is None or shown[1] <= floor.epoch:
                    logger.bind(epoch=epoch, later=shown[1]).warning(
                        "the presence key names a later term ({who}, epoch {later}): "
                        "this term stops keeping it", who=shown[0], later=shown[1])
                    return False
                impossible = floor.epoch
            result = self.etcd.txn(
                [Compare(self.presence_key, "mod", "==", kv.mod_revision if kv else 0)],
                [Put(self.presence_key, value, lease)], [Get(self.presence_key)])
            if result.succeeded:
                if impossible is not None and shown is not None:
                    self.presence_repairs.inc()
                    logger.bind(epoch=epoch, key=self.presence_key).error(
                        "wrote over a presence record of epoch {bad} ({who}), above the "
                        "epoch floor {floor}: no term can have written it; whoever did "
                        "should not be able to reach the locks' etcd (docs/security.md)",
                        bad=shown[1], who=shown[0], floor=impossible)
                return True
            kvs = result.results[0].kvs
            kv = kvs[0] if kvs else None

    def shows_presence(self, identity: str, epoch: int) -> bool:
        """Whether the presence key names (``identity``, ``epoch``); raises
        :class:`~neonvm.leader.etcd.EtcdError` when etcd does not answer."""
        return self._presence_of(self.etcd.get(self.presence_key)) == (identity, epoch)

    @staticmethod
    def _presence_of(kv: KeyValue | None) -> tuple[str, int] | None:
        if kv is None:
            return None
        try:
            data = json.loads(kv.value)
            return str(data["identity"]), int(data["epoch"])
        except (ValueError, KeyError, TypeError):
            return None

    def check_access(self) -> None:
        """Raise :class:`~neonvm.leader.election.AccessRefused` unless etcd lets this
        client read and write every key of its installation and read the floor of
        earlier versions: what a replica touches. One transaction that writes nothing
        (:meth:`Etcd.check_access`). Any other failure (an outage) is raised as is."""
        try:
            self.etcd.check_access(self.root, read=[self.legacy_key])
        except EtcdAccessDenied as exc:
            raise AccessRefused(str(exc)) from None

    def claim(self, epoch: int, identity: str) -> bool:
        """Record ``epoch`` as the floor iff it is above the stored one (see module doc).

        ``epoch`` is the caller's Lease's ``leaseTransitions``, above every epoch used
        while that Lease existed; so a malformed stored floor counts as none and is
        replaced (by a transaction on the revision read), loudly. Raises
        :class:`~neonvm.leader.election.AccessRefused` when etcd refuses this client the
        floor's keys (a configuration the elector ends on).
        """
        try:
            return self._claim(epoch, identity)
        except EtcdAccessDenied as exc:
            raise AccessRefused(str(exc)) from None

    def _claim(self, epoch: int, identity: str) -> bool:
        if not 0 <= epoch <= MAX_EPOCH:
            raise ValueError(f"epoch must be in 0..{MAX_EPOCH}, got {epoch}")
        value = FloorRecord(epoch, identity, datetime.now(UTC).isoformat()).encode()
        kv = self.etcd.get(self.key)
        if kv is None:
            legacy = self._parse_or_none(self.etcd.get(self.legacy_key), self.legacy_key)
            if legacy is not None and epoch <= legacy.epoch:
                logger.bind(epoch=epoch, floor=legacy.epoch, floor_holder=legacy.identity
                            ).warning("epoch claim refused: not above the floor of an "
                                      "earlier version ({key})", key=self.legacy_key)
                return False
        # Each failed round means someone else raised the floor, which can happen only
        # finitely often below our epoch: the loop ends.
        while True:
            stored = self._parse_or_none(kv, self.key)
            if stored is not None and epoch <= stored.epoch:
                logger.bind(epoch=epoch, floor=stored.epoch, floor_holder=stored.identity
                            ).warning("epoch claim refused: not above the floor")
                return False
            revision = kv.mod_revision if kv else 0
            result = self.etcd.txn([Compare(self.key, "mod", "==", revision)],
                                   [Put(self.key, value)], [Get(self.key)])
            if result.succeeded:
                if kv is not None and stored is None:  # there, and malformed
                    self.repairs.inc()
                    logger.bind(epoch=epoch, identity=identity, key=self.key).error(
                        "replaced a malformed epoch floor by epoch {epoch}, the Lease's "
                        "transitions (above every epoch used under it); whoever wrote it "
                        "should not be able to reach the locks' etcd (docs/security.md)",
                        epoch=epoch)
                else:
                    logger.bind(epoch=epoch, identity=identity).info("epoch floor raised")
                return True
            kvs = result.results[0].kvs
            kv = kvs[0] if kvs else None

    def _parse_or_none(self, kv: KeyValue | None, key: str) -> FloorRecord | None:
        """The record, or None (with an ERROR logged) when it is malformed."""
        try:
            return self._parse(kv, key)
        except EpochFloorCorrupt as exc:
            logger.bind(key=key).error("{err}; it counts as no floor", err=str(exc))
            return None

    def _parse(self, kv: KeyValue | None, key: str | None = None) -> FloorRecord | None:
        if kv is None:
            return None
        try:
            data = json.loads(kv.value)
            epoch = data["epoch"]
            if not isinstance(epoch, int) or isinstance(epoch, bool) \
                    or not 0 <= epoch <= MAX_EPOCH:
                raise ValueError(f"bad epoch {epoch!r}")
            return FloorRecord(epoch, str(data.get("identity", "")),
                               str(data.get("claimedAt", "")))
        except (ValueError, KeyError, TypeError) as exc:
            shown = kv.value[:60].decode(errors="replace")
            raise EpochFloorCorrupt(
                f"etcd key {key or self.key} is malformed ({exc}; it holds {shown!r})"
            ) from None
