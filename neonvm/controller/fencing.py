"""Self-fencing, the driver's side: which pods are surely dead, and their force-delete.

A pod built with :data:`~neonvm.api.rights.RIGHT_SECONDS_ANNOTATION` has a runner that
kills its guest once its right to run lapses (docs/protocol.md, "Self-fencing"). Such a
pod is *dead for sure* when (1) its node is unreachable: the Node's ``Ready`` condition is
not ``True``, the Node is gone, or it carries the ``node.kubernetes.io/unreachable``
taint; and (2) the leader's ledger condemns it
(:meth:`~neonvm.controller.rights.RightsLedger.condemn`: its right is surely over, and it
is never granted again; the longer of the pod's annotation and its runner's own
``NEONVM_RIGHT_SECONDS`` counts). :meth:`SelfFencing.observe` puts those pods' uids into
``Observation.dead_pods`` (``decide`` then answers ``ForceDeleteDeadPod``, from a direct
read), and the seconds until the next one will be into ``Observation.fence_recheck``.
A pod this term has condemned stays dead whatever its node says later (its DELETE
may have missed: a 409, or the node came back), so the DELETE is sent again.

Which pods are looked at (each costs one GET of its Node, kept :data:`NODE_TTL` seconds:
nodes are not watched): self-fencing pods on a node that are terminating, or whose
``Ready`` condition is not ``True`` while the pod is ``Running`` or ``Unknown``. A pod on a
node that stops heartbeating is marked not ready by the node lifecycle controller, which
is the watch event that brings its VM up. Pods without the annotation are never looked
at: they keep waiting for ``node.kubernetes.io/out-of-service``.

The node's state plays no part in safety (the right's expiry does); it only keeps the
controller from replacing a VM whose node is fine.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kubernetes.client.exceptions import ApiException
from loguru import logger

from neonvm import kube
from neonvm.api.rights import (
    RIGHT_SECONDS_ANNOTATION,
    RIGHT_SECONDS_ENV,
    RIGHTS_URL_ENV,
    parse_annotation,
)
from neonvm.controller import actions as d
from neonvm.controller.podspec import UNREACHABLE_TAINT
from neonvm.controller.rights import RightsLedger

NODE_TTL = 2.0
"""Seconds a Node read is reused (a VM waiting for its old pod looks every second)."""
SELF_FENCED = "SelfFenced"
"""Warning event reason: a self-fenced pod was force-deleted."""

NodeReader = Callable[[str], dict[str, Any] | None]


def candidate(pod: dict[str, Any]) -> float | None:
    """The pod's right (seconds) if it is worth a look at its node (module doc)."""
    meta = pod.get("metadata") or {}
    seconds = parse_annotation((meta.get("annotations") or {}).get(RIGHT_SECONDS_ANNOTATION))
    if seconds is None or not (pod.get("spec") or {}).get("nodeName"):
        return None
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") is not None:
        return seconds
    if status.get("phase") not in ("Running", "Unknown"):
        return None
    ready = next((c.get("status") for c in status.get("conditions") or []
                  if c.get("type") == "Ready"), None)
    return seconds if ready != "True" else None


def runner_self_fences(pod: dict[str, Any]) -> float | None:
    """The right the pod's runner renews, if its immutable spec says it self-fences (a
    runner container with :data:`~neonvm.api.rights.RIGHTS_URL_ENV` set and a valid
    :data:`~neonvm.api.rights.RIGHT_SECONDS_ENV`); else None (a cached pod keeps no
    environment: None too). The annotation alone never says so: whoever may patch pods
    may add it (docs/security.md, "Rights endpoint")."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        env = {e.get("name"): e.get("value") for e in container.get("env") or []}
        if env.get(RIGHTS_URL_ENV) and env.get(RIGHT_SECONDS_ENV) is not None:
            seconds = parse_annotation(str(env[RIGHT_SECONDS_ENV]))
            if seconds is not None:
                return seconds
    return None


def node_unreachable(node: dict[str, Any] | None) -> bool:
    """The Node is gone, not ``Ready=True``, or tainted unreachable."""
    if node is None:
        return True
    if any(t.get("key") == UNREACHABLE_TAINT for t in (node.get("spec") or {}).get("taints")
           or []):
        return True
    ready = next((c.get("status") for c in (node.get("status") or {}).get("conditions") or []
                  if c.get("type") == "Ready"), None)
    return ready != "True"


class SelfFencing:
    """Adds ``dead_pods`` and ``fence_recheck`` to observations (module doc)."""

    def __init__(self, ledger: RightsLedger, read_node: NodeReader,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ledger = ledger
        self._read_node = read_node
        self._clock = clock
        self._nodes: dict[str, tuple[dict[str, Any] | None, float]] = {}
        self._lock = threading.Lock()
        self._warned = False

    @classmethod
    def from_api(cls, ledger: RightsLedger, api: Any) -> SelfFencing:
        return cls(ledger, lambda name: kube.get_or_none(
            api, f"/api/v1/nodes/{kube.path_segment(name)}", timeout=10))

    def _node(self, name: str) -> dict[str, Any] | bool | None:
        """The Node (None: gone), or False when it cannot be read now."""
        now = self._clock()
        with self._lock:
            cached = self._nodes.get(name)
            if cached is not None and now - cached[1] < NODE_TTL:
                return cached[0]
        try:
            node = self._read_node(name)
        except ApiException as exc:
            if exc.status == 403 and not self._warned:
                self._warned = True
                logger.warning("not allowed to get nodes: self-fencing pods on a dead node "
                               "wait for node.kubernetes.io/out-of-service (grant `get` on "
                               "nodes)")
            return False
        except OSError:
            return False
        with self._lock:
            if len(self._nodes) > 10_000:
                self._nodes.clear()
            self._nodes[name] = (node, now)
        return node

    def observe(self, obs: d.Observation, pods: dict[str, dict[str, Any]]) -> d.Observation:
        """``obs`` with the dead pods and the recheck time of its VM's pods (raw ``pods``).

        Only a direct observation condemns (marks in the ledger); from a cached one a pod
        that would be condemned is reported all the same, and ``decide`` then asks for a
        direct read before anything is done."""
        dead: set[str] = set()
        recheck = math.inf
        for pod in pods.values():
            uid = str((pod.get("metadata") or {}).get("uid") or "")
            if uid and self.ledger.is_condemned(uid):
                # Condemned in this term: its right is over and this term never grants
                # it again, whatever its node says now (a DELETE that missed, then the
                # node came back): report it dead so the DELETE is sent again, or a
                # fresh runner waits for ever.
                dead.add(uid)
                continue
            seconds = candidate(pod)
            if seconds is None:
                continue
            node = self._node(str(pod["spec"]["nodeName"]))
            if isinstance(node, bool) or not node_unreachable(node):
                continue
            # The annotation may be changed by whoever may patch pods; the runner's own
            # flag may not, and it bounds every right the runner keeps. A pod is marked
            # only from a direct read, which carries it; a cached one is only looked at.
            if obs.direct:  # condemned only if its spec says it self-fences
                spec_seconds = runner_self_fences(pod)
                if spec_seconds is None:
                    continue
                seconds = max(seconds, spec_seconds)
            left = (self.ledger.condemn(uid, seconds) if obs.direct
                    else self.ledger.remaining(uid, seconds))
            if left == 0.0:
                dead.add(uid)
            else:
                recheck = min(recheck, left)
        gone = obs.vm.status.pod_uid if obs.vm is not None else ""
        if gone and self.ledger.is_condemned(gone):
            # The VM's pod, condemned in this term and (once deleted) gone: its restart
            # is a self-fenced replacement, which grows no restart streak (restarts.py).
            dead.add(gone)
        if not dead and math.isinf(recheck):
            return obs
        return replace(obs, dead_pods=frozenset(dead),
                       fence_recheck=None if math.isinf(recheck) else recheck)


def force_delete_dead_pod(fencing: SelfFencing | None, cluster: Any, events: Any,
                          action: d.ForceDeleteDeadPod, vm: Any, check: Callable[[], None],
                          log: Any) -> str:
    """Perform :class:`~neonvm.controller.decide.ForceDeleteDeadPod` (the reconciler's
    row calls this): only a pod the ledger has condemned. The pod is read (after the
    condemn), then the authority checked (``check``), then it is deleted with
    ``gracePeriodSeconds: 0`` and the uid and that ``resourceVersion`` as preconditions,
    so that a next term's first grant, which writes the pod first, and this DELETE
    cannot both land (:class:`~neonvm.controller.rights.RightsService`). A Warning event
    ``SelfFenced``."""
    if fencing is None or not fencing.ledger.is_condemned(action.uid):
        return "not_condemned"
    pod = cluster.get_pod(vm.namespace, action.name)
    meta = (pod or {}).get("metadata") or {}
    if pod is None or meta.get("uid") != action.uid:
        return "gone"
    check()
    try:
        cluster.delete_pod(vm.namespace, action.name, uid=action.uid,
                           resource_version=str(meta.get("resourceVersion") or ""),
                           grace_period_seconds=0)
    except ApiException as exc:
        if exc.status == 404:
            return "gone"
        if exc.status == 409:
            log.info("pod {pod} changed since it was read: deciding again", pod=action.name)
            return "conflict"
        raise
    log.warning("force-deleted self-fenced pod {pod}: {reason}", pod=action.name,
                reason=action.reason)
    events.record(vm, SELF_FENCED, f"runner pod {action.name} force-deleted: "
                                   f"{action.reason}", warning=True)
    return "done"
