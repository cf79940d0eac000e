"""The self-fencing explorer: every interleaving, with time and drifting clocks, of a
runner's right to run and the leader's force-delete (docs/protocol.md, "Self-fencing").

The pod explorer (``model``/``actors``/``explore``) has no time: its pods are gone when
the API says so. Self-fencing makes "gone from the API" true again for a pod on a node
that nobody can reach, by time alone, so this model has time. It counts running
*guests*, not pods.

The world: one VM, its runner pod P on a node that may become unreachable, the
replacement Q, and two leader terms.

* **Time** passes in ticks. The leader's monotonic clock advances
  :attr:`Timing.leader_rate` units per tick; P's runner's clock advances one of
  :attr:`Timing.runner_rates` per tick, chosen anew at every tick (so its rate drifts
  within the bound). ``rho`` is the bound on how much faster the leader's clock runs
  than the runner's (leader rate / slowest runner rate - 1), as docs/protocol.md defines
  it. Every other step takes no time: between two ticks anything may happen in any
  order.
* **P's runner** (the shipped :func:`neonvm.runner.right.extended`): sends a request
  for a right at any moment while none is outstanding (more often than every ``D/3``:
  the schedule is the adversary's), reading its clock first (``t0``); takes an answer
  at any later moment, however old (the real runner gives up after ``D/6``; safety must
  not depend on it); may give up on a request at any moment (a timeout, an answer lost).
  It starts QEMU at its first grant (a *fresh* runner has none yet), and each ask says
  whether its guest has started (it has once QEMU runs; a request is never outstanding
  across that start, since the start is the taking of an answer). Its watchdog
  SIGKILLs the guest at the latest one tick after the first tick at which the deadline
  is seen passed (time cannot pass further while the guest runs): ``epsilon`` must cover
  that tick. A killed guest never runs again; its runner exits.
* **The node** may become unreachable (a partition: P's requests and the kubelet's
  reports are lost, the guest and its runner keep running) and reachable again. P stays
  in the API until it is deleted. Once P's runner has exited and the node is reachable,
  the kubelet reports P failed and the ordinary restart removes it. A reachable node's
  kubelet also stops a runner whose pod was deleted, at some later step. The whole node
  may also stop and thaw (``freeze``: its processes stopped, the runner's clock runs on;
  ``suspend``: its clock stops too): nothing of P moves meanwhile and its guest does not
  run; on the thaw a watchdog whose deadline has passed kills before time moves on.
* **The leader** drives the shipped :class:`neonvm.controller.rights.RightsLedger`
  (rebuilt for each step on a clock that reads the model's leader clock): ``grant``
  while its term leads, if P is in the API (the VM's current pod); ``condemn`` while
  P's node is unreachable (conditions 1 and 2 of docs/protocol.md), which tests
  ``max(issued, term_start) + D*(1+rho) + epsilon`` and marks P in one step when the
  test passes; the force-delete is sent then (again, from a fresh read, after a 409) and
  lands at any later step, even after its term ended (one call in flight may overlap
  the next term). With :attr:`FencingConfig.stamp_first_grant` (shipped), a term's
  first grant to an ask that does not say the guest has started writes P first (a new
  resourceVersion, which fails a DELETE decided before it); an ask that says it is
  granted without the write (:attr:`FencingConfig.skip_mark_when_started`), and only a
  write counts as the term's. While P stays condemned the DELETE is sent again whatever its node
  says (the shipped observation reports this term's condemned pods dead). A failover
  ends the term (its leader stops all work: no grant, no new delete) and, at any later
  moment, the next term starts with ``term_start`` = then. Terms alternate between two
  controller processes, A (odd terms) and B (even ones), each with **one ledger for
  life**, as the controller keeps it: what a process marked in its earlier term is
  carried into its next one as the shipped ledger carries it (its ``begin_term`` is
  asked), so a mark that outlives its term is found (a process's earlier grants are
  not carried: they precede the new ``term_start`` and so move nothing).
* **Someone else with P's credential** (budget ``forge``): asks once for P, saying P's
  guest has started, while the leading term has not written P; the grant records
  ``issued[P]`` and its answer is the asker's, not P's runner's.
* **The replacement Q**: once P is gone from the API and a leader leads, Q is created,
  ungated (the quorum list shows it alone) and its runner asks for a right; with a
  grant its guest runs (for ever, here: the worst case for the invariant).

Checked: **at most one running guest** in every state (P's and Q's guests, whatever the
API says; in the freeze scenarios, the weaker :meth:`FencingModel.check_moment`), and,
from every state, once faults stop, a calm run ends with exactly one guest running
(Q's, unless P is reachable, uncondemned and renewed).

Coarser than the real thing: one VM; P's node only (Q's is reachable); a request the
runner gave up on is not processed later (that would record a later ``issued``, which
delays the delete, and could write P and mark it for the term, so that the runner's
next ask before its guest starts is granted with no write of its own: the write still
comes before that grant in the same term, as the argument needs); the leader's cache
is exact (a stale cache can grant a pod already deleted: harmless for a runner whose
guest was killed, not for a fresh one, see docs/verification.md). Time is discrete:
the margins are compared in whole ticks, so a mutant that changes a margin by less
than a tick is invisible here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from neonvm.api.rights import RightGrant
from neonvm.runner.right import extended


@dataclass(frozen=True)
class Timing:
    """Clock units per tick and the right's numbers, all in clock units."""

    seconds: int = 6
    """D."""
    leader_rate: int = 3
    runner_rates: tuple[int, ...] = (2, 3, 4)
    epsilon: int = 4
    """More than one tick of the leader's clock: the watchdog may fire up to one tick
    after the first moment its deadline is seen passed."""

    @property
    def rho(self) -> float:
        return self.leader_rate / min(self.runner_rates) - 1

    @property
    def cap(self) -> int:
        """Leader-clock ages are kept up to this (past it no decision changes)."""
        margin = self.seconds * (1 + self.rho) + self.epsilon
        return -(-int(margin + self.leader_rate) // self.leader_rate) * self.leader_rate


@dataclass(frozen=True)
class Mutants:
    """Deliberate breakages the explorer must catch (docs/verification.md)."""

    no_margin: bool = False
    """(a) The leader deletes at ``max(issued, term_start) + D``: no ``rho``, no
    ``epsilon``."""
    no_rho: bool = False
    """The margin without the clock-rate term: ``+ D + epsilon``."""
    no_epsilon: bool = False
    """The margin without the slack for the kill: ``+ D*(1+rho)``."""
    forget_kill: bool = False
    """(b) The runner's watchdog never kills the guest."""
    test_then_mark: bool = False
    """(c) Condemn's test and its mark are two steps: the DELETE is decided on the test,
    and a grant may be issued between the test and the mark (after the condemn)."""
    ignore_term_start: bool = False
    """(d) The test uses ``issued`` alone (a pod this term never granted is surely
    dead): grants by an earlier term are not waited out."""
    deadline_from_answer: bool = False
    """(e) The runner counts the right from the answer's arrival, not its send time."""
    answer_before_record: bool = False
    """(f) The ledger answers a grant first and records ``issued`` at a later step."""
    marks_outlive_term: bool = False
    """(g) A process's condemn marks survive into its next term (its ledger is not
    cleared by ``begin_term``): another process may have granted the pod in between."""
    skip_mark_always: bool = False
    """(h) The leader grants without writing the pod whatever the ask says (it ignores
    whether the runner's guest has started)."""
    started_early: bool = False
    """(i) The runner says its guest has started in asks sent before QEMU started."""
    grant_is_mark: bool = False
    """(j) The leader takes any grant of its term for the term's write to the pod, also a
    grant made without one (to an ask that said started): a later ask of the pod that
    does not say it then gets no write either."""


@dataclass(frozen=True)
class FencingConfig:
    timing: Timing = Timing()
    mutants: Mutants = Mutants()
    stamp_first_grant: bool = False
    """The fix for a deposed term's DELETE still in flight (docs/protocol.md,
    "Self-fencing"), shipped: a term's first grant to a pod is preceded by a write to the
    pod (a new resourceVersion), and the force-delete carries the resourceVersion of the
    pod as read when it was decided, so one of the two fails. Off by default so that
    ``fence-fresh-failover`` shows the gap it closes."""
    skip_mark_when_started: bool = True
    """Shipped with the write: an ask that says its runner's guest has started (the
    runner says so only after it started QEMU, which it does once) is granted without
    the write (docs/protocol.md, "A deposed leader's delete still in flight"). Only
    matters with ``stamp_first_grant``."""


class Budget(NamedTuple):
    partition: int = 0
    """The node becomes unreachable."""
    heal: int = 0
    """The node becomes reachable again."""
    failover: int = 0
    """The leading term ends; the next starts at any later moment."""
    frozen_grant: int = 0
    """The election's guarantee broken (docs/protocol.md, "A leader whose clock stops"):
    a deposed term's leader, woken from a freeze, grants once more."""
    freeze: int = 0
    """P's whole node stops (SIGSTOP of its processes) and later thaws; the runner's
    monotonic clock counts the time stopped."""
    suspend: int = 0
    """P's whole node stops and later thaws, and the runner's clock does not count the
    time stopped (a suspended machine; ``CLOCK_MONOTONIC``): it breaks the rate bound."""
    forge: int = 0
    """Someone who holds P's credential but is not P's runner asks for P, saying P's
    guest has started (true or not): granted, the answer is the asker's, not P's
    runner's."""


class World(NamedTuple):
    p_runner: bool
    """P's runner is up (it exits once its guest is killed)."""
    p_guest: bool
    """P's guest (QEMU) runs: only after a first grant, never again once killed."""
    p_left: int | None
    """P's deadline minus its runner's clock (runner units); None: no grant yet."""
    overdue: bool
    """P's guest was seen past its deadline at a tick: the watchdog fires before the
    next."""
    p_req: tuple[str, int, bool] | None
    """P's outstanding request: (stage, age of its t0 in runner units, whether it says
    P's guest has started); stage ``sent``, ``granted``, ``refused``."""
    p_in_api: bool
    node_up: bool
    leader: int
    """The leading term (1, 2, 3); 0 between a term's end and the next one's start."""
    last_term: int
    term_since: int
    """Leader-clock units since the leading term began (capped)."""
    issued_since: int | None
    """The leading term's ledger: leader-clock units since it last granted P (capped)."""
    unrecorded: bool
    """Mutant (f): a grant answered and not yet recorded."""
    condemned: bool
    stamped: bool
    """The leading term has written P before its first grant (``stamp_first_grant``)."""
    p_version: int
    """P's resourceVersion, as far as a stamp changes it."""
    delete: tuple[int, int] | None
    """A force-delete of P decided and in flight: (term, P's version when decided)."""
    q: int
    """0: no replacement; 1: Q created and ungated, its runner asking; 2: Q's guest runs."""
    budget: Budget
    frozen: int = 0
    """P's node is stopped: 0 no; 1 with its clock running (``freeze``); 2 with its clock
    stopped (``suspend``). Nothing of P moves, its guest does not run."""
    other_condemned: bool = False
    """The ledger of the process not leading (or whose term is next) shows P condemned
    (from its last term)."""


class Violation(NamedTuple):
    property: str
    message: str


POD = "p-uid"


def initial_world(budget: Budget, t: Timing = Timing(), fresh: bool = False) -> World:
    """P with a right just granted by the leader of term 1, long in office; ``fresh``:
    P's runner has just started and has no right yet (its guest not started)."""
    return World(p_runner=True, p_guest=not fresh, p_left=None if fresh else t.seconds,
                 overdue=False, p_req=None, p_in_api=True, node_up=True, leader=1,
                 last_term=1, term_since=t.cap, issued_since=None if fresh else 0,
                 unrecorded=False, condemned=False, stamped=True, p_version=0,
                 delete=None, q=0, budget=budget)


SCENARIOS: dict[str, tuple[str, bool, Budget]] = {
    "fence-partition": ("P runs; its node is cut off and may come back", False,
                        Budget(partition=1, heal=1)),
    "fence-flaky": ("P runs; its node is cut off, comes back, is cut off again", False,
                    Budget(partition=2, heal=1)),
    "fence-failover": ("P runs; its node is cut off and may come back; a failover at any "
                       "moment", False, Budget(partition=1, heal=1, failover=1)),
    "fence-fresh": ("P's runner has no right yet; its node is cut off and may come back",
                    True, Budget(partition=1, heal=1)),
    "fence-fresh-failover": ("P's runner has no right yet; its node is cut off and may "
                             "come back; a failover (a deposed term's DELETE may land "
                             "late)", True, Budget(partition=1, heal=1, failover=1)),
    "fence-fresh-flap": ("P's runner has no right yet; its node is cut off, comes back, "
                         "is cut off again; two failovers (terms of processes A, B, A, "
                         "each process keeping its ledger)", True,
                         Budget(partition=2, heal=1, failover=2)),
    "fence-fresh-forged": ("P's runner has no right yet; its node is cut off and may come "
                           "back; a failover; someone else with P's credential asks once, "
                           "saying P's guest has started", True,
                           Budget(partition=1, heal=1, failover=1, forge=1)),
    "fence-frozen-leader": ("P runs; its node is cut off and may come back; a failover, and "
                            "the deposed leader grants once after it (a stopped clock)",
                            False, Budget(partition=1, heal=1, failover=1, frozen_grant=1)),
    "fence-freeze": ("P runs; its node is stopped (SIGSTOP: the runner's clock runs on) "
                     "and thawed at any moment", False, Budget(freeze=1)),
    "fence-suspend": ("P runs; its node is suspended (the runner's clock stops) and "
                      "resumed at any moment", False, Budget(suspend=1)),
}
"""name: (what happens, P's runner fresh, budget). The first four hold for the design as
shipped; the others are gaps that docs/protocol.md names ("What is not covered"). The
freeze scenarios are checked against :meth:`FencingModel.check_moment`."""
FREEZES = ("fence-freeze", "fence-suspend")
SHIPPED_SAFE = ("fence-partition", "fence-flaky", "fence-failover", "fence-fresh")


def _cap(v: int, cap: int) -> int:
    return v if v < cap else cap


def _spend(w: World, **kw: int) -> World:
    b = w.budget._asdict()
    for k, v in kw.items():
        b[k] -= v
    return w._replace(budget=Budget(**b))


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FencingModel:
    """The steps of :class:`World` (see the module docstring)."""

    def __init__(self, cfg: FencingConfig = FencingConfig()) -> None:
        self.cfg = cfg
        self.t = cfg.timing
        self.m = cfg.mutants
        self._calm: dict[World, Violation | None] = {}
        self._ledger: dict[tuple[object, ...], object] = {}
        self._keeps: bool | None = None

    def _ledger_keeps_marks(self) -> bool:
        """Whether the shipped ledger still shows a pod condemned in a process's earlier
        term once its next term has begun (or the mutant says so)."""
        if self.m.marks_outlive_term:
            return True
        if self._keeps is None:
            from neonvm.controller.rights import RightsLedger

            clock = _Clock()
            ledger = RightsLedger(clock)
            ledger.begin_term(lambda: True)
            clock.now = 1e9
            assert ledger.condemn(POD, float(self.t.seconds)) == 0.0
            ledger.end_term()
            clock.now = 2e9
            ledger.begin_term(lambda: True)
            self._keeps = ledger.is_condemned(POD)
        return self._keeps

    # ---- the shipped ledger -----------------------------------------------------------

    def _with_ledger(self, w: World, op: str) -> object:
        """Run ``op`` (``grant``, ``is_condemned`` or ``condemn``) on the shipped
        :class:`~neonvm.controller.rights.RightsLedger` rebuilt in the state ``w``
        describes (the leader's clock reads 0 now): a term begun ``term_since`` ago,
        P granted ``issued_since`` ago, or condemned."""
        key = (op, w.term_since, w.issued_since, w.condemned)
        if key in self._ledger:
            return self._ledger[key]
        from neonvm.controller.rights import RightsLedger

        t, m = self.t, self.m
        rho = 0.0 if (m.no_margin or m.no_rho) else t.rho
        eps = 0.0 if (m.no_margin or m.no_epsilon) else float(t.epsilon)
        clock = _Clock()
        ledger = RightsLedger(clock, rho=rho, epsilon=eps)
        clock.now = -float(w.term_since)
        ledger.begin_term(lambda: True)
        if w.issued_since is not None:
            clock.now = -float(w.issued_since)
            assert ledger.grant(POD, t.seconds) is None
        if w.condemned:
            clock.now = 1e9
            assert ledger.condemn(POD, t.seconds) == 0.0
        clock.now = 0.0
        result: object
        if op == "grant":
            result = ledger.grant(POD, t.seconds)
        elif op == "is_condemned":
            result = ledger.is_condemned(POD)
        elif m.ignore_term_start and w.issued_since is None and not w.condemned:
            result = 0.0
        else:
            result = ledger.condemn(POD, t.seconds)
        self._ledger[key] = result
        return result

    # ---- every step -----------------------------------------------------------------

    def successors(self, w: World) -> Iterator[tuple[str, World]]:
        t, m, b = self.t, self.m, w.budget
        req = w.p_req
        # P's runner (nothing of it moves while its node is stopped).
        if w.p_runner and not w.frozen:
            if req is None:
                says = w.p_guest or m.started_early
                yield ("P's runner asks for a right (t0 read)"
                       + ("; the ask says its guest has started" if says else ""),
                       w._replace(p_req=("sent", 0, says)))
            else:
                yield (f"P's runner gives up on its request ({req[0]})",
                       w._replace(p_req=None))
                if req[0] in ("granted", "refused"):
                    yield self._answer(w)
            if w.p_guest and w.p_left is not None and w.p_left <= 0 and not m.forget_kill:
                yield ("P's watchdog: deadline passed, SIGKILL the guest; the runner exits",
                       w._replace(p_runner=False, p_guest=False, p_left=None,
                                  overdue=False, p_req=None))
        # The leader's side of P's request (only over a reachable node's network).
        if req is not None and req[0] == "sent" and w.node_up and not w.frozen:
            yield self._grant(w)
            if b.frozen_grant and w.leader != 1 and w.p_in_api:
                yield ("the deposed leader of term 1 wakes from a freeze and grants P "
                       "(belief left on its stopped clock)",
                       _spend(w, frozen_grant=1)._replace(p_req=("granted", *req[1:])))
        # Only while the term has not written P: after the write, the forged grant's one
        # effect is a later issued[P], which only delays the condemn.
        if (b.forge and w.leader and w.p_in_api and not w.stamped
                and self._with_ledger(w, "grant") is None):
            forged = _spend(w, forge=1)
            if (self.cfg.stamp_first_grant and not w.stamped
                    and not (self.cfg.skip_mark_when_started or m.skip_mark_always)):
                forged = forged._replace(stamped=True, p_version=w.p_version + 1)
            yield (f"someone with P's credential, not its runner, asks saying P's guest has "
                   f"started: leader (term {w.leader}) records issued[P] = now and grants "
                   f"(the answer is the asker's)",
                   forged._replace(issued_since=0, stamped=forged.stamped or m.grant_is_mark))
        if w.unrecorded and w.leader:
            yield ("leader: records issued[P] = now (after its answer)",
                   w._replace(issued_since=0, unrecorded=False))
        # Condemn and force-delete: P's node unreachable (conditions 1 and 2).
        if w.leader and w.p_in_api and w.delete is None and w.condemned:
            yield (f"leader (term {w.leader}): P condemned: DELETE grace 0 sent again "
                   f"(from a fresh read)", w._replace(delete=(w.leader, w.p_version)))
        elif (w.leader and w.p_in_api and w.delete is None and not w.node_up
              and self._with_ledger(w, "condemn") == 0.0):
            if m.test_then_mark:
                yield (f"leader (term {w.leader}): condemn's test passes; DELETE sent "
                       f"(not yet marked)", w._replace(delete=(w.leader, w.p_version)))
            else:
                yield (f"leader (term {w.leader}): condemn P (issued {w.issued_since} "
                       f"ago, term {w.term_since} ago); DELETE grace 0 sent",
                       w._replace(condemned=True, delete=(w.leader, w.p_version)))
        if (m.test_then_mark and w.delete is not None and w.delete[0] == w.leader
                and not w.condemned):
            yield "leader: marks P condemned", w._replace(condemned=True)
        if w.delete is not None and w.p_in_api:
            term, version = w.delete
            if version == w.p_version:
                yield (f"the DELETE of P (term {term}) lands: P gone from the API",
                       w._replace(p_in_api=False, delete=None))
            else:
                yield (f"the DELETE of P (term {term}) lands: 409, P was written since",
                       w._replace(delete=None))
        # The node and the kubelet.
        if w.node_up and w.p_in_api and not w.p_runner:
            yield ("kubelet: P's runner exited, pod Failed; the restart removes it",
                   w._replace(p_in_api=False, delete=None))
        if w.node_up and not w.p_in_api and w.p_runner:
            yield ("kubelet: P was deleted from the API: it stops P",
                   w._replace(p_runner=False, p_guest=False, p_left=None, overdue=False,
                              p_req=None))
        if w.node_up and not w.frozen and (b.freeze or b.suspend):
            for kind, allowed in ((1, b.freeze), (2, b.suspend)):
                if allowed:
                    what = "SIGSTOP" if kind == 1 else "suspend: its clocks stop too"
                    yield (f"fault: P's whole node stops ({what})", _spend(
                        w, freeze=int(kind == 1), suspend=int(kind == 2))._replace(
                            frozen=kind, node_up=False))
        if w.frozen:
            due = w.p_guest and w.p_left is not None and w.p_left <= 0
            yield ("P's node thaws" + (": the watchdog finds the deadline passed" if due
                                       else ""),
                   w._replace(frozen=0, node_up=True, overdue=due))
        if w.node_up and b.partition:
            yield "fault: P's node is cut off", _spend(w, partition=1)._replace(node_up=False)
        if not w.node_up and b.heal:
            yield "P's node is reachable again", _spend(w, heal=1)._replace(node_up=True)
        # Leadership.
        if w.leader and b.failover:
            yield (f"failover: term {w.leader} ends (its leader stops all work; a DELETE "
                   f"already sent stays in flight)",
                   _spend(w, failover=1)._replace(leader=0, unrecorded=False))
        if w.leader == 0:
            term = w.last_term + 1
            carried = w.other_condemned and self._ledger_keeps_marks()
            yield (f"term {term} begins (process {'AB'[(term - 1) % 2]}"
                   f"{': its mark on P from its last term kept' if carried else ''}), "
                   f"term_start = now",
                   w._replace(leader=term, last_term=term, term_since=0, issued_since=None,
                              condemned=carried, other_condemned=w.condemned,
                              stamped=False))
        # The replacement.
        if not w.p_in_api and w.q == 0 and w.leader:
            yield ("leader: restart, plan, create Q gated; the quorum list shows Q alone: "
                   "ungate; Q's runner asks", w._replace(q=1))
        if w.q == 1 and w.leader:
            yield "leader grants Q; Q's guest starts", w._replace(q=2)
        # Time.
        if not (w.p_guest and w.overdue and not m.forget_kill):
            for rate in (0,) if w.frozen == 2 else t.runner_rates:
                yield (f"tick (P's clock +{rate}, the leader's +{t.leader_rate})",
                       self._tick(w, rate))

    def _answer(self, w: World) -> tuple[str, World]:
        assert w.p_req is not None
        stage, age, _ = w.p_req
        if stage == "refused":
            return "P's runner takes the refusal", w._replace(p_req=None)
        d = self.t.seconds
        if self.m.deadline_from_answer:
            left = d if w.p_left is None else max(w.p_left, d)
        else:
            new = extended(None if w.p_left is None else float(w.p_left), float(-age),
                           RightGrant(seconds=d), d)
            assert new is not None and new == int(new)
            left = int(new)
        start = not w.p_guest and left > 0
        what = f"deadline now {left} ahead" + ("; QEMU starts" if start else "")
        return (f"P's runner takes the grant: {what}",
                w._replace(p_left=left, p_req=None, p_guest=w.p_guest or start,
                           overdue=w.overdue and left <= 0))

    def _grant(self, w: World) -> tuple[str, World]:
        """The leader's handler for P's request (the shipped ledger's ``grant``)."""
        assert w.p_req is not None
        _, age, says = w.p_req
        if not w.leader:
            return "no leader: 503 NotLeader", w._replace(p_req=("refused", age, says))
        if not w.p_in_api:
            return "leader: 403 NotCurrentPod", w._replace(p_req=("refused", age, says))
        if self._with_ledger(w, "is_condemned"):  # as the shipped service: before any write
            return "leader: 403 Condemned (no write)", w._replace(p_req=("refused", age, says))
        skip = self.m.skip_mark_always or (says and self.cfg.skip_mark_when_started)
        if self.cfg.stamp_first_grant and not w.stamped and not skip:
            return (f"leader (term {w.leader}): writes P before its first grant in this "
                    f"term (a new resourceVersion)",
                    w._replace(stamped=True, p_version=w.p_version + 1))
        refused = self._with_ledger(w, "grant")
        if refused is not None:
            return f"leader: 403 {refused}", w._replace(p_req=("refused", age, says))
        unwritten = ("" if not self.cfg.stamp_first_grant or w.stamped
                     else " (no write: the ask says started)" if says
                     else " (no write)")
        stamped = w.stamped or self.m.grant_is_mark
        if self.m.answer_before_record:
            return (f"leader (term {w.leader}): grants P (not yet recorded){unwritten}",
                    w._replace(p_req=("granted", age, says), unrecorded=True,
                               stamped=stamped))
        return (f"leader (term {w.leader}): records issued[P] = now, grants P{unwritten}",
                w._replace(issued_since=0, p_req=("granted", age, says), stamped=stamped))

    def _tick(self, w: World, rate: int) -> World:
        t = self.t
        cap = t.cap
        req = w.p_req
        left = w.p_left
        return w._replace(
            p_left=max(left - rate, -1) if left is not None else None,
            overdue=not w.frozen and w.p_guest and left is not None and left <= 0,
            p_req=(req[0], min(req[1] + rate, t.seconds), req[2]) if req is not None else None,
            term_since=_cap(w.term_since + t.leader_rate, cap),
            issued_since=(_cap(w.issued_since + t.leader_rate, cap)
                          if w.issued_since is not None else None))

    # ---- properties -----------------------------------------------------------------

    @staticmethod
    def check(w: World) -> Violation | None:
        if w.p_guest and not w.frozen and w.q == 2:
            return Violation("at-most-one-running-guest",
                             f"P's guest (deadline {w.p_left} ahead, pod "
                             f"{'in the API' if w.p_in_api else 'gone from the API'}) and "
                             f"Q's guest both run")
        return None

    @staticmethod
    def check_moment(w: World) -> Violation | None:
        """The weaker property of the freeze scenarios: two guests may run together only
        for the moment between a thaw and the watchdog's kill of a guest past its
        deadline (time cannot pass then); any other overlap is a violation."""
        if w.p_guest and not w.frozen and w.q == 2 and not (
                w.overdue and w.p_left is not None and w.p_left <= 0):
            return Violation("two-guests-past-a-moment",
                             f"P's guest (deadline {w.p_left} ahead) and Q's guest run on "
                             f"together")
        return None

    @staticmethod
    def settled(w: World) -> bool:
        if w.q == 2:
            return not w.p_guest
        return (w.p_guest and w.node_up and w.p_in_api and not w.condemned
                and w.delete is None)

    def converges(self, w: World, max_steps: int = 200) -> Violation | None:
        """Faults stop (the node stays as it is, a deposed term's DELETE is dropped, a
        term begins if none leads): a run must end with one guest, Q's unless P is
        reachable, uncondemned and renewed."""
        delete = w.delete if w.delete is not None and w.delete[0] == w.leader else None
        s = w._replace(budget=Budget(), delete=delete)
        if s in self._calm:
            return self._calm[s]
        start = s
        for _ in range(max_steps):
            if self.settled(s):
                break
            # The runner asks only while its node is reachable and its guest has not
            # started (a running guest there is settled, or condemned: asking changes
            # nothing), and last; it gives up on what its cut-off node cannot deliver.
            # The first other step is taken; time passes only when nothing else can.
            steps = [(text, nxt) for text, nxt in self.successors(s)
                     if not text.startswith("P's runner gives up")]
            if not s.node_up or s.p_guest:
                steps = [x for x in steps if not x[0].startswith("P's runner asks")]
            if s.p_req is not None and s.p_req[0] == "sent" and not s.node_up:
                steps.insert(0, ("give up", s._replace(p_req=None)))
            untimed = sorted((x for x in steps if not x[0].startswith("tick")),
                             key=lambda x: x[0].startswith("P's runner asks"))
            pick = untimed[0] if untimed else next(
                (x for x in steps if x[0].startswith("tick")), None)
            if pick is None:
                break
            s = pick[1]
        verdict = None if self.settled(s) else Violation(
            "converges", f"no single guest after a calm run: {s}")
        self._calm[start] = verdict
        return verdict


@dataclass
class FencingReport:
    scenario: str
    states: int = 0
    transitions: int = 0
    complete: bool = False
    violation: Violation | None = None
    trace: list[str] = field(default_factory=list)


def explore_fencing(scenario: str, cfg: FencingConfig = FencingConfig(), *,
                    liveness: bool = True, max_states: int = 500_000,
                    moment: bool | None = None) -> FencingReport:
    """Breadth-first over every interleaving of ``scenario``; stops at the first
    violation (its trace is a shortest one). ``moment``: check
    :meth:`FencingModel.check_moment` instead of :meth:`FencingModel.check` (default:
    for the freeze scenarios only)."""
    _, fresh, budget = SCENARIOS[scenario]
    model = FencingModel(cfg)
    if moment is None:
        moment = scenario in FREEZES
    check = model.check_moment if moment else model.check
    start = initial_world(budget, cfg.timing, fresh)
    parents: dict[World, tuple[World, str] | None] = {start: None}
    queue: deque[World] = deque([start])
    report = FencingReport(scenario)

    def trace(s: World, last: str | None) -> list[str]:
        steps = [last] if last is not None else []
        at = parents[s]
        while at is not None:
            s, step = at
            steps.append(step)
            at = parents[s]
        return steps[::-1]

    while queue:
        s = queue.popleft()
        report.states += 1
        if liveness:
            v = model.converges(s)
            if v is not None:
                report.violation, report.trace = v, trace(s, "(calm run)")
                return report
        for step, nxt in model.successors(s):
            report.transitions += 1
            if nxt in parents:
                continue
            parents[nxt] = (s, step)
            v = check(nxt)
            if v is not None:
                report.violation, report.trace = v, trace(nxt, None)
                return report
            if len(parents) >= max_states:
                return report
            queue.append(nxt)
    report.complete = True
    return report
