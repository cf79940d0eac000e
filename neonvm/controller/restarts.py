"""Restart backoff: how long a VM whose pod keeps exiting waits before its next plan.

0 s for the first restart, then 1, 2, 4 ... s up to 60 s, counting restarts in a row
(``status.restartStreak``: each within :data:`RESTART_STREAK_WINDOW` of the previous).
A bound on churn, not a safety property; docs/reconciler.md says more.
"""

from __future__ import annotations

import datetime as dt

from neonvm.api import times
from neonvm.api.types import VirtualMachine

RESTART_BACKOFF_BASE = 1.0
"""Seconds of backoff after the second restart; doubled for each further one."""
RESTART_BACKOFF_MAX = 60.0
"""Cap of the restart backoff."""
RESTART_STREAK_WINDOW = 600.0
"""A restart more than this many seconds after the previous one starts a new streak, so
a VM whose pod ran for a while is replaced at once (as the kubelet resets its crash-loop
backoff after ten minutes of running)."""
def next_restart_streak(streak: int, last_restart: str | None, now: str | None, *,
                        self_fenced: bool = False) -> int:
    """The streak after one more restart at ``now`` (RFC 3339; None: no clock).

    A self-fenced replacement (the pod's node was lost and the leader force-deleted the
    pod once its right was surely over) leaves the streak as it is: the node failed, not
    the guest, and a VM whose node is lost twice in ten minutes is replaced at once both
    times (docs/protocol.md, "Self-fencing"). The quiet window applies first, to both: a
    restart more than :data:`RESTART_STREAK_WINDOW` after the previous one starts a new
    streak, so a self-fenced VM that ran quietly waits no old streak's backoff."""
    last, at = times.parse(last_restart), times.parse(now)
    if last is not None and at is not None and (at - last).total_seconds() > (
        RESTART_STREAK_WINDOW
    ):
        return 1
    if self_fenced:
        return streak
    return streak + 1
def restart_backoff(restart_count: int) -> float:
    """Seconds a new plan waits after restart number ``restart_count`` was recorded.

    0 for the first restart, so a deleted pod is replaced at once; then 1, 2, 4, ...
    seconds, at most :data:`RESTART_BACKOFF_MAX`.
    """
    if restart_count <= 1:
        return 0.0
    return min(RESTART_BACKOFF_BASE * 2.0 ** min(restart_count - 2, 32), RESTART_BACKOFF_MAX)


def backoff_remaining(vm: VirtualMachine, now: dt.datetime | None) -> float:
    """Seconds before ``vm`` may be planned again after its last restart (0: now; ``now``
    None: no clock, no backoff)."""
    last = times.parse(vm.status.last_restart_time)
    if now is None or last is None:
        return 0.0
    delay = restart_backoff(vm.status.restart_streak)
    elapsed = (times.utc(now) - last).total_seconds()
    # A clock behind the recorder's (elapsed < 0) waits at most ``delay`` per decision.
    return max(0.0, min(delay, delay - elapsed))
