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

What is not guaranteed:

* Nothing stops an operator from deleting or lowering the key with etcdctl. Don't.
* A malformed value is not guessed at: :class:`EpochFloorCorrupt` is raised and the
  claim refused until an operator puts a correct value back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

from loguru import logger

from neonvm.leader.etcd import DEFAULT_PREFIX, Compare, Etcd, EtcdError, Get, KeyValue, Put
from neonvm.leader.lock import DEFAULT_INSTALLATION, Installation


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
                 installation: Installation = DEFAULT_INSTALLATION) -> None:
        self.etcd = etcd
        self.key = floor_key(prefix, installation)
        self.legacy_key = legacy_floor_key(prefix)

    def current(self) -> FloorRecord | None:
        """The recorded floor, or None when no leader has claimed one yet."""
        return self._parse(self.etcd.get(self.key))

    def claim(self, epoch: int, identity: str) -> bool:
        """Record ``epoch`` as the floor iff it is above the stored one (see module doc)."""
        if epoch < 0:
            raise ValueError(f"epoch must not be negative, got {epoch}")
        value = FloorRecord(epoch, identity, datetime.now(UTC).isoformat()).encode()
        kv = self.etcd.get(self.key)
        if kv is None:
            legacy = self._parse(self.etcd.get(self.legacy_key), self.legacy_key)
            if legacy is not None and epoch <= legacy.epoch:
                logger.bind(epoch=epoch, floor=legacy.epoch, floor_holder=legacy.identity
                            ).warning("epoch claim refused: not above the floor of an "
                                      "earlier version ({key})", key=self.legacy_key)
                return False
        # Each failed round means someone else raised the floor, which can happen only
        # finitely often below our epoch: the loop ends.
        while True:
            stored = self._parse(kv)
            if stored is not None and epoch <= stored.epoch:
                logger.bind(epoch=epoch, floor=stored.epoch, floor_holder=stored.identity
                            ).warning("epoch claim refused: not above the floor")
                return False
            revision = kv.mod_revision if kv else 0
            result = self.etcd.txn([Compare(self.key, "mod", "==", revision)],
                                   [Put(self.key, value)], [Get(self.key)])
            if result.succeeded:
                logger.bind(epoch=epoch, identity=identity).info("epoch floor raised")
                return True
            kvs = result.results[0].kvs
            kv = kvs[0] if kvs else None

    def _parse(self, kv: KeyValue | None, key: str | None = None) -> FloorRecord | None:
        if kv is None:
            return None
        try:
            data = json.loads(kv.value)
            epoch = data["epoch"]
            if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
                raise ValueError(f"bad epoch {epoch!r}")
            return FloorRecord(epoch, str(data.get("identity", "")),
                               str(data.get("claimedAt", "")))
        except (ValueError, KeyError, TypeError) as exc:
            raise EpochFloorCorrupt(
                f"etcd key {key or self.key} is malformed ({exc}); put back "
                '{"epoch": N} with N at least the highest epoch any leader used'
            ) from None
