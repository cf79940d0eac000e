"""Condition types and reasons, and the reasons of the events the driver records: the
one place that spells them.

Types: Available, Degraded, Scaling, RestartBackoff, WaitingForOldPod. Reasons say why
(``CreateRefused``, ``FenceAhead``, ``<Step>NotTakingEffect``, ...); docs/reconciler.md
("Conditions") says when each is written and cleared.
"""

from __future__ import annotations

# ---- condition types -----------------------------------------------------------------------

READY = "Ready"
"""Written by earlier versions (what Available says); removed at the next conditions write."""
AVAILABLE = "Available"
"""NeonVM's condition (what ``kubectl wait --for=condition=Available`` checks): True while
the VM runs on its runner pod."""
DEGRADED = "Degraded"
"""Condition type the controller reports trouble in (its reason says which)."""
SCALING_CONDITION = "Scaling"
"""Condition type (and Wait condition) while a live scaling change is in progress."""
RESTART_BACKOFF_CONDITION = "RestartBackoff"
WAITING_FOR_OLD_POD = "WaitingForOldPod"

# ---- Degraded ---------------------------------------------------------------------------------

CREATE_REFUSED = "CreateRefused"
"""Degraded reason recorded when the API server refuses a pod create."""
PULL_SECRET_NOT_FOUND = "ImagePullSecretNotFound"
"""Wait condition (and Degraded reason) while an image pull secret of the VM is missing."""
FENCE_AHEAD = "FenceAhead"
"""Degraded reason: the VM's status carries a fence ahead of the (still valid) leader."""
FENCE_RESOLVED = "FenceResolved"
NOT_TAKING_EFFECT = "NotTakingEffect"
"""Suffix of the Degraded reason naming a step that kept not taking effect."""
STEP_BUDGET_EXHAUSTED = "StepBudgetExhausted"
"""Degraded reason when every step took effect, yet the reconcile never converged."""
UNGATE_FORBIDDEN = "UngateForbidden"
"""Degraded reason: the API server refused (403) to let this identity ungate."""
CREATE_FORBIDDEN = "CreateForbidden"
"""Degraded reason: the admission fence refused (403) to let this identity create a
runner pod (only the controller's identity may)."""
CREATE_FAILING = "CreateFailing"
"""Degraded reason: pod creates keep failing with errors that are retried."""
RUNNER_MISBEHAVING_REASON = "RunnerMisbehaving"
"""Degraded reason: the VM's runner answered the controller as no runner does (a
redirect, an oversized or endless answer, malformed JSON); see docs/security.md."""
RUNNER_UNREACHABLE_REASON = "RunnerUnreachable"
"""Degraded reason: the VM's runner has given no answer to ``GET /scale`` for a while
while a scaling plan waits for it."""
POD_SCALE_FENCE_AHEAD = "PodScaleFenceAhead"
"""Wait condition and Degraded reason: the committed pod's record of its size is behind
the spec, and its ``vm.neon.tech/scale-fence`` is above every scaling plan of the VM (no
plan wrote it: a tenant's patch of the pod), so no plan can rewrite that record
(docs/protocol.md, "The pod's record")."""
OBJECT_TOO_LARGE = "ObjectTooLarge"
"""Degraded reason: the VM's JSON is above the cache's bound, so the controller leaves it
alone (its running pod keeps its right to run) until it is smaller
(neonvm/controller/too_large.py)."""
TOO_LARGE_KEY = "neonvm.tooLarge"
"""The key of a cached *stub* (:func:`neonvm.controller.informer.too_large`): an object
above the cache's bound, kept as its head only (its ``metadata``'s identity, version,
deletion and finalizers, and its status when that is small; never its spec,
:func:`neonvm.kube.object_head`); the value is the object's JSON length. No API object
has such a top-level field (the CRD's schema prunes unknown ones)."""
RECOVERED = "Recovered"
"""Reason of Degraded=False after one of the recoverable reasons above."""

# ---- Scaling and Wait ---------------------------------------------------------------------------

SCALING_NEEDS_RESTART = "ScalingNeedsRestart"
"""Scaling condition reason: the running pod cannot take the size (the runner refused:
400, outside the bounds it booted with; 401, the pod was built without live scaling or
with another token scheme). The pod's next start boots at the spec's size."""
SCALING_DISABLED = "ScalingDisabled"
"""Scaling condition reason: the controller cannot get the VM's scaling token (no RBAC
on Secrets, ``rbac.liveScaling=false``; the Secret missing or not the controller's)."""
SCALING_REFUSED = frozenset({SCALING_NEEDS_RESTART, SCALING_DISABLED})
SCALING_DROPPED = "ScalingDropped"
"""Scaling condition reason: a plan was dropped to be planned again (the runner applied a
newer fence, or the plan was for another pod)."""
DROP_REASONS = SCALING_REFUSED | {SCALING_DROPPED}
"""Scaling=False reasons that say the last plan was dropped rather than committed: a
``PUT /scale`` of it sent before the drop may still land
(:func:`~neonvm.controller.looks.looks_after_drop`)."""
RUNNER_NOT_ANSWERING = "RunnerNotAnswering"
"""Scaling=True reason while a recorded plan's runner cannot be asked."""
NAMESPACE_TERMINATING = "NamespaceTerminating"
"""Wait condition: the VM's namespace is being deleted, so no pod is planned or created
(the VM's own deletion, with its finalizer, comes through the watch)."""


# ---- event reasons ----------------------------------------------------------------------------

PLANNED = "Planned"
CREATED = "Created"
COMMITTED = "Committed"
STARTED = "Started"
"""The progress of a VM's way to a running pod (one Event per reconcile:
:mod:`neonvm.controller.progress`)."""
PLAN_DROPPED = "PlanDropped"
RESTARTING = "Restarting"
FINALIZED = "Finalized"
DELETED = "Deleted"
GATE_STRIPPED = "GateStripped"
"""Warning: a runner pod came back from its create without our scheduling gate."""
RUNNER_UNLABELLED = "RunnerUnlabelled"
"""Warning: the committed, still gated pod lost its runner label and is replaced."""
LOOK_GIVEN_UP = "ScaleLookGivenUp"
"""Warning: the look after a dropped scaling plan ended unsettled
(:data:`~neonvm.controller.looks.LOOK_GIVE_UP_SECONDS`)."""
RESIZE_REFUSED = "ResizeRefused"
"""Warning: the API server refused a scaling plan's in-place resize of the runner pod
(a ResourceQuota, an admission webhook, a QoS class change; on a cluster without
in-place resize only at the pod's first refusal): its CPU request and limit stay until a
later plan's resize is taken (neonvm/controller/scaling.py, ``_resize_refused``)."""
SSH_KEY_UNAVAILABLE = "SSHKeyUnavailable"
"""Warning: the API server refused the VM's SSH key Secret (no RBAC rule, the admission
fence, a quota); its runner pod starts without a key (neonvm/controller/ssh_keys.py)."""
