"""The explorer's ``failover`` fault stands for every way a term ends, so it must stay
enabled wherever the leader is.

The election ends terms in several ways (the renew deadline, deposition, SIGTERM, a
step-down asked by the CLI or by a standby that sees no presence in the locks' etcd, an
etcd refusal). The untimed explorer has no actor for each: they all only end a term,
and ``failover`` (``neonvm/verify/actors.py``, ``_failovers``) ends the leading term at
any step, leaves the old leader acting as a zombie with its old epoch and starts a new
leader at epoch + 1 (docs/verification.md, "The model"). That covers them only while
``failover`` has no guard on the leader's ``pc``; these tests keep it so.
"""

from __future__ import annotations

from collections import deque

import pytest

from neonvm.verify.actors import Actors
from neonvm.verify.model import LEADER, ZOMBIE, World
from neonvm.verify.scenarios import ci_scenarios

pytestmark = pytest.mark.unit

WRITING_PCS = ("idle", "act", "retry", "precreate", "patch", "forcedelete", "sweep")
"""Where the leader's next step writes: the VM lock (idle, sweep), the VM or its status
(act, retry, precreate), a pod (act, patch: the ungate, forcedelete)."""

REACHED_WRITING_PCS = {"idle", "act", "retry", "patch"}
"""The writing pcs the bounded search below reaches (its coverage must not shrink)."""


def _scenario(name: str) -> tuple[Actors, World]:
    scenario = next(s for s in ci_scenarios() if s.name == name)
    return Actors(scenario.config), scenario.world


def _failovers(actors: Actors, w: World) -> list[tuple[int, World]]:
    """Each failover step from ``w``: the index of the old leader, and the state after."""
    return [(step.args[0], after) for step, after in actors.successors(w)
            if step.kind == "failover"]


def _leader(w: World) -> int:
    return next(i for i, x in enumerate(w.workers) if x.role == LEADER)


@pytest.mark.parametrize("pc", WRITING_PCS)
def test_failover_is_enabled_whatever_the_leaders_pc(pc: str) -> None:
    actors, w = _scenario("seed-pod-deleted")
    lead = _leader(w)
    at_pc = w._replace(workers=tuple(x._replace(pc=pc) if i == lead else x
                                     for i, x in enumerate(w.workers)))
    steps = [(step, after) for step, after in actors.adversary_steps(at_pc)
             if step.kind == "failover"]
    assert steps, f"no failover with the leader at {pc}"
    for _step, after in steps:
        old = after.workers[lead]
        assert old.role == ZOMBIE and old.pc == pc and old.epoch == w.workers[lead].epoch
        assert after.epoch == w.epoch + 1


def test_failover_is_enabled_in_every_reached_state_with_a_leader() -> None:
    """A bounded search of the ``create`` scenario (a deposed leader races the leader),
    with a failover in every state's budget: each state with a leader has a failover
    step, which leaves the old leader a zombie at the pc it was at."""
    actors, w0 = _scenario("create")
    w0 = w0._replace(budget=w0.budget._replace(failover=1))
    seen, queue, reached = {w0}, deque([w0]), set()
    while queue and len(seen) < 3000:
        w = queue.popleft()
        leaders = [i for i, x in enumerate(w.workers) if x.role == LEADER]
        if leaders and w.budget.failover:
            lead = leaders[0]
            reached.add(w.workers[lead].pc)
            failovers = _failovers(actors, w)
            assert failovers, f"no failover with the leader at {w.workers[lead].pc}"
            for old, after in failovers:
                assert old == lead
                assert after.workers[lead] == w.workers[lead]._replace(role=ZOMBIE)
        for _step, after in actors.successors(w):
            if after not in seen:
                seen.add(after)
                queue.append(after)
    assert reached >= REACHED_WRITING_PCS, reached
